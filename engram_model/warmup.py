"""Compile every Numba kernel of engram ahead of time: ``engram-warmup`` (or ``python -m engram_model.warmup``).

The store's kernels (row gathers, range reads, planning), the model's hashing kernels (prefill and decode), and
DeepSeek-V4.1's (hash, its continuous-batching step, FP8 row decoding fused with the gather for 12 and 24 columns,
gate, checkpoint packing, the engines' row gathers), and Qwen4-Exp's PLE hash.
Nothing needs this: kernels compile on first use and are cached on disk (see :mod:`engram_store.warmup` for
where, and ``NUMBA_CACHE_DIR``). Run it when building a deployment image, so no request pays for compilation.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from engram_store import cli


def warm_model(verbose: bool = True) -> float:
    """Hash a few tokens through the prefill and decode paths of a small configuration; returns seconds."""
    start = time.perf_counter()
    from ._config import BackboneConfig, EngramConfig
    from ._hashing import get_hash_mapping
    from ._incremental import IncrementalHasher

    config = EngramConfig(engram_vocab_size=[1000, 1000], max_ngram_size=3, n_embed_per_ngram=32,
                          n_head_per_ngram=2, layer_ids=[1, 2], tokenizer_name_or_path=None)
    mapping = get_hash_mapping(config, BackboneConfig(vocab_size=1000, num_layers=3), None)
    ids = np.arange(8, dtype=np.int64).reshape(2, 4)
    mapping.hash_layers(ids, [1, 2])
    hasher = IncrementalHasher(mapping)
    hasher.hash_step(["a", "b"], ids[:, :1])
    hasher.hash_step(["a", "b"], ids[:, 1:3])
    elapsed = time.perf_counter() - start
    if verbose:
        print(f"engram_model kernels ready in {elapsed:.1f} s", flush=True)
    return elapsed


def warm_v41(verbose: bool = True) -> float:
    """Run DeepSeek-V4.1's kernels once on tiny inputs, through the same wrappers serving uses; returns seconds.

    The fused gather is compiled per column count: 24 (the release) and 12 (``engram_model.v41.demo``).
    """
    from engram_store import EngramStore

    from .v41 import V41Config, V41Engram, V41Hasher, decode_fp8_rows, encode_fp8_rows, v41_store_config

    start = time.perf_counter()
    for n_heads in (8, 4):
        config = V41Config(layer_ids=[1, 14], max_ngram_size=4, n_heads=n_heads, head_dim=32, engram_vocab_size=40,
                           compressed_vocab_size=8, hidden_size=8, hc_mult=4)
        hasher = V41Hasher(config, np.arange(16, dtype=np.int64) % 8)
        layout = v41_store_config(config, 1)
        table = EngramStore(1, layout, None)
        table.bind_local([encode_fp8_rows(np.ones((n, 32), dtype=np.float32)) for n in layout.table_vocab_sizes])
        K = config.cols * config.head_dim
        engram = V41Engram(config, 1, np.zeros((40, K), np.float32), np.ones((4, 8), np.float32),
                           np.ones((4, 8), np.float32), table, hasher)
        ids = np.arange(6, dtype=np.int64).reshape(2, 3)
        hidden = np.zeros((2, 3, 4, 8), dtype=np.float32)
        engram.forward(hidden, ids, token_mask=np.ones((2, 3), dtype=bool), position_ids=np.zeros((2, 3), np.int64))
        engram.forward(hidden, ids)
        hasher.step(hasher.begin(2), ids)
        state = hasher.begin(4)  # continuous batching: a draft hashed, then its accepted tokens committed
        flags = np.zeros(6, dtype=bool)
        hasher.step_ragged(state, ids.ravel(), [3, 0], [0, 2, 6], token_mask=~flags, doc_start=flags, commit=False)
        hasher.commit(state, ids.ravel()[:3], [3, 0], [0, 1, 3])
        table.close()
        if n_heads == 8:  # engram-stats --v41: a corpus replayed into the curve, first touches counted
            from .v41._sizing import replay_tokens, sizing_report

            sizing_report(replay_tokens(config, np.arange(16, dtype=np.int64) % 8, ids, max_keys=4), 0.5)
    decode_fp8_rows(encode_fp8_rows(np.ones((2, 32), dtype=np.float32)))
    from ._rows_gather import warm_kernels

    warm_kernels()  # the engines' row gathers (V41Rows)
    _warm_v41_checkpoint()
    elapsed = time.perf_counter() - start
    if verbose:
        print(f"engram_model.v41 kernels ready in {elapsed:.1f} s", flush=True)
    return elapsed


def warm_ple(verbose: bool = True) -> float:
    """Run Qwen4-Exp's PLE hash kernel once through the paths serving uses (whole sequences, a ragged step, a draft
    and its commit, a step after vLLM's context), and the engines' row gathers (PLERows); returns seconds."""
    from ._rows_gather import warm_kernels
    from .ple import PLEConfig, PLEHasher

    start = time.perf_counter()
    for base in (2, 20_000_000):  # toy head sizes (the general modulo loop) and the release's
        hasher = PLEHasher(PLEConfig(ple_layer_ids=[2], ngram_vocab_size_base=base, hidden_size=16, vocab_size=64,
                                     eos_token_id=1))
        ids = np.arange(6, dtype=np.int64).reshape(2, 3)
        hasher(ids)
        state = hasher.begin(4)
        hasher.step_ragged(state, ids.ravel(), [3, 0], [0, 2, 6], commit=False)
        hasher.commit(state, ids.ravel()[:3], [3, 0], [0, 1, 3])
        hasher.hash_ragged(ids.ravel(), [0, 2, 6], np.ones((2, 2), np.int64))
    warm_kernels()  # the engines' row gathers (PLERows)
    elapsed = time.perf_counter() - start
    if verbose:
        print(f"engram_model.ple kernels ready in {elapsed:.1f} s", flush=True)
    return elapsed


def _warm_v41_checkpoint() -> None:
    """Checkpoint reading: a one-layer file with the dtypes of the release, read as load_v41_table reads it."""
    import os
    import tempfile

    from .v41 import V41Config
    from .v41 import _kernels as v41_kernels
    from .v41._checkpoint import SafetensorsCheckpoint, load_v41_weights
    from .v41._toy import write_safetensors

    config = V41Config(layer_ids=[1], max_ngram_size=2, n_heads=1, head_dim=32, engram_vocab_size=2,
                       compressed_vocab_size=8, hidden_size=32, hc_mult=1)
    rows = config.num_embeddings(1)
    tensors = {"layers.1.engram.embed.weight": ("F8_E4M3", np.zeros((rows, 32), np.uint8)),
               "layers.1.engram.embed.scale": ("F8_E8M0", np.full((rows, 1), 127, np.uint8)),
               "layers.1.engram.wkv.weight": ("F8_E4M3", np.zeros((64, 32), np.uint8)),
               "layers.1.engram.wkv.scale": ("F8_E8M0", np.full((2, 1), 127, np.uint8)),
               "layers.1.engram.q_weight": ("BF16", np.zeros((1, 32), np.uint16)),
               "layers.1.engram.k_weight": ("BF16", np.zeros((1, 32), np.uint16))}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        write_safetensors(path, tensors)
        ckpt = SafetensorsCheckpoint(path)
        load_v41_weights(ckpt, config, 1)
        weight, scale = (np.asarray(ckpt.raw(n)) for n in list(tensors)[:2])
        v41_kernels.pack_rows(weight, scale, np.empty((rows, config.row_bytes), np.uint8))
        del ckpt, weight, scale


PROG = "engram-warmup"


def _groups() -> list[tuple[str, object]]:
    """The kernel groups, in the order they are compiled: (what they are, a call that compiles them)."""
    from engram_store import disk, kernels

    return [("store: row gathers, read planning, sorting, hot-row cache", kernels.warmup),
            ("store: SSD tier (page packing, reads, row cache)", disk.warmup),
            ("model: N-gram hashing, prefill and decode", lambda: warm_model(verbose=False)),
            ("DeepSeek-V4.1: hash, ragged steps, FP8 gather + decode, gate, checkpoint packing",
             lambda: warm_v41(verbose=False)),
            ("Qwen4-Exp PLE: hash, ragged steps", lambda: warm_ple(verbose=False))]


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str] | None) -> int:
    p = cli.parser(PROG, "Compile every Numba kernel of engram ahead of time (the store's, the model's hashing,\n"
                          "DeepSeek-V4.1's and Qwen4-Exp's PLE hash), for deployment images: kernels otherwise\n"
                          "compile on first use. Compiled kernels are cached on disk, next to the installed\n"
                          "sources or in Numba's user cache where those are read-only; set NUMBA_CACHE_DIR to\n"
                          "choose. With a warm cache this takes seconds.")
    cli.add_log_level(p, "WARNING")
    cli.setup_logging(p.parse_args(argv).log_level)
    if os.environ.get("NUMBA_DISABLE_JIT") == "1":
        print(f"{PROG}: NUMBA_DISABLE_JIT=1: nothing to compile", flush=True)
        return 0
    from engram_store.warmup import cache_location

    groups = _groups()
    print(f"{PROG}: compiling {len(groups)} kernel groups into {cache_location()} (an empty cache takes 10-30 s; a "
          "warm one a few seconds)", flush=True)
    total = time.perf_counter()
    for i, (what, warm) in enumerate(groups, 1):
        print(f"  [{i}/{len(groups)}] {what} ...", end="", flush=True)
        start = time.perf_counter()
        warm()
        print(f" {time.perf_counter() - start:.1f} s", flush=True)
    print(f"{PROG}: every kernel ready in {time.perf_counter() - total:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
