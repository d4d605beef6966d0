"""The raw read channel's round trips, one GIL-free kernel per side: a client's lookup read and a segment's answer.

Why: on each side a raw-channel read used to cross the interpreter a dozen times (plan the ranges, pack a header,
send, receive, unpack, check the named objects, gather, send). Hot, each crossing costs a microsecond or two; at
the cadence serving uses (one lookup per model step, tens of milliseconds apart, every cache cold by then) each
costs tens, and each GIL release on the way hands the interpreter to a busy model thread for up to a switch
interval. Here each side's part is one call that talks to libc (``poll``, ``send``, ``recv``, ``recvmsg``,
``read``, ``clock_gettime``) itself:

* :func:`read_direct` (client): build the request in the channel's buffer (header, the placement's checks, one
  range per (m, head) row in output order, as :func:`direct_pairs` plans it), send it, receive the reply header
  and rows straight into the output, check the header.
* :func:`serve_read` (segment): wait on a connection (a linger, then a poll that also watches a "thread wanted"
  pipe), receive a read, check the objects it names against the generation table (as :func:`check_table`), check
  its ranges, gather them behind the reply header, read the table's sequence again, send the reply.

Anything off that path is the caller's: a kernel returns a status, and what it received stays in the caller's
buffer. Messages are a 24-byte header of three little-endian words (kind, request id, count) and a body; the
caller passes the kinds in (the magic, version and op or status of its protocol), so this room knows no protocol.

Linux on a 64-bit little-endian CPU only (the layouts of ``struct pollfd``, ``struct msghdr`` and ``struct iovec``
and the errno values are that ABI's, and words are read in place): elsewhere :data:`RAW_IO` is False and callers
keep to their Python paths. The NumPy/Python twins the tests hold the kernels to are in :mod:`._raw_twins`.
"""
from __future__ import annotations

import errno as _errno
import socket as _socket
import sys
import time

import numpy as np
from numba import carray, njit, types

from ._gather import _gather_pairs_any
from ._generations_table import HOLDS, SEQ, _check_table
from ._planning import _pairs_total

#: Whether the kernels run here (Linux, 64-bit, little-endian); callers take their Python paths where not.
RAW_IO = sys.platform.startswith("linux") and sys.maxsize > 2 ** 32 and sys.byteorder == "little"

# The kernels' arrays are int64 words; each layout below is a record dtype, and the kernels index its fields by
# the word each starts at (_words: a layout's field -> word index).


