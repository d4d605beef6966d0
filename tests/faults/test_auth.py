"""CURVE authentication (``--auth``): keys from ``engram-master keygen``, real master and segment processes.

An authorised client reads and writes; a client without keys, with another cluster's keys, or with the
right server key but an unauthorised client key is refused by master and segments alike, within its
timeout, and the servers log the refusal. A segment without keys never joins an --auth master.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
from engram_store.testing import Cluster, start_master, start_segment

from engram_store import DistributedStore, MasterUnavailable, SegmentUnavailable
from engram_store.wire._auth import load_keys
from engram_store.wire import Connection

pytestmark = pytest.mark.skipif(not __import__("zmq").has("curve"), reason="libzmq without CURVE")


def _engram_master(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engram_store.master", *args], capture_output=True, text=True, timeout=60)


def _keygen(directory) -> str:
    result = _engram_master("keygen", str(directory))
    assert result.returncode == 0, result.stderr
    return str(directory)


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _status(master: str, auth_dir: str, *extra: str) -> dict:
    result = _engram_master("status", "--master", master, "--auth", auth_dir, "--json", *extra)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture
def keys(tmp_path) -> str:
    return _keygen(tmp_path / "keys")


@pytest.fixture
def auth_cluster(keys):
    with Cluster(segments=1, auth_dir=keys, heartbeat_timeout_s=3.0) as c:
        yield c


@pytest.mark.timeout(120)
def test_keygen_writes_private_keys_and_refuses_to_overwrite(tmp_path):
    directory = tmp_path / "keys"
    result = _engram_master("keygen", str(directory))
    assert result.returncode == 0, result.stderr
    assert "--auth" in result.stdout and "auth_dir" in result.stdout
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    for name in ("server.key", "client.key", "authorized_clients/client.key"):
        assert (directory / name).is_file()
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE(os.stat(directory / name).st_mode) == 0o600
    before = (directory / "server.key").read_text()

    again = _engram_master("keygen", str(directory))
    assert again.returncode != 0 and "--force" in again.stderr
    assert (directory / "server.key").read_text() == before

    forced = _engram_master("keygen", str(directory), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (directory / "server.key").read_text() != before


@pytest.mark.timeout(120)
def test_authorised_client_round_trips(auth_cluster, keys):
    rng = np.random.default_rng(5)
    for local_direct in (False, True):
        with DistributedStore.connect(auth_cluster.address, timeout_ms=5000, local_direct=local_direct,
                                      auth_dir=keys) as store:
            data = rng.integers(0, 255, size=3 << 20, dtype=np.uint8)  # several chunks over CURVE
            key = f"t:{local_direct}"
            store.put(key, data)
            assert store.get(key) == data.tobytes()
            rows = np.zeros(4096, dtype=np.uint8)
            store.get_into_ranges([rows], [[key]], [[[0, 2048]]], [[[100, 1 << 20]]], [[[2048, 2048]]])
            assert np.array_equal(rows[:2048], data[100:2148])
            assert np.array_equal(rows[2048:], data[(1 << 20):(1 << 20) + 2048])
            store.remove(key, force=True)
    segments = _status(auth_cluster.address, keys)["segments"]
    assert [s["address"] for s in segments] == [auth_cluster.segments[0].address]
    # status first asks, and checks with a bare TCP connect that something listens only when no answer came: a
    # connection closed before its handshake would show the master a client it refused
    assert _status(auth_cluster.address, keys, "--wait-segments", "1")["segments"]
    # a last round trip: by its answer the master has read the connection events of the calls before it
    DistributedStore.connect(auth_cluster.address, timeout_ms=5000, auth_dir=keys).close()
    assert "refused" not in auth_cluster.master.output(), auth_cluster.master.output()


@pytest.mark.timeout(120)
def test_client_without_keys_is_refused_and_logged(auth_cluster, keys):
    with DistributedStore.connect(auth_cluster.address, timeout_ms=5000, auth_dir=keys) as store:
        store.put("secret", b"x" * 1000)

    start = time.monotonic()
    with pytest.raises(MasterUnavailable, match="auth_dir"):
        DistributedStore.connect(auth_cluster.address, timeout_ms=1500)
    assert time.monotonic() - start < 1.5 + 2.0
    assert _wait_for(lambda: "refused a connection" in auth_cluster.master.output()), \
        auth_cluster.master.output()

    # The segment refuses a keyless reader too (it would otherwise serve any offset it is asked for).
    segment = auth_cluster.segments[0]
    conn = Connection(segment.address, unavailable=SegmentUnavailable)
    try:
        with pytest.raises(SegmentUnavailable):
            conn.call("read_ranges", None, [np.array([0], dtype=np.int64), np.array([1000], dtype=np.int64)],
                      timeout_ms=1000)
        # (the connection stays open meanwhile: on a loaded machine the segment may see the handshake fail only
        # after the call gave up, and a connection closed first is a peer that left, not one refused)
        assert _wait_for(lambda: "refused a connection" in segment.output()), segment.output()
    finally:
        conn.close()

    status = _engram_master("status", "--master", auth_cluster.address, "--timeout", "1")
    assert status.returncode != 0 and "--auth" in status.stderr


@pytest.mark.timeout(120)
def test_client_with_other_keys_is_refused(auth_cluster, keys, tmp_path):
    other = _keygen(tmp_path / "other")  # another cluster's keys: the server key does not match
    with pytest.raises(MasterUnavailable):
        DistributedStore.connect(auth_cluster.address, timeout_ms=1500, auth_dir=other)

    # The right server key but a client key pair the cluster never authorised: refused by ZAP, key logged.
    intruder = tmp_path / "intruder"
    shutil.copytree(other, intruder)
    shutil.copy(os.path.join(keys, "server.key"), intruder / "server.key")
    with pytest.raises(MasterUnavailable):
        DistributedStore.connect(auth_cluster.address, timeout_ms=1500, auth_dir=str(intruder))
    client_key = next(line.split('"')[1] for line in (intruder / "client.key").read_text().splitlines()
                      if "public-key" in line)
    assert _wait_for(lambda: f"client key {client_key} is not authorised" in auth_cluster.master.output()), \
        auth_cluster.master.output()

    with DistributedStore.connect(auth_cluster.address, timeout_ms=5000, auth_dir=keys) as store:
        assert store.ping()["role"] == "master"  # the refusals did not disturb the server


@pytest.mark.timeout(120)
def test_segment_without_keys_cannot_register(auth_cluster, keys, tmp_path):
    with pytest.raises(RuntimeError):
        start_segment(auth_cluster.address, extra=["--register-timeout", "3"])
    # With another cluster's keys it cannot join either.
    other = _keygen(tmp_path / "other")
    with pytest.raises(RuntimeError):
        start_segment(auth_cluster.address, extra=["--register-timeout", "3"], auth_dir=other)
    segments = _status(auth_cluster.address, keys)["segments"]
    assert [s["address"] for s in segments] == [auth_cluster.segments[0].address]


@pytest.mark.timeout(120)
def test_embedded_store_with_auth(keys):
    with DistributedStore.embedded(segment_size="16MiB", timeout_ms=5000, auth_dir=keys) as store:
        store.put("k", b"embedded")
        assert store.get("k") == b"embedded"
        with DistributedStore.connect(store.master_address, timeout_ms=5000, local_direct=False,
                                      auth_dir=keys) as other:
            assert other.get("k") == b"embedded"
        with pytest.raises(MasterUnavailable):
            DistributedStore.connect(store.master_address, timeout_ms=1000)


@pytest.mark.timeout(120)
def test_non_loopback_bind_without_auth_warns(keys):
    master = start_master(extra=["--host", "0.0.0.0"])
    try:
        assert _wait_for(lambda: "WARNING: binding 0.0.0.0 without --auth" in master.output()), master.output()
    finally:
        master.close()
    master = start_master(extra=["--host", "0.0.0.0"], auth_dir=keys)
    try:
        time.sleep(0.5)
        assert "without --auth" not in master.output()
    finally:
        master.close()


@pytest.mark.timeout(120)
def test_re_replication_between_auth_segments(keys):
    # The master copies objects between segments as a client of the cluster, with the cluster's client keys.
    payload = os.urandom(1 << 20)
    with Cluster(segments=2, auth_dir=keys, heartbeat_timeout_s=3.0, extra=["--re-replicate"]) as c:
        with DistributedStore.connect(c.address, timeout_ms=3000, local_direct=False, auth_dir=keys) as store:
            store.put("precious", payload, replica_num=2)
            c.segments[0].kill()
            assert _wait_for(lambda: len(store.status()["segments"]) == 1, 15)
            spare = c.add_segment("64MiB")
            assert _wait_for(lambda: spare.segment_id in {r.segment_id for r in store.locate(["precious"])[0].replicas},
                             20), c.master.output()
            c.segments[1].kill()
            assert _wait_for(lambda: len(store.status()["segments"]) == 1, 15)
            assert store.get("precious") == payload


@pytest.mark.timeout(120)
def test_segment_readers_require_the_cluster_keys(auth_cluster, keys):
    segment = auth_cluster.segments[0]
    assert segment.read_addresses
    with DistributedStore.connect(auth_cluster.address, timeout_ms=5000, local_direct=False, auth_dir=keys) as store:
        store.put("read-me", b"r" * 4096)
        replica = store.locate(["read-me"])[0].replicas[0]
    assert replica.read_addresses == tuple(segment.read_addresses)
    pairs = np.array([[replica.offset, 4096]], dtype=np.int64)
    curve = load_keys(keys, server=False).client_curve
    for address in replica.read_addresses:
        conn = Connection(address, unavailable=SegmentUnavailable, curve=curve)
        try:
            _, frames = conn.call("read_ranges", None, [pairs], timeout_ms=5000)
            assert frames[0].bytes == b"r" * 4096
        finally:
            conn.close()
    # A reader without keys gets no answer, and the reader logs the refusal like the main socket does.
    keyless = Connection(replica.read_addresses[0], unavailable=SegmentUnavailable)
    start = time.monotonic()
    try:
        with pytest.raises(SegmentUnavailable):
            keyless.call("read_ranges", None, [pairs], timeout_ms=1000)
    finally:
        keyless.close()
    assert time.monotonic() - start < 1.0 + 2.0
    assert _wait_for(lambda: "reader 0: refused a connection" in segment.output()), segment.output()
