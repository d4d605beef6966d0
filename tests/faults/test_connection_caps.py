"""Caps and deadlines on every listening socket, against servers in this process (bounds shortened through their
modules' constants, read when a server is built): a ZeroMQ server cuts handshakes at their deadline, drops a peer
that falls silent, and holds each peer to its share of unproven and of all connections; a metrics page serves every
connection from one thread, within a peer's share and a request deadline, answering what it does not serve with its
status; the raw read channel holds each peer to its share; peers are told apart by address and, on this host, by
user. One user's floods as another user are tests/security's (test_floods.py); the raw read channel's deadlines
and other bounds are test_raw_limits.py's.
"""
from __future__ import annotations

import os
import select
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_store import _http, _peers
from engram_store.metrics import MetricsEndpoint
from engram_store.raw import RawReadServer
from engram_store.raw import limits as _raw
from engram_store.raw.frame import HEADER, MAGIC, OP_READ, STATUS_BUSY, VERSION
from engram_store.wire import Connection, RpcServer
from engram_store.wire import _guard
from suite_helpers import ZMTP_GREETING, ZMTP_READY

pytestmark = pytest.mark.timeout(60)


def _closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the peer closes ``sock`` within ``timeout_s`` (what it sends meanwhile is read and dropped)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if select.select([sock], [], [], left)[0]:
            try:
                if not sock.recv(4096):
                    return True
            except (ConnectionResetError, BrokenPipeError):
                return True
    return False


