"""Helpers every folder of the suite may use (see conftest.py for the conventions)."""
import os
import threading
from typing import Callable


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
