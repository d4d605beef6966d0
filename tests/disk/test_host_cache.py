"""The host row cache: one cache in shared memory for every process of a host, under real processes.

Lookups from several worker processes equal NumPy indexing whatever the cache size and interleaving; a process
SIGKILLed half-way through a fill (the ENGRAM_TEST_DIE_MID_FILL hook makes it deterministic) leaves no wrong row
and no blocked set; a layer published again under the same id never serves the old data's rows; the files go
with the last process. Each test uses its own shared-memory directory (ENGRAM_SHM_DIR).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import host_cache_worker as worker

from engram_store import EngramStore, EngramStoreConfig
from engram_store.errors import InvalidArgument
from engram_store.disk import HostRowCache, LayerProfile, RowCache, load_profile, save_profile
from engram_store.disk import _cache_kernels as ck
from engram_store.disk import _kernels as dk

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_cache_worker.py")
PROCESS_TIMEOUT_S = 120


def publish(disk_dir, seed: int) -> list[np.ndarray]:
    tables = worker.tables(seed)
    with EngramStore(worker.LAYER, worker.config(), disk_dir=disk_dir) as store:
        store.populate(tables)
    return tables


def run_workers(args_list, env=None, timeout_s=PROCESS_TIMEOUT_S) -> list[subprocess.CompletedProcess]:
    """Start every worker, wait for all (killing what outlives the timeout), return what each printed."""
    procs = [subprocess.Popen([sys.executable, WORKER, *map(str, args)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
             for args in args_list]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def cached_rows_are_right(cache: RowCache, tag: int, tables, sizes) -> int:
    """Check every cached way of ``tag``'s keys against the tables; returns how many were checked."""
    row_base = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    meta = cache.meta.reshape(-1, dk.META_WORDS)
    checked = 0
    for s, w in zip(*np.nonzero(meta[:, 1:] >= 0)):
        if meta[s, 0] & dk.BUSY:
            continue  # a busy set is never read (readers miss it)
        key = int(meta[s, 1 + w])
        if key >> dk.KEY_ROW_BITS != tag:
            continue
        r = key & ((1 << dk.KEY_ROW_BITS) - 1)
        h = int(np.searchsorted(row_base, r, side="right")) - 1
        at = (s * dk.WAYS + w) * cache.row_bytes
        np.testing.assert_array_equal(cache.rows[at:at + cache.row_bytes], tables[h][r - row_base[h]])
        checked += 1
    return checked


# ---- several processes -------------------------------------------------------------------------------------

