"""A KeyboardInterrupt while LLVM's lock is being taken (a Ctrl-C as a kernel loads) leaves no thread waiting for it
forever (the fault explorer's seed 972443), and one while a kernel compiles lets the compile finish and breaks no
later call (the explorer's churn tour) (``engram_store.kernels._interrupts``)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

#: In a process of its own (a lock left held would stall every later kernel load of the test's worker): the
#: interrupt is raised inside the lock's ``__enter__``, after the lock is taken, by a callback of llvmlite's own;
#: then another thread makes an LLVM call, as a lookup's thread loading a kernel does.
PROBE = """
import sys, threading
if sys.argv[1] == "engram":
    import engram_store.kernels  # noqa: F401
from llvmlite import binding
from llvmlite.binding import ffi

def interrupt():
    raise KeyboardInterrupt

def nothing():
    pass

ffi.lib._lock.register(interrupt, nothing)
try:
    binding.get_process_triple()
except KeyboardInterrupt:
    pass
ffi.lib._lock.unregister(interrupt, nothing)
done = []
thread = threading.Thread(target=lambda: done.append(binding.get_process_triple()), daemon=True)
thread.start()
thread.join(10)
print("answered" if done else "blocked", flush=True)
"""


def test_an_interrupt_inside_llvms_lock_leaves_other_threads_free_to_load_kernels():
    # (with "bare", llvmlite 0.50 alone, the other thread is "blocked": the hazard this guards against)
    said = subprocess.run([sys.executable, "-c", PROBE, "engram"], capture_output=True, text=True, timeout=90)
    assert said.stdout.strip() == "answered", said.stderr[-2000:]



#: In a process of its own with a Numba cache of its own (the compile must happen there): SIGINT is raised from
#: inside a compile of one of engram's kernels (as Numba's type inference starts), then the kernel is called again.
COMPILE_PROBE = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a test worker's child may inherit SIGINT ignored)
import numpy as np
from numba.core import typed_passes
from numba.core.dispatcher import Dispatcher
from engram_model._rows_gather_kernels import first_bad
if sys.argv[1] == "bare":
    Dispatcher.compile = Dispatcher._engram_compile
run_pass = typed_passes.NopythonTypeInference.run_pass
fired = []

def interrupting(self, state):
    if not fired:
        fired.append(1)
        signal.raise_signal(signal.SIGINT)
    return run_pass(self, state)

typed_passes.NopythonTypeInference.run_pass = interrupting
ids = np.array([5, -1, 9, 2, 40, 1], dtype=np.int16)[::2]  # int16 and strided: a signature no warm-up made
try:
    first_bad(ids, 10)
    print("no interrupt")
except KeyboardInterrupt:
    print("interrupted", "compiled" if len(first_bad.overloads) else "not compiled")
print("then", first_bad(ids, 10), first_bad(ids, 3))
"""


@pytest.mark.parametrize("mode", ["engram", "bare"])
def test_an_interrupt_while_a_kernel_compiles_comes_after_the_compile_and_breaks_no_later_call(mode, tmp_path):
    said = subprocess.run([sys.executable, "-c", COMPILE_PROBE, mode], capture_output=True, text=True, timeout=110,
                          env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)})
    lines = said.stdout.split("\n")
    if mode == "bare":  # Numba alone: the interrupt cuts the compile short (the hazard this guards against)
        assert lines[0] == "interrupted not compiled", said.stdout + said.stderr[-2000:]
        return
    assert lines[:2] == ["interrupted compiled", "then 2 0"], said.stdout + said.stderr[-2000:]
