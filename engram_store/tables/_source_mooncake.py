"""Tables in a real Mooncake store (``mooncake.store.MooncakeDistributedStore``, or any store with its calls).

Reads use the same planning as this project's store (distinct rows per head merged into byte ranges) over
Mooncake's ``get_into_ranges``, into a staging buffer registered with the store, then scattered into the output;
a source closed or dropped leaves its buffer registered for the next source of the store (``_SPARES``).
Tables are uploaded hard-pinned (``_replicate_config``), so Mooncake's eviction never drops them.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import numpy as np

from .. import kernels as _kernels
from ..errors import InvalidArgument, LeaseActive, ObjectNotFound, StoreError
from ._keyed import KeyedSource, Upload, check_code
from ._layout import Layer
from ._source import Job

log = logging.getLogger(__name__)

#: Mooncake's ErrorCode::OBJECT_NOT_FOUND and OBJECT_HAS_LEASE, as its Python methods return them.
_MOONCAKE_OBJECT_NOT_FOUND = -704
_MOONCAKE_OBJECT_HAS_LEASE = -706


class MooncakeSource(KeyedSource):
    """Layers in a Mooncake store, one key per head and the manifest; ``lay.state`` says the manifest was checked."""

    def __init__(self, store: Any, require_manifest: bool, threads: int = 1):
        super().__init__(store, require_manifest, threads)
        self._lock = threading.Lock()
        self._staging: np.ndarray | None = None  # registered buffer for the distinct rows of a read
        self._staging_release: weakref.finalize | None = None

    # ---- the store's primitives (see KeyedSource) -------------------------------------------------------------

    def exists(self, keys: list[str]) -> list[bool]:
        result = self.store.batch_is_exist(keys)
        out = []
        for key, r in zip(keys, result):
            if r not in (0, 1, True, False):
                raise StoreError(f"batch_is_exist: the store answered {r!r} for {key!r}")
            out.append(bool(r))
        return out

    def get_manifest(self, lay: Layer) -> bytes | None:
        if not self.exists([lay.manifest_key])[0]:
            return None
        return self.store.get(lay.manifest_key) or None

    def put_manifest(self, lay: Layer, data: bytes, replica_num: int, heads: dict[str, int] | None = None) -> None:
        # (Mooncake names no generations: the heads are not checked as the manifest is published.)
        _mooncake_put(self.store, lay.manifest_key, np.frombuffer(data, dtype=np.uint8).copy(),
                      _replicate_config(replica_num))

    def put_tables(self, lay: Layer, tables: list[np.ndarray], replica_num: int, bar: Any) -> Upload:
        from concurrent.futures import ThreadPoolExecutor

        from ._manifest import checksums

        # The manifest's checksums are computed while the tables upload (the hash releases the GIL).
        with ThreadPoolExecutor(1, thread_name_prefix=f"engram-l{lay.layer_id}-checksum") as pool:
            sums = pool.submit(checksums, tables)
            self._upload(lay, tables, replica_num, bar)
            return Upload(*sums.result())

    def remove_key(self, key: str, force: bool) -> bool:
        # Remove first and read the code; no existence check before it: on a real Mooncake store
        # is_exist/batch_is_exist grant the key a read lease (-default_kv_lease_ttl, 10 s by default),
        # so checking first made every remove without force fail with OBJECT_HAS_LEASE (-706).
        try:
            code = self.store.remove(key, force)
        except TypeError:  # an older binding without the force argument
            code = self.store.remove(key)
        if code == _MOONCAKE_OBJECT_NOT_FOUND:
            return False
        if code != 0:
            if code != _MOONCAKE_OBJECT_HAS_LEASE and not self.exists([key])[0]:
                return False
            raise LeaseActive(f"remove {key!r}: the store refused with code {code} (a read lease may be "
                              "live: Mooncake leases a key for -default_kv_lease_ttl, 10 s by default, "
                              "after each read or existence check; pass force=True)")
        return True

    def read_head(self, lay: Layer, j: int) -> np.ndarray:
        n = lay.sizes[j]
        ids = np.zeros((n, lay.num_heads), dtype=np.int64)
        ids[:, j] = np.arange(n, dtype=np.int64)
        out = np.empty((n, lay.num_heads, lay.row_bytes), dtype=np.uint8)
        self._read_one(lay, ids, out.reshape(-1))
        return np.ascontiguousarray(out[:, j]).reshape(-1)

    def forget(self, lay: Layer) -> None:
        lay.state = None  # the manifest is checked again on the next read

    def detach(self, lay: Layer) -> None:
        self.forget(lay)

    # ---- reads ------------------------------------------------------------------------------------------------

    def read(self, jobs: list[Job]) -> None:
        for job in jobs:
            self._read_one(job.layer, job.ids, job.out)
            job.layer.counters.add(lookups=1, rows=job.ids.size)

    def _read_one(self, lay: Layer, ids: np.ndarray, flat: np.ndarray) -> None:
        """The store's planning over Mooncake's ``get_into_ranges`` (one call for all heads of the layer)."""
        if not lay.state:
            self.check_published(lay)
            lay.state = True
        H = lay.num_heads
        heads = np.arange(H, dtype=np.int64)
        uniq, head_starts, inverse = _kernels.plan_unique_rows(ids, heads)
        need = int(uniq.size) * lay.row_bytes
        with self._lock:
            staging = self._staging
            if staging is None or staging.nbytes < need:
                staging = self._new_staging(need)
            all_keys, all_dst, all_src, all_sizes = [], [], [], []
            zero = np.zeros(1, dtype=np.int64)
            for h in range(H):
                rows = uniq[head_starts[h]:head_starts[h + 1]]
                offsets, lengths, _ = _kernels.rows_to_ranges(rows, np.array([0, rows.size], dtype=np.int64),
                                                              zero, lay.row_bytes)
                dst = int(head_starts[h]) * lay.row_bytes + np.concatenate(([0], np.cumsum(lengths)[:-1]))
                all_keys.append(lay.keys[h])
                all_dst.append(dst.tolist())
                all_src.append(offsets.tolist())
                all_sizes.append(lengths.tolist())
            results = self.store.get_into_ranges([staging.ctypes.data], [all_keys], [all_dst], [all_src], [all_sizes])
            # Mooncake answers per range with the bytes read, or a negative code (the same for every range
            # of a key that cannot be read). -704 is OBJECT_NOT_FOUND: name it, as the native path does.
            for h, (sizes, got) in enumerate(zip(all_sizes, results[0])):
                if list(got) != sizes:
                    if any(int(g) == _MOONCAKE_OBJECT_NOT_FOUND for g in got):
                        raise ObjectNotFound(f"get_into_ranges: key {lay.keys[h]!r} is not in the store "
                                             f"(code {_MOONCAKE_OBJECT_NOT_FOUND}); populate layer "
                                             f"{lay.layer_id} first")
                    raise StoreError(f"get_into_ranges: key {lay.keys[h]!r} returned {list(got)[:4]}..., "
                                     f"expected the requested sizes")
            _kernels.scatter_rows_prepared(staging[:need], inverse, heads, 0, lay.row_bytes, flat)

    def _upload(self, lay: Layer, tables: list[np.ndarray], replica_num: int, bar: Any) -> None:
        store = self.store
        config = _replicate_config(replica_num)
        written: list[str] = []
        done = 0
        try:
            for key, table in zip(lay.keys, tables):
                _mooncake_put(store, key, table, config)
                written.append(key)
                done += table.nbytes
                bar(done)
        except BaseException:
            for key in written:
                try:
                    store.remove(key)
                except Exception:
                    log.exception("rollback: could not remove %r", key)
            raise

    def _new_staging(self, need: int) -> np.ndarray:
        """A registered staging buffer of at least ``need`` bytes in place of this source's own (called under the
        lock, in a read: the store is open). A smaller one of its own is unregistered; the new one is a spare
        another source of this store left (see :data:`_SPARES`) or a new registration."""
        store = self.store
        if self._staging_release is not None:
            self._staging_release.detach()
            self._staging_release = None
            old, self._staging = self._staging, None
            check_code(store.unregister_buffer(old.ctypes.data), "unregister_buffer", "staging buffer")
        staging = _take_spare(store, need)
        if staging is None:
            staging = np.empty(max(need, 1 << 20), dtype=np.uint8)
            check_code(store.register_buffer(staging.ctypes.data, staging.nbytes), "register_buffer",
                       "staging buffer")
        self._staging = staging
        # Closed or dropped, this source hands the buffer, still registered, to the next source of the store: a
        # call into the store then could find it closed (Mooncake's client crashes the process there).
        self._staging_release = weakref.finalize(self, _park, store, staging)
        return staging

    def close(self) -> None:
        with self._lock:
            self._staging = None
            release, self._staging_release = self._staging_release, None
        if release is not None:
            release()


def _replicate_config(replica_num: int):
    """Mooncake's ReplicateConfig for a table upload: ``replica_num`` copies, hard-pinned.

    Hard pin is what keeps a table in a real Mooncake store: its master evicts unpinned objects whose read
    lease has run out as soon as a segment passes ``-eviction_high_watermark_ratio`` (0.9) or an allocation
    fails, and with the default config (no pin) a table would silently disappear under memory pressure.
    ``with_hard_pin`` objects are never eviction candidates (tests/mooncake checks both behaviours). Without
    the mooncake package (a duck-typed store) a single replica needs no config, as before.
    """
    try:
        from mooncake.store import ReplicateConfig  # type: ignore
    except ImportError:
        if replica_num == 1:
            return None
        raise InvalidArgument("replica_num > 1 on a Mooncake store needs mooncake.store.ReplicateConfig") from None
    config = ReplicateConfig()
    config.replica_num = replica_num
    config.with_hard_pin = True  # tables are immutable once published: never evicted
    return config


def _mooncake_put(store: Any, key: str, buffer: np.ndarray, config: Any) -> None:
    """Upload ``buffer`` (C-contiguous) under ``key`` to a Mooncake store: registered for the transfer, put
    with ``config`` (a ReplicateConfig, or None for the store's default), unregistered whatever happens."""
    ptr = buffer.ctypes.data
    check_code(store.register_buffer(ptr, buffer.nbytes), "register_buffer", key)
    try:
        codes = (store.batch_put_from([key], [ptr], [buffer.nbytes], config) if config is not None
                 else store.batch_put_from([key], [ptr], [buffer.nbytes]))
        check_code(codes[0], "batch_put_from", key)
    finally:
        store.unregister_buffer(ptr)


#: Registered staging buffers that no source holds, per store (by id: a weak reference to the store, or the store
#: itself where it takes none, and the buffers): the next source of the store that needs one takes it. A buffer
#: is never unregistered from a close or a finalizer, where the store may be closed already (a call into a closed
#: Mooncake store crashes the process); nor is it freed while it may be registered, or the store would refuse a
#: later buffer at the same address ("overlapped memory"). So spares live as long as their store: with Mooncake's
#: own store their registrations die with it; behind any other object (a wrapper, a proxy) the store may live on,
#: and they are kept in ``_KEPT``.
_SPARES: dict[int, tuple[Any, bool, list[np.ndarray]]] = {}
_KEPT: list[np.ndarray] = []
#: Reentrant: a garbage collection inside _take_spare may run a source's finalizer (_park) or a store's
#: weak-reference callback (_store_gone) on the same thread.
_SPARES_LOCK = threading.RLock()


def _spares(store: Any, create: bool) -> list[np.ndarray] | None:
    key = id(store)
    entry = _SPARES.get(key)
    if entry is not None:
        ref, _, spares = entry
        if (ref() if isinstance(ref, weakref.ref) else ref) is store:
            return spares
    if not create:
        return None
    try:
        ref = weakref.ref(store, lambda gone: _store_gone(key, gone))
    except TypeError:
        ref = store  # no weak reference: its spares keep it
    spares = []
    _SPARES[key] = (ref, type(store).__module__.partition(".")[0] == "mooncake", spares)
    return spares


def _store_gone(key: int, ref: weakref.ref) -> None:
    with _SPARES_LOCK:
        entry = _SPARES.get(key)
        if entry is None or entry[0] is not ref:
            return
        del _SPARES[key]
        if not entry[1]:
            _KEPT.extend(entry[2])  # the store behind this object may live on, the buffers registered with it


def _park(store: Any, buffer: np.ndarray) -> None:
    """Keep a source's registered staging buffer for the next source of ``store`` (its close, or its finalizer)."""
    with _SPARES_LOCK:
        _spares(store, create=True).append(buffer)


def _take_spare(store: Any, need: int) -> np.ndarray | None:
    """A registered spare of ``store`` of at least ``need`` bytes, taken from the spares, or None."""
    with _SPARES_LOCK:
        spares = _spares(store, create=False)
        for i, buffer in enumerate(spares or ()):
            if buffer.nbytes >= need:
                return spares.pop(i)
    return None
