"""llvmlite's process-wide lock, made safe against a KeyboardInterrupt.

Numba calls into LLVM (llvmlite) under one re-entrant lock, which ``_LLVMLock.__enter__`` takes before it runs its
callbacks. A KeyboardInterrupt raised in the main thread inside that ``__enter__``, after the lock is taken and
before ``__exit__`` can run (a Ctrl-C while a kernel loads from the disk cache, as in a notebook), leaves the lock
held by the main thread for good: the main thread goes on (the lock is re-entrant), and every other thread that
loads a kernel afterwards (a lookup with ``background=True``, a serving thread) waits for it forever. The fault
explorer found it (seed 972443: a reload's reader thread blocked in ``_LLVMLock.__enter__`` a second after a SIGINT
had interrupted its process's lookup). :func:`make_interrupt_safe` gives the lock an ``__enter__`` that lets go of
what it took when it is interrupted, and an ``__exit__`` that lets go whatever its callbacks raise.
"""
from __future__ import annotations


def make_interrupt_safe() -> bool:
    """Patch llvmlite's ``_LLVMLock`` (once); False where llvmlite has no such class (a version of another shape:
    left as it is)."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return False
    cls = getattr(ffi, "_LLVMLock", None)
    if cls is None or getattr(cls, "_interrupt_safe", False) or not hasattr(ffi.lib, "_lock") \
            or not hasattr(getattr(ffi.lib._lock, "_lock", None), "_is_owned"):
        return False

    def __enter__(self):
        held = self._lock._is_owned()  # (re-entered by a callback: the outer level lets go)
        try:
            self._lock.acquire()
            for acquired, _ in self._cblist:
                acquired()
        except BaseException:
            if not held and self._lock._is_owned():
                self._lock.release()
            raise

    def __exit__(self, *exc_details):
        try:
            for _, released in self._cblist:
                released()
        finally:
            self._lock.release()

    cls.__enter__, cls.__exit__, cls._interrupt_safe = __enter__, __exit__, True
    return True
