"""Fencing in the master's state: puts that ended before their writers stopped, and the space they keep.

A fenced put's space is freed replica by replica as each segment acknowledges the fence (with a heartbeat), or
kept while the segment reports a live writer still writing the range straight into its file. A segment that
registers again ends every put writing to it: its new write key already refuses their tickets.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ._records import PENDING, ObjectMeta, Segment

log = logging.getLogger("engram_store.master._state")


@dataclass
class Fence:
    """Space of a fenced put, freed replica by replica as each segment acknowledges the fence."""
    key: str
    size: int
    waiting: dict  # segment id -> offset of the replica still to be acknowledged


class Fencing:
    """The fencing part of :class:`~._state.MasterState` (a mixin: the state holds segments, objects, fences)."""

    def _end_registration(self, segment: Segment) -> None:
        """The segment registered again: every ticket of its old registration is dead, so its space held by pending
        or fenced puts is free, except ranges it reports as still written (see :meth:`_report_held`)."""
        for key in [k for k, m in self.objects.items() if m.state == PENDING
                    and any(r.segment_id == segment.segment_id for r in m.replicas)]:
            self._fence(key, self.objects[key], settled={segment.segment_id})
        for put_id in list(segment.fences):
            self._fence_acknowledged(segment, put_id)
        segment.fences.clear()

    def _report_held(self, segment: Segment, held: list[tuple[int, int]]) -> None:
        """The segment's current list of ranges still written by live writers of fenced puts: reserve the new
        ones, free those no longer reported."""
        reported = {(int(o), int(n)) for o, n in held}
        for offset, size in reported - segment.held:
            # A range this master may not know as allocated (a registration after a restart): reserve it; one it
            # already reserves for the fenced put stays reserved as held.
            if not self._reserved_by_fence(segment.segment_id, offset, size):
                if not segment.allocator.reserve(offset, size):
                    log.warning("segment %s reports a live writer in [%d, %d), which overlaps objects this master "
                                "placed there", segment.segment_id, offset, offset + size)
                    continue
            segment.held.add((offset, size))
        for offset, size in segment.held - reported:
            segment.held.discard((offset, size))
            segment.allocator.free(offset, size)
            log.info("segment %s: [%d, %d) is free again: its stale writer finished or died", segment.segment_id,
                     offset, offset + size)

    def _reserved_by_fence(self, segment_id: str, offset: int, size: int) -> bool:
        return any(f.waiting.get(segment_id) == offset and f.size == size for f in self.fencing.values())

    def _fence(self, key: str, meta: ObjectMeta, settled: set[str] = frozenset()) -> None:
        """Forget a pending put. Its replicas on ``settled`` segments are free at once; the others wait until each
        segment has acknowledged the fence (sent with its heartbeat replies), so no late write lands in space
        that another object owns."""
        del self.objects[key]
        waiting = {}
        for replica in meta.replicas:
            segment = self.segments.get(replica.segment_id)
            if segment is None:  # redundant today: dropping a segment takes its replicas out of pending puts first
                continue
            if replica.segment_id in settled or not meta.size:
                segment.allocator.free(replica.offset, meta.size)
            else:
                segment.fences.add(meta.put_id)
                waiting[replica.segment_id] = replica.offset
        if waiting:
            self.fencing[meta.put_id] = Fence(key, meta.size, waiting)

    def _fence_acknowledged(self, segment: Segment, put_id: int, held: list[tuple[int, int]] | None = None) -> None:
        """The segment applied the fence of ``put_id``: free its replica there, unless the segment reports a live
        writer still writing that range (then it stays reserved as held)."""
        fence = self.fencing.get(put_id)
        if fence is None:  # redundant today: a put id in a segment's fences always has a fence waiting on it
            return
        offset = fence.waiting.pop(segment.segment_id, None)
        if offset is not None:
            # (Redundant today: heartbeat() reports the same list next, and _report_held frees a range it lacks.)
            if held is not None and (offset, fence.size) in {(int(o), int(n)) for o, n in held}:
                segment.held.add((offset, fence.size))
            else:
                segment.allocator.free(offset, fence.size)
        if not fence.waiting:
            del self.fencing[put_id]

    def _forget_settled_fences(self) -> None:
        for put_id in [p for p, f in self.fencing.items() if not f.waiting]:
            del self.fencing[put_id]

    def fencing_bytes(self) -> int:
        """Bytes of fenced puts waiting for the segments' acknowledgements, and of ranges held by stale writers."""
        return (sum(f.size * len(f.waiting) for f in self.fencing.values())
                + sum(size for s in self.segments.values() for _, size in s.held))
