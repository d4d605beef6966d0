"""The SSD tier: the device's own floor, the I/O engines, the hot-row cache policies and the tier's lookups.

    python bench/bench_disk.py [--dir DIR] [--size 30GB] [--quick] [--sections floor,engine,policy,tier,hit]
                               [--tier-lookups decode,prefill] [--layer-table 8GB] [--seed N] [--json PATH]

Sections (all by default):

* ``floor``: random 4 KiB O_DIRECT reads of the layer's file at queue depths 1, 8, 32, 64: IOPS and p50/p99
  latency, from ``fio`` (io_uring) when it is installed and from plain ``os.preadv`` calls in Python threads.
* ``engine``: the same random page reads through the tier's engines (Linux native AIO from the calling thread,
  and Numba ``nogil`` ``pread`` loops in T threads) beside a pool of Python threads calling ``os.preadv`` per
  page, at the same queue depths, in short rounds alternating with fio (io_uring and libaio).
* ``policy``: hit rate and cost per lookup of the hot-row caches on Zipfian (s = 0.8, 1.0, 1.2) and uniform row
  streams, cache at 1%, 10% and 50% of a scaled-down layer: the project's direct-mapped cache
  (``engram_store.kernels.cache_probe``), the tier's 7-way set-associative cache with CLOCK eviction, and the
  same with doorkeeper admission.
* ``tier``: ``DiskLayer.read_rows`` on the full layer: decode-sized (64 x 48 rows) and prefill-sized
  (4,096 x 48 rows) lookups, cold (no cache) and with a cache of 1%, 10% and 50% of the layer, Zipf(1.0) and
  uniform ids: rows/s, p50/p99, hit rate, pages per lookup.
* ``hit``: a lookup served wholly from the cache beside the local-direct gather kernel reading the same rows from
  memory (packed in a table of their own, and scattered over a ``--layer-table``-sized table as a real layer's
  are) and ``np.take``; then ``EngramStore.lookup_into`` from a cached disk layer beside the same call on the same
  tables bound in memory, and beside itself without the hit rate at every cache size (``stats()
  ['hit_rate_by_size']``: what keeping it costs a lookup).

The layer (48 heads of 264-byte rows, ``--size`` bytes, 30 GB by default: more than this machine's memory) is
written once under ``--dir`` and reused by later runs. Row ``r`` of head ``h`` starts with the 8 bytes of
``h << 40 | r``, so every read is checked.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from _common import Stats, default_json_path, fmt, print_table, write_json

from engram_store import EngramStore, EngramStoreConfig
from engram_store import kernels as ground
from engram_store.units import parse_size
from engram_store.disk import DiskDir, DiskLayer, IOEngine, RowCache, read_many
from engram_store.disk import _kernels as dk
from engram_store.disk._files import aligned_empty, open_direct

HEADS = 48
ROW_BYTES = 264
LAYER_ID = 0
QUEUE_DEPTHS = (1, 8, 32, 64)
DECODE_ROWS = 64      # requests of a decode step, one token each
PREFILL_ROWS = 4096   # tokens of a prefill


# ---- the layer ----------------------------------------------------------------------------------------------


def layer_sizes(size_bytes: int) -> list[int]:
    """Per-head row counts of a layer whose file is about ``size_bytes`` (15 rows a 4 KiB page)."""
    rows = size_bytes // 4096 * (4096 // ROW_BYTES)
    per_head = rows // HEADS
    return [per_head - h for h in range(HEADS)]


def pattern_rows(heads: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """Write row ``rows[i]`` of head ``heads[i]`` in the layer's pattern into ``out[i]`` (``[n, ROW_BYTES]``): the
    8 bytes of ``h << 40 | r``, then that value mod 251 (what ``check_rows`` checks)."""
    keys = (np.asarray(heads, dtype=np.int64) << 40) | rows
    out[:, :8] = keys.view(np.uint8).reshape(-1, 8)
    out[:, 8:] = (keys % 251).astype(np.uint8)[:, None]


def row_keys(layer: DiskLayer, heads: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The keys ``layer``'s rows have in its cache (see ``engram_store.disk._kernels``)."""
    return (np.int64(layer.tag) << dk.KEY_ROW_BITS) | (layer.row_base[heads] + rows)


def fill_head(h: int):
    def fill(start: int, out: np.ndarray) -> None:
        pattern_rows(np.full(out.shape[0], h), np.arange(start, start + out.shape[0], dtype=np.int64), out)
    return fill


