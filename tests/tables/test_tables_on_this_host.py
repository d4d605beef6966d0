"""Tables on this host (``local_dir``, ``disk_dir``, ``bind_local``) while their directory changes and their
EngramStore closes under them.

* A layer opened while it is removed and populated again is one publication, whole: ``local_dir`` mapped the heads
  of two populates in one open (each head file was opened by path), ``disk_dir`` read one populate's rows under the
  other's manifest.
* A table keeps the directory it opened, whatever its path names later.
* A closed table raises TableClosed, and a lookup running when it closes finishes on its own files: it raised
  ``AttributeError`` or read through a descriptor number another open had taken.
"""
from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import pytest
import xxhash

from engram_store import EngramStore, EngramStoreConfig, TableClosed
from engram_store.disk import DiskDir, IOEngine
from engram_store.tables._inventory import LocalDirLayers
from engram_store.tables._layout import Layer

pytestmark = pytest.mark.timeout(120)

CONFIG = EngramStoreConfig([300, 300, 300], 264, row_format="bytes")
IDS = np.stack([np.arange(300)] * 3, axis=-1).reshape(1, 300, 3)


def _generation(g: int) -> list[np.ndarray]:
    """Generation ``g`` of a layer: every byte of it is ``g``, so one read shows which populate each head came from."""
    return [np.full((n, 264), g, np.uint8) for n in CONFIG.table_vocab_sizes]


def _published_again(where: str, path) -> None:
    """Remove layer 1 and populate it again as generation 2, as another process does."""
    if where == "local_dir":
        LocalDirLayers(str(path)).remove(1, False)
        with EngramStore(1, CONFIG, local_dir=path) as writer:
            writer.populate(_generation(2))
    else:
        with EngramStore(1, CONFIG, disk_dir=path) as writer:
            writer.remove_from_store()
            writer.populate(_generation(2))


def test_a_local_dir_layer_opened_while_it_is_published_again_maps_one_publication(tmp_path, monkeypatch):
    with EngramStore(1, CONFIG, local_dir=tmp_path) as writer:
        writer.populate(_generation(1))
    real_mmap, swapped = mmap.mmap, []

    def map_then_publish_again(*args, **kwargs):
        mapped = real_mmap(*args, **kwargs)
        if not swapped:  # head 0 is mapped: the layer is removed and populated again before head 1 is opened
            swapped.append(True)
            _published_again("local_dir", tmp_path)
        return mapped

    monkeypatch.setattr(mmap, "mmap", map_then_publish_again)
    with EngramStore(1, CONFIG, local_dir=tmp_path) as reader:
        rows = reader.lookup(IDS)
    assert swapped
    assert np.unique(rows).size == 1, f"heads of generations {np.unique(rows[0, 0, :, 0]).tolist()} in one open"


