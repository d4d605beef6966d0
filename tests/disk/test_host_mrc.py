"""The host cache's curve: every process's lookups in one stack in shared memory, checked against an exact LRU of
the interleaved stream; a process killed mid-replay; layers past the region's room."""
from __future__ import annotations


import numpy as np
import pytest

from engram_store import EngramStore, EngramStoreConfig
from engram_store.disk import SIZE_LADDER, HostCurve
from engram_store.disk import _host_mrc as hm
from suite_helpers import exact_lru_hits

pytestmark = pytest.mark.timeout(120)

SIZES = [900, 600]
CONFIG = EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=8, row_format="bytes")


@pytest.fixture
def published(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGRAM_SHM_DIR", str(tmp_path / "shm"))
    with EngramStore(2, CONFIG, disk_dir=tmp_path / "disk") as writer:
        writer.populate([np.zeros((n, 8), np.uint8) for n in SIZES])
    return tmp_path / "disk"


def _host(store: EngramStore) -> HostCurve:
    return store._source.sizing.hosts[8]


def test_the_host_curve_is_an_exact_lru_of_every_process_lookups(published, monkeypatch):
    monkeypatch.setattr(hm, "FLUSH_AT", 1)  # each lookup's rows handed over at once: the stream as interleaved
    rng = np.random.default_rng(8)
    stream = []
    with EngramStore(2, CONFIG, disk_dir=published, row_cache_bytes=1 << 14, cache_scope="host") as a, \
            EngramStore(2, CONFIG, disk_dir=published, row_cache_bytes=1 << 14, cache_scope="host") as b:
        for step in range(120):  # two workers: hot rows of their own, and some they share
            store, base = (a, 0) if step % 2 else (b, 200)
            ids = np.stack([np.where(rng.random(10) < 0.5, rng.integers(0, 40, 10),
                                     base + rng.integers(0, 100 + 200 * h, 10)) % n
                            for h, n in enumerate(SIZES)], axis=-1)[None]
            store.lookup(ids)
            stream += [(h, int(r)) for r in ids[0] for h, r in [(0, r[0]), (1, r[1])]]
        stats = a.stats()
        assert stats["host_cache_hit_rate_by_size"] == b.stats()["host_cache_hit_rate_by_size"]
        mine = a.stats()["hit_rate_by_size"]
    universe = sum(SIZES)
    for f, entry in zip(SIZE_LADDER, stats["host_cache_hit_rate_by_size"]):
        assert entry["hit_rate"] == pytest.approx(exact_lru_hits(stream, f * universe) / len(stream), abs=0.01), f
    assert mine != stats["host_cache_hit_rate_by_size"]  # a's own lookups alone: another curve
    assert len(stats["host_cache_hit_rate_by_size_per_head"]) == 2



def test_a_process_killed_mid_replay_starts_the_curve_afresh(published):
    with EngramStore(2, CONFIG, disk_dir=published, row_cache_bytes=1 << 14, cache_scope="host") as a, \
            EngramStore(2, CONFIG, disk_dir=published, row_cache_bytes=1 << 14, cache_scope="host") as b:
        a.lookup(np.zeros((1, 5, 2), np.int64))
        assert a.stats()["host_cache_hit_rate_by_size"][-1]["hit_rate"] == 0.8
        _host(a).header[hm.BUSY] = 1  # what a process killed half-way through a replay leaves
        assert "host_cache_hit_rate_by_size" not in b.stats(), "a curve half-replayed is not reported"
        b.lookup(np.ones((1, 5, 2), np.int64))
        assert _host(b).flush(b._source.sizing.curves[8], 1.0)
        assert _host(b).stats()["resets"] == 1
        curve = b.stats()["host_cache_hit_rate_by_size"]
        assert curve[-1]["hit_rate"] == 0.8  # b's lookups since: a's rows went with the reset
        a.lookup(np.ones((1, 5, 2), np.int64))  # a registers its layer again and its rows count
        assert a.stats()["host_cache_hit_rate_by_size"][-1]["hit_rate"] == 0.9


def test_layers_past_the_regions_room_have_no_host_curve(published):
    with EngramStore(2, CONFIG, disk_dir=published, row_cache_bytes=1 << 14, cache_scope="host") as store:
        _host(store).header[hm.NEXT_COLUMN] = hm.MAX_COLUMNS  # other processes' layers took every column
        store.lookup(np.zeros((1, 3, 2), np.int64))
        stats = store.stats()
    assert "host_cache_hit_rate_by_size" not in stats and stats["hit_rate_by_size"][-1]["hit_rate"] > 0
