"""DeepSeek-V4.1's Engram: the hash, the fused row gather + FP8 decode, and where one Engram step spends its time.

    python bench/bench_v41.py [--quick] [--sections hash,ragged,gather,step] [--rows N] [--json PATH]

* hash: the released config (layers [1, 14], 48 ids per token), a random token map of 129,280 ids onto 99,092.
  Prefill (whole sequences) in tokens/s and one decode step of 64 and 256 requests in us: the Numba kernel of
  ``V41Hasher`` beside the same hash vectorised in NumPy (``V41Hasher.hash_numpy``; for a step, the window of
  kept history plus the new token). Both run on one core.
* ragged: continuous batching, ``V41Hasher.step_ragged`` (requests flattened as engines pass them, a state slot
  each) beside the existing paths for the same tokens, in the same run: prefill beside a whole-sequence call;
  decode steps beside ``step`` on a ``[B, 1]`` batch; a speculative step (each request's token plus 4 drafts, hashed
  with ``commit=False``, then ``commit`` of a random accepted prefix of 1..5) beside what the existing API needs
  for it: a snapshot, ``step`` on ``[B, 5]``, and, from the snapshot, one ``step`` per group of requests that
  accepted the same number of tokens.
* gather: the released row format (24 columns, 264-byte rows: 256 e4m3 codes + 8 e8m0 scale bytes) in tables
  of ``--rows`` rows per column held in this process; ``V41Engram.rows`` (gather and decode in one kernel, no
  copy of the packed rows) beside a NumPy gather followed by ``decode_fp8_rows``, and beside an all-NumPy decode.
* step: one V4.1 Engram step of the demo config (``engram_model.v41.demo``: 2 layers, 12 columns, head_dim 64,
  hidden 512 x 4 streams) with its tables in an embedded store, at prefill 4x1024 and decode 64x1: the hash of
  both layers, then per layer the gather + decode, the kv projection (BLAS), its bf16 rounding and the gate.

Times are medians (p50) of repeated calls in one process, on a shared machine: compare columns within a run.
BLAS runs on one thread (``OPENBLAS_NUM_THREADS=1`` unless set), like everything else here: two threads on a
shared 2-core machine made the kv projection's time swing threefold between identical calls.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before NumPy loads its BLAS

import numpy as np
from _common import default_json_path, fmt, measure, print_table, write_json

from engram_model.v41 import V41Config, V41Engram, V41Hasher, V41HashState, decode_fp8_rows, v41_store_config
from engram_model.v41 import _kernels
from engram_model.v41._fp8 import DECODE_TABLE
from engram_model.v41.demo import demo_config, demo_token_map, random_layer
from engram_store import DistributedStore, EngramStore

RELEASED_VOCAB = 129280
DEAD = -1


def _p50(fn, quick: bool, warmup: int = 2) -> float:
    """Median microseconds of ``fn()``."""
    return measure(lambda i: fn(), warmup=warmup, min_reps=5 if quick else 15,
                   min_time_s=0.3 if quick else 1.5).p50_us


def _token_map(rng: np.random.Generator, vocab: int, distinct: int) -> np.ndarray:
    keys = np.concatenate([np.arange(distinct), rng.integers(0, distinct, vocab - distinct)])
    rng.shuffle(keys)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    rank = np.empty(first.size, dtype=np.int64)
    rank[np.argsort(first)] = np.arange(first.size)
    return rank[inverse.ravel()]


def numpy_step(hasher: V41Hasher, history: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """One decode step (T = 1) in vectorised NumPy: the kept history and the new token as one window."""
    c0 = hasher.token_map[tokens[:, 0]]                                          # (B,)
    window = np.concatenate([c0[:, None], history], axis=1)                       # (B, max_n): s tokens back
    blocked = np.logical_or.accumulate(window == DEAD, axis=1)
    tok = np.where(blocked, hasher.pad, window)
    B = tokens.shape[0]
    n_layers, max_n = hasher.multipliers.shape
    n_heads = hasher.config.n_heads
    out = np.empty((B, 1, n_layers, hasher.primes.shape[1]), dtype=np.int64)
    r = tok[:, None, 0] * hasher.multipliers[None, :, 0]                        # (B, n_layers)
    for n in range(2, max_n + 1):
        r = r ^ (tok[:, None, n - 1] * hasher.multipliers[None, :, n - 1])
        cols = slice((n - 2) * n_heads, (n - 1) * n_heads)
        out[:, 0, :, cols] = r[..., None] % hasher.primes[:, cols] + hasher.offsets[:, cols]
    history[:, 1:] = history[:, :-1].copy()
    history[:, 0] = c0
    return out


def bench_hash(quick: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    config = V41Config(layer_ids=[1, 14])
    hasher = V41Hasher(config, _token_map(rng, RELEASED_VOCAB, config.compressed_vocab_size))
    ids_per_token = len(config.layer_ids) * config.cols
    results, rows = [], []
    for B, L in ([(4, 1024)] if quick else [(4, 4096), (1, 16384)]):
        ids = rng.integers(0, RELEASED_VOCAB, size=(B, L))
        assert np.array_equal(hasher(ids), hasher.hash_numpy(ids))
        numba_us, numpy_us = _p50(lambda: hasher(ids), quick), _p50(lambda: hasher.hash_numpy(ids), quick)
        tokens = B * L
        results.append({"case": "prefill", "B": B, "L": L, "ids_per_token": ids_per_token,
                        "numba_tokens_per_s": tokens / numba_us * 1e6, "numpy_tokens_per_s": tokens / numpy_us * 1e6,
                        "numba_us": numba_us, "numpy_us": numpy_us})
        rows.append([f"prefill {B}x{L}", f"{fmt(tokens / numba_us)}M tok/s", f"{fmt(tokens / numpy_us)}M tok/s",
                     f"{numpy_us / numba_us:.1f}x"])
    for B in (64, 256):
        prompt = rng.integers(0, RELEASED_VOCAB, size=(B, 5))
        state = hasher.begin(B)
        hasher.step(state, prompt)
        history = state.history.copy()
        tok = rng.integers(0, RELEASED_VOCAB, size=(B, 1))
        assert np.array_equal(hasher.step(state.copy(), tok), numpy_step(hasher, history.copy(), tok))
        numba_us = _p50(lambda: hasher.step(state, tok), quick)
        numpy_us = _p50(lambda: numpy_step(hasher, history, tok), quick)
        results.append({"case": "decode step", "B": B, "L": 1, "ids_per_token": ids_per_token,
                        "numba_us": numba_us, "numpy_us": numpy_us})
        rows.append([f"decode step, {B} requests", f"{numba_us:.1f} us", f"{numpy_us:.1f} us",
                     f"{numpy_us / numba_us:.1f}x"])
    print_table(["V4.1 hash, 2 layers x 24 ids", "Numba", "NumPy", "NumPy / Numba"], rows,
                title="hash (released config, one core)")
    return results


def existing_speculative_step(hasher: V41Hasher, state: V41HashState, tokens: np.ndarray,
                              accepted: np.ndarray) -> np.ndarray:
    """A draft step and its acceptance with the existing API: ``tokens [B, K]`` hashed after a snapshot, then from
    the snapshot each group of requests that accepted the same number of tokens stepped by them (``step`` takes
    one length for the whole batch)."""
    snapshot = state.history.copy()
    rows = hasher.step(state, tokens)                                             # (B, K, n_layers, cols)
    state.history[:] = snapshot
    for a in np.unique(accepted):
        idx = np.flatnonzero(accepted == a)
        group = V41HashState(snapshot[idx])
        hasher.step(group, tokens[idx, :a])
        state.history[idx] = group.history
    return rows


def bench_ragged(quick: bool) -> list[dict]:
    rng = np.random.default_rng(3)
    config = V41Config(layer_ids=[1, 14])
    hasher = V41Hasher(config, _token_map(rng, RELEASED_VOCAB, config.compressed_vocab_size))
    results, rows = [], []
    for B, L in ([(1, 16384), (4, 4096)] if not quick else [(4, 1024)]):   # prefill: whole prompts in one step
        ids = rng.integers(0, RELEASED_VOCAB, size=(B, L))
        flat, starts, slots = ids.ravel(), np.arange(B + 1) * L, np.arange(B)
        assert np.array_equal(hasher.step_ragged(hasher.begin(B), flat, slots, starts).reshape(B, L, 2, -1),
                              hasher(ids))
        ragged_us = _p50(lambda: hasher.step_ragged(hasher.begin(B), flat, slots, starts), quick)
        existing_us = _p50(lambda: hasher(ids), quick)
        n = B * L
        results.append({"case": "prefill", "requests": B, "tokens": n, "existing": "V41Hasher(ids [B, L])",
                        "ragged_us": ragged_us, "existing_us": existing_us,
                        "ragged_tokens_per_s": n / ragged_us * 1e6, "existing_tokens_per_s": n / existing_us * 1e6})
        rows.append([f"prefill {B}x{L}", f"{n:,}", f"{fmt(n / ragged_us)}M tok/s", f"{fmt(n / existing_us)}M tok/s",
                     "whole-sequence call", f"{existing_us / ragged_us:.2f}x"])
    for B in (64, 256):
        prompt = rng.integers(0, RELEASED_VOCAB, size=(B, 5))
        state = hasher.begin(B)
        hasher.step(state, prompt)
        old = state.copy()
        slots = rng.permutation(B)                     # requests sit in slots in any order
        tok = rng.integers(0, RELEASED_VOCAB, size=(B, 1))
        flat = np.empty(B, dtype=np.int64)
        flat[np.argsort(slots)] = tok[:, 0]            # request r (slot slots[r]) brings sequence slots[r]'s token
        starts = np.arange(B + 1)
        check = state.copy()
        got = hasher.step_ragged(check, flat, slots, starts)
        assert np.array_equal(got, hasher.step(old.copy(), tok)[slots, 0])
        ragged_us = _p50(lambda: hasher.step_ragged(state, flat, slots, starts), quick)
        existing_us = _p50(lambda: hasher.step(old, tok), quick)
        results.append({"case": "decode step", "requests": B, "tokens": B, "existing": "V41Hasher.step(tokens [B, 1])",
                        "ragged_us": ragged_us, "existing_us": existing_us})
        rows.append([f"decode step, {B} requests", f"{B:,}", f"{ragged_us:.1f} us", f"{existing_us:.1f} us",
                     "step [B, 1]", f"{existing_us / ragged_us:.2f}x"])

        K = 5                                          # the request's token and 4 drafts
        tokens = rng.integers(0, RELEASED_VOCAB, size=(B, K))
        accepted = rng.integers(1, K + 1, size=B)
        acc_starts = np.concatenate([[0], np.cumsum(accepted)])
        acc_tokens = np.concatenate([tokens[r, :accepted[r]] for r in range(B)])
        draft_starts = np.arange(B + 1) * K
        ragged_state, existing_state = old.copy(), old.copy()
        draft = hasher.step_ragged(ragged_state, tokens.ravel(), np.arange(B), draft_starts, commit=False)
        hasher.commit(ragged_state, acc_tokens, np.arange(B), acc_starts)
        existing = existing_speculative_step(hasher, existing_state, tokens, accepted)
        assert np.array_equal(draft, existing.reshape(B * K, 2, -1))
        assert np.array_equal(ragged_state.history, existing_state.history)

        def ragged_spec():
            hasher.step_ragged(ragged_state, tokens.ravel(), np.arange(B), draft_starts, commit=False)
            hasher.commit(ragged_state, acc_tokens, np.arange(B), acc_starts)

        draft_us = _p50(lambda: hasher.step_ragged(ragged_state, tokens.ravel(), np.arange(B), draft_starts,
                                                   commit=False), quick)
        commit_us = _p50(lambda: hasher.commit(ragged_state, acc_tokens, np.arange(B), acc_starts), quick)
        ragged_us = _p50(ragged_spec, quick)
        existing_us = _p50(lambda: existing_speculative_step(hasher, existing_state, tokens, accepted), quick)
        results.append({"case": "speculative step", "requests": B, "tokens": B * K, "drafts_per_request": K - 1,
                        "accepted_tokens": int(accepted.sum()),
                        "existing": "snapshot + V41Hasher.step(tokens [B, 5]) + a step per accepted length",
                        "ragged_us": ragged_us, "ragged_draft_us": draft_us, "ragged_commit_us": commit_us,
                        "existing_us": existing_us})
        rows.append([f"speculative step, {B} requests x (1 + 4 drafts)", f"{B * K:,}",
                     f"{ragged_us:.1f} us ({draft_us:.1f} + {commit_us:.1f})", f"{existing_us:.1f} us",
                     "snapshot, step [B, 5], a step per accepted length", f"{existing_us / ragged_us:.2f}x"])
    print_table(["V4.1 hash, 2 layers x 24 ids", "tokens", "step_ragged", "existing", "existing path",
                 "existing / ragged"], rows, title="continuous batching (released config, one core)")
    return results


def bench_gather(quick: bool, rows_per_column: int) -> list[dict]:
    rng = np.random.default_rng(1)
    config = V41Config(layer_ids=[1, 14], engram_vocab_size=rows_per_column, hidden_size=8)  # 24 x 264-byte rows
    layout = v41_store_config(config, 1)
    print(f"# building {config.cols} tables of ~{rows_per_column} rows x {config.row_bytes} B "
          f"({sum(layout.table_vocab_sizes) * config.row_bytes / 2**20:.0f} MiB)", flush=True)
    tables = []
    for n in layout.table_vocab_sizes:
        t = rng.integers(0, 256, size=(n, config.row_bytes), dtype=np.uint8)
        t[:, :256] &= 0xF7                                           # no NaN codes
        t[:, 256:] = rng.integers(110, 130, size=(n, 8), dtype=np.uint8)
        tables.append(t)
    store = EngramStore(1, layout, None)
    store.bind_local(tables)
    K = config.cols * config.head_dim
    engram = V41Engram(config, 1, np.zeros((5 * 8, K), np.float32), np.ones((4, 8), np.float32),
                       np.ones((4, 8), np.float32), store)
    offsets = config.offsets(1)
    primes = np.array(layout.table_vocab_sizes)

    def numpy_gather_then_decode(row_ids):
        packed = np.stack([tables[c][row_ids[..., c] - offsets[c]] for c in range(config.cols)], axis=2)
        return decode_fp8_rows(packed)

    def all_numpy(row_ids):
        packed = np.stack([tables[c][row_ids[..., c] - offsets[c]] for c in range(config.cols)], axis=2)
        scales = np.repeat(packed[..., 256:], 32, axis=-1)
        return DECODE_TABLE[scales, packed[..., :256]]

    results, rows = [], []
    for B, L in [(4, 1024), (64, 1), (256, 1)]:
        row_ids = offsets + (rng.random((B, L, config.cols)) * primes).astype(np.int64)
        fused = engram.rows(row_ids)
        assert np.array_equal(fused, numpy_gather_then_decode(row_ids)) and np.array_equal(fused, all_numpy(row_ids))
        t_fused = _p50(lambda: engram.rows(row_ids), quick)
        t_split = _p50(lambda: numpy_gather_then_decode(row_ids), quick)
        t_numpy = _p50(lambda: all_numpy(row_ids), quick)
        n = B * L * config.cols
        results.append({"B": B, "L": L, "rows": n, "fused_us": t_fused, "numpy_gather_decode_fp8_rows_us": t_split,
                        "all_numpy_us": t_numpy, "fused_rows_per_s": n / t_fused * 1e6})
        rows.append([f"{B}x{L} ({n:,} rows)", fmt(t_fused), fmt(t_split), fmt(t_numpy), f"{t_split / t_fused:.1f}x",
                     f"{n * config.row_bytes / t_fused / 1e3:.2f}"])
    print_table(["rows of 24 columns", "fused us", "NumPy gather + decode_fp8_rows us", "all-NumPy us",
                 "speed-up", "fused GB/s (packed)"], rows,
                title=f"gather + decode (264-byte rows, {config.cols} tables of ~{rows_per_column:,} rows)")
    store.close()
    return results


def bench_step(quick: bool) -> list[dict]:
    rng = np.random.default_rng(2)
    config = demo_config()
    hasher = V41Hasher(config, demo_token_map(config))
    results = []
    table_rows = []
    with DistributedStore.embedded(segment_size="256MiB") as store:
        layers = [random_layer(config, lid, store, rng) for lid in config.layer_ids]
        engrams = [V41Engram(config, lid, w["wkv"], w["q_weight"], w["k_weight"], t, hasher)
                   for lid, (t, w) in zip(config.layer_ids, layers)]
        try:
            for name, (B, L) in (("prefill", (4, 1024)), ("decode", (64, 1))):
                prompt = rng.integers(0, 16_000, size=(B, 8))
                state = hasher.begin(B)
                hasher.step(state, prompt)
                ids = rng.integers(0, 16_000, size=(B, L))
                h = rng.standard_normal((B, L, config.hc_mult, config.hidden_size), dtype=np.float32)
                stages: dict[str, float] = {}
                if name == "prefill":
                    stages["hash, both layers"] = _p50(lambda: hasher(ids), quick)
                    row_ids = hasher(ids)
                else:
                    stages["hash, both layers"] = _p50(lambda: hasher.step(state.copy(), ids), quick)
                    row_ids = hasher.step(state.copy(), ids)
                for engram in engrams:
                    lid = engram.layer_id
                    E = engram.rows(row_ids)
                    kv = E.reshape(B * L, -1) @ engram.wkv.T
                    out = np.empty_like(h)
                    stages[f"layer {lid}: gather + FP8 decode"] = _p50(lambda: engram.rows(row_ids), quick)
                    stages[f"layer {lid}: kv = E @ wkv.T (BLAS)"] = _p50(lambda: E.reshape(B * L, -1) @ engram.wkv.T,
                                                                         quick)
                    stages[f"layer {lid}: round kv to bf16"] = _p50(lambda: _kernels.round_bf16_inplace(kv), quick)
                    stages[f"layer {lid}: gate + residual"] = _p50(
                        lambda: _kernels.gate_output(h.reshape(B * L, config.hc_mult, -1), kv, engram.gate_weight,
                                                     config.rms_norm_eps, np.ones(1, bool), False,
                                                     out.reshape(B * L, config.hc_mult, -1)), quick)

                def whole_step():
                    rows = hasher(ids) if name == "prefill" else hasher.step(state.copy(), ids)
                    x = h
                    for engram in engrams:
                        x = engram.forward(x, row_ids=rows)
                    return x

                total = _p50(whole_step, quick)
                parts = sum(stages.values())
                results.append({"case": name, "B": B, "L": L, "stages_us": stages, "sum_of_stages_us": parts,
                                "whole_step_us": total})
                table_rows.append((name, B, L, stages, parts, total))
        finally:
            for engram, (table, _) in zip(engrams, layers):
                engram.close()
                table.remove_from_store()
                table.close()
    names = list(table_rows[0][3])
    rows = []
    for stage in names + ["sum of the stages", "whole step (hash + forward of both layers)"]:
        cells = [stage]
        for case, B, L, stages, parts, total in table_rows:
            value = stages.get(stage, parts if stage.startswith("sum") else total)
            unit = 1e3 if case == "prefill" else 1.0
            cells += [fmt(value / unit, 2 if case == "prefill" else 1), f"{100 * value / total:.0f}%"]
        rows.append(cells)
    print_table(["one V4.1 Engram step (demo config)", "prefill 4x1024 ms", "share", "decode 64x1 us", "share"],
                rows, title="where one step's time goes (embedded store, rows decoded in place)")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller tables, shorter runs")
    parser.add_argument("--sections", default="hash,ragged,gather,step",
                        help="comma-separated: hash, ragged, gather, step")
    parser.add_argument("--rows", type=int, default=None,
                        help="rows per column in the gather section (default 100,000; 20,000 with --quick)")
    parser.add_argument("--json", metavar="PATH", default=default_json_path("bench_v41"))
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - {"hash", "ragged", "gather", "step"}
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}")
    result: dict = {}
    if "hash" in sections:
        result["hash"] = bench_hash(args.quick)
    if "ragged" in sections:
        result["ragged"] = bench_ragged(args.quick)
    if "gather" in sections:
        result["gather"] = bench_gather(args.quick, args.rows or (20_000 if args.quick else 100_000))
    if "step" in sections:
        result["step"] = bench_step(args.quick)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
