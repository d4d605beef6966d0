"""Objects a segment offers back when it registers, taken back where the master does not know them.

When: the master does not know the segment (it restarted without a journal, or dropped the segment while it was
away), or the segment registers for the first time since the master replayed its journal. The second case is the
journal's check against the world: a journal cut at a record boundary (whole records lost from its end) reads as
a shorter, valid journal, so the segments, which hold the bytes, are the witnesses of what it lost.

Why it is correct:

- **Only what is held.** A segment offers only objects whose bytes it has verified against their checksums.
- **Nothing removed comes back.** An object remembered as removed (key and generation) is not taken back.
- **Newer than the journal.** At the first registration after a replay, an object the journal does not know, or
  one of a key whose journalled object is another and older (by generation: put ids only grow along a journal's
  life), was written in what the journal lost; it is taken back. A journalled object whose place here the
  segment has since written over with such an object (the segment does not list it) is dropped there, and
  reported lost by name if that was its last replica: its bytes are gone. Removed space the replay holds back for
  the reuse delay gives way to what the segment proves it holds there.
- **Nothing changes before its record is written**: the whole registration (the segment's record and every object
  it changes) is worked out first, on a copy of the segment's space, and journalled as one record; a registration
  whose record cannot be written is refused and changes nothing (:meth:`Adoption.records`).
- **A lost object restored beats a write of its key in progress**: that put is fenced (its writer gets
  WriteFenced), so the acknowledged object is not lost for good if the write then fails.

What a replay restored and the segment does not list stays: a segment's catalogue may lag (a publication it was
not told of before the master restarted).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from ._records import COMPLETE, PENDING, LostObject, ObjectMeta, Replica, Segment, some_keys

log = logging.getLogger("engram_store.master._state")


@dataclass
class Adoption:
    """What a registration's offered objects change, worked out before anything changes."""
    #: The segment as it will be (its space with the adopted objects reserved); a copy until applied.
    segment: Segment
    #: The objects as they will be, by key (adopted ones, or journalled ones with a replica more or less).
    objects: dict = field(default_factory=dict)
    #: Journalled objects that newer ones from the segment replace, by key.
    replaced: dict = field(default_factory=dict)
    #: Objects left without any replica (written over here), as they will be remembered.
    lost: dict = field(default_factory=dict)
    #: Keys whose write in progress is fenced, because the segment brings back the lost object of that key.
    fenced: set = field(default_factory=set)
    #: The reuse-delay quarantine as it will be.
    quarantine: list = field(default_factory=list)
    #: Removed space held back for the reuse delay that the adopted objects may take; given back to the quarantine
    #: where they leave room.
    held_back: list = field(default_factory=list)
    #: Journalled objects with a replica here that the segment does not list, by key -> (offset, size, generation):
    #: asked about (see Segment.doubtful).
    doubtful: dict = field(default_factory=dict)
    #: What differs from what the master knew, logged once applied.
    notes: list = field(default_factory=list)
    skipped: int = 0

    def records(self, object_record) -> list[dict]:
        records = []
        for key, meta in self.replaced.items():
            records += [{"op": "removed", "key": key, "generation": r.generation} for r in meta.replicas
                        if r.generation]
        for key, meta in self.objects.items():
            records.append(object_record(key, meta))  # with no replica left, replay forgets the object here ...
            if not meta.replicas:
                records.append(self.lost[key].record(key))  # ... and remembers it lost
        return records


def _offer(entry) -> tuple[str, int, int, int, str, int]:
    key, offset, size, replica_num = entry[:4]
    checksum = entry[4] if len(entry) > 4 else ""
    generation = entry[5] if len(entry) > 5 else 0
    return str(key), int(offset), int(size), max(1, int(replica_num)), str(checksum or ""), int(generation or 0)


def _overlaps(offset: int, size: int, ranges: list[tuple[int, int]]) -> bool:
    return any(offset < o + s and o < offset + size for o, s in ranges)


