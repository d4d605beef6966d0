"""DeepSeek-V4.1's Engram on a small scale: two layers, orders 2..4, FP8 rows, 4 streams, tables in the store.

Run ``python -m engram_model.v41.demo``. The store runs inside this process (``DistributedStore.embedded()``);
``--master HOST:PORT`` uses a running ``engram-master`` instead. The configuration keeps the released structure
(layers [1, 14], n-gram orders 2..4, e4m3 rows with an e8m0 scale per 32 values, hc_mult 4) at a size that fits
a laptop: 4 heads per order (12 columns), head_dim 64, tables of about 20,000 rows per column, hidden size 512.
Tables and weights are random, and the token map is a stand-in for ``build_token_map(tokenizer)``.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

from engram_store import DistributedStore, EngramStore

from ._config import V41Config, v41_store_config
from ._layer import V41Engram
from ._fp8 import round_bf16
from ._hasher import V41Hasher

#: Raw token ids of the demo's stand-in tokenizer.
DEMO_VOCAB = 16_000


def demo_config() -> V41Config:
    """The released structure, scaled down: every field but the sizes is the release's."""
    return V41Config(layer_ids=[1, 14], max_ngram_size=4, n_heads=4, head_dim=64, engram_vocab_size=20_000,
                     compressed_vocab_size=10_000, pad_id=2, hidden_size=512, hc_mult=4, rms_norm_eps=1e-20)


def demo_token_map(config: V41Config, vocab: int = DEMO_VOCAB) -> np.ndarray:
    """A stand-in for ``build_token_map(tokenizer)``: ``vocab`` ids folded onto the config's compressed ids, in
    order of first appearance (as case and spacing variants of a word fold onto one key)."""
    return np.arange(vocab, dtype=np.int64) % config.compressed_vocab_size


