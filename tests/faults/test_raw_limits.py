"""The raw read channel against strangers: bounded memory and threads, deadlines, refusals that fall back.

Against real ``engram-segment`` processes: a thousand idle or dripping connections leave lookups working and the
segment's memory and threads flat; a full channel answers busy and clients read over ZeroMQ, with refusals
counted and logged at a bounded rate; a read header before the token is refused with its body unread; large
reads leave no buffer behind. Against a server in this process (deadlines shortened through the module's
constants, read when a server is built): a dripping message, a client that does not read its reply, a
connection that never presents its token and an idle one are cut off at their deadlines, clients reconnect
transparently, and reads past the bound on request bytes in flight are answered busy.

Memory is the segment's anonymous resident memory (``RssAnon`` in ``/proc/<pid>/status``): its shared-memory
segment is resident too once read, and is the table itself, not a cost of connections (under the thousand
connections ``VmRSS`` is checked as well, the segment being too small to hide a leak).
"""
from __future__ import annotations

import contextlib
import select
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from engram_store import DistributedStore, EngramStore, EngramStoreConfig, SegmentUnavailable
from engram_store.raw import RawChannel, RawChannelRefused, RawReadServer
from engram_store.raw import limits as _raw
from engram_store.raw.frame import HEADER, MAGIC, OP_HELLO, OP_READ, STATUS_BUSY, TOKEN_BYTES, VERSION
from engram_store.testing import Cluster, wait_ping
from suite_helpers import proc_status

HAS_CURVE = __import__("zmq").has("curve")
SIZES, DIM = [4001, 3001, 2003], 32


def _raw_stats(address: str, auth_dir: str | None = None) -> dict:
    return wait_ping(address, timeout_s=10, unavailable=SegmentUnavailable, auth_dir=auth_dir)["raw_stats"]


def _wait_for(predicate, timeout_s: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.05)


def _keys(tmp_path) -> str:
    directory = str(tmp_path / "keys")
    result = subprocess.run([sys.executable, "-m", "engram_store.master", "keygen", directory], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return directory


def _tables() -> list[np.ndarray]:
    return [np.random.default_rng(h).standard_normal((n, DIM), dtype=np.float32) for h, n in enumerate(SIZES)]


def _check_lookups(store, tables, rounds: int, seed: int) -> None:
    layer = EngramStore(3, EngramStoreConfig(SIZES, DIM), store)
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        ids = np.stack([rng.integers(0, n, (2, 8)) for n in SIZES], axis=-1)  # [B, L, H]
        expected = np.stack([tables[h][ids[..., h]] for h in range(len(SIZES))], axis=-2)
        np.testing.assert_array_equal(layer.lookup(ids), expected)


@contextlib.contextmanager
def _open_files(needed: int):
    """Raise this process's soft open-files limit to ``needed`` (processes it starts inherit it); skip if the
    hard limit is lower."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the hard open-files limit is {hard}; this test holds {needed} descriptors")
    if soft == resource.RLIM_INFINITY or soft >= needed:
        yield
        return
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class _Strangers:
    """``count`` connections to a raw port, half silent, half dripping a header one byte every ``drip_s``; a
    connection the segment closes is opened again, so the pressure lasts until :meth:`stop`. They come from
    ``sources`` loopback addresses (127.0.0.2, ...), each a peer of its own, so that no peer holds more than the
    channel's share of one (``raw.limits.PENDING_PER_PEER``; one peer's flood is tests/security's)."""

    def __init__(self, port: int, count: int, header: bytes, drip_s: float = 0.2, sources: int = 32):
        self.port = port
        self.sources = sources
        self.header = header
        self.drip_s = drip_s
        self.socks: list[socket.socket | None] = [None] * count
        self.sent = [0] * count
        self.reopened = 0
        self._stop = threading.Event()
        for i in range(count):
            self.socks[i] = self._open(i)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self, i: int) -> socket.socket | None:
        try:
            return socket.create_connection(("127.0.0.1", self.port), timeout=5,
                                            source_address=(f"127.0.0.{2 + i % self.sources}", 0))
        except OSError:
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.drip_s):
            for i, sock in enumerate(self.socks):
                if self._stop.is_set():
                    return
                if sock is None or (i % 2 and self.sent[i] >= len(self.header)):
                    continue
                try:
                    if i % 2:
                        sock.send(self.header[self.sent[i]:self.sent[i] + 1])
                        self.sent[i] += 1
                    elif not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                        raise ConnectionError("closed by the segment")
                except BlockingIOError:
                    pass  # open, and quiet
                except OSError:
                    sock.close()
                    self.socks[i], self.sent[i] = self._open(i), 0
                    self.reopened += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the connection holder's thread did not end"
        for sock in self.socks:
            if sock is not None:
                sock.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("auth", [False, True], ids=["plain", "auth"])