def _words(layout: np.dtype) -> dict[str, int]:
    return {name: offset // 8 for name, (_, offset) in layout.fields.items()}


_I8 = "<i8"
#: A message's header as the kernels read it: three little-endian words (the frame, engram_store.raw.frame, gives
#: the bytes: magic, version and op or status make the kind).
HEADER_LAYOUT = np.dtype([("kind", _I8), ("request_id", _I8), ("count", _I8)])
H_KIND, H_REQUEST_ID, H_COUNT = _words(HEADER_LAYOUT).values()
HEADER_WORDS = HEADER_LAYOUT.itemsize // 8
HEADER_BYTES = HEADER_LAYOUT.itemsize
#: A read's pair of words: (offset, length), or a check.
PAIR_WORDS = 2
PAIR_BYTES = 8 * PAIR_WORDS
#: libc's structs (Linux, 64-bit) as words: ``struct msghdr`` (an int and a socklen_t padded to a word each),
#: ``struct iovec``, ``struct timespec``; a ``struct pollfd`` is one word (the fd in the low 32 bits, the events
#: above, the returned events from bit 48).
MSGHDR = np.dtype([("name", _I8), ("namelen", _I8), ("iov", _I8), ("iovlen", _I8), ("control", _I8),
                   ("controllen", _I8), ("flags", _I8)])
M_NAME, M_NAMELEN, M_IOV, M_IOVLEN, M_CONTROL, M_CONTROLLEN, M_FLAGS = _words(MSGHDR).values()
IOVEC = np.dtype([("base", _I8), ("len", _I8)])
IOV_BASE, IOV_LEN = _words(IOVEC).values()
IOVEC_WORDS = IOVEC.itemsize // 8
TIMESPEC = np.dtype([("sec", _I8), ("nsec", _I8)])
TS_SEC, TS_NSEC = _words(TIMESPEC).values()
POLL_EVENTS_SHIFT, POLL_REVENTS_SHIFT = 32, 48
#: The words at the start of a channel's buffer (client_buffer): a msghdr, two iovecs (the reply's header, then
#: its rows), the reply header, a timespec, a pollfd, the request's kind, a good reply's kind, the timeout.
C_IOVECS = 2
CLIENT_LAYOUT = np.dtype([("msghdr", MSGHDR), ("iov", IOVEC, C_IOVECS), ("head", HEADER_LAYOUT), ("time", TIMESPEC),
                          ("poll", _I8), ("kind", _I8), ("ok_kind", _I8), ("timeout_ns", _I8), ("spare", _I8, 4)])
C_MSGHDR, C_IOV, C_HEAD, C_TIME, C_POLL, C_KIND, C_OK_KIND, C_TIMEOUT_NS, _ = _words(CLIENT_LAYOUT).values()
CLIENT_WORDS = CLIENT_LAYOUT.itemsize // 8
#: A :func:`serve_read` state array: the bytes received and not used yet (``request[start:end]``), how many reads
#: the call answered, the last one's request id and reply bytes, scratch memory (two pollfds, a timespec), then each
#: answered read's serving time in ns (at most RING of them a call).
RING = 64
SERVER_LAYOUT = np.dtype([("start", _I8), ("end", _I8), ("count", _I8), ("request_id", _I8), ("total", _I8),
                          ("spare", _I8, 3), ("poll", _I8, 2), ("time", TIMESPEC), ("spare2", _I8, 4),
                          ("ring", _I8, RING)])
START, END, COUNT, REQUEST_ID, TOTAL, _, S_POLL, S_TIME, _, RING_AT = _words(SERVER_LAYOUT).values()
SERVER_STATE_WORDS = SERVER_LAYOUT.itemsize // 8
#: A :func:`direct_read_plan`: ``[K, C, order[K], bases[K], limits[K], checks[2C, 2]]``; order starts at PLAN_ORDER.
PLAN_K, PLAN_C, PLAN_ORDER = 0, 1, 2
#: :func:`serve_read`'s params: the kinds of a read request and a good reply, and the bounds of one request.
(P_READ_KIND, P_OK_KIND, P_MAX_RANGES, P_MAX_BYTES, P_STREAM_MIN, P_STREAM_PIECE, P_SEND_TIMEOUT_NS,
 P_SEND_MIN_RATE) = range(8)
SERVER_PARAMS = 8

# read_direct's answers.
OK = 0
NO_ROOM = 1  # the request does not fit the buffer given: nothing was sent
CLOSED = 2  # the peer closed (or reset) the connection before a byte of the reply came
TIMEOUT = 3  # a send or receive waited out the socket's timeout, or the deadline passed
FAILED = 4  # any other socket error, or the connection ended inside a reply
REFUSED = 5  # the reply carries another status (busy, an error): its message is still on the connection
PROTOCOL = 6  # not the reply expected (another magic or version, request id or count)
INTERRUPTED = 7  # a signal came (its handler runs once the caller is back in Python): the read may be half done
BAD_ID = 8  # an id is outside its head's rows (the plan's limits): nothing was sent
# serve_read's answers (state[COUNT] says how many reads it answered before it returned any of them).
SERVED = 0  # reads were answered (RING of them, or no other came within the settle wait)
QUIET = 1  # nothing came within the linger and the sticky wait (or at once, without a wait)
NEEDED = 2  # during the sticky wait the pipe asked for this thread (its byte was taken)
RECHECK = 3  # the pipe woke the wait but another thread took its byte: the caller decides
GONE = 4  # the peer closed the connection, or it failed
PYTHON = 5  # a message this kernel does not answer (or part of one): the caller takes it from state
SEND_TIMEOUT = 6  # the reply was not taken within the send deadline

_EINTR, _EAGAIN = _errno.EINTR, _errno.EAGAIN
_EPIPE, _ECONNRESET = _errno.EPIPE, _errno.ECONNRESET
_MSG_DONTWAIT = getattr(_socket, "MSG_DONTWAIT", 0x40)
_MSG_NOSIGNAL = getattr(_socket, "MSG_NOSIGNAL", 0x4000)
_POLLIN, _POLLOUT = 0x1, 0x4
_CLOCK_MONOTONIC = getattr(time, "CLOCK_MONOTONIC", 1)
_LOW48 = (1 << 48) - 1  # a header's magic and version, without its op or status

# libc, by symbol name (resolved when the kernel is linked, so the compiled kernels cache like any other).
_ssize, _int, _ptr = types.intp, types.intc, types.uintp
_send = types.ExternalFunction("send", _ssize(_int, _ptr, _ptr, _int))
_recv = types.ExternalFunction("recv", _ssize(_int, _ptr, _ptr, _int))
_recvmsg = types.ExternalFunction("recvmsg", _ssize(_int, _ptr, _int))
_read = types.ExternalFunction("read", _ssize(_int, _ptr, _ptr))
_poll = types.ExternalFunction("poll", _int(_ptr, _ptr, _int))
_clock_gettime = types.ExternalFunction("clock_gettime", _int(_int, _ptr))
_errno_location = types.ExternalFunction("__errno_location", types.CPointer(_int)())


@njit(cache=True, nogil=True)
def _errno():
    return carray(_errno_location(), (1,))[0]


@njit(cache=True, nogil=True)
def _now_ns(scratch, at):
    # CLOCK_MONOTONIC in ns (time.monotonic's clock); scratch[at:at + 2] holds the timespec.
    _clock_gettime(_CLOCK_MONOTONIC, scratch.ctypes.data + 8 * at)
    return scratch[at + TS_SEC] * 1_000_000_000 + scratch[at + TS_NSEC]


@njit(cache=True, nogil=True)
def _wait_fd(fd, events, deadline_ns, interruptible, scratch, at_time, at_poll):
    # Poll fd for events until deadline_ns: OK once it is ready (or failed: the next call says how), TIMEOUT when
    # the deadline passed, INTERRUPTED on a signal if interruptible. The pollfd at scratch[at_poll], the timespec
    # at scratch[at_time:at_time + 2].
    while True:
        now = _now_ns(scratch, at_time)
        if now >= deadline_ns:
            return TIMEOUT
        scratch[at_poll] = fd | (events << POLL_EVENTS_SHIFT)
        r = _poll(scratch.ctypes.data + 8 * at_poll, 1, (deadline_ns - now + 999_999) // 1_000_000)
        if r > 0:
            return OK
        if r < 0:
            if _errno() != _EINTR:
                return OK
            if interruptible:
                return INTERRUPTED


@njit(cache=True, nogil=True)
def _send_all(fd, address, nbytes, deadline_ns, interruptible, scratch, at_time, at_poll):
    # Send nbytes from address: OK, CLOSED (reset or broken pipe), TIMEOUT (not taken by the deadline), FAILED, or
    # INTERRUPTED (a signal, if interruptible). A blocking socket waits in send (bounded by its own send timeout),
    # a non-blocking one in poll.
    sent = 0
    while sent < nbytes:
        k = _send(fd, address + sent, nbytes - sent, _MSG_NOSIGNAL)
        if k > 0:
            sent += k
            if sent < nbytes and _now_ns(scratch, at_time) > deadline_ns:
                return TIMEOUT
            continue
        e = _errno()
        if k < 0 and e == _EINTR:
            if interruptible:
                return INTERRUPTED
            continue
        if k < 0 and e == _EAGAIN:
            status = _wait_fd(fd, _POLLOUT, deadline_ns, interruptible, scratch, at_time, at_poll)
            if status != OK:
                return status
            continue
        if k < 0 and (e == _EPIPE or e == _ECONNRESET):
            return CLOSED
        return FAILED
    return OK


# ---- the client: one lookup read ---------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _direct_request(ids, plan, row_bytes, kind, request_id, words):
    # The request of a direct read into words (int64): header, the checks, then one (offset, row_bytes) per
    # (m, listed head) in output order. plan: [K, C, order[K], bases[K], limits[K], checks[2C, 2] flat]. Returns
    # its bytes, -1 when words is too small, -2 when an id is outside [0, its head's limit).
    M = ids.shape[0]
    K = plan[PLAN_K]
    C = plan[PLAN_C]
    order, bases, limits, c0 = PLAN_ORDER, PLAN_ORDER + K, PLAN_ORDER + 2 * K, PLAN_ORDER + 3 * K
    count = C + M * K
    if HEADER_WORDS + PAIR_WORDS * count > words.size:
        return -1
    words[H_KIND] = kind
    words[H_REQUEST_ID] = request_id
    words[H_COUNT] = count
    p = HEADER_WORDS
    for i in range(PAIR_WORDS * C):
        words[p + i] = plan[c0 + i]
    p += PAIR_WORDS * C
    for m in range(M):
        for k in range(K):
            row = ids[m, plan[order + k]]
            if row < 0 or row >= plan[limits + k]:
                return -2
            words[p] = plan[bases + k] + row * row_bytes
            words[p + 1] = row_bytes
            p += PAIR_WORDS
    return 8 * p


@njit(cache=True, nogil=True)
def read_direct_unchecked(fd, ids, plan, row_bytes, request_id, buf, out):
    # buf: the channel's buffer (see client_buffer): CLIENT_WORDS words of its own, then the request.
    words = buf[:buf.size - buf.size % 8].view(np.int64)
    nbytes = _direct_request(ids, plan, row_bytes, words[C_KIND], request_id, words[CLIENT_WORDS:])
    if nbytes < 0:
        return NO_ROOM if nbytes == -1 else BAD_ID
    expected = ids.shape[0] * plan[PLAN_K] * row_bytes
    if out.size < expected:
        return NO_ROOM
    deadline = _now_ns(words, C_TIME) + words[C_TIMEOUT_NS]
    base = buf.ctypes.data
    status = _send_all(fd, base + 8 * CLIENT_WORDS, nbytes, deadline, True, words, C_TIME, C_POLL)
    if status != OK:
        return status
    # The reply: its header into words[C_HEAD:C_HEAD + HEADER_WORDS], its rows straight into out; both in one
    # recvmsg where they arrived together (the msghdr at C_MSGHDR names the two iovecs at C_IOV).
    head = base + 8 * C_HEAD
    words[C_MSGHDR + M_NAME] = 0
    words[C_MSGHDR + M_NAMELEN] = 0
    words[C_MSGHDR + M_IOV] = base + 8 * C_IOV
    words[C_MSGHDR + M_IOVLEN] = C_IOVECS
    words[C_MSGHDR + M_CONTROL] = 0
    words[C_MSGHDR + M_CONTROLLEN] = 0
    words[C_MSGHDR + M_FLAGS] = 0
    words[C_IOV + IOV_BASE] = head
    words[C_IOV + IOV_LEN] = HEADER_BYTES
    words[C_IOV + IOVEC_WORDS + IOV_BASE] = out.ctypes.data
    words[C_IOV + IOVEC_WORDS + IOV_LEN] = expected
    ok_kind = words[C_OK_KIND]
    total = HEADER_BYTES + expected
    got = 0
    checked = False
    while got < total:
        if got == 0:
            k = _recvmsg(fd, base + 8 * C_MSGHDR, 0)
        elif got < HEADER_BYTES:
            k = _recv(fd, head + got, HEADER_BYTES - got, 0)
        else:
            k = _recv(fd, out.ctypes.data + (got - HEADER_BYTES), total - got, 0)
        if k > 0:
            got += k
            if not checked and got >= HEADER_BYTES:
                checked = True
                if words[C_HEAD + H_KIND] != ok_kind:
                    return REFUSED if (words[C_HEAD + H_KIND] & _LOW48) == (ok_kind & _LOW48) else PROTOCOL
                if words[C_HEAD + H_REQUEST_ID] != request_id or words[C_HEAD + H_COUNT] != expected:
                    return PROTOCOL
            if got < total and _now_ns(words, C_TIME) > deadline:
                return TIMEOUT
            continue
        e = _errno()
        if k < 0 and e == _EINTR:
            return INTERRUPTED  # the caller's signal handlers run (Ctrl-C ends a stuck lookup), then it reads again
        if k < 0 and e == _EAGAIN:  # a blocking socket's receive timeout ran out, or a non-blocking one is empty
            status = _wait_fd(fd, _POLLIN, deadline, True, words, C_TIME, C_POLL)
            if status != OK:
                return status
            continue
        if got == 0 and (k == 0 or e == _ECONNRESET):
            return CLOSED
        return FAILED
    return OK


def client_buffer(request_bytes: int, kind: int, ok_kind: int, timeout_s: float) -> np.ndarray:
    """A channel's buffer for :func:`read_direct`: CLIENT_WORDS int64 words of the kernel's own (a msghdr, two
    iovecs, the reply header, a timespec, a pollfd, then the request's kind, a good reply's kind and the timeout),
    then room for a request of ``request_bytes``; 8-byte aligned uint8."""
    buf = np.zeros(8 * CLIENT_WORDS + request_bytes, dtype=np.uint8)
    words = buf[:8 * CLIENT_WORDS].view(np.int64)
    words[C_KIND], words[C_OK_KIND] = kind, ok_kind
    set_client_timeout(buf, timeout_s)
    return buf


def set_client_timeout(buf: np.ndarray, timeout_s: float) -> None:
    """How long :func:`read_direct` may take on this buffer's channel from now on."""
    buf[:8 * CLIENT_WORDS].view(np.int64)[C_TIMEOUT_NS] = int(timeout_s * 1e9)


def direct_read_plan(order: np.ndarray, bases: np.ndarray, checks: np.ndarray,
                     sizes: np.ndarray | None = None) -> np.ndarray:
    """What :func:`read_direct` needs of a placement, in one int64 array: ``[K, C, order[K], bases[K], limits[K],
    checks]`` (``order``: the K listed heads, ``bases``: where each one's table starts, ``checks``: int64 ``[C, 2]``,
    ``sizes``: each head's rows, by head id, so that a read of an id outside them sends nothing and answers BAD_ID;
    None: no limit)."""
    order = np.ascontiguousarray(order, dtype=np.int64)
    bases = np.ascontiguousarray(bases, dtype=np.int64)
    checks = np.ascontiguousarray(checks, dtype=np.int64).reshape(-1, PAIR_WORDS)
    if order.ndim != 1 or bases.shape != order.shape:
        raise ValueError(f"bases: expected {order.size} entries (one per listed head), got shape {bases.shape}")
    if sizes is None:
        limits = np.full(order.size, np.iinfo(np.int64).max, dtype=np.int64)
    else:
        sizes = np.ascontiguousarray(sizes, dtype=np.int64)
        if sizes.ndim != 1 or (order.size and int(order.max()) >= sizes.size):
            raise ValueError(f"sizes: expected the rows of every head up to {int(order.max(initial=-1))}, "
                             f"got shape {sizes.shape}")
        limits = sizes[order]
    return np.concatenate(([order.size, checks.shape[0]], order, bases, limits, checks.reshape(-1))).astype(np.int64)


def direct_request_bytes(ids: np.ndarray, plan: np.ndarray) -> int:
    """The bytes of the request :func:`read_direct` sends for ``ids`` under ``plan`` (what ``client_buffer`` needs
    room for)."""
    return HEADER_BYTES + PAIR_BYTES * (int(plan[PLAN_C]) + ids.shape[0] * int(plan[PLAN_K]))


def read_direct(fd: int, ids: np.ndarray, plan: np.ndarray, row_bytes: int, request_id: int, buf: np.ndarray,
                out: np.ndarray) -> int:
    """One lookup read on the socket ``fd``: send the request of the rows of ``ids`` (validated int64 ``[M, H]``)
    under ``plan`` (:func:`direct_read_plan`), built in ``buf`` (:func:`client_buffer`, which holds the kinds and
    the timeout too), and receive the reply's ``M * K * row_bytes`` bytes into ``out`` (uint8); returns OK or why
    not (see the module's answers; an id outside the plan's limits sends nothing: BAD_ID). The whole call waits
    about the buffer's timeout at most (a blocking socket's own timeouts bound each call in between). Hot paths
    call ``read_direct_unchecked`` with arguments prepared once."""
    if not (isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.ndim == 2 and ids.flags.c_contiguous):
        raise TypeError(f"ids: expected a C-contiguous int64 [M, H] array, got {getattr(ids, 'dtype', type(ids))}")
    for name, a, dtype in (("plan", plan, np.int64), ("buf", buf, np.uint8), ("out", out, np.uint8)):
        if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == 1 and a.flags.c_contiguous):
            raise TypeError(f"{name}: expected a contiguous 1-D {np.dtype(dtype)} array, got "
                            f"{getattr(a, 'dtype', type(a).__name__)} with shape {getattr(a, 'shape', None)}")
    if buf.size < 8 * CLIENT_WORDS or buf.ctypes.data % 8:
        raise ValueError(f"buf: expected an 8-byte aligned buffer of at least {8 * CLIENT_WORDS} bytes "
                         "(client_buffer makes one)")
    order = plan[PLAN_ORDER:PLAN_ORDER + int(plan[PLAN_K])]
    if ids.shape[0] and ids.shape[1] <= int(order.max(initial=-1)):
        raise ValueError(f"plan: lists head {int(order.max())}, ids have {ids.shape[1]} heads")
    return int(read_direct_unchecked(np.int64(fd), ids, plan, np.int64(row_bytes), np.int64(request_id), buf, out))


# ---- the segment: one read answered -----------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _wait_readable(fd, need_fd, linger_ms, sticky_ms, state):
    # Wait for fd: linger_ms watching it alone, then sticky_ms watching need_fd as well (a byte there: another
    # request wants this thread). 0 when fd is readable, else QUIET, NEEDED or RECHECK. pollfds at state[S_POLL]
    # (fd) and state[S_POLL + 1] (need_fd), the timespec at state[S_TIME].
    if linger_ms < 0:
        return QUIET
    now = _now_ns(state, S_TIME)
    linger_end = now + linger_ms * 1_000_000
    sticky_end = linger_end + sticky_ms * 1_000_000
    fds = state.ctypes.data + 8 * S_POLL
    state[S_POLL] = fd | (_POLLIN << POLL_EVENTS_SHIFT)
    state[S_POLL + 1] = need_fd | (_POLLIN << POLL_EVENTS_SHIFT)
    while True:
        if now < linger_end:
            n, end = 1, linger_end
        elif now < sticky_end:
            n, end = 2, sticky_end
        else:
            return QUIET
        r = _poll(fds, n, (end - now + 999_999) // 1_000_000)
        if r > 0:
            if (state[S_POLL] >> POLL_REVENTS_SHIFT) & 0xFFFF:
                return 0
            if n == 2 and (state[S_POLL + 1] >> POLL_REVENTS_SHIFT) & 0xFFFF:
                k = _read(need_fd, state.ctypes.data + 8 * S_TIME, 1)  # into state[S_TIME], rewritten below
                return NEEDED if k == 1 else RECHECK
        elif r < 0 and _errno() != _EINTR:
            return GONE
        now = _now_ns(state, S_TIME)


@njit(cache=True, nogil=True)
def _serve_one(fd, need_fd, linger_ms, sticky_ms, request, reply, segment, table, params, state):
    # Wait (as _wait_readable) for a whole read, answer it: SERVED (its serving time in the ring), or why not.
    start = state[START]
    end = state[END]
    words = request[:request.size - request.size % 8].view(np.int64)
    base = request.ctypes.data
    count = 0
    need = 0
    while True:  # until a whole read is in the buffer
        have = end - start
        if have >= HEADER_BYTES:
            w = start >> 3
            count = words[w + H_COUNT]
            if start % 8 or words[w + H_KIND] != params[P_READ_KIND] or count < 0 or count > params[P_MAX_RANGES]:
                break  # for the caller: a hello, another op, a bad header, or an unaligned start
            need = HEADER_BYTES + PAIR_BYTES * count
            if start + need > request.size or have >= need:
                break
        elif have == 0:
            start = end = 0
        if end >= request.size:
            break
        k = _recv(fd, base + end, request.size - end, _MSG_DONTWAIT)
        if k > 0:
            end += k
            continue
        if k == 0:
            return GONE
        e = _errno()
        if e == _EINTR:
            continue
        if e != _EAGAIN:
            return GONE
        if have > 0:
            break  # part of a message: the caller waits for the rest
        status = _wait_readable(fd, need_fd, linger_ms, sticky_ms, state)
        if status != 0:
            state[START] = start
            state[END] = end
            return status
    state[START] = start
    state[END] = end
    if end - start < HEADER_BYTES or start % 8 or words[(start >> 3) + H_KIND] != params[P_READ_KIND] or count < 0 \
            or count > params[P_MAX_RANGES] or start + need > request.size or end - start < need:
        return PYTHON
    t0 = _now_ns(state, S_TIME)
    p0 = (start >> 3) + HEADER_WORDS
    pairs = words[p0:p0 + PAIR_WORDS * count].reshape((count, PAIR_WORDS))
    K = 0
    while K < count and pairs[K, 0] < 0:
        K += 1
    seq = 0
    if K:
        if table.size == 0 or K % 2:
            return PYTHON
        bad, seq = _check_table(table, pairs[:K])
        if bad != HOLDS:
            return PYTHON  # stale (the caller says so), or the table cannot tell (the caller checks)
    ranges = pairs[K:]
    bad, total = _pairs_total(ranges, segment.size)
    if bad >= 0 or total > params[P_MAX_BYTES] or total > params[P_STREAM_MIN] \
            or (ranges.shape[0] == 1 and total >= params[P_STREAM_PIECE]) or HEADER_BYTES + total > reply.size:
        return PYTHON  # an error to explain, a reply sent in pieces, or one larger than the buffer
    _gather_pairs_any(segment, ranges, reply[HEADER_BYTES:HEADER_BYTES + total])
    if K and table[SEQ] != seq:  # a put claimed a range meanwhile: check again before a byte goes out
        bad, seq = _check_table(table, pairs[:K])
        if bad != HOLDS:
            return PYTHON
    head = reply[:HEADER_BYTES].view(np.int64)
    head[H_KIND] = params[P_OK_KIND]
    head[H_REQUEST_ID] = words[(start >> 3) + H_REQUEST_ID]
    head[H_COUNT] = total
    now = _now_ns(state, S_TIME)
    state[RING_AT + state[COUNT]] = now - t0
    deadline = now + params[P_SEND_TIMEOUT_NS] + total * 1_000_000_000 // params[P_SEND_MIN_RATE]
    status = _send_all(fd, reply.ctypes.data, HEADER_BYTES + total, deadline, False, state, S_TIME, S_POLL)
    if status == TIMEOUT:
        return SEND_TIMEOUT
    if status != OK:
        return GONE
    state[START] = start + need
    state[COUNT] += 1
    state[REQUEST_ID] = head[H_REQUEST_ID]
    state[TOTAL] = total
    return SERVED


@njit(cache=True, nogil=True)
def serve_read_unchecked(fd, need_fd, linger_ms, sticky_ms, settle_ms, request, reply, segment, table, params, state):
    # Answer reads until none comes within settle_ms of the last reply (or RING were answered): the caller's
    # bookkeeping then runs while the client takes its reply, not before the next request.
    state[COUNT] = 0
    status = _serve_one(fd, need_fd, linger_ms, sticky_ms, request, reply, segment, table, params, state)
    while status == SERVED and state[COUNT] < RING:
        status = _serve_one(fd, need_fd, 0, settle_ms, request, reply, segment, table, params, state)
    if status == QUIET and state[COUNT]:
        return SERVED
    return status


def serve_params(read_kind: int, ok_kind: int, max_ranges: int, max_bytes: int, stream_min_bytes: int,
                 stream_piece_bytes: int, send_timeout_s: float, send_min_bytes_per_s: int) -> np.ndarray:
    """:func:`serve_read`'s ``params``: the header kinds of a read and of a good reply, and the bounds."""
    if send_min_bytes_per_s < 1:
        raise ValueError(f"send_min_bytes_per_s: expected >= 1, got {send_min_bytes_per_s}")
    return np.array([read_kind, ok_kind, max_ranges, max_bytes, stream_min_bytes, stream_piece_bytes,
                     int(send_timeout_s * 1e9), send_min_bytes_per_s], dtype=np.int64)


def serve_read(fd: int, need_fd: int, linger_ms: int, sticky_ms: int, settle_ms: int, request: np.ndarray,
               reply: np.ndarray, segment: np.ndarray, table: np.ndarray, params: np.ndarray, state: np.ndarray) -> int:
    """Answer the reads that come on the blocking socket ``fd``; returns SERVED or why it stopped (see the module's
    answers), ``state[COUNT]`` saying how many it answered first (their serving times in ns at ``state[RING_AT:]``).

    ``request`` (uint8) holds the bytes received and not used yet at ``state[START]:state[END]`` and receives more
    (a client may send several reads ahead); with nothing there the kernel waits ``linger_ms`` (none if negative),
    then ``sticky_ms`` watching ``need_fd`` as well. A read whose checks the generation ``table`` (int64, as
    ``kernels.check_table`` reads it; empty: none) confirms, whose ranges lie in ``segment`` and whose reply fits
    ``reply`` behind the header and below the params' bounds is answered; anything else is left in ``request``
    for the caller (PYTHON). After a reply it answers the next read that comes within ``settle_ms`` (watching
    ``need_fd`` too), up to RING reads a call. ``params``: :func:`serve_params`; ``state``: int64 of
    SERVER_STATE_WORDS."""
    for name, a, dtype in (("request", request, np.uint8), ("reply", reply, np.uint8),
                           ("segment", segment, np.uint8), ("table", table, np.int64), ("params", params, np.int64),
                           ("state", state, np.int64)):
        if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == 1 and a.flags.c_contiguous):
            raise TypeError(f"{name}: expected a contiguous 1-D {np.dtype(dtype)} array, got "
                            f"{getattr(a, 'dtype', type(a).__name__)} with shape {getattr(a, 'shape', None)}")
    if state.size < SERVER_STATE_WORDS or params.size < SERVER_PARAMS:
        raise ValueError(f"state, params: expected {SERVER_STATE_WORDS} and {SERVER_PARAMS} words, got "
                         f"{state.size} and {params.size}")
    if request.ctypes.data % 8 or reply.ctypes.data % 8:
        raise ValueError("request, reply: expected 8-byte aligned buffers")
    if not 0 <= state[START] <= state[END] <= request.size:
        raise ValueError(f"state: expected 0 <= start <= end <= {request.size}, got {state[START]}, {state[END]}")
    return int(serve_read_unchecked(np.int64(fd), np.int64(need_fd), np.int64(linger_ms), np.int64(sticky_ms),
                           np.int64(settle_ms), request, reply, segment, table, params, state))
