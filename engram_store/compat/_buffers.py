"""Memory as Mooncake's store API hands it around: raw addresses, registered regions, and ``BufferHandle``."""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from ..errors import InvalidArgument


class BufferHandle(bytearray):
    """An object's bytes as ``get_buffer``/``batch_get_buffer`` return them (Mooncake's ``BufferHandle``).

    It has the buffer protocol (``bytes(h)``, ``memoryview(h)``, ``np.frombuffer(h, np.uint8)``), ``len(h)``,
    and Mooncake's ``size()`` and ``ptr()``. Its memory is its own: it stays valid for as long as the handle lives.
    """

    def size(self) -> int:
        """The object's size in bytes."""
        return len(self)

    def ptr(self) -> int:
        """The address of the first byte (valid while the handle lives)."""
        if not len(self):
            return 0
        return ctypes.addressof(ctypes.c_char.from_buffer(self))


def view(ptr: int, size: int, name: str) -> np.ndarray:
    """A uint8 array over ``size`` bytes at address ``ptr`` (the caller vouches for the memory, as in Mooncake)."""
    if not isinstance(ptr, int) or isinstance(ptr, bool) or ptr <= 0:
        raise InvalidArgument(f"{name}: expected a buffer address (int > 0), got {ptr!r}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise InvalidArgument(f"{name}: expected a size (int >= 0), got {size!r}")
    if size == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer((ctypes.c_char * size).from_address(ptr), dtype=np.uint8)


class Registrations:
    """The regions passed to ``register_buffer``; an address inside one may be written up to the region's end.

    Registering is optional here (any address is read into), but a registered region bounds what a ranged read
    may write, as Mooncake checks its destination against the registered size.
    """

    def __init__(self) -> None:
        self._regions: dict[int, int] = {}  # base address -> size
        self._lock = threading.Lock()

    def add(self, ptr: int, size: int) -> None:
        if not isinstance(ptr, int) or isinstance(ptr, bool) or ptr <= 0:
            raise InvalidArgument(f"buffer_ptr: expected a buffer address (int > 0), got {ptr!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidArgument(f"size: expected a size (int > 0), got {size!r}")
        with self._lock:
            self._regions[ptr] = size

    def remove(self, ptr: int) -> bool:
        with self._lock:
            return self._regions.pop(ptr, None) is not None

    def clear(self) -> None:
        with self._lock:
            self._regions.clear()

    def capacity(self, ptr: int) -> int | None:
        """Bytes from ``ptr`` to the end of the registered region holding it; None if no region holds it."""
        with self._lock:
            ends = [base + size - ptr for base, size in self._regions.items() if base <= ptr < base + size]
        return max(ends, default=None)
