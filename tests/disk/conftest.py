import os

import numpy as np
import pytest

from disk_helpers import make_tables

from engram_store.disk import DiskDir


@pytest.fixture
def small_layer(tmp_path):
    """A published layer 7 of 3 heads of 264-byte rows under tmp_path: (DiskDir, sizes, tables)."""
    rng = np.random.default_rng(11)
    sizes = [100, 31, 250]
    tables = make_tables(rng, sizes, 264)
    d = DiskDir(tmp_path / "disk")
    d.write(7, 264, sizes, tables, progress=False)
    return d, sizes, tables


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """The directory this user's host caches live in (``engram-<uid>`` under ENGRAM_SHM_DIR)."""
    path = tmp_path / "shm"
    path.mkdir()
    monkeypatch.setenv("ENGRAM_SHM_DIR", str(path))
    own = path / f"engram-{os.geteuid()}"
    own.mkdir(mode=0o700)
    return own
