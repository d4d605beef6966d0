"""MooncakeDistributedStore's calls as Mooncake documents them, against a real engram-master on 127.0.0.1.

Each client mounts its segment in this process; the master is a separate process (engram_store.testing),
killed and reaped when the module's tests end. Return codes are Mooncake's: 0 or a byte count, -600 invalid
parameters, -704 not found, -1601 no DFS tier.
"""
from __future__ import annotations

import ctypes
import gc
import itertools
import os
import socket

import numpy as np
import pytest

from engram_store import SegmentUnavailable
from engram_store.compat import BufferHandle, MooncakeDistributedStore, ReplicateConfig, SoftPinAction
from engram_store.testing import Cluster, free_port, wait_ping

pytestmark = pytest.mark.timeout(120)

_keys = itertools.count()


def key(name: str) -> str:
    """A key no other test (or run) uses."""
    return f"api-{os.getpid()}-{next(_keys)}-{name}"


@pytest.fixture(scope="module")
def cluster():
    with Cluster(segments=0) as cluster:
        yield cluster


def connect(cluster, local_buffer_size=16 << 20, host="localhost", segment_size=32 << 20) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    rc = store.setup(host, "P2PHANDSHAKE", segment_size, local_buffer_size, "tcp", "", cluster.address)
    assert rc == 0, f"setup returned {rc}: {store.last_error}"
    return store


@pytest.fixture(scope="module")
def store(cluster):
    store = connect(cluster)
    yield store
    store.close()


# ---- setup ----------------------------------------------------------------------------------------------


def test_dictionary_setup_with_human_readable_sizes(cluster):
    store = MooncakeDistributedStore()
    try:
        assert store.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                            "global_segment_size": "16MB", "local_buffer_size": "16 MB",
                            "protocol": "tcp", "rdma_devices": "", "master_server_addr": cluster.address}) == 0
        name = key("dict")
        assert store.put(name, b"configured by a dict") == 0
        assert store.get(name) == b"configured by a dict"
        assert store.native_store.status()["segments"]  # its own 16 MiB segment among them
    finally:
        store.close()


def test_zero_local_buffer_fails_staged_calls_as_mooncake(cluster, store):
    name = key("zero-buffer")
    assert store.put(name, b"someone else's") == 0
    zero = connect(cluster, local_buffer_size=0)
    try:
        assert zero.put(key("zero-put"), b"no buffer to stage through") == -600
        assert "local_buffer_size" in str(zero.last_error)
        assert zero.is_exist(key("zero-put")) == 0
        assert zero.upsert(name, b"x") == -600 and zero.get(name) == b"" and zero.get_buffer(name) is None
        data = np.frombuffer(b"zero-copy needs none", dtype=np.uint8).copy()
        assert zero.put_from(key("zero-from"), data.ctypes.data, data.nbytes) == 0  # zero-copy: no staging
        out = np.zeros(64, dtype=np.uint8)
        assert zero.get_into(name, out.ctypes.data, out.nbytes) == len(b"someone else's")
    finally:
        zero.close()
    small = connect(cluster, local_buffer_size=1024)
    try:
        assert small.put(key("too-big"), b"x" * 1025) == -600 and small.put(key("fits"), b"x" * 1024) == 0
    finally:
        small.close()


def test_hostname_is_this_clients_endpoint_on_a_port_in_mooncakes_range(cluster, store):
    host, port = store.get_hostname().split(":")
    assert host == "localhost" and 12300 <= int(port) <= 14300
    wait_ping(store.get_hostname(), timeout_s=10, unavailable=SegmentUnavailable)  # the segment answers there
    client_only = connect(cluster, segment_size=0)
    try:  # a client that mounts nothing still holds a name of its own
        other = client_only.get_hostname()
        assert other.startswith("localhost:") and 12300 <= int(other.split(":")[1]) <= 14300
        assert other != store.get_hostname()
    finally:
        client_only.close()


