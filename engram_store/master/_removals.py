"""Removal in the master's state: objects removed (all or nothing, by key or by the put that wrote them), their
space quarantined for the reuse delay, removed and lost keys remembered."""

from __future__ import annotations

import logging

from engram_store.errors import LeaseActive, ObjectNotFound

from ._records import COMPLETE, LOST_KEYS_KEPT, PENDING, REMOVED_KEPT, LostObject, ObjectMeta, Replica

log = logging.getLogger("engram_store.master._state")


class Removals:
    """The removal part of :class:`~._state.MasterState` (a mixin: the state holds objects, segments, the lost and
    removed keys, the quarantine)."""

    def remove(self, key: str, force: bool = False) -> list[Replica] | None:
        """Remove a complete object, or with ``force`` a put still being written (it is fenced). Removing a lost
        object (its data died with its segments) forgets the loss, so the key reads as absent again, as ``exists``
        already says, and can be written anew. Returns the replicas of a complete object removed."""
        meta = self.objects.get(key)
        if meta is None and key not in self.lost:
            raise ObjectNotFound(f"remove: no object under key {key!r}")
        if meta is not None and not force:
            self._check_removable(key, meta, self.clock())
        return self._remove_keys([key])[key] or None

    def remove_many(self, keys: list[str], force: bool = False,
                    generations: list[int] | None = None) -> dict[str, list[Replica]]:
        """Remove several objects, all or nothing: if a read lease (or, without ``force``, a write in progress)
        holds any of them, none is removed and LeaseActive names it; if the journal cannot take the removal, none
        is removed and JournalError says why. Keys that are absent are skipped. Returns the replicas of each object
        removed, by key (lost objects and writes in progress: none).

        ``generations`` (one per key) removes only the objects those puts wrote: a key now holding another put's
        object is skipped like an absent one. A writer undoing its own failed write passes the generations its
        puts got, so it never removes what another writer put under the same keys meanwhile."""
        if generations is not None:
            keys = [k for k, g in zip(keys, generations) if self._written_by(k, g)]
        keys = [k for k in dict.fromkeys(keys) if k in self.objects or k in self.lost]
        if not force:
            now = self.clock()
            for key in keys:
                if key in self.objects:
                    self._check_removable(key, self.objects[key], now, f"nothing of the {len(keys)} objects was "
                                                                       "removed; ")
        return self._remove_keys(keys)

    def _check_removable(self, key: str, meta: ObjectMeta, now: float, said: str = "") -> None:
        """LeaseActive unless the object may be removed without ``force``."""
        if meta.state == PENDING:
            raise LeaseActive(f"remove {key!r}: a write is in progress (last renewed by its writer "
                              f"{now - meta.renewed:.1f} s ago); {said}pass force=True to revoke it")
        if meta.lease_until > now:
            raise LeaseActive(f"remove {key!r}: a read lease is live for {meta.lease_until - now:.2f} s more; "
                              f"{said}pass force=True")

    def _remove_keys(self, keys: list[str]) -> dict[str, list[Replica]]:
        """Remove each key (complete: released; being written: fenced; lost: forgotten), after one journal record
        of them all; returns the replicas of each complete object removed, by key."""
        self._record(*[{"op": "remove", "key": key} for key in keys
                       if key in self.lost or self.objects[key].state == COMPLETE])
        removed = {}
        for key in keys:
            meta = self.objects.get(key)
            removed[key] = []
            if meta is not None and meta.state == PENDING:
                log.warning("put of %r revoked by a forced remove", key)
                self._fence(key, meta)
            elif meta is not None:
                self._release(key, meta)
                removed[key] = meta.replicas
            if key in self.lost:
                self._forget_lost(key)
        return removed

    def _written_by(self, key: str, generation: int) -> bool:
        """Whether the object under ``key`` (complete, pending or lost) is the one the put ``generation`` wrote
        (0: whichever is there)."""
        if not generation:
            return key in self.objects or key in self.lost
        meta = self.objects.get(key)
        if meta is not None:
            return meta.put_id == generation or any(r.generation == generation for r in meta.replicas)
        lost = self.lost.get(key)
        return lost is not None and any(r.generation == generation for r in lost.places)

    def remove_all(self, force: bool = False) -> tuple[int, int]:
        """Remove every complete object (and forget every lost one; with ``force`` also revoke every pending put),
        in one journal record; returns (removed, refused by a lease or a write in progress)."""
        now = self.clock()
        keys = [k for k, m in self.objects.items() if force or (m.state == COMPLETE and m.lease_until <= now)]
        refused = len(self.objects) - len(keys)
        self._remove_keys(list(dict.fromkeys([*keys, *self.lost])))
        return len(keys), refused

    def _release(self, key: str, meta: ObjectMeta, keep: str = "") -> None:
        """Forget a complete object; its space is quarantined (readers may hold its placement), except on the
        segment ``keep`` (whose space the caller has dealt with)."""
        self._touch(meta)
        self.remember_removed(key, meta)
        reusable_at = self.clock() + self.reuse_delay_s
        for replica in meta.replicas:
            segment = self.segments.get(replica.segment_id)
            if segment is None or replica.segment_id == keep:
                continue
            if self.reuse_delay_s > 0 and meta.size:
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

    def _forget_lost(self, key: str) -> None:
        """A lost object is removed: a segment that comes back with its bytes does not bring it back."""
        lost = self.lost.pop(key)
        self.remember_removed(key, ObjectMeta(lost.size, lost.replica_num, lost.places, COMPLETE))

    def remember_removed(self, key: str, meta: ObjectMeta) -> None:
        for replica in meta.replicas:
            if replica.generation:
                self.removed[(key, replica.generation)] = None
        while len(self.removed) > REMOVED_KEPT:
            self.removed.popitem(last=False)

    def _remember_lost(self, key: str, lost: LostObject) -> None:
        self.lost.pop(key, None)
        self.lost[key] = lost
        while len(self.lost) > LOST_KEYS_KEPT:
            self.lost.popitem(last=False)
