"""Benchmark of engram_model: N-gram hashing (Numba kernel vs the reference's NumPy formulation), the
Engram forward pass with its rows read from the store (local mapping vs the network path, direct vs prefetched),
a decode loop (B=256 requests, 64 steps: incremental hashing + lookup + forward, vs re-hashing each
sequence every step), and one decode step's hashing alone (64 and 256 requests, both layers, T=1: the batched
kernel of IncrementalHasher vs the per-request Python loop it replaced vs re-hashing whole sequences).

Configuration is DeepSeek's demo (engram_vocab_size=[129280*5]*2, max_ngram_size=3, n_embed_per_ngram=512,
n_head_per_ngram=8, layer_ids=[1, 15], hidden_size=1024, hc_mult=4). At full size one layer's tables are
16 heads x ~646,400 rows x 64 float32 = 2.6 GB; ``--rows-scale`` shrinks every table (hashing cost does not
depend on it; lookups touch a smaller working set). ``--quick`` uses 1% tables, shorter forward sequences and
fewer repeats.

    python bench/bench_engram_model.py --quick --json results.json
    python bench/bench_engram_model.py --decode-hash-only      # the decode-step hashing table alone, ~1 min
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from typing import Callable

import numpy as np
from _common import Stats, fmt, print_table as print_columns, time_ns, write_json

from engram_model import (BackboneConfig, CompressedTokenizer, Engram, EngramConfig, IncrementalHasher,
                          NgramHashMapping, get_hash_mapping)
from engram_model.demo._hasher import token_ids_2d
from engram_store import DistributedStore

DEMO_VOCAB = 129280


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Mean and median wall time of ``fn`` in milliseconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(1e3 * (time.perf_counter() - start))
    return {"mean_ms": statistics.fmean(samples), "p50_ms": statistics.median(samples), "repeats": repeats}


def configs(rows_scale: float) -> tuple[EngramConfig, BackboneConfig]:
    base = max(2, int(DEMO_VOCAB * 5 * rows_scale))
    cfg = EngramConfig(engram_vocab_size=[base, base], max_ngram_size=3, n_embed_per_ngram=512, n_head_per_ngram=8,
                       layer_ids=[1, 15], pad_id=2, seed=0, kernel_size=4)
    return cfg, BackboneConfig(hidden_size=1024, hc_mult=4, vocab_size=DEMO_VOCAB, num_layers=30)


def bench_hashing(cfg: EngramConfig, bb: BackboneConfig, shapes: list[tuple[int, int]], repeats: int) -> list[dict]:
    mapping = get_hash_mapping(cfg, bb)
    rng = np.random.default_rng(0)
    rows = []
    for B, L in shapes:
        ids = rng.integers(0, bb.vocab_size, size=(B, L))
        numba = timed(lambda: mapping.hash(ids), repeats)
        numpy = timed(lambda: [mapping.hash_numpy(ids, lid) for lid in mapping.layer_ids], repeats)
        got = mapping.hash(ids)
        assert all(np.array_equal(got[lid], mapping.hash_numpy(ids, lid)) for lid in mapping.layer_ids)
        rows.append({"name": f"hash {len(mapping.layer_ids)} layers", "B": B, "L": L,
                     "a": {"label": "numba", **numba}, "b": {"label": "numpy", **numpy}})
    return rows


def bench_forward(cfg: EngramConfig, bb: BackboneConfig, shapes: list[tuple[int, int]], repeats: int) -> list[dict]:
    """Forward of layer 1 against an embedded store: local vs remote reads, direct vs prefetched."""
    probe = Engram(1, cfg, bb)
    table_bytes = sum(probe.get_table_vocab_sizes()) * probe.get_embedding_dim() * 4
    segment = ((int(table_bytes * 1.05) >> 20) + 65) << 20  # whole MiB, with room to spare
    print(f"# populating layer 1: {probe.get_num_heads()} tables, {table_bytes / 2**20:.1f} MiB "
          f"(segment {segment / 2**20:.0f} MiB)", flush=True)
    rows = []
    rng = np.random.default_rng(1)
    with DistributedStore.embedded(segment_size=segment) as store, \
            DistributedStore.connect(store.master_address, local_direct=False) as remote_store:
        local = Engram(1, cfg, bb, store)
        remote = Engram(1, cfg, bb, remote_store)  # same keys, every read over TCP to the segment server
        D = local.get_embedding_dim()
        local.populate_store_from_buffers([rng.standard_normal((n, D), dtype=np.float32)
                                           for n in local.get_table_vocab_sizes()])
        try:
            # A stand-in for the transformer block computed while the rows are read: one (C, C) matmul per stream.
            w = (rng.standard_normal((bb.hidden_size, bb.hidden_size)) / np.sqrt(bb.hidden_size)).astype(np.float32)
            for B, L in shapes:
                ids = rng.integers(0, bb.vocab_size, size=(B, L))
                hidden = rng.standard_normal((B, L, bb.hc_mult, bb.hidden_size), dtype=np.float32)
                row_ids = local.hash_input_ids(ids)
                rows.append({"name": "lookup rows", "B": B, "L": L,
                             "a": {"label": "local", **timed(lambda: local.engram_store.lookup(row_ids), repeats)},
                             "b": {"label": "remote", **timed(lambda: remote.engram_store.lookup(row_ids), repeats)}})
                rows.append({"name": "forward", "B": B, "L": L,
                             "a": {"label": "local", **timed(lambda: local.forward(hidden, ids), repeats)},
                             "b": {"label": "remote", **timed(lambda: remote.forward(hidden, ids), repeats)}})
                for name, engram in (("local", local), ("remote", remote)):
                    def direct() -> np.ndarray:
                        block = np.tanh(hidden @ w)
                        return engram.forward(block, ids)

                    def prefetched() -> np.ndarray:
                        handle = engram.prefetch(ids)
                        block = np.tanh(hidden @ w)
                        return engram.forward(block, ids, prefetched=handle)

                    assert np.array_equal(direct(), prefetched())
                    rows.append({"name": f"block+forward {name}", "B": B, "L": L,
                                 "a": {"label": "prefetch", **timed(prefetched, repeats)},
                                 "b": {"label": "direct", **timed(direct, repeats)}})
        finally:
            local.remove_from_store(force=True)
            local.close()
            remote.close()
    return rows


def bench_decode(cfg: EngramConfig, bb: BackboneConfig, batch: int, steps: int, prompt_len: int) -> list[dict]:
    """A decode loop: per step, hash one new token per request for both layers, read the rows, run forward.

    A: :class:`IncrementalHasher` (hash only the new tokens, with each request's kept context). B: the obvious
    way without it, re-hashing every request's whole sequence so far and keeping the last position.
    """
    rng = np.random.default_rng(2)
    mapping = get_hash_mapping(cfg, bb)
    probe = Engram(cfg.layer_ids[0], cfg, bb)
    table_bytes = sum(sum(mapping.get_table_vocab_sizes(lid)) for lid in cfg.layer_ids) * probe.get_embedding_dim() * 4
    segment = ((int(table_bytes * 1.05) >> 20) + 65) << 20
    prompt = rng.integers(0, bb.vocab_size, size=(batch, prompt_len))
    new_tokens = rng.integers(0, bb.vocab_size, size=(steps, batch, 1))
    hidden = rng.standard_normal((batch, 1, bb.hc_mult, bb.hidden_size), dtype=np.float32)
    with DistributedStore.embedded(segment_size=segment) as store:
        engrams = [Engram(lid, cfg, bb, store) for lid in cfg.layer_ids]
        for e in engrams:
            e.populate_store_from_buffers([rng.standard_normal((n, e.get_embedding_dim()), dtype=np.float32)
                                           for n in e.get_table_vocab_sizes()])
        try:
            def loop(incremental: bool) -> tuple[float, float]:
                """Mean ms per step: (hashing only, hash + reads + forward of both layers)."""
                hasher = IncrementalHasher(mapping)
                hasher.hash_step(range(batch), prompt)
                tokens = prompt
                hash_s = 0.0
                start = time.perf_counter()
                for step in range(steps):
                    t0 = time.perf_counter()
                    if incremental:
                        rows = hasher.hash_step(range(batch), new_tokens[step])
                    else:
                        tokens = np.concatenate([tokens, new_tokens[step]], axis=1)
                        rows = {lid: r[:, -1:] for lid, r in mapping.hash(tokens).items()}
                    hash_s += time.perf_counter() - t0
                    handles = {e.layer_id: e.engram_store.prefetch(rows[e.layer_id]) for e in engrams}
                    for e in engrams:
                        e.forward(hidden, embeddings=handles[e.layer_id].result())
                return 1e3 * hash_s / steps, 1e3 * (time.perf_counter() - start) / steps

            loop(True)  # warm
            a = [loop(True) for _ in range(3)]
            b = [loop(False) for _ in range(3)]
        finally:
            for e in engrams:
                e.remove_from_store(force=True)
                e.close()
    def stats(samples: list[float], label: str) -> dict:
        return {"label": label, "mean_ms": statistics.fmean(samples), "p50_ms": statistics.median(samples),
                "repeats": len(samples)}

    return [{"name": f"decode hash ({steps} steps)", "B": batch, "L": 1,
             "a": stats([x[0] for x in a], "incr"), "b": stats([x[0] for x in b], "rehash")},
            {"name": f"decode step ({steps} steps)", "B": batch, "L": 1,
             "a": stats([x[1] for x in a], "incr"), "b": stats([x[1] for x in b], "rehash")}]


class PythonLoopHasher:
    """BASELINE ONLY: ``IncrementalHasher.hash_step`` as it was before the batched kernel, copied verbatim.

    Per request a history object, a ``np.concatenate`` and a row of a padded window built in Python, then one
    whole-batch hash of the windows. Kept here so the decode-step table shows what the kernel replaced.
    """

    def __init__(self, mapping: NgramHashMapping, max_rollback: int = 64):
        self.mapping = mapping
        self.layer_ids = list(mapping.layer_ids)
        self.context = mapping.max_ngram_size - 1
        self._keep = self.context + max_rollback
        self._requests: dict = {}  # request id -> [kept tokens (oldest first), total]

    def hash_step(self, request_ids, new_token_ids) -> dict[int, np.ndarray]:
        request_ids = list(request_ids)
        new = token_ids_2d(new_token_ids)
        if len(request_ids) != new.shape[0]:
            raise ValueError("request_ids: one per row of new_token_ids")
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("request_ids: a request appears twice in one step")
        compressed = self.mapping.prepare_ids(new)
        B, T = compressed.shape
        C = self.context
        window = np.full((B, C + T), self.mapping.pad_id, dtype=np.int64)
        window[:, C:] = compressed
        histories = [self._requests.get(r) for r in request_ids]
        for b, history in enumerate(histories):
            if history is not None and C:
                tail = history[0][-C:]
                window[b, C - tail.size:C] = tail
        rows = self.mapping.hash_prepared(window, self.layer_ids)
        for b, (request_id, history) in enumerate(zip(request_ids, histories)):
            if history is None:
                history = self._requests[request_id] = [np.empty(0, dtype=np.int64), 0]
            history[0] = np.concatenate((history[0], compressed[b]))[-self._keep:]
            history[1] += T
        return {lid: np.ascontiguousarray(r[:, C:]) for lid, r in rows.items()}


def synthetic_tokenizer(vocab_size: int) -> CompressedTokenizer:
    """A tokenizer of ``vocab_size`` ids whose texts collapse about 2.6:1 (only its lookup table is timed)."""
    return CompressedTokenizer([f"t{i % 50_000}" for i in range(vocab_size)])


def bench_decode_hashing(cfg: EngramConfig, bb: BackboneConfig, batches: list[int], context_len: int,
                         min_time_s: float, rounds: int = 5) -> list[dict]:
    """One decode step's hashing, T=1 per request, both layers: kernel vs Python loop vs re-hashing.

    Each path is timed in ``rounds`` interleaved rounds of at least ``min_time_s`` (so a burst of noise does
    not land on one path only), after a warm-up; its results are checked against hashing whole sequences
    first. ``rehash`` hashes every request's whole sequence (``context_len`` tokens) and keeps the last row.
    """
    rng = np.random.default_rng(3)
    rows = []
    for tok_label, tokenizer in (("raw ids", None), ("compressed", synthetic_tokenizer(bb.vocab_size))):
        mapping = get_hash_mapping(cfg, bb, tokenizer)
        for B in batches:
            ids = list(range(B))
            prompt = rng.integers(0, bb.vocab_size, size=(B, context_len - 1))
            steps = rng.integers(0, bb.vocab_size, size=(256, B, 1))  # cycled
            sequence = np.concatenate([prompt, steps[0]], axis=1)      # (B, context_len)
            hashers = {"kernel": IncrementalHasher(mapping), "python loop": PythonLoopHasher(mapping)}
            for hasher in hashers.values():
                hasher.hash_step(ids, prompt)
            check = {name: hasher.hash_step(ids, steps[0]) for name, hasher in hashers.items()}
            full = mapping.hash(sequence)
            for lid in mapping.layer_ids:
                for name in hashers:
                    assert np.array_equal(check[name][lid], full[lid][:, -1:]), f"{name} differs from hashing"
            paths = {
                "kernel": lambda i, h=hashers["kernel"]: h.hash_step(ids, steps[i % 256]),
                "python loop": lambda i, h=hashers["python loop"]: h.hash_step(ids, steps[i % 256]),
                "rehash": lambda i: {lid: r[:, -1:] for lid, r in mapping.hash(sequence).items()},
            }
            samples: dict[str, list[int]] = {name: [] for name in paths}
            for fn in paths.values():
                for i in range(50):
                    fn(-1 - i)
            for _ in range(rounds):
                for name, fn in paths.items():
                    samples[name] += time_ns(fn, min_reps=5, min_time_s=min_time_s, start=len(samples[name]))
            stats = {name: Stats.from_ns(t) for name, t in samples.items()}
            rows.append({"case": f"decode hash T=1, {tok_label}", "B": B, "layers": len(mapping.layer_ids),
                         "context_len": context_len, **{name: st.as_dict() for name, st in stats.items()}})
    print_columns(
        ["case", "B", "layers", "kernel p50", "kernel p99", "py-loop p50", "py-loop p99",
         f"rehash L={context_len} p50", "rehash p99", "py-loop/kernel"],
        [[r["case"], r["B"], r["layers"], fmt(r["kernel"]["p50_us"]), fmt(r["kernel"]["p99_us"]),
          fmt(r["python loop"]["p50_us"]), fmt(r["python loop"]["p99_us"]), fmt(r["rehash"]["p50_us"]),
          fmt(r["rehash"]["p99_us"]), f"{r['python loop']['p50_us'] / r['kernel']['p50_us']:.1f}x"]
         for r in rows],
        title="decode-step hashing, us per step (kernel: IncrementalHasher; py-loop: the per-request Python "
              "loop it replaced; rehash: whole sequences)")
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'case':<24s} {'B x L':>10s} | {'A':>8s} {'mean ms':>9s} {'p50 ms':>9s} | {'B':>8s} {'mean ms':>9s} "
          f"{'p50 ms':>9s} | {'B/A':>6s}")
    for r in rows:
        a, b = r["a"], r["b"]
        r["ratio_b_over_a"] = b["mean_ms"] / a["mean_ms"] if a["mean_ms"] > 0 else float("inf")
        print(f"{r['name']:<24s} {r['B']:>4d} x {r['L']:<4d} | {a['label']:>8s} {a['mean_ms']:9.3f} {a['p50_ms']:9.3f} "
              f"| {b['label']:>8s} {b['mean_ms']:9.3f} {b['p50_ms']:9.3f} | {r['ratio_b_over_a']:6.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1%% tables, shorter sequences, fewer repeats")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--rows-scale", type=float, default=None,
                        help="scale every table's base size (default 1.0; 0.01 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions per case (default 10; 3 quick)")
    parser.add_argument("--skip-forward", action="store_true", help="hashing only (no store)")
    parser.add_argument("--decode-hash-only", action="store_true", help="only the decode-step hashing table")
    args = parser.parse_args(argv)
    rows_scale = args.rows_scale if args.rows_scale is not None else (0.01 if args.quick else 1.0)
    if not 0 < rows_scale <= 1:
        parser.error("--rows-scale must be in (0, 1]")
    repeats = args.repeats or (3 if args.quick else 10)
    forward_len = 1024 if args.quick else 4096

    cfg, bb = configs(rows_scale)
    print(f"# DeepSeek demo config, engram_vocab_size={cfg.engram_vocab_size} (rows scale {rows_scale:g}"
          f"{'; full size is ' + str(DEMO_VOCAB * 5) if rows_scale != 1 else ''}), {repeats} repeats")
    if args.quick:
        print(f"# --quick: tables at {rows_scale:g} of full size, forward at L={forward_len} instead of 4096")
    rows = []
    if not args.decode_hash_only:
        rows = bench_hashing(cfg, bb, [(64, 4096), (1, 4096), (256, 1)], repeats)
        if not args.skip_forward:
            rows += bench_forward(cfg, bb, [(1, forward_len), (256, 1)], repeats)
            rows += bench_decode(cfg, bb, batch=256, steps=64, prompt_len=256 if args.quick else 1024)
        print_table(rows)
    decode_hash = bench_decode_hashing(cfg, bb, [64, 256], context_len=256 if args.quick else 1024,
                                       min_time_s=0.1 if args.quick else 0.5)
    if args.json:
        result = {
            "benchmark": "engram_model", "quick": args.quick, "rows_scale": rows_scale, "repeats": repeats,
            "config": {"engram_vocab_size": cfg.engram_vocab_size, "max_ngram_size": cfg.max_ngram_size,
                       "n_embed_per_ngram": cfg.n_embed_per_ngram, "n_head_per_ngram": cfg.n_head_per_ngram,
                       "layer_ids": cfg.layer_ids, "hidden_size": bb.hidden_size, "hc_mult": bb.hc_mult},
            "platform": {"python": sys.version.split()[0], "numpy": np.__version__, "machine": platform.machine()},
            "results": rows,
            "decode_step_hashing_us": decode_hash,
        }
        write_json(args.json, result)  # adds the command line and the machine
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