def test_a_thousand_idle_and_dripping_connections_leave_lookups_and_memory_alone(tmp_path, auth):
    if auth and not HAS_CURVE:
        pytest.skip("libzmq without CURVE")
    strangers_count = 1000
    auth_dir = _keys(tmp_path) if auth else None
    with _open_files(strangers_count + 1024), \
            Cluster(segments=1, segment_size="32MiB", auth_dir=auth_dir, heartbeat_timeout_s=60.0,
                    segment_extra=["--readers", "0"]) as c:
        segment = c.segments[0]
        tables = _tables()
        with DistributedStore.connect(c.address, auth_dir=auth_dir, local_direct=False) as store:
            EngramStore(3, EngramStoreConfig(SIZES, DIM), store).populate(tables)
            _check_lookups(store, tables, rounds=20, seed=1)  # warm: threads, buffers, kernels
            port = store.raw_routes.ports[segment.address].port
            base_anon, base_rss = proc_status(segment.pid, "RssAnon"), proc_status(segment.pid, "VmRSS")
            # Before --auth a hello is all a stranger may send; without, a read header.
            header = HEADER.pack(MAGIC, VERSION, OP_HELLO if auth else OP_READ, 1, TOKEN_BYTES if auth else 4)
            strangers = _Strangers(port, strangers_count, header)
            try:
                _wait_for(lambda: _raw_stats(segment.address, auth_dir)["connections"] >= strangers_count, 60,
                          "the segment to hold the strangers' connections")
                peak_anon, peak_rss = base_anon, base_rss
                # A client that connects now, and the one connected before, both read rows right.
                with DistributedStore.connect(c.address, auth_dir=auth_dir, local_direct=False) as late:
                    for seed in range(4):
                        _check_lookups(late, tables, rounds=10, seed=10 + seed)
                        _check_lookups(store, tables, rounds=10, seed=20 + seed)
                        peak_anon = max(peak_anon, proc_status(segment.pid, "RssAnon"))
                        peak_rss = max(peak_rss, proc_status(segment.pid, "VmRSS"))
                    stats = _raw_stats(segment.address, auth_dir)
                    threads = proc_status(segment.pid, "Threads")
                    assert late.raw_routes.channels, "the late client read over the raw channel"
            finally:
                strangers.stop()
        assert stats["connections"] >= strangers_count // 2, stats
        assert peak_anon - base_anon < 64 << 10, f"RssAnon grew by {(peak_anon - base_anon) >> 10} MiB"
        # (VmRSS also counts pages of the 32 MiB segment the reads touch, where the prefault had not yet.)
        assert peak_rss - base_rss < 64 << 10, f"VmRSS grew by {(peak_rss - base_rss) >> 10} MiB"
        assert threads < 64, f"{threads} threads for {stats['connections']} connections"


