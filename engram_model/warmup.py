"""Compile every Numba kernel of engram ahead of time: ``engram-warmup`` (or ``python -m engram_model.warmup``).

The store's kernels (row gathers, range reads, planning) and the model's hashing kernels (prefill and decode).
Nothing needs this: kernels compile on first use and are cached on disk (see :mod:`engram_store.warmup` for
where, and ``NUMBA_CACHE_DIR``). Run it when building a deployment image, so no request pays for compilation.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="engram-warmup", description=__doc__.split("\n\n")[0])
    p.parse_args(argv)
    from engram_store.warmup import warm_store

    warm_store()
    warm_model()
    return 0


if __name__ == "__main__":
    sys.exit(main())
