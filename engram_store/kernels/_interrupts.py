"""A Ctrl-C (SIGINT) while Numba loads or compiles one of engram's kernels, made safe.

Two faults the fault explorer found, both from a SIGINT in a client process at the wrong moment:

* llvmlite's process-wide lock. Numba calls into LLVM (llvmlite) under one re-entrant lock, which
  ``_LLVMLock.__enter__`` takes before it runs its callbacks. A KeyboardInterrupt raised in the main thread inside
  that ``__enter__``, after the lock is taken and before ``__exit__`` can run (a Ctrl-C while a kernel loads from the
  disk cache, as in a notebook), leaves the lock held by the main thread for good: the main thread goes on (the lock
  is re-entrant), and every other thread that loads a kernel afterwards (a lookup with ``background=True``, a
  serving thread) waits for it forever (seed 972443). :func:`make_interrupt_safe` gives the lock an ``__enter__``
  that lets go of what it took when it is interrupted, and an ``__exit__`` that lets go whatever its callbacks raise.
* Numba's compiler. A KeyboardInterrupt raised in the middle of a compile leaves state behind that breaks the next
  compile of the same kernel, or of any other: raised inside a callback from LLVM it is swallowed and the object code
  is missing ("RuntimeError: no compiled object yet for <Library 'split_from_span'>", the churn tour), raised while
  Numba registers its typing templates it leaves them half made ("TypingError: Unknown attribute 'shape' of type
  array(int64, 1d, C)" on the next call). :func:`defer_interrupts_while_compiling` makes a compile or cache load of
  one of engram's kernels in the main thread whole: a SIGINT that comes meanwhile is raised as KeyboardInterrupt as
  soon as it is done (a compile takes a few seconds at most; a load, milliseconds). Other packages' Numba functions,
  and a SIGINT handler of the program's own, are left as they are.
"""
from __future__ import annotations

import signal
import threading

#: The packages whose kernels compile whole (see the module docstring).
_OURS = ("engram_store", "engram_model")
_compiling = False  # the main thread is in a guarded compile (a kernel's compile compiles those it calls)


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


def defer_interrupts_while_compiling() -> bool:
    """Patch Numba's ``Dispatcher.compile`` (once) as the module docstring says; False where it is patched already or
    Numba has no such method."""
    try:
        from numba.core.dispatcher import Dispatcher
    except ImportError:
        return False
    original = getattr(Dispatcher, "compile", None)
    if original is None or getattr(Dispatcher, "_engram_whole_compiles", False):
        return False

    def compile(self, sig):
        global _compiling
        module = getattr(getattr(self, "py_func", None), "__module__", "") or ""
        if _compiling or module.split(".", 1)[0] not in _OURS \
                or threading.current_thread() is not threading.main_thread() \
                or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return original(self, sig)  # (nested, another package's, another thread's, or a handler of the program's)
        came = []
        signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
        _compiling = True
        try:
            return original(self, sig)
        finally:
            _compiling = False
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if came:
                raise KeyboardInterrupt

    Dispatcher._engram_compile = original  # (Numba's own, for a check of the difference)
    Dispatcher.compile, Dispatcher._engram_whole_compiles = compile, True
    return True
