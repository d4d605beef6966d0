"""The master's Prometheus endpoint and the client-side lookup counters."""
from __future__ import annotations

import re
import socket
import time
import urllib.request

import pytest

from engram_store import DistributedStore, ObjectNotFound, Unavailable
from engram_store.master import MasterServer
from engram_store.testing import Cluster, free_port

pytestmark = pytest.mark.timeout(120)


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_master_metrics_endpoint_reports_state_and_requests():
    port = free_port()
    with Cluster(segments=2, segment_size="32MiB", extra=["--metrics-port", str(port)]) as c:
        with DistributedStore.connect(c.address, local_direct=False) as store:
            store.put("m1", b"x" * 1000, replica_num=2)
            store.put("m2", b"y" * 500)
            store.get("m1")  # takes a lease
            with pytest.raises(ObjectNotFound):
                store.get("missing")
            deadline = time.monotonic() + 10
            while True:  # the snapshot is rebuilt every tick
                samples = _scrape(port)
                if samples.get('engram_master_requests_total{op="get_replicas"}', 0) >= 2:
                    break
                assert time.monotonic() < deadline, samples
                time.sleep(0.05)
    assert samples["engram_master_object_bytes"] == 1500
    assert samples["engram_master_segments_alive"] == 2
    assert samples["engram_master_leases_active"] >= 1
    used = {k: v for k, v in samples.items() if k.startswith("engram_master_segment_used_bytes")}
    assert len(used) == 2 and sum(used.values()) >= 1000 * 2 + 500
    assert not any("address=" in k for k in used)  # segments by id: addresses only with --metrics-addresses
    assert samples['engram_master_requests_total{op="put_start"}'] == 2
    assert samples['engram_master_requests_total{op="get_replicas"}'] >= 2  # a missing key is a result, not an error
    assert samples['engram_master_request_errors_total{op="put_start"}'] == 0
    buckets = {float(re.search(r'le="([^"]+)"', k).group(1)): v for k, v in samples.items()
               if k.startswith('engram_master_request_seconds_bucket{op="put_end"')}
    assert buckets[float("inf")] == samples['engram_master_request_seconds_count{op="put_end"}'] == 2
    counts = [buckets[le] for le in sorted(buckets)]
    assert counts == sorted(counts)  # cumulative buckets never decrease


def test_metrics_port_in_use_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(Unavailable, match="metrics: cannot serve"):
            MasterServer("127.0.0.1", 0, metrics_port=busy.getsockname()[1])


def test_master_metrics_bind_loopback_and_name_addresses_only_when_asked():
    """The page binds 127.0.0.1 whatever the master binds (here 127.0.0.2), unless told otherwise."""
    port = free_port()
    with MasterServer("127.0.0.2", 0, metrics_port=port) as master:
        master.start()
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.2", port)) != 0  # nothing listens on the master's address
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert reply.status == 200  # (its text, published at the next tick)
    port = free_port()
    with Cluster(segments=1, segment_size="16MiB", extra=["--metrics-port", str(port), "--metrics-addresses"]) as c:
        deadline = time.monotonic() + 10
        samples = _scrape(port)
        while not any("address=" in k for k in samples):  # the snapshot is rebuilt every tick
            assert time.monotonic() < deadline, samples
            time.sleep(0.05)
            samples = _scrape(port)
        assert f'address="{c.segments[0].address}"' in " ".join(samples)
