"""No wrong row under ordinary churn: a layer removed and populated again, `engram-layers remove` racing a populate,
readers cut off from the master, Ctrl-C in a client, threads that come and go, while every read path is busy.

Each test pins one break a probe found: a streamed reply cut off part-way returned as rows (B1), ``V41Rows`` and
local-direct copies reading a mapping past the generation checks (B2), a row cache keeping an earlier populate's
rows (B3), a populate publishing its manifest after a remove took its heads (B6) and hearing ObjectNotFound where a
forced remove ended it, a lookup after Ctrl-C failing on a half-sent request, a socket left per short-lived thread.
"""
from __future__ import annotations

import gc
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

from suite_helpers import TcpProxy, run_threads, wait_for
from engram_store import DistributedStore, EngramStore, SegmentUnavailable, StalePlacement, WriteFenced
from engram_store.raw import RawChannel, RawChannelRefused
from engram_store.tables.cli import main as layers_main
from engram_store.testing import Cluster
from engram_store.raw.frame import HEADER, MAGIC, STATUS_OK, VERSION
from faults_helpers import CONFIG, expected_rows, layer_ids, layer_tables

pytestmark = pytest.mark.timeout(180)

#: The master's reuse delay here: a removed layer's space is taken again soon after.
REUSE_DELAY = ["--reuse-delay", "0.3"]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---- B1: a reply is whole or it raises ------------------------------------------------------------------------


def _serve_half(listener: socket.socket, expected: int, sent: threading.Event) -> None:
    """A segment's raw port that answers one read with its header and half its rows, then closes (as a segment
    ends a streamed reply whose objects changed while it went out)."""
    conn, _ = listener.accept()
    with conn:
        head = conn.recv(HEADER.size, socket.MSG_WAITALL)
        count = HEADER.unpack(head)[4]
        conn.recv(16 * count, socket.MSG_WAITALL)
        conn.sendall(HEADER.pack(MAGIC, VERSION, STATUS_OK, HEADER.unpack(head)[3], expected)
                     + b"\x5a" * (expected // 2))
    sent.set()


def test_a_reply_the_segment_ends_part_way_is_never_taken_as_rows():
    """Every byte of a cut-off reply has arrived (with the close) before the client receives: the client must
    raise, saying the reply was cut, never return a buffer half of which is what it held before."""
    listener = socket.create_server(("127.0.0.1", 0))
    expected = 4096
    sent = threading.Event()
    thread = threading.Thread(target=_serve_half, args=(listener, expected, sent), daemon=True)
    thread.start()
    try:
        channel = RawChannel("segment-x", "127.0.0.1", listener.getsockname()[1])
        deadline = time.monotonic() + 10
        request = channel.send_read(np.array([[0, expected]], dtype=np.int64), deadline)
        assert sent.wait(10), "the fake segment did not answer"
        out = np.zeros(expected, dtype=np.uint8)
        with pytest.raises(RawChannelRefused, match=f"ended its reply after {expected // 2} of {expected} bytes") \
                as caught:
            channel.recv_read(request, expected, deadline, out)
        assert caught.value.cut and caught.value.pairs.tolist() == [[0, expected]]
        assert channel.sock is None, "the connection of a cut reply is closed"
    finally:
        thread.join(timeout=10)
        listener.close()


class _CutProxy:
    """A segment's raw port behind a forwarder that passes every request on and the first ``limit`` bytes of
    what comes back, then closes the client's connection: a streamed reply cut at a piece's end."""

    def __init__(self, port: int, limit: int):
        self.limit = limit
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstream = port
        self.cuts = 0
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream), timeout=10)
            for target in (self._up, self._down):
                t = threading.Thread(target=target, args=(client, server), daemon=True)
                t.start()
                self._threads.append(t)

    @staticmethod
    def _up(client: socket.socket, server: socket.socket) -> None:
        try:
            while data := client.recv(1 << 16):
                server.sendall(data)
        except OSError:
            pass

    def _down(self, client: socket.socket, server: socket.socket) -> None:
        passed = 0
        try:
            while passed < self.limit and (data := server.recv(min(1 << 16, self.limit - passed))):
                client.sendall(data)
                passed += len(data)
        except OSError:
            pass
        self.cuts += passed == self.limit
        for s in (client, server):
            try:
                s.shutdown(socket.SHUT_RDWR)  # (a close alone leaves the connection to the thread in its recv)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()
        for t in self._threads:
            t.join(timeout=10)
        self._accepting.join(timeout=10)


