"""The master's metadata: segments, objects, placement, leases, liveness and write fencing. No sockets, no files.

Every change that must survive a restart is handed to ``journal`` (a callable taking one record dict) before it is
made, so the state can be rebuilt by :meth:`MasterState.replay`: a change whose record cannot be written (the
callable raises JournalError) is not made. A change that touches several objects is one record (a ``batch``), so a
crash never replays half of it. Pending puts are not journalled: after a restart a write that had not reached
``put_end`` is absent, never half visible.

Fencing: a write must never land in space another object owns. Each registration of a segment brings a fresh
secret ``write_key`` chosen by the segment; every replica of a put gets a *ticket* (the put's id and the range it
may write, with a MAC under that key) that the segment checks on every write (:func:`make_ticket`). A put that is
revoked, expires or is removed with ``force`` is *fenced*: its id goes to each segment with the next heartbeat
reply, and its space is freed only once the segment has acknowledged the fence (and reports no writer of it still
alive that writes straight into the segment's file). A segment that registers again (it was dropped, or the master
restarted and forgot its pending puts) picks a new key first, so every older ticket dies before this master can
hand its space to anyone; a master restored from its journal allocates on a segment only once it has registered
again. See DESIGN.md, "Fencing".
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from engram_store.errors import (
    CatalogUnwritable,
    EngramError,
    InvalidArgument,
    JournalError,
    ObjectExists,
    ObjectLost,
    ObjectNotFound,
    OutOfSpace,
    SegmentUnavailable,
    WriteFenced,
)
from engram_store.wire import make_ticket

from ._adoption import Adoptions
from ._allocator import FreeListAllocator
from ._fencing import Fencing
from ._records import COMPLETE, PENDING, LostObject, ObjectMeta, Replica, Segment, some_keys
from ._removals import Removals
from ._repairs import Repairs
from ._replay import Replay

log = logging.getLogger(__name__)

#: Put ids handed out per journal record (see MasterState.put_ids_below): one record per million puts.
PUT_ID_BLOCK = 1 << 20


@dataclass
class MasterState(Removals, Fencing, Repairs, Replay, Adoptions):
    lease_ttl_s: float = 5.0
    heartbeat_timeout_s: float = 10.0
    #: A pending put whose writer has not renewed it (put_start, put_renew) for this long is fenced and its space
    #: freed once the segments acknowledge; writers renew a few times per period while they write.
    put_timeout_s: float = 30.0
    #: Space of a removed object becomes allocatable again only after this delay, so a reader still using a
    #: placement it resolved just before the remove reads the old bytes, never another object's.
    reuse_delay_s: float = 2.0
    journal: Callable[[dict], None] = lambda record: None
    clock: Callable[[], float] = time.monotonic
    segments: dict[str, Segment] = field(default_factory=dict)
    objects: dict[str, ObjectMeta] = field(default_factory=dict)
    #: Acknowledged objects whose every replica was dropped, by key (oldest first, at most LOST_KEYS_KEPT).
    lost: OrderedDict = field(default_factory=OrderedDict)
    #: Removed objects as ``(key, generation)`` (oldest first, at most REMOVED_KEPT): never adopted again.
    removed: OrderedDict = field(default_factory=OrderedDict)
    #: Freed blocks waiting out ``reuse_delay_s``: (time allocatable, allocator, offset, size), oldest first.
    quarantine: deque = field(default_factory=deque)
    #: Fenced puts whose space waits for the segments' acknowledgements, by put id.
    fencing: dict = field(default_factory=dict)
    #: Put ids name the generation of the bytes they write (segments refuse reads naming an older one), so they
    #: must not repeat across restarts of a master, with or without a journal: each master starts at a random
    #: point of a 62-bit space.
    next_put_id: int = field(default_factory=lambda: (secrets.randbits(30) << 32) + 1)
    #: Put ids below this one may be handed out without a word to the journal: a master journals the end of each
    #: block of PUT_ID_BLOCK ids before it hands out the block's first (:meth:`take_put_id`), so a master that
    #: replays its journal starts past every id handed out before, written or not (0: none journalled yet).
    put_ids_below: int = 0

    # ---- segments -------------------------------------------------------------------------------

    def register_segment(
        self, segment_id: str, address: str, size: int, shm_path: str, host_id: str, public_key: str = "",
        objects: list[tuple] | None = None, read_addresses: tuple[str, ...] = (), *,
        write_key: bytes = b"", registration: str = "", held: list[tuple[int, int]] | None = None,
        direct_writes: bool = False, confirmed: bool = True,
    ) -> bool:
        """Add a segment (or refresh a known one); returns True when it was already known.

        ``write_key`` and ``registration`` are the secret and id of this registration, chosen by the segment.
        ``confirmed=False`` (a journal replay) records a segment nothing is allocated on until it registers with
        this master again. A new registration of a known segment ends every put still writing to it (the
        segment refuses their old tickets already); ``held`` are ranges the segment reports as still written by
        live writers of such puts, reserved until it stops reporting them.

        ``objects`` is what the segment says it holds, as ``(key, offset, size, replica_num[, checksum[,
        generation]])`` (its catalogue, the bytes verified against their checksums). They are taken back when this
        master does not know the segment (it lost its state, or dropped the segment while it was away), and at the
        segment's first registration since the master replayed its journal, where the journal does not know them
        (see :mod:`._adoption`). Otherwise a known segment's objects are the ones this master recorded, which
        already include every write and every remove. The segment's record and what it changes are journalled
        first, as one record: a registration that cannot be journalled raises JournalError and changes nothing.
        """
        known = self.segments.get(segment_id)
        if known is not None and known.size != size:
            raise InvalidArgument(
                f"segment {segment_id}: registered with size {known.size}, now claims {size}"
            )
        fields = {"address": address, "shm_path": shm_path, "host_id": host_id, "public_key": public_key,
                  "read_addresses": tuple(read_addresses)}
        record = {"op": "segment", "segment_id": segment_id, "size": size, **fields,
                  "read_addresses": list(read_addresses)}
        fresh = Segment(segment_id, address, size, shm_path, host_id, FreeListAllocator(size), self.clock(),
                        public_key, tuple(read_addresses)) if known is None else None
        plan = None
        if confirmed and (objects and known is None or known is not None and not known.confirmed):
            journalled = known is not None  # restored by the replay, registering for the first time since
            target = fresh or dataclasses.replace(known, allocator=known.allocator.copy(), held=set(known.held))
            plan = self.plan_adoption(target, objects or [], held or [], journalled,
                                      original=known.allocator if known is not None else None)
        changed = known is None or any(getattr(known, name) != value for name, value in fields.items())
        self._record(*([record] if changed else []), *(plan.records(self._object_record) if plan else []))
        if known is None:
            self.segments[segment_id] = fresh
            log.info("segment %s registered at %s (%d bytes, %d reader sockets)", segment_id, address, size,
                     len(read_addresses))
        else:
            self._refresh_segment(known, fields, confirmed and (registration != known.registration
                                                                 or not known.confirmed))
        segment = self.segments[segment_id]
        segment.confirmed = confirmed
        if confirmed:
            segment.write_key, segment.registration = bytes(write_key), registration
            segment.direct_writes = bool(direct_writes)
            if plan is not None:
                self.apply_adoption(segment, plan)
            else:
                self._report_held(segment, held or [])
        return known is not None

    def _refresh_segment(self, known: Segment, fields: dict, new_registration: bool) -> None:
        """A known segment registering again: its fields as it gives them now, alive as of now; a new registration
        ends what the old one had going (its puts, and the questions asked of it about lost objects)."""
        for name, value in fields.items():
            setattr(known, name, value)
        known.last_heartbeat = self.clock()
        if new_registration:
            for offset, length, _ in known.verifying.values():  # asked of the old registration: ask again
                known.allocator.free(offset, length)
            known.verifying.clear()
            known.doubtful = {}
            self._end_registration(known)

    def segment_objects(self, segment_id: str) -> tuple[int, list[list]]:
        """``(catalog_version, [[key, offset, size, replica_num, checksum, generation], ...])`` of the complete
        objects on a segment."""
        segment = self.segments.get(segment_id)
        if segment is None:
            raise ObjectNotFound(f"segment {segment_id} is not registered")
        held = [[key, r.offset, m.size, m.replica_num, m.checksum, r.generation] for key, m in self.objects.items()
                if m.state == COMPLETE for r in m.replicas if r.segment_id == segment_id]
        return segment.catalog_version, held

    def _touch(self, meta: ObjectMeta) -> None:
        for replica in meta.replicas:
            segment = self.segments.get(replica.segment_id)
            if segment is not None:
                segment.catalog_version += 1

    @staticmethod
    def _object_record(key: str, meta: ObjectMeta, checksum: str | None = None) -> dict:
        return {"op": "object", "key": key, "size": meta.size, "replica_num": meta.replica_num,
                "replicas": [r.record() for r in meta.replicas],
                "checksum": meta.checksum if checksum is None else checksum}

    def _record(self, *records: dict) -> None:
        """Journal the records of one change, before it is made (several as one ``batch`` record, so a crash
        never leaves half of the change); raises JournalError when they cannot be written: make no change then."""
        if len(records) == 1:
            self.journal(records[0])
        elif records:
            self.journal({"op": "batch", "records": list(records)})

    def heartbeat(self, segment_id: str, registration: str | None = None, fenced: list[int] = (),
                  held: list[tuple[int, int]] | None = None, refusing: str = "") -> Segment | None:
        """Record a heartbeat; returns the segment, or None when this master does not know it under that
        registration (it must register again).

        ``fenced`` are put ids whose fence the segment has applied (no write of theirs lands any more), ``held``
        the ranges it reports as still written by live writers of fenced puts (None: a segment that predates
        fencing), ``refusing`` why it takes no new puts now ("": it takes them), so none is placed there."""
        segment = self.segments.get(segment_id)
        if segment is None or (registration is not None and registration != segment.registration):
            return None
        segment.last_heartbeat = self.clock()
        if refusing != segment.refusing:
            if refusing:
                log.warning("segment %s at %s takes no new puts (%s); placing them on other segments", segment_id,
                            segment.address, refusing)
            else:
                log.info("segment %s at %s takes puts again", segment_id, segment.address)
            segment.refusing = refusing
        for put_id in fenced:
            if put_id in segment.fences:
                segment.fences.discard(put_id)
                self._fence_acknowledged(segment, put_id, held)
        if held is not None:
            self._report_held(segment, held)
        return segment

    def drop_segment(self, segment_id: str, reason: str) -> int:
        """Forget a segment and every replica on it; returns how many objects lost their last replica."""
        segment = self.segments.get(segment_id)
        if segment is None:
            return 0
        self._record({"op": "drop_segment", "segment_id": segment_id, "reason": reason})
        del self.segments[segment_id]
        for fence in self.fencing.values():
            fence.waiting.pop(segment_id, None)  # its space went with it
        self._forget_settled_fences()
        lost: list[str] = []
        for key in list(self.objects):
            meta = self.objects[key]
            kept = [r for r in meta.replicas if r.segment_id != segment_id]
            if len(kept) == len(meta.replicas):
                continue
            if meta.state == PENDING:
                meta.replicas = kept
                self._fence(key, meta)  # a write that cannot complete as asked: its other replicas are fenced
                continue
            dropped = [r for r in meta.replicas if r.segment_id == segment_id]
            meta.replicas = kept
            if not kept:
                del self.objects[key]
                message = (f"object {key!r} was lost: its last replica was on segment {segment_id} at "
                           f"{segment.address}, which {reason}")
                self._remember_lost(key, LostObject(message, meta.size, meta.replica_num, meta.checksum, dropped))
                lost.append(key)
        log.warning("segment %s at %s dropped (%s); %d object(s) lost%s", segment_id, segment.address, reason,
                    len(lost), some_keys(lost))
        return len(lost)

    def expire_segments(self, running_gap_s: float = 0.0) -> list[str]:
        """Drop segments whose last heartbeat is older than the timeout; returns their ids.

        ``running_gap_s`` is time the master itself was not running (stalled or paused) since the
        previous check; it is credited to every segment so a master stall never kills live segments.
        """
        now = self.clock()
        if running_gap_s > 0:
            for segment in self.segments.values():
                segment.last_heartbeat += running_gap_s
            for meta in self.objects.values():
                meta.renewed += running_gap_s  # nor does it expire the puts being written meanwhile
        dead = [s.segment_id for s in self.segments.values()
                if now - s.last_heartbeat > self.heartbeat_timeout_s]
        failed = None
        for segment_id in dead:
            try:
                self.drop_segment(segment_id, f"missed heartbeats for over {self.heartbeat_timeout_s:g} s")
            except JournalError as exc:
                failed = exc  # still registered: dropped at a later check, once the journal takes the record
        if failed is not None:
            raise failed
        return dead

    def expire_puts(self) -> list[str]:
        """Fence pending puts whose writer has not renewed them for ``put_timeout_s`` (it died or stalled)."""
        now = self.clock()
        stale = [k for k, m in self.objects.items() if m.state == PENDING and now - m.renewed > self.put_timeout_s]
        for key in stale:
            log.warning("put of %r not renewed by its writer for %g s; fenced and revoked", key, self.put_timeout_s)
            self._fence(key, self.objects[key])
        return stale

    # ---- objects --------------------------------------------------------------------------------

    def put_start(self, key: str, size: int, replica_num: int) -> list[tuple[Segment, int]]:
        """Reserve space for ``replica_num`` replicas on distinct segments; the object stays invisible.

        Returns the placement; the put's id (its tickets name it) is ``objects[key].put_id``."""
        if key in self.objects:
            meta = self.objects[key]
            if meta.state == PENDING:
                raise ObjectExists(
                    f"key {key!r} already exists (a write is in progress, last renewed by its writer "
                    f"{self.clock() - meta.renewed:.1f} s ago; a writer that died lets go within "
                    f"{self.put_timeout_s:g} s, or remove it with force=True)")
            raise ObjectExists(f"key {key!r} already exists")
        if replica_num < 1:
            raise InvalidArgument(f"replica_num: expected >= 1, got {replica_num}")
        self.release_quarantine()
        confirmed = self._placeable(key, replica_num)
        # Most free space first spreads objects over segments; ties broken by id for determinism.
        candidates = sorted(confirmed, key=lambda s: (-s.allocator.free_bytes, s.segment_id))
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
            largest = max((s.allocator.largest_free() for s in confirmed), default=0)
            removed, abandoned = self.quarantined_bytes(), self.fencing_bytes()
            raise OutOfSpace(
                f"put {key!r}: no room for {replica_num} replica(s) of {size} bytes on distinct segments "
                f"(largest free block: {largest} bytes over {len(confirmed)} segments"
                + (f"; {removed} bytes of removed objects become free within {self.reuse_delay_s:g} s"
                   if removed else "")
                + (f"; {abandoned} bytes of abandoned writes become free once their segments have fenced them "
                   "(within a heartbeat, or when their writer exits)" if abandoned else "") + ")"
            )
        # A lost object of the key stays lost (and restorable) until this put is published: a put that fails must
        # not erase the loss (put_end forgets it; a segment that brings the lost object back fences this put).
        try:
            put_id = self.take_put_id()
        except JournalError:
            for segment, offset in placed:
                segment.allocator.free(offset, size)
            raise
        now = self.clock()
        self.objects[key] = ObjectMeta(size, replica_num, [Replica(s.segment_id, o, put_id) for s, o in placed],
                                       PENDING, started=now, put_id=put_id, renewed=now)
        return placed

    def _placeable(self, key: str, replica_num: int) -> list[Segment]:
        """The segments a put of ``key`` may be placed on (registered with this master, taking puts), at least
        ``replica_num`` of them: else SegmentUnavailable (some have yet to register since a restart: retry),
        CatalogUnwritable (some refuse puts now) or OutOfSpace (too few segments)."""
        taking = [s for s in self.segments.values() if s.takes_puts]
        if replica_num <= len(taking):
            return taking
        if replica_num > len(self.segments):
            raise OutOfSpace(f"put {key!r}: replica_num={replica_num} needs {replica_num} distinct segments, but "
                             f"{len(self.segments)} are registered")
        waiting = [s for s in self.segments.values() if not s.confirmed]
        refusing = [s for s in self.segments.values() if s.confirmed and s.refusing]
        if refusing and replica_num > len(taking) + len(waiting):
            raise CatalogUnwritable(
                f"put {key!r}: replica_num={replica_num} needs {replica_num} distinct segments taking puts, but "
                f"{len(refusing)} of the {len(self.segments)} registered take none now (segment "
                f"{refusing[0].segment_id} at {refusing[0].address}: {refusing[0].refusing})")
        raise SegmentUnavailable(
            f"put {key!r}: {len(waiting)} of {len(self.segments)} segments have not registered with this master "
            "since it restarted (they do within a heartbeat); retry")

    def take_put_id(self) -> int:
        """The next put id. Ids name the bytes a put writes (segments refuse a read naming an older one, a writer
        acts on its own put only), so no master may hand one out twice: past the end of the journalled block, the
        next block's end is journalled first (JournalError: no id is handed out)."""
        if self.next_put_id >= self.put_ids_below:
            below = self.next_put_id + PUT_ID_BLOCK
            self._record({"op": "put_ids", "below": below})
            self.put_ids_below = below
        put_id = self.next_put_id
        self.next_put_id += 1
        return put_id

    def ticket(self, segment: Segment, put_id: int, offset: int, size: int) -> bytes:
        return make_ticket(segment.write_key, segment.segment_id, put_id, offset, size)

    # ``generation`` below is the put's id as put_start gave it: a writer that names it acts on its own put only,
    # never on one another writer started under the same key after a forced remove ended this one (0: any put).

    def put_renew(self, key: str, generation: int = 0) -> bool:
        """The writer of a pending put is still writing; False when the put is not pending any more (revoked,
        expired, or forgotten by a restart): the writer must stop."""
        meta = self.objects.get(key)
        if meta is None or meta.state != PENDING or (generation and meta.put_id != generation):
            return False
        meta.renewed = self.clock()
        return True

    def put_end(self, key: str, checksum: str = "", generation: int = 0,
                requires: list[tuple[str, int]] = ()) -> None:
        error = self.put_end_many([(key, checksum, generation)], requires)[0]
        if error is not None:
            raise error

    def put_end_many(self, puts: list[tuple[str, str, int]],
                     requires: list[tuple[str, int]] = ()) -> list[EngramError | None]:
        """Publish ``(key, checksum, generation)`` puts, all in one journal record: each answered None (published,
        or published already) or with its error; if the record cannot be written, none is published and each
        gets the JournalError. Publishing a key that was lost forgets the loss: the key holds the new object.

        ``requires``: ``(key, generation)`` of published objects the puts describe (a layer's heads, for its
        manifest): unless every one is still the object that put wrote, nothing is published and every put gets
        WriteFenced (checked here, with the publication, so no remove can come between). A put named by its
        generation that is not in progress any more (revoked, expired, ended by a forced remove) gets WriteFenced."""
        gone = next(((key, g) for key, g in requires if not self._published_by(key, g)), None)
        if gone is not None:
            return [WriteFenced(f"put_end {key!r}: {gone[0]!r} is no longer the object put {gone[1]} wrote "
                                "(removed, or written again), and this object describes it: nothing was published")
                    for key, _, _ in puts]
        results: list[EngramError | None] = []
        ready: dict[str, tuple[ObjectMeta, str]] = {}
        for key, checksum, generation in puts:
            meta = self.objects.get(key)
            if meta is None or (generation and not self._written_by(key, generation)):
                results.append(_ended(key, generation))
                continue
            results.append(None)
            if meta.state != COMPLETE and key not in ready:
                ready[key] = (meta, checksum)
        try:
            self._record(*[self._object_record(key, meta, checksum) for key, (meta, checksum) in ready.items()])
        except JournalError as exc:
            return [exc if key in ready and error is None else error for (key, _, _), error in zip(puts, results)]
        for key, (meta, checksum) in ready.items():
            if key in self.lost:
                self._forget_lost(key)  # written anew: the lost bytes must not come back over the new object
            meta.state = COMPLETE
            meta.put_id = 0
            meta.checksum = checksum
            self._touch(meta)
        return results

    def _published_by(self, key: str, generation: int) -> bool:
        """Whether ``key`` holds a published object that the put ``generation`` wrote."""
        meta = self.objects.get(key)
        return meta is not None and meta.state == COMPLETE and self._written_by(key, generation)

    def put_revoke(self, key: str, settled: bool = False, generation: int = 0) -> None:
        """Abandon a pending put. ``settled``: its writer has no write in flight any more (every write it sent was
        answered), so the space is free at once; otherwise the put is fenced first. A put named by ``generation``
        that was published already (the call that wrote it failed on another key) is removed: the call wrote
        nothing."""
        meta = self.objects.get(key)
        if meta is None or (generation and not self._written_by(key, generation)):
            return
        if meta.state != PENDING and generation:
            self.remove(key, force=True)
            return
        if meta.state != PENDING:
            raise InvalidArgument(f"put_revoke {key!r}: the object is complete; use remove")
        self._fence(key, meta, settled={r.segment_id for r in meta.replicas} if settled else set())

    def get(self, key: str, lease: bool = True) -> ObjectMeta:
        meta = self.objects.get(key)
        if meta is None or meta.state != COMPLETE:
            if key in self.lost:
                raise ObjectLost(self.lost[key].message)
            raise ObjectNotFound(f"no object under key {key!r}")
        if lease:
            meta.lease_until = max(meta.lease_until, self.clock() + self.lease_ttl_s)
        return meta

    def exists(self, key: str) -> bool:
        meta = self.objects.get(key)
        return meta is not None and meta.state == COMPLETE

    def list_keys(self, prefix: str, after: str, limit: int) -> tuple[list[list], bool]:
        """Objects whose key starts with ``prefix``, after the key ``after``, in key order, at most ``limit``:
        ``[key, size, replica_num, live replicas, state, lease left in ms]`` with state complete, pending or
        lost; and whether there are more."""
        now = self.clock()
        rows = [[k, m.size, m.replica_num, len(m.replicas), m.state, max(0, int((m.lease_until - now) * 1000))]
                for k, m in self.objects.items() if k.startswith(prefix) and k > after]
        rows += [[k, lost.size, lost.replica_num, 0, "lost", 0] for k, lost in self.lost.items()
                 if k.startswith(prefix) and k > after and k not in self.objects]
        rows.sort()
        return rows[:limit], len(rows) > limit


def _ended(key: str, generation: int) -> EngramError:
    """put_end's answer for a put that is not in progress: WriteFenced where the writer named its put (it ended:
    revoked, expired, ended by a forced remove or a segment's new registration, or forgotten by a master restart),
    ObjectNotFound where it named none."""
    why = "(revoked, timed out, fenced, or forgotten by a master restart)"
    if generation:
        return WriteFenced(f"put_end {key!r}: no write in progress for put {generation} {why}: nothing of it is "
                           "published")
    return ObjectNotFound(f"put_end {key!r}: no write in progress {why}")