def test_hostname_port_given_in_local_hostname_or_the_environment(cluster, monkeypatch):
    port = free_port(4)  # the ports after it are free too: a mounted segment's reader sockets take them
    store = connect(cluster, host=f"127.0.0.1:{port}")
    try:
        assert store.get_hostname() == f"127.0.0.1:{port}"
        wait_ping(store.get_hostname(), timeout_s=10, unavailable=SegmentUnavailable)
    finally:
        store.close()
    low = free_port(reserve=False)  # the store holds it with a plain bind (no SO_REUSEADDR)
    monkeypatch.setenv("MC_STORE_CLIENT_MIN_PORT", str(low))
    monkeypatch.setenv("MC_STORE_CLIENT_MAX_PORT", str(low))
    store = connect(cluster, segment_size=0)
    try:
        assert store.get_hostname() == f"localhost:{low}"
        with socket.socket() as probe, pytest.raises(OSError):
            probe.bind(("localhost", low))  # held while the store lives
    finally:
        store.close()


def test_close_drops_the_objects_of_this_clients_segment():
    with Cluster(segments=0) as own:  # this client's segment is the only one
        store = connect(own)
        name = key("teardown")
        assert store.put(name, b"in my segment") == 0 and store.close() == 0
        store = connect(own)
        try:
            assert store.get(name) == b""
            assert store.put(name, b"again") == 0 and store.get(name) == b"again"
        finally:
            store.close()


def test_init_all_starts_a_master_here_with_a_segment_and_mooncakes_1_gib_buffer():
    store = MooncakeDistributedStore()
    try:
        assert store.init_all("tcp", "", 16 << 20) == 0
        assert store.get_hostname().startswith("127.0.0.1:")
        assert store.put(key("init-all"), b"x" * (2 << 20)) == 0
        assert store.native_store.status()["segments"]
    finally:
        store.close()


def test_a_store_dropped_without_close_unmounts_its_segment():
    with Cluster(segments=0) as own:  # the dropped client's segment is the only one
        observer = connect(own, segment_size=0)
        try:
            dropped = connect(own)
            name = key("dropped")
            assert dropped.put(name, b"on the dropped client's segment") == 0 and observer.is_exist(name) == 1
            del dropped
            gc.collect()
            assert observer.is_exist(name) == 0  # gone with its segment, as Mooncake's client unmounts when destroyed
        finally:
            observer.close()


# ---- writes ---------------------------------------------------------------------------------------------


def test_put_of_an_existing_key_succeeds_and_keeps_the_stored_object(store):
    name = key("put-twice")
    assert store.put(name, b"first") == 0
    assert store.put(name, b"second, longer") == 0
    assert store.get(name) == b"first"
    data = np.frombuffer(b"from a buffer", dtype=np.uint8).copy()
    assert store.put_from(name, data.ctypes.data, data.nbytes) == 0
    assert store.batch_put_from([name], [data.ctypes.data], [data.nbytes]) == [0]
    assert store.get(name) == b"first"
    fresh = key("batch-new")
    assert store.put_batch([name, fresh], [b"ignored", b"new"]) == 0
    assert store.get(name) == b"first" and store.get(fresh) == b"new"
    assert store.put_parts(key("parts"), b"Hello, ", bytearray(b"World"), memoryview(b"!")) == 0
    assert store.put(key("empty"), b"") == -600  # Mooncake refuses an empty object


def test_write_checks_return_mooncakes_codes(store):
    cases = [("replica_num", 0, -600), ("nof_replica_num", 1, -600), ("dfs_replica_num", 1, -1601),
             ("group_ids", ["a", "b"], -600), ("prefer_alloc_in_same_node", True, -600)]
    for field, value, code in cases:
        config = ReplicateConfig()
        setattr(config, field, value)
        name = key(field)
        assert store.put(name, b"x", config) == code, field
        assert store.is_exist(name) == 0
    hard = ReplicateConfig()
    hard.with_hard_pin = True
    hard.preferred_segment = store.get_hostname()
    assert store.put(key("hard"), b"pinned", hard) == 0
    bad_ttl = ReplicateConfig()
    bad_ttl.soft_pin_ttl_ms = 5
    existing = key("existing")
    assert store.put(existing, b"x") == 0
    assert store.put(existing, b"x", bad_ttl) == -600  # the config is checked before the key is looked up
    grouped = ReplicateConfig()
    grouped.group_ids = ["g1", "g2"]
    values = [np.full(8, i, dtype=np.uint8) for i in range(2)]
    assert store.batch_put_from([key("g1"), key("g2")], [v.ctypes.data for v in values], [8, 8], grouped) == [0, 0]