def test_a_streamed_lookup_cut_at_a_piece_is_read_again_whole():
    """A lookup of 4 MiB over the raw channel (the segment streams it in 1 MiB pieces); the connection ends after
    the header and the first piece, as when the segment finds the layer written over before the second: the
    lookup returns every row (read again over ZeroMQ), never the caller's old buffer past the first piece."""
    from engram_store.raw import RawPort
    from engram_store.raw.limits import STREAM_PIECE_BYTES

    tables = layer_tables(1)
    ids = layer_ids(1, (64, 256))  # 16,384 positions x 4 heads x 64 bytes: 4 MiB
    with Cluster(segments=1, segment_size="16MiB", heartbeat_timeout_s=30.0) as c, \
            DistributedStore.connect(c.address, local_direct=False) as store:
        layer = EngramStore(1, CONFIG, store)
        layer.populate(tables)
        np.testing.assert_array_equal(layer.lookup(ids[:2]), expected_rows(tables, ids[:2]))
        routes = store.raw_routes
        (port,) = set(routes.ports.values())  # (one segment: every endpoint of it names its raw port)
        proxy = _CutProxy(port.port, HEADER.size + STREAM_PIECE_BYTES)
        try:
            for endpoint in list(routes.ports):
                routes.close(endpoint)
                routes.ports[endpoint] = RawPort("127.0.0.1", proxy.port, port.needs_token)
            out = np.full(ids.shape + (CONFIG.embedding_dim,), np.nan, dtype=np.float32)
            layer.lookup_into(ids, out)
            assert proxy.cuts, "the reply went out whole: nothing was cut"
            np.testing.assert_array_equal(out, expected_rows(tables, ids))
        finally:
            for endpoint in list(routes.ports):
                routes.close(endpoint)
            proxy.close()


# ---- B2: every read of mapped memory passes the generation checks -------------------------------------------


def _cut_off_reader(c: Cluster, proxy: TcpProxy, writer: DistributedStore, first, second, read) -> tuple[int, int]:
    """The reader maps the layer's segment; once it is cut off from the master, the writer removes the layer and
    populates another in its space. ``read()`` must return the first layer's rows (True) or raise StalePlacement
    (or, on a host so loaded that the segment does not answer within the reader's timeout, SegmentUnavailable);
    returns (served, refused) over two seconds."""
    proxy.freeze()
    first.remove_from_store(force=True)
    time.sleep(0.5)  # past the reuse delay: the next layer takes the same space
    second()
    refused = served = 0
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and refused < 10:
        try:
            assert read(), "a reader cut off from the master got the rows of the layer that took the space"
            served += 1
        except (StalePlacement, SegmentUnavailable):
            refused += 1
    proxy.thaw()
    return served, refused


