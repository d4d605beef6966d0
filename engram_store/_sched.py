"""A short scheduling slice for a thread whose work is short and whose wake-ups are waited on (Linux 6.12+).

A serving thread sleeps until a read comes and then works for microseconds. Woken on a CPU that another thread
keeps busy (a model, a BLAS pool), it waits for that thread's slice to end unless the scheduler lets it preempt:
with the default slice (about 1.4 ms here) about 1% of such wake-ups waited a millisecond or more. Since
Linux 6.12 a thread of the normal policy may ask for a shorter slice (``sched_attr.sched_runtime``, clamped by
the kernel to 0.1-100 ms); EEVDF then gives it an earlier deadline, so a wake-up preempts at once, and it yields
its CPU after that slice where it runs longer. Its share of the CPU does not change. Older kernels take the call
and ignore the field.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import struct
import sys

log = logging.getLogger(__name__)

#: sched_setattr(2)'s number by architecture (x86_64's own table; the others use the generic one).
_SYSCALL = {"x86_64": 314, "amd64": 314, "aarch64": 274, "arm64": 274, "riscv64": 274}
#: struct sched_attr as first defined (SCHED_ATTR_SIZE_VER0): size, policy, flags, nice, priority, runtime,
#: deadline, period.
_ATTR = struct.Struct("=IIQiIQQQ")
#: Policies whose slice this may set: the normal ones (SCHED_OTHER, SCHED_BATCH); real-time ones are left alone.
_FAIR = {getattr(os, "SCHED_OTHER", 0), getattr(os, "SCHED_BATCH", 3)}

_libc: ctypes.CDLL | None = None


def prefer_short_slice(seconds: float) -> bool:
    """Ask for a scheduling slice of ``seconds`` for the calling thread, keeping its policy and nice value; True
    where the kernel took the request (a kernel before 6.12 takes it and ignores it), False where it cannot be
    made (not Linux, an unknown architecture, a real-time policy, a refusal). ``seconds`` <= 0 asks nothing."""
    global _libc
    number = _SYSCALL.get(platform.machine().lower())
    if seconds <= 0 or number is None or not sys.platform.startswith("linux"):
        return False
    try:
        policy = os.sched_getscheduler(0)
        nice = os.getpriority(os.PRIO_PROCESS, 0)  # (the calling thread's, on Linux)
    except OSError:
        return False
    if policy not in _FAIR:
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        attr = ctypes.create_string_buffer(_ATTR.pack(_ATTR.size, policy, 0, nice, 0, int(seconds * 1e9), 0, 0))
        failed = _libc.syscall(ctypes.c_long(number), ctypes.c_long(0), attr, ctypes.c_uint(0)) != 0
    except (OSError, AttributeError) as exc:
        log.debug("sched_setattr: %s", exc)
        return False
    if failed:
        log.debug("sched_setattr: %s", os.strerror(ctypes.get_errno()))
    return not failed
