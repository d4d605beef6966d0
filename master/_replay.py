"""Journal replay in the master's state: rebuilding segments and objects from records, and the compact snapshot."""

from __future__ import annotations

import logging

from ._records import COMPLETE, ObjectMeta, Replica

log = logging.getLogger("master._state")


class Replay:
    """The journal part of :class:`~._state.MasterState` (a mixin)."""

    def replay(self, records) -> int:
        """Rebuild state from journal records (without re-journalling); returns the record count.

        Restored segments get a fresh heartbeat deadline; a segment that died while the master was
        down misses it and is dropped then. They are unconfirmed: nothing is allocated on one until it registers
        again, with a new write key that fences every put the old master had started there. Leases are not
        restored: they only ever delay a remove.
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
                                          read_addresses=tuple(record.get("read_addresses") or ()),
                                          confirmed=False)
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
            self.objects[key] = ObjectMeta(size, record.get("replica_num", len(replicas)), replicas, COMPLETE,
                                           checksum=str(record.get("checksum") or ""))

    def snapshot(self) -> list[dict]:
        """The journal records that rebuild the current durable state (used to compact the journal)."""
        records = [{"op": "segment", "segment_id": s.segment_id, "address": s.address, "size": s.size,
                    "shm_path": s.shm_path, "host_id": s.host_id, "public_key": s.public_key,
                    "read_addresses": list(s.read_addresses)}
                   for s in self.segments.values()]
        records += [{"op": "object", "key": k, "size": m.size, "replica_num": m.replica_num,
                     "replicas": [[r.segment_id, r.offset] for r in m.replicas], "checksum": m.checksum}
                    for k, m in self.objects.items() if m.state == COMPLETE]
        return records
