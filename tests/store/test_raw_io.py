"""The raw read channel's kernel round trips (``kernels.read_direct``, ``kernels.serve_read``) against their plain
Python/NumPy twins, over real socket pairs: the bytes each sends, what each makes of every reply, and the waits."""

import ctypes
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_store.kernels import RAW_IO, check_pairs_for, direct_read_plan, read_direct, serve_params, serve_read
from engram_store.kernels import raw_io as rio
from engram_store.kernels import _raw_twins as twins
from engram_store.raw import frame
from engram_store.segment._generations import Generations

pytestmark = pytest.mark.skipif(not RAW_IO, reason="the kernel round trips run on 64-bit little-endian Linux")

WORDS = struct.Struct("<qqq")
READ, OK, BUSY = 0x1_0003_52474E45, 0x0_0003_52474E45, 0x5_0003_52474E45  # kinds: magic, version, op/status


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """The kernels compiled (or loaded from the cache) before any test times them."""
    read_direct(-1, np.zeros((1, 1), np.int64), direct_read_plan(np.zeros(1, np.int64), np.zeros(1, np.int64),
                                                                 np.zeros((0, 2), np.int64)),
                8, 1, rio.client_buffer(0, 0, 0, 1.0), np.zeros(8, dtype=np.uint8))
    serve_read(-1, -1, -1, 0, -1, np.zeros(64, np.uint8), np.zeros(64, np.uint8), SEGMENT, np.zeros(0, np.int64),
               PARAMS, np.zeros(rio.SERVER_STATE_WORDS, np.int64))


def _pair(timeout_s: float = 5.0):
    a, b = socket.socketpair()
    for s in (a, b):
        s.settimeout(timeout_s)
    return a, b


