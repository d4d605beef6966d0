"""What the fault tests of this folder share: a small layer of four heads, its tables by seed, ids and the rows
a lookup of them must return."""
from __future__ import annotations

import numpy as np

from engram_store import EngramStoreConfig

SIZES = [1009, 1013, 1019, 1021]
DIM = 16
CONFIG = EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=DIM)


def layer_tables(seed: int) -> list[np.ndarray]:
    """The layer's tables (float32 [SIZES[h], DIM]) drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, DIM), dtype=np.float32) for n in SIZES]


def layer_ids(seed: int, shape: tuple[int, int]) -> np.ndarray:
    """Ids ``[*shape, heads]`` within each head's rows, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.integers(0, n, size=shape) for n in SIZES], axis=-1)


def expected_rows(tables: list[np.ndarray], ids: np.ndarray) -> np.ndarray:
    """What a lookup of ``ids`` in ``tables`` returns: ``[*shape, heads, DIM]``."""
    return np.stack([tables[h][ids[..., h]] for h in range(len(tables))], axis=-2)
