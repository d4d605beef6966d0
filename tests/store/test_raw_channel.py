"""The raw read channel (``engram_store.raw``: ``_server``, ``_client``): range reads over plain TCP next to ZeroMQ.

Reads through it equal NumPy slicing; hostile bytes get error replies (and a connection whose framing is lost
is closed) while the segment keeps serving; a header of another version is refused naming both versions; with
CURVE keys a connection needs a one-time token from the ZeroMQ socket; a killed segment makes reads fail over or
raise SegmentUnavailable at once; clients built with ``raw_reads=False`` (or segments with ``--no-raw-reads``)
read over ZeroMQ with the same results.
"""
from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from suite_helpers import run_threads
from engram_store import (AuthError, DistributedStore, EngramStore, EngramStoreConfig, InvalidArgument,
                          ProtocolError, SegmentUnavailable)
from engram_store.raw import RawChannel, port_of
from engram_store.raw.frame import HEADER, MAGIC, OP_HELLO, OP_READ, VERSION
from engram_store.testing import Cluster

pytestmark = pytest.mark.timeout(240)

SEGMENT_BYTES = 8 << 20


@pytest.fixture(scope="module")
def cluster():
    with Cluster(segments=1, segment_size=str(SEGMENT_BYTES), heartbeat_timeout_s=10.0) as c:
        yield c


@pytest.fixture(scope="module")
def filled(cluster):
    """A client that reads over the raw channel, and a 1 MiB object of known bytes at a known offset."""
    payload = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    with DistributedStore.connect(cluster.address, local_direct=False) as store:
        store.put("raw-object", payload)
        replica = store.locate(["raw-object"])[0].replicas[0]
        yield store, payload, replica


def _raw_port(store, address):
    store._raw_channel(address)  # learns the port with a ping
    return store.raw_routes.ports[address].port


def _request(sock, op, request_id, count, body=b""):
    sock.sendall(HEADER.pack(MAGIC, VERSION, op, request_id, count) + body)


def _reply(sock):
    head = b""
    while len(head) < HEADER.size:
        chunk = sock.recv(HEADER.size - len(head))
        if not chunk:
            return None
        head += chunk
    magic, version, status, rid, count = HEADER.unpack(head)
    body = b""
    while len(body) < count:
        chunk = sock.recv(count - len(body))
        if not chunk:
            break
        body += chunk
    return status, rid, body


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, (1 << 20) - 1), st.integers(0, 5000)), min_size=1, max_size=30))
def test_raw_reads_equal_numpy_slicing(filled, ranges):
    store, payload, replica = filled
    pairs = np.array([[replica.offset + o, min(n, (1 << 20) - o)] for o, n in ranges], dtype=np.int64)
    expected = b"".join(payload[o - replica.offset:o - replica.offset + n].tobytes() for o, n in pairs)
    got = store.read_pairs(replica.address, pairs, len(expected))
    assert bytes(got) == expected
    # The ZeroMQ path answers the same request the same way.
    zmq_reply = store.read_pairs_many([(replica.address, pairs)])[0]
    assert bytes(zmq_reply) == expected


@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(st.integers(0, (3 << 20) - 1), st.integers(0, 3 << 20)), min_size=0, max_size=12))
def test_large_replies_stream_in_pieces_and_equal_numpy_slicing(filled, ranges):
    """Past 4 MiB the segment sends its reply in pieces of about 1 MiB, cut at range boundaries (a range larger
    than a piece goes alone); the bytes are those of one reply."""
    store, _, _ = filled
    big = np.random.default_rng(7).integers(0, 256, 3 << 20, dtype=np.uint8)
    if not store.is_exist("raw-big"):
        store.put("raw-big", big)  # once for all examples (a removed object's space is reused only later)
    replica = store.locate(["raw-big"])[0].replicas[0]
    spans = [(o, min(n, (3 << 20) - o)) for o, n in ranges] + [(0, 3 << 20), (5, (3 << 20) - 5)]
    pairs = np.array([[replica.offset + o, n] for o, n in spans], dtype=np.int64)
    expected = b"".join(big[o:o + n].tobytes() for o, n in spans)
    assert len(expected) > 4 << 20
    assert bytes(store.read_pairs(replica.address, pairs, len(expected))) == expected
    out = np.empty(len(expected), dtype=np.uint8)
    assert store.read_pairs(replica.address, pairs, len(expected), out=out) is out
    assert out.tobytes() == expected


