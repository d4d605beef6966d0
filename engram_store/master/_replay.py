"""Journal replay in the master's state: rebuilding segments and objects from records, and the compact snapshot.

Replay follows the records in order and frees a removed object's space at once: the reuse delay protects readers
of the running master, and every record of an object that took that space later comes after the remove's record.
Replay therefore never depends on how much wall-clock time passed between records. The space of removed objects
that nothing took again is quarantined for the reuse delay once replay is over, since a reader may still hold the
placement the previous master gave it.
"""

from __future__ import annotations

import logging

from engram_store.errors import EngramError, JournalError

from ._records import COMPLETE, LostObject, ObjectMeta, Replica

log = logging.getLogger("engram_store.master._state")


def _replica(entry: list) -> Replica:
    """A replica as journalled: ``[segment_id, offset]`` (older journals) or ``[segment_id, offset, generation]``."""
    return Replica(str(entry[0]), int(entry[1]), int(entry[2]) if len(entry) > 2 else 0)


class Replay:
    """The journal part of :class:`~._state.MasterState` (a mixin)."""

    def replay(self, records) -> int:
        """Rebuild state from journal records (without re-journalling); returns the record count.

        Restored segments get a fresh heartbeat deadline; a segment that died while the master was
        down misses it and is dropped then. They are unconfirmed: nothing is allocated on one until it registers
        again, with a new write key that fences every put the old master had started there, and offers back what
        it holds, which the master compares with what the journal says (see :mod:`._adoption`). Leases are not
        restored: they only ever delay a remove.
        """
        journal, self.journal = self.journal, (lambda record: None)
        freed: list[tuple[str, int, int]] = []  # space of removed objects: quarantined after replay
        count = 0
        try:
            for record in records:
                count += 1
                try:
                    self._replay_record(record, freed)
                except EngramError as exc:  # a record the schema allows that contradicts the ones before it
                    raise JournalError(f"journal: record {count} ({record.get('op')}) cannot be replayed: {exc}; "
                                       "refusing to start") from None
        finally:
            self.journal = journal
        self._quarantine_replayed(freed)
        # Past every put id the journal names, a removed or lost object's too: segments know a range's writer by
        # its put id (a removed object's id marks its range removed there), and a lost object is told from one
        # written anew under its key by its id.
        generations = [r.generation for m in self.objects.values() for r in m.replicas]
        generations += [p.generation for lost in self.lost.values() for p in lost.places]
        generations += [generation for _, generation in self.removed]
        self.next_put_id = max([self.next_put_id, *(g + 1 for g in generations)])
        return count

    def _replay_record(self, record: dict, freed: list[tuple[str, int, int]]) -> None:
        op = record.get("op")
        if op == "segment":
            self.register_segment(record["segment_id"], record["address"], record["size"], record["shm_path"],
                                  record["host_id"], record.get("public_key") or "",
                                  read_addresses=tuple(record.get("read_addresses") or ()), confirmed=False)
        elif op == "drop_segment":
            self.drop_segment(record["segment_id"], record.get("reason") or "was dropped")
        elif op == "object":
            self._replay_object(record)
        elif op == "remove":
            meta = self.objects.pop(record["key"], None)
            if meta is not None:
                self.remember_removed(record["key"], meta)
                freed += self._free_replicas(meta)
            elif record["key"] in self.lost:
                self._forget_lost(record["key"])
        elif op == "lost":
            self._remember_lost(record["key"], LostObject(
                str(record.get("message") or f"object {record['key']!r} was lost"), int(record["size"]),
                int(record.get("replica_num") or 1), str(record.get("checksum") or ""),
                [_replica(p) for p in record.get("places") or ()]))
        elif op == "removed":
            self.removed[(str(record["key"]), int(record["generation"]))] = None
        elif op == "put_ids":  # ids below it may have been handed out: the next starts there
            self.next_put_id = max(self.next_put_id, int(record["below"]))
        elif op == "forget_lost":
            for key in list(self.lost):
                self._forget_lost(key)
        elif op == "batch":  # one change made at once: the objects it places again give up their old space first
            self._free_replaced(record["records"])
            for inner in record["records"]:
                self._replay_record(inner, freed)
        else:  # the journal's reader refuses these before replay
            raise JournalError(f"journal: cannot replay a record of unknown op {op!r}")

    def _free_replaced(self, records: list[dict]) -> None:
        """Before a batch's records replay, free the space of each object a record of the batch places again (a
        segment's adoption replaces an object whose space another object of the same batch now holds: in record
        order the newcomer would find that space still taken). Keys the batch also removes replay in order."""
        removed = {str(r.get("key")) for r in records if r.get("op") == "remove"}
        for inner in records:
            key = str(inner.get("key"))
            if inner.get("op") == "object" and key not in removed:
                old = self.objects.pop(key, None)
                if old is not None:
                    self._free_replicas(old)

    def found(self, key: str, replicas: list[Replica]) -> None:
        """An object of ``key`` with ``replicas`` is known again: a lost one of the key is restored by it, or (written
        anew while it was lost) is removed, so its bytes never come back over the new object."""
        if key in self.lost and not any(r.generation == p.generation for r in replicas
                                        for p in self.lost[key].places):
            self._forget_lost(key)
        self.lost.pop(key, None)

    def _free_replicas(self, meta: ObjectMeta) -> list[tuple[str, int, int]]:
        freed = []
        for replica in meta.replicas:
            segment = self.segments.get(replica.segment_id)
            if segment is not None:
                segment.allocator.free(replica.offset, meta.size)
                freed.append((replica.segment_id, replica.offset, meta.size))
        return freed

    def _quarantine_replayed(self, freed: list[tuple[str, int, int]]) -> None:
        """Hold the space of replayed removes that is still free for the reuse delay, counted from now."""
        if self.reuse_delay_s <= 0:
            return
        reusable_at = self.clock() + self.reuse_delay_s
        for segment_id, offset, size in freed:
            segment = self.segments.get(segment_id)
            if segment is None:
                continue
            for start, length in segment.allocator.free_blocks():
                lo, hi = max(start, offset), min(start + length, offset + size)
                if lo < hi and segment.allocator.reserve(lo, hi - lo):
                    self.quarantine.append((reusable_at, segment.allocator, lo, hi - lo))

    def _replay_object(self, record: dict) -> None:
        key, size = record["key"], int(record["size"])
        old = self.objects.pop(key, None)
        if old is not None:  # the same object again, with a replica more or less: its space is its own
            self._free_replicas(old)
        replicas, refused = [], []
        for entry in record["replicas"]:
            replica = _replica(entry)
            segment = self.segments.get(replica.segment_id)
            if segment is not None and segment.allocator.reserve(replica.offset, size):
                replicas.append(replica)
            else:
                refused.append(replica)
        checksum = str(record.get("checksum") or "")
        replica_num = int(record.get("replica_num") or len(replicas) or 1)
        for replica in refused:
            log.warning("journal: object %r (%d bytes) at segment %s offset %d overlaps space the journal gives "
                        "another object, or a segment it does not know; that replica is not restored", key, size,
                        replica.segment_id, replica.offset)
        if replicas:
            self.found(key, replicas)
            self.objects[key] = ObjectMeta(size, replica_num, replicas, COMPLETE, checksum=checksum)
        elif refused:
            message = (f"object {key!r} was lost: the journal's record of it could not be replayed (its space at "
                       + ", ".join(f"segment {r.segment_id} offset {r.offset}" for r in refused)
                       + " overlaps another object's)")
            self._remember_lost(key, LostObject(message, size, replica_num, checksum, refused))

    def snapshot(self) -> list[dict]:
        """The journal records that rebuild the current durable state (used to compact the journal)."""
        records = [{"op": "segment", "segment_id": s.segment_id, "address": s.address, "size": s.size,
                    "shm_path": s.shm_path, "host_id": s.host_id, "public_key": s.public_key,
                    "read_addresses": list(s.read_addresses)}
                   for s in self.segments.values()]
        records += [{"op": "object", "key": k, "size": m.size, "replica_num": m.replica_num,
                     "replicas": [r.record() for r in m.replicas], "checksum": m.checksum}
                    for k, m in self.objects.items() if m.state == COMPLETE]
        records += [lost.record(key) for key, lost in self.lost.items()]
        records += [{"op": "removed", "key": key, "generation": generation} for key, generation in self.removed]
        records.append({"op": "put_ids", "below": max(self.put_ids_below, self.next_put_id)})
        return records
