"""Shared by the tests of ``engram_store.compat``'s EngramStore: tables, configs, expected rows, layer ids."""
from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from engram_store.compat import EngramStoreConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Mooncake's test fixture: four heads of 17, 19, 23 and 29 rows.
SIZES = [17, 19, 23, 29]

#: Layer ids unique within a test run, so tests sharing a store never meet each other's keys.
_layer_ids = itertools.count(5000 + os.getpid() % 1000 * 100)


def next_layer() -> int:
    return next(_layer_ids)


def byte_config(sizes=SIZES, row_bytes=32) -> EngramStoreConfig:
    """A config set field by field, as Mooncake's users write it."""
    config = EngramStoreConfig()
    config.table_vocab_sizes = list(sizes)
    config.row_bytes = row_bytes
    return config


def float_config(sizes=SIZES, embedding_dim=8) -> EngramStoreConfig:
    config = EngramStoreConfig()
    config.table_vocab_sizes = list(sizes)
    config.embedding_dim = embedding_dim
    return config


def spec_tables(sizes=SIZES, row_bytes=32) -> list[np.ndarray]:
    """Mooncake's fixture tables: every byte differs from its neighbours, and head h is offset by 37 * h."""
    return [(np.arange(n * row_bytes).reshape(n, row_bytes) + 37 * h).astype(np.uint8) for h, n in enumerate(sizes)]


def random_tables(sizes, row_bytes, rng) -> list[np.ndarray]:
    return [rng.integers(0, 256, (n, row_bytes), dtype=np.uint8) for n in sizes]


def float_tables(sizes, dim, seed) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, dim), dtype=np.float32) for n in sizes]


def random_ids(rng, sizes, B, L) -> np.ndarray:
    return np.stack([rng.integers(0, n, (B, L)) for n in sizes], axis=-1).astype(np.int64)  # (B, L, H)


def last_row_ids(sizes=SIZES) -> np.ndarray:
    return np.array([[[n - 1 for n in sizes]]], dtype=np.int64)  # (1, 1, H)


def gather(tables, ids) -> np.ndarray:
    """NumPy fancy indexing: the rows a lookup must return, ``[B, L, H, row]``."""
    return np.stack([tables[h][ids[..., h]] for h in range(len(tables))], axis=-2)


@contextlib.contextmanager
def registered_output(store, shape, fill=None):
    """A uint8 output registered with ``store`` for the block (Mooncake's fixture; none is needed here)."""
    output = np.empty(shape, dtype=np.uint8)
    if fill is not None:
        output.fill(fill)
    if output.nbytes:
        assert store.register_buffer(output.ctypes.data, output.nbytes) == 0
    try:
        yield output
    finally:
        if output.nbytes:
            store.unregister_buffer(output.ctypes.data)


# ---- user scripts (tests/compat/user_scripts) ------------------------------------------------------

SCRIPTS = Path(__file__).resolve().parent / "user_scripts"
MOONCAKE_IMPORT = "from mooncake.store import EngramStore, EngramStoreConfig, ReplicateConfig, MooncakeDistributedStore"
COMPAT_IMPORT = ("from engram_store.compat import EngramStore, EngramStoreConfig, ReplicateConfig, "
                 "MooncakeDistributedStore")
SCRIPT_TIMEOUT_S = 120


def user_script(name: str, directory: Path, imports: str = COMPAT_IMPORT) -> Path:
    """The script ``name`` with its Mooncake import line replaced by ``imports``: nothing else changes."""
    text = (SCRIPTS / name).read_text()
    assert text.count(MOONCAKE_IMPORT) == 1, f"{name} must import Mooncake's names on one line"
    path = directory / name
    path.write_text(text.replace(MOONCAKE_IMPORT, imports))
    return path


def script_env() -> dict:
    """This checkout's packages first, whatever is installed."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
            "PYTHONUNBUFFERED": "1"}


def run_script(path: Path, *args) -> str:
    """Run ``path`` to completion; its last line of output."""
    proc = subprocess.run([sys.executable, str(path), *map(str, args)], capture_output=True, text=True,
                          timeout=SCRIPT_TIMEOUT_S, cwd=REPO, env=script_env())
    assert proc.returncode == 0, f"{path.name} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout.strip().splitlines()[-1]