def test_v41_rows_cut_off_from_the_master_never_read_the_layer_written_in_its_space():
    """V41Rows gathers a store's tables mapped on this host in one kernel: past half the reuse delay that read
    passes the same generation checks as a lookup's, so the rows are the layer's own or the call raises."""
    from engram_model.v41 import V41Config, V41Rows, v41_store_config

    cfg = V41Config(layer_ids=[1, 4], max_ngram_size=3, n_heads=3, head_dim=64, engram_vocab_size=60,
                    compressed_vocab_size=50, hidden_size=8, hc_mult=1)
    bounds = np.append(cfg.offsets(4), cfg.num_embeddings(4))
    rng = np.random.default_rng(3)
    rows_of = [rng.integers(0, 256, (int(bounds[-1]), cfg.row_bytes), dtype=np.uint8) for _ in range(2)]
    columns = [[rows[bounds[k]:bounds[k + 1]] for k in range(cfg.cols)] for rows in rows_of]
    layout = v41_store_config(cfg, 4)
    ids = np.stack([rng.integers(bounds[k], bounds[k + 1], 32) for k in range(cfg.cols)], axis=1)
    with Cluster(segments=1, segment_size="8MiB", heartbeat_timeout_s=30.0, extra=REUSE_DELAY) as c, \
            TcpProxy(c.address) as proxy, \
            DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as writer, \
            DistributedStore.connect(proxy.address, timeout_ms=300, local_direct=True) as reader:
        first = EngramStore(4, layout, writer)
        first.populate(columns[0])
        table = EngramStore(4, layout, reader)
        rows = V41Rows(table, cfg, 4)
        out = np.zeros((32, cfg.cols, cfg.row_bytes), dtype=np.uint8)

        def gathered() -> bool:
            out[:] = 0
            rows.gather_into(ids, out)
            return np.array_equal(out, rows_of[0][ids])

        assert gathered() and rows.memory_gathers == 1, "the reader maps the segment"
        served, refused = _cut_off_reader(c, proxy, writer, first,
                                          lambda: EngramStore(4, layout, writer).populate(columns[1]), gathered)
        assert refused, "the reader went on reading a layer that is gone"


@pytest.mark.parametrize("reader", ["lookup", "read_object"])
def test_lookups_and_local_copies_cut_off_from_the_master_never_read_what_took_the_space(reader):
    """The same for the other readers of mapped memory: a lookup (the placement's gather, past half the reuse
    delay) and a local-direct copy of an object located before (``read_object``: an ObjectInfo of no known age,
    checked however young), each reading through the one check."""
    first, second = layer_tables(5), layer_tables(6)
    ids = layer_ids(5, (2, 16))
    with Cluster(segments=1, segment_size="8MiB", heartbeat_timeout_s=30.0, extra=REUSE_DELAY) as c, \
            TcpProxy(c.address) as proxy, \
            DistributedStore.connect(c.address, timeout_ms=5000, local_direct=False) as writer, \
            DistributedStore.connect(proxy.address, timeout_ms=300 if reader == "lookup" else 5000,
                                     local_direct=True) as reader_store:
        # (A lookup asks the frozen master and waits its timeout; a copy of a located object reads through the
        # segment when its table refuses it, a first connection there taking more than 300 ms under load.)
        layer_w = EngramStore(2, CONFIG, writer)
        layer_w.populate(first)
        layer = EngramStore(2, CONFIG, reader_store)
        np.testing.assert_array_equal(layer.lookup(ids), expected_rows(first, ids))
        assert layer.stats()["local_rows"] > 0, "the reader maps the segment"
        head = reader_store.locate(["engram:l2:h0"], lease=False)[0]
        copy = np.empty(head.size, dtype=np.uint8)

        def read() -> bool:
            if reader == "lookup":
                return np.array_equal(layer.lookup(ids), expected_rows(first, ids))
            reader_store.read_object(head, copy)
            return np.array_equal(copy.view(np.float32).reshape(first[0].shape), first[0])

        assert read()
        _, refused = _cut_off_reader(c, proxy, writer, layer_w,
                                     lambda: EngramStore(2, CONFIG, writer).populate(second), read)
        assert refused


# ---- B3: a cached row carries the placement it was read under --------------------------------------------------


def test_a_row_cache_filled_while_the_layer_is_written_again_never_serves_the_earlier_rows():
    """A lookup reads rows of generation 1; before it puts them in the row cache, the layer is removed, written
    again (generation 2) and the reader's placement check finds the new tables (and clears the cache): the rows
    of generation 1 must not land in the cache, and the next lookups return generation 2's rows."""
    first, second = layer_tables(7), layer_tables(8)
    ids = layer_ids(7, (4, 64))
    with Cluster(segments=1, segment_size="8MiB", heartbeat_timeout_s=30.0) as c, \
            DistributedStore.connect(c.address, local_direct=False) as writer, \
            DistributedStore.connect(c.address, local_direct=False) as reader:
        EngramStore(3, CONFIG, writer).populate(first)
        layer = EngramStore(3, CONFIG, reader, row_cache_bytes=1 << 20)
        np.testing.assert_array_equal(layer.lookup(ids[:1]), expected_rows(first, ids[:1]))
        read_pairs_many = reader.read_pairs_many
        raced = []

        def racing(requests, outs=None):
            replies = read_pairs_many(requests, outs)  # generation 1's rows, on their way into the cache
            if not raced:
                raced.append(True)
                writer.remove_all(force=True)
                EngramStore(3, CONFIG, writer).populate(second)
                source = layer._source
                source.placements.resolve(layer._layer(None), set())  # the placement check, as in the background
            return replies

        reader.read_pairs_many = racing
        np.testing.assert_array_equal(layer.lookup(ids), expected_rows(first, ids))
        del reader.read_pairs_many
        assert raced
        np.testing.assert_array_equal(layer.lookup(ids), expected_rows(second, ids))


