"""The hot-row cache's guards, each held by a test of its own that fails in milliseconds when the guard breaks.

A lookup reads a set as a sequence lock and never reads one a writer holds busy, so a row half-written by a writer
that died is never served; the next fill empties that set first; a hit marks its own way used, and nothing else.
``test_host_cache.py`` shows the same with processes killed mid-fill; here each guard is met head on, not only
when a random lookup happens to reach the dead writer's set before the repairing fill does.
"""
from __future__ import annotations

import numpy as np
import pytest

from engram_store.disk import HostRowCache, RowCache
from engram_store.disk import _cache_kernels as ck
from engram_store.disk import _kernels as dk

ROW = 16
ONE_SET = 7 * ROW + 79  # the bytes of one set of 7 ways


def _rows(keys) -> np.ndarray:
    """Each key's row: its bytes name the key, so a row served under another key shows."""
    keys = np.asarray(keys, np.int64)
    return ((keys[:, None] * 7 + np.arange(ROW)) % 251).astype(np.uint8)


def _fill(cache: RowCache, keys, stop_at: int = -1) -> int:
    """Offer ``keys`` and their rows; ``stop_at`` stops that insertion half-way, as a writer killed there would."""
    keys = np.asarray(keys, np.int64)
    cache.stop_at = stop_at
    try:
        return RowCache._fill_locked(cache, keys, np.arange(keys.size, dtype=np.int64), _rows(keys).reshape(-1))
    finally:
        cache.stop_at = -1


def _probe(cache: RowCache, keys) -> tuple[np.ndarray, np.ndarray]:
    """``(hit mask, rows copied)`` of a lookup of ``keys`` (one head, tag 0: a row's key is its id)."""
    ids = np.asarray(keys, np.int64).reshape(-1, 1)
    out = np.zeros(ids.size * ROW, np.uint8)
    miss_pos, miss_key = np.empty(ids.size, np.int64), np.empty(ids.size, np.int64)
    missed = dk._probe_all(ids, np.zeros(1, np.int64), 0, cache.meta, cache.rows, ROW, out, ROW, miss_pos, miss_key)
    np.testing.assert_array_equal(miss_key[:missed], ids[miss_pos[:missed], 0])
    hit = np.ones(ids.size, bool)
    hit[miss_pos[:missed]] = False
    return hit, out.reshape(-1, ROW)


def test_a_probe_never_reads_a_set_a_writer_holds_busy():
    cache = RowCache(ONE_SET, ROW, "always")
    assert _fill(cache, range(5)) == 5
    hit, rows = _probe(cache, range(5))
    assert hit.all()
    np.testing.assert_array_equal(rows, _rows(range(5)))
    # A writer stops half-way through key 5's row: its key is in a way, half its row is not, the set is busy.
    assert _fill(cache, [5], stop_at=0) == -1
    assert cache.meta[0] & dk.BUSY and int(cache.journal[0]) == 0 and 5 in cache.meta[1:8]
    hit, _ = _probe(cache, range(6))
    assert not hit.any(), "a lookup took rows from a set a writer holds busy"
    # The repair empties the set for good: nothing of what it held is found, and fills work again.
    ck._cache_repair(cache.meta, 0)
    assert not cache.meta[0] & dk.BUSY
    hit, _ = _probe(cache, range(6))
    assert not hit.any()
    assert _fill(cache, [5, 6]) == 2
    hit, rows = _probe(cache, [5, 6, 0])
    assert hit.tolist() == [True, True, False]
    np.testing.assert_array_equal(rows[:2], _rows([5, 6]))


def test_a_hit_marks_its_own_way_used_and_a_miss_marks_nothing():
    cache = RowCache(ONE_SET, ROW, "always")
    _fill(cache, [10, 11, 12, 13])
    assert cache.meta[0] & dk.REF_MASK == 0  # a fill leaves its ways unmarked
    ways = {int(key): way for way, key in enumerate(cache.meta[1:8]) if key >= 0}
    version = cache.meta[0] >> dk.VERSION_SHIFT
    hit, _ = _probe(cache, [12, 99, 12])
    assert hit.tolist() == [True, False, True]
    assert cache.meta[0] & dk.REF_MASK == 1 << ways[12]
    _probe(cache, [10])
    assert cache.meta[0] & dk.REF_MASK == (1 << ways[12]) | (1 << ways[10])
    # A way's mark is its own bit: the neighbour's mark above it does not stand in for it.
    below = next(k for k in (11, 13) if ways[k] + 1 in (ways[10], ways[12]))
    _probe(cache, [below])
    assert cache.meta[0] & (1 << ways[below])
    assert cache.meta[0] >> dk.VERSION_SHIFT == version, "marking a way used is no change of the set's rows"


def test_a_key_is_found_only_in_its_own_set():
    """A row cached under a key is found by that key alone, wherever its set and way are."""
    cache = RowCache(5 * ONE_SET, ROW, "always")
    _fill(cache, np.arange(0, 400, 3))
    keys = cache.meta.reshape(-1, dk.META_WORDS)[:, 1:]
    held = set(keys[keys >= 0].tolist())
    probe = np.arange(400, dtype=np.int64)
    hit, rows = _probe(cache, probe)
    assert set(probe[hit].tolist()) == held
    np.testing.assert_array_equal(rows[hit], _rows(probe[hit]))


