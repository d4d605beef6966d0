"""What the master records: segments, objects and their replicas."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from ._allocator import FreeListAllocator

PENDING = "pending"
COMPLETE = "complete"
#: How many keys of objects lost with their segments are remembered, to explain later reads.
LOST_KEYS_KEPT = 10_000
#: How many removed objects are remembered (by key and the put that wrote them), so that a segment that was away
#: when they were removed, and offers them back, does not bring them back.
REMOVED_KEPT = 100_000


@dataclass
class Segment:
    segment_id: str
    address: str
    size: int
    shm_path: str
    host_id: str
    allocator: FreeListAllocator
    last_heartbeat: float
    public_key: str = ""
    #: ``host:port`` of the segment's reader sockets (read_ranges and ping only); empty for older segments.
    read_addresses: tuple[str, ...] = ()
    #: Bumped whenever the set of complete objects with a replica here changes; the segment compares it with
    #: the version of its catalogue and fetches the catalogue when they differ. It starts at a random point: a
    #: master that restarted (or dropped the segment) must never hand out a version the segment's catalogue of an
    #: earlier list already carries, or the segment would keep that list.
    catalog_version: int = field(default_factory=lambda: secrets.randbits(48))
    #: The secret of the segment's current registration (tickets are MACs under it). Empty for a segment
    #: restored from the journal: nothing is allocated on it until it registers with this master again.
    write_key: bytes = b""
    #: Id of the current registration (heartbeats carry it; another one means the segment registered again).
    registration: str = ""
    #: Put ids fenced on this segment and not yet acknowledged: sent with every heartbeat reply.
    fences: set = field(default_factory=set)
    #: Ranges ``(offset, size)`` the segment reports as still written by a live writer of a fenced put (straight
    #: into its file): reserved until the segment stops reporting them.
    held: set = field(default_factory=set)
    #: Whether same-host clients may write into the segment's file (a file of this process only: shared memory).
    direct_writes: bool = False
    #: Registered with this master (not only restored from its journal): space may be allocated here.
    confirmed: bool = True
    #: Lost objects whose bytes this segment may still hold, by key -> (offset, size): reserved while the segment
    #: checks them against their checksums (it was asked to at registration and answers with ``offer_objects``).
    verifying: dict = field(default_factory=dict)
    #: Objects a replayed journal places here that the segment's catalogue did not list at its first registration
    #: since, by key -> (offset, size, generation): it is asked whether it still holds them (its catalogue may lag a
    #: publication; or the journal lost the records of their remove), and those it does not are dropped here.
    doubtful: dict = field(default_factory=dict)
    #: Why the segment takes no new puts now, as its heartbeats say (a durable segment that cannot write its
    #: catalogue); "" while it takes them. Nothing is placed on it meanwhile.
    refusing: str = ""

    @property
    def takes_puts(self) -> bool:
        """Whether new puts (and copies) may be placed here: registered with this master and not refusing them."""
        return self.confirmed and not self.refusing

    def describe(self) -> dict:
        return {
            "segment_id": self.segment_id,
            "address": self.address,
            "size": self.size,
            "used": self.allocator.used,
            "shm_path": self.shm_path,
            "host_id": self.host_id,
            "read_addresses": list(self.read_addresses),
            "confirmed": self.confirmed,
            "catalog": self.catalog_version,
            "fencing": len(self.fences),
            "held_bytes": sum(size for _, size in self.held),
            "refusing_puts": self.refusing,
        }


@dataclass
class Replica:
    segment_id: str
    offset: int
    #: The id of the put whose ticket wrote these bytes (segments learn it from the ticket, so a read naming it
    #: is refused once another put has written the range); 0 where it is not known (offered back by an older
    #: segment), and then segments do not check it.
    generation: int = 0

    def record(self) -> list:
        return [self.segment_id, self.offset, self.generation]


@dataclass
class LostObject:
    """An acknowledged object whose every replica was on segments that were dropped: remembered with where its
    bytes were, so a segment that comes back with them intact (verified against the checksum) restores it."""
    message: str
    size: int
    replica_num: int
    checksum: str
    places: list[Replica]

    def record(self, key: str) -> dict:
        return {"op": "lost", "key": key, "message": self.message, "size": self.size,
                "replica_num": self.replica_num, "checksum": self.checksum,
                "places": [r.record() for r in self.places]}


@dataclass
class ObjectMeta:
    size: int
    replica_num: int
    replicas: list[Replica]
    state: str
    lease_until: float = 0.0
    started: float = 0.0
    #: The put that is writing a pending object (its tickets name it); 0 for complete objects.
    put_id: int = 0
    #: When the writer last said it is still writing (put_start or put_renew); a pending put silent for longer
    #: than ``put_timeout_s`` is fenced.
    renewed: float = 0.0
    #: xxh3_64 of the object's bytes (hex) as its writer computed them; empty if it gave none.
    checksum: str = ""


def some_keys(keys: list[str], shown: int = 5) -> str:
    """``": 'a', 'b', ... (n more)"`` for log lines that name the keys they count."""
    if not keys:
        return ""
    more = f", ... ({len(keys) - shown} more)" if len(keys) > shown else ""
    return ": " + ", ".join(map(repr, keys[:shown])) + more
