"""Segment reader sockets, the read_ranges wire forms and the pwrite write path, against real processes.

Every reader endpoint a segment registers answers ``read_ranges`` exactly like NumPy slicing of the object,
in the one-frame pairs form and the older two-frame form; bad requests get error replies and the reader
keeps serving; the endpoints survive a master restart in its journal and die with a killed segment; puts
over both write paths round-trip exactly.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from suite_helpers import manifest_objects, zmq_request
from engram_store.wire._protocol import PROTOCOL_VERSION as V
from engram_store import DistributedStore, InvalidArgument, ProtocolError, SegmentServer, SegmentUnavailable
from engram_store.client import _writes as _client
from engram_store.segment import MAX_RANGES, MAX_READ_BYTES, SegmentMemory, default_readers
from engram_store.segment._memory import shmem_huge_pages
from engram_store.wire import Connection
from engram_store.testing import Cluster, wait_ping

pytestmark = pytest.mark.timeout(180)

SEGMENT_SIZE = 48 << 20
OBJECT_BYTES = 6 << 20


@pytest.fixture(scope="module")
def reader_cluster():
    """One segment process with two readers, holding one random object."""
    with Cluster(segments=1, segment_size=str(SEGMENT_SIZE), heartbeat_timeout_s=30.0,
                 segment_extra=["--readers", "2"]) as c:
        with DistributedStore.connect(c.address, timeout_ms=10_000, local_direct=False) as store:
            data = np.random.default_rng(11).integers(0, 256, OBJECT_BYTES, dtype=np.uint8)
            store.put("readers:object", data)
            replica = store.locate(["readers:object"], lease=False)[0].replicas[0]
            yield c, store, data, replica


def _endpoints(replica) -> list[str]:
    return [replica.address, *replica.read_addresses]


def _read(address: str, frames: list, timeout_ms: int = 5000) -> bytes:
    conn = Connection(address, unavailable=SegmentUnavailable)
    try:
        header, reply = conn.call("read_ranges", None, frames, timeout_ms=timeout_ms)
    finally:
        conn.close()
    data = reply[0].bytes
    assert header["bytes"] == len(data)
    return data


def _assert_silent(address: str) -> None:
    """Nothing answers a ping at ``address`` any more."""
    conn = Connection(address, unavailable=SegmentUnavailable)
    try:
        with pytest.raises(SegmentUnavailable):
            conn.call("ping", timeout_ms=300)
    finally:
        conn.close()


def _raw(address: str, frames: list, timeout_ms: int = 5000) -> dict | None:
    """Send raw frames to a server; the unpacked reply header, or None if no reply came."""
    reply = zmq_request(address, frames, timeout_ms)
    return None if reply is None else msgpack.unpackb(reply[0])


def test_segment_registers_its_reader_endpoints(reader_cluster):
    cluster, store, _, replica = reader_cluster
    proc = cluster.segments[0]
    assert len(proc.read_addresses) == 2
    assert replica.read_addresses == tuple(proc.read_addresses)
    assert replica.address not in replica.read_addresses
    hash(replica)  # frozen and hashable, a placement-cache key
    (segment,) = store.status()["segments"]
    assert segment["read_addresses"] == proc.read_addresses
    for address in proc.read_addresses:
        assert wait_ping(address, timeout_s=5, unavailable=SegmentUnavailable)["segment_id"] == proc.segment_id


ranges = st.lists(st.tuples(st.integers(0, OBJECT_BYTES - 1), st.integers(0, 4096)), min_size=1, max_size=40)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spans=st.one_of(ranges, st.tuples(st.integers(0, OBJECT_BYTES - (3 << 20)),
                                         st.integers(1 << 20, 3 << 20)).map(lambda r: [r])))
def test_reads_through_every_endpoint_equal_numpy_slicing(reader_cluster, spans):
    _, _, data, replica = reader_cluster
    spans = [(o, min(n, OBJECT_BYTES - o)) for o, n in spans]
    expected = b"".join(data[o:o + n].tobytes() for o, n in spans)
    offsets = np.array([replica.offset + o for o, _ in spans], dtype=np.int64)
    lengths = np.array([n for _, n in spans], dtype=np.int64)
    pairs = np.stack((offsets, lengths), axis=1)
    for address in _endpoints(replica):
        assert _read(address, [pairs]) == expected, address
        assert _read(address, [offsets, lengths]) == expected, address


def _bad_requests(replica) -> list[tuple[str, list, str]]:
    head = msgpack.packb({"v": V, "id": 7, "op": "read_ranges"})
    end = SEGMENT_SIZE

    def pairs(*ps):
        return np.array(ps, dtype=np.int64).tobytes()

    return [
        ("no ranges frame", [head], "expected 1 frame"),
        ("three frames", [head, pairs((0, 8)), b"", b""], "expected 1 frame"),
        ("ragged pairs", [head, pairs((0, 8))[:12]], "whole number"),
        ("ragged offsets", [head, b"\x00" * 12, pairs((8,))], "whole number"),
        ("mismatched counts", [head, np.zeros(2, np.int64).tobytes(), np.ones(3, np.int64).tobytes()],
         "expected 2"),
        ("past the end", [head, pairs((replica.offset, 8), (end - 8, 16))], "range 1"),
        ("a lone check (a negative offset)", [head, pairs((-64, 8))], "leading check pairs, expected an even"),
        ("negative length", [head, pairs((0, 8), (64, -8))], "range 1 length"),
        ("lengths that wrap int64", [head, pairs(*[(0, 1 << 62)] * 4)], "range 0"),
        ("too many bytes", [head, pairs((0, MAX_READ_BYTES), (0, 8))], "total length"),
        ("too many ranges", [head, np.zeros((MAX_RANGES + 1, 2), np.int64).tobytes()], "at most"),
        ("garbage header", [b"\xc1", pairs((0, 8))], "msgpack"),
        ("header not a map", [msgpack.packb([1, 2]), pairs((0, 8))], "map"),
        ("wrong version", [msgpack.packb({"v": 99, "id": 1, "op": "read_ranges"}), pairs((0, 8))], "version"),
        ("id not an integer", [msgpack.packb({"v": V, "id": "x", "op": "read_ranges"})], "'id'"),
        ("op not a string", [msgpack.packb({"v": V, "id": 1, "op": 5})], "'op'"),
        ("writes go to the main socket", [msgpack.packb({"v": V, "id": 1, "op": "write", "offset": 0}), b"x"],
         "unknown op"),
    ]


def test_bad_requests_to_a_reader_get_error_replies_and_it_keeps_serving(reader_cluster):
    _, store, data, replica = reader_cluster
    reader = replica.read_addresses[0]
    for name, frames, message in _bad_requests(replica):
        reply = _raw(reader, frames)
        assert reply is not None, f"{name}: no reply"
        assert reply["ok"] is False, (name, reply)
        assert message in reply["message"], (name, reply["message"])
    _raw(reader, [b""], timeout_ms=500)  # an empty header may be dropped as noise; serving goes on
    wait_ping(reader, timeout_s=5, unavailable=SegmentUnavailable)
    pairs = np.array([[replica.offset + 5, 1000]], dtype=np.int64)
    assert _read(reader, [pairs]) == data[5:1005].tobytes()
    assert store.get("readers:object") == data.tobytes()


def test_readers_stop_with_the_segment_and_a_killed_segment_takes_them_along():
    # In-process: close() stops the reader threads and their sockets.
    server = SegmentServer(1 << 20, None, readers=3).start()
    addresses = server.read_addresses
    assert len(addresses) == 3
    for address in addresses:
        wait_ping(address, timeout_s=5, unavailable=SegmentUnavailable)
    tag = server.segment_id[:8]
    readers = [t for t in threading.enumerate() if tag in t.name and "reader" in t.name]
    assert len([t for t in readers if not t.name.endswith("-guard")]) == 3  # each with its socket's guard
    assert len(readers) == 6
    server.close()
    server.close()  # idempotent
    assert not [t for t in threading.enumerate() if tag in t.name and t.is_alive()]
    for address in addresses:
        _assert_silent(address)
    # A SIGKILLed segment process: its readers were threads, they go with it.
    with Cluster(segments=1, heartbeat_timeout_s=30.0) as c:
        proc = c.segments[0]
        for address in proc.read_addresses:
            wait_ping(address, timeout_s=5, unavailable=SegmentUnavailable)
        proc.kill()
        for address in [proc.address, *proc.read_addresses]:
            _assert_silent(address)


def test_the_default_reader_count_follows_the_cpus():
    assert default_readers() == (2 if len(os.sched_getaffinity(0)) >= 4 else 1)
    with Cluster(segments=1, heartbeat_timeout_s=30.0) as c:
        assert len(c.segments[0].read_addresses) == default_readers()
    server = SegmentServer(1 << 20, None)
    try:
        assert len(server.read_addresses) == default_readers()
    finally:
        server.close()


def test_a_segment_with_no_readers_registers_none():
    with Cluster(segments=0, heartbeat_timeout_s=30.0) as c:
        proc = c.add_segment("8MiB", ["--readers", "0"])
        assert proc.read_addresses == []
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            store.put("k", b"v" * 100)
            assert store.locate(["k"])[0].replicas[0].read_addresses == ()
            assert store.get("k") == b"v" * 100
        with pytest.raises(RuntimeError, match="readers"):
            c.add_segment("8MiB", ["--readers", "-1"])


def test_read_addresses_survive_a_master_restart_with_its_journal(tmp_path):
    journal = str(tmp_path / "master.journal")
    with Cluster(segments=2, journal=journal, heartbeat_timeout_s=5.0, segment_extra=["--readers", "2"]) as c:
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            store.put("j", b"j" * 5000, replica_num=2)
            before = {r.segment_id: r.read_addresses for r in store.locate(["j"])[0].replicas}
            assert before == {s.segment_id: tuple(s.read_addresses) for s in c.segments}
            c.master.kill()
            c.restart_master(journal=journal, heartbeat_timeout_s=5.0)
            after = {r.segment_id: r.read_addresses for r in store.locate(["j"])[0].replicas}
            assert after == before
            assert {s["segment_id"]: tuple(s["read_addresses"]) for s in store.status()["segments"]} == before
            with open(journal, encoding="utf-8") as f:  # compacted at start: the snapshot holds them too
                records = [json.loads(line) for line in f if line.strip()]
            assert {r["segment_id"]: tuple(r["read_addresses"]) for r in records if r["op"] == "segment"} == before
            replica = store.locate(["j"])[0].replicas[0]
            pairs = np.array([[replica.offset, 5000]], dtype=np.int64)
            assert _read(replica.read_addresses[1], [pairs]) == b"j" * 5000


ODD_SIZES = [1, 63, 4097, (3 << 20) + 5, 2_000_011]


@pytest.mark.parametrize("local_direct", [True, False], ids=["same-host", "remote"])
def test_puts_round_trip_exactly_with_odd_sizes_and_offsets(monkeypatch, local_direct):
    # Odd chunk sizes make every chunk after the first start at an odd offset of the object and the segment.
    monkeypatch.setattr(_client, "WRITE_CHUNK_BYTES", 1_000_003)
    monkeypatch.setattr(_client, "LOCAL_WRITE_CHUNK_BYTES", 999_983)
    rng = np.random.default_rng(5)
    backing = rng.integers(0, 256, sum(ODD_SIZES) + 64, dtype=np.uint8)
    objects, pos = [], 3
    for n in ODD_SIZES:  # views at odd addresses of one buffer
        objects.append(backing[pos:pos + n])
        pos += n
    keys = [f"odd-{n}" for n in ODD_SIZES]
    with Cluster(segments=2, segment_size="32MiB", heartbeat_timeout_s=30.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=10_000, local_direct=local_direct) as store:
            store.batch_put_from(keys, objects, replica_num=2)
            store.put("empty", b"")
        with DistributedStore.connect(c.address, timeout_ms=10_000, local_direct=False) as reader:
            for key, obj in zip(keys, objects):
                for replica in reader.locate([key])[0].replicas:  # both copies, through a reader endpoint
                    pairs = np.array([[replica.offset, obj.size]], dtype=np.int64)
                    assert _read(replica.read_addresses[0], [pairs]) == obj.tobytes(), key
                assert reader.get(key) == obj.tobytes()
            assert reader.get("empty") == b""
        # Writes straight to the main socket at odd offsets, under a ticket the master issued, land exactly there.
        master = Connection(c.address, unavailable=SegmentUnavailable)
        try:
            (placed,) = master.call("put_start", {"keys": ["raw"], "sizes": [100_014], "replica_num": 1})[0]["results"]
        finally:
            master.close()
        replica = placed["replicas"][0]
        conn = Connection(replica["address"], unavailable=SegmentUnavailable)
        try:
            payload = rng.integers(0, 256, 100_001, dtype=np.uint8)
            offset = replica["offset"] + 13
            written = conn.call("write", {"offset": offset, "ticket": replica["ticket"]}, [payload])[0]["written"]
            assert written == payload.size
            pairs = np.array([[offset, payload.size]], dtype=np.int64)
            assert _read(replica["address"], [pairs]) == payload.tobytes()
            with pytest.raises(InvalidArgument, match="end past"):
                conn.call("write", {"offset": (32 << 20) - 10, "ticket": replica["ticket"]}, [payload])
            with pytest.raises(InvalidArgument, match="outside the range"):
                conn.call("write", {"offset": offset + 1, "ticket": replica["ticket"]}, [payload])
            with pytest.raises(InvalidArgument, match="missing field 'ticket'"):
                conn.call("write", {"offset": offset}, [payload])
        finally:
            conn.close()


def test_a_durable_segment_restarts_with_objects_written_both_ways(tmp_path):
    path = str(tmp_path / "segment.bin")
    same_host = np.random.default_rng(1).integers(0, 256, (5 << 20) + 3, dtype=np.uint8)
    remote = np.random.default_rng(2).integers(0, 256, (3 << 20) + 1, dtype=np.uint8)
    with Cluster(segments=0, heartbeat_timeout_s=30.0) as c:
        seg = c.add_segment("16MiB", ["--file", path])
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=True) as store:
            store.put("same-host", same_host)  # pwrite into the segment's file from this process
        with DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as store:
            store.put("remote", remote)  # a write request; the segment pwrites it
            deadline = time.monotonic() + 20
            while manifest_objects(path) != 2:  # recorded after an fsync of the data
                assert time.monotonic() < deadline, "the manifest never recorded both objects"
                time.sleep(0.05)
            seg.kill()
            c.add_segment("16MiB", ["--file", path])
            assert store.get("same-host") == same_host.tobytes()
            assert store.get("remote") == remote.tobytes()


def test_segment_memory_prefaults_and_reports_the_huge_page_policy(tmp_path):
    memory = SegmentMemory(8 << 20, path=str(tmp_path / "m.bin"), keep_file=True)
    try:
        assert memory.prefault(threading.Event(), chunk_bytes=3 << 20) == 8 << 20
        stop = threading.Event()
        stop.set()
        assert memory.prefault(stop) == 0
        assert memory.write(5, memoryview(b"abc")) == 3
        memory.flush()
        assert bytes(memory.array[5:8]) == b"abc"
    finally:
        memory.close()
    memory.close()  # idempotent
    assert shmem_huge_pages() in ("", "always", "within_size", "advise", "never", "deny", "force")
    server = SegmentServer(4 << 20, None, readers=0)
    try:
        server._prefault_thread.join(timeout=30)
        assert not server._prefault_thread.is_alive()
    finally:
        server.close()


def test_a_reader_socket_refuses_an_unknown_op_with_the_list_of_what_it_serves(reader_cluster):
    _, _, _, replica = reader_cluster
    conn = Connection(replica.read_addresses[0], unavailable=SegmentUnavailable)
    try:
        with pytest.raises(ProtocolError, match="ping.*read_ranges"):
            conn.call("write", {"offset": 0}, [b"x"], timeout_ms=5000)
    finally:
        conn.close()


def test_a_put_to_a_hung_segment_times_out_and_leaves_nothing_behind():
    payload = np.random.default_rng(8).integers(0, 256, (20 << 20) + 1, dtype=np.uint8)  # several chunks
    with Cluster(segments=2, segment_size="64MiB", heartbeat_timeout_s=30.0) as c:
        with DistributedStore.connect(c.address, timeout_ms=1500, local_direct=False) as store:
            c.segments[0].signal(signal.SIGSTOP)
            try:
                start = time.monotonic()
                with pytest.raises(SegmentUnavailable, match="write"):
                    store.put("stuck", payload, replica_num=2)
                assert time.monotonic() - start < 1.5 + 3.0
            finally:
                c.segments[0].signal(signal.SIGCONT)
            assert not store.is_exist("stuck")
            store.put("after", payload, replica_num=2)  # the window works again once the segment runs
            assert store.get("after") == payload.tobytes()
