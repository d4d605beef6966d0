"""Helpers every folder of the suite may use (see conftest.py for the conventions)."""
import json
import os
import threading
import time
from typing import Callable

import zmq


def fill_up(path: str) -> None:
    """Take every page left on the file system of ``path`` (a file that grows until the system says no)."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY)
    try:
        for size in (1 << 20, 64 << 10, 4 << 10):
            while True:
                try:
                    os.posix_fallocate(fd, os.fstat(fd).st_size, size)
                except OSError:
                    break
    finally:
        os.close(fd)


def zmq_request(address: str, frames: list, timeout_ms: int = 5000) -> list[bytes] | None:
    """Send ``frames`` as they are to the ZeroMQ server at ``address`` (a DEALER of its own); the reply's frames,
    or None when none came within ``timeout_ms``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    try:
        sock.send_multipart(frames)
        if not sock.poll(timeout_ms):
            return None
        return sock.recv_multipart()
    finally:
        sock.close(0)


def manifest_objects(path: str) -> int:
    """How many objects the catalogue next to the segment file ``path`` lists; -1 where there is none to read."""
    try:
        with open(path + ".manifest", encoding="utf-8") as f:
            return len(json.load(f)["objects"])
    except (OSError, ValueError):
        return -1


def segment_memory(pid: int) -> str:
    """A path through /proc to the memory of the segment process ``pid`` (its memfd), for a test that changes bytes
    behind the segment's back (it opens even while the segment is stopped)."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"/memfd:engram-segment-{pid}"):
            return f"/proc/{pid}/fd/{fd}"
    raise AssertionError(f"segment process {pid} holds no segment memory")


def run_threads(work: Callable[[int], None], count: int, timeout_s: float, what: str = "a thread") -> None:
    """Run ``work(0)`` .. ``work(count - 1)`` in threads at once and wait for them: a thread still running after
    ``timeout_s`` fails the test, and so does the first exception any of them raised."""
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            work(seed)
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
        assert not t.is_alive(), f"{what} did not finish within {timeout_s:g} s"
    assert not errors, errors[0]


def read_ranges_served(store, timeout_s: float = 10.0) -> int:
    """read_ranges requests the embedded segment of ``store`` has served so far, once the count has held still for
    longer than a serving thread may keep reads it answered natively out of the metrics (it counts them when no
    other read came within ``SETTLE_S`` of the last reply, or after 64)."""
    from engram_store.segment import _raw_limits as limits

    def count() -> int:
        return sum(int(float(line.split()[-1])) for line in store.local_segment.server.metrics.render()
                   if line.startswith('engram_requests_total{op="read_ranges"}'))

    quiet_s = limits.SETTLE_S + 0.1
    deadline = time.monotonic() + timeout_s
    last = count()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = count()
        if now == last:
            return now
        last = now
    return last
