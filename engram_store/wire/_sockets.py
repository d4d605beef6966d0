"""This process's ZeroMQ context and its sockets, made so that running out of file descriptors is an error that
says so: libzmq aborts the whole process when its I/O threads find none, so the first socket of a context checks
that enough are free first (see :func:`new_socket`)."""

from __future__ import annotations

import os

import zmq

from ..errors import NO_FILES, StoreError, Unavailable, out_of_files, too_many_open_files


def _context() -> zmq.Context:
    return zmq.Context.instance()


#: Contexts (by id) whose I/O threads have started; see :func:`new_socket`.
_started: set[int] = set()


def new_socket(kind: int, what: str) -> zmq.Socket:
    """A socket of this process's context, for ``what`` (e.g. "connecting to HOST:PORT"). The context's first
    socket starts its I/O threads, each needing descriptors of its own, and libzmq aborts the whole process when
    it finds none (an assertion in its poller): where too few are left for them, this raises ResourceExhausted
    instead. A socket refused for want of one raises it too."""
    try:
        context = _context()
        if id(context) not in _started:
            if not _files_free(2 * int(context.get(zmq.IO_THREADS)) + 4):
                raise too_many_open_files(f"starting ZeroMQ's I/O threads ({what})")
            _started.add(id(context))
        return context.socket(kind)
    except zmq.ZMQError as exc:
        if exc.errno in NO_FILES:
            raise too_many_open_files(what) from exc
        raise


def _files_free(n: int) -> bool:
    """Whether ``n`` more file descriptors can be opened now (tried, then closed)."""
    fds = []
    try:
        for _ in range(n):
            fds.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        return True
    except OSError as exc:
        if exc.errno not in NO_FILES:
            raise
        return False
    finally:
        for fd in fds:
            os.close(fd)


def io_threads() -> int:
    """ZeroMQ I/O threads of this process's context (``zmq.Context.instance(io_threads=N)`` before any
    socket sets it; servers pin sockets to them with ``io_affinity``)."""
    return int(_context().get(zmq.IO_THREADS))


def failed(address: str, unavailable: type[Unavailable], what: str, exc: BaseException | None = None) -> StoreError:
    """The error of a request to ``address`` that failed (``what`` happened): ResourceExhausted where the cause is
    this process's open files (the connection could not be made, which reads as a peer that does not answer), else
    ``unavailable``."""
    if (isinstance(exc, zmq.ZMQError) and exc.errno in NO_FILES) or out_of_files():
        return too_many_open_files(f"a connection to {address}")
    return unavailable(what)
