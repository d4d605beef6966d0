"""Atomic, create-only publication; the writer lock; a dead writer's staging directory."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from engram_store.errors import InvalidArgument, ObjectExists, ObjectNotFound, StoreError
from engram_store.disk import DiskDir, LayerWriter, write_layer


@pytest.mark.timeout(30)
def test_nothing_is_visible_until_commit(tmp_path):
    d = DiskDir(tmp_path)
    w = d.writer(3, 8, [5, 5], progress=False)
    w.write_head(0, np.zeros((5, 8), np.uint8))
    assert d.layers() == [] and d.open(3) is None and os.path.isdir(d.layer_path(3) + ".tmp")
    w.write_head(1, np.ones((5, 8), np.uint8))
    assert d.open(3) is None
    w.commit()
    assert d.layers() == [3] and not os.path.exists(d.layer_path(3) + ".tmp")
    mask = os.umask(0o022)
    os.umask(mask)
    assert os.stat(os.path.join(d.layer_path(3), "rows.bin")).st_mode & 0o777 == 0o444 & ~mask  # as the umask says


@pytest.mark.timeout(30)
def test_a_failing_fill_or_a_missing_head_publishes_nothing(tmp_path):
    d = DiskDir(tmp_path)

    def fill(start, out):
        raise RuntimeError("checkpoint shard missing")

    with pytest.raises(RuntimeError, match="checkpoint shard missing"):
        d.write(0, 8, [2, 40], [np.zeros((2, 8), np.uint8), fill], progress=False)
    assert d.layers() == [] and os.listdir(tmp_path) == ["layer-0.lock"]
    w = d.writer(0, 8, [2, 2], progress=False)
    w.write_head(1, np.zeros((2, 8), np.uint8))
    with pytest.raises(InvalidArgument, match=r"heads \[0\] were never written; nothing was published"):
        w.commit()
    with pytest.raises(ValueError):
        with d.writer(0, 8, [2], progress=False):
            raise ValueError("caller failed")
    assert d.layers() == [] and sorted(os.listdir(tmp_path)) == ["layer-0.lock"]
    with pytest.raises(StoreError, match="already committed or aborted"):
        w.write_head(0, np.zeros((2, 8), np.uint8))


@pytest.mark.timeout(30)
def test_publication_is_create_only(small_layer):
    d, sizes, tables = small_layer
    with pytest.raises(ObjectExists, match="layer 7 is already published"):
        d.write(7, 264, sizes, tables, progress=False)
    d.remove(7)
    assert d.layers() == [] and d.open(7) is None
    with pytest.raises(ObjectNotFound, match="layer 7 is not published"):
        d.remove(7)
    d.write(7, 264, sizes, tables, progress=False)
    assert d.layers() == [7]


@pytest.mark.timeout(60)
def test_a_dead_writers_staging_dir_is_removed_by_the_next_writer(tmp_path):
    script = textwrap.dedent(f"""
        import os, numpy as np
        from engram_store.disk import LayerWriter
        w = LayerWriter({str(tmp_path)!r}, 5, 8, [4, 4], progress=False)
        w.write_head(0, np.zeros((4, 8), np.uint8))
        os._exit(0)  # dies holding the lock, with a half-written layer staged
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    staging = os.path.join(tmp_path, "layer-5.tmp")
    assert os.path.isdir(staging) and not os.path.exists(os.path.join(tmp_path, "layer-5"))
    path = write_layer(tmp_path, 5, 8, [4, 4], [np.full((4, 8), 1, np.uint8), np.full((4, 8), 2, np.uint8)],
                       progress=False)
    assert not os.path.exists(staging)
    assert sorted(os.listdir(path)) == ["manifest.json", "rows.bin"]
    DiskDir(tmp_path).verify(5)


@pytest.mark.timeout(30)
def test_a_second_writer_waits_for_the_lock_and_then_gives_up(tmp_path):
    first = LayerWriter(tmp_path, 1, 8, [1], progress=False)
    try:
        with pytest.raises(StoreError, match=r"another writer holds .*layer-1.lock \(waited 0.2 s\)"):
            LayerWriter(tmp_path, 1, 8, [1], progress=False, lock_timeout_s=0.2)
    finally:
        first.abort()
    LayerWriter(tmp_path, 1, 8, [1], progress=False, lock_timeout_s=0.2).abort()  # the lock is free again