@pytest.mark.timeout(60)
def test_a_host_cache_fill_repairs_what_a_dead_writer_left_before_anything_else(tmp_path):
    with HostRowCache(ONE_SET, ROW, scope="guards", directory=str(tmp_path)) as cache:
        assert cache.fill(np.arange(4, dtype=np.int64), np.arange(4, dtype=np.int64), _rows(range(4)).reshape(-1)) == 4
        assert _fill(cache, [4], stop_at=0) == -1  # a writer of another process died here, holding the lock
        assert int(cache.journal[0]) == 0 and cache.meta[0] & dk.BUSY
        assert not _probe(cache, range(5))[0].any()
        assert cache.fill(np.array([7], np.int64), np.zeros(1, np.int64), _rows([7]).reshape(-1)) == 1
        assert cache.stats()["repairs"] == 1 and int(cache.journal[0]) == -1 and not cache.meta[0] & dk.BUSY
        hit, rows = _probe(cache, [7, 4, 0])
        assert hit.tolist() == [True, False, False], "the dead writer's set was not emptied before the fill"
        np.testing.assert_array_equal(rows[0], _rows([7])[0])


@pytest.mark.timeout(60)
def test_a_host_cache_hands_out_tags_and_fills_only_under_its_lock(tmp_path):
    """Tags keep layers' rows apart: one per published layer, the same in every process, a new one otherwise, and
    only while holding the cache's lock (two processes making tags at once could give two layers one). A fill
    that cannot take the lock in time is skipped, and counted; every fill and row inserted is counted."""
    from engram_store import InvalidArgument, LockTimeout
    from engram_store.disk._host_cache import REGISTRY_ENTRIES

    with HostRowCache(1 << 14, ROW, scope="tags", directory=str(tmp_path)) as cache, \
            HostRowCache(1 << 14, ROW, scope="tags", directory=str(tmp_path)) as other:
        with pytest.raises(InvalidArgument, match="row_bytes"):
            cache.new_tag(ROW + 1, identity=5)
        a, b = cache.new_tag(ROW, identity=5), other.new_tag(ROW, identity=6)
        assert a != b and other.new_tag(ROW, identity=5) == a and cache.new_tag(ROW, identity=0) not in (a, b)
        given = [cache.new_tag(ROW, identity=100 + i) for i in range(REGISTRY_ENTRIES + 3)]  # past a full registry
        assert len(set(given)) == REGISTRY_ENTRIES + 3 and not set(given) & {a, b}
        # Every entry of the registry is shared, its last one included (5 and 6 took two); past it, a new tag.
        shared = REGISTRY_ENTRIES - 2
        assert [other.new_tag(ROW, identity=100 + i) for i in range(shared)] == given[:shared]
        assert other.new_tag(ROW, identity=100 + shared) not in given
        keys = np.arange(10, dtype=np.int64)
        assert cache.fill(keys, keys, _rows(keys).reshape(-1)) == 10
        stats = cache.stats()
        assert (stats["fills"], stats["inserted"], stats["fills_skipped"]) == (1, 10, 0)
        cache.lock_timeout_s, cache.fill_wait_s = 0.2, 0.01
        with other.locked(1.0) as held:
            assert held
            with pytest.raises(LockTimeout, match="a layer's tag"):
                cache.new_tag(ROW, identity=7)
            assert cache.fill(keys + 10, keys, _rows(keys + 10).reshape(-1)) == 0
        stats = cache.stats()
        assert (stats["fills"], stats["inserted"], stats["fills_skipped"]) == (1, 10, 1)


def test_pin_pins_up_to_its_limit_a_set_and_pins_a_row_already_cached_in_place():
    """``pin(max_ways=n)`` leaves exactly n pinned ways in a set (not fewer), pins a row the set already holds
    where it is (in way 0 too: one copy of a key a set), and skips a row pinned already."""
    cache = RowCache(ONE_SET, ROW, "always")
    assert _fill(cache, [40]) == 1 and int(cache.meta[1]) == 40  # cached, unpinned, in way 0
    assert cache.pin(np.array([40, 41, 40], np.int64), _rows([40, 41, 40]).reshape(-1), max_ways=3) == 2
    keys = cache.meta[1:8].tolist()
    assert keys.count(40) == 1 and keys.count(41) == 1 and keys.index(40) == 0, keys
    assert cache.pinned() == 2
    assert cache.pin(np.array([42, 43], np.int64), _rows([42, 43]).reshape(-1), max_ways=3) == 1
    assert cache.pinned() == 3 and 43 not in cache.meta[1:8]
    pins = (int(cache.meta[0]) >> dk.PIN_SHIFT) & dk.REF_MASK
    assert sorted(key for way, key in enumerate(cache.meta[1:8].tolist()) if pins >> way & 1) == [40, 41, 42]
    hit, rows = _probe(cache, [40, 41, 42])
    assert hit.all()
    np.testing.assert_array_equal(rows, _rows([40, 41, 42]))


def test_pin_of_a_row_cached_in_way_0_pins_it_there_whatever_the_clock_hand_points_at():
    """A row CLOCK placed in way 0 (the hand has moved on since) is pinned where it is: no second copy of it takes
    the way the hand points at, and the row held there stays."""
    cache = RowCache(ONE_SET, ROW, "always")
    assert _fill(cache, range(7)) == 7 and _fill(cache, [7]) == 1  # the eighth evicts way 0; the hand moves on
    assert int(cache.meta[1]) == 7 and int(cache.hands[0]) == 1
    held = cache.meta[1:8].tolist()
    assert cache.pin(np.array([7], np.int64), _rows([7]).reshape(-1), max_ways=1) == 1
    assert cache.meta[1:8].tolist() == held and cache.pinned() == 1
    assert (int(cache.meta[0]) >> dk.PIN_SHIFT) & dk.REF_MASK == 1
