"""Helpers shared by ``bench_store.py`` and ``bench_engram_store.py``.

Timing (``measure`` runs a call until it has enough repetitions, ``Stats`` summarises them), table printing,
JSON output with the machine and the command line, and the processes a benchmark talks to: a master with
``engram-segment`` processes (through :class:`engram_store.testing.Cluster`, which waits for each to answer a
ping and kills and reaps them all on exit) and a raw ZeroMQ echo server.

Run as a script with ``--echo-server`` it *is* that echo server (see :func:`echo_server_main`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: Liveness is not under test here: a busy 2-core machine must not get a segment declared dead mid-run.
HEARTBEAT_TIMEOUT_S = 60.0
#: Longest time any one store call may take (a 64 MiB put on a loaded machine stays far below).
TIMEOUT_MS = 60_000
#: The largest reply the echo server can send.
ECHO_MAX_BYTES = 64 << 20
START_TIMEOUT_S = 60.0


# ---- timing ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    """Latency of repeated calls, in microseconds."""

    reps: int
    mean_us: float
    p50_us: float
    p99_us: float
    min_us: float

    @classmethod
    def from_ns(cls, times_ns: Sequence[int]) -> "Stats":
        assert len(times_ns) > 0, "Stats.from_ns: no samples"
        t = np.asarray(times_ns, dtype=np.float64) / 1e3
        return cls(len(t), float(t.mean()), float(np.percentile(t, 50)), float(np.percentile(t, 99)),
                   float(t.min()))

    def as_dict(self) -> dict:
        return asdict(self)


def time_ns(fn: Callable[[int], object], *, min_reps: int, min_time_s: float, max_reps: int = 100_000,
            between: Callable[[int], object] | None = None, start: int = 0) -> list[int]:
    """Durations (ns) of ``fn(i)``, ``i = start, start + 1, ...``, until ``min_reps`` calls and ``min_time_s`` passed.

    ``between(i)`` runs after each timed call, untimed (e.g. removing the key a put just wrote).
    """
    assert min_reps >= 1 and max_reps >= min_reps, f"time_ns: bad rep bounds {min_reps}..{max_reps}"
    times: list[int] = []
    spent_ns = 0
    budget_ns = int(min_time_s * 1e9)
    i = start
    while len(times) < max_reps and (len(times) < min_reps or spent_ns < budget_ns):
        t0 = time.perf_counter_ns()
        fn(i)
        dt = time.perf_counter_ns() - t0
        times.append(dt)
        spent_ns += dt
        if between is not None:
            between(i)
        i += 1
    return times


def measure(fn: Callable[[int], object], *, warmup: int, min_reps: int, min_time_s: float,
            max_reps: int = 100_000, between: Callable[[int], object] | None = None) -> Stats:
    """Time ``fn(i)`` with ``time.perf_counter_ns`` (see :func:`time_ns`) after ``warmup`` untimed calls.

    The warm-up compiles kernels, caches placements and touches pages, so the timed calls see steady state.
    """
    for i in range(warmup):
        fn(-1 - i)
        if between is not None:
            between(-1 - i)
    return Stats.from_ns(time_ns(fn, min_reps=min_reps, min_time_s=min_time_s, max_reps=max_reps,
                                 between=between))


# ---- output ---------------------------------------------------------------------------------------------


def interleaved_times(cands: dict[str, Callable[[int], object]], rounds: int, sets: int) -> dict[str, np.ndarray]:
    """Microseconds of each call of each candidate ``fn(set_index)``, calls interleaved round by round (each candidate
    once per round, the order turning each round: none always follows the same one). Every call reads an id set of
    its own, the sets ``0 .. sets - 2`` in turn (set ``sets - 1`` warms each candidate first: compile, map): no
    candidate finds rows that the one before it brought into the CPU's caches, and over the rounds each reads
    them all."""
    for fn in cands.values():
        fn(sets - 1)
    times: dict[str, list[float]] = {name: [] for name in cands}
    items = list(cands.items())
    for r in range(rounds):
        for i in range(len(items)):
            name, fn = items[(i + r) % len(items)]
            t0 = time.perf_counter_ns()
            fn((r * len(items) + i) % (sets - 1))
            times[name].append((time.perf_counter_ns() - t0) / 1e3)
    return {name: np.array(v) for name, v in times.items()}


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None) -> None:
    """Print rows under headers, each column right-aligned to its widest cell (first column left-aligned)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[j]) for r in cells) for j in range(len(headers))]
    if title:
        print(f"\n{title}")
    for n, row in enumerate(cells):
        line = "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths)))
        print(line.rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


def fmt(x: float | None, digits: int = 1) -> str:
    """A number for a table cell: ``-`` for a missing one, thousands separated above 10,000."""
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "-"
    if abs(x) >= 10_000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def size_label(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def machine_info() -> dict:
    import numba
    import zmq

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
    }


def default_json_path(name: str) -> str:
    return os.path.join(RESULTS_DIR, f"{name}.json")


def write_json(path: str, payload: dict) -> None:
    """Write ``payload`` with the command line and machine info added; create the directory."""
    record = {"command": " ".join([sys.executable] + sys.argv), "machine": machine_info(), **payload}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    print(f"\nwrote {path}")


# ---- processes ------------------------------------------------------------------------------------------


def start_cluster(segments: int = 1, segment_size: int = 1 << 30):
    """A master and ``segments`` ``engram-segment`` processes on 127.0.0.1; ``close()`` kills and reaps them.

    Use it as a context manager (``with start_cluster(...) as cluster:``); ``cluster.address`` is the master.
    The master reuses removed objects' space at once (``--reuse-delay 0``): the benchmarks put and remove
    in a loop and no reader holds an old placement.
    """
    from engram_store.testing import Cluster

    return Cluster(segments=segments, segment_size=str(int(segment_size)),
                   heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, extra=["--reuse-delay", "0"])


class EchoServer:
    """A raw ZeroMQ ROUTER in its own process that answers ``n`` (8 bytes, little-endian) with ``n`` bytes.

    The floor for any network read on this machine: one request, one reply frame, no header to unpack,
    no range checking, the payload sent zero-copy from a preallocated buffer. A context manager.
    """

    MODE = "--echo-server"

    def __init__(self):
        self.popen = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), self.MODE],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            line = self._ready_line()
            # "echo-server ready on 127.0.0.1:PORT" (or "frame-echo ready on ...")
            self.address = line.split()[-1]
        except BaseException:
            self.close()
            raise

    def _ready_line(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        buf = b""
        while not buf.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError("echo server: no ready line within the start timeout")
            ready, _, _ = select.select([self.popen.stdout], [], [], min(remaining, 0.5))
            if ready:
                chunk = os.read(self.popen.stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(f"echo server exited before it was ready (code {self.popen.poll()})")
                buf += chunk
        return buf.decode().strip()

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=30)
        if self.popen.stdout is not None:
            self.popen.stdout.close()

    def __enter__(self) -> "EchoServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EchoClient:
    """A DEALER to an :class:`EchoServer`; :meth:`read_into` is one round trip landing in a caller buffer."""

    def __init__(self, address: str, timeout_ms: int = TIMEOUT_MS):
        import zmq

        self._zmq = zmq
        self.timeout_ms = timeout_ms
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://{address}")
        self.address = address

    def read_into(self, buffer: np.ndarray, nbytes: int) -> int:
        self.socket.send(int(nbytes).to_bytes(8, "little"))
        if not self.socket.poll(self.timeout_ms, self._zmq.POLLIN):
            raise TimeoutError(f"echo server {self.address}: no reply within {self.timeout_ms} ms")
        got = self.socket.recv_into(buffer, nbytes=nbytes)  # one copy: zmq's message -> the caller's buffer
        assert got == nbytes, f"echo server {self.address}: sent {got} bytes, expected {nbytes}"
        return got

    def close(self) -> None:
        self.socket.close(0)

    def __enter__(self) -> "EchoClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FrameEcho(EchoServer):
    """A bare pyzmq ROUTER in its own process that answers a request of any frames with a short header frame
    and ``n`` payload bytes, ``n`` read from the first 8 bytes (little-endian) of the request's first frame.

    The floor of a remote lookup: the same frames go out and come back as for a ``read_ranges`` request, and
    the server does nothing but receive and send (small payloads copied, large ones zero-copy from a
    preallocated buffer, as the segment sends its gathers). A context manager.
    """

    MODE = "--frame-echo"


class FrameEchoClient:
    """A DEALER to a :class:`FrameEcho`; :meth:`round_trip` sends the given frames and waits for the reply."""

    def __init__(self, address: str, timeout_ms: int = TIMEOUT_MS):
        import zmq

        self._zmq = zmq
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
        self.socket.connect(f"tcp://{address}")
        self.address = address

    def round_trip(self, header: bytes, payload: bytes, reply_bytes: int) -> list:
        """Send ``[header, payload]`` (header's first 8 bytes: ``reply_bytes``); return the reply frames."""
        self.socket.send_multipart((header, payload), copy=len(payload) < ZERO_COPY_BYTES)
        frames = self.socket.recv_multipart(copy=reply_bytes < ZERO_COPY_BYTES)
        assert len(frames) == 2, f"frame echo {self.address}: expected 2 reply frames, got {len(frames)}"
        return frames

    def close(self) -> None:
        self.socket.close(0)

    def __enter__(self) -> "FrameEchoClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: Frames at least this large are sent and received without a copy (as the store's client and segment do).
ZERO_COPY_BYTES = 64 << 10


class TcpEcho(EchoServer):
    """A bare TCP server in its own process (Python, blocking sockets, a thread per connection) that answers a
    message of a 24-byte header and ``count`` 16-byte items with a 24-byte header and ``n`` payload bytes,
    ``count`` and ``n`` read from the request header: the same bytes as the store's raw read channel moves,
    with no checks and no gather. The floor of a remote lookup over TCP. A context manager.
    """

    MODE = "--tcp-echo"


class TcpEchoClient:
    """A blocking TCP connection to a :class:`TcpEcho`; :meth:`round_trip` sends one request, waits for the reply."""

    _HEADER = struct.Struct("<4sHHQQ")

    def __init__(self, address: str, timeout_ms: int = TIMEOUT_MS):
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_ms / 1000)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.address = address
        self._reply = np.empty(ECHO_MAX_BYTES + self._HEADER.size, dtype=np.uint8)

    def round_trip(self, pairs: bytes, reply_bytes: int) -> None:
        """Send a header asking for ``reply_bytes`` and ``pairs``; receive the header and the bytes."""
        self.sock.sendall(self._HEADER.pack(b"ENGR", 1, 1, reply_bytes, len(pairs) // 16) + pairs)
        view = memoryview(self._reply)[:self._HEADER.size + reply_bytes]
        got = 0
        while got < view.nbytes:
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError(f"tcp echo {self.address} closed the connection")
            got += n

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "TcpEchoClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tcp_echo_main() -> int:
    import threading

    from engram_store.raw.frame import sendmsg_all as _sendmsg_all  # every byte of a large reply, without copying the payload

    header = struct.Struct("<4sHHQQ")
    payload = np.full(ECHO_MAX_BYTES, 7, dtype=np.uint8)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"tcp-echo ready on 127.0.0.1:{listener.getsockname()[1]}", flush=True)

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        while True:
            got = 0
            while got < header.size:  # the header, and usually the body with it
                n = conn.recv_into(view[got:])
                if n == 0:
                    return
                got += n
            _, _, _, nbytes, count = header.unpack_from(buf)
            need = header.size + 16 * count
            if need > len(buf):  # a request larger than any before: grow the buffer, keep what arrived
                buf = bytearray(buf[:got]) + bytearray(need - got)
                view = memoryview(buf)
            while got < need:
                n = conn.recv_into(view[got:need])
                if n == 0:
                    return
                got += n
            nbytes = min(nbytes, ECHO_MAX_BYTES)
            _sendmsg_all(conn, [header.pack(b"ENGR", 1, 0, 0, nbytes), memoryview(payload)[:nbytes]])

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _zmq_echo(name: str, reply) -> int:
    """Serve a ROUTER on a free loopback port until killed: ``reply(identity, frames, payload)`` answers each
    request (``payload``: ECHO_MAX_BYTES of preallocated bytes to send from)."""
    import zmq

    payload = np.full(ECHO_MAX_BYTES, 7, dtype=np.uint8)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"{name} ready on 127.0.0.1:{port}", flush=True)
    try:
        while True:
            identity, *frames = sock.recv_multipart()
            reply(sock, identity, frames, payload)
    finally:
        sock.close(0)


