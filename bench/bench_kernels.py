"""Numba kernels against the plain NumPy way of doing the same thing.

    python bench/bench_kernels.py [--quick] [--json PATH]

Rows: range gathers of embedding-row sized pieces (what a segment does per read), row planning (distinct rows
per head with an inverse map: what a client does before a remote read), the local-direct row gather from a
mapped segment, and the scatter of returned rows into ``[M, H, D]``. Times are medians of repeated calls in
one process; the ratio column is NumPy time / kernel time (above 1: the kernel is faster).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from _common import default_json_path, write_json

from engram_store import kernels as k


def _median_us(fn, min_time_s: float) -> float:
    fn()
    times = []
    deadline = time.perf_counter() + min_time_s
    while len(times) < 5 or time.perf_counter() < deadline:
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return float(np.median(times)) / 1e3


def _cases(quick: bool):
    rng = np.random.default_rng(0)
    segment = rng.integers(0, 256, size=(64 << 20) if not quick else (16 << 20), dtype=np.uint8)
    for row_bytes, count in [(64, 2048), (256, 2048), (4096, 1024)]:
        offsets = np.sort(rng.choice(segment.size // row_bytes, size=count, replace=False)).astype(np.int64) \
            * row_bytes
        lengths = np.full(count, row_bytes, dtype=np.int64)
        out = np.empty(count * row_bytes, dtype=np.uint8)
        index = (offsets[:, None] + np.arange(row_bytes)).ravel()
        yield (f"gather_ranges {count} x {row_bytes} B",
               lambda o=offsets, n=lengths, d=out: k.gather_ranges(segment, o, n, d),
               lambda i=index, d=out: np.take(segment, i, out=d))

    for M, H in [(256, 8), (4096, 16)]:
        ids = rng.integers(0, 646_400, size=(M, H), dtype=np.int64)
        heads = np.arange(H, dtype=np.int64)
        yield (f"plan_unique_rows M={M} H={H}",
               lambda i=ids, h=heads: k.plan_unique_rows(i, h),
               lambda i=ids: [np.unique(i[:, h], return_inverse=True) for h in range(i.shape[1])])

    D = 64
    H = 16
    rows_per_head = 646_400 if not quick else 100_000
    table = rng.standard_normal(H * rows_per_head * D // 4, dtype=np.float32)  # a quarter: reuse rows per head
    base = np.zeros(H, dtype=np.int64)  # every head reads the same table: memory stays small
    views = [table.reshape(-1, D)] * H
    for M in [1, 256, 4096]:
        ids = rng.integers(0, table.size // D, size=(M, H), dtype=np.int64)
        heads = np.arange(H, dtype=np.int64)
        out = np.empty((M, H, D), dtype=np.float32)
        yield (f"gather_rows_local M={M} H={H} D={D}",
               lambda i=ids, o=out: k.gather_rows_local(table, base, i, heads, D, o),
               lambda i=ids: np.stack([views[h][i[:, h]] for h in range(H)], axis=1))
        uniq, _, inverse = k.plan_unique_rows(ids, heads)
        rows = rng.standard_normal((uniq.size, D), dtype=np.float32)
        yield (f"scatter_rows M={M} H={H} D={D}",
               lambda r=rows, inv=inverse, o=out: k.scatter_rows(r, inv, heads, 0, o),
               lambda r=rows, inv=inverse: r[inv])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller inputs, shorter timing")
    p.add_argument("--json", default=default_json_path("bench_kernels"))
    args = p.parse_args(argv)
    k.warmup()
    min_time = 0.05 if args.quick else 0.3
    rows = []
    print(f"{'case':<40} {'kernel us':>11} {'numpy us':>11} {'numpy/kernel':>13}")
    for name, kernel, baseline in _cases(args.quick):
        t_kernel = _median_us(kernel, min_time)
        t_numpy = _median_us(baseline, min_time)
        rows.append({"case": name, "kernel_us": t_kernel, "numpy_us": t_numpy, "ratio": t_numpy / t_kernel})
        print(f"{name:<40} {t_kernel:>11.1f} {t_numpy:>11.1f} {t_numpy / t_kernel:>12.2f}x", flush=True)
    write_json(args.json, {"results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
