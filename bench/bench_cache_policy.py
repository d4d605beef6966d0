"""The hot-row cache's admission and eviction on real V4.1 traffic, against an exact LRU and the first-touch bound.

    python bench/bench_cache_policy.py [--corpus-dir DIR] [--layer 1] [--batch 16] [--profile-frac 0.2]
                                       [--sizes 0.001,0.01,0.1] [--quick] [--json PATH]

The stream is the corpus of ``bench/corpus.py`` (Python's standard library through DeepSeek-V4's tokenizer and
V4.1's released hash): at every token, the 24 rows of one layer's table, looked up ``--batch`` tokens at a time
as a serving step's lookups go out together. The first ``--profile-frac`` of the tokens is the past: a warm-start
profile is counted on it (the rows looked up at least twice, most frequent first: what ``engram-stats --v41
--profile`` writes); hit rates are counted on the rest.

Policies, at caches of 0.1%, 1% and 10% of the stream's distinct rows:

* ``bound``: the first-touch bound, a cache of unbounded size: every first touch misses, nothing else does;
* ``LRU``: an exact least-recently-used cache of that many rows (``bench/_policy.py``);
* ``door``, ``always``: the tier's set-associative cache (``engram_store.disk``'s own kernels, 7 ways, CLOCK),
  with doorkeeper admission (the process cache's default) or admitting every missed row (the host cache's);
* ``always+warm``, ``door+warm``: the same, warm-started: the profile's most frequent rows pinned first, in at
  most 2 of each set's 7 ways (``EngramStore.warm_cache``);
* ``curve``: not a cache: the hit rate the tier's miss-ratio curve predicts at that size (``MissRatioCurve``, the
  sampled LRU stack behind ``stats()['hit_rate_by_size']``), from one replay of the stream for every size.

Two scenarios: ``cold`` (a server starting on the rest of the stream: caches start empty, the bound counts first
touches within it) and ``steady`` (every cache has served the past first, uncounted; the bound counts first
touches over the whole stream).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from _common import default_json_path, print_table, write_json
from _policy import first_touch_hits, lru_hits

import corpus as corpus_mod
from engram_store.disk import MissRatioCurve, RowCache
from engram_store.disk import _kernels as dk
from engram_store.disk._cache import MAX_PINNED_WAYS, per_set_bytes

ROW_BYTES = 264  # a V4.1 row (the memory column); the simulation caches 8-byte rows
TAG = 1


def dense_stream(rows: np.ndarray) -> tuple[np.ndarray, int]:
    """The stream's rows renumbered 0..n-1 (int64 ``[T, C]``), and n."""
    uniq, inverse = np.unique(np.asarray(rows).reshape(-1), return_inverse=True)
    return inverse.astype(np.int64).reshape(rows.shape), int(uniq.size)


def profile_keys(keys: np.ndarray, n_keys: int, end: int) -> np.ndarray:
    """Rows looked up at least twice in tokens ``[0, end)``, most frequent first (ties by row)."""
    counts = np.bincount(keys[:end].reshape(-1), minlength=n_keys)
    hot = np.flatnonzero(counts >= 2)
    return hot[np.lexsort((hot, -counts[hot]))]


