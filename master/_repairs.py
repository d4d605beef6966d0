"""Re-replication in the master's state: copies of objects below their replica count onto segments with room."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ._fencing import Fence
from ._records import COMPLETE, LostObject, ObjectMeta, Replica, some_keys

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
        if not usable:
            if target is not None and ok:
                target.allocator.free(job.target_offset, job.size)  # every write of the copy was answered
            elif target is not None:
                # A copy that failed may have a write still queued at the target: fence it like a revoked put.
                target.fences.add(job.put_id)
                self.fencing[job.put_id] = Fence(job.key, job.size, {job.target_id: job.target_offset})
            return False
        meta.replicas.append(Replica(job.target_id, job.target_offset, job.put_id))
        target.catalog_version += 1
        self._journal_object(job.key, meta)
        return True

    # ---- objects a segment found damaged -----------------------------------------------------------

    def drop_damaged(self, segment_id: str, damaged: list[tuple[str, int, int]]) -> list[str]:
        """The segment found these replicas (``(key, offset, generation)``) no longer matching their checksums when
        it started on its file: they are not served again. Each is dropped from its object (its space quarantined
        as a removed one's: readers may hold its placement); an object left without a replica is lost, with a
        message that says why. Returns the keys of the objects lost."""
        segment = self.segments.get(segment_id)
        if segment is None or not damaged:
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
            # The journal first, then the state: a change whose record could not be written is not made.
            self.journal({"op": "object", "key": key, "size": meta.size, "replica_num": meta.replica_num,
                          "replicas": [r.record() for r in kept], "checksum": meta.checksum})
            record = None
            if not kept:
                record = LostObject(f"object {key!r} was lost: its last replica, on segment {segment_id} at "
                                    f"{segment.address}, no longer matched its checksum when the segment started on "
                                    "its file (damaged at rest)", meta.size, meta.replica_num, meta.checksum, bad)
                self.journal(record.record(key))
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
        checksums and are restored; the space of the others is free again. Returns how many were restored."""
        segment = self.segments.get(segment_id)
        if segment is None or registration != segment.registration:
            return 0
        verified = set(keys)
        restored = []
        for key, (offset, size, generation) in list(segment.verifying.items()):
            del segment.verifying[key]
            lost = self.lost.get(key)
            if key in verified and lost is not None and key not in self.objects and lost.size == size:
                del self.lost[key]
                meta = self.objects[key] = ObjectMeta(size, lost.replica_num,
                                                      [Replica(segment_id, offset, generation)], COMPLETE,
                                                      checksum=lost.checksum)
                self._journal_object(key, meta)
                restored.append(key)
            else:
                segment.allocator.free(offset, size)
        if restored:
            segment.catalog_version += 1
            log.warning("segment %s: %d lost object(s) restored, their bytes intact%s", segment_id, len(restored),
                        some_keys(restored))
        return len(restored)