def random_layer(config: V41Config, layer_id: int, store, rng: np.random.Generator,
                 ) -> tuple[EngramStore, dict[str, np.ndarray]]:
    """Populate random FP8 tables for ``layer_id`` and draw its weights: ``(table, {wkv, q_weight, k_weight})``.

    Rows are random e4m3 codes (NaN codes excluded) with scale bytes around 2^-7, so values stay within a few
    units; ``encode_fp8_rows`` makes such rows from float values.
    """
    layout = v41_store_config(config, layer_id)
    D = config.head_dim
    tables = []
    for n in layout.table_vocab_sizes:
        rows = rng.integers(0, 256, size=(n, config.row_bytes), dtype=np.uint8)
        rows[:, :D] &= 0xF7                                               # no NaN codes (0x7F, 0xFF)
        rows[:, D:] = rng.integers(118, 124, size=(n, D // 32), dtype=np.uint8)  # scales 2^-9 .. 2^-4
        tables.append(rows)
    table = EngramStore(layer_id, layout, store)
    table.populate(tables)
    hc, hidden, K = config.hc_mult, config.hidden_size, config.cols * D
    weights = {"wkv": (rng.standard_normal(((hc + 1) * hidden, K), dtype=np.float32) / np.sqrt(K)),
               "q_weight": rng.standard_normal((hc, hidden), dtype=np.float32),
               "k_weight": rng.standard_normal((hc, hidden), dtype=np.float32)}
    return table, weights


@contextmanager
def _step(name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    print(f"  {name:<44s} {1e3 * (time.perf_counter() - start):9.2f} ms")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engram_model.v41.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--master", metavar="HOST:PORT", help="use this running master instead of an embedded store")
    parser.add_argument("--segment-size", default="256MiB", help="segment mounted by this process (default 256MiB)")
    parser.add_argument("--batch", type=int, default=4, help="requests B (default 4)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prefill length L (default 64)")
    parser.add_argument("--decode-steps", type=int, default=8, help="decode steps (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tables, weights and tokens")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.prompt_len < 1 or args.decode_steps < 0:
        parser.error("--batch and --prompt-len must be >= 1, --decode-steps >= 0")
    return args


def _prefill(config: V41Config, hasher: V41Hasher, engrams: list[V41Engram], rng: np.random.Generator, B: int,
             L: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A prompt through both layers, one position masked: the prompt, its mask and its row ids."""
    prompt = rng.integers(0, DEMO_VOCAB, size=(B, L))
    mask = np.ones((B, L), dtype=bool)
    mask[0, L // 2] = False  # say, an image position: no n-gram reaches across it, its gate is shut
    hidden = rng.standard_normal((B, L, config.hc_mult, config.hidden_size), dtype=np.float32)
    with _step(f"prefill {B}x{L}: hash both layers once"):
        row_ids = hasher(prompt, token_mask=mask)
    with _step("prefill: start both layers' reads"):
        pending = [e.prefetch(row_ids=row_ids) for e in engrams]
    with _step("prefill: forward both layers"):
        h_in = hidden
        for engram, handle in zip(engrams, pending):  # (the decoder layers in between run here)
            hidden = engram.forward(hidden, token_mask=mask, prefetched=handle)
    passed = np.array_equal(hidden[0, L // 2], round_bf16(h_in[0, L // 2]))
    print(f"  output {hidden.shape} {hidden.dtype} holding bf16 values; the masked position passed through "
          f"unchanged: {passed}")
    return prompt, mask, row_ids


def _decode(config: V41Config, hasher: V41Hasher, engrams: list[V41Engram], rng: np.random.Generator,
            prompt: np.ndarray, mask: np.ndarray, row_ids: np.ndarray, decode_steps: int) -> None:
    """Decode steps after the prompt, then speculative tokens rolled back by a snapshot of the decode state."""
    B = prompt.shape[0]
    state = hasher.begin(B)
    steps = hasher.step(state, prompt, token_mask=mask)  # the prompt as one chunk: the rows of the call above
    assert np.array_equal(steps, row_ids)
    tokens = rng.integers(0, DEMO_VOCAB, size=(B, 1))
    for k in range(decode_steps):
        h = rng.standard_normal((B, 1, config.hc_mult, config.hidden_size), dtype=np.float32)
        with _step(f"decode step {k}: hash + 2 layers ({B} requests)"):
            ids = hasher.step(state, tokens)
            for engram in engrams:
                h = engram.forward(h, row_ids=ids)
        tokens = rng.integers(0, DEMO_VOCAB, size=(B, 1))
    snapshot = state.copy()
    hasher.step(state, rng.integers(0, DEMO_VOCAB, size=(B, 3)))  # 3 speculative tokens, all rejected
    state = snapshot
    print("  speculative tokens rolled back by restoring a state snapshot")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)

    config = demo_config()
    rng = np.random.default_rng(args.seed)
    B, L = args.batch, args.prompt_len
    print(f"DeepSeek-V4.1 Engram demo: layers {list(config.layer_ids)}, {config.cols} columns x "
          f"{config.row_bytes}-byte FP8 rows, hidden {config.hidden_size} x {config.hc_mult} streams")
    with _step("store setup"):
        store = (DistributedStore.connect(args.master, segment_size=args.segment_size) if args.master
                 else DistributedStore.embedded(segment_size=args.segment_size))
    tables: list[EngramStore] = []
    engrams: list[V41Engram] = []
    try:
        hasher = V41Hasher(config, demo_token_map(config))
        with _step(f"populate {len(config.layer_ids)} layers"):
            for layer_id in config.layer_ids:
                table, w = random_layer(config, layer_id, store, rng)
                tables.append(table)
                engrams.append(V41Engram(config, layer_id, w["wkv"], w["q_weight"], w["k_weight"], table, hasher))
        rows = sum(config.num_embeddings(lid) for lid in config.layer_ids)
        print(f"  tables: {rows} rows, {rows * config.row_bytes / 2**20:.1f} MiB")

        with _step("first calls (load the compiled kernels)"):
            warm = np.zeros((1, 1), dtype=np.int64)
            for engram in engrams:
                engram.forward(np.zeros((1, 1, config.hc_mult, config.hidden_size), np.float32), warm)

        prompt, mask, row_ids = _prefill(config, hasher, engrams, rng, B, L)
        _decode(config, hasher, engrams, rng, prompt, mask, row_ids, args.decode_steps)
        paths = [f"layer {e.layer_id}: {e.fused_reads} fused, {e.staged_reads} staged" for e in engrams]
        print(f"  row reads ({'; '.join(paths)})")
    finally:
        with _step("remove tables, close"):
            for engram in engrams:
                engram.close()
            for table in tables:
                table.remove_from_store()
                table.close()
            store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
