"""A store layer's read ways (``StoreSource._read_one``) hand a failed read to the one general path.

A layer whose heads sit on one server is read by one kernel call over the raw channel, or, where the channel does
not take it (here: a client that reads over ZeroMQ only), by one ``read_pairs``; when the server holding the
heads dies, either way gives the read to the general path with that server left out, and the rows come from the
other replica in the same call.
"""
from __future__ import annotations

import numpy as np
import pytest

from engram_store import DistributedStore, EngramStore, EngramStoreConfig
from engram_store.testing import Cluster

pytestmark = pytest.mark.timeout(120)

SIZES = [211]
DIM = 8


@pytest.mark.parametrize("raw_reads", [True, False], ids=["native-call", "read-pairs"])
def test_a_dead_server_under_a_fast_way_is_read_from_the_other_replica_in_the_same_call(raw_reads):
    tables = [np.random.default_rng(7).random((SIZES[0], DIM), dtype=np.float32)]
    ids = np.random.default_rng(8).integers(0, SIZES[0], (3, 2, 1))
    expected = np.stack([tables[0][ids[..., 0]]], axis=-2)
    with Cluster(segments=2, segment_size="16MiB", heartbeat_timeout_s=30.0) as c, \
            DistributedStore.connect(c.address, local_direct=False, raw_reads=raw_reads, timeout_ms=5000) as store:
        layer = EngramStore(1, EngramStoreConfig(SIZES, DIM), store)
        layer.populate(tables, replica_num=2)
        for _ in range(2):  # the first read makes the layer's one-call plan, the second uses it
            np.testing.assert_array_equal(layer.lookup(ids), expected)
        lay = layer._layer(None)
        (holder, *_), = lay.state.placement.remote
        next(s for s in c.segments if s.address == holder).kill()
        layer.stats(reset=True)
        out = np.full(expected.shape, -1, np.float32)
        assert layer.lookup_into(ids, out) is out
        np.testing.assert_array_equal(out, expected)
        (now, *_), = lay.state.placement.remote
        assert now != holder
        stats = layer.stats()
        assert stats["lookups"] == 1 and stats["rows"] == ids.size and stats["remote_rows"] == ids.size
        np.testing.assert_array_equal(layer.lookup(ids), expected)  # and the next, the fast way again
