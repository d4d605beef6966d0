"""What the plugins need of CUDA, in one place (none of it runs without a GPU).

* :func:`register_host_mappings`: engram's mapped table files made readable by the GPU in place. Each mapping is
  registered with ``cudaHostRegister`` (``cudaHostRegisterReadOnly``: the files are mapped read-only, and a GPU must
  not write them) rounded out to whole pages; under UVA the device address of registered host memory is its host
  address (as SGLang's and vLLM's host tables use it). A mapping stays registered for the life of the process:
  the engine reads it every step, and engram's files outlive the server, so a restart maps and registers them
  again instead of reloading the table.
* :class:`DeviceSteps`: a copy stream, and the events of one step's copies, for the host path: the step's ids to
  pinned host memory, each layer's packed rows back to the GPU. On a CPU device every copy is done when it
  returns and there is nothing to wait for (:class:`HostSteps`), which is how the tests run the same code.
"""

from __future__ import annotations

import mmap
from typing import Any, Sequence

import numpy as np

#: cudaHostRegisterMapped | cudaHostRegisterReadOnly (CUDA 11.1+): device-visible, never written through it.
REGISTER_FLAGS = 0x02 | 0x08
_REGISTERED: set[int] = set()


def register_host_mappings(columns: Sequence[np.ndarray]) -> np.ndarray:
    """Register every column's mapping with CUDA (once per process); returns their device addresses (int64)."""
    import torch

    cudart = torch.cuda.cudart()
    for array in columns:
        start = array.ctypes.data & ~(mmap.PAGESIZE - 1)
        end = -(-(array.ctypes.data + array.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        if start in _REGISTERED:
            continue
        err = cudart.cudaHostRegister(start, end - start, REGISTER_FLAGS)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of an engram table mapping ({end - start} bytes at {start:#x}) "
                               f"failed: {err}; set ENGRAM_DEVICE_READ=host to gather rows on the host instead")
        _REGISTERED.add(start)
    return np.array([a.ctypes.data for a in columns], dtype=np.int64)


class HostSteps:
    """The CPU stand-in of :class:`DeviceSteps`: copies are synchronous, events are already done."""

    cuda = False

    def pinned(self, shape: tuple[int, ...], dtype: Any) -> Any:
        import torch

        return torch.empty(shape, dtype=dtype)

    def ids_to_host(self, src: Any, dst: Any) -> None:
        dst.copy_(src)

    def wait_ids(self) -> None:
        pass

    def rows_to_device(self, i: int, staged: Any, device_packed: Any, out: Any, decode: Any) -> None:
        device_packed.copy_(staged)
        decode(device_packed, out)

    def wait_rows(self, i: int) -> None:
        pass


class DeviceSteps(HostSteps):
    """The host path's copies on a CUDA device (see the module docstring)."""

    cuda = True

    def __init__(self, device: Any, layers: int):
        import torch

        self.torch = torch
        self.stream = torch.cuda.Stream(device=device)
        self.ids_ready = torch.cuda.Event()
        self.rows_ready = [torch.cuda.Event() for _ in range(layers)]

    def pinned(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self.torch.empty(shape, dtype=dtype, pin_memory=True)

    def ids_to_host(self, src: Any, dst: Any) -> None:
        torch = self.torch
        self.stream.wait_stream(torch.cuda.current_stream())  # the ids are written by the main stream
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            self.ids_ready.record(self.stream)

    def wait_ids(self) -> None:
        self.ids_ready.synchronize()

    def rows_to_device(self, i: int, staged: Any, device_packed: Any, out: Any, decode: Any) -> None:
        torch = self.torch
        with torch.cuda.stream(self.stream):
            device_packed.copy_(staged, non_blocking=True)
            decode(device_packed, out)
            self.rows_ready[i].record(self.stream)

    def wait_rows(self, i: int) -> None:
        self.torch.cuda.current_stream().wait_event(self.rows_ready[i])
