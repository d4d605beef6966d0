"""The demo architecture's kernels compiled ahead of time (``engram-warmup``): its hash, prefill and decode."""

from __future__ import annotations

import numpy as np

from ._config import BackboneConfig, EngramConfig
from ._hasher import get_hash_mapping
from ._incremental import IncrementalHasher


def warmup() -> None:
    """Hash a few tokens through the prefill and decode paths of a small configuration."""
    config = EngramConfig(engram_vocab_size=[1000, 1000], max_ngram_size=3, n_embed_per_ngram=32,
                          n_head_per_ngram=2, layer_ids=[1, 2], tokenizer_name_or_path=None)
    mapping = get_hash_mapping(config, BackboneConfig(vocab_size=1000, num_layers=3), None)
    ids = np.arange(8, dtype=np.int64).reshape(2, 4)
    mapping.hash_layers(ids, [1, 2])
    hasher = IncrementalHasher(mapping)
    hasher.hash_step(["a", "b"], ids[:, :1])
    hasher.hash_step(["a", "b"], ids[:, 1:3])