def test_upsert_and_soft_pin_transitions(store):
    name = key("soft-pin")
    enable = ReplicateConfig()
    enable.soft_pin_action = SoftPinAction.ENABLE
    enable.soft_pin_ttl_ms = 1000
    assert store.put(name, b"soft-pin forwarding", enable) == 0
    preserve_with_ttl = ReplicateConfig()
    preserve_with_ttl.soft_pin_ttl_ms = 1000
    assert store.upsert(name, b"refused", preserve_with_ttl) == -600
    disable_with_ttl = ReplicateConfig()
    disable_with_ttl.soft_pin_action = SoftPinAction.DISABLE
    disable_with_ttl.soft_pin_ttl_ms = 1000
    assert store.upsert(name, b"refused", disable_with_ttl) == -600
    assert store.get(name) == b"soft-pin forwarding"  # a refused upsert changes nothing
    assert len(b"same size new bytes") == len(b"soft-pin forwarding")
    assert store.upsert(name, b"same size new bytes") == 0 and store.get(name) == b"same size new bytes"
    assert store.upsert(name, b"replaced") == 0 and store.get(name) == b"replaced"
    disable = ReplicateConfig()
    disable.soft_pin_action = SoftPinAction.DISABLE
    assert store.upsert(name, b"replaced again", disable) == 0 and store.get(name) == b"replaced again"
    fresh = key("upsert-new")
    assert store.upsert(fresh, b"inserted") == 0 and store.get(fresh) == b"inserted"


def test_upsert_variants_replace_what_is_there(store):
    names = [key(f"upsert-{i}") for i in range(3)]
    assert store.put_batch(names, [b"old-0", b"old-1", b"old-2"]) == 0
    assert store.get(names[0]) == b"old-0"  # a read lease: upsert replaces regardless, as in Mooncake
    data = [np.frombuffer(f"new bytes {i}".encode(), dtype=np.uint8).copy() for i in range(3)]
    assert store.upsert_from(names[0], data[0].ctypes.data, data[0].nbytes) == 0
    assert store.batch_upsert_from(names[1:], [d.ctypes.data for d in data[1:]], [d.nbytes for d in data[1:]]) \
        == [0, 0]
    assert store.get_batch(names) == [d.tobytes() for d in data]
    assert store.upsert_parts(names[0], b"a", b"b") == 0 and store.get(names[0]) == b"ab"
    grouped = ReplicateConfig()
    grouped.group_ids = ["a", "", "b"]  # one group per key
    assert store.upsert_batch(names, [b"x", b"yy", b"zzz"], grouped) == 0
    assert store.get_batch(names) == [b"x", b"yy", b"zzz"]
    assert store.batch_upsert_from(names[:2], [data[0].ctypes.data], [1]) == [-600, -600]


# ---- reads ----------------------------------------------------------------------------------------------


def test_batch_get_buffer_returns_buffers_and_none_for_missing_keys(store):
    names = [key("buf-1"), key("buf-2")]
    data = [b"Batch Buffer Data 1! " * 100, b"Batch Buffer Data 2! " * 200]
    assert store.put_batch(names, data) == 0
    buffers = store.batch_get_buffer([names[0], key("missing"), names[1]])
    assert buffers[1] is None
    for buffer, expected in zip((buffers[0], buffers[2]), data):
        assert isinstance(buffer, BufferHandle) and buffer.size() == len(buffer) == len(expected)
        assert bytes(buffer) == expected and bytes(memoryview(buffer)) == expected
        assert np.frombuffer(buffer, dtype=np.uint8).tobytes() == expected
        assert (ctypes.c_char * buffer.size()).from_address(buffer.ptr()).raw == expected
    assert store.batch_get_buffer([]) == []
    assert store.get_buffer(key("missing")) is None and bytes(store.get_buffer(names[0])) == data[0]
    assert store.get_batch([names[1], key("missing")]) == [data[1], b""]