def ensure_layer(directory: str, size_bytes: int) -> tuple[DiskDir, list[int]]:
    d = DiskDir(directory)
    sizes = layer_sizes(size_bytes)
    path = d.layer_path(LAYER_ID)
    manifest = os.path.join(path, "manifest.json")
    if os.path.isfile(manifest):
        with open(manifest) as f:
            if json.load(f)["sizes"] == sizes:
                return d, sizes
        d.remove(LAYER_ID)
    elif os.path.isdir(path):  # what is left of a layer whose files were deleted by hand
        shutil.rmtree(path)
    free = shutil.disk_usage(directory).free
    need = sum(sizes) // 15 * 4096
    if need > free - (2 << 30):
        sys.exit(f"{directory}: {free / 1e9:.1f} GB free, the layer needs {need / 1e9:.1f} GB (use --size)")
    t0 = time.perf_counter()
    d.write(LAYER_ID, ROW_BYTES, sizes, [fill_head(h) for h in range(HEADS)])
    dt = time.perf_counter() - t0
    print(f"wrote {need / 1e9:.1f} GB in {dt:.0f} s ({need / dt / 1e9:.2f} GB/s)")
    return d, sizes


def check_rows(ids: np.ndarray, out: np.ndarray) -> None:
    got = out.reshape(ids.shape[0], HEADS, ROW_BYTES)[:, :, :8].copy().view(np.int64)[..., 0]
    want = (np.arange(HEADS, dtype=np.int64) << 40)[None, :] | ids
    if not np.array_equal(got, want):
        bad = np.argwhere(got != want)[0]
        raise SystemExit(f"wrong row at {tuple(bad)}: got {got[tuple(bad)]:#x}, want {want[tuple(bad)]:#x}")


# ---- floor ---------------------------------------------------------------------------------------------------


def random_pages(rng: np.random.Generator, file_bytes: int, n: int) -> np.ndarray:
    return rng.integers(0, file_bytes // 4096, n, dtype=np.int64) * 4096


def fio_floor(file: str, qd: int, seconds: float, engine: str = "io_uring") -> dict | None:
    """fio's random 4 KiB O_DIRECT reads (``engine``: io_uring, else libaio; one job, ``qd`` in flight, fresh
    offsets every run: a host that caches the VM's disk serves fio's default repeatable offsets from memory); None
    without fio."""
    if shutil.which("fio") is None:
        return None
    cmd = ["fio", "--name=floor", f"--filename={file}", "--readonly", "--rw=randread", "--bs=4k", "--direct=1",
           f"--ioengine={engine}", f"--iodepth={qd}", f"--runtime={int(seconds * 1000)}ms", "--time_based",
           "--randrepeat=0", "--output-format=json"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=True)
    except (subprocess.SubprocessError, OSError):
        cmd[cmd.index(f"--ioengine={engine}")] = "--ioengine=libaio"
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=True)
    job = json.loads(res.stdout)["jobs"][0]["read"]
    pct = job["clat_ns"]["percentile"]
    return {"iops": job["iops"], "p50_us": pct["50.000000"] / 1e3, "p99_us": pct["99.000000"] / 1e3}


def python_floor(file: str, qd: int, seconds: float, seed: int) -> dict:
    """Random 4 KiB reads with ``os.preadv`` from ``qd`` Python threads (O_DIRECT), each one read at a time."""
    fd, direct = open_direct(file, os.O_RDONLY)
    size = os.fstat(fd).st_size
    lat: list[list[int]] = [[] for _ in range(qd)]
    stop = time.perf_counter() + seconds

    def worker(t: int) -> None:
        rng = np.random.default_rng(seed + t)
        buf = [memoryview(aligned_empty(4096))]
        offsets = random_pages(rng, size, 1 << 16).tolist()
        mine = lat[t]
        i = 0
        while time.perf_counter() < stop:
            t0 = time.perf_counter_ns()
            os.preadv(fd, buf, offsets[i & 0xFFFF])
            mine.append(time.perf_counter_ns() - t0)
            i += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(qd)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    os.close(fd)
    all_ns = np.concatenate([np.asarray(x, dtype=np.int64) for x in lat])
    return {"iops": all_ns.size / elapsed, "p50_us": float(np.percentile(all_ns, 50)) / 1e3,
            "p99_us": float(np.percentile(all_ns, 99)) / 1e3, "direct": direct}


def section_floor(file: str, seconds: float, seed: int) -> list[dict]:
    rows = []
    for qd in QUEUE_DEPTHS:
        rows.append({"qd": qd, "fio": fio_floor(file, qd, seconds),
                     "python": python_floor(file, qd, seconds, seed + 100 * qd)})
    print_table(["queue depth", "fio IOPS", "fio p50 us", "fio p99 us", "py preadv IOPS", "py p50 us", "py p99 us"],
                [[r["qd"], fmt(r["fio"] and r["fio"]["iops"], 0), fmt(r["fio"] and r["fio"]["p50_us"]),
                  fmt(r["fio"] and r["fio"]["p99_us"]), fmt(r["python"]["iops"], 0), fmt(r["python"]["p50_us"]),
                  fmt(r["python"]["p99_us"])] for r in rows],
                title="floor: random 4 KiB O_DIRECT reads of the layer's file")
    return rows


# ---- engines ---------------------------------------------------------------------------------------------------


