"""The SSD tier: Engram layers published as files on local disk, read a page per row behind a hot-row cache.

For tables larger than the host's memory (DeepSeek-V4.1's ~101 GB layers of 264-byte FP8 rows)::

    from engram_store.disk import DiskDir, RowCache

    d = DiskDir("/nvme/engram")
    d.write(1, row_bytes, sizes, heads)            # arrays or fill(start_row, out) callbacks, streamed
    cache = RowCache(8 << 30, row_bytes)           # one cache for every layer of the process
    with d.open(1, row_bytes, sizes, cache=cache) as layer:
        layer.read_rows(ids, out)                  # ids int64 [M, H]; out flat uint8 [M * H * row_bytes]
        read_many([(layer, ids, out), ...])        # several layers' reads in flight together

Rows never straddle a 4 KiB page (``_layout``); reads go through O_DIRECT with many in flight (``_reader``); the
cache is set-associative with CLOCK eviction and a choice of admission (``_cache``), one per process or one per
host in shared memory (``HostRowCache``, ``_host_cache``), warm-started from a profile of frequent rows
(``warm_layer``, ``_profile``).
"""
from ._cache import RowCache
from ._dir import DiskDir, verify_layer
from ._host_cache import HostRowCache
from ._host_mrc import HostCurve
from ._mrc import SIZE_LADDER, MissRatioCurve, bytes_for_rows
from ._profile import LayerProfile, load_profile, save_profile, warm_layer
from ._layout import PAGE_BYTES, DiskLayout
from ._reader import (DEFAULT_DEPTH, DiskLayer, DiskReadError, IOEngine, aio_available, default_engine, read_checked,
                      read_many)
from ._writer import LayerWriter, write_layer

__all__ = [
    "DiskDir", "DiskLayer", "DiskLayout", "DiskReadError", "HostCurve", "HostRowCache", "IOEngine", "LayerProfile",
    "LayerWriter",
    "MissRatioCurve", "SIZE_LADDER", "bytes_for_rows",
    "RowCache", "PAGE_BYTES", "DEFAULT_DEPTH", "aio_available", "default_engine", "load_profile", "read_checked",
    "read_many",
    "save_profile", "verify_layer", "warm_layer", "write_layer", "warmup",
]


def warmup() -> None:
    """Compile (or load from the on-disk cache) the disk kernels: a tiny layer written, cached and read back."""
    import tempfile

    import numpy as np

    sizes = [20, 3]
    row = 24  # 170 rows to a page leave room for its checksum: the checked read path is compiled too
    tables = [(np.arange(n * row) % 251).astype(np.uint8).reshape(n, row) for n in sizes]
    with tempfile.TemporaryDirectory(prefix="engram-disk-warmup-") as tmp:
        d = DiskDir(tmp)
        d.write(0, row, sizes, [tables[0], lambda start, out: out.__setitem__(slice(None), tables[1][start:])],
                progress=False)
        d.verify(0)
        ids = np.array([[0, 1], [19, 2], [5, 0]], dtype=np.int64)
        out = np.empty(ids.size * row, dtype=np.uint8)
        for mode in ("auto", "threads"):
            with IOEngine(2, mode) as engine, d.open(0, row, sizes, cache=RowCache(1 << 12, row),
                                                     engine=engine) as layer:
                layer.read_rows(ids, out)
                layer.read_rows(ids, out)
                warm_layer(layer, LayerProfile.from_counts([0, 1], [3, 2], [5, 4]))
        from . import _cache_kernels as ck

        ck._cache_repair(RowCache(1 << 12, 8).meta, 0)
        ck._counter_add(np.zeros(2, dtype=np.int64), 0, 1)
        ck._count_lookup(np.zeros(2, dtype=np.int64), 1, 1)
        curve = MissRatioCurve(2)
        col0 = curve.add_columns(2)
        buf = np.zeros(9, dtype=np.int64)
        buf[2] = 1 << 32
        curve.observe(ids, np.array([0, 20], dtype=np.int64), 1, col0, buf)  # past 2 keys: the rate drops
        curve.replay(buf[3:3 + buf[0]], buf[6:6 + buf[0]], np.arange(2, dtype=np.int64))
        curve.hits([0, 1], [1.0, 10.0])