@pytest.mark.timeout(180)
def test_a_full_channel_answers_busy_and_clients_read_over_zeromq():
    with Cluster(segments=1, segment_size="32MiB", heartbeat_timeout_s=60.0,
                 segment_extra=["--readers", "0", "--raw-max-connections", "4"]) as c:
        segment = c.segments[0]
        tables = _tables()
        with DistributedStore.connect(c.address, local_direct=False) as writer:
            EngramStore(3, EngramStoreConfig(SIZES, DIM), writer).populate(tables)
            replica = writer.locate(["engram:l3:h0"])[0].replicas[0]
        port = wait_ping(segment.address, unavailable=SegmentUnavailable)["raw_port"]
        # Four connections that have each completed a read hold every slot (none is a stranger to displace).
        holders = []
        for i in range(4):
            channel = RawChannel(segment.address, "127.0.0.1", port, timeout_s=10)
            deadline = time.monotonic() + 10
            rid = channel.send_read(np.array([[replica.offset, 8]], dtype=np.int64), deadline)
            channel.recv_read(rid, 8, deadline)
            holders.append(channel)
        try:
            _wait_for(lambda: _raw_stats(segment.address)["connections"] == 4, what="four connections")
            with DistributedStore.connect(c.address, local_direct=False) as store:
                _check_lookups(store, tables, rounds=10, seed=3)  # over ZeroMQ: the channel answered busy
                assert segment.address in store.raw_routes.backoff
            for _ in range(40):  # a burst of refusals: counted each, logged at a bounded rate
                with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                    reply = sock.recv(HEADER.size, socket.MSG_WAITALL)
                    assert HEADER.unpack(reply)[2] == STATUS_BUSY
            stats = _raw_stats(segment.address)
            assert stats["refused_full"] >= 41, stats
            logged = segment.output().count("the channel is full")
            assert 1 <= logged <= 3, segment.output()[-3000:]
        finally:
            for channel in holders:
                channel.close()
        # Room again: after its hold-off a client reads over the raw channel once more.
        _wait_for(lambda: _raw_stats(segment.address)["connections"] == 0, what="the holders to be gone")
        with DistributedStore.connect(c.address, local_direct=False) as store:
            _check_lookups(store, tables, rounds=3, seed=4)
            assert store.raw_routes.channels and not store.raw_routes.backoff


@pytest.mark.timeout(180)
@pytest.mark.skipif(not HAS_CURVE, reason="libzmq without CURVE")
def test_a_read_before_the_token_is_refused_with_its_body_unread(tmp_path):
    """A 24-byte header claiming 2^22 ranges (a 64 MiB body) from 16 strangers: each is answered with an
    authentication error and closed at once; the segment buffers nothing."""
    keys = _keys(tmp_path)
    with Cluster(segments=1, segment_size="16MiB", auth_dir=keys, heartbeat_timeout_s=60.0,
                 segment_extra=["--readers", "0"]) as c:
        segment = c.segments[0]
        port = wait_ping(segment.address, unavailable=SegmentUnavailable, auth_dir=keys)["raw_port"]
        base_rss = proc_status(segment.pid, "RssAnon")
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(16)]
        try:
            for sock in socks:
                sock.sendall(HEADER.pack(MAGIC, VERSION, OP_READ, 1, 1 << 22) + b"\0" * 4096)
            for sock in socks:
                head = sock.recv(HEADER.size, socket.MSG_WAITALL)
                assert len(head) == HEADER.size, "no reply: the segment waits for the body"
                status, count = HEADER.unpack(head)[2], HEADER.unpack(head)[4]
                message = sock.recv(count, socket.MSG_WAITALL).decode()
                assert status == 3 and "requires a token first" in message, (status, message)
                with contextlib.suppress(ConnectionResetError):
                    assert sock.recv(1) == b""  # closed
            # A hello whose token is not 32 bytes is refused at its header too.
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(HEADER.pack(MAGIC, VERSION, OP_HELLO, 1, 1 << 22))
                head = sock.recv(HEADER.size, socket.MSG_WAITALL)
                assert HEADER.unpack(head)[2] == 2
            grown = proc_status(segment.pid, "RssAnon") - base_rss
            assert grown < 16 << 10, f"RssAnon grew by {grown >> 10} MiB"
            assert _raw_stats(segment.address, keys)["refused_auth"] >= 16
        finally:
            for sock in socks:
                sock.close()


