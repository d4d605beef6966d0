"""What a forked child must not use of what it inherits, and how each owner makes its own on first use.

A child made by ``fork`` (``multiprocessing``'s default on Linux, a data loader's workers) gets a copy of this
process's memory and descriptors but only the thread that forked. What it inherits works against it:

* ZeroMQ sockets belong to the parent's context, whose I/O threads the child does not have: a call on one waits
  forever. Raw read channels and write descriptors are the parent's connections: bytes the child sent on one would
  interleave with the parent's.
* Thread pools have no threads: work handed to one is never done. Locks another thread held at the fork stay held.
* A Linux AIO context is not inherited (the kernel gives the child none): reads through the parent's fail with
  EINVAL, which reads like a disk fault.
* ``flock`` locks belong to open file descriptions, which the child shares with the parent: a lock the child took
  or released through one is taken or released for the parent too.

Each owner registers a callback with :func:`in_child`; after a fork, the child calls every live one before it runs
anything else, and each drops (never closes: they are the parent's) what it inherited and starts afresh, so the
child makes its own connections, pools, contexts and descriptions on first use. What it drops is kept referenced
here (:func:`keep`), so that no destructor closes the parent's objects from the child. :func:`pid` is this
process's id, kept current across forks without a system call.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Callable

log = logging.getLogger(__name__)

_hooks: list = []   # weak references to bound methods, or plain functions
_kept: list = []    # what children dropped, never to be closed from here
_lock = threading.Lock()
_pid = os.getpid()


def pid() -> int:
    """This process's id (updated in a forked child before anything else runs there)."""
    return _pid


def in_child(callback: Callable[[], Any]) -> None:
    """Call ``callback`` in every child forked from now on (a bound method is held weakly: it goes with its
    object)."""
    ref = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else (lambda: callback)
    with _lock:
        _hooks[:] = [h for h in _hooks if h() is not None]
        _hooks.append(ref)


def keep(*objects: Any) -> None:
    """Hold ``objects`` (the parent's sockets, pools, files) for the child's life, so that it never closes them."""
    _kept.extend(objects)


def _after_fork_in_child() -> None:
    global _pid, _lock
    _pid = os.getpid()
    _lock = threading.Lock()  # another thread may have held it at the fork
    for ref in list(_hooks):
        callback = ref()
        if callback is None:
            continue
        try:
            callback()
        except Exception:  # one owner's failure must not leave the others inherited
            log.exception("resetting %r in a forked child failed", callback)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