# ---- B6: a populate publishes only while it holds its heads ---------------------------------------------------


@pytest.mark.parametrize("force", [False, True], ids=["remove", "remove --force"])
def test_engram_layers_remove_between_a_populates_heads_and_its_manifest_leaves_no_half_layer(force, capsys):
    """``engram-layers remove`` lists the layer after the populate published its heads and before its manifest:
    it removes the heads; the populate must then fail (WriteFenced) and leave nothing, not publish a manifest
    whose heads are gone."""
    tables = layer_tables(9)
    with Cluster(segments=1, segment_size="8MiB", heartbeat_timeout_s=30.0) as c, \
            DistributedStore.connect(c.address, local_direct=False) as store:
        layer = EngramStore(4, CONFIG, store)
        publish = layer._source.publish
        said = []

        def racing(*args, **kwargs):
            said.append(layers_main(["remove", "--master", c.address, "--yes", "4"]
                                    + (["--force"] if force else [])))
            return publish(*args, **kwargs)

        layer._source.publish = racing
        with pytest.raises(WriteFenced, match="is no longer the object put .* wrote"):
            layer.populate(tables)
        assert said == [0] and "removed 4 object(s)" in capsys.readouterr().out
        assert store.list_keys() == [], "a half layer was left"
        del layer._source.publish
        layer.populate(tables)  # populating again writes it whole
        np.testing.assert_array_equal(layer.lookup(layer_ids(9, (2, 8))), expected_rows(tables, layer_ids(9, (2, 8))))


def test_the_last_shard_publishes_the_manifest_only_while_every_shards_heads_are_there():
    """A layer written as two head shards: the second publishes the manifest, naming the first shard's heads as
    the master gave them; one removed before the publication makes it fail (WriteFenced), leaving no manifest."""
    tables = layer_tables(14)
    with Cluster(segments=1, segment_size="8MiB", heartbeat_timeout_s=30.0) as c, \
            DistributedStore.connect(c.address, local_direct=False) as store, \
            DistributedStore.connect(c.address, local_direct=False) as other:
        EngramStore(9, CONFIG, store, heads=[0, 1]).populate(tables[:2])
        put_generations = store.put_generations

        def racing(keys, *args, **kwargs):
            if keys == ["engram:l9:manifest"]:
                other.remove("engram:l9:h0", force=True)
            return put_generations(keys, *args, **kwargs)

        store.put_generations = racing
        with pytest.raises(WriteFenced, match="'engram:l9:h0' is no longer the object put"):
            EngramStore(9, CONFIG, store, heads=[2, 3]).populate(tables[2:])
        assert [k.key for k in store.list_keys()] == ["engram:l9:h1"], "a manifest or the shard's heads were left"


def test_a_forced_remove_that_ends_a_populate_makes_it_raise_write_fenced():
    """docs/store.md: a write whose put was ended (here by ``remove_from_store(force=True)`` while the heads are
    written) is refused with WriteFenced, and nothing of it is published."""
    tables = layer_tables(10)
    with Cluster(segments=1, segment_size="8MiB", heartbeat_timeout_s=30.0) as c, \
            DistributedStore.connect(c.address, local_direct=False) as store, \
            DistributedStore.connect(c.address, local_direct=False) as other:
        put_end = store._put_end

        def racing(*args, **kwargs):
            EngramStore(5, CONFIG, other).remove_from_store(force=True)  # the heads' puts, ended
            return put_end(*args, **kwargs)

        store._put_end = racing
        with pytest.raises(WriteFenced, match="no write in progress for put"):
            EngramStore(5, CONFIG, store).populate(tables)
        assert store.list_keys() == []


