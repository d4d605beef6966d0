"""The raw channel's serving threads: a bounded set that receives a read's ranges, gathers (GIL-free) and sends,
then waits on the connection for its next request (see :mod:`._server`)."""

from __future__ import annotations

import logging
import os
import queue
import select
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import kernels as _kernels
from ..errors import EngramError, InvalidArgument
from .._sched import prefer_short_slice
from ..kernels.raw_io import GONE as GONE_NATIVE
from ..kernels.raw_io import COUNT, PYTHON, RAW_IO, RECHECK, RING_AT, SEND_TIMEOUT, SERVED, serve_read_unchecked
from ..kernels.raw_io import QUIET as QUIET_NATIVE
from ..wire import REFUSALS
from .frame import (HEADER, MAGIC, OP_READ, PAIR_BYTES, STATUS_OK, VERSION, error_reply, request_id_of,
                    sendmsg_all)
from . import limits
from ._state import GONE, READY, WAIT, Buffers, Conn

log = logging.getLogger("engram_store.raw._server")
#: The generation table of a server without one: a read that names objects is then checked in Python.
_NO_TABLE = np.zeros(0, dtype=np.int64)


class Serving:
    """The serving threads of a :class:`~._server.RawReadServer` (a mixin: the server holds their state)."""

    def _dispatch(self, c: Conn) -> None:
        with self._lock:
            self._busy.add(c)
            self._queued += 1
            short = self._queued > self._idle_threads
            spawn = short and self._threads < self.serving_threads
            if spawn:
                self._threads += 1
            nudge = short and not spawn and self._lingering > 0
        self._work.put(c)
        if nudge:
            try:
                os.write(self._need_w, b"\0")
            except OSError:
                pass  # full: lingering threads have been asked already
        if spawn:
            threading.Thread(target=self._serving_thread, name=f"engram-raw-{self.name}-serve",
                             daemon=True).start()

    def _serving_thread(self) -> None:
        prefer_short_slice(limits.SERVING_SLICE_S)
        bufs = Buffers()
        while True:
            with self._lock:
                self._idle_threads += 1
            try:
                c = self._work.get(timeout=limits.SERVING_IDLE_S)
            except queue.Empty:
                c = False
            with self._lock:
                self._idle_threads -= 1
                if c:
                    self._queued -= 1
            if c is None:
                return  # closing
            if c is False:
                bufs.drop()  # idle: give the buffers back
                continue
            self._serve(c, bufs)

    def _serve(self, c: Conn, bufs: "Buffers") -> None:
        """Answer ``c``'s read (receiving its ranges first where the loop handed over a header), then the reads
        that follow: those already received at once, and while no other connection waits for a thread, those
        that come within limits.LINGER_S (then limits.STICKY_S); then hand ``c`` back to the loop (or close it).

        The reads that follow are answered by a kernel (``kernels.serve_read``: the wait, the receive, the
        checks, the gather and the send in one GIL-free call) wherever it can; what it leaves (a large or slow
        request, an error to explain, a reply sent in pieces) takes the Python path below."""
        alive = False
        sticky = False  # counted in _lingering: this thread waits on c between requests
        try:
            if c.complete():
                result = READY
            else:
                result = self._advance(c, socket.MSG_WAITALL, into=bufs.room(HEADER.size + PAIR_BYTES * c.count))
            if result != READY:
                alive = result == WAIT  # the ranges are slow: the loop receives the rest
            else:
                request: tuple | None = (c.request_id, c.body.view(np.int64).reshape(c.count, 2))
                while True:
                    if request is not None:
                        self._answer(c.sock, *request, bufs)
                        self._release(c)
                        c.next_message()
                    ahead = bufs.end > bufs.start  # sent before this reply: served now, whatever waits
                    if not ahead:
                        if self._closed or self._queued or not (sticky or self._start_linger()):
                            alive = True
                            break
                        sticky = True
                    status = self._serve_in_kernel(c, bufs, wait=sticky)
                    if status == SERVED:
                        request = None
                        continue
                    if status != PYTHON:
                        alive = status != GONE_NATIVE
                        break
                    request = self._next_request(c, bufs, wait=sticky)
                    if not isinstance(request, tuple):
                        alive = request == WAIT  # quiet, or part of a message: the loop waits for the rest
                        break
        except TimeoutError as exc:
            self._count("timeout_send")
            REFUSALS.refused(self._where, c.peer, str(exc))
        except OSError as exc:
            if isinstance(exc, BlockingIOError):  # a send that moved nothing for limits.SEND_TIMEOUT_S
                self._count("timeout_send")
                REFUSALS.refused(self._where, c.peer, f"a reply was not taken within {self.send_timeout_s:g} s")
            else:
                log.debug("%s: connection from %s ended: %s", self._where, c.peer, exc)
        except Exception:  # a bug: log it, drop this connection, keep serving the others
            log.exception("%s: serving a read from %s failed", self._where, c.peer)
        self._hand_back(c, bufs, alive, sticky)

    def _hand_back(self, c: Conn, bufs: "Buffers", alive: bool, sticky: bool) -> None:
        """After serving ``c``: empty the thread's buffers, close ``c`` unless it is ``alive`` (and the server
        open), and give it back to the event loop (``sticky``: this thread lingered on it)."""
        bufs.start = bufs.end = 0
        if not alive or self._closed:
            self._drop(c)
            alive = False
        c.last_active = time.monotonic()
        with self._lock:
            self._busy.discard(c)
            if sticky:
                self._lingering -= 1
        self._returns.append((c, alive))
        self._wake()

    def _serve_in_kernel(self, c: Conn, bufs: "Buffers", wait: bool) -> int:
        """Answer the next reads on ``c`` in the kernel (``kernels.serve_read``), waiting for the first
        (limits.LINGER_S, then limits.STICKY_S ready to give the thread up) if ``wait``, and the next ones that come
        within limits.SETTLE_S of a reply: SERVED (each counted in the metrics, as its reply went out), PYTHON (a
        message, or part of one, for the Python path, in ``bufs``), GONE_NATIVE (closed), or another status for a
        connection that goes back to the loop. A reply not taken in time raises TimeoutError."""
        if not RAW_IO:
            return PYTHON
        if bufs.request is None or bufs.end == bufs.start:
            bufs.room(HEADER.size + PAIR_BYTES * limits.SMALL_RANGES)
        state = bufs.state
        state[0], state[1] = bufs.start, bufs.end
        table = self.generations.table if self.generations is not None else None
        linger_ms, settle_ms = (int(limits.LINGER_S * 1000), int(limits.SETTLE_S * 1000)) if wait else (-1, -1)
        while True:
            status = serve_read_unchecked(c.sock.fileno(), self._need_r, linger_ms, int(limits.STICKY_S * 1000), settle_ms,
                                 bufs.request, bufs.reply_room(0), self.segment, _NO_TABLE if table is None else table,
                                 self._kernel_params, state)
            if self.metrics is not None:
                for ns in state[RING_AT:RING_AT + state[COUNT]].tolist():
                    self.metrics.record("read_ranges", ns / 1e9, True)
            if status != RECHECK or state[COUNT] or self._closed or self._queued:
                break  # (RECHECK: another lingering thread took the nudge; linger on while nothing waits)
        bufs.start, bufs.end = int(state[0]), int(state[1])
        if status == SEND_TIMEOUT:
            raise TimeoutError(f"a reply was not taken within {self.send_timeout_s:g} s")
        if status == RECHECK:
            return QUIET_NATIVE  # (answered some, then the nudge: the loop takes the connection)
        return status

    def _start_linger(self) -> bool:
        """Whether this thread may wait on its connection for the next request: not while requests wait for a
        thread, and never as the last thread that does not."""
        with self._lock:
            if self._queued or self._lingering + 1 >= self.serving_threads:
                return False
            self._lingering += 1
            return True

    def _linger_more(self, c: Conn) -> bool:
        """After limits.LINGER_S: wait up to limits.STICKY_S more for ``c`` to become readable (True), unless a request needs
        this thread first or the server closes (False)."""
        poller = select.poll()
        poller.register(c.sock, select.POLLIN)
        poller.register(self._need_r, select.POLLIN)
        deadline = time.monotonic() + limits.STICKY_S
        while not self._closed and not self._queued:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            for fd, _ in poller.poll(remaining * 1000):
                if fd != self._need_r:
                    return True
                try:
                    os.read(self._need_r, 1)
                    return False  # this thread goes to the waiting request
                except BlockingIOError:
                    pass  # another lingering thread went
        return False

    def _next_request(self, c: Conn, bufs: "Buffers", wait: bool) -> tuple | int:
        """The next read on ``c``: ``(request_id, pairs)``, or WAIT (nothing, or part of a message: the loop
        takes over) or GONE (closed). Bytes come into this thread's buffer as they are (a read of up to
        limits.REQUEST_KEEP_BYTES of ranges is served from there, the hot path; a client may have sent several);
        anything else takes the general way. ``wait``: wait limits.LINGER_S for bytes in a blocking receive, then
        limits.STICKY_S in poll; else take only what has come."""
        sock = c.sock
        while True:
            start = bufs.start
            have = bufs.end - start
            if have >= HEADER.size:
                rq = bufs.request
                magic, version, op, request_id, count = HEADER.unpack_from(rq, start)
                need = HEADER.size + PAIR_BYTES * count
                if op != OP_READ or magic != MAGIC or version != VERSION or count > self.max_ranges:
                    return self._general(c, bufs, wait)
                if have >= need and not start % 8:  # the hot path: a whole read, its ranges aligned
                    bufs.start = start + need
                    return request_id, rq[start + HEADER.size:start + need].view(np.int64).reshape(count, 2)
                if bufs.room(need) is None:  # too large for this thread's buffer
                    return self._general(c, bufs, wait)
                if have >= need:
                    continue  # moved to an aligned start
            elif have == 0 and bufs.request is not None:
                bufs.start = bufs.end = 0  # nothing kept: receive from the buffer's start
            else:
                bufs.room(HEADER.size + PAIR_BYTES * limits.SMALL_RANGES)
            view = memoryview(bufs.request)[bufs.end:]
            try:
                try:
                    n = sock.recv_into(view, 0, 0 if wait else socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    if not (wait and have == 0 and self._linger_more(c)):
                        raise
                    n = sock.recv_into(view, 0, socket.MSG_DONTWAIT)  # readable now: bytes, or the end
            except (BlockingIOError, InterruptedError):
                return self._general(c, bufs, False) if have else WAIT
            except OSError as exc:
                log.debug("%s: connection from %s ended: %s", self._where, c.peer, exc)
                return GONE
            if n == 0:
                return GONE
            bufs.end += n

    def _general(self, c: Conn, bufs: "Buffers", wait: bool) -> tuple | int:
        """The next message of ``c`` by _advance, from the bytes in this thread's buffer on: anything but a read
        that fits the buffer, or part of a message going back to the loop."""
        data = memoryview(bufs.request)[bufs.start:bufs.end]
        result = self._advance(c, socket.MSG_WAITALL if wait else socket.MSG_DONTWAIT, data)
        bufs.start += c.fed
        if result != READY:
            return result
        return c.request_id, c.body.view(np.int64).reshape(c.count, 2)

    def _answer(self, sock: socket.socket, request_id: int, pairs: np.ndarray, bufs: "Buffers") -> None:
        """Check and gather ``pairs``, send the reply (gathered behind its header in ``bufs.reply``, grown up to
        limits.STREAM_MIN_BYTES).

        The request is counted in the metrics before its reply goes out (so a client that has the reply sees it
        counted)."""
        start = time.perf_counter()
        checked, version = pairs, 0
        if pairs.shape[0] and pairs[0, 0] < 0:
            try:
                if self.generations is None:
                    raise InvalidArgument(f"read_ranges: negative offset {int(pairs[0, 0])} ({self.address})")
                pairs, version = self.generations.split(pairs, self.address)
            except EngramError as exc:
                return self._reply_error(sock, request_id, exc)
        bad, total = _kernels.check_pairs(self.segment, pairs)
        if bad >= 0:
            return self._reply_error(sock, request_id, InvalidArgument(
                f"read_ranges: range {bad} (offset {int(pairs[bad, 0])}, length {int(pairs[bad, 1])}) is outside "
                f"the segment of {self.segment.size} bytes ({self.address})"))
        if total > self.max_bytes:
            return self._reply_error(sock, request_id, InvalidArgument(
                f"read_ranges: {total} bytes requested, at most {self.max_bytes} per request ({self.address})"))
        timeout_s = self.send_timeout_s + total / limits.SEND_MIN_BYTES_PER_S
        if total > limits.STREAM_MIN_BYTES or (pairs.shape[0] == 1 and total >= limits.STREAM_PIECE_BYTES):
            head = HEADER.pack(MAGIC, VERSION, STATUS_OK, request_id, total)
            recheck = None if checked is pairs else (lambda: self.generations.recheck(checked, version, self.address))
            return self._stream(sock, head, pairs, total, start, bufs, timeout_s, recheck)
        buf = bufs.reply_room(total)  # the reply behind its header: one buffer, one send
        _kernels.gather_pairs_unchecked(self.segment, pairs, buf[HEADER.size:HEADER.size + total])
        if checked is not pairs:
            try:  # a put that wrote over a named object while we gathered: its bytes must not go out
                self.generations.recheck(checked, version, self.address)
            except EngramError as exc:
                return self._reply_error(sock, request_id, exc)
        HEADER.pack_into(buf, 0, MAGIC, VERSION, STATUS_OK, request_id, total)
        if self.metrics is not None:
            self.metrics.record("read_ranges", time.perf_counter() - start, True)
        sendmsg_all(sock, [buf[:HEADER.size + total]], timeout_s)

    def _stream(self, sock: socket.socket, head: bytes, pairs: np.ndarray, total: int, start: float,
                bufs: "Buffers", timeout_s: float, recheck: Any = None) -> None:
        """Send a large reply in pieces (see :func:`_kernels.plan_pieces`): a range of limits.STREAM_PIECE_BYTES or more
        straight from the segment, the others gathered into alternate halves of ``bufs.reply`` by a helper thread,
        piece k + 1 while piece k is sent, so the client receives while the rest is gathered. The reply on the
        wire is the same as in one piece. ``recheck`` (a read that named its objects) runs before each piece goes
        out: a put that wrote over them meanwhile ends the reply with an error (before the first piece) or by closing
        the connection (after it), never with its bytes."""
        bounds, sizes = _kernels.plan_pieces(pairs, total, limits.STREAM_PIECE_BYTES)
        lone = [(hi - lo == 1 and n >= limits.STREAM_PIECE_BYTES) for lo, hi, n in
                zip(bounds[:-1].tolist(), bounds[1:].tolist(), sizes.tolist())]
        halves: tuple = ()
        if not all(lone):
            buf = bufs.reply_room(2 * limits.STREAM_PIECE_BYTES)[HEADER.size:]
            halves = (buf[:limits.STREAM_PIECE_BYTES], buf[limits.STREAM_PIECE_BYTES:2 * limits.STREAM_PIECE_BYTES])
        half = []  # the half each gathered piece goes into: gathered pieces alternate
        g = 0
        for is_lone in lone:
            half.append(-1 if is_lone else g % 2)
            g += not is_lone
        segment = self.segment
        pool = self._gather_pool() if g > 1 else None

        def gather(k: int) -> np.ndarray:
            out = halves[half[k]][:int(sizes[k])]
            _kernels.gather_pairs_unchecked(segment, pairs[bounds[k]:bounds[k + 1]], out)
            return out

        def begin(k: int) -> Any:
            if half[k] < 0:
                offset = int(pairs[bounds[k], 0])
                return segment[offset:offset + int(sizes[k])]
            return pool.submit(gather, k) if pool is not None else gather(k)

        deadline = time.monotonic() + timeout_s
        pending = begin(0)
        try:
            for k in range(len(lone)):
                piece = pending.result() if isinstance(pending, Future) else pending
                if recheck is not None:
                    if half[k] < 0:  # straight from the segment: copy it before checking, then send the copy
                        piece = np.array(piece)
                    try:
                        recheck()
                    except EngramError as exc:
                        if k == 0:
                            return self._reply_error(sock, request_id_of(head), exc)
                        raise ConnectionAbortedError(str(exc)) from None
                # The other half's piece has been sent: gather piece k + 1 into it while this one goes out.
                pending = begin(k + 1) if k + 1 < len(lone) else None
                if k == 0:  # the header goes out with the first piece
                    if self.metrics is not None:
                        self.metrics.record("read_ranges", time.perf_counter() - start, True)
                    sendmsg_all(sock, [head, piece], deadline=deadline)
                else:
                    sendmsg_all(sock, [piece], deadline=deadline)
        finally:
            if isinstance(pending, Future):  # a failed send: let the gather finish before its buffer is reused
                pending.exception()

    def _gather_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1),
                                                thread_name_prefix=f"engram-raw-{self.name}-gather")
            return self._pool

    def _reply_error(self, sock: socket.socket, request_id: int, exc: Exception) -> None:
        """An error reply for a read whose framing holds: the connection keeps serving."""
        if self.metrics is not None:
            self.metrics.record("read_ranges", 0.0, False)
        sendmsg_all(sock, [error_reply(request_id, exc)], self.send_timeout_s)