@pytest.mark.timeout(180)
def test_large_reads_leave_no_buffer_behind():
    """Four connections each read one 64 MiB range and 48 MiB in 4 KiB ranges, then idle: long ranges go out
    straight from the segment, the rest through a serving thread's two 1 MiB pieces, and nothing stays."""
    with Cluster(segments=1, segment_size="96MiB", heartbeat_timeout_s=60.0, segment_extra=["--readers", "0"]) as c:
        segment = c.segments[0]
        port = wait_ping(segment.address, unavailable=SegmentUnavailable)["raw_port"]
        one = np.array([[0, 64 << 20]], dtype=np.int64)
        many = np.stack([np.arange(0, 96 << 20, 8192), np.full(12288, 4096)], axis=1).astype(np.int64)
        out = np.empty(64 << 20, dtype=np.uint8)
        channels = [RawChannel(segment.address, "127.0.0.1", port, timeout_s=60) for _ in range(4)]
        try:
            deadline = time.monotonic() + 120
            channels[0].recv_read(channels[0].send_read(many[:16], deadline), 16 * 4096, deadline)
            base_rss = proc_status(segment.pid, "RssAnon")
            for channel in channels:
                for pairs in (one, many):
                    total = int(pairs[:, 1].sum())
                    channel.recv_read(channel.send_read(pairs, deadline), total, deadline, out[:total])
            grown = proc_status(segment.pid, "RssAnon") - base_rss
            assert grown < 32 << 10, f"RssAnon grew by {grown >> 10} MiB after the reads"
        finally:
            for channel in channels:
                channel.close()


# ---- a server in this process, with short deadlines --------------------------------------------------------


@pytest.fixture
def short(monkeypatch):
    """Deadlines of a second or less for the servers built in the test."""
    for name, value in (("HELLO_TIMEOUT_S", 0.5), ("MESSAGE_TIMEOUT_S", 1.0), ("IDLE_TIMEOUT_S", 0.5),
                        ("SEND_TIMEOUT_S", 1.0), ("STICKY_S", 0.2), ("PARTIAL_MESSAGE_TIMEOUT_S", 1.0)):
        monkeypatch.setattr(_raw, name, value, raising=False)


@pytest.fixture
def server(short):
    segment = np.random.default_rng(5).integers(0, 256, 64 << 20, dtype=np.uint8)
    srv = RawReadServer("127.0.0.1", segment, max_ranges=1 << 22, max_bytes=256 << 20).start()
    try:
        yield srv, segment
    finally:
        srv.close()


def _closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the peer closes ``sock`` within ``timeout_s`` (what it sends meanwhile is read and dropped)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            try:
                if not sock.recv(1 << 20):
                    return True
            except ConnectionResetError:
                return True
    return False


def _read(sock: socket.socket, request_id: int, pairs: list) -> tuple[int, bytes]:
    sock.sendall(HEADER.pack(MAGIC, VERSION, OP_READ, request_id, len(pairs)) +
                 np.array(pairs, dtype=np.int64).tobytes())
    head = sock.recv(HEADER.size, socket.MSG_WAITALL)
    _, _, status, rid, count = HEADER.unpack(head)
    assert rid == request_id
    return status, sock.recv(count, socket.MSG_WAITALL) if count else b""


@pytest.mark.timeout(60)
def test_a_message_dripped_byte_by_byte_is_cut_off_at_its_deadline(server):
    srv, segment = server
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        assert _read(sock, 1, [[0, 16]]) == (0, segment[:16].tobytes())
        header = HEADER.pack(MAGIC, VERSION, OP_READ, 2, 1)
        start = time.monotonic()
        closed = False
        for byte in header:  # one byte every 0.25 s: each receive is quick, the message takes 6 s
            try:
                sock.send(bytes([byte]))
            except OSError:
                closed = True
                break
            if _closed_by_peer(sock, 0.25):
                closed = True
                break
        assert closed, "the segment still waits for the header after 6 s"
        assert time.monotonic() - start < 1.0 + 2.0