def frame_echo_main() -> int:
    import msgpack

    header = msgpack.packb({"v": 1, "id": 1 << 20, "ok": True, "bytes": 1 << 20})  # a reply header's size

    def reply(sock, identity, frames, payload) -> None:
        n = min(int.from_bytes(frames[0][:8], "little"), ECHO_MAX_BYTES)
        sock.send_multipart((identity, header, memoryview(payload[:n])), copy=n < ZERO_COPY_BYTES)

    return _zmq_echo("frame-echo", reply)


def echo_server_main() -> int:
    def reply(sock, identity, frames, payload) -> None:
        n = min(int.from_bytes(frames[0][:8], "little"), ECHO_MAX_BYTES)
        sock.send_multipart([identity, memoryview(payload[:n])], copy=False)

    return _zmq_echo("echo-server", reply)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="benchmark helpers; --echo-server runs the raw ZeroMQ echo server")
    parser.add_argument("--echo-server", action="store_true")
    parser.add_argument("--frame-echo", action="store_true")
    parser.add_argument("--tcp-echo", action="store_true")
    parsed = parser.parse_args()
    if parsed.tcp_echo:
        sys.exit(tcp_echo_main())
    if parsed.echo_server:
        sys.exit(echo_server_main())
    if parsed.frame_echo:
        sys.exit(frame_echo_main())
    parser.print_help()