# ---- Ctrl-C in a client ---------------------------------------------------------------------------------------


@pytest.fixture
def sigint_raises():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_lookup_after_ctrl_c_between_two_frames_of_a_request_reads_its_own_rows(monkeypatch, sigint_raises):
    """SIGINT lands between the header frame and the ranges frame of a read over ZeroMQ: the next lookup must not
    send its request as the rest of that message (the segment read its header as the ranges: "offsets: frame of
    25 bytes")."""
    import zmq

    tables = layer_tables(11)
    ids = layer_ids(11, (2, 8))
    send = zmq.Socket.send
    fired = []

    def interrupted(self, data, flags=0, *args, **kwargs):
        result = send(self, data, flags, *args, **kwargs)
        if not fired and flags & zmq.SNDMORE and b"read_ranges" in bytes(data):
            fired.append(True)
            signal.raise_signal(signal.SIGINT)
        return result

    with Cluster(segments=1, segment_size="8MiB", heartbeat_timeout_s=30.0) as c, \
            DistributedStore.connect(c.address, local_direct=False, raw_reads=False) as store:
        layer = EngramStore(6, CONFIG, store)
        layer.populate(tables)
        monkeypatch.setattr(zmq.Socket, "send", interrupted)
        with pytest.raises(KeyboardInterrupt):
            layer.lookup(ids)
        assert fired
        np.testing.assert_array_equal(layer.lookup(ids), expected_rows(tables, ids))


def test_a_lookup_after_ctrl_c_between_a_raw_read_and_its_reply_reads_its_own_rows(monkeypatch, sigint_raises):
    """SIGINT lands after a raw-channel read went out and before its reply was received: the next read on that
    connection must not take the abandoned read's reply as its own."""
    tables = layer_tables(12)
    ids = layer_ids(12, (2, 8))
    recv_read = RawChannel.recv_read
    fired = []

    def interrupted(self, *args, **kwargs):
        if not fired:
            fired.append(True)
            signal.raise_signal(signal.SIGINT)
        return recv_read(self, *args, **kwargs)

    with Cluster(segments=1, segment_size="8MiB", heartbeat_timeout_s=30.0) as c, \
            DistributedStore.connect(c.address, local_direct=False) as store:
        layer = EngramStore(7, CONFIG, store)
        layer.populate(tables)
        monkeypatch.setattr(RawChannel, "recv_read", interrupted)
        with pytest.raises(KeyboardInterrupt):
            layer.lookup(ids)
        assert fired
        for seed in range(3):
            ids = layer_ids(20 + seed, (2, 8))
            np.testing.assert_array_equal(layer.lookup(ids), expected_rows(tables, ids))


# ---- threads that come and go ---------------------------------------------------------------------------------


def test_short_lived_threads_leave_no_socket_behind():
    """Each of 60 threads makes store calls (a lookup over the raw channel, a get from the master and a segment)
    and ends: the process's descriptors come back to where they were."""
    tables = layer_tables(13)
    ids = layer_ids(13, (2, 8))
    with Cluster(segments=1, segment_size="8MiB", heartbeat_timeout_s=30.0) as c, \
            DistributedStore.connect(c.address, local_direct=False) as store:
        layer = EngramStore(8, CONFIG, store)
        layer.populate(tables)
        store.put("blob", b"b" * 1000)
        layer.lookup(ids)
        gc.collect()
        before = _fds()

        def work(seed: int) -> None:
            np.testing.assert_array_equal(layer.lookup(ids), expected_rows(tables, ids))
            assert store.get("blob") == b"b" * 1000

        for _ in range(60):
            thread = threading.Thread(target=work, args=(0,))
            thread.start()
            thread.join(timeout=30)
            assert not thread.is_alive()
        run_threads(work, 4, 60)
        gc.collect()
        wait_for(lambda: _fds() <= before + 8, 20, f"the descriptors to come back to {before} (now {_fds()})")