@pytest.mark.timeout(60)
def test_a_client_that_does_not_read_its_reply_loses_the_connection(server):
    srv, segment = server
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        total = 48 << 20
        sock.sendall(HEADER.pack(MAGIC, VERSION, OP_READ, 1, 2) +
                     np.array([[0, total // 2], [total // 2, total // 2]], dtype=np.int64).tobytes())
        _wait_for(lambda: srv.stats()["timeout_send"] >= 1, 30, "the send deadline")
        received = 0
        while True:  # what was in flight, then the end of the connection
            try:
                chunk = sock.recv(1 << 20)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += len(chunk)
        assert received < HEADER.size + total
        assert srv.stats()["serving"] == 0


@pytest.mark.timeout(60)
def test_a_connection_without_its_token_is_closed_after_the_hello_deadline(short):
    segment = np.zeros(1 << 20, dtype=np.uint8)
    srv = RawReadServer("127.0.0.1", segment, max_ranges=1024, max_bytes=1 << 20, require_token=True).start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as silent, \
                socket.create_connection(("127.0.0.1", srv.port), timeout=10) as partial:
            partial.sendall(HEADER.pack(MAGIC, VERSION, OP_HELLO, 0, TOKEN_BYTES)[:10])
            assert _closed_by_peer(silent, 5.0) and _closed_by_peer(partial, 5.0)
        # With a token the channel serves.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(HEADER.pack(MAGIC, VERSION, OP_HELLO, 0, TOKEN_BYTES) + bytes.fromhex(srv.issue_token()))
            assert HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))[2] == 0
            assert _read(sock, 1, [[0, 8]]) == (0, bytes(8))
        assert srv.stats()["timeout_hello"] >= 2
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_idle_connections_are_closed_and_clients_reconnect_transparently(short):
    with DistributedStore.embedded(segment_size="16MiB", local_direct=False) as store:
        raw = store.local_segment.raw
        payload = np.random.default_rng(2).integers(0, 256, 1 << 16, dtype=np.uint8)
        store.put("idle", payload)
        for _ in range(3):
            assert store.get("idle") == payload.tobytes()
            before = raw.stats()["timeout_idle"]
            _wait_for(lambda: raw.stats()["timeout_idle"] > before, 20, "the idle connection to be closed")
        assert not store.raw_routes.backoff and store.raw_routes.channels  # every read went over the raw channel
        assert raw.stats()["connections"] <= 1


@pytest.mark.timeout(60)
def test_reads_past_the_bound_on_bytes_in_flight_are_answered_busy(monkeypatch, short):
    monkeypatch.setattr(_raw, "BODY_BYTES_IN_FLIGHT", 1 << 20)
    for name in ("HELLO_TIMEOUT_S", "MESSAGE_TIMEOUT_S"):  # a first request of 2 MiB may take a while to arrive
        monkeypatch.setattr(_raw, name, 30.0)                 # on a loaded machine
    monkeypatch.setattr(_raw, "REQUEST_KEEP_BYTES", 64 << 10)
    segment = np.random.default_rng(9).integers(0, 256, 4 << 20, dtype=np.uint8)
    srv = RawReadServer("127.0.0.1", segment, max_ranges=1 << 22, max_bytes=256 << 20).start()
    try:
        big = np.stack([np.arange(1 << 17), np.ones(1 << 17)], axis=1).astype(np.int64)  # 2 MiB of ranges
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            status, message = _read(sock, 1, big)
            assert status == STATUS_BUSY and b"busy" in message
            assert _read(sock, 2, [[8, 8]]) == (0, segment[8:16].tobytes())  # the connection goes on
        channel = RawChannel("segment", "127.0.0.1", srv.port)
        deadline = time.monotonic() + 10
        with pytest.raises(RawChannelRefused) as refused:
            channel.recv_read(channel.send_read(big, deadline), 1 << 17, deadline)
        assert refused.value.busy
        assert srv.stats()["busy"] == 2
        # (an answered request's bytes are let go once its reply is out, which the client may see first)
        _wait_for(lambda: srv.stats()["body_bytes_in_flight"] == 0, 10, "the answered requests' bytes to be let go")
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_a_connection_whose_first_request_was_answered_busy_is_not_cut_at_the_hellos_deadline(monkeypatch, short):
    """The deadline of a new connection's first request is met by a request answered busy: the connection goes on
    past it (it was cut there, as if it had sent nothing)."""
    monkeypatch.setattr(_raw, "BODY_BYTES_IN_FLIGHT", 1 << 10)
    monkeypatch.setattr(_raw, "REQUEST_KEEP_BYTES", 1 << 10)
    monkeypatch.setattr(_raw, "IDLE_TIMEOUT_S", 30.0)
    segment = np.random.default_rng(4).integers(0, 256, 1 << 20, dtype=np.uint8)
    srv = RawReadServer("127.0.0.1", segment, max_ranges=1 << 16, max_bytes=1 << 20).start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            status, _ = _read(sock, 1, [[i, 1] for i in range(256)])  # 4 KiB of ranges: more than may be in flight
            assert status == STATUS_BUSY
            time.sleep(2 * _raw.HELLO_TIMEOUT_S)  # past the deadline of a first request
            assert _read(sock, 2, [[8, 8]]) == (0, segment[8:16].tobytes())
        assert srv.stats().get("timeout_hello", 0) == 0
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_a_lookup_answered_busy_is_read_over_zeromq(monkeypatch, short):
    monkeypatch.setattr(_raw, "BODY_BYTES_IN_FLIGHT", 1 << 20)
    for name in ("HELLO_TIMEOUT_S", "MESSAGE_TIMEOUT_S"):  # a first request of 1.25 MiB may take a while to arrive
        monkeypatch.setattr(_raw, name, 30.0)                 # on a loaded machine
    monkeypatch.setattr(_raw, "REQUEST_KEEP_BYTES", 64 << 10)
    with DistributedStore.embedded(segment_size="64MiB", local_direct=False) as store:
        sizes = [70_001, 70_003]
        tables = [np.random.default_rng(h).standard_normal((n, 4), dtype=np.float32) for h, n in enumerate(sizes)]
        layer = EngramStore(7, EngramStoreConfig(sizes, 4), store)
        layer.populate(tables)
        ids = np.stack([np.random.default_rng(h).integers(0, n, (1, 40_000)) for h, n in enumerate(sizes)], -1)
        expected = np.stack([tables[h][ids[..., h]] for h in range(2)], axis=-2)
        np.testing.assert_array_equal(layer.lookup(ids), expected)  # 80,000 ranges: 1.25 MiB, answered busy
        assert store.local_segment.raw.stats()["busy"] >= 1
        assert store.raw_routes.backoff  # the endpoint read over ZeroMQ for a while


@pytest.mark.timeout(60)
def test_reads_sent_ahead_survive_an_idle_close_and_a_busy_answer(monkeypatch, short):
    """Several reads to one segment go out on one connection before the first reply is received: after the
    segment closed that connection while idle they are all sent again; when one is answered busy, it and those
    sent after it are read over ZeroMQ."""
    monkeypatch.setattr(_raw, "BODY_BYTES_IN_FLIGHT", 1 << 20)
    monkeypatch.setattr(_raw, "REQUEST_KEEP_BYTES", 64 << 10)
    with DistributedStore.embedded(segment_size="16MiB", local_direct=False, raw_reads=True) as store:
        raw = store.local_segment.raw
        payload = np.random.default_rng(6).integers(0, 256, 4 << 20, dtype=np.uint8)
        store.put("ahead", payload)
        replica = store.locate(["ahead"])[0].replicas[0]
        endpoint = store.pick_endpoint(store.read_endpoints(replica))
        small = [np.array([[replica.offset + 1000 * i, 100 + i]], dtype=np.int64) for i in range(4)]
        expected = [payload[1000 * i:1000 * i + 100 + i].tobytes() for i in range(4)]
        assert [bytes(r) for r in store.read_pairs_many([(endpoint, p) for p in small])] == expected
        before = raw.stats()["timeout_idle"]
        _wait_for(lambda: raw.stats()["timeout_idle"] > before, 20, "the idle connection to be closed")
        assert [bytes(r) for r in store.read_pairs_many([(endpoint, p) for p in small])] == expected
        assert not store.raw_routes.backoff
        # The second read carries 2 MiB of ranges: answered busy; it and the two after it go over ZeroMQ.
        big = np.stack([replica.offset + np.arange(1 << 17) * 16, np.full(1 << 17, 16)], axis=1).astype(np.int64)
        big_expected = payload[:(1 << 17) * 16].tobytes()
        replies = store.read_pairs_many([(endpoint, small[0]), (endpoint, big), (endpoint, small[1]),
                                         (endpoint, small[2])])
        assert [bytes(r) for r in replies] == [expected[0], big_expected, expected[1], expected[2]]
        assert raw.stats()["busy"] >= 1 and store.raw_routes.backoff
