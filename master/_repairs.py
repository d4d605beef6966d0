"""Re-replication in the master's state: copies of objects below their replica count onto segments with room."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from engram_store._errors import JournalError

from ._fencing import Fence
from ._records import COMPLETE, ObjectMeta, Replica, some_keys

log = logging.getLogger("master._state")


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
            candidates = sorted((s for s in self.segments.values() if s.segment_id not in holders and s.confirmed),
                                key=lambda s: (-s.allocator.free_bytes, s.segment_id))
            for target in candidates:
                offset = target.allocator.allocate(meta.size)
                if offset is not None:
                    source = meta.replicas[0]
                    put_id = self.next_put_id
                    self.next_put_id += 1
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

    # ---- lost objects a segment still holds ------------------------------------------------------

    def verification_candidates(self, segment_id: str) -> list[list]:
        """Lost objects that had a replica on this segment, as ``[key, offset, size, checksum]``: the segment is
        asked to check their bytes (it may have been dropped before it learnt of them, so they are not in the
        catalogue it offered back). Their ranges stay reserved until it answers (:meth:`offer_verified`)."""
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
                    candidates.append([key, place.offset, lost.size, lost.checksum])
                    break
        if candidates:
            log.info("segment %s: asked to check %d lost object(s) it may still hold%s", segment_id,
                     len(candidates), some_keys([c[0] for c in candidates]))
        return candidates

    def offer_verified(self, segment_id: str, registration: str, keys: list[str]) -> int:
        """The segment checked the objects :meth:`verification_candidates` named; those in ``keys`` matched their
        checksums and are restored (in one journal record, written first: if it cannot be, none is, and
        JournalError says why; the segment is asked again when it next registers); the space of the others is
        free again. A write of a restored key still in progress is fenced: the acknowledged object is back.
        Returns how many were restored."""
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
        verifying, segment.verifying = segment.verifying, {}
        try:
            self._record(*[self._object_record(key, meta) for key, meta in restore.items()])
        except JournalError:
            restore = {}
            raise
        finally:
            for key, (offset, size, _) in verifying.items():
                if key not in restore:
                    segment.allocator.free(offset, size)
        for key, meta in restore.items():
            if key in self.objects:
                log.warning("the write of %r in progress is fenced: segment %s brings back its lost object", key,
                            segment_id)
                self._fence(key, self.objects[key])
            del self.lost[key]
            self.objects[key] = meta
        if restore:
            segment.catalog_version += 1
            log.warning("segment %s: %d lost object(s) restored, their bytes intact%s", segment_id, len(restore),
                        some_keys(list(restore)))
        return len(restore)