def test_a_disk_dir_layer_opened_while_it_is_published_again_reads_one_publication(tmp_path, monkeypatch):
    d = DiskDir(tmp_path)
    d.write(1, 264, CONFIG.table_vocab_sizes, _generation(1), progress=False)
    real_open, swapped = os.open, []

    def publish_again_before_the_data_file(path, flags, *args, **kwargs):
        if str(path).endswith("rows.bin") and not flags & os.O_CREAT and not swapped:  # the manifest was read
            swapped.append(True)
            _published_again("disk_dir", tmp_path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", publish_again_before_the_data_file)
    layer = d.open(1)
    monkeypatch.undo()
    try:
        out = np.empty(IDS.size * 264, np.uint8)
        layer.read_rows(IDS.reshape(-1, 3), out)
        generation = int(out[0])
        assert np.all(out == generation)
        checksums = tuple(xxhash.xxh3_64_hexdigest(t.tobytes()) for t in _generation(generation))
        assert swapped and layer.checksums == checksums, "the manifest of one populate over the rows of another"
    finally:
        layer.close()
        d.close()


@pytest.mark.parametrize("where", ["local_dir", "disk_dir"])
def test_a_table_keeps_the_directory_it_opened_whatever_its_path_names_later(tmp_path, where):
    """The path is resolved once: a link pointed elsewhere (or the directory moved) after the open changes nothing
    for this table; the next table opened by the path gets what it names then."""
    first, second, link = tmp_path / "first", tmp_path / "second", tmp_path / "current"
    first.mkdir()
    second.mkdir()
    link.symlink_to(first)
    config = {1: CONFIG, 2: CONFIG}
    with EngramStore(config, **{where: link}) as store:
        store.populate(_generation(1), layer=1)
        (tmp_path / "next").symlink_to(second)
        os.replace(tmp_path / "next", link)  # the link names the second directory from now on
        store.populate(_generation(2), layer=2)
        assert np.all(store.lookup(IDS, layer=2) == 2) and np.all(store.lookup(IDS, layer=1) == 1)
    assert sorted(p for p in os.listdir(first) if not p.endswith(".lock")) == ["layer-1", "layer-2"]
    assert os.listdir(second) == []


def _table(where: str, path) -> EngramStore:
    """An EngramStore of layer 1, generation 1, in ``where``."""
    if where == "bind_local":
        store = EngramStore(1, CONFIG)
        store.bind_local(_generation(1))
        return store
    store = EngramStore(1, CONFIG, **{where: path})
    store.populate(_generation(1))
    return store


@pytest.mark.parametrize("where", ["disk_dir", "local_dir", "bind_local"])
def test_a_closed_table_raises_table_closed(tmp_path, where):
    store = _table(where, tmp_path)
    assert np.all(store.lookup(IDS) == 1)
    store.close()
    for call in (lambda: store.lookup(IDS), lambda: store.prefetch(IDS, background=False).result(),
                 lambda: store.lookup_into(IDS, np.empty((1, 300, 3, 264), np.uint8)), store.local_tables):
        with pytest.raises(TableClosed, match="layer 1: this EngramStore is closed"):
            call()
    store.close()


@pytest.mark.parametrize("where", ["disk_dir", "local_dir", "bind_local"])
def test_a_table_closed_while_a_lookup_is_planned_raises_table_closed(tmp_path, where, monkeypatch):
    """The close lands between the lookup's check that the layer is there and its read (it raised AttributeError,
    'NoneType' object has no attribute ...)."""
    store = _table(where, tmp_path)
    real_as_ids = Layer.as_ids

    def close_first(self, row_ids):
        store.close()
        return real_as_ids(self, row_ids)

    monkeypatch.setattr(Layer, "as_ids", close_first)
    with pytest.raises(TableClosed, match="layer 1 was closed"):
        store.lookup(IDS)


def test_a_disk_dir_table_closed_under_a_running_lookup_lets_it_finish_on_its_own_file(tmp_path, monkeypatch):
    """The lookup's reads are under way when the table closes, and another table opens at once (taking the
    descriptor numbers the close gave back): the lookup still returns its own layer's rows, whole."""
    store = _table("disk_dir", tmp_path / "mine")
    started, go = threading.Event(), threading.Event()
    real_read = IOEngine.read

    def held_read(self, batch, direct):
        if not started.is_set():
            started.set()
            assert go.wait(60)
        return real_read(self, batch, direct)

    monkeypatch.setattr(IOEngine, "read", held_read)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(_outcome(store)))
    reader.start()
    try:
        assert started.wait(60)
        store.close()
        other = EngramStore(1, CONFIG, disk_dir=tmp_path / "other")  # same geometry, generation 3
        other.populate(_generation(3))
        go.set()
        reader.join(60)
        other.close()
    finally:
        go.set()
        reader.join(60)
    assert len(got) == 1 and not isinstance(got[0], BaseException), got
    assert np.all(got[0] == 1), f"rows of generations {np.unique(got[0]).tolist()}"


def _outcome(store: EngramStore):
    try:
        return store.lookup(IDS)
    except BaseException as exc:  # noqa: BLE001 (the test reports what the lookup raised)
        return exc


@pytest.mark.parametrize("readers", [1, 4])
def test_a_held_descriptor_is_closed_once_after_its_last_read_and_never_handed_out_after_its_close(tmp_path,
                                                                                                readers):
    """Reads enter and leave without a lock while the owner closes: every read that got the descriptor saw its own
    file until it left, none got it after the close, and it was closed exactly once, by whoever let it go last."""
    from engram_store._layer_dir import HeldFd

    path = tmp_path / "file"
    path.write_bytes(b"x")
    for round_ in range(20):
        fd = os.open(path, os.O_RDONLY)
        inode = os.fstat(fd).st_ino
        held = HeldFd(fd, "the file")
        closed, wrong, late = threading.Event(), [], []

        def read():
            while True:
                after_close = closed.is_set()
                try:
                    got = held.enter()
                except TableClosed:
                    return
                try:
                    if after_close:
                        late.append(got)  # handed out though close() had returned before the read began
                    if os.fstat(got).st_ino != inode:
                        wrong.append(got)
                finally:
                    held.leave()

        threads = [threading.Thread(target=read) for _ in range(readers)]
        for t in threads:
            t.start()
        threading.Event().wait(0.001 * (round_ % 5))
        held.close()
        closed.set()
        for t in threads:
            t.join(30)
        assert not wrong and not late and held._fds == []
        with pytest.raises(OSError):
            os.fstat(fd)  # closed (no other open in this test takes the number meanwhile)
