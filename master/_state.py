"""The master's metadata: segments, objects, placement, leases and liveness. No sockets, no files.

Every change that must survive a restart is handed to ``journal`` (a callable taking one record dict), so
the state can be rebuilt by :meth:`MasterState.replay`. Pending puts are not journalled: after a restart a
write that had not reached ``put_end`` is absent, never half visible.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from engram_store._errors import (
    InvalidArgument,
    LeaseActive,
    ObjectExists,
    ObjectLost,
    ObjectNotFound,
    OutOfSpace,
)

from ._allocator import FreeListAllocator

log = logging.getLogger(__name__)

PENDING = "pending"
COMPLETE = "complete"
#: How many keys of objects lost with their segments are remembered, to explain later reads.
LOST_KEYS_KEPT = 10_000


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
    #: Bumped whenever the set of complete objects with a replica here changes; a durable segment compares
    #: it with the version of its manifest and fetches its catalogue when they differ.
    catalog_version: int = 0

    def describe(self) -> dict:
        return {
            "segment_id": self.segment_id,
            "address": self.address,
            "size": self.size,
            "used": self.allocator.used,
            "shm_path": self.shm_path,
            "host_id": self.host_id,
            "read_addresses": list(self.read_addresses),
        }


@dataclass
class Replica:
    segment_id: str
    offset: int


@dataclass
class ObjectMeta:
    size: int
    replica_num: int
    replicas: list[Replica]
    state: str
    lease_until: float = 0.0
    started: float = 0.0


@dataclass
class RepairJob:
    """A copy of one object onto a segment that lacks it (the target space is reserved)."""
    key: str
    meta: ObjectMeta
    source_address: str
    source_offset: int
    target_id: str
    target_address: str
    target_offset: int
    size: int


@dataclass
class MasterState:
    lease_ttl_s: float = 5.0
    heartbeat_timeout_s: float = 10.0
    #: A put not finished within this many seconds is revoked and its space freed.
    put_timeout_s: float = 600.0
    #: Space of a removed object becomes allocatable again only after this delay, so a reader still using a
    #: placement it resolved just before the remove reads the old bytes, never another object's.
    reuse_delay_s: float = 2.0
    journal: Callable[[dict], None] = lambda record: None
    clock: Callable[[], float] = time.monotonic
    segments: dict[str, Segment] = field(default_factory=dict)
    objects: dict[str, ObjectMeta] = field(default_factory=dict)
    lost: OrderedDict = field(default_factory=OrderedDict)
    #: Freed blocks waiting out ``reuse_delay_s``: (time allocatable, allocator, offset, size), oldest first.
    quarantine: deque = field(default_factory=deque)

    # ---- segments -------------------------------------------------------------------------------

    def register_segment(
        self, segment_id: str, address: str, size: int, shm_path: str, host_id: str, public_key: str = "",
        objects: list[tuple[str, int, int, int]] | None = None, read_addresses: tuple[str, ...] = (),
    ) -> bool:
        """Add a segment (or refresh a known one); returns True when it was already known.

        ``read_addresses`` are the segment's reader sockets (they change when it restarts, so a known
        segment's are replaced).

        ``objects`` is what a durable segment's manifest says it holds, as ``(key, offset, size, replica_num)``.
        They are adopted only when this master does not know the segment (it lost its state, or dropped the
        segment while it was down): a known segment's objects are the ones this master recorded, which
        already include every write and every remove.
        """
        now = self.clock()
        known = self.segments.get(segment_id)
        if known is not None:
            if known.size != size:
                raise InvalidArgument(
                    f"segment {segment_id}: registered with size {known.size}, now claims {size}"
                )
            known.address, known.shm_path, known.host_id = address, shm_path, host_id
            known.public_key = public_key
            known.read_addresses = tuple(read_addresses)
            known.last_heartbeat = now
        else:
            self.segments[segment_id] = Segment(
                segment_id, address, size, shm_path, host_id, FreeListAllocator(size), now, public_key,
                tuple(read_addresses),
            )
            log.info("segment %s registered at %s (%d bytes, %d reader sockets)", segment_id, address, size,
                     len(read_addresses))
        self.journal({"op": "segment", "segment_id": segment_id, "address": address, "size": size,
                      "shm_path": shm_path, "host_id": host_id, "public_key": public_key,
                      "read_addresses": list(read_addresses)})
        if known is None and objects:
            self._adopt(self.segments[segment_id], objects)
        return known is not None

    def _adopt(self, segment: Segment, objects: list[tuple[str, int, int, int]]) -> None:
        adopted = skipped = 0
        for key, offset, size, replica_num in objects:
            meta = self.objects.get(key)
            if meta is not None and (meta.state != COMPLETE or meta.size != size):
                log.warning("segment %s holds %r (%d bytes) but this master has another object under that key; "
                            "ignoring the segment's copy", segment.segment_id, key, size)
                skipped += 1
                continue
            if not segment.allocator.reserve(offset, size):
                log.warning("segment %s: %r at offset %d overlaps another object; ignoring it",
                            segment.segment_id, key, offset)
                skipped += 1
                continue
            if meta is None:
                meta = self.objects[key] = ObjectMeta(size, max(1, replica_num), [], COMPLETE)
                self.lost.pop(key, None)
            meta.replicas.append(Replica(segment.segment_id, offset))
            self._journal_object(key, meta)
            adopted += 1
        segment.catalog_version += 1
        log.info("segment %s: adopted %d object(s) from its manifest, ignored %d", segment.segment_id, adopted,
                 skipped)

    def segment_objects(self, segment_id: str) -> tuple[int, list[list]]:
        """``(catalog_version, [[key, offset, size, replica_num], ...])`` of the complete objects on a segment."""
        segment = self.segments.get(segment_id)
        if segment is None:
            raise ObjectNotFound(f"segment {segment_id} is not registered")
        held = [[key, r.offset, m.size, m.replica_num] for key, m in self.objects.items() if m.state == COMPLETE
                for r in m.replicas if r.segment_id == segment_id]
        return segment.catalog_version, held

    def _touch(self, meta: ObjectMeta) -> None:
        for replica in meta.replicas:
            segment = self.segments.get(replica.segment_id)
            if segment is not None:
                segment.catalog_version += 1

    def _journal_object(self, key: str, meta: ObjectMeta) -> None:
        self.journal({"op": "object", "key": key, "size": meta.size, "replica_num": meta.replica_num,
                      "replicas": [[r.segment_id, r.offset] for r in meta.replicas]})

    def heartbeat(self, segment_id: str) -> bool:
        segment = self.segments.get(segment_id)
        if segment is None:
            return False
        segment.last_heartbeat = self.clock()
        return True

    def drop_segment(self, segment_id: str, reason: str) -> int:
        """Forget a segment and every replica on it; returns how many objects lost their last replica."""
        segment = self.segments.pop(segment_id, None)
        if segment is None:
            return 0
        lost = 0
        for key in list(self.objects):
            meta = self.objects[key]
            kept = [r for r in meta.replicas if r.segment_id != segment_id]
            if len(kept) == len(meta.replicas):
                continue
            if meta.state == PENDING:
                self._release(key, meta)  # a write that cannot complete as asked
                continue
            meta.replicas = kept
            if not kept:
                del self.objects[key]
                self._remember_lost(key, f"object {key!r} was lost: its last replica was on segment "
                                         f"{segment_id} at {segment.address}, which {reason}")
                lost += 1
        log.warning("segment %s at %s dropped (%s); %d objects lost", segment_id, segment.address, reason, lost)
        self.journal({"op": "drop_segment", "segment_id": segment_id, "reason": reason})
        return lost

    def expire_segments(self, running_gap_s: float = 0.0) -> list[str]:
        """Drop segments whose last heartbeat is older than the timeout; returns their ids.

        ``running_gap_s`` is time the master itself was not running (stalled or paused) since the
        previous check; it is credited to every segment so a master stall never kills live segments.
        """
        now = self.clock()
        if running_gap_s > 0:
            for segment in self.segments.values():
                segment.last_heartbeat += running_gap_s
        dead = [s.segment_id for s in self.segments.values()
                if now - s.last_heartbeat > self.heartbeat_timeout_s]
        for segment_id in dead:
            self.drop_segment(segment_id, f"missed heartbeats for over {self.heartbeat_timeout_s:g} s")
        return dead

    def expire_puts(self) -> list[str]:
        now = self.clock()
        stale = [k for k, m in self.objects.items() if m.state == PENDING and now - m.started > self.put_timeout_s]
        for key in stale:
            log.warning("put of %r not finished within %g s; revoked", key, self.put_timeout_s)
            self._release(key, self.objects[key])
        return stale

    # ---- objects --------------------------------------------------------------------------------

    def put_start(self, key: str, size: int, replica_num: int) -> list[tuple[Segment, int]]:
        """Reserve space for ``replica_num`` replicas on distinct segments; the object stays invisible."""
        if key in self.objects:
            state = self.objects[key].state
            raise ObjectExists(f"key {key!r} already exists" + (" (a write is in progress)" if state == PENDING else ""))
        if replica_num < 1:
            raise InvalidArgument(f"replica_num: expected >= 1, got {replica_num}")
        self.release_quarantine()
        if replica_num > len(self.segments):
            raise OutOfSpace(
                f"put {key!r}: replica_num={replica_num} needs {replica_num} distinct segments, "
                f"but {len(self.segments)} are registered"
            )
        # Most free space first spreads objects over segments; ties broken by id for determinism.
        candidates = sorted(self.segments.values(), key=lambda s: (-s.allocator.free_bytes, s.segment_id))
        placed: list[tuple[Segment, int]] = []
        for segment in candidates:
            offset = segment.allocator.allocate(size)
            if offset is not None:
                placed.append((segment, offset))
                if len(placed) == replica_num:
                    break
        if len(placed) < replica_num:
            for segment, offset in placed:
                segment.allocator.free(offset, size)
            largest = max((s.allocator.largest_free() for s in self.segments.values()), default=0)
            waiting = self.quarantined_bytes()
            raise OutOfSpace(
                f"put {key!r}: no room for {replica_num} replica(s) of {size} bytes on distinct segments "
                f"(largest free block: {largest} bytes over {len(self.segments)} segments"
                + (f"; {waiting} bytes of removed objects become free within {self.reuse_delay_s:g} s)"
                   if waiting else ")")
            )
        self.lost.pop(key, None)
        self.objects[key] = ObjectMeta(size, replica_num, [Replica(s.segment_id, o) for s, o in placed],
                                       PENDING, started=self.clock())
        return placed

    def put_end(self, key: str) -> None:
        meta = self.objects.get(key)
        if meta is None:
            raise ObjectNotFound(f"put_end {key!r}: no write in progress (revoked, timed out, or never started)")
        if meta.state == COMPLETE:
            return
        meta.state = COMPLETE
        self._touch(meta)
        self._journal_object(key, meta)

    def put_revoke(self, key: str) -> None:
        meta = self.objects.get(key)
        if meta is None:
            return
        if meta.state != PENDING:
            raise InvalidArgument(f"put_revoke {key!r}: the object is complete; use remove")
        self._release(key, meta)

    def get(self, key: str, lease: bool = True) -> ObjectMeta:
        meta = self.objects.get(key)
        if meta is None or meta.state != COMPLETE:
            if key in self.lost:
                raise ObjectLost(self.lost[key])
            raise ObjectNotFound(f"no object under key {key!r}")
        if lease:
            meta.lease_until = max(meta.lease_until, self.clock() + self.lease_ttl_s)
        return meta

    def exists(self, key: str) -> bool:
        meta = self.objects.get(key)
        return meta is not None and meta.state == COMPLETE

    def remove(self, key: str, force: bool = False) -> None:
        """Remove a complete object. Removing a lost one (its data died with its segments) forgets the loss,
        so the key reads as absent again, as ``exists`` already says, and can be written anew."""
        meta = self.objects.get(key)
        if meta is None and key in self.lost:
            del self.lost[key]
            self.journal({"op": "remove", "key": key})
            return
        if meta is None or meta.state != COMPLETE:
            raise ObjectNotFound(f"remove: no object under key {key!r}")
        remaining = meta.lease_until - self.clock()
        if remaining > 0 and not force:
            raise LeaseActive(f"remove {key!r}: a read lease is live for {remaining:.2f} s more; pass force=True")
        self._release(key, meta)
        self.journal({"op": "remove", "key": key})

    def remove_all(self, force: bool = False) -> tuple[int, int]:
        """Remove every complete object (and forget every lost one); returns (removed, refused by a lease)."""
        removed = refused = 0
        if self.lost:
            self.lost.clear()
            self.journal({"op": "forget_lost"})
        for key in [k for k, m in self.objects.items() if m.state == COMPLETE]:
            try:
                self.remove(key, force)
                removed += 1
            except LeaseActive:
                refused += 1
        return removed, refused

    def _release(self, key: str, meta: ObjectMeta) -> None:
        """Forget an object. A complete one's space is quarantined (readers may hold its placement); a
        pending one's is free at once (no reader was ever told where it is)."""
        complete = meta.state == COMPLETE
        if complete:
            self._touch(meta)
        reusable_at = self.clock() + self.reuse_delay_s
        for replica in meta.replicas:
            segment = self.segments.get(replica.segment_id)
            if segment is None:
                continue
            if complete and self.reuse_delay_s > 0 and meta.size:
                self.quarantine.append((reusable_at, segment.allocator, replica.offset, meta.size))
            else:
                segment.allocator.free(replica.offset, meta.size)
        del self.objects[key]

    def release_quarantine(self) -> int:
        """Return quarantined blocks whose delay is over to their allocators; returns how many."""
        now = self.clock()
        live = {id(s.allocator) for s in self.segments.values()}
        released = 0
        while self.quarantine and self.quarantine[0][0] <= now:
            _, allocator, offset, size = self.quarantine.popleft()
            if id(allocator) in live:  # a dropped segment's allocator is gone with it
                allocator.free(offset, size)
            released += 1
        return released

    def quarantined_bytes(self, segment_id: str | None = None) -> int:
        allocator = self.segments[segment_id].allocator if segment_id is not None else None
        return sum(size for _, a, _, size in self.quarantine if allocator is None or a is allocator)

    def _remember_lost(self, key: str, message: str) -> None:
        self.lost[key] = message
        while len(self.lost) > LOST_KEYS_KEPT:
            self.lost.popitem(last=False)

    # ---- re-replication -------------------------------------------------------------------------

    def plan_repairs(self, busy: set[str], limit: int) -> list["RepairJob"]:
        """Reserve space for copies of objects below their replica count.

        Returns up to ``limit`` jobs, skipping keys in ``busy`` (copies in flight). Each job's target space
        stays reserved until :meth:`finish_repair`.
        """
        self.release_quarantine()
        jobs = []
        for key, meta in self.objects.items():
            if len(jobs) >= limit:
                break
            if meta.state != COMPLETE or len(meta.replicas) >= meta.replica_num or key in busy or not meta.replicas:
                continue
            holders = {r.segment_id for r in meta.replicas}
            candidates = sorted((s for s in self.segments.values() if s.segment_id not in holders),
                                key=lambda s: (-s.allocator.free_bytes, s.segment_id))
            for target in candidates:
                offset = target.allocator.allocate(meta.size)
                if offset is not None:
                    source = meta.replicas[0]
                    jobs.append(RepairJob(key, meta, self.segments[source.segment_id].address, source.offset,
                                          target.segment_id, target.address, offset, meta.size))
                    break
        return jobs

    def under_replicated(self) -> list[str]:
        return [k for k, m in self.objects.items() if m.state == COMPLETE and len(m.replicas) < m.replica_num]

    def finish_repair(self, job: "RepairJob", ok: bool) -> bool:
        """Record a finished copy, or release its space if it failed or the object changed meanwhile."""
        target = self.segments.get(job.target_id)
        meta = self.objects.get(job.key)
        usable = (ok and target is not None and meta is job.meta
                  and job.target_id not in {r.segment_id for r in meta.replicas})
        if not usable:
            if target is not None:
                target.allocator.free(job.target_offset, job.size)
            return False
        meta.replicas.append(Replica(job.target_id, job.target_offset))
        target.catalog_version += 1
        self._journal_object(job.key, meta)
        return True

    # ---- journal replay -------------------------------------------------------------------------

    def replay(self, records) -> int:
        """Rebuild state from journal records (without re-journalling); returns the record count.

        Restored segments get a fresh heartbeat deadline; a segment that died while the master was
        down misses it and is dropped then. Leases are not restored: they only ever delay a remove.
        """
        journal, self.journal = self.journal, (lambda record: None)
        count = 0
        try:
            for record in records:
                count += 1
                op = record.get("op")
                if op == "segment":
                    self.register_segment(record["segment_id"], record["address"], record["size"],
                                          record["shm_path"], record["host_id"], record.get("public_key", ""),
                                          read_addresses=tuple(record.get("read_addresses") or ()))
                elif op == "drop_segment":
                    self.drop_segment(record["segment_id"], record.get("reason", "was dropped"))
                elif op == "object":
                    self._replay_object(record)
                elif op == "remove":
                    meta = self.objects.get(record["key"])
                    if meta is not None:
                        self._release(record["key"], meta)
                    else:
                        self.lost.pop(record["key"], None)
                elif op == "forget_lost":
                    self.lost.clear()
                else:
                    log.warning("journal: skipping unknown record %r", op)
        finally:
            self.journal = journal
        return count

    def _replay_object(self, record: dict) -> None:
        key, size = record["key"], record["size"]
        if key in self.objects:
            self._release(key, self.objects[key])
        replicas = []
        for segment_id, offset in record["replicas"]:
            segment = self.segments.get(segment_id)
            if segment is not None and segment.allocator.reserve(offset, size):
                replicas.append(Replica(segment_id, offset))
        if replicas:
            self.objects[key] = ObjectMeta(size, record.get("replica_num", len(replicas)), replicas, COMPLETE)

    def snapshot(self) -> list[dict]:
        """The journal records that rebuild the current durable state (used to compact the journal)."""
        records = [{"op": "segment", "segment_id": s.segment_id, "address": s.address, "size": s.size,
                    "shm_path": s.shm_path, "host_id": s.host_id, "public_key": s.public_key,
                    "read_addresses": list(s.read_addresses)}
                   for s in self.segments.values()]
        records += [{"op": "object", "key": k, "size": m.size, "replica_num": m.replica_num,
                     "replicas": [[r.segment_id, r.offset] for r in m.replicas]}
                    for k, m in self.objects.items() if m.state == COMPLETE]
        return records