def test_batch_get_into_registered_buffers(store):
    names = [key(f"into-{i}") for i in range(3)]
    data = [b"Hello, Batch World %d! " % i * (100 * (i + 1)) for i in range(3)]
    assert store.put_batch(names, data) == 0
    spacing = 1 << 16
    large = np.zeros(3 * spacing, dtype=np.uint8)
    assert store.register_buffer(large.ctypes.data, large.nbytes) == 0
    ptrs = [large.ctypes.data + i * spacing for i in range(3)]
    assert store.batch_get_into(names, ptrs, [spacing] * 3) == [len(d) for d in data]
    for i, expected in enumerate(data):
        assert large[i * spacing:i * spacing + len(expected)].tobytes() == expected
    assert store.batch_get_into(names[:2], ptrs, [spacing] * 3) == [-600, -600]  # lists of different lengths
    assert store.batch_get_into([], [], []) == []
    assert store.batch_get_into([names[0], key("missing"), names[1]], ptrs, [spacing, spacing, 10]) \
        == [len(data[0]), -704, -600]  # missing; buffer too small
    assert store.unregister_buffer(large.ctypes.data) == 0


def test_get_into_ranges_matches_mooncakes_example_byte_for_byte(store):
    key1, key2 = key("ranges-1"), key("ranges-2")
    data1, data2 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", b"abcdefghijklmnopqrstuvwxyz0123456789"
    assert store.put(key1, data1) == 0 and store.put(key2, data2) == 0
    buffers = [np.full(32, ord("_"), dtype=np.uint8) for _ in range(2)]
    for buffer in buffers:
        assert store.register_buffer(buffer.ctypes.data, 32) == 0
    results = store.get_into_ranges([b.ctypes.data for b in buffers], [[key1, key2], [key2, key1]],
                                    [[[0, 20], [8]], [[4], [16]]], [[[1, 30], [2]], [[0], [10]]],
                                    [[[4, 3], [5]], [[6], [4]]])
    assert results == [[[4, 3], [5]], [[6], [4]]]
    expected0 = bytearray(b"_" * 32)
    expected0[0:4], expected0[8:13], expected0[20:23] = data1[1:5], data2[2:7], data1[30:33]
    expected1 = bytearray(b"_" * 32)
    expected1[4:10], expected1[16:20] = data2[0:6], data1[10:14]
    assert buffers[0].tobytes() == bytes(expected0) and buffers[1].tobytes() == bytes(expected1)


def test_get_into_ranges_fails_entries_not_calls(store):
    key1, key2 = key("frag-1"), key("frag-2")
    data1 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    assert store.put(key1, data1) == 0 and store.put(key2, b"abcdefgh") == 0
    buffer = np.zeros(32, dtype=np.uint8)
    ptr = buffer.ctypes.data
    assert store.register_buffer(ptr, 32) == 0
    # key1's offset and size lists differ in length: its slot fails, key2 (no fragments) answers [], and a key
    # after them is still read
    results = store.get_into_ranges([ptr], [[key1, key2, key2]], [[[0], [], [8]]], [[[0, 1], [], [2]]],
                                    [[[], [], [4]]])
    assert len(results[0][0]) == 1 and results[0][0][0] < 0 and results[0][1] == [] and results[0][2] == [4]
    assert buffer[8:12].tobytes() == b"cdef"
    # fragment by fragment: past the object, past the buffer, a missing key, and the good ones around them
    results = store.get_into_ranges([ptr, ptr], [[key1, key("missing")], [key2]],
                                    [[[0, 4, 31], [0]], [[16]]], [[[len(data1) - 1, 0, 0], [0]], [[0]]],
                                    [[[4, 2, 4], [4]], [[3]]])
    assert results[0][0][0] == -600 and results[0][0][1] == 2 and results[0][0][2] == -600
    assert results[0][1] == [-704] and results[1] == [[3]]
    assert buffer[4:6].tobytes() == b"01" and buffer[16:19].tobytes() == b"abc"
    # lists of different lengths at the top: every entry fails, in Mooncake's shape
    assert store.get_into_ranges([ptr, ptr], [[key1]], [[[0]]], [[[0]]], [[[4]]]) == [[[-600]], [[-600]]]
    # an address nobody registered is read into too (exactly the bytes asked of it)
    free = np.zeros(8, dtype=np.uint8)
    assert store.get_into_ranges([free.ctypes.data], [[key2]], [[[2]]], [[[0]]], [[[6]]]) == [[[6]]]
    assert free.tobytes() == b"\0\0abcdef"


def test_batch_remove_one_code_per_key(store):
    names = [key("rm-1"), key("rm-2")]
    assert store.put_batch(names, [b"1", b"2"]) == 0
    assert store.batch_remove([names[0], key("missing"), names[1]], force=True) == [0, -704, 0]
    assert store.batch_is_exist(names) == [0, 0]
