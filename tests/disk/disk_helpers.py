"""Helpers of the disk tests (a module of its own name: ``conftest`` is ambiguous across test folders)."""
import numpy as np


def make_tables(rng: np.random.Generator, sizes, row_bytes: int) -> list[np.ndarray]:
    return [rng.integers(0, 256, (n, row_bytes), dtype=np.uint8) for n in sizes]


def expected_rows(tables, ids: np.ndarray) -> np.ndarray:
    """What a read of ``ids`` must return: NumPy indexing of each head's table, flat in output order."""
    return np.stack([tables[h][ids[:, h]] for h in range(ids.shape[1])], axis=1).reshape(-1)
