"""Process-wide thread pools, and work split over them.

Gathers and checksums release the GIL, so a large one runs on several threads. Each use has one pool per process
(:class:`SharedPool`), grown to the most workers any caller asked for, and made afresh in a forked child: the
child's copy of a pool has no threads, so work handed to it would never be done (see ``engram_store._fork``).
:func:`split` runs ``work(lo, hi)`` over a range in parts, the first on the calling thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from . import _fork


class SharedPool:
    """A pool for one use (``prefix`` names its threads; one per process, or one per owner that closes it), grown
    to the most workers asked for."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0
        _fork.in_child(self._forked)

    def get(self, workers: int = 1) -> ThreadPoolExecutor:
        """The pool, with at least ``workers`` threads."""
        with self._lock:
            if self._pool is None or self._size < workers:
                old = self._pool
                self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=self.prefix)
                self._size = workers
                if old is not None:
                    old.shutdown(wait=False)
            return self._pool

    def close(self) -> None:
        """Wait for the work handed to the pool and stop its threads; a later :meth:`get` makes a new one."""
        with self._lock:
            pool, self._pool, self._size = self._pool, None, 0
        if pool is not None:
            pool.shutdown(wait=True)

    def _forked(self) -> None:
        """In a forked child: the parent's pool has no thread here; the child makes its own on first use."""
        _fork.keep(self._pool)
        self._pool, self._size, self._lock = None, 0, threading.Lock()


def split(work: Callable[[int, int], Any], n: int, threads: int, pool: SharedPool) -> list:
    """``work(lo, hi)`` over ``range(n)`` in ``threads`` parts, the first on this thread and the others on
    ``pool``; their results in order."""
    if threads <= 1:
        return [work(0, n)]
    step = -(-n // threads)
    executor = pool.get(threads - 1)
    parts = [executor.submit(work, lo, min(n, lo + step)) for lo in range(step, n, step)]
    first = work(0, min(n, step))
    return [first, *(part.result() for part in parts)]