def _wait_for(predicate, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        time.sleep(0.02)


@pytest.fixture
def rpc():
    """A ZeroMQ server answering ``ping``, built by the test after it set the bounds."""
    servers = []

    def make() -> RpcServer:
        server = RpcServer("127.0.0.1", 0, "caps", {"ping": lambda req: {"pong": True}}).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


def _ping(address: str) -> None:
    conn = Connection(address)
    try:
        assert conn.call("ping", timeout_ms=5000)[0]["pong"] is True
    finally:
        conn.close()


def _handshaken(port: int) -> socket.socket:
    """A connection that completed a ZeroMQ handshake (NULL mechanism) and then says nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(ZMTP_GREETING + ZMTP_READY)
    sock.recv(64, socket.MSG_WAITALL)  # the server's greeting (its READY follows), or less where it closes at once
    return sock


def test_a_connection_that_never_completes_its_handshake_is_closed_at_the_deadline(monkeypatch, rpc):
    monkeypatch.setattr(_guard, "HANDSHAKE_MS", 300)
    server = rpc()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as silent:
        began = time.monotonic()
        assert _closed_by_peer(silent, 5.0), "libzmq's default handshake interval is 30 s"
        assert time.monotonic() - began < 3.0
    _ping(server.address)


def test_a_peer_silent_after_its_handshake_is_dropped_by_heartbeats(monkeypatch, rpc):
    monkeypatch.setattr(_guard, "HEARTBEAT_IVL_MS", 100)
    monkeypatch.setattr(_guard, "HEARTBEAT_TIMEOUT_MS", 400)
    server = rpc()
    with _handshaken(server.port) as quiet:
        assert _closed_by_peer(quiet, 5.0), "a peer that answers no ping keeps its connection"
    _ping(server.address)  # a libzmq client answers pings by itself


def test_a_peer_past_its_share_of_unproven_connections_loses_its_oldest(monkeypatch, rpc):
    monkeypatch.setattr(_guard, "UNPROVEN_PER_PEER", 4)
    server = rpc()
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(10)]
    try:
        assert all(_closed_by_peer(sock, 5.0) for sock in socks[:6])
        assert not any(_closed_by_peer(sock, 0.3) for sock in socks[6:])
        _ping(server.address)  # the same peer's client: it completes its handshake before four more come
        assert server.connection_stats()["closed_unproven"] >= 6
    finally:
        for sock in socks:
            sock.close()


def test_a_peer_past_its_share_of_connections_loses_the_new_one(monkeypatch, rpc):
    monkeypatch.setattr(_guard, "UNPROVEN_PER_PEER", 2)
    monkeypatch.setattr(_guard, "CONNECTIONS_PER_PEER", 3)
    monkeypatch.setattr(_guard, "HANDSHAKE_MS", 200)  # proven (alive past it) quickly
    server = rpc()
    held = []
    try:
        for _ in range(3):
            held.append(_handshaken(server.port))
            time.sleep(0.3)
        _wait_for(lambda: server.connection_stats()["connections"] == 3, what="three connections")
        with _handshaken(server.port) as fourth:
            assert _closed_by_peer(fourth, 5.0)
        assert not any(_closed_by_peer(sock, 0.3) for sock in held)
        assert server.connection_stats()["closed_over_peer_cap"] >= 1
    finally:
        for sock in held:
            sock.close()


def test_a_closed_server_stops_its_guard_and_gives_back_its_connections(rpc):
    held = _peers.LEDGER.held
    server = rpc()
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(5)]
    try:
        _wait_for(lambda: _peers.LEDGER.held >= held + 5, what="the guard to count the connections")
        server.close()
        assert all(_closed_by_peer(sock, 5.0) for sock in socks)
        assert _peers.LEDGER.held == held
        assert not [t for t in threading.enumerate() if t.name == "engram-caps-guard"]
    finally:
        for sock in socks:
            sock.close()


# ---- the metrics page ------------------------------------------------------------------------------------------


@pytest.fixture
def page():
    endpoint = MetricsEndpoint("127.0.0.1", 0)
    endpoint.publish(["# TYPE up gauge", "up 1"])
    try:
        yield endpoint
    finally:
        endpoint.close()


def _get(port: int, path: str = "/metrics", method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_a_metrics_page_serves_every_connection_from_one_thread(page):
    threads = set(threading.enumerate())  # (another test's threads may end meanwhile)
    socks = [socket.create_connection(("127.0.0.1", page.port), timeout=5) for _ in range(20)]
    try:
        assert _get(page.port) == (200, b"# TYPE up gauge\nup 1\n")
        assert not set(threading.enumerate()) - threads, "a thread per connection"
    finally:
        for sock in socks:
            sock.close()


def test_a_metrics_page_answers_what_it_does_not_serve_with_its_status(page):
    assert _get(page.port, "/other")[0] == 404
    assert _get(page.port, method="POST")[0] == 405
    status, body = _get(page.port, method="HEAD")
    assert status == 200 and body == b""
    with socket.create_connection(("127.0.0.1", page.port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * _http.MAX_REQUEST_BYTES)
        assert sock.recv(64).startswith(b"HTTP/1.1 431")
    with socket.create_connection(("127.0.0.1", page.port), timeout=5) as sock:
        sock.sendall(b"nonsense\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.1 400")
    assert _get(page.port)[0] == 200


def test_a_metrics_page_holds_a_peer_to_its_share_and_requests_to_their_deadline(monkeypatch):
    monkeypatch.setattr(_http, "PER_PEER", 3)
    monkeypatch.setattr(_http, "REQUEST_TIMEOUT_S", 0.5)
    with MetricsEndpoint("127.0.0.1", 0) as endpoint:
        socks = [socket.create_connection(("127.0.0.1", endpoint.port), timeout=5) for _ in range(5)]
        try:
            assert all(_closed_by_peer(sock, 3.0) for sock in socks[:2])  # the oldest two, at once
            began = time.monotonic()
            assert all(_closed_by_peer(sock, 3.0) for sock in socks[2:])  # the rest at their deadline
            assert time.monotonic() - began < 2.5
            assert _get(endpoint.port)[0] == 200
        finally:
            for sock in socks:
                sock.close()


def test_a_full_metrics_page_closes_the_oldest_of_the_peer_holding_most(monkeypatch):
    monkeypatch.setattr(_http, "MAX_CONNECTIONS", 4)
    with MetricsEndpoint("127.0.0.1", 0) as endpoint:
        crowd = [socket.create_connection(("127.0.0.1", endpoint.port), timeout=5,
                                          source_address=("127.0.0.2", 0)) for _ in range(3)]
        other = socket.create_connection(("127.0.0.1", endpoint.port), timeout=5, source_address=("127.0.0.3", 0))
        try:
            time.sleep(0.2)
            newcomer = socket.create_connection(("127.0.0.1", endpoint.port), timeout=5,
                                                source_address=("127.0.0.4", 0))
            with newcomer:
                assert _closed_by_peer(crowd[0], 3.0)
                assert not _closed_by_peer(other, 0.3) and not _closed_by_peer(newcomer, 0.1)
                newcomer.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
                assert newcomer.recv(64).startswith(b"HTTP/1.1 200")
        finally:
            for sock in crowd + [other]:
                sock.close()


def test_a_refused_handshake_is_logged_though_its_connection_closed_before_the_guard_named_it(monkeypatch, caplog):
    """A refused handshake is quick and a loaded host slow: the connection may be closed before the guard's thread
    reads its accept event, so the guard never names it; the refusal is still logged, without the peer."""
    import logging

    import zmq

    monkeypatch.setattr(_guard, "REFUSALS", _peers.RefusalLog())  # (no earlier refusal of this test's suppresses it)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    guard = _guard.ConnectionGuard(sock, "a test server", log_handshakes=True)  # events handed over by hand
    try:
        with caplog.at_level(logging.WARNING, logger=_peers.__name__):
            guard._handshake_failed(0)
            guard._disconnected(1 << 20)  # a descriptor the guard never saw accepted
        assert "a test server: refused a connection from an unknown peer: the handshake did not complete" \
            in caplog.text, caplog.text
    finally:
        guard.close(sock)
        sock.close(0)


# ---- peers ---------------------------------------------------------------------------------------------------


def test_a_local_peer_is_named_by_its_address_and_user():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname(), timeout=5) as client:
            port = client.getsockname()[1]
            accepted, _ = listener.accept()
            with accepted:
                names = _peers.PeerNames()
                try:
                    peer, name = names.name(accepted)
                finally:
                    names.close()
    assert peer == f"127.0.0.1:{port}"
    if not hasattr(socket, "AF_NETLINK"):
        assert name == "127.0.0.1"
    else:
        assert name == f"127.0.0.1 uid {os.getuid()}"


def test_a_raised_open_files_limit_raises_the_connection_budget():
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        assert _peers.LEDGER.budget == 1024 - 256
        now = _peers.raise_open_files_limit(4096)
        assert now == min(4096, hard) and _peers.LEDGER.budget == now - max(128, now // 4)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


operations = st.lists(st.tuples(st.sampled_from(["add", "proven", "remove"]), st.integers(0, 3), st.integers(0, 15)),
                      max_size=80)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_holders_count_each_peer_and_name_the_oldest_unproven(ops):
    """Against a plain model: counts per peer and in all, unproven connections in order, the caps' choices."""
    holders = _peers.Holders(per_peer=5, unproven_per_peer=2)
    model: dict[int, tuple[str, bool]] = {}  # conn -> (peer, unproven), in insertion order
    for op, peer_i, conn in ops:
        peer = f"10.0.0.{peer_i}"
        if op == "add" and conn not in model:
            holders.add(conn, peer)
            model[conn] = (peer, True)
        elif op == "proven" and conn in model:
            holders.proven(conn)
            model[conn] = (model[conn][0], False)
        elif op == "remove":
            holders.remove(conn)
            model.pop(conn, None)
        unproven = {}
        for c, (p, fresh) in model.items():
            if fresh:
                unproven.setdefault(p, []).append(c)
        assert holders.count == len(model)
        for i in range(4):
            p = f"10.0.0.{i}"
            mine = unproven.get(p, [])
            assert holders.held_by(p) == sum(1 for q, _ in model.values() if q == p)
            assert holders.over_cap(p) == (holders.held_by(p) > 5)
            assert holders.crowding(p) == (mine[0] if len(mine) > 2 else None)
            assert holders.oldest_unproven(p) == (mine[0] if mine else None)
        busiest = holders.busiest_unproven()
        most = max((len(v) for v in unproven.values()), default=0)
        assert (busiest is None) == (most == 0)
        if busiest is not None:
            assert busiest in [v[0] for v in unproven.values() if len(v) == most]
        assert sorted(holders.unproven()) == sorted(c for v in unproven.values() for c in v)


# ---- the raw read channel's shares ------------------------------------------------------------------------------


def _raw_read(sock: socket.socket) -> int:
    """Read no ranges once; the reply's status."""
    sock.sendall(HEADER.pack(MAGIC, VERSION, OP_READ, 1, 0))
    return HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))[2]


def test_a_raw_channel_holds_each_peer_to_its_share(monkeypatch):
    monkeypatch.setattr(_raw, "PENDING_PER_PEER", 2)
    segment = np.zeros(1 << 16, dtype=np.uint8)
    srv = RawReadServer("127.0.0.1", segment, max_ranges=16, max_bytes=1 << 16, max_connections=8).start()
    socks = []

    def connect(source: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5, source_address=(source, 0))
        socks.append(sock)
        return sock

    try:
        assert srv.per_peer == 4
        silent = [connect("127.0.0.2") for _ in range(3)]  # one more than its share without a message
        assert _closed_by_peer(silent[0], 5.0) and not _closed_by_peer(silent[2], 0.3)
        assert [_raw_read(connect("127.0.0.3")) for _ in range(4)] == [0] * 4  # its share, each read once
        assert _raw_read(connect("127.0.0.3")) == STATUS_BUSY  # past it: busy, and its client reads over ZeroMQ
        assert _raw_read(connect("127.0.0.4")) == 0  # another peer is served
        stats = srv.stats()
        assert stats["displaced_peer"] == 1 and stats["refused_peer"] == 1 and stats["refused_full"] == 0, stats
    finally:
        for sock in socks:
            sock.close()
        srv.close()
