"""Faults of the SSD tier: a remover killed half way, a layer file deleted under a reader, a disk that fills up."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from engram_store import EngramStore, EngramStoreConfig, OutOfSpace, StoreError
from engram_store.disk import DiskDir, DiskReadError, LayerWriter
from engram_store.disk import _files, _writer
from engram_store import _layer_dir, pages as _pages

SIZES = [701, 1009, 97]
CONFIG = EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=66, row_format="bytes")


def _tables(seed: int, sizes=SIZES, dim=66) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (n, dim), dtype=np.uint8) for n in sizes]


def _ids(seed: int, sizes=SIZES) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.integers(0, n, (2, 16)) for n in sizes], axis=-1)


def _expected(tables, ids):
    return np.stack([tables[h][ids[..., h]] for h in range(len(tables))], axis=-2)


def _leave_a_dead_removers_dir(path, layer_id: int) -> str:
    """What a remover killed after its rename leaves: ``layer-<L>.removing`` with part of the layer's files."""
    doomed = os.path.join(path, f"layer-{layer_id}.removing")
    os.mkdir(doomed)
    with open(os.path.join(doomed, "manifest.json"), "w") as f:
        f.write("{}")
    with open(os.path.join(doomed, "rows.bin"), "wb") as f:
        f.write(b"\0" * 4096)
    os.chmod(os.path.join(doomed, "rows.bin"), 0o444)
    return doomed


# ---- a remover that died ----


@pytest.mark.timeout(60)
def test_remove_from_store_leaves_nothing_behind(tmp_path):
    with EngramStore(1, CONFIG, disk_dir=tmp_path) as layer:
        layer.populate(_tables(1))
        assert layer.remove_from_store() == 3
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(60)
def test_a_dead_removers_leftover_does_not_block_the_next_remove(tmp_path):
    tables = _tables(2)
    with EngramStore(1, CONFIG, disk_dir=tmp_path) as layer:
        layer.populate(tables)
    doomed = _leave_a_dead_removers_dir(tmp_path, 2)  # layer 2's dead remover: layer 1 has no leftover here
    with EngramStore(2, CONFIG, disk_dir=tmp_path) as layer:  # the leftover goes when the directory is opened
        assert not os.path.exists(doomed)
        _leave_a_dead_removers_dir(tmp_path, 2)  # and when one appears later, at the next remove
        layer.populate(tables)
        ids = _ids(3)
        np.testing.assert_array_equal(layer.lookup(ids), _expected(tables, ids))
        assert layer.remove_from_store() == 3
        layer.populate(tables)  # and again, published and removed as often as asked
        assert layer.remove_from_store() == 3
    assert sorted(os.listdir(tmp_path)) == ["layer-1", "layer-1.lock"]


@pytest.mark.timeout(60)
def test_a_live_removers_dir_is_left_to_it(tmp_path):
    doomed = _leave_a_dead_removers_dir(tmp_path, 4)
    remover = _layer_dir.LayerDir(tmp_path, "disk_dir")
    held = remover.lock("layer-4.lock", 0)  # a remover at work holds the layer's lock
    try:
        DiskDir(tmp_path).close()
        assert os.path.isdir(doomed)
    finally:
        held.close()
        remover.close()
    DiskDir(tmp_path).close()
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(60)
def test_a_remover_killed_after_its_rename_blocks_nothing(tmp_path):
    tables = _tables(4)
    with EngramStore(1, CONFIG, disk_dir=tmp_path) as layer:
        layer.populate(tables)
    script = textwrap.dedent(f"""
        import os, shutil, signal
        from engram_store import EngramStore, EngramStoreConfig
        real_rmtree = shutil.rmtree

        def rmtree(path, *args, dir_fd=None, **kwargs):
            if str(path).endswith(".removing"):  # the layer is renamed away: delete one file, then die
                os.unlink(os.path.join(path, "rows.bin"), dir_fd=dir_fd)
                os.kill(os.getpid(), signal.SIGKILL)
            return real_rmtree(path, *args, dir_fd=dir_fd, **kwargs)

        shutil.rmtree = rmtree
        config = EngramStoreConfig(table_vocab_sizes={SIZES}, embedding_dim=66, row_format="bytes")
        with EngramStore(1, config, disk_dir={str(tmp_path)!r}) as layer:
            layer.remove_from_store()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    assert sorted(os.listdir(tmp_path / "layer-1.removing")) == ["manifest.json"]
    _populate_lookup_and_remove(tmp_path, tables)


def _populate_lookup_and_remove(path, tables, config=CONFIG) -> None:
    """What every user of the directory must still be able to do, however the last one died."""
    sizes = config.table_vocab_sizes
    with EngramStore(1, config, disk_dir=path) as layer:
        if 1 in DiskDir(path).layers():
            layer.remove_from_store()
        layer.populate(tables)
        ids = _ids(5, sizes)
        np.testing.assert_array_equal(layer.lookup(ids), _expected(tables, ids))
        assert layer.remove_from_store() == len(sizes)
        layer.populate(tables)
        assert layer.remove_from_store() == len(sizes)
    assert os.listdir(path) == []


@pytest.mark.timeout(300)
def test_a_populate_remove_loop_killed_anywhere_leaves_a_usable_directory(tmp_path):
    # Large enough rows that a remove takes a while (a killed remove is likely, not certain): every kill, wherever
    # it lands, must leave a directory the next EngramStore populates and removes in.
    sizes = [40_000, 40_000]
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        from engram_store import EngramStore, EngramStoreConfig
        config = EngramStoreConfig(table_vocab_sizes={sizes}, embedding_dim=512, row_format="bytes")
        tables = [np.full((n, 512), h, np.uint8) for h, n in enumerate({sizes})]
        with EngramStore(1, config, disk_dir={str(tmp_path)!r}) as layer:
            while True:
                layer.populate(tables)
                print("removing", flush=True)
                layer.remove_from_store()
    """)
    config = EngramStoreConfig(table_vocab_sizes=sizes, embedding_dim=512, row_format="bytes")
    tables = _tables(6, sizes, 512)
    for kill_after in (1, 2, 3):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            for _ in range(kill_after):
                line = proc.stdout.readline()
                assert line == b"removing\n", (line, proc.stderr.read() if proc.poll() is not None else b"")
            proc.send_signal(signal.SIGKILL)  # the remove just started, or is done, or the next write began
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=60)
            proc.stdout.close()
            proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL
        _populate_lookup_and_remove(tmp_path, tables, config)


