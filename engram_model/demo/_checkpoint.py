"""Checkpoint files: ``.npz`` through NumPy and ``.safetensors`` through a small reader and writer.

The safetensors format is an 8-byte little-endian header length, a JSON header mapping each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the header; an optional
``"__metadata__"`` of strings), then the raw little-endian tensor bytes. Writing it here keeps the
``safetensors`` package optional; the tests check that files pass both ways between the two.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Mapping

import numpy as np

from engram_store.durable import write_replacing
from engram_store.errors import InvalidArgument, InvalidType, describe

from .._checkpoint_files import open_checkpoint_file

#: safetensors dtype names and the NumPy dtypes they are read as. BF16 has no NumPy dtype and is widened
#: to float32 on reading (exactly: bfloat16 is the top half of a float32).
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NAMES = {dt.newbyteorder("<") if dt.itemsize > 1 else dt: name for name, dt in _DTYPES.items()}
#: A header larger than this is refused as corrupt (the reference implementation uses the same bound).
MAX_HEADER_BYTES = 100 << 20


def save_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` (name -> array) to a safetensors file, names in sorted order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    arrays = []
    offset = 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        dtype = arr.dtype.newbyteorder("<") if arr.dtype.itemsize > 1 else arr.dtype
        if dtype not in _NAMES:
            raise InvalidType(f"tensors[{name!r}]: dtype {arr.dtype} has no safetensors equivalent "
                              f"(supported: {', '.join(sorted(_DTYPES))})")
        data = np.ascontiguousarray(arr, dtype=dtype).tobytes()
        header[name] = {"dtype": _NAMES[dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        arrays.append(data)
        offset += len(data)
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # pad so the data starts 8-byte aligned, as the reference writer does

    def write(f) -> None:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for data in arrays:
            f.write(data)
    write_replacing(path, write, "save_safetensors")  # a private temporary, renamed into place


def load_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read every tensor of a safetensors file (native-endian arrays; BF16 widened to float32).

    The file is read with ``pread`` into each tensor's array, not mapped: a multi-gigabyte table is copied once,
    and a file that shrinks while it is read is an InvalidArgument naming it, not SIGBUS.
    """
    where = os.fspath(path)
    try:
        fd = open_checkpoint_file(where)  # a regular file its directory's owner may give: never a pipe
    except FileNotFoundError:
        raise InvalidArgument(f"path: no such safetensors file {where!r}") from None
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise InvalidArgument(f"{where}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if n > min(MAX_HEADER_BYTES, size - 8):  # not quoted: the bytes may be anyone's
            raise InvalidArgument(f"{where}: not a safetensors file (its header length exceeds the file's {size} "
                                  "bytes)")
        try:
            header = json.loads(_pread_exact(fd, 8, n, where).decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidArgument(f"{where}: not a safetensors file (its header is not UTF-8 text)") from None
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{where}: not a safetensors file (header is not JSON: {exc})") from None
        if not isinstance(header, dict):
            raise InvalidArgument(f"{where}: safetensors header must be a JSON object, got {type(header).__name__}")
        return {name: _read_tensor(where, name, info, fd, 8 + n, size - 8 - n) for name, info in header.items()
                if name != "__metadata__"}
    finally:
        os.close(fd)


def _pread_exact(fd: int, offset: int, nbytes: int, where: str, into: np.ndarray | None = None) -> bytes:
    """``nbytes`` at ``offset`` of ``fd`` (into ``into``, a uint8 array of that size, when given); InvalidArgument
    naming ``where`` when the file ends first (it shrank while it was read)."""
    out = np.empty(nbytes, dtype=np.uint8) if into is None else into
    view, done = memoryview(out), 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise InvalidArgument(f"{where}: needs bytes up to {offset + nbytes}, but the file ends at "
                                  f"{os.fstat(fd).st_size} bytes now: it was truncated while it was read")
        done += got
    return out.tobytes() if into is None else b""


def _read_tensor(where: str, name: str, info: object, fd: int, start: int, data_bytes: int) -> np.ndarray:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise InvalidArgument(f"{where}: tensor {name!r} needs dtype, shape and data_offsets, got {describe(info)}")
    dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise InvalidArgument(f"{where}: tensor {name!r} has a bad shape {describe(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise InvalidArgument(f"{where}: tensor {name!r} has data_offsets {describe(offsets)} outside the "
                              f"{data_bytes} data bytes")
    count = int(np.prod(shape, dtype=np.int64))
    if dtype_name == "BF16":
        nbytes, dtype = 2 * count, np.dtype("<u2")
    elif dtype_name in _DTYPES:
        dtype = _DTYPES[dtype_name]
        nbytes = dtype.itemsize * count
    else:
        raise InvalidArgument(f"{where}: tensor {name!r} has dtype {dtype_name!r}, which this reader does not "
                              f"support (supported: BF16, {', '.join(sorted(_DTYPES))})")
    if offsets[1] - offsets[0] != nbytes:
        raise InvalidArgument(f"{where}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes, but {dtype_name} "
                              f"{shape} needs {nbytes}")
    arr = np.empty(shape, dtype=dtype)
    _pread_exact(fd, start + offsets[0], nbytes, f"{where}: tensor {name!r}", arr.reshape(-1).view(np.uint8))
    if dtype_name == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(dtype.newbyteorder("="), copy=False)


def save_checkpoint(path: str | os.PathLike, tensors: Mapping[str, np.ndarray]) -> None:
    """Write a ``.npz`` or ``.safetensors`` file, chosen by the file name's extension."""
    kind = _kind(path)
    if kind == "npz":
        write_replacing(path, lambda f: np.savez(f, **{k: np.asarray(v) for k, v in tensors.items()}),
                        "save_checkpoint")
    else:
        save_safetensors(path, tensors)


def load_checkpoint(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read every array of a ``.npz`` or ``.safetensors`` file, chosen by the file name's extension."""
    if _kind(path) == "npz":
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    return load_safetensors(path)


def _kind(path: str | os.PathLike) -> str:
    name = os.fspath(path)
    if name.endswith(".npz"):
        return "npz"
    if name.endswith(".safetensors"):
        return "safetensors"
    raise InvalidArgument(f"path: expected a file name ending in .npz or .safetensors, got {name!r}")
