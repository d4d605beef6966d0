"""Qwen4-Exp's PLE kernels compiled ahead of time (``engram-warmup``): the hash through the paths serving uses
(whole sequences, a ragged step, a draft and its commit, a step after vLLM's context) and the engines' row
gathers (PLERows)."""

from __future__ import annotations

import numpy as np

from .._rows_gather import warm_kernels
from ._config import PLEConfig
from ._hasher import PLEHasher


def warmup() -> None:
    """Run the family's kernels once on tiny inputs."""
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
