"""A host row cache leaves without waiting on itself: under remove/populate churn two reader processes stalled 30 s
and then raised LockTimeout (or stalled in close), because a cache dropped without ``close()`` was left to the
garbage collector, which ran its finalizer inside another cache's locked section on the same file, where it waited
for a lock its own thread held through another open file.

Each cause is a test: the finalizer in that place, a ``DiskSource`` that referred to itself (so only the collector
ever freed it), and an EngramStore whose constructor failed after attaching its cache.
"""
from __future__ import annotations

import gc
import logging
import os
import weakref
from contextlib import contextmanager

import numpy as np
import pytest

from engram_store import ConfigError, EngramStore, EngramStoreConfig, TableClosed
from engram_store.disk import HostRowCache

pytestmark = pytest.mark.timeout(120)

CONFIG = EngramStoreConfig([50, 60], 24, row_format="bytes")


@contextmanager
def collector_off():
    """The garbage collector runs only where the test says (gc.collect), so what is freed without it shows."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _populated(path) -> None:
    with EngramStore(1, CONFIG, disk_dir=path) as store:
        store.populate([np.zeros((n, 24), np.uint8) for n in CONFIG.table_vocab_sizes])


def test_a_finalizer_run_inside_another_caches_lock_leaves_once_that_lock_is_let_go(shm, caplog):
    with collector_off():
        dropped = HostRowCache(1 << 16, 24, scope="churn", lock_timeout_ms=3000)
        files = dropped._files
        kept = HostRowCache(1 << 16, 24, scope="churn")  # the same file, through another open file
        cycle = [dropped]
        cycle.append(cycle)
        del dropped, cycle  # only the collector frees it now
        with caplog.at_level(logging.WARNING, logger="engram_store.disk"), kept.locked(5.0) as held:
            assert held
            gc.collect()  # the finalizer runs here, in the thread that holds the lock of the same file
            attached_meanwhile = files.data_fd >= 0
        assert attached_meanwhile, "the finalizer waited for the lock this thread held, and gave up"
        assert files.data_fd < 0 and files.lock_fd < 0, "it left when the lock was let go"
        assert "detached without cleaning up" not in caplog.text
        kept.close()
    assert os.listdir(shm) == []  # the last one attached deleted the files


def test_an_engram_store_dropped_without_close_leaves_its_host_cache_where_it_is_dropped(tmp_path, shm):
    _populated(tmp_path / "disk")
    with collector_off():
        store = EngramStore(1, CONFIG, disk_dir=tmp_path / "disk", row_cache_bytes=1 << 16, cache_scope="host")
        store.lookup(np.zeros((1, 4, 2), np.int64))
        assert any(name.startswith("engram-rowcache-") for name in os.listdir(shm))
        source = weakref.ref(store._source)
        del store
        assert source() is None, "the source lives on in a reference cycle, for the collector to free at any point"
        assert os.listdir(shm) == []


def test_an_engram_store_whose_constructor_fails_leaves_no_cache_attached(tmp_path, shm):
    disk = tmp_path / "disk"
    _populated(disk)
    other = EngramStoreConfig([50, 61], 24, row_format="bytes")
    with EngramStore(2, other, disk_dir=disk) as store:
        store.populate([np.zeros((n, 24), np.uint8) for n in other.table_vocab_sizes])
    with collector_off():
        with pytest.raises(ConfigError, match="layer at .*layer-2 was published with"):
            EngramStore({1: CONFIG, 2: CONFIG}, disk_dir=disk, row_cache_bytes=1 << 16, cache_scope="host")
        assert os.listdir(shm) == [], "the cache it attached is left to the collector"


def test_a_closed_host_cache_caches_nothing_more_and_gives_no_tags(shm):
    """A read that ran into the close keeps its rows uncached; a layer opening on the closed cache is refused by
    name (the cache's files and its directory's descriptor are no longer its own to lock)."""
    cache = HostRowCache(1 << 16, 24, scope="closed")
    tag = cache.new_tag(24, identity=7)
    cache.close()
    keys = np.array([tag << 40 | 3], dtype=np.int64)
    assert cache.fill(keys, np.zeros(1, np.int64), np.ones(24, np.uint8)) == 0
    with pytest.raises(TableClosed, match="a layer's tag: the cache is closed"):
        cache.new_tag(24, identity=8)
    with pytest.raises(TableClosed, match="pinning rows: the cache is closed"):
        cache.pin(keys, np.ones(24, np.uint8))
    with cache.locked(1.0) as held:
        assert not held
    assert os.listdir(shm) == []