def _recv_exact(sock, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _client(ids, plan, row_bytes, answer, kernel: bool, request_bytes: int = 1 << 16, timeout_s: float = 5.0):
    """Run one read (the kernel, or its Python twin) against a peer thread that receives the request and sends
    ``answer(request)``; returns (status, out, the request the peer received)."""
    a, b = _pair(timeout_s)
    expected = ids.shape[0] * int(plan[0]) * row_bytes
    size = len(twins.direct_request_numpy(ids, plan, row_bytes, READ, 9))
    got = {}

    def peer():
        got["request"] = _recv_exact(b, size) if size <= request_bytes else b""
        reply = answer(got["request"])
        try:
            if reply is None:
                b.close()
            elif reply:
                b.sendall(reply)
                b.shutdown(socket.SHUT_WR)  # and nothing more
        except OSError:
            pass  # the client has gone: what it made of the reply is what the test checks

    thread = threading.Thread(target=peer)
    thread.start()
    out = np.zeros(expected, dtype=np.uint8)
    try:
        if kernel:
            status = read_direct(a.fileno(), ids, plan, row_bytes, 9,
                                 rio.client_buffer(request_bytes, READ, OK, timeout_s), out)
        else:
            status = twins.read_direct_python(a, ids, plan, row_bytes, READ, OK, 9, out)
    finally:
        a.close()
        thread.join()
        b.close()
    return status, out, got.get("request", b"")


@settings(max_examples=60, deadline=None)
@given(M=st.integers(1, 40), H=st.integers(1, 6), row_words=st.integers(1, 4), checks=st.integers(0, 3),
       seed=st.integers(0, 2 ** 31))
def test_a_lookup_read_sends_what_numpy_plans_and_receives_the_rows_in_place(M, H, row_words, checks, seed):
    rng = np.random.default_rng(seed)
    row_bytes = 8 * row_words
    K = int(rng.integers(1, H + 1))
    order = rng.permutation(H)[:K].astype(np.int64)
    bases = rng.integers(0, 1 << 30, K).astype(np.int64)
    named = check_pairs_for(rng.integers(0, 1 << 30, checks).astype(np.int64),
                            rng.integers(1, 1 << 20, checks).astype(np.int64), rng.integers(1, 99, checks))
    plan = direct_read_plan(order, bases, named)
    ids = rng.integers(0, 1000, (M, H)).astype(np.int64)
    rows = rng.integers(0, 256, M * K * row_bytes, dtype=np.uint8).tobytes()

    def answer(request):
        return WORDS.pack(OK, 9, len(rows)) + rows

    for kernel in (True, False):
        status, out, request = _client(ids, plan, row_bytes, answer, kernel)
        assert status == rio.OK
        assert request == twins.direct_request_numpy(ids, plan, row_bytes, READ, 9)
        assert out.tobytes() == rows
    # The NumPy twin is the header, the checks and kernels.direct_pairs' ranges.
    from engram_store.kernels import direct_pairs
    body = np.concatenate((named, direct_pairs(ids, order, bases, row_bytes)))
    assert twins.direct_request_numpy(ids, plan, row_bytes, READ, 9) == \
        WORDS.pack(READ, 9, body.shape[0]) + body.tobytes()


@settings(max_examples=40, deadline=None)
@given(M=st.integers(1, 20), H=st.integers(1, 5), seed=st.integers(0, 2 ** 31))
def test_a_lookup_read_of_an_id_outside_its_heads_rows_sends_nothing(M, H, seed):
    """A plan with each head's rows: an id outside them is answered BAD_ID before a byte goes out; ids inside
    them are read as a plan without limits reads them."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 50, H).astype(np.int64)
    order = rng.permutation(H).astype(np.int64)
    bases = (np.arange(H) * 4096).astype(np.int64)
    plan = direct_read_plan(order, bases, np.zeros((0, 2), np.int64), sizes)
    ids = rng.integers(0, sizes, (M, H)).astype(np.int64)
    rows = bytes(M * H * 8)
    for kernel in (True, False):
        status, _, request = _client(ids, plan, 8, lambda r: WORDS.pack(OK, 9, len(rows)) + rows, kernel)
        assert status == rio.OK
        unlimited = direct_read_plan(order, bases, np.zeros((0, 2), np.int64))
        assert request == twins.direct_request_numpy(ids, unlimited, 8, READ, 9)
    m, h = int(rng.integers(M)), int(rng.integers(H))
    ids[m, h] = int(rng.choice([-1, sizes[h], sizes[h] + 7, 1 << 62]))
    for kernel in (True, False):
        status, _, request = _client(ids, plan, 8, lambda r: WORDS.pack(OK, 9, len(rows)) + rows, kernel)
        assert (status, request) == (rio.BAD_ID, b"")


@settings(max_examples=100, deadline=None)
@given(code=st.integers(0, 0xFFFF), request_id=st.integers(0, 2 ** 63 - 1), count=st.integers(0, 2 ** 63 - 1))
def test_the_kernels_read_the_frames_header_as_their_words(code, request_id, count):
    """The frame (``raw.frame.HEADER``) and the kernels' view of it (``raw_io.HEADER_LAYOUT``) are the same bytes:
    the kind the frame makes of magic, version and code, then the request id and the count."""
    head = frame.HEADER.pack(frame.MAGIC, frame.VERSION, code, request_id, count)
    words = np.frombuffer(head, dtype=np.int64)
    assert words.size == rio.HEADER_WORDS
    assert (words[rio.H_KIND], words[rio.H_REQUEST_ID], words[rio.H_COUNT]) == (frame.kind(code), request_id, count)
    assert np.frombuffer(head, dtype=rio.HEADER_LAYOUT)[0].tolist() == (frame.kind(code), request_id, count)


def test_the_kernels_libc_layouts_are_libcs():
    """The words read_direct fills for recvmsg are ``struct msghdr`` and ``struct iovec`` as libc lays them out."""
    class Msghdr(ctypes.Structure):
        _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32), ("iov", ctypes.c_void_p),
                    ("iovlen", ctypes.c_size_t), ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                    ("flags", ctypes.c_int)]

    class Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    for struct_, layout in ((Msghdr, rio.MSGHDR), (Iovec, rio.IOVEC)):
        assert ctypes.sizeof(struct_) == layout.itemsize
        assert [getattr(struct_, name).offset for name in layout.names] == [layout.fields[n][1] for n in layout.names]
    assert rio.CLIENT_LAYOUT.fields["iov"][1] == 8 * rio.C_IOV and rio.CLIENT_LAYOUT.itemsize == 8 * rio.CLIENT_WORDS


@pytest.mark.parametrize("case, answer, status", [
    ("closed before any reply", lambda r: None, rio.CLOSED),
    ("busy", lambda r: WORDS.pack(BUSY, 9, 4) + b"busy", rio.REFUSED),
    ("another request id", lambda r: WORDS.pack(OK, 8, 16) + bytes(16), rio.PROTOCOL),
    ("another count", lambda r: WORDS.pack(OK, 9, 8) + bytes(8), rio.PROTOCOL),
    ("another magic", lambda r: WORDS.pack(0x0_0003_41414141, 9, 16) + bytes(16), rio.PROTOCOL),
    ("cut inside the rows", lambda r: WORDS.pack(OK, 9, 16) + bytes(5), rio.FAILED),
])
def test_a_lookup_read_says_why_a_reply_is_not_its_rows(case, answer, status):
    ids = np.array([[3, 4]], dtype=np.int64)
    plan = direct_read_plan(np.array([0, 1]), np.array([0, 1 << 20]), np.zeros((0, 2), np.int64))

    for kernel in (True, False):
        got, _, _ = _client(ids, plan, 8, answer, kernel)
        assert got == status, (case, kernel)


def test_a_lookup_read_times_out_on_a_silent_peer_and_refuses_a_request_too_large_for_its_buffer():
    ids = np.zeros((4, 2), dtype=np.int64)
    plan = direct_read_plan(np.array([0, 1]), np.array([0, 64]), np.zeros((0, 2), np.int64))
    for kernel in (True, False):
        start = time.monotonic()
        status, _, _ = _client(ids, plan, 8, lambda r: b"", kernel, timeout_s=0.3)
        assert status == rio.TIMEOUT and time.monotonic() - start < 3
    status, _, request = _client(ids, plan, 8, lambda r: b"", True, request_bytes=64)
    assert status == rio.NO_ROOM and request == b""


@pytest.mark.parametrize("checks", [0, 2])
def test_a_buffer_with_room_for_exactly_the_request_reads_and_one_word_less_sends_nothing(checks):
    """client_buffer(direct_request_bytes(...)) is what a channel allocates for its largest read: that read must go
    out, and a buffer a word short of it must answer NO_ROOM before a byte does."""
    ids = np.arange(6, dtype=np.int64).reshape(3, 2)
    named = check_pairs_for(np.arange(checks) * 64, np.full(checks, 64), np.arange(1, checks + 1))
    plan = direct_read_plan(np.array([1, 0]), np.array([0, 4096]), named)
    exact = rio.direct_request_bytes(ids, plan)
    assert exact == rio.HEADER_BYTES + 16 * (len(named) + ids.size)
    rows = bytes(range(ids.size * 8))
    status, out, request = _client(ids, plan, 8, lambda r: WORDS.pack(OK, 9, len(rows)) + rows, True,
                                   request_bytes=exact)
    assert status == rio.OK and len(request) == exact and out.tobytes() == rows
    status, _, request = _client(ids, plan, 8, lambda r: b"", True, request_bytes=exact - 8)
    assert status == rio.NO_ROOM and request == b""


def test_a_signal_ends_a_lookup_read_so_its_handler_runs_at_once():
    """A read stuck on a silent segment returns INTERRUPTED when the thread gets a signal (Ctrl-C ends a lookup at
    once instead of after the timeout); the channel then closes the connection and reads the general way."""
    import signal
    ids = np.zeros((1, 2), dtype=np.int64)
    plan = direct_read_plan(np.array([0, 1]), np.array([0, 64]), np.zeros((0, 2), np.int64))
    caught = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: caught.append(True))
    a, b = _pair()
    try:
        timer = threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1))
        timer.start()
        start = time.monotonic()
        status = read_direct(a.fileno(), ids, plan, 8, 9, rio.client_buffer(1024, READ, OK, 10.0),
                             np.zeros(16, dtype=np.uint8))
        assert status == rio.INTERRUPTED and time.monotonic() - start < 5
        timer.join()
        assert caught
    finally:
        signal.signal(signal.SIGUSR1, previous)
        a.close()
        b.close()


# ---- the segment's side ------------------------------------------------------------------------------------------

SEGMENT = np.random.default_rng(3).integers(0, 256, 1 << 16, dtype=np.uint8)
PARAMS = serve_params(READ, OK, max_ranges=64, max_bytes=1 << 12, stream_min_bytes=1 << 11,
                      stream_piece_bytes=1 << 10, send_timeout_s=1.0, send_min_bytes_per_s=1 << 20)


@pytest.fixture
def table():
    generations = Generations("seg-generations", SEGMENT.size)
    generations.claim(0, 4096, 7)
    generations.claim(8192, 4096, 8)
    try:
        yield generations
    finally:
        generations.close()


class Server:
    """serve_read on one end of a socket pair, its "thread wanted" pipe, and its buffers."""

    def __init__(self, table: np.ndarray, reply_bytes: int = 1 << 12):
        self.sock, self.peer = _pair()
        self.need_r, self.need_w = os.pipe()
        os.set_blocking(self.need_r, False)
        self.request = np.zeros(1 << 12, dtype=np.uint8)
        self.reply = np.zeros(reply_bytes, dtype=np.uint8)
        self.state = np.zeros(rio.SERVER_STATE_WORDS, dtype=np.int64)
        self.table = table

    def serve(self, linger_ms: int = 1000, sticky_ms: int = 0, settle_ms: int = 0) -> int:
        return serve_read(self.sock.fileno(), self.need_r, linger_ms, sticky_ms, settle_ms, self.request, self.reply,
                          SEGMENT, self.table, PARAMS, self.state)

    def close(self) -> None:
        for s in (self.sock, self.peer):
            s.close()
        os.close(self.need_r)
        os.close(self.need_w)


def _message(request_id: int, pairs) -> bytes:
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    return WORDS.pack(READ, request_id, pairs.shape[0]) + pairs.tobytes()


_ranges = st.lists(st.tuples(st.integers(-8, SEGMENT.size + 8), st.integers(0, 600)), max_size=12)
_checks = st.lists(st.sampled_from([(0, 4096, 7), (0, 4096, 6), (8192, 4096, 8), (8192, 2048, 8), (20000, 64, 3)]),
                   max_size=3)


@settings(max_examples=150, deadline=None)
@given(ranges=_ranges, checks=_checks, odd=st.booleans())
def test_a_read_is_answered_as_the_python_twin_answers_it_or_left_to_the_caller(ranges, checks, odd):
    generations = Generations("seg-generations", SEGMENT.size)
    generations.claim(0, 4096, 7)
    generations.claim(8192, 4096, 8)
    server = Server(generations.table)
    try:
        named = check_pairs_for(*(np.array(c, dtype=np.int64).reshape(-1) for c in zip(*checks))) if checks \
            else np.zeros((0, 2), np.int64)
        if odd and named.size:
            named = named[:-1]  # a check without its size
        message = _message(5, np.concatenate((named, np.array(ranges, dtype=np.int64).reshape(-1, 2))))
        expected = twins.serve_read_python(message, SEGMENT, generations.table, PARAMS, server.reply.size)
        server.peer.sendall(message)
        status = server.serve()
        if expected is None:
            assert status == rio.PYTHON
            start, end = server.state[:2]
            assert server.request[start:end].tobytes() == message  # left whole for the caller
        else:
            assert status == rio.SERVED
            assert _recv_exact(server.peer, len(expected)) == expected
            assert server.state[rio.START] == server.state[rio.END]  # all of it used
            assert list(server.state[rio.COUNT:rio.TOTAL + 1]) == [1, 5, len(expected) - 24]
            assert 0 < server.state[rio.RING_AT] < 10 ** 9  # its serving time, in ns
    finally:
        server.close()
        generations.close()


def test_reads_sent_ahead_are_answered_in_order_and_part_of_one_is_left_to_the_caller(table):
    server = Server(table.table)
    try:
        first, second = _message(1, [[0, 8], [100, 16]]), _message(2, [[64, 8]])
        server.peer.sendall(first + second)
        assert server.serve() == rio.SERVED and server.state[rio.COUNT] == 2  # both in one call
        assert _recv_exact(server.peer, 24 + 24 + 24 + 8) == (
            WORDS.pack(OK, 1, 24) + SEGMENT[0:8].tobytes() + SEGMENT[100:116].tobytes()
            + WORDS.pack(OK, 2, 8) + SEGMENT[64:72].tobytes())
        server.peer.sendall(second + second[:10])
        assert server.serve() == rio.PYTHON and server.state[rio.COUNT] == 1  # the rest of the third is not in
        start, end = server.state[:2]
        assert server.request[start:end].tobytes() == second[:10]  # the caller waits for it
        assert _recv_exact(server.peer, 24 + 8) == WORDS.pack(OK, 2, 8) + SEGMENT[64:72].tobytes()
    finally:
        server.close()


def test_a_hello_a_large_reply_and_a_reply_past_the_buffer_are_left_to_the_caller(table):
    server = Server(table.table, reply_bytes=24 + 512)
    try:
        for message in (WORDS.pack(0x2_0003_52474E45, 0, 32) + bytes(32),  # a hello
                        _message(1, [[0, 1024]]),  # one range of a piece's size: sent from the segment
                        _message(2, [[0, 600], [4096, 600], [9000, 900]]),  # past the stream bound
                        _message(3, [[0, 513]])):  # past this reply buffer
            server.state[:2] = 0  # the caller took the one before
            server.peer.sendall(message)
            assert server.serve() == rio.PYTHON
            start, end = server.state[:2]
            assert server.request[start:end].tobytes() == message
    finally:
        server.close()


def test_the_wait_lingers_then_gives_the_thread_up_to_a_request_that_wants_it(table):
    server = Server(table.table)
    try:
        start = time.monotonic()
        assert server.serve(linger_ms=60, sticky_ms=60) == rio.QUIET
        assert 0.1 <= time.monotonic() - start < 2
        os.write(server.need_w, b"x")  # another request wants a thread: heard only after the linger
        start = time.monotonic()
        assert server.serve(linger_ms=80, sticky_ms=5000) == rio.NEEDED
        assert 0.07 <= time.monotonic() - start < 2
        assert server.serve(linger_ms=-1) == rio.QUIET  # no wait at all
        threading.Timer(0.05, lambda: server.peer.sendall(_message(4, [[8, 8]]))).start()
        assert server.serve(linger_ms=1000) == rio.SERVED
        # After a reply, the next read that comes within the settle wait is answered in the same call.
        for at in (0.05, 0.06):
            threading.Timer(at, lambda: server.peer.sendall(_message(5, [[8, 8]]))).start()
        assert server.serve(linger_ms=1000, settle_ms=500) == rio.SERVED and server.state[rio.COUNT] == 2
        os.write(server.need_w, b"x")  # a request wants the thread: heard in the settle wait
        server.peer.sendall(_message(6, [[8, 8]]))
        assert server.serve(linger_ms=1000, settle_ms=5000) == rio.NEEDED and server.state[rio.COUNT] == 1
        server.peer.close()
        assert server.serve(linger_ms=1000) == rio.GONE
    finally:
        server.close()


def test_a_named_object_written_over_is_left_to_the_caller_and_without_a_table_every_checked_read_is(table):
    server = Server(table.table)
    try:
        good = check_pairs_for(np.array([0]), np.array([4096]), np.array([7]))
        message = _message(1, np.concatenate((good, [[16, 16]])))
        server.peer.sendall(message)
        assert server.serve() == rio.SERVED
        table.claim(0, 4096, 9)  # another put wrote over it
        server.peer.sendall(message)
        assert server.serve() == rio.PYTHON
    finally:
        server.close()
    server = Server(np.zeros(0, dtype=np.int64))
    try:
        server.peer.sendall(_message(1, np.concatenate((good, [[16, 16]]))))
        assert server.serve() == rio.PYTHON
    finally:
        server.close()
