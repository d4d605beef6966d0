"""Callers' host buffers as NumPy views, never copies: NumPy arrays, CPU tensors that speak DLPack, the buffer
protocol.

Serving engines hand over torch tensors, often of dtypes NumPy has no name for (bfloat16, float8_e4m3fn,
float8_e8m0fnu). NumPy's DLPack import refuses those, so a tensor of such a dtype is viewed through an integer
dtype of the same width first (``tensor.view(torch.int16)``, taken from the torch module the caller already
imported: engram never imports torch), and the view says which dtype its bits are. ``ml_dtypes`` arrays (NumPy
arrays of those dtypes) are viewed the same way.

:func:`host_array` is the one door: it returns a :class:`HostArray` (the view, and the name of the dtype the
caller's buffer holds) or raises naming the argument, what it expected and what came.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import numpy as np

from .errors import InvalidArgument, InvalidType

__all__ = ["HostArray", "host_array"]

#: DLPack device types whose memory the CPU reads and writes: kDLCPU, kDLCUDAHost (pinned), kDLCUDAManaged.
HOST_DEVICES = {1: "CPU", 3: "CUDA host (pinned)", 13: "CUDA managed"}
#: Dtypes NumPy cannot import through DLPack, by name, and the integer dtype of the same width their bits are
#: viewed as.
BIT_VIEWS = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8,
             "float8_e8m0fnu": np.uint8, "float8_e4m3fnuz": np.uint8, "float8_e5m2fnuz": np.uint8}
_TORCH_INT = {np.uint16: "int16", np.uint8: "uint8"}


class HostArray(NamedTuple):
    """A NumPy view of a caller's buffer: ``array`` shares its memory; ``dtype`` names what its bits hold
    (``"bfloat16"`` for a bf16 tensor viewed as uint16, else ``array.dtype.name``)."""
    array: np.ndarray
    dtype: str


def host_array(obj: Any, name: str = "out", *, writable: bool = True) -> HostArray:
    """A view of ``obj`` (a NumPy array, a CPU tensor with ``__dlpack__``, or an object with the buffer protocol or
    ``__array_interface__``) sharing its memory. ``writable``: refuse a buffer that cannot be written in place.
    Never copies; a buffer NumPy cannot view in place is refused (``InvalidType``), as is device memory."""
    if isinstance(obj, np.ndarray):
        arr = obj
    elif isinstance(obj, (list, tuple, str, bytes)) or obj is None:
        raise InvalidType(f"{name}: expected a host buffer (a NumPy array, a CPU tensor with __dlpack__, or an "
                          f"object with the buffer protocol), got {type(obj).__name__}")
    elif hasattr(obj, "__dlpack__"):
        arr, kind = _from_dlpack(obj, name)
        if writable and not arr.flags.writeable:
            raise InvalidArgument(f"{name}: expected a writable buffer, got a read-only {kind} {arr.shape}")
        return HostArray(arr, kind)
    else:
        try:
            arr = np.asarray(obj)
        except Exception:  # anything NumPy cannot view
            arr = None
        if arr is None or arr.dtype == object or arr.base is None:  # no view of the caller's memory
            raise InvalidType(f"{name}: expected a buffer NumPy can view in place, got {type(obj).__name__}")
    if writable and not arr.flags.writeable:
        raise InvalidArgument(f"{name}: expected a writable buffer, got a read-only {arr.dtype} {arr.shape}")
    kind = arr.dtype.name
    bits = BIT_VIEWS.get(kind)
    if bits is not None:  # an ml_dtypes array: its bits as integers
        arr = arr.view(bits)
    return HostArray(arr, kind)


def _from_dlpack(obj: Any, name: str) -> tuple[np.ndarray, str]:
    try:
        device_type = int(obj.__dlpack_device__()[0])
    except Exception as exc:
        raise InvalidType(f"{name}: {type(obj).__name__} has __dlpack__ but no usable __dlpack_device__ "
                          f"({exc})") from None
    if device_type not in HOST_DEVICES:
        raise InvalidArgument(f"{name}: a {type(obj).__name__} on DLPack device type {device_type}; engram reads and "
                              "writes host memory (a CPU or pinned tensor): stage through one and copy it to the "
                              "device")
    kind = _torch_dtype_name(obj)
    source = obj
    if kind in BIT_VIEWS:  # viewed through an integer dtype of the same width, then named back
        torch = sys.modules["torch"]
        source = obj.view(getattr(torch, _TORCH_INT[BIT_VIEWS[kind]]))
    try:
        try:
            arr = np.from_dlpack(source, copy=False)
        except TypeError:  # NumPy < 2.1 has no copy= (and never copies)
            arr = np.from_dlpack(source)
    except (BufferError, ValueError, RuntimeError) as exc:
        raise InvalidType(f"{name}: NumPy cannot view {type(obj).__name__} through DLPack in place ({exc})") from None
    if kind in BIT_VIEWS:
        return arr.view(BIT_VIEWS[kind]), kind
    return arr, arr.dtype.name


def _torch_dtype_name(obj: Any) -> str | None:
    """``"bfloat16"`` for a torch tensor of that dtype (and the like), else None; torch is never imported here."""
    if "torch" not in sys.modules or type(obj).__module__.split(".")[0] != "torch":
        return None
    return str(getattr(obj, "dtype", "")).removeprefix("torch.")

