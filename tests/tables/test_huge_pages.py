"""Shared memory in 2 MiB pages (``engram_store.pages``): mappings placed at a 2 MiB boundary, files collapsed into
huge pages whatever the host's shmem policy, and what uses them: a ``local_dir``'s layer files (written and opened)
and the host row cache (a segment's memory is not collapsed: docs/operating.md, "Huge pages"). hugetlbfs is refused
by name."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest

from engram_store import EngramStore, EngramStoreConfig
from engram_store import pages
from engram_store.disk._host_cache import HostRowCache
from engram_store.errors import ConfigError
from engram_store.tables._local_dir import LAYOUT_MAGIC

MiB = 1 << 20
HUGE = pages.HUGE_PAGE_BYTES


def _shm_dir() -> str:
    """A directory in shared memory: this test run's own (conftest sets ENGRAM_SHM_DIR), else /dev/shm (files made
    here are removed by the tests: anonymous files, temporary directories)."""
    return os.environ.get("ENGRAM_SHM_DIR") or "/dev/shm"


@pytest.fixture
def collapsing():
    """Skips the test where this kernel does not move a shared-memory file into 2 MiB pages (MADV_COLLAPSE needs
    Linux 6.1 and a shmem policy other than deny)."""
    if not os.path.isdir(_shm_dir()):
        pytest.skip(f"no shared memory directory here ({_shm_dir()})")
    with tempfile.TemporaryFile(dir=_shm_dir()) as f:
        os.posix_fallocate(f.fileno(), 0, 2 * HUGE)
        if pages.collapse_file(f.fileno(), 2 * HUGE, "probe") != 2 * HUGE:
            pytest.skip("this kernel does not collapse shared memory into 2 MiB pages (MADV_COLLAPSE needs Linux "
                        "6.1 and a shmem policy other than deny)")


needs_collapse = pytest.mark.usefixtures("collapsing")


def _huge_kib(address: int, pid: str = "self") -> int:
    """KiB of the mapping holding ``address`` that are mapped as 2 MiB pages (its smaps' ShmemPmdMapped)."""
    found = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= address < hi
            elif found and head == "ShmemPmdMapped:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _huge_kib_elsewhere(path: str) -> int:
    """KiB of the file at ``path`` that another process, which collapses nothing itself, maps as 2 MiB pages."""
    probe = ("import os, sys\n"
             "from engram_store import pages\n"
             "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
             "size = os.fstat(fd).st_size\n"
             "owner, offset = pages.map_file(fd, size)\n"
             "sum(owner[offset + i] for i in range(0, size, 4096))\n"
             "print(open('/proc/self/smaps_rollup').read())\n")
    out = subprocess.run([sys.executable, "-c", probe, path], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    return int(next(line.split()[1] for line in out.splitlines() if line.startswith("ShmemPmdMapped:")))


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        return any(int(a, 16) <= address < int(b, 16) for a, b in (line.split()[0].split("-") for line in f))


# ---- pages.map_file and pages.collapse ------------------------------------------------------------------------


def test_map_file_places_the_file_at_a_2_MiB_boundary_and_maps_its_bytes(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 * MiB + 123, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDWR)
    try:
        owner, offset = pages.map_file(fd, data.size, writable=True)
        view = np.frombuffer(owner, np.uint8, count=data.size, offset=offset)
        assert view.ctypes.data % HUGE == 0
        np.testing.assert_array_equal(view, data)
        view[7] = data[7] ^ 0xFF  # a writable mapping writes the file
        assert os.pread(fd, 1, 7)[0] == data[7] ^ 0xFF
        address = view.ctypes.data
        with pytest.raises(BufferError):  # as any mmap: not unmapped under a live view
            owner.close()
        del view
        owner.close()
        assert not _mapped(address)
        read_only, offset = pages.map_file(fd, data.size)
        view = np.frombuffer(read_only, np.uint8, count=data.size, offset=offset)
        assert not view.flags.writeable and view[7] == data[7] ^ 0xFF
        del view
        read_only.close()
        small, offset = pages.map_file(fd, HUGE - 1)  # smaller than a huge page: a plain mapping
        assert offset == 0 and len(small) == HUGE - 1
        small.close()
    finally:
        os.close(fd)


def test_madvise_still_answers_after_the_heap_is_trimmed():
    """Each C function pages calls has its own signature: trim_heap (a master's, in an embedded cluster beside a
    segment) once replaced the library madvise called through, which then passed addresses without its signature
    and every advice failed with EINVAL."""
    pages.trim_heap()
    owner = mmap.mmap(-1, 4 * MiB)
    address = np.frombuffer(owner, np.uint8, count=1).ctypes.data
    assert address > 1 << 32  # an address a C int cannot hold
    assert pages.madvise(address, 4 * MiB, pages.MADV_POPULATE_READ) == 0
    owner.close()


@needs_collapse
def test_collapse_moves_a_shared_memory_file_into_2_MiB_pages_and_keeps_its_bytes():
    size = 3 * HUGE + 4096  # the tail past the last whole huge page stays in 4 KiB pages
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    with tempfile.TemporaryFile(dir=_shm_dir()) as f:
        f.write(data.tobytes())
        f.flush()
        owner, offset = pages.map_file(f.fileno(), size)
        view = np.frombuffer(owner, np.uint8, count=size, offset=offset)
        assert _huge_kib(view.ctypes.data) == 0  # /dev/shm's own pages: 4 KiB (the test run's policy or not)
        assert pages.collapse(view.ctypes.data, size, "test") == 3 * HUGE
        assert _huge_kib(view.ctypes.data) == 3 * HUGE // 1024
        np.testing.assert_array_equal(view, data)
        del view
        owner.close()


@needs_collapse
def test_collapse_stops_when_asked_and_leaves_holes_alone():
    with tempfile.TemporaryFile(dir=_shm_dir()) as f:
        os.ftruncate(f.fileno(), 4 * HUGE)  # a hole: no pages to collapse
        owner, offset = pages.map_file(f.fileno(), 4 * HUGE)
        address = np.frombuffer(owner, np.uint8, count=1, offset=offset).ctypes.data
        assert pages.collapse(address, 4 * HUGE, "hole") == 0
        os.posix_fallocate(f.fileno(), 0, 4 * HUGE)
        stop = threading.Event()
        stop.set()
        assert pages.collapse(address, 4 * HUGE, "stopped", stop) == 0
        assert pages.collapse(address, 4 * HUGE, "whole", chunk_bytes=HUGE) == 4 * HUGE
        owner.close()


# ---- who uses them ---------------------------------------------------------------------------------------------

CONFIG = EngramStoreConfig([5 * HUGE // 264 + 7, 3 * HUGE // 264], 264, row_format="bytes")  # 2 heads, 5 and 3 MiB


def _tables(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (n, 264), dtype=np.uint8) for n in CONFIG.table_vocab_sizes]


@needs_collapse
def test_a_local_dir_layer_is_written_and_read_in_2_MiB_pages():
    tables = _tables(2)
    with tempfile.TemporaryDirectory(dir=_shm_dir()) as where:
        with EngramStore(1, CONFIG, local_dir=where) as writer:
            writer.populate(tables)
        for h, table in enumerate(tables):  # written so: before any reader of ours opened them
            path = os.path.join(where, "layer-1", f"head-{h}.bin")
            assert _huge_kib_elsewhere(path) == table.nbytes // HUGE * HUGE // 1024
        with EngramStore(1, CONFIG, local_dir=where) as reader:
            views = reader.local_tables()
            for view, table in zip(views, tables):
                assert view.ctypes.data % HUGE == 0
                assert _huge_kib(view.ctypes.data) == view.nbytes // HUGE * HUGE // 1024
                np.testing.assert_array_equal(view, table)
            ids = np.array([[[0, 1], [len(tables[0]) - 1, len(tables[1]) - 1]]])
            rows = reader.lookup(ids)
            np.testing.assert_array_equal(rows[0, 1, 0], tables[0][-1])
            del views


@needs_collapse
def test_a_local_dir_layer_another_writer_left_in_4_KiB_pages_is_collapsed_by_its_reader():
    """A layer written without collapsing (Mooncake's writer, an older engram) is moved into 2 MiB pages when a
    reader opens it: in the files, so a second reader maps them as such too."""
    tables = _tables(3)
    with tempfile.TemporaryDirectory(dir=_shm_dir()) as where:
        layer = os.path.join(where, "layer-1")
        os.mkdir(layer, 0o700)
        for h, table in enumerate(tables):
            with open(os.path.join(layer, f"head-{h}.bin"), "wb") as f:
                f.write(table.tobytes())
            os.chmod(os.path.join(layer, f"head-{h}.bin"), 0o444)
        with open(os.path.join(layer, "layout"), "w") as f:
            f.write(f"{LAYOUT_MAGIC}\n264\n" + "".join(f"{n}\n" for n in CONFIG.table_vocab_sizes))
        os.chmod(os.path.join(layer, "layout"), 0o444)
        with EngramStore(1, CONFIG, local_dir=where) as reader:
            view = reader.local_tables()[0]
            assert _huge_kib(view.ctypes.data) == view.nbytes // HUGE * HUGE // 1024
            np.testing.assert_array_equal(view, tables[0])
            del view
        assert _huge_kib_elsewhere(os.path.join(layer, "head-0.bin")) == tables[0].nbytes // HUGE * HUGE // 1024


@needs_collapse
def test_the_host_row_cache_is_in_2_MiB_pages():
    with HostRowCache(8 * MiB, 264, scope="huge-pages-test") as cache:
        assert _huge_kib(cache.rows.ctypes.data) >= 4 * HUGE // 1024


def test_a_local_dir_on_hugetlbfs_is_refused_by_name_and_nothing_is_written(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting hugetlbfs needs root")
    where = tmp_path / "huge"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "hugetlbfs", "none", str(where)], capture_output=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount hugetlbfs here: {done.stderr.decode().strip()}")
    try:
        with EngramStore(1, CONFIG, local_dir=where) as writer:
            with pytest.raises(ConfigError, match=f"local_dir: {where} is on hugetlbfs.*/dev/shm"):
                writer.populate(_tables(4))
        assert os.listdir(where) == []
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True, timeout=30)