def test_hostile_bytes_get_error_replies_and_the_segment_keeps_serving(filled, cluster):
    store, payload, replica = filled
    port = _raw_port(store, replica.address)
    bad_requests = [
        # (what is sent, expected status, whether the connection survives)
        (lambda s: _request(s, OP_READ, 1, 1, struct.pack("<qq", SEGMENT_BYTES - 4, 8)), 1, True),  # past the end
        (lambda s: _request(s, OP_READ, 2, 1, struct.pack("<qq", 0, -1)), 1, True),  # negative length
        (lambda s: _request(s, OP_READ, 3, 1, struct.pack("<qq", -8, 8)), 1, True),  # negative offset
        (lambda s: _request(s, OP_READ, 4, 1 << 40), 1, False),  # an absurd range count: framing is lost
        (lambda s: _request(s, 99, 5, 0), 2, False),  # unknown op
        (lambda s: s.sendall(b"GARBAGE!" * 3), 2, False),  # wrong magic
        (lambda s: _request(s, OP_HELLO, 6, 4096), 2, False),  # a token of the wrong size
    ]
    for send, status, survives in bad_requests:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            send(sock)
            reply = _reply(sock)
            assert reply is not None and reply[0] == status, reply
            assert reply[2], "an error reply names what was wrong"
            if survives:  # the same connection still serves a good read
                _request(sock, OP_READ, 7, 1, struct.pack("<qq", replica.offset, 16))
                ok = _reply(sock)
                assert ok[0] == 0 and ok[1] == 7 and ok[2] == payload[:16].tobytes()
            else:
                assert _reply(sock) is None  # closed
    # A peer that vanishes in the middle of a message leaves the segment unharmed.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(HEADER.pack(MAGIC, VERSION, OP_READ, 8, 4)[:10])
    assert bytes(store.read_pairs(replica.address, np.array([[replica.offset, 64]]), 64)) == payload[:64].tobytes()
    assert store.get("raw-object") == payload.tobytes()


def test_a_header_of_another_version_is_refused_naming_both_versions(filled):
    store, payload, replica = filled
    port = _raw_port(store, replica.address)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(HEADER.pack(MAGIC, 1, OP_READ, 3, 1) + struct.pack("<qq", replica.offset, 8))
        status, rid, message = _reply(sock)
        assert status == 2 and rid == 3
        assert f"speaks version {VERSION}, the request is version 1".encode() in message
        with contextlib.suppress(ConnectionResetError):  # reset: the segment closed with the ranges unread
            assert _reply(sock) is None  # closed