@pytest.mark.timeout(60)
def test_a_lock_file_removed_by_its_holder_is_not_shared_by_two_waiters(tmp_path, monkeypatch):
    path = os.path.join(tmp_path, "layer-1.lock")
    held = _layer_dir.LayerDir(tmp_path, "disk_dir")
    first = held.lock("layer-1.lock", 0)
    waiting = threading.Event()
    real_sleep = _layer_dir.time.sleep

    def sleep(seconds):
        waiting.set()  # the second has opened the lock file and found it held
        real_sleep(seconds)

    monkeypatch.setattr(_layer_dir.time, "sleep", sleep)
    got: list[object] = []
    second = threading.Thread(target=lambda: got.append(held.lock("layer-1.lock", 30)))
    second.start()
    try:
        assert waiting.wait(30)
        os.unlink(path)  # the holder removes the lock file, then lets go
        first.close()
        second.join(30)
        assert len(got) == 1 and isinstance(got[0], _layer_dir.LayerLock)
        with pytest.raises(StoreError, match="another writer holds"):
            held.lock("layer-1.lock", 0.2)  # the second holds the file now at the path; nobody else gets it
    finally:
        second.join(30)
        for lock in got:
            lock.close()
        held.close()


# ---- a layer file gone ----


@pytest.mark.timeout(60)
def test_verify_names_a_deleted_layer_file_and_what_to_do(tmp_path):
    with EngramStore(1, CONFIG, disk_dir=tmp_path) as layer:
        layer.populate(_tables(7))
        file = os.path.join(tmp_path, "layer-1", "rows.bin")
        os.unlink(file)  # readers keep the open file; verify reads the file by name
        with pytest.raises(DiskReadError, match=rf"disk layer 1: cannot open {file} to verify it: No such file or "
                                                r"directory.*remove_from_store\(\) and populate it again"):
            layer.verify()
        with pytest.raises(DiskReadError, match=rf"cannot open {file}"):
            DiskDir(tmp_path).verify(1)


# ---- a disk that fills up ----


@pytest.mark.timeout(60)
def test_out_of_space_says_what_was_free_before_the_attempt(tmp_path, monkeypatch):
    taken = []

    def fallocate(fd, offset, nbytes):  # as ext4 does: the blocks it got stay taken when it fails
        taken.append(nbytes)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    class Usage:
        @property
        def free(self):
            return 0 if taken else 12_345

    monkeypatch.setattr(_pages.os, "posix_fallocate", fallocate)
    monkeypatch.setattr(_pages.shutil, "disk_usage", lambda path: Usage())
    with pytest.raises(OutOfSpace, match=r"disk layer: cannot reserve 8192 bytes in .* \(12345 bytes free before "
                                         r"the attempt\) for rows.bin"):
        LayerWriter(tmp_path, 1, 4096, [2], progress=False)
    assert sorted(os.listdir(tmp_path)) == ["layer-1.lock"]


@pytest.mark.timeout(60)
def test_a_manifest_write_out_of_space_raises_out_of_space(tmp_path, monkeypatch):
    writer = LayerWriter(tmp_path, 1, 8, [2], progress=False)
    writer.write_head(0, np.zeros((2, 8), np.uint8))

    def write(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_writer.os, "write", write)
    with pytest.raises(OutOfSpace, match=r"disk layer 1: no space left writing .*layer-1.tmp/manifest.json"):
        writer.commit()
    monkeypatch.undo()
    assert DiskDir(tmp_path).layers() == [] and not os.path.exists(tmp_path / "layer-1.tmp")


@pytest.mark.timeout(60)
def test_a_full_file_system_raises_out_of_space_for_the_rows_and_for_the_manifest(tmpfs):
    small_tmpfs = tmpfs("1M")
    with pytest.raises(OutOfSpace, match=r"cannot reserve 2097152 bytes in .* \(1048576 bytes free before the "
                                         "attempt\\)"):
        DiskDir(small_tmpfs).write(1, 4096, [512], [np.zeros((512, 4096), np.uint8)], progress=False)
    # rows.bin takes every page of the file system: the manifest finds none left
    with pytest.raises(OutOfSpace, match="disk layer 2: no space left writing .*manifest.json"):
        DiskDir(small_tmpfs).write(2, 4096, [256], [np.zeros((256, 4096), np.uint8)], progress=False)
    assert DiskDir(small_tmpfs).layers() == []
    assert sorted(os.listdir(small_tmpfs)) == ["layer-1.lock", "layer-2.lock"]
