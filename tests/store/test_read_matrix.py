"""Every read path, with and without authentication: lookups equal NumPy indexing in each cell.

The matrix: CURVE auth (off, on) x reader sockets (0, 2) x the raw read channel (on, off) x local-direct (on,
off). One cluster (a master and two segments, so a layer's heads spread over servers) per (auth, readers) pair
serves the cells that share it; each cell is a client built with its own ``raw_reads`` and ``local_direct``.
Lookups go through ``EngramStore`` over ``DistributedStore.connect``: one layer alone (one request per server,
read in output order where one server holds every head), both layers in one call (one request per server for
all of them), and a lookup large enough that its reply streams in pieces.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from engram_store import DistributedStore, EngramStore, EngramStoreConfig
from engram_store.raw import RawPort
from engram_store.testing import Cluster

pytestmark = pytest.mark.timeout(180)

HAS_CURVE = __import__("zmq").has("curve")
LAYERS = {5: [1009, 2003, 787], 9: [3001, 1499]}  # layer id -> rows per head
DIM = 64  # 256-byte rows: the large lookup below is 8192 x 3 rows, a 6 MiB reply (streamed in pieces)


def _tables(layer_id: int) -> list[np.ndarray]:
    rng = np.random.default_rng(layer_id)
    return [rng.standard_normal((n, DIM), dtype=np.float32) for n in LAYERS[layer_id]]


def _ids(layer_id: int, B: int, L: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.integers(0, n, (B, L)) for n in LAYERS[layer_id]], axis=-1)  # [B, L, H]


def _expected(tables: list[np.ndarray], ids: np.ndarray) -> np.ndarray:
    return np.stack([tables[h][ids[..., h]] for h in range(len(tables))], axis=-2)  # [B, L, H, D]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> str:
    if not HAS_CURVE:
        return ""
    directory = str(tmp_path_factory.mktemp("matrix") / "keys")
    result = subprocess.run([sys.executable, "-m", "engram_store.master", "keygen", directory], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return directory


@pytest.fixture(scope="module", params=[(False, 0), (False, 2), (True, 0), (True, 2)],
                ids=["plain-readers0", "plain-readers2", "auth-readers0", "auth-readers2"])
def cluster(request, keys):
    auth, readers = request.param
    if auth and not HAS_CURVE:
        pytest.skip("libzmq without CURVE")
    auth_dir = keys if auth else None
    with Cluster(segments=2, segment_size="32MiB", auth_dir=auth_dir, heartbeat_timeout_s=30.0,
                 segment_extra=["--readers", str(readers)]) as c:
        with DistributedStore.connect(c.address, auth_dir=auth_dir, local_direct=False) as writer:
            for layer_id, sizes in LAYERS.items():
                EngramStore(layer_id, EngramStoreConfig(sizes, DIM), writer).populate(_tables(layer_id))
            replica = writer.locate(["engram:l5:h0"])[0].replicas[0]
            assert len(replica.read_addresses) == readers
        yield c, auth_dir


@pytest.mark.parametrize("local_direct", [True, False], ids=["local", "remote"])
@pytest.mark.parametrize("raw_reads", [True, False], ids=["raw", "zmq"])
def test_lookups_equal_numpy_indexing(cluster, raw_reads, local_direct):
    c, auth_dir = cluster
    with DistributedStore.connect(c.address, auth_dir=auth_dir, local_direct=local_direct, raw_reads=raw_reads,
                                  timeout_ms=20_000) as store:
        tables = {layer_id: _tables(layer_id) for layer_id in LAYERS}
        single = EngramStore(5, EngramStoreConfig(LAYERS[5], DIM), store)
        for seed, (B, L) in enumerate([(1, 1), (4, 16), (1, 8192)]):
            ids = _ids(5, B, L, seed)
            np.testing.assert_array_equal(single.lookup(ids), _expected(tables[5], ids))
        both = EngramStore({lid: EngramStoreConfig(sizes, DIM) for lid, sizes in LAYERS.items()}, store=store)
        ids = {lid: _ids(lid, 3, 7, 100 + lid) for lid in LAYERS}
        got = both.lookup_layers(ids)
        for lid in LAYERS:
            np.testing.assert_array_equal(got[lid], _expected(tables[lid], ids[lid]))
        if raw_reads and not local_direct:  # the reads really went over the raw channel (no silent fallback)
            assert store.raw_routes.channels and all(isinstance(v, RawPort) for v in store.raw_routes.ports.values()), \
                store.raw_routes.ports
        else:
            assert not store.raw_routes.channels
