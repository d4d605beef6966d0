"""Hot rows: a Zipf(1.1) row-id stream read remotely, with and without the client-side row cache.

    python bench/bench_hot_rows.py [--quick] [--json PATH]

N-gram frequencies are Zipfian, so a small cache of hot rows saves most remote reads. Each head draws its
row ids from a Zipf(1.1) distribution over its table (a random permutation per head, so hot rows are spread
over the table). The layer (16 heads x 100,000 rows x D=64 by default) lives in a separate ``engram-segment``
process and every read goes over ZeroMQ (``local_direct=False``). Batches are B=256, L=1 (a decode step).
Printed per cache size: lookup latency (mean, p50, p99), hit rate and the speed-up over no cache.

On one machine the "remote" segment is across loopback, where fetching a row costs about what the cache's
own random memory reads cost, so the cache saves bytes on the wire and work on the segment server rather
than latency here; it pays off when the segment is across a real network or shared by many clients.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from _common import Stats, default_json_path, print_table, start_cluster, time_ns, write_json

from engram_store import DistributedStore, EngramStore, EngramStoreConfig

HEADS = 16
DIM = 64


def zipf_ids(rng: np.random.Generator, sizes: list[int], batches: int, batch: int, a: float) -> np.ndarray:
    """``[batches, batch, 1, H]`` row ids, Zipf(a)-distributed over a random permutation of each table."""
    out = np.empty((batches, batch, 1, len(sizes)), dtype=np.int64)
    for h, n in enumerate(sizes):
        perm = rng.permutation(n)
        ranks = rng.zipf(a, size=(batches, batch, 1))
        ranks = np.where(ranks > n, rng.integers(1, n + 1, size=ranks.shape), ranks)  # fold the long tail
        out[..., h] = perm[ranks - 1]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller tables, fewer batches")
    p.add_argument("--rows", type=int, default=100_000, help="rows per head (default 100,000)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent (default 1.1)")
    p.add_argument("--json", default=default_json_path("bench_hot_rows"))
    args = p.parse_args(argv)
    rows = args.rows // 10 if args.quick else args.rows
    batches = 100 if args.quick else 400
    sizes = [rows + h for h in range(HEADS)]
    table_bytes = sum(sizes) * DIM * 4
    cache_sizes = [0, 1 << 20, 8 << 20, 64 << 20]
    rng = np.random.default_rng(0)
    stream = zipf_ids(rng, sizes, batches, 256, args.zipf)
    print(f"{HEADS} heads x {rows:,} rows x D={DIM} ({table_bytes / 1e6:.0f} MB) on a segment process; "
          f"{batches} batches of B=256, L=1, Zipf({args.zipf:g}) row ids")
    results = []
    with start_cluster(segments=1, segment_size=table_bytes + (64 << 20)) as cluster, \
            DistributedStore.connect(cluster.address, local_direct=False) as store:
        writer = EngramStore(1, EngramStoreConfig(sizes, DIM), store)
        writer.populate([rng.standard_normal((n, DIM), dtype=np.float32) for n in sizes])
        expected = writer.lookup(stream[0])
        for cache_bytes in cache_sizes:
            layer = EngramStore(1, EngramStoreConfig(sizes, DIM), store, row_cache_bytes=cache_bytes)
            np.testing.assert_array_equal(layer.lookup(stream[0]), expected)
            for ids in stream[: batches // 4]:  # warm the cache with the first quarter of the stream
                layer.lookup(ids)
            layer.stats(reset=True)
            out = np.empty((256, 1, HEADS, DIM), dtype=np.float32)
            samples = time_ns(lambda i: layer.lookup_into(stream[batches // 4 + i % (batches - batches // 4)], out),
                              min_reps=batches - batches // 4, min_time_s=0.0,
                              max_reps=batches - batches // 4)
            stats = layer.stats()
            looked = stats["cache_hits"] + stats["cache_misses"]
            hit_rate = stats["cache_hits"] / looked if looked else 0.0
            results.append({"cache_bytes": cache_bytes, "latency": Stats.from_ns(samples).as_dict(),
                            "hit_rate": hit_rate, "remote_rows_per_lookup": stats["remote_rows"] / stats["lookups"]})
            layer.close()
        writer.remove_from_store(force=True)
    base = results[0]["latency"]["p50_us"]
    print_table(["cache", "mean us", "p50 us", "p99 us", "hit rate", "rows fetched/lookup", "speed-up (p50)"],
                [[f"{r['cache_bytes'] >> 20} MiB" if r["cache_bytes"] else "none", f"{r['latency']['mean_us']:.1f}",
                  f"{r['latency']['p50_us']:.1f}", f"{r['latency']['p99_us']:.1f}", f"{r['hit_rate']:.1%}",
                  f"{r['remote_rows_per_lookup']:.0f}", f"{base / r['latency']['p50_us']:.2f}x"] for r in results])
    write_json(args.json, {"rows_per_head": rows, "heads": HEADS, "dim": DIM, "zipf": args.zipf,
                           "batches": batches, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