def test_a_client_fails_clearly_against_a_server_of_another_version():
    """A server answering with another version's header: the client names both versions; a segment whose ping
    names another version (or none: version 1) is read over ZeroMQ."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        conn, _ = listener.accept()
        with conn:
            conn.recv(1 << 16)
            conn.sendall(HEADER.pack(MAGIC, VERSION + 1, 0, 1, 0))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        channel = RawChannel("segment-x", "127.0.0.1", port)
        deadline = time.monotonic() + 10
        with pytest.raises(ProtocolError, match=f"version {VERSION + 1}, this client version {VERSION}"):
            channel.recv_read(channel.send_read(np.array([[0, 8]], dtype=np.int64), deadline), 8, deadline)
    finally:
        thread.join(timeout=10)
        listener.close()
    assert not thread.is_alive(), "the fake segment's thread did not end"
    assert port_of("h:1", {"raw_port": 5, "raw_version": VERSION}) == ("h", 5, False)
    assert port_of("h:1", {"raw_port": 5, "raw_version": VERSION + 1}) is None
    assert port_of("h:1", {"raw_port": 5}) is None


def test_reads_sent_ahead_are_answered_in_order(filled):
    """A client may send several reads before it receives: on a new connection (whose first read the event loop
    hands over) and on one a serving thread waits on, in one send or a byte at a time."""
    store, payload, replica = filled
    port = _raw_port(store, replica.address)
    rng = np.random.default_rng(4)
    spans = [(int(o), int(n)) for o, n in zip(rng.integers(0, 1 << 19, 12), rng.integers(1, 5000, 12))]
    messages = [HEADER.pack(MAGIC, VERSION, OP_READ, 10 + i, 1) + struct.pack("<qq", replica.offset + o, n)
                for i, (o, n) in enumerate(spans)]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"".join(messages[:4]))  # a new connection
        sock.sendall(b"".join(messages[4:8]))
        for byte in b"".join(messages[8:]):  # a byte at a time
            sock.sendall(bytes([byte]))
        for i, (o, n) in enumerate(spans):
            assert _reply(sock) == (0, 10 + i, payload[o:o + n].tobytes())
    # The client sends every read to one segment before it receives the first.
    requests = [(replica.address, np.array([[replica.offset + o, n]], dtype=np.int64)) for o, n in spans]
    replies = store.read_pairs_many(requests)
    assert [bytes(r) for r in replies] == [payload[o:o + n].tobytes() for o, n in spans]


def test_client_errors_name_the_problem(filled):
    store, payload, replica = filled
    with pytest.raises(InvalidArgument, match="outside the segment"):
        store.read_pairs(replica.address, np.array([[SEGMENT_BYTES, 1]], dtype=np.int64), 1)
    # The channel reconnects after an error and serves again.
    assert bytes(store.read_pairs(replica.address, np.array([[replica.offset, 8]]), 8)) == payload[:8].tobytes()


def test_many_threads_read_at_once(filled):
    store, payload, replica = filled

    def reader(seed):
        rng = np.random.default_rng(seed)
        for _ in range(200):
            o = int(rng.integers(0, (1 << 20) - 4096))
            n = int(rng.integers(1, 4096))
            got = store.read_pairs(replica.address, np.array([[replica.offset + o, n]]), n)
            assert bytes(got) == payload[o:o + n].tobytes()

    run_threads(reader, 6, 120, "a reader thread")


def test_lookups_agree_over_raw_and_zeromq_and_with_raw_reads_off(cluster):
    sizes, dim = [1000, 777, 31], 16
    tables = [np.random.default_rng(h).standard_normal((n, dim), dtype=np.float32) for h, n in enumerate(sizes)]
    ids = np.stack([np.random.default_rng(9).integers(0, n, (3, 5)) for n in sizes], axis=-1)
    expected = np.stack([tables[h][ids[..., h]] for h in range(3)], axis=-2)
    with DistributedStore.connect(cluster.address, local_direct=False) as raw, \
            DistributedStore.connect(cluster.address, local_direct=False, raw_reads=False) as plain:
        layer = EngramStore(801, EngramStoreConfig(sizes, dim), raw)
        layer.populate(tables)
        try:
            assert np.array_equal(layer.lookup(ids), expected)
            assert np.array_equal(EngramStore(801, EngramStoreConfig(sizes, dim), plain).lookup(ids), expected)
            assert raw.raw_routes.ports and not plain.raw_routes.ports  # one learnt the raw port, the other never asked
        finally:
            layer.remove_from_store(force=True)


def test_a_segment_without_the_raw_channel_is_read_over_zeromq():
    with Cluster(segments=0, heartbeat_timeout_s=10.0) as c:
        c.add_segment("16MiB", extra=["--no-raw-reads"])
        with DistributedStore.connect(c.address, local_direct=False) as store:
            store.put("k", b"x" * 1000)
            assert store.get("k") == b"x" * 1000
            assert list(store.raw_routes.ports.values()) == [None]


def test_killed_segment_fails_reads_at_once_and_a_replica_takes_over():
    with Cluster(segments=2, segment_size="16MiB", heartbeat_timeout_s=30.0) as c:
        with DistributedStore.connect(c.address, local_direct=False, timeout_ms=20_000) as store:
            payload = bytes(range(256)) * 64
            store.put("both", payload, replica_num=2)
            store.put("one", payload)
            assert store.get("both") == payload and store.get("one") == payload
            holder = store.locate(["one"])[0].replicas[0].address
            victim = next(s for s in c.segments if s.address == holder)
            victim.kill()
            start = time.monotonic()
            assert store.get("both") == payload  # the other replica answers
            with pytest.raises(SegmentUnavailable):
                store.get("one")
            # A dead raw port is refused at once: no waiting for the 20 s timeout.
            assert time.monotonic() - start < 10


def test_a_hung_segment_does_not_hold_up_reads_of_a_healthy_one(monkeypatch):
    """After a read from a hung segment times out, the ping that looks for it again runs after the healthy
    server's read is sent; once that ping goes unanswered, reads to it fail at once for DEAD_HOLD_S; when it
    runs again it is found again."""
    import signal

    from engram_store.raw import _routes  # its hold is patched
    with Cluster(segments=2, segment_size="16MiB", heartbeat_timeout_s=30.0) as c:
        with DistributedStore.connect(c.address, local_direct=False, timeout_ms=3000) as store:
            payload = np.arange(1 << 12, dtype=np.uint8)
            store.put("a", payload, replica_num=2)
            hung, healthy = (s.address for s in c.segments)
            offsets = {r.address: r.offset for r in store.locate(["a"])[0].replicas}
            reqs = [(hung, np.array([[offsets[hung], 64]], dtype=np.int64)),
                    (healthy, np.array([[offsets[healthy], 64]], dtype=np.int64))]
            assert [bytes(r) for r in store.read_pairs_many(reqs)] == [payload[:64].tobytes()] * 2
            monkeypatch.setattr(_routes, "DEAD_HOLD_S", 600.0)  # a stalled test machine does not end the hold
            c.segments[0].signal(signal.SIGSTOP)
            try:
                first = store.read_pairs_many(reqs)  # times out on the hung one: it becomes suspect
                assert isinstance(first[0], SegmentUnavailable) and bytes(first[1]) == payload[:64].tobytes(), first
                second = store.read_pairs_many(reqs)  # the ping goes unanswered; the healthy read still lands
                assert isinstance(second[0], SegmentUnavailable) and bytes(second[1]) == payload[:64].tobytes(), second
                start = time.monotonic()
                third = store.read_pairs_many(reqs)
                assert time.monotonic() - start < 1.5  # refused at once, not after another timeout (3 s)
                assert "did not answer a ping" in str(third[0]) and bytes(third[1]) == payload[:64].tobytes()
            finally:
                c.segments[0].signal(signal.SIGCONT)
            monkeypatch.setattr(_routes, "DEAD_HOLD_S", 0.0)
            assert [bytes(r) for r in store.read_pairs_many(reqs)] == [payload[:64].tobytes()] * 2


@pytest.mark.skipif(not __import__("zmq").has("curve"), reason="libzmq without CURVE")
def test_with_auth_a_connection_needs_a_token_from_the_zeromq_socket(tmp_path):
    keys = str(tmp_path / "keys")
    result = subprocess.run([sys.executable, "-m", "engram_store.master", "keygen", keys], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    with Cluster(segments=1, auth_dir=keys, heartbeat_timeout_s=10.0) as c:
        with DistributedStore.connect(c.address, local_direct=False, auth_dir=keys) as store:
            store.put("secret", b"s" * 4096)
            assert store.get("secret") == b"s" * 4096  # over the raw channel, with a token
            address = store.locate(["secret"])[0].replicas[0].address
            host, port, needs_token = store.raw_routes.ports[address]
            assert needs_token
            offset = store.locate(["secret"])[0].replicas[0].offset
            # Without a token, or with a made-up one, the segment refuses and closes.
            with socket.create_connection((host, port), timeout=10) as sock:
                _request(sock, OP_READ, 1, 1, struct.pack("<qq", offset, 16))
                assert _reply(sock)[0] == 3
            with socket.create_connection((host, port), timeout=10) as sock:
                _request(sock, OP_HELLO, 1, 32, b"\0" * 32)
                assert _reply(sock)[0] == 3
            forged = RawChannel(address, host, port, token_source=lambda: "00" * 32)
            with pytest.raises(AuthError, match="unknown or expired token"):
                forged.send_read(np.array([[offset, 16]], dtype=np.int64), time.monotonic() + 10)
            # A token is good for one connection only.
            token = store._segment_conn(address).call("channel_token")[0]["token"]
            for attempt in range(2):
                with socket.create_connection((host, port), timeout=10) as sock:
                    _request(sock, OP_HELLO, 1, 32, bytes.fromhex(token))
                    assert _reply(sock)[0] == (0 if attempt == 0 else 3)


def test_protocol_error_for_a_reply_of_the_wrong_size(filled):
    store, payload, replica = filled
    with pytest.raises(ProtocolError, match="expected 9"):
        store.read_pairs(replica.address, np.array([[replica.offset, 8]]), 9)
