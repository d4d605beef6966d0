"""Remote lookups: rows read in output order against distinct rows read once and scattered.

    python bench/bench_read_plans.py [--quick] [--full | --rows-scale S] [--json PATH]

A remote lookup whose layer has every head on one segment server can ask for the rows as they are, in output
order (the reply is the output itself; a row asked for twice travels twice), or ask for each distinct row once
and scatter the reply (a sort per head and a random scatter, but no row travels twice). The store reads in
output order (``DIRECT_MAX_ROWS``); this benchmark times both plans on the same layer, interleaved, at a
prefill (B=1, L=4096) and a decode step (B=256, L=1), with ids drawn uniformly and from a small pool per head
(a text whose n-grams repeat: about half of each head's rows are repeats).

A layer spread over several servers always reads distinct rows: there the reply is not the output, and a
variant that placed each server's rows by head lost to deduplication once rows repeat (0.80-0.82x with the
repeating ids at both shapes, 1.05-1.07x with uniform ones, on two segment processes sharing two cores with
the client), so it was not kept.

The layer is one of DeepSeek's demo config, 16 heads x 646,403 rows x D=64 float32 (2.65 GB) with ``--full``,
else scaled by ``--rows-scale`` (default 0.1). p50 of each plan, microseconds; "distinct / output order" above
1 means reading in output order is faster.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from _common import Stats, default_json_path, fmt, print_table, start_cluster, time_ns, write_json

from engram_store import DistributedStore, EngramStore, EngramStoreConfig
from engram_store.tables import _plan as _engram_store

HEADS, ROWS, DIM = 16, 646_403, 64
SHAPES = ((1, 4096), (256, 1))
ID_POOL = 8
PLANS = {"output order": _engram_store.DIRECT_MAX_ROWS, "distinct": 0}


def _ids(rng: np.random.Generator, rows: int, batch: int, length: int, repeats: bool) -> np.ndarray:
    if not repeats:
        return np.stack([rng.integers(0, rows, (batch, length)) for _ in range(HEADS)], axis=-1)
    # A pool of 0.7 x the positions per head: about half of each head's ids repeat an earlier one.
    pools = [rng.integers(0, rows, max(1, int(0.7 * batch * length))) for _ in range(HEADS)]
    return np.stack([rng.choice(pool, (batch, length)) for pool in pools], axis=-1)


def _run(segments: int, rows: int, tables: list[np.ndarray], quick: bool, seed: int) -> list[dict]:
    size = HEADS * rows * DIM * 4
    results = []
    with start_cluster(segments=segments, segment_size=int(size * 1.1 / segments) + (64 << 20)) as cluster, \
            DistributedStore.connect(cluster.address, timeout_ms=60_000, local_direct=False) as store:
        layer = EngramStore(1, EngramStoreConfig(table_vocab_sizes=[rows] * HEADS, embedding_dim=DIM), store)
        layer.populate(tables)
        rng = np.random.default_rng(seed)
        for batch, length in SHAPES:
            for repeats in (False, True):
                pool = [_ids(rng, rows, batch, length, repeats).astype(np.int64) for _ in range(ID_POOL)]
                out = np.empty((batch, length, HEADS, DIM), dtype=np.float32)
                for ids in pool[:2]:  # both plans return the rows NumPy does
                    want = np.stack([tables[h][ids[..., h]] for h in range(HEADS)], axis=-2)
                    for limit in PLANS.values():
                        _engram_store.DIRECT_MAX_ROWS = limit
                        layer.lookup_into(ids, out)
                        assert np.array_equal(out, want), "a read plan returned wrong rows"
                times: dict[str, list[int]] = {name: [] for name in PLANS}
                big = batch * length >= 4096
                rounds = 3 if quick else 6
                for r in range(rounds):
                    for name, limit in PLANS.items():
                        _engram_store.DIRECT_MAX_ROWS = limit

                        def call(i: int) -> None:
                            layer.lookup_into(pool[i % ID_POOL], out)

                        call(r)  # warm: placement, buffers
                        times[name] += time_ns(call, min_reps=(3 if quick else 8) if big else (20 if quick else 100),
                                               min_time_s=0.05 if quick else 0.3, start=r)
                distinct_rows = sum(len(np.unique(ids[..., h])) for ids in pool for h in range(HEADS)) / ID_POOL
                stats = {name: Stats.from_ns(t) for name, t in times.items()}
                results.append({
                    "segments": segments, "batch": batch, "length": length,
                    "ids": "repeating" if repeats else "uniform",
                    "rows": batch * length * HEADS, "distinct_rows": distinct_rows,
                    "plans": {name: s.as_dict() for name, s in stats.items()},
                    "distinct_over_output_order": stats["distinct"].p50_us / stats["output order"].p50_us,
                })
        _engram_store.DIRECT_MAX_ROWS = PLANS["output order"]
        layer.remove_from_store()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, tables scaled to 0.02")
    parser.add_argument("--full", action="store_true", help="the real table size (2.65 GB, ~6 GB of RAM)")
    parser.add_argument("--rows-scale", type=float, default=0.1, help="table rows as a fraction of the real size")
    parser.add_argument("--json", default=None, help="where to write results (default bench/results/...)")
    args = parser.parse_args(argv)
    scale = 1.0 if args.full else (0.02 if args.quick else args.rows_scale)
    if not 0 < scale <= 1:
        parser.error(f"--rows-scale: expected a fraction in (0, 1], got {scale}")
    rows = max(1, int(ROWS * scale))
    rng = np.random.default_rng(0)
    tables = [rng.random((rows, DIM), dtype=np.float32) for _ in range(HEADS)]
    print(f"{HEADS} heads x {rows:,} rows x D={DIM} float32 = {HEADS * rows * DIM * 4 / 1e9:.3f} GB; "
          "remote reads over the raw TCP channel (local_direct=False)")
    results = _run(1, rows, tables, args.quick, seed=1)
    print_table(["segments", "shape", "ids", "rows", "distinct", "output order us", "distinct us",
                 "distinct / output order"],
                [[r["segments"], f"B={r['batch']} L={r['length']}", r["ids"], f"{r['rows']:,}",
                  f"{r['distinct_rows']:,.0f}", fmt(r["plans"]["output order"]["p50_us"]),
                  fmt(r["plans"]["distinct"]["p50_us"]), f"{r['distinct_over_output_order']:.2f}x"]
                 for r in results], title="p50 per plan, interleaved")
    name = "bench_read_plans" + ("_full" if args.full else "")
    write_json(args.json or default_json_path(name), {
        "benchmark": "bench_read_plans", "quick": args.quick, "rows_scale": scale, "heads": HEADS, "dim": DIM,
        "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