@pytest.mark.timeout(600)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sets=st.sampled_from([1, 3, 40]), workers=st.integers(2, 3), seed=st.integers(0, 2**16))
def test_lookups_from_several_processes_equal_numpy_indexing(tmp_path_factory, sets, workers, seed):
    base = tmp_path_factory.mktemp("host")
    os.environ["ENGRAM_SHM_DIR"] = str(base / "shm")
    try:
        disk = base / "disk"
        publish(disk, seed)
        cache_bytes = sets * (7 * worker.ROW_BYTES + 79)  # one set: constant eviction; 40: most rows fit
        go = base / "go"
        procs_args = [(disk, cache_bytes, seed, seed * 7 + i, 60, "--wait-file", go) for i in range(workers)]
        procs = [subprocess.Popen([sys.executable, WORKER, *map(str, a)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for a in procs_args]
        try:
            go.touch()
            outs = [p.communicate(timeout=PROCESS_TIMEOUT_S) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0 and out.startswith("ok"), (out, err[-2000:])
        assert os.listdir(base / "shm" / f"engram-{os.geteuid()}") == [], "the last process deletes the cache's files"
    finally:
        del os.environ["ENGRAM_SHM_DIR"]


@pytest.mark.timeout(300)
def test_processes_share_one_cache_and_its_counters(tmp_path, shm):
    disk = tmp_path / "disk"
    tables = publish(disk, 5)
    ids = np.stack([np.arange(20) % n for n in worker.SIZES], axis=-1)[None].astype(np.int64)
    with EngramStore(worker.LAYER, worker.config(), disk_dir=disk, row_cache_bytes=1 << 16,
                     cache_scope="host") as store:
        np.testing.assert_array_equal(store.lookup(ids)[0], np.stack([t[ids[0, :, h]] for h, t in
                                                                      enumerate(tables)], axis=1))
        # a second process finds every row of ours cached
        (res,) = run_workers([(disk, 1 << 16, 5, 1, 0)])
        assert res.returncode == 0, res.stderr[-2000:]
        code = ("import sys, numpy as np; sys.path.insert(0, %r); import host_cache_worker as w\n"
                "from engram_store import EngramStore\n"
                "s = EngramStore(w.LAYER, w.config(), disk_dir=%r, row_cache_bytes=1 << 16, cache_scope='host')\n"
                "ids = np.stack([np.arange(20) %% n for n in w.SIZES], axis=-1)[None].astype(np.int64)\n"
                "s.lookup(ids); st = s.stats(); print(st['cache_hits'], st['cache_misses'], st['pages_read'])\n"
                "s.close()") % (os.path.dirname(WORKER), str(disk))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["60", "0", "0"]
        s = store.stats()
        assert s["cache_misses_per_head"] == [20, 20, 20] and s["cache_hits_per_head"] == [0, 0, 0]
        assert s["host_cache_hits"] == 60 and s["host_cache_misses"] == 60 and s["host_cache_attaches"] == 3
        assert len(os.listdir(shm)) == 2
    assert os.listdir(shm) == []


def test_another_size_or_admission_attaches_to_the_cache_there_and_says_so(tmp_path, shm, caplog):
    disk = tmp_path / "disk"
    publish(disk, 6)
    ids = np.stack([np.arange(20) % n for n in worker.SIZES], axis=-1)[None].astype(np.int64)
    with EngramStore(worker.LAYER, worker.config(), disk_dir=disk, row_cache_bytes=1 << 16,
                     cache_scope="host") as store:
        store.lookup(ids)
        (res,) = run_workers([(disk, 1 << 17, 6, 1, 0)])  # a worker restarted with twice the memory
        assert res.returncode == 0, res.stderr[-2000:]
        assert "asked for row_cache_bytes=131072" in res.stderr and "of 65536 bytes" in res.stderr, res.stderr
        assert len(os.listdir(shm)) == 2, os.listdir(shm)  # one cache: its file and its lock, not a second pair
        with caplog.at_level(logging.WARNING):
            other = HostRowCache(1 << 18, worker.ROW_BYTES, scope=os.path.realpath(disk), admission="doorkeeper")
        try:
            mine = store._source.caches[worker.ROW_BYTES]
            assert (other.path, other.capacity_rows, other.admission) == (mine.path, mine.capacity_rows, "always")
            assert other.stats()["attaches"] == 3 and other.stats()["held_rows"] == mine.stats()["held_rows"] > 0
        finally:
            other.close()
        assert "row_cache_bytes=262144 (admission doorkeeper)" in caplog.text, caplog.text
        assert "of 65536 bytes (admission always)" in caplog.text
        assert len(os.listdir(shm)) == 2
    assert os.listdir(shm) == []


# ---- a process killed mid-fill -----------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_a_process_killed_mid_fill_leaves_no_wrong_row_and_no_blocked_set(tmp_path, shm):
    disk = tmp_path / "disk"
    tables = publish(disk, 9)
    cache_bytes = 2 * (7 * worker.ROW_BYTES + 79)  # two sets: the dead fill's set is met at once
    with EngramStore(worker.LAYER, worker.config(), disk_dir=disk, row_cache_bytes=cache_bytes,
                     cache_scope="host") as store:
        cache = store._source.caches[worker.ROW_BYTES]
        (res,) = run_workers([(disk, cache_bytes, 9, 2, 5)], env={"ENGRAM_TEST_DIE_MID_FILL": "3"})
        assert res.returncode == -signal.SIGKILL, (res.stdout, res.stderr[-2000:])
        s = int(cache.journal[0])
        assert s >= 0 and cache.meta[s * dk.META_WORDS] & dk.BUSY, "the dead writer left its set busy"
        # the half-written row is never served: its set reads as a miss until the next fill repairs it. First a
        # lookup of every row the busy set names (the dead writer's among them), probed before any fill repairs it
        tag = store._layers[worker.LAYER].state.tag
        row_base = np.concatenate(([0], np.cumsum(worker.SIZES)[:-1]))
        keys = [int(key) for key in cache.meta[s * dk.META_WORDS + 1:(s + 1) * dk.META_WORDS]
                if key >= 0 and key >> dk.KEY_ROW_BITS == tag]
        ids = np.zeros((1, len(keys), 3), np.int64)
        for m, key in enumerate(keys):
            r = key & ((1 << dk.KEY_ROW_BITS) - 1)
            h = int(np.searchsorted(row_base, r, side="right")) - 1
            ids[0, m, h] = r - row_base[h]
        assert keys, "the dead writer's set holds rows of this layer"
        np.testing.assert_array_equal(store.lookup(ids), np.stack([tables[h][ids[..., h]] for h in range(3)], axis=-2))
        rng = np.random.default_rng(0)
        for _ in range(30):
            ids = np.stack([rng.integers(0, n, (2, 9)) for n in worker.SIZES], axis=-1).astype(np.int64)
            want = np.stack([tables[h][ids[..., h]] for h in range(3)], axis=-2)
            np.testing.assert_array_equal(store.lookup(ids), want)
        st = store.stats()
        assert st["host_cache_repairs"] == 1 and st["host_cache_fills_skipped"] == 0
        assert int(cache.journal[0]) == -1
        assert not any(cache.meta[::dk.META_WORDS] & dk.BUSY), "no set stays busy"
        assert cached_rows_are_right(cache, tag, tables, worker.SIZES) > 0


@pytest.mark.timeout(300)
def test_processes_killed_while_filling_never_leave_a_wrong_row(tmp_path, shm):
    disk = tmp_path / "disk"
    tables = publish(disk, 4)
    cache_bytes = 6 * (7 * worker.ROW_BYTES + 79)
    with EngramStore(worker.LAYER, worker.config(), disk_dir=disk, row_cache_bytes=cache_bytes,
                     cache_scope="host") as store:
        cache = store._source.caches[worker.ROW_BYTES]
        for i in range(4):  # busy fillers killed at deterministic points of their fills
            res = run_workers([(disk, cache_bytes, 4, 10 + i, 40)], env={"ENGRAM_TEST_DIE_MID_FILL": str(i * 5)})
            assert res[0].returncode in (0, -signal.SIGKILL), res[0].stderr[-2000:]
            store.lookup(np.zeros((1, 1, 3), np.int64))  # a fill here repairs what the dead one left
        (ok,) = run_workers([(disk, cache_bytes, 4, 99, 40)])
        assert ok.returncode == 0, ok.stdout + ok.stderr[-2000:]
        tag = store._layers[worker.LAYER].state.tag
        cached_rows_are_right(cache, tag, tables, worker.SIZES)


# ---- the same layer id published again ---------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_layer_published_again_never_serves_the_old_rows(tmp_path, shm):
    disk = tmp_path / "disk"
    old = publish(disk, 1)
    new = worker.tables(2)
    ids = np.stack([np.arange(30) % n for n in worker.SIZES], axis=-1)[None].astype(np.int64)
    rows = lambda t: np.stack([t[h][ids[0, :, h]] for h in range(3)], axis=1)
    kw = dict(disk_dir=disk, row_cache_bytes=1 << 16, cache_scope="host")
    with EngramStore(worker.LAYER, worker.config(), **kw) as a, EngramStore(worker.LAYER, worker.config(), **kw) as b:
        np.testing.assert_array_equal(a.lookup(ids)[0], rows(old))
        np.testing.assert_array_equal(b.lookup(ids)[0], rows(old))
        assert b.stats()["cache_hits"] == 90, "two stores of one published layer share its cached rows"
        old_tag = a._layers[worker.LAYER].state.tag
        a.remove_from_store()
        a.populate(new)
        assert a._layers[worker.LAYER].state.tag != old_tag
        np.testing.assert_array_equal(a.lookup(ids)[0], rows(new))
        with EngramStore(worker.LAYER, worker.config(), **kw) as c:  # opened after: the new data, its rows shared
            np.testing.assert_array_equal(c.lookup(ids)[0], rows(new))
            assert c.stats()["cache_hits"] == 90


# ---- lifecycle, arguments, warm start --------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_files_of_a_killed_process_are_reclaimed(tmp_path, shm):
    disk = tmp_path / "disk"
    publish(disk, 3)
    code = ("import os, signal, sys; sys.path.insert(0, %r); import host_cache_worker as w\n"
            "from engram_store import EngramStore\n"
            "s = EngramStore(w.LAYER, w.config(), disk_dir=%r, row_cache_bytes=1 << 15, cache_scope='host')\n"
            "os.kill(os.getpid(), signal.SIGKILL)") % (os.path.dirname(WORKER), str(disk))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=PROCESS_TIMEOUT_S)
    assert out.returncode == -signal.SIGKILL
    left = sorted(os.listdir(shm))
    assert len(left) == 2, "a killed process cannot delete its files"
    with HostRowCache(1 << 14, 8, scope="another"):  # attaching any cache there deletes what nobody holds
        assert not set(left) & set(os.listdir(shm))
    assert os.listdir(shm) == []


def test_cache_scope_is_checked():
    with pytest.raises(InvalidArgument, match="cache_scope: expected 'process' or 'host', got 'node'"):
        EngramStore(0, EngramStoreConfig([10], 4), cache_scope="node")
    with pytest.raises(InvalidArgument, match="cache_scope: 'host' .* pass disk_dir="):
        EngramStore(0, EngramStoreConfig([10], 4), cache_scope="host")


@pytest.mark.timeout(120)
def test_warm_start_pins_the_profiles_rows_and_they_survive_eviction(tmp_path, shm):
    disk = tmp_path / "disk"
    tables = publish(disk, 6)
    heads = np.array([0, 2, 1, 2, 0], np.int64)
    rows = np.array([5, 299, 39, 7, 96], np.int64)
    path = tmp_path / "profile.npz"
    save_profile(path, {worker.LAYER: LayerProfile.from_counts(heads, rows, [9, 50, 3, 7, 1])})
    prof = load_profile(path)[worker.LAYER]
    assert prof.counts.tolist() == [50, 9, 7, 3, 1] and prof.heads.tolist() == [2, 0, 2, 1, 0]
    with EngramStore(worker.LAYER, worker.config(), disk_dir=disk, row_cache_bytes=3 * (7 * 24 + 79),
                     cache_scope="host") as store:
        pinned = store.warm_cache(path, max_rows=5)
        assert 2 <= pinned <= 5  # at most 2 pinned ways in each of the 3 sets
        rng = np.random.default_rng(1)
        for _ in range(20):  # many other rows through 3 sets: without pins these would be evicted
            store.lookup(np.stack([rng.integers(0, n, (4, 8)) for n in worker.SIZES], axis=-1))
        store.stats(reset=True)
        ids = np.zeros((1, 5, 3), np.int64)
        ids[0, np.arange(5), heads] = rows
        ids[0, np.arange(5), (heads + 1) % 3] = -1
        got = store.lookup(np.where(ids < 0, 0, ids))
        want = np.stack([tables[h][np.where(ids < 0, 0, ids)[0, :, h]] for h in range(3)], axis=1)
        np.testing.assert_array_equal(got[0], want)
        hits = np.array(store.stats()["cache_hits_per_head"])
        assert hits.sum() >= pinned and store.stats()["host_cache_pinned_rows"] == pinned
    with pytest.raises(InvalidArgument, match="profile: expected a profile of layer 3"):
        with EngramStore(worker.LAYER, worker.config(), disk_dir=disk, row_cache_bytes=1 << 14) as store:
            store.warm_cache({4: prof})


# ---- the writers' kernels against a plain Python model -----------------------------------------------------

def _model_fill(sets, hands, keys, n_sets, pinned):
    """CLOCK with "always" admission and pinned ways, one Python list of (key, ref) per set."""
    for key in keys:
        s = int(dk._set_of(np.int64(key), n_sets))
        ways = sets[s]
        if any(k == key for k, _ in ways):
            continue
        if any(k == -1 for k, _ in ways):
            w = [k for k, _ in ways].index(-1)
        else:
            if all(pinned[s]):
                continue
            h = hands[s]
            for _ in range(15):
                if pinned[s][h]:
                    h = (h + 1) % 7
                elif ways[h][1]:
                    ways[h] = (ways[h][0], False)
                    h = (h + 1) % 7
                else:
                    break
            w = h
            hands[s] = (h + 1) % 7
        ways[w] = (key, False)
        pinned[s][w] = False


@settings(max_examples=60, deadline=None)
@given(n_sets=st.integers(1, 4), seed=st.integers(0, 2**32), n_pins=st.integers(0, 8))
def test_fill_and_pin_kernels_match_a_python_model(n_sets, seed, n_pins):
    rng = np.random.default_rng(seed)
    cache = RowCache(n_sets * (7 * 8 + 79), 8, "always")
    pin_keys = rng.integers(0, 40, n_pins).astype(np.int64)
    src = (pin_keys[:, None] * 3 + np.arange(8)).astype(np.uint8).reshape(-1)
    got = cache.pin(pin_keys, src, max_ways=3)
    meta = cache.meta.reshape(-1, 8)
    sets = [[(int(meta[s, 1 + w]), False) for w in range(7)] for s in range(n_sets)]
    pinned = [[bool((meta[s, 0] >> (dk.PIN_SHIFT + w)) & 1) for w in range(7)] for s in range(n_sets)]
    assert sum(map(sum, pinned)) == got and all(sum(p) <= 3 for p in pinned)
    hands = cache.hands.astype(int).tolist()
    for _ in range(5):
        keys = rng.integers(0, 60, int(rng.integers(1, 30))).astype(np.int64)
        out = (keys[:, None] * 3 + np.arange(8)).astype(np.uint8).reshape(-1)
        cache.fill(keys, np.arange(keys.size, dtype=np.int64), out)
        _model_fill(sets, hands, keys.tolist(), n_sets, pinned)
        for s, w in zip(*np.nonzero(rng.random((n_sets, 7)) < 0.3)):  # readers mark some ways used
            if meta[s, 1 + w] >= 0:
                meta[s, 0] |= 1 << w
                sets[s][w] = (sets[s][w][0], True)
        assert [[k for k, _ in ways] for ways in sets] == meta[:, 1:].tolist()
    for s, w in zip(*np.nonzero(meta[:, 1:] >= 0)):
        at = (s * 7 + w) * 8
        np.testing.assert_array_equal(cache.rows[at:at + 8], (meta[s, 1 + w] * 3 + np.arange(8)).astype(np.uint8))


def test_repair_empties_the_set_and_moves_its_version_on():
    cache = RowCache(2 * (7 * 8 + 79), 8, "always")
    keys = np.arange(10, dtype=np.int64)
    cache.stop_at = 4  # the fifth insertion stops half-way, as a killed writer would
    assert cache.fill(keys, np.arange(10, dtype=np.int64), np.zeros(80, np.uint8)) == -5
    s = int(cache.journal[0])
    before = int(cache.meta[s * 8])
    assert before & dk.BUSY
    ck._cache_repair(cache.meta, s)
    after = int(cache.meta[s * 8])
    assert not after & dk.BUSY and after >> dk.VERSION_SHIFT > before >> dk.VERSION_SHIFT
    assert (cache.meta[s * 8 + 1:s * 8 + 8] == -1).all() and after & (dk.REF_MASK | dk.PIN_MASK) == 0


def test_repair_of_a_set_its_writer_had_finished_leaves_it_usable_and_drops_its_marks():
    """A writer that died after it finished its set but before it cleared the journal: the journal names a set that
    is not busy. The repair empties it all the same, drops its used and pinned marks, and leaves it not busy (a set
    left busy would never be read again), its version moved on."""
    cache = RowCache(2 * (7 * 8 + 79), 8, "always")
    keys = np.arange(10, dtype=np.int64)
    assert cache.fill(keys, keys, np.zeros(80, np.uint8)) == 10
    s = int(dk._set_of(np.int64(3), 2))
    cache.meta[s * 8] |= (1 << 2) | (1 << (dk.PIN_SHIFT + 1))  # a way marked used, another pinned
    before = int(cache.meta[s * 8])
    assert not before & dk.BUSY
    ck._cache_repair(cache.meta, s)
    after = int(cache.meta[s * 8])
    assert not after & dk.BUSY and after >> dk.VERSION_SHIFT > before >> dk.VERSION_SHIFT
    assert (cache.meta[s * 8 + 1:s * 8 + 8] == -1).all() and after & (dk.REF_MASK | dk.PIN_MASK) == 0
    assert cache.fill(keys[3:4], np.zeros(1, np.int64), np.zeros(8, np.uint8)) == 1


# ---- profiles ------------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), H=st.integers(1, 5))
def test_profile_rows_counts_every_head_and_row_like_a_counter(seed, H):
    from collections import Counter

    from engram_model.stats import profile_rows

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 12, (int(rng.integers(1, 50)), H))
    valid = rng.random(ids.shape[0]) < 0.8
    prof = profile_rows(ids, valid)
    want = Counter((h, int(r)) for m in np.flatnonzero(valid) for h, r in enumerate(ids[m]))
    assert dict(zip(zip(prof.heads.tolist(), prof.rows.tolist()), prof.counts.tolist())) == dict(want)
    assert (np.diff(prof.counts) <= 0).all(), "most frequent first"


def test_engram_stats_writes_a_profile_the_store_loads(tmp_path):
    from engram_model.stats import main

    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 500, (2, 300)))
    path = tmp_path / "profile.npz"
    assert main([str(tokens), "--vocab-size", "500", "--profile", str(path), "--json"]) == 0
    profiles = load_profile(path)
    assert sorted(profiles) == [1, 15]
    assert all(p.counts.sum() == 600 * p.heads.max() + 600 for p in profiles.values())


def test_shared_counters_add_like_python():
    counters = np.zeros(4, np.int64)
    want = [0, 0, 0, 0]
    for hits, misses, extra in [(3, 5, 1), (0, 7, 2), (11, 0, 0)]:
        ck._count_lookup(counters, hits, misses)
        ck._counter_add(counters, 3, extra)
        want = [want[0] + hits, want[1] + misses, 0, want[3] + extra]
    assert counters.tolist() == want
