import numpy as np
import pytest

from engram_store.disk import DiskDir


def make_tables(rng: np.random.Generator, sizes, row_bytes: int) -> list[np.ndarray]:
    return [rng.integers(0, 256, (n, row_bytes), dtype=np.uint8) for n in sizes]


def expected_rows(tables, ids: np.ndarray) -> np.ndarray:
    """What a read of ``ids`` must return: NumPy indexing of each head's table, flat in output order."""
    return np.stack([tables[h][ids[:, h]] for h in range(ids.shape[1])], axis=1).reshape(-1)


@pytest.fixture
def small_layer(tmp_path):
    """A published layer 7 of 3 heads of 264-byte rows under tmp_path: (DiskDir, sizes, tables)."""
    rng = np.random.default_rng(11)
    sizes = [100, 31, 250]
    tables = make_tables(rng, sizes, 264)
    d = DiskDir(tmp_path / "disk")
    d.write(7, 264, sizes, tables, progress=False)
    return d, sizes, tables
