"""A step's Engram rows gathered on the host while the engine runs: the first layer first, the others behind it.

A serving step hashes once for every Engram layer; the engine needs the first Engram layer's rows (layer 1 of
DeepSeek-V4.1) after one decoder layer, the next (layer 14) thirteen layers later. :class:`StepGathers` takes a
step's work at once and does it on one worker thread, in layer order::

    ready()                    # e.g. wait for the step's ids to reach the host (a CUDA event), once per step
    for each layer i:  gather(i); staged(i)   # rows into the layer's (pinned) buffer, then on to the device
    futures[i].result()        # the engine, where layer i needs its rows: blocks only for layer i

so no layer waits at its turn on a gather that could have started earlier, and the engine's own thread is free to
launch the layers before it. A failure is raised by the futures of the layers it reached; a later step starts afresh.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Sequence

from engram_store.pools import SharedPool

#: How long the engine waits for a layer's rows before it raises (a stuck read must not hang a server forever).
WAIT_TIMEOUT_S = 120.0


class StepGathers:
    """One worker thread doing steps' gathers in order (see the module docstring)."""

    def __init__(self, name: str):
        self._pool = SharedPool(name)

    def start(self, gathers: Sequence[Callable[[], None]], ready: Callable[[], None] | None = None,
              staged: Callable[[int], None] | None = None) -> list[Future]:
        """Queue a step: ``ready()``, then for each layer ``gathers[i]()`` and ``staged(i)``. Returns one future
        per layer: ``result(timeout)`` blocks until that layer is staged and raises what its work raised."""
        futures: list[Future] = [Future() for _ in gathers]

        def run() -> None:
            try:
                if ready is not None:
                    ready()
            except BaseException as exc:  # every layer of the step fails with it
                for future in futures:
                    future.set_exception(exc)
                return
            for i, gather in enumerate(gathers):
                try:
                    gather()
                    if staged is not None:
                        staged(i)
                except BaseException as exc:
                    futures[i].set_exception(exc)
                else:
                    futures[i].set_result(None)

        self._pool.get(1).submit(run)
        return futures

    def close(self) -> None:
        self._pool.close()