def python_engine_read(fd: int, offsets: np.ndarray, in_page: np.ndarray, out: np.ndarray, threads: int) -> None:
    """The candidate engine in Python: ``threads`` pool workers, each ``os.preadv`` a page and copy its row out."""
    n = offsets.size
    rows = out.reshape(n, ROW_BYTES)
    next_page = iter(range(n))
    lock = threading.Lock()

    def worker() -> None:
        page = aligned_empty(4096)
        view = [memoryview(page)]
        while True:
            with lock:
                j = next(next_page, -1)
            if j < 0:
                return
            if os.preadv(fd, view, int(offsets[j])) != 4096:
                raise OSError(f"short read at {offsets[j]}")
            rows[j] = page[in_page[j]:in_page[j] + ROW_BYTES]

    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(worker) for _ in range(threads)]:
            f.result()


def section_engine(d: DiskDir, sizes: list[int], pages: int, rounds: int, seed: int) -> list[dict]:
    """Per queue depth, ``rounds`` rounds of: one cold lookup of ``pages`` random pages through each engine, then
    fio (io_uring, the floor, and libaio) for half a second each; the median of each, and of each one's ratio to the
    floor measured beside it in its round (this disk's rate moves several-fold from one second to the next, so
    only ratios taken side by side mean anything)."""
    rng = np.random.default_rng(seed)
    results = []
    have_fio = shutil.which("fio") is not None
    for qd in QUEUE_DEPTHS:
        n = pages if qd > 1 else pages // 8
        m = max(1, n // HEADS)
        runs: dict[str, list[float]] = {"aio": [], "threads": [], "python": [], "fio": [], "fio_libaio": []}
        engines = {mode: IOEngine(qd, mode) for mode in ("aio", "threads")}
        layers = {mode: d.open(LAYER_ID, ROW_BYTES, sizes, engine=e) for mode, e in engines.items()}
        for layer in layers.values():
            layer.read_rows(np.zeros((2, HEADS), np.int64), np.empty(2 * HEADS * ROW_BYTES, np.uint8))
        lay = layers["aio"].layout
        fd, _ = open_direct(layers["aio"].file, os.O_RDONLY)
        def tier_read(mode: str) -> None:
            ids = np.stack([rng.integers(0, sizes[h], m) for h in range(HEADS)], axis=1)
            out = np.empty(ids.size * ROW_BYTES, dtype=np.uint8)
            layers[mode].stats(reset=True)
            t0 = time.perf_counter()
            layers[mode].read_rows(ids, out)
            runs[mode].append(layers[mode].stats()["pages_read"] / (time.perf_counter() - t0))
            check_rows(ids, out)

        def python_read() -> None:
            ids = np.stack([rng.integers(0, sizes[h], m) for h in range(HEADS)], axis=1)
            offs = np.array([lay.row_offset(h, int(r)) for (_, h), r in np.ndenumerate(ids)], dtype=np.int64)
            out = np.empty(ids.size * ROW_BYTES, dtype=np.uint8)
            t0 = time.perf_counter()
            python_engine_read(fd, offs // 4096 * 4096, offs % 4096, out, qd)
            runs["python"].append(ids.size / (time.perf_counter() - t0))
            check_rows(ids, out)

        def floor_read(engine: str) -> None:
            key = "fio" if engine == "io_uring" else "fio_libaio"
            if have_fio:
                runs[key].append(fio_floor(layers["aio"].file, qd, 0.5, engine)["iops"])
            else:
                floor = python_floor(layers["aio"].file, qd, 0.5, qd)["iops"] if key == "fio" else float("nan")
                runs[key].append(floor)

        steps = [lambda: tier_read("aio"), lambda: tier_read("threads"), python_read, lambda: floor_read("io_uring"),
                 lambda: floor_read("libaio")]
        for r in range(rounds):
            for k in range(len(steps)):  # each round starts one step later: a disk speeding up or slowing down
                steps[(r + k) % len(steps)]()  # within rounds favours no one
        os.close(fd)
        for mode in layers:
            layers[mode].close()
            engines[mode].close()
        row = {"qd": qd, "pages": m * HEADS, "rounds": rounds, "floor": "fio" if have_fio else "python"}
        for key, values in runs.items():
            row[f"{key}_iops"] = float(np.median(values))
            row[f"{key}_runs"] = values
        for key in ("aio", "threads", "python", "fio_libaio"):
            row[f"{key}_ratio"] = float(np.median(np.asarray(runs[key]) / np.asarray(runs["fio"])))
        results.append(row)
    print_table(["queue depth", "pages", "aio IOPS", "numba threads IOPS", "python preadv IOPS", "floor IOPS",
                 "fio libaio IOPS", "aio/floor", "threads/floor", "python/floor", "fio libaio/floor"],
                [[r["qd"], r["pages"], fmt(r["aio_iops"], 0), fmt(r["threads_iops"], 0), fmt(r["python_iops"], 0),
                  fmt(r["fio_iops"], 0), fmt(r["fio_libaio_iops"], 0), fmt(r["aio_ratio"], 2),
                  fmt(r["threads_ratio"], 2), fmt(r["python_ratio"], 2), fmt(r["fio_libaio_ratio"], 2)]
                 for r in results],
                title=f"engines: cold lookups of random rows (a page each), medians of {rounds} rounds; each ratio is "
                      "the median of (engine / the floor, fio's io_uring, measured beside it)")
    return results


# ---- id streams ----------------------------------------------------------------------------------------------

_SCATTER = np.int64(2654435761)  # a prime: rank -> row is a bijection of [0, N) for any N below it


class Stream:
    """Row ids ``[M, H]``: Zipf(s) ranks (or uniform) per head, ranks scattered over each table."""

    def __init__(self, sizes: list[int], s: float | None, seed: int):
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.s = s
        self.rng = np.random.default_rng(seed)
        n = int(self.sizes.min())
        self.shift = int(self.rng.integers(0, n))  # where the hot rows lie differs from seed to seed
        if s is not None:
            w = np.arange(1, n + 1, dtype=np.float64) ** -s
            self.cdf = np.cumsum(w) / w.sum()

    def batch(self, M: int) -> np.ndarray:
        H = self.sizes.size
        if self.s is None:
            return (self.rng.random((M, H)) * self.sizes).astype(np.int64)
        ranks = np.minimum(np.searchsorted(self.cdf, self.rng.random((M, H))), self.cdf.size - 1).astype(np.int64)
        return (ranks * _SCATTER + np.arange(H, dtype=np.int64) * 7919 + self.shift) % self.sizes

    def label(self) -> str:
        return "uniform" if self.s is None else f"zipf {self.s:g}"


# ---- cache policies -----------------------------------------------------------------------------------------


def simulate(policy: str, sizes: list[int], cap_rows: int, stream: Stream, batches: int, M: int) -> tuple[float, float]:
    """(hit rate over the last two thirds of the stream, ns per lookup) of one cache policy (8-byte rows)."""
    H = len(sizes)
    row_base = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    out = np.zeros(M * H * 8, dtype=np.uint8)
    if policy == "direct-mapped":
        cache_keys = np.full(cap_rows, -1, dtype=np.int64)
        cache_rows = np.zeros((cap_rows, 1), dtype=np.uint64)
        got = np.empty((M * H, 1), dtype=np.uint64)
    else:
        admission = "doorkeeper" if policy.endswith("doorkeeper") else "always"
        cache = RowCache(-(-cap_rows // dk.WAYS) * (dk.WAYS * 8 + dk.META_WORDS * 8 + 1 + dk.WAYS), 8, admission)
        lay = __import__("engram_store.disk._layout", fromlist=["DiskLayout"]).DiskLayout.of(8, sizes)
        n_rows, offs = np.asarray(sizes, dtype=np.int64), np.asarray(lay.head_offsets, dtype=np.int64)
    hits = looked = 0
    ns = 0
    for b in range(batches):
        ids = stream.batch(M)
        t0 = time.perf_counter_ns()
        if policy == "direct-mapped":
            keys = (np.arange(H, dtype=np.int64)[None, :] << 40 | ids).reshape(-1)
            hit, n_hit = ground.cache_probe(keys, cache_keys, cache_rows, got)
            miss = np.flatnonzero(~hit)
            ground.cache_insert(keys[miss], got[miss], cache_keys, cache_rows)
        else:
            bad, n_hit, miss_pos, miss_key, *_ = dk._plan_read(ids, n_rows, offs, row_base, lay.rows_per_block,
                                                                lay.block_bytes, 8, 1, cache.meta, cache.rows, 8, out)
            cache.fill(miss_key, miss_pos, out)
        ns += time.perf_counter_ns() - t0
        if b >= batches // 3:
            hits += int(n_hit)
            looked += ids.size
    return hits / looked, ns / (batches * M * H)


def section_policy(quick: bool, seed: int) -> list[dict]:
    per_head = 20_000 if quick else 100_000
    sizes = [per_head - h for h in range(HEADS)]
    total = sum(sizes)
    batches = 300 if quick else 1500
    results = []
    for s in (0.8, 1.0, 1.2, None):
        for frac in (0.01, 0.10, 0.50):
            row = {"stream": Stream(sizes, s, 0).label(), "cache": frac}
            for policy in ("direct-mapped", "clock", "clock+doorkeeper"):
                rate, ns = simulate(policy, sizes, int(total * frac), Stream(sizes, s, seed), batches, DECODE_ROWS)
                row[policy] = {"hit_rate": rate, "ns_per_lookup": ns}
            results.append(row)
    print_table(["stream", "cache", "direct-mapped hit", "clock hit", "clock+doorkeeper hit", "dm ns/lookup",
                 "clock ns", "clock+dk ns"],
                [[r["stream"], f"{r['cache']:.0%}"] + [f"{r[p]['hit_rate']:.1%}" for p in
                                                       ("direct-mapped", "clock", "clock+doorkeeper")]
                 + [fmt(r[p]["ns_per_lookup"]) for p in ("direct-mapped", "clock", "clock+doorkeeper")]
                 for r in results],
                title=f"cache policies: {HEADS} heads x {per_head:,} rows, {batches} decode batches "
                      f"({DECODE_ROWS} x {HEADS} rows), hit rate over the last 2/3 (ns/lookup: probe + fill, "
                      "whole stream)")
    return results


# ---- the tier ---------------------------------------------------------------------------------------------------


def warm_cache(layer: DiskLayer, stream: Stream, offer_rows: int, limit_s: float) -> int:
    """Offer ``layer``'s cache the rows of the stream's next lookups as reads from the disk would (their bytes made
    in the layer's pattern instead of read): what a server holds after serving that much of the stream, which
    reads from this disk would take hours to reach for a large cache. Returns the rows offered."""
    cache = layer.cache
    M = PREFILL_ROWS
    heads = np.tile(np.arange(HEADS, dtype=np.int64), M)
    pos = np.arange(M * HEADS, dtype=np.int64)
    rows = np.empty((M * HEADS, ROW_BYTES), dtype=np.uint8)
    offered = 0
    t_end = time.perf_counter() + limit_s
    while offered < offer_rows and time.perf_counter() < t_end:
        ids = stream.batch(M).reshape(-1)
        pattern_rows(heads, ids, rows)
        cache.fill(row_keys(layer, heads, ids), pos, rows.reshape(-1))
        offered += ids.size
    return offered


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def section_tier(d: DiskDir, sizes: list[int], quick: bool, seed: int, floor: list[dict],
                 lookups: list[str]) -> list[dict]:
    """Per lookup size and id stream, every cache configuration is opened at once (each on rows of its own) and
    their timed lookups are interleaved, one of each in turn: this disk's rate moves several-fold within a minute,
    and configurations timed one after the other would measure its moods."""
    file_bytes = sum(-(-n // 15) for n in sizes) * 4096
    results = []
    for M, label in ((DECODE_ROWS, "decode"), (PREFILL_ROWS, "prefill")):
        if label not in lookups:
            continue
        reps = (20 if quick else 100) if M == DECODE_ROWS else (2 if quick else 6)
        for s in (1.0, None):
            configs = []
            cache = layer = c = None
            for frac in (0.0, 0.01, 0.10, 0.50):
                seed += 1  # every configuration reads rows of its own, not pages another one brought in
                cache_bytes = int(file_bytes * frac)
                if cache_bytes > _mem_available() - (3 << 30):
                    print(f"tier: skipping the {frac:.0%} cache ({cache_bytes / 1e9:.1f} GB): not enough free memory")
                    continue
                stream = Stream(sizes, s, seed)
                cache = RowCache(cache_bytes, ROW_BYTES) if frac else None
                layer = d.open(LAYER_ID, ROW_BYTES, sizes, cache=cache)
                out = np.empty(M * HEADS * ROW_BYTES, dtype=np.uint8)
                offered = 0 if cache is None else \
                    warm_cache(layer, stream, 3 * cache.capacity_rows, 15.0 if quick else 120.0)
                t_end = time.perf_counter() + (0.0 if not frac else (1.0 if quick else 3.0))
                while time.perf_counter() < t_end:  # and reads of the stream, as served
                    layer.read_rows(stream.batch(M), out)
                layer.stats(reset=True)
                configs.append({"frac": frac, "stream": stream, "layer": layer, "out": out, "offered": offered,
                                "cache_rows": cache.capacity_rows if cache is not None else 0, "times": [],
                                "batches": [stream.batch(M) for _ in range(reps)]})
            for i in range(reps):
                for c in configs:
                    ids = c["batches"][i]
                    t0 = time.perf_counter_ns()
                    c["layer"].read_rows(ids, c["out"])
                    c["times"].append(time.perf_counter_ns() - t0)
                    check_rows(ids, c["out"])
            for c in configs:
                st = c["layer"].stats()
                c["layer"].close()
                times = c["times"]
                rows = st["rows"]
                results.append({"latency": Stats.from_ns(times).as_dict(), "rows_per_s": rows / (sum(times) / 1e9),
                                "hit_rate": st["cache_hits"] / rows, "pages_per_lookup": st["pages_read"] / len(times),
                                "iops": st["pages_read"] / (sum(times) / 1e9), "lookup": label, "rows": M * HEADS,
                                "stream": c["stream"].label(), "cache": c["frac"],
                                "warm_rows_offered": c["offered"], "cache_rows": c["cache_rows"]})
            del configs, cache, layer, c  # the caches' memory goes back before the next stream's are made
            gc.collect()
    qd64 = next((f for f in floor if f["qd"] == 64), None)
    fl = (qd64["fio"] or qd64["python"])["iops"] if qd64 else None
    print_table(["lookup", "stream", "cache", "warmed by", "rows/s", "p50 ms", "p99 ms", "hit rate", "pages/lookup",
                 "IOPS", "IOPS/floor(64)"],
                [[f"{r['lookup']} {r['rows']:,}", r["stream"], f"{r['cache']:.0%}" if r["cache"] else "none",
                  f"{r['warm_rows_offered'] / max(1, r['cache_rows']):.1f}x" if r["cache"] else "",
                  fmt(r["rows_per_s"], 0), fmt(r["latency"]["p50_us"] / 1e3, 2), fmt(r["latency"]["p99_us"] / 1e3, 2),
                  f"{r['hit_rate']:.1%}", fmt(r["pages_per_lookup"], 0), fmt(r["iops"], 0),
                  fmt(fl and r["iops"] / fl, 2)] for r in results],
                title=f"tier: DiskLayer.read_rows on the {file_bytes / 1e9:.0f} GB layer (each cache first offered the "
                      "rows of the same stream, up to 3x its capacity ('warmed by'), then "
                      f"{'1' if quick else '3'} s of reads)")
    return results


# ---- cache hits beside an in-memory gather --------------------------------------------------------------------


def section_hit(d: DiskDir, sizes: list[int], quick: bool, seed: int, layer_table_bytes: int) -> list[dict]:
    """Lookups whose rows all sit in the cache, beside the same rows read from memory: by the local-direct gather
    kernel from a table of only those rows, packed (a lower bound no real layer reaches: its rows spread over the
    whole layer), by the same kernel from a ``layer_table_bytes`` table holding them at scattered places (what a
    local-direct lookup of a large layer pays: a TLB miss per row on top of the row), and by ``np.take``."""
    working = 200_000 if quick else 1_000_000          # distinct rows held (264 MB at full size)
    cache = RowCache(4 * working // dk.WAYS * (dk.WAYS * ROW_BYTES + 72 + dk.WAYS) // 3, ROW_BYTES)
    rng = np.random.default_rng(seed)
    heads = rng.integers(0, HEADS, working)
    rows = (rng.random(working) * np.asarray(sizes)[heads]).astype(np.int64)
    results = []
    with d.open(LAYER_ID, ROW_BYTES, sizes, cache=cache) as layer:
        # fill the cache with the working set's rows as a read would (synthetic rows in the layer's pattern)
        table = np.empty((working, ROW_BYTES), dtype=np.uint8)
        pattern_rows(heads, rows, table)
        cache_keys = row_keys(layer, heads, rows)
        pos = np.arange(working, dtype=np.int64)
        for _ in range(2):  # the second offer passes the doorkeeper where a set is full
            cache.fill(cache_keys, pos, table.reshape(-1))
        # the same rows as in-memory tables read by the kernel of local-direct lookups (one head of them all):
        # packed, and scattered over a layer-sized table (committed, so every page is real memory)
        packed = ground.row_source(table.reshape(-1), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64),
                                   ROW_BYTES)
        big_rows = max(working, layer_table_bytes // ROW_BYTES)
        big = np.zeros((big_rows, ROW_BYTES), dtype=np.uint8)
        place = rng.choice(big_rows, working, replace=False).astype(np.int64)
        big[place] = table
        spread = ground.row_source(big.reshape(-1), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64),
                                   ROW_BYTES)
        held = set(np.flatnonzero(_held_mask(cache, cache_keys)).tolist())
        pick = np.fromiter(held, dtype=np.int64)
        for M, label in ((DECODE_ROWS, "decode"), (PREFILL_ROWS, "prefill")):
            reps = (200 if quick else 1000) if M == DECODE_ROWS else (10 if quick else 40)
            # lookups whose rows all sit in the cache: head h of each token asks for a held row of head h
            by_head = [pick[heads[pick] == h] for h in range(HEADS)]
            batches = []
            for _ in range(reps):
                idx = np.stack([by_head[h][rng.integers(0, by_head[h].size, M)] for h in range(HEADS)], axis=1)
                batches.append(idx)
            out = np.empty(M * HEADS * ROW_BYTES, dtype=np.uint8)
            out2 = out.reshape(M * HEADS, ROW_BYTES)
            layer.stats(reset=True)
            times: dict[str, list[int]] = {"cache": [], "numpy_gather": [], "local_direct": [], "local_layer": []}
            # interleaved, so all see the same moments of a busy machine; each in-memory gather reads another
            # lookup's rows, or it would find rows the one before pulled into the CPU caches
            for i, idx in enumerate(batches):
                ids = rows[idx]
                t0 = time.perf_counter_ns()
                layer.read_rows(ids, out)
                times["cache"].append(time.perf_counter_ns() - t0)
                check_rows(ids, out)
                t0 = time.perf_counter_ns()
                np.take(table, idx.reshape(-1), axis=0, out=out2)
                times["numpy_gather"].append(time.perf_counter_ns() - t0)
                other = batches[(i + reps // 2) % reps].reshape(-1, 1)
                t0 = time.perf_counter_ns()
                ground.gather_rows(packed, other, out)
                times["local_direct"].append(time.perf_counter_ns() - t0)
                other = batches[(i + reps // 3) % reps]
                t0 = time.perf_counter_ns()
                ground.gather_rows(spread, place[other].reshape(-1, 1), out)
                times["local_layer"].append(time.perf_counter_ns() - t0)
                check_rows(rows[other], out)
            st = layer.stats()
            stats = {key: Stats.from_ns(t) for key, t in times.items()}
            c = stats["cache"]
            results.append({"lookup": label, "rows": M * HEADS, **{key: v.as_dict() for key, v in stats.items()},
                            "layer_table_bytes": big.nbytes, "hit_rate": st["cache_hits"] / st["rows"],
                            "ratio_p50": c.p50_us / stats["numpy_gather"].p50_us,
                            "ratio_local_p50": c.p50_us / stats["local_direct"].p50_us,
                            "ratio_layer_p50": c.p50_us / stats["local_layer"].p50_us})
        del big
    print_table(["lookup", "cache hit p50 us", "p99 us", "local packed p50 us", "p99 us",
                 f"local {layer_table_bytes / 1e9:.0f} GB p50 us", "p99 us", "np.take p50 us", "hit / packed",
                 "hit / layer", "hit / np.take", "hit rate"],
                [[f"{r['lookup']} {r['rows']:,}", fmt(r["cache"]["p50_us"]), fmt(r["cache"]["p99_us"]),
                  fmt(r["local_direct"]["p50_us"]), fmt(r["local_direct"]["p99_us"]),
                  fmt(r["local_layer"]["p50_us"]), fmt(r["local_layer"]["p99_us"]),
                  fmt(r["numpy_gather"]["p50_us"]), fmt(r["ratio_local_p50"], 2), fmt(r["ratio_layer_p50"], 2),
                  fmt(r["ratio_p50"], 2), f"{r['hit_rate']:.1%}"] for r in results],
                title=f"cache hits: read_rows served from the cache ({working:,} rows held) beside the local-direct "
                      "gather kernel reading the same rows packed in a table of their own and scattered over a "
                      f"{layer_table_bytes / 1e9:.0f} GB table, and np.take from the packed table")
    return results


def section_hit_api(directory: str, quick: bool, seed: int) -> list[dict]:
    """``EngramStore.lookup_into`` served wholly from the disk tier's cache beside the same call on tables bound in
    memory (``bind_local``: the local-direct gather), on a layer small enough to hold in both; and beside the same
    disk lookups with the hit rate at every cache size not kept (what ``stats()['hit_rate_by_size']`` costs)."""
    per_head = 5_000 if quick else 20_000
    config = EngramStoreConfig(table_vocab_sizes=[per_head] * HEADS, embedding_dim=ROW_BYTES, row_format="bytes")
    tables = []
    for h in range(HEADS):
        t = np.empty((per_head, ROW_BYTES), dtype=np.uint8)
        fill_head(h)(0, t)
        tables.append(t)
    where = tempfile.mkdtemp(prefix="engram-hit-api-", dir=directory)
    results = []
    try:
        with EngramStore(1, config, disk_dir=where) as writer:
            writer.populate(tables)
        # room for 4/3 of the layer's rows, as in section_hit; a row whose set is full stays out
        rows_all = per_head * HEADS
        cache_bytes = 4 * rows_all // dk.WAYS * (dk.WAYS * ROW_BYTES + 72 + dk.WAYS) // 3
        with EngramStore(1, config, disk_dir=where, row_cache_bytes=cache_bytes) as disk, \
                EngramStore(1, config) as memory:
            memory.bind_local(tables)
            every = np.arange(per_head, dtype=np.int64)
            for start in range(0, per_head, 1024):  # every row once: the cache takes each into a free way
                chunk = every[start:start + 1024]
                disk.lookup(np.repeat(chunk[None, :, None], HEADS, axis=2))
            # the rows the cache took, per head (the disk layer under the EngramStore and its cache)
            layer = disk._layers[1].state
            keys = row_keys(layer, np.repeat(np.arange(HEADS), per_head), np.tile(every, HEADS))
            held = _held_mask(layer.cache, keys).reshape(HEADS, per_head)
            by_head = [np.flatnonzero(held[h]) for h in range(HEADS)]
            rng = np.random.default_rng(seed)
            for M, label in ((DECODE_ROWS, "decode"), (PREFILL_ROWS, "prefill")):
                reps = (200 if quick else 1000) if M == DECODE_ROWS else (10 if quick else 40)
                batches = [np.stack([by_head[h][rng.integers(0, by_head[h].size, M)] for h in range(HEADS)],
                                    axis=1)[:, None, :] for _ in range(reps)]
                out = np.empty((M, 1, HEADS, ROW_BYTES), dtype=np.uint8)
                disk.stats(reset=True)
                t_disk, t_mem, t_bare = [], [], []
                sizing = disk._source.sizing
                for i, ids in enumerate(batches):
                    t0 = time.perf_counter_ns()
                    disk.lookup_into(ids, out)
                    t_disk.append(time.perf_counter_ns() - t0)
                    check_rows(ids.reshape(M, HEADS), out.reshape(-1))
                    bare = batches[(i + reps // 3) % reps]  # the same kind of lookup without the curve
                    sizing.observe = lambda jobs, states: None
                    t0 = time.perf_counter_ns()
                    disk.lookup_into(bare, out)
                    t_bare.append(time.perf_counter_ns() - t0)
                    del sizing.observe
                    check_rows(bare.reshape(M, HEADS), out.reshape(-1))
                    other = batches[(i + reps // 2) % reps]  # other rows: not the ones just pulled into the CPU caches
                    t0 = time.perf_counter_ns()
                    memory.lookup_into(other, out)
                    t_mem.append(time.perf_counter_ns() - t0)
                    check_rows(other.reshape(M, HEADS), out.reshape(-1))
                st = disk.stats()
                c, m, bare = Stats.from_ns(t_disk), Stats.from_ns(t_mem), Stats.from_ns(t_bare)
                results.append({"lookup": label, "rows": M * HEADS, "disk_cache": c.as_dict(),
                                "bind_local": m.as_dict(), "without_curve": bare.as_dict(),
                                "curve_cost_p50": c.p50_us / bare.p50_us,
                                "hit_rate": st["cache_hits"] / max(1, st["cache_hits"] + st["cache_misses"]),
                                "ratio_p50": c.p50_us / m.p50_us})
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print_table(["lookup", "disk tier, cache hits p50 us", "p99 us", "bind_local p50 us", "p99 us", "hits / local",
                 "hit rate", "without the curve p50 us", "with / without"],
                [[f"{r['lookup']} {r['rows']:,}", fmt(r["disk_cache"]["p50_us"]), fmt(r["disk_cache"]["p99_us"]),
                  fmt(r["bind_local"]["p50_us"]), fmt(r["bind_local"]["p99_us"]), fmt(r["ratio_p50"], 2),
                  f"{r['hit_rate']:.1%}", fmt(r["without_curve"]["p50_us"]), fmt(r["curve_cost_p50"], 3)]
                 for r in results],
                title=f"cache hits through the API: EngramStore.lookup_into on a disk_dir layer ({per_head:,} rows a "
                      "head, a cache of 4/3 of them, lookups of rows it holds) beside the same lookups of the same "
                      "tables bound in memory (local-direct)")
    return results


def _held_mask(cache: RowCache, keys: np.ndarray) -> np.ndarray:
    held = cache.meta.reshape(-1, dk.META_WORDS)[:, 1:]
    return np.isin(keys, held[held >= 0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/var/tmp/engram-disk-bench", help="where the layer is written once and reused")
    p.add_argument("--size", default="30GB", help="the layer's size (default 30GB)")
    p.add_argument("--quick", action="store_true", help="shorter runs")
    p.add_argument("--sections", default="floor,engine,policy,tier,hit")
    p.add_argument("--layer-table", default="8GB",
                   help="hit section: the in-memory table the cached rows are scattered over for the local-direct "
                        "comparison (a real layer's size where memory allows; default 8GB)")
    p.add_argument("--tier-lookups", default="decode,prefill", help="the tier section's lookup sizes")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of every id stream (default: a fresh one, printed; a disk or VM host that caches pages "
                        "would serve a repeated run's reads from memory)")
    p.add_argument("--json", default=default_json_path("bench_disk"))
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "little")
    sections = args.sections.split(",")
    d, sizes = ensure_layer(args.dir, parse_size(args.size))
    print(f"layer: {HEADS} heads x {sizes[0]:,} rows x {ROW_BYTES} B ({sum(sizes) // 15 * 4096 / 1e9:.1f} GB) "
          f"under {args.dir}")
    file = os.path.join(d.layer_path(LAYER_ID), "rows.bin")
    print(f"seed: {seed}")
    payload: dict = {"seed": seed, "heads": HEADS, "row_bytes": ROW_BYTES, "sizes": sizes, "dir": args.dir,
                     "file_bytes": os.path.getsize(file)}
    floor: list[dict] = []
    if "floor" in sections:
        floor = payload["floor"] = section_floor(file, 2.0 if args.quick else 5.0, seed)
    if "engine" in sections:
        payload["engine"] = section_engine(d, sizes, 6_000 if args.quick else 10_000, 4 if args.quick else 7,
                                           seed + 1000)
    if "policy" in sections:
        payload["policy"] = section_policy(args.quick, seed + 2000)
    if "tier" in sections:
        payload["tier"] = section_tier(d, sizes, args.quick, seed + 3000, floor, args.tier_lookups.split(","))
    if "hit" in sections:
        payload["hit"] = section_hit(d, sizes, args.quick, seed + 4000, parse_size(args.layer_table))
        payload["hit_api"] = section_hit_api(args.dir, args.quick, seed + 5000)
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
