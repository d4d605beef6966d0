"""Re-replication in the master's state: copies of objects below their replica count onto segments with room."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from engram_store.errors import JournalError

from ._fencing import Fence
from ._records import COMPLETE, PENDING, LostObject, ObjectMeta, Replica, some_keys

log = logging.getLogger("engram_store.master._state")


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
    put_id: int = 0
    ticket: bytes = b""


class Repairs:
    """The repair part of :class:`~._state.MasterState` (a mixin): copies of objects below their replica count, and
    lost objects restored from a segment that comes back with their bytes."""

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
            candidates = sorted((s for s in self.segments.values() if s.segment_id not in holders and s.takes_puts),
                                key=lambda s: (-s.allocator.free_bytes, s.segment_id))
            for target in candidates:
                offset = target.allocator.allocate(meta.size)
                if offset is not None:
                    source = meta.replicas[0]
                    try:
                        put_id = self.take_put_id()
                    except JournalError:
                        target.allocator.free(offset, meta.size)
                        return jobs
                    jobs.append(RepairJob(key, meta, self.segments[source.segment_id].address, source.offset,
                                          target.segment_id, target.address, offset, meta.size, put_id,
                                          self.ticket(target, put_id, offset, meta.size)))
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
        replica = Replica(job.target_id, job.target_offset, job.put_id)
        if usable:
            try:
                self._record(self._object_record(job.key, dataclasses.replace(meta, replicas=[*meta.replicas,
                                                                                              replica])))
            except JournalError as exc:
                log.warning("re-replication of %r to %s is given up: %s", job.key, job.target_address, exc)
                usable = False
        if not usable:
            if target is not None and ok:
                target.allocator.free(job.target_offset, job.size)  # every write of the copy was answered
            elif target is not None:
                # A copy that failed may have a write still queued at the target: fence it like a revoked put.
                target.fences.add(job.put_id)
                self.fencing[job.put_id] = Fence(job.key, job.size, {job.target_id: job.target_offset})
            return False
        meta.replicas.append(replica)
        target.catalog_version += 1
        return True

    # ---- objects a segment found damaged -----------------------------------------------------------

    def drop_damaged(self, segment_id: str, damaged: list[tuple[str, int, int]]) -> list[str]:
        """The segment found these replicas (``(key, offset, generation)``) no longer matching their checksums when
        it started on its file: they are not served again. Each is dropped from its object (its space quarantined
        as a removed one's: readers may hold its placement); an object left without a replica is lost, with a
        message that says why. Returns the keys of the objects lost."""
        segment = self.segments.get(segment_id)
        if segment is None or not damaged:  # redundant: no object has a replica on a segment this master dropped
            return []
        lost, dropped = [], []
        reusable_at = self.clock() + self.reuse_delay_s
        for key, offset, generation in damaged:
            meta = self.objects.get(key)
            if meta is None or meta.state != COMPLETE:
                continue
            bad = [r for r in meta.replicas if r.segment_id == segment_id and r.offset == offset
                   and (not generation or not r.generation or r.generation == generation)]
            if not bad:
                continue  # another object under the key now (the segment's list was older)
            kept = [r for r in meta.replicas if r not in bad]
            records = [{"op": "object", "key": key, "size": meta.size, "replica_num": meta.replica_num,
                        "replicas": [r.record() for r in kept], "checksum": meta.checksum}]
            record = None
            if not kept:
                record = LostObject(f"object {key!r} was lost: its last replica, on segment {segment_id} at "
                                    f"{segment.address}, no longer matched its checksum when the segment started on "
                                    "its file (damaged at rest)", meta.size, meta.replica_num, meta.checksum, bad)
                records.append(record.record(key))
            # The journal first, then the state: a change whose record could not be written is not made. The
            # object's last replica dropped and its loss are one record (a batch): a journal torn after the first
            # would replay the object gone without a word (seed 870113).
            self._record(*records)
            self._touch(meta)
            meta.replicas = kept
            self.quarantine.append((reusable_at, segment.allocator, offset, meta.size))
            dropped.append(key)
            if record is not None:
                del self.objects[key]
                self._remember_lost(key, record)
                lost.append(key)
        if dropped:
            log.warning("segment %s: %d replica(s) damaged at rest dropped, %d object(s) lost with them%s",
                        segment_id, len(dropped), len(lost), some_keys(dropped))
        return lost

    # ---- lost objects a segment still holds ------------------------------------------------------

    def verification_candidates(self, segment_id: str) -> list[list]:
        """What the segment is asked to check, as ``[key, offset, size, checksum, generation]``: lost objects that
        had a replica on it (it may have been dropped before it learnt of them, so they are not in the catalogue it
        offered back), their ranges reserved until it answers (:meth:`offer_verified`); and objects a replayed
        journal places on it that its catalogue does not list (``Segment.doubtful``)."""
        segment = self.segments.get(segment_id)
        if segment is None or not segment.confirmed:
            return []
        candidates = []
        for key, lost in self.lost.items():
            if key in segment.verifying or not lost.checksum:
                continue
            for place in lost.places:
                if place.segment_id == segment_id and segment.allocator.reserve(place.offset, lost.size):
                    segment.verifying[key] = (place.offset, lost.size, place.generation)
                    candidates.append([key, place.offset, lost.size, lost.checksum, place.generation])
                    break
        if candidates:
            log.info("segment %s: asked to check %d lost object(s) it may still hold%s", segment_id,
                     len(candidates), some_keys([c[0] for c in candidates]))
        doubtful = [[key, offset, size, self.objects[key].checksum, generation]
                    for key, (offset, size, generation) in segment.doubtful.items() if key in self.objects]
        if doubtful:
            log.info("segment %s: asked whether it holds %d object(s) the journal places there and its catalogue "
                     "does not list%s", segment_id, len(doubtful), some_keys([c[0] for c in doubtful]))
        return candidates + doubtful

    def offer_verified(self, segment_id: str, registration: str, keys: list[str]) -> int:
        """The segment checked the objects :meth:`verification_candidates` named; ``keys`` are those it holds
        intact. Lost ones are restored (a write of such a key still in progress is fenced: the acknowledged object
        is back), the space of the others is free again; doubtful ones it does not hold are dropped there (lost,
        by name, where that was their last replica). All in one journal record, written first: if it cannot be,
        nothing changes and JournalError says why (lost objects are asked about again when the segment next
        registers; doubtful ones stay as the journal says). Returns how many were restored."""
        segment = self.segments.get(segment_id)
        if segment is None or registration != segment.registration:
            return 0
        verified = set(keys)
        restore: dict[str, ObjectMeta] = {}
        for key, (offset, size, generation) in segment.verifying.items():
            lost, meta = self.lost.get(key), self.objects.get(key)
            if key in verified and lost is not None and lost.size == size and (meta is None
                                                                                or meta.state == PENDING):
                restore[key] = ObjectMeta(size, lost.replica_num, [Replica(segment_id, offset, generation)],
                                          COMPLETE, checksum=lost.checksum)
        dropped = self._not_held(segment, verified)
        verifying, segment.verifying = segment.verifying, {}
        try:
            self._record(*[self._object_record(key, meta) for key, meta in restore.items()],
                         *[r for key, (meta, lost) in dropped.items()
                           for r in [self._object_record(key, meta)] + ([lost.record(key)] if lost else [])])
        except JournalError:
            restore, dropped = {}, {}
            raise
        finally:
            for key, (offset, size, _) in verifying.items():
                if key not in restore:
                    segment.allocator.free(offset, size)
            segment.doubtful = {}
        self._restore(segment, restore)
        self._drop_not_held(segment, dropped)
        return len(restore)

    def _not_held(self, segment, verified: set) -> dict:
        """The doubtful objects the segment does not hold as the journal says, as they will be: ``{key: (meta without
        the replica there, LostObject or None)}``."""
        dropped = {}
        for key, (offset, size, generation) in segment.doubtful.items():
            meta = self.objects.get(key)
            here = [r for r in meta.replicas if r.segment_id == segment.segment_id and r.offset == offset
                    and r.generation == generation] if meta is not None and meta.state == COMPLETE else []
            if key in verified or not here:
                continue
            kept = dataclasses.replace(meta, replicas=[r for r in meta.replicas if r is not here[0]])
            lost = None if kept.replicas else LostObject(
                f"object {key!r} was lost: segment {segment.segment_id}, where the journal placed it at offset "
                f"{offset}, no longer holds it (it was removed or written over in records the journal lost)",
                meta.size, meta.replica_num, meta.checksum, [])
            dropped[key] = (kept, lost)
        return dropped

    def _restore(self, segment, restore: dict) -> None:
        for key, meta in restore.items():
            if key in self.objects:
                log.warning("the write of %r in progress is fenced: segment %s brings back its lost object", key,
                            segment.segment_id)
                self._fence(key, self.objects[key])
            del self.lost[key]
            self.objects[key] = meta
        if restore:
            segment.catalog_version += 1
            log.warning("segment %s: %d lost object(s) restored, their bytes intact%s", segment.segment_id,
                        len(restore), some_keys(list(restore)))

    def _drop_not_held(self, segment, dropped: dict) -> None:
        for key, (kept, lost) in dropped.items():
            old = self.objects[key]
            segment.allocator.free(next(r.offset for r in old.replicas if r not in kept.replicas), old.size)
            if lost is None:
                self.objects[key] = kept
            else:
                del self.objects[key]
                self._remember_lost(key, lost)
            self._touch(old)
        if dropped:
            log.warning("segment %s does not hold %d object(s) the journal places there (removed or written over "
                        "in records the journal lost); dropped there%s", segment.segment_id, len(dropped),
                        some_keys(list(dropped)))
