"""A process that forks after it has used the store, for ``test_fork.py``: what a child of a connected process gets.

    python fork_worker.py client MASTER                a child of a connected client reads, writes and looks up
    python fork_worker.py disk DISK_DIR                a child reads a disk layer its parent read (AIO and threads)
    python fork_worker.py host_cache SHM_DIR           a helper forked by a host-cache user, and one that exits

Prints one JSON line of what happened; a child that fails prints its traceback and exits 3, one that hangs is
killed by its alarm (SIGALRM).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import traceback

import numpy as np

from engram_store import DistributedStore, EngramStore, EngramStoreConfig
from engram_store.disk import DiskDir, HostRowCache, IOEngine

SIZES = [101, 103]
CONFIG = EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=8)
CHILD_ALARM_S = 15


def _tables() -> list[np.ndarray]:
    rng = np.random.default_rng(4)
    return [rng.standard_normal((n, 8), dtype=np.float32) for n in SIZES]


def _check(layer: EngramStore, seed: int) -> None:
    tables = _tables()
    ids = np.random.default_rng(seed).integers(0, 100, (2, 3, 2))
    want = np.stack([tables[h][ids[..., h]] for h in range(2)], axis=-2)
    np.testing.assert_array_equal(layer.lookup(ids), want)
    np.testing.assert_array_equal(layer.prefetch(ids).result(), want)


def _in_child(work) -> int:
    """Fork; the child runs ``work`` under an alarm and exits 0 (or 3 with its traceback); returns its exit code."""
    pid = os.fork()
    if pid == 0:
        signal.alarm(CHILD_ALARM_S)
        code = 0
        try:
            work()
        except BaseException:
            traceback.print_exc()
            code = 3
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def client(master: str) -> dict:
    """For a client reading local-direct and one reading remotely: the child's exit code, and the keys it wrote."""
    out = {}
    for local_direct in (True, False):
        with DistributedStore.connect(master, timeout_ms=3000, local_direct=local_direct) as store, \
                EngramStore(1, CONFIG, store) as layer:
            _check(layer, 0)
            store.get("parent")

            def child() -> None:
                assert store.get("parent") == b"p" * 1000
                store.put(f"child-{os.getpid()}", b"c" * 1000)
                _check(layer, 1)

            code = _in_child(child)
            _check(layer, 2)  # the parent goes on with its own connections
            out["local-direct" if local_direct else "remote"] = code
    with DistributedStore.connect(master, timeout_ms=3000) as store:
        out["children"] = len(store.list_keys("child-"))
    return out


def disk(disk_dir: str) -> dict:
    codes = {}
    with EngramStore(7, CONFIG, disk_dir=disk_dir) as layer:  # the process's engine: AIO where the host has it
        _check(layer, 0)
        codes["default"] = _in_child(lambda: _check(layer, 1))
        _check(layer, 2)
    ids = np.array([[1, 2], [99, 100]], dtype=np.int64)
    want = np.empty(ids.size * 32, dtype=np.uint8)
    with IOEngine(4, "threads") as engine, DiskDir(disk_dir).open(7, engine=engine) as layer:
        layer.read_rows(ids, want)  # the pool's threads are the parent's

        def child() -> None:
            out = np.empty_like(want)
            layer.read_rows(ids, out)
            np.testing.assert_array_equal(out, want)

        codes["threads"] = _in_child(child)
    return codes


def host_cache(directory: str) -> dict:
    scope = f"fork-test-{os.getpid()}"
    other = HostRowCache(1 << 20, 64, scope=scope, directory=directory)  # another process's attachment
    mine = HostRowCache(1 << 20, 64, scope=scope, directory=directory)
    # A helper forked by this process outlives its attachment: it must hold none of its locks.
    r, w = os.pipe()
    helper = os.fork()
    if helper == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    mine.close()
    attached = threading.Event()

    def attach() -> None:
        HostRowCache(1 << 20, 64, scope=scope, directory=directory).close()
        attached.set()

    t = threading.Thread(target=attach)
    t.start()
    t.join(5)
    result = {"attached_beside_the_helper": attached.is_set()}
    os.write(w, b"x")
    os.waitpid(helper, 0)
    t.join()
    # A child that exits normally (its finalisers run) leaves the parent attached and the files in place.
    child = os.fork()
    if child == 0:
        sys.exit(0)
    result["child"] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    result["files_kept"] = os.path.exists(other.path)
    keys = np.array([5], dtype=np.int64) | (np.int64(other.new_tag(64, 0)) << 40)
    other.fill(keys, np.array([0], dtype=np.int64), np.full(64, 7, dtype=np.uint8))
    result["fills_skipped"] = other.stats()["fills_skipped"]
    other.close()
    return result


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "client":
        out = client(sys.argv[2])
    elif what == "disk":
        out = disk(sys.argv[2])
    else:
        out = host_cache(sys.argv[2])
    print(json.dumps(out), flush=True)
