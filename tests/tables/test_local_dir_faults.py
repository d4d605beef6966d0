"""local_dir on a full file system: OutOfSpace naming the file, and nothing published or left behind."""
import os

import numpy as np
import pytest

from engram_store import EngramStore, EngramStoreConfig, OutOfSpace

pytestmark = pytest.mark.timeout(60)


def test_a_layout_file_that_finds_no_room_raises_out_of_space(tmpfs):
    tiny_tmpfs = tmpfs("64k")
    # 16 KiB taken by something else; the three heads take the 48 KiB left, so the layout file finds no page.
    with open(tiny_tmpfs / "other", "wb") as f:
        f.write(b"x" * (16 << 10))
    config = EngramStoreConfig(table_vocab_sizes=[256, 256, 256], embedding_dim=16)
    layer = EngramStore(1, config, local_dir=str(tiny_tmpfs / "layers"))
    with pytest.raises(OutOfSpace, match=r"local_dir: cannot publish layer 1 .* the file system is full .*layout"):
        layer.populate([np.zeros((256, 16), np.float32)] * 3)
    assert os.listdir(tiny_tmpfs / "layers") == []  # nothing published, nothing staged, no lock file


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_a_head_file_that_cannot_be_finished_fails_the_writer_and_every_file_handed_over_is_closed():
    from engram_store.tables._local_dir import _HeadFinisher

    finisher = _HeadFinisher()
    read_end, write_end = os.pipe()  # fsync of a pipe: EINVAL, raised on the finishing thread
    os.close(write_end)
    finisher.finish(read_end, 0, "head-0.bin")
    with pytest.raises(OSError) as failed:
        finisher.wait()
    assert failed.value.errno == 22 and not _is_open(read_end)
    finisher.wait()  # raised once: nothing in hand now

    # the next file is not taken over while the one before failed: it is closed, and the failure raised
    read_end, write_end = os.pipe()
    os.close(write_end)
    finisher.finish(read_end, 0, "head-1.bin")
    second, other = os.pipe()
    os.close(other)
    with pytest.raises(OSError):
        finisher.finish(second, 0, "head-2.bin")
    assert not _is_open(read_end) and not _is_open(second)
    finisher.stop()


def test_a_populate_whose_head_cannot_be_finished_publishes_nothing(tmp_path, monkeypatch):
    from engram_store.tables import _local_dir

    def no_room_to_map(fd, size, name, stop=None):  # as map_file fails where the address space is short
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(_local_dir, "collapse_file", no_room_to_map)  # called on the finishing thread only
    config = EngramStoreConfig(table_vocab_sizes=[256, 256, 256], embedding_dim=16)
    layer = EngramStore(1, config, local_dir=str(tmp_path / "layers"))
    with pytest.raises(Exception, match=r"local_dir: cannot publish layer 1 .*Cannot allocate memory"):
        layer.populate([np.ones((256, 16), np.float32)] * 3)
    assert os.listdir(tmp_path / "layers") == []  # nothing published, nothing staged, no lock file
    layer.close()


def test_a_head_file_whose_thread_cannot_start_is_closed_by_the_writer_and_only_once(monkeypatch):
    from engram_store.tables import _local_dir

    def cannot_start(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(_local_dir.threading.Thread, "start", cannot_start)
    finisher = _local_dir._HeadFinisher()
    read_end, write_end = os.pipe()
    os.close(write_end)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        finisher.finish(read_end, 0, "head-0.bin")
    assert not _is_open(read_end)
    finisher.stop()  # a thread never started is not waited for

    handed = _local_dir._Handed(os.open(os.devnull, os.O_RDONLY))
    fd = handed.claim("thread")
    assert fd is not None and handed.claim("writer") is None and _is_open(fd)  # the thread's to close, not the writer's
    os.close(fd)
    handed = _local_dir._Handed(os.open(os.devnull, os.O_RDONLY))
    taken = handed.fd
    assert handed.claim("writer") is None and not _is_open(taken) and handed.claim("thread") is None