class Adoptions:
    """The adoption part of :class:`~._state.MasterState` (a mixin)."""

    def plan_adoption(self, segment: Segment, offers: list, held: list, journalled: bool,
                      original=None) -> Adoption:
        """Work out what taking back ``offers`` changes, on ``segment``: a new one not yet registered, or a copy
        of a known one whose space is a copy of ``original`` (its allocator); ``journalled``: its first
        registration since the master replayed its journal."""
        self._report_held(segment, held)
        plan = Adoption(segment, quarantine=[(t, segment.allocator if a is original else a, o, s)
                                             for t, a, o, s in self.quarantine])
        wanted = [w for w in map(_offer, offers) if self._wanted(plan, w, journalled)]
        if journalled:
            self._make_room(plan, wanted, {(w[0], w[1]) for w in map(_offer, offers)})
        for key, offset, size, replica_num, checksum, generation in wanted:
            if not segment.allocator.reserve(offset, size):
                log.warning("segment %s: %r at offset %d overlaps another object; ignoring it", segment.segment_id,
                            key, offset)
                plan.skipped += 1
                continue
            meta = plan.objects.get(key) or (None if key in plan.replaced or key in plan.fenced
                                             else self.objects.get(key))
            replica = Replica(segment.segment_id, offset, generation)
            if meta is None:
                plan.objects[key] = ObjectMeta(size, replica_num, [replica], COMPLETE, checksum=checksum)
            else:
                plan.objects[key] = dataclasses.replace(meta, replicas=[*meta.replicas, replica],
                                                        checksum=meta.checksum or checksum)
            plan.lost.pop(key, None)
        if journalled:
            self._doubt(plan, {(w[0], w[1]) for w in map(_offer, offers)})
        return plan

    def _doubt(self, plan: Adoption, listed: set) -> None:
        """The journalled objects with a replica here that the segment does not list, as they will be."""
        sid = plan.segment.segment_id
        for key in self.objects.keys() | plan.objects.keys():
            meta = plan.objects.get(key) or self.objects.get(key)
            if key in plan.replaced and key not in plan.objects or meta.state != COMPLETE:
                continue
            for r in meta.replicas:
                if r.segment_id == sid and (key, r.offset) not in listed:
                    plan.doubtful[key] = (r.offset, meta.size, r.generation)

    def _wanted(self, plan: Adoption, offer: tuple, journalled: bool) -> bool:
        """Whether to take one offered object back (False: known already, removed, or another object's key)."""
        key, offset, size, _, checksum, generation = offer
        sid = plan.segment.segment_id
        meta = self.objects.get(key)
        if generation and (key, generation) in self.removed:
            log.info("segment %s still lists %r, which was removed while it was away; not adopted", sid, key)
            plan.skipped += 1
            return False
        if key in plan.objects or key in plan.fenced or key in plan.replaced:
            plan.skipped += 1  # the same key twice in one offer
            return False
        here = [r for r in meta.replicas if r.segment_id == sid and r.offset == offset] \
            if meta is not None and meta.state == COMPLETE else []
        if here and (not generation or not here[0].generation or here[0].generation == generation):
            return False  # known here already
        if here and journalled and meta.size == size and (not checksum or checksum == meta.checksum):
            # The same bytes written again in the same place, by a put the journal does not know: its generation.
            plan.objects[key] = dataclasses.replace(meta, replicas=[
                dataclasses.replace(r, generation=generation) if r is here[0] else r for r in meta.replicas])
            plan.notes.append(f"{key!r} at offset {offset} was written again by put {generation}")
            return False
        if meta is not None and meta.state == PENDING and self._restores_lost(key, offset, size, checksum, generation,
                                                                               sid):
            plan.fenced.add(key)
            return True
        if meta is not None and (meta.state != COMPLETE or meta.size != size
                                 or (checksum and meta.checksum and checksum != meta.checksum)):
            if journalled and meta.state == COMPLETE and generation > max(r.generation for r in meta.replicas):
                plan.replaced[key] = meta
                plan.notes.append(f"{key!r}: the segment holds a newer object (put {generation}) than the journal's "
                                  f"(put {max(r.generation for r in meta.replicas)}), which it replaces")
                return True
            log.warning("segment %s holds %r (%d bytes) but this master has another object under that key; "
                        "ignoring the segment's copy", sid, key, size)
            plan.skipped += 1
            return False
        if journalled:
            plan.notes.append(f"{key!r} at offset {offset} (put {generation}), which the journal does not know")
        return True

    def _restores_lost(self, key: str, offset: int, size: int, checksum: str, generation: int, sid: str) -> bool:
        lost = self.lost.get(key)
        return lost is not None and lost.size == size and (
            any(p.segment_id == sid and p.offset == offset and p.generation == generation for p in lost.places)
            or bool(checksum) and checksum == lost.checksum)

    def _make_room(self, plan: Adoption, wanted: list, listed: set) -> None:
        """Free, in the plan, what the journal has where the segment proves it holds newer objects: replicas it
        does not list (it wrote over them), replaced objects, and removed space held back for the reuse delay."""
        segment = plan.segment
        sid, allocator = segment.segment_id, segment.allocator
        ranges = [(w[1], w[2]) for w in wanted]
        keys = {w[0] for w in wanted}
        for key, meta in plan.replaced.items():
            for r in meta.replicas:
                if r.segment_id == sid:
                    allocator.free(r.offset, meta.size)
        for key, meta in self.objects.items():
            if key in plan.replaced or meta.state != COMPLETE:
                continue
            gone = [r for r in meta.replicas if r.segment_id == sid and (key, r.offset) not in listed
                    and (key in keys or _overlaps(r.offset, meta.size, ranges))]
            for r in gone:
                allocator.free(r.offset, meta.size)
                plan.notes.append(f"{key!r} at offset {r.offset}, which the journal places there, is written over "
                                  "by a newer object: dropped there")
            if gone:
                kept = [r for r in meta.replicas if r not in gone]
                plan.objects[key] = dataclasses.replace(meta, replicas=kept)
                if not kept:
                    plan.lost[key] = LostObject(
                        f"object {key!r} was lost: the journal placed it at segment {sid} offset {gone[0].offset}, "
                        "where the segment holds a newer object (the journal had lost the records of it)",
                        meta.size, meta.replica_num, meta.checksum, [])
        freed = [e for e in plan.quarantine if e[1] is allocator and _overlaps(e[2], e[3], ranges)]
        plan.quarantine = [e for e in plan.quarantine if not any(e is f for f in freed)]
        for _, _, offset, size in freed:
            allocator.free(offset, size)
        plan.held_back = freed

    def apply_adoption(self, segment: Segment, plan: Adoption) -> None:
        """Make the planned changes (their record is written); ``segment`` is the registered segment."""
        segment.allocator, segment.held = plan.segment.allocator, plan.segment.held
        segment.doubtful = plan.doubtful
        for reusable_at, _, offset, size in plan.held_back:
            for start, length in segment.allocator.free_blocks():
                lo, hi = max(start, offset), min(start + length, offset + size)
                if lo < hi and segment.allocator.reserve(lo, hi - lo):
                    plan.quarantine.append((reusable_at, segment.allocator, lo, hi - lo))
        self.quarantine.clear()
        self.quarantine.extend(sorted(plan.quarantine, key=lambda e: e[0]))
        for key in plan.fenced:
            log.warning("the write of %r in progress is fenced: segment %s brings back its lost object", key,
                        segment.segment_id)
            self._fence(key, self.objects[key])
        for key, meta in plan.replaced.items():
            self._release(key, meta, keep=segment.segment_id)
        for key, meta in plan.objects.items():
            if meta.replicas:
                self.objects[key] = meta
                self.found(key, meta.replicas)
            else:
                self.objects.pop(key, None)
                self._remember_lost(key, plan.lost[key])
            self._touch(meta)
        segment.catalog_version += 1
        generations = [r.generation for m in plan.objects.values() for r in m.replicas]
        self.next_put_id = max([self.next_put_id, *(g + 1 for g in generations)])
        adopted = sum(1 for m in plan.objects.values() for r in m.replicas if r.segment_id == segment.segment_id)
        log.info("segment %s: adopted %d object(s) it still holds, ignored %d", segment.segment_id, adopted,
                 plan.skipped)
        if plan.notes:
            log.warning("segment %s holds objects that differ from what the journal says (it lost records, or was "
                        "restored from an older copy); the segment's, verified, are taken: %s%s", segment.segment_id,
                        "; ".join(plan.notes[:5]), f"; ... ({len(plan.notes) - 5} more)" if len(plan.notes) > 5
                        else "")
        lost = [k for k, m in plan.objects.items() if not m.replicas]
        if lost:
            log.warning("segment %s: %d object(s) lost, written over%s", segment.segment_id, len(lost),
                        some_keys(lost))
