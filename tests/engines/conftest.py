"""Fixtures of the engine tests (helpers: ``engines_helpers.py``)."""
from __future__ import annotations

import types

import pytest
from engines_helpers import CONFIG, load_tables, write_checkpoint


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A toy V4.1 checkpoint and its tables, as engram-load-v41 writes them: a local_dir and a disk_dir."""
    root = tmp_path_factory.mktemp("toy")
    checkpoint = write_checkpoint(root / "checkpoint")
    load_tables(checkpoint, CONFIG, local_dir=root / "local")
    load_tables(checkpoint, CONFIG, disk_dir=root / "disk")
    return types.SimpleNamespace(checkpoint=checkpoint, local=root / "local", disk=root / "disk")