def run_cache(keys: np.ndarray, capacity_rows: int, admission: str, batch: int, start: int, replay_from: int,
              pins: np.ndarray | None) -> np.ndarray:
    """Per-column hits of the tier's cache (its own kernels) over tokens ``[replay_from, T)``, counted from
    ``start``."""
    n_sets = max(1, -(-capacity_rows // dk.WAYS))
    cache = RowCache(n_sets * per_set_bytes(8), 8, admission)
    if pins is not None and pins.size:
        limit = cache.capacity_rows * MAX_PINNED_WAYS // dk.WAYS
        pin_keys = (np.int64(TAG) << dk.KEY_ROW_BITS) | pins[:limit]
        cache.pin(pin_keys, np.zeros(pin_keys.size * 8, np.uint8), MAX_PINNED_WAYS)
    T, C = keys.shape
    row_base = np.zeros(C, np.int64)
    out = np.empty(batch * C * 8, np.uint8)
    miss_pos = np.empty(batch * C, np.int64)
    miss_key = np.empty(batch * C, np.int64)
    misses = np.zeros(C, np.int64)
    lookups = 0
    for a in range(replay_from, T, batch):
        ids = keys[a:a + batch]
        K = dk._probe_all(ids, row_base, TAG, cache.meta, cache.rows, 8, out, 8, miss_pos, miss_key)
        if a >= start:
            misses += np.bincount(miss_pos[:K] % C, minlength=C)
            lookups += ids.shape[0]
        cache.fill(miss_key[:K].copy(), miss_pos[:K].copy(), out)
    return lookups - misses


def curve_hits(keys: np.ndarray, capacities: list[int], batch: int, start: int, replay_from: int) -> np.ndarray:
    """Hits the miss-ratio curve predicts at each capacity (rows), ``[len(capacities)]``, over tokens from ``start``:
    the stream replayed from ``replay_from``, its counts zeroed at ``start`` (the stack kept, as the cache's rows)."""
    T, C = keys.shape
    curve = MissRatioCurve()
    col0 = curve.add_columns(C)
    row_base = np.zeros(C, np.int64)
    for a in range(replay_from, T, batch):
        if a <= start < a + batch:
            curve.observe(np.ascontiguousarray(keys[a:start]), row_base, TAG, col0)
            curve.reset()
            curve.observe(np.ascontiguousarray(keys[start:a + batch]), row_base, TAG, col0)
        else:
            curve.observe(keys[a:a + batch], row_base, TAG, col0)
    return curve.hits(range(col0, col0 + C), capacities)[0].sum(axis=0)


def orders(hits: np.ndarray, per_column: int, n_heads: int = 8) -> list[float]:
    """Hit rate of each n-gram order (columns (n - 2) * n_heads + h)."""
    return [float(hits[i:i + n_heads].sum() / (per_column * n_heads)) for i in range(0, hits.size, n_heads)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus-dir", default=None, help="bench/corpus.py's cache dir (default: its own default)")
    p.add_argument("--layer", type=int, default=1)
    p.add_argument("--batch", type=int, default=16, help="tokens whose lookups go out together (default 16)")
    p.add_argument("--profile-frac", type=float, default=0.2, help="share of the stream that is the past")
    p.add_argument("--sizes", default="0.001,0.01,0.1", help="cache sizes, shares of the distinct rows")
    p.add_argument("--quick", action="store_true", help="the first 300k tokens only")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    corpus = corpus_mod.ensure(args.corpus_dir)
    rows = corpus.rows[args.layer]
    if args.quick:
        rows = rows[:300_000]
    t0 = time.monotonic()
    keys, n_keys = dense_stream(rows)
    T, C = keys.shape
    start = int(T * args.profile_frac)
    per_column = T - start
    pins = profile_keys(keys, n_keys, start)
    print(f"layer {args.layer}: {T:,} tokens, {T * C:,} lookups of {n_keys:,} distinct rows; past = first {start:,} "
          f"tokens ({pins.size:,} rows seen twice there); prepared in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    sizes = [float(s) for s in args.sizes.split(",")]
    results = {"layer": args.layer, "tokens": T, "columns": C, "distinct_rows": n_keys, "batch": args.batch,
               "profile_tokens": start, "profile_rows": int(pins.size), "corpus": corpus.meta, "scenarios": {}}
    policies = ("LRU", "door", "always", "door+warm", "always+warm")
    for scenario in ("cold", "steady"):
        replay_from = start if scenario == "cold" else 0
        bound = first_touch_hits(keys, n_keys, start, replay_from)
        table, records = [], []
        caps = [max(dk.WAYS, int(n_keys * frac)) for frac in sizes]
        predicted = curve_hits(keys, [-(-cap // dk.WAYS) * dk.WAYS for cap in caps], args.batch, start, replay_from)
        for frac, curve in zip(sizes, predicted):
            cap = max(dk.WAYS, int(n_keys * frac))
            hits = {"bound": bound}
            t1 = time.monotonic()
            hits["LRU"] = lru_hits(keys[replay_from:], n_keys, cap, args.batch, start - replay_from)
            for name in policies[1:]:
                admission = name.split("+")[0].replace("door", "doorkeeper")
                hits[name] = run_cache(keys, cap, admission, args.batch, start, replay_from,
                                       pins if name.endswith("+warm") else None)
            rate = {name: float(h.sum() / (per_column * C)) for name, h in hits.items()}
            rate["curve"] = float(curve / (per_column * C))
            best = max(policies[1:], key=lambda n: rate[n])
            print(f"  {scenario} {frac:g}: {time.monotonic() - t1:.1f} s", file=sys.stderr)
            table.append([f"{frac:.1%}", f"{cap:,}", f"{cap * ROW_BYTES / 2**20:,.0f} MiB", f"{rate['bound']:.1%}",
                          f"{rate['LRU']:.1%}"] + [f"{rate[n]:.1%}" for n in policies[1:]] + [f"{rate['curve']:.1%}"]
                         + [best, f"{(rate['bound'] - rate[best]) * 100:+.1f}", f"{(rate[best] - rate['LRU']) * 100:+.1f}"])
            records.append({"size_frac": frac, "capacity_rows": cap, "hit_rate": rate, "best": best,
                            "hit_rate_by_order": {n: orders(h, per_column) for n, h in hits.items()}})
        results["scenarios"][scenario] = records
        print_table(["cache", "rows", "V4.1 rows", "bound", "LRU", *policies[1:], "curve", "best", "bound-best",
                     "best-LRU"],
                    table, title=f"{scenario}: hit rate over the last {per_column:,} tokens "
                                 f"({'caches start empty' if scenario == 'cold' else 'after serving the past'}), "
                                 f"batches of {args.batch} tokens")
        order_rows = [[f"{r['size_frac']:.1%}", name] + [f"{x:.1%}" for x in r["hit_rate_by_order"][name]]
                      for r in records for name in dict.fromkeys(("bound", "LRU", "always", r["best"]))]
        print_table(["cache", "policy", "order 2", "order 3", "order 4"], order_rows,
                    title=f"{scenario}: hit rate by n-gram order")
    write_json(args.json or default_json_path("bench_cache_policy"), {"args": vars(args), **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
