"""Reading safetensors shards without mapping them: headers parsed and held to the format, data read with ``pread``.

NumPy has no name for F8_E4M3, F8_E8M0 or BF16, so the header is parsed here and the data read as bytes from the
descriptor each shard's header was read through: a table (101 GB in DeepSeek-V4.1's release) is never read into
memory at once (:meth:`SafetensorsCheckpoint.read_rows` reads a run of rows), and a shard that shrinks while it is
read (truncated, or rewritten in place) is an InvalidArgument naming it and the tensor, where a mapping would have
killed the process with SIGBUS.

Headers are held to the format: each tensor's bytes match its dtype and shape, and the tensors cover the data
section exactly, in order of offsets, without overlaps or holes. An index names shards in its own directory: an
entry with an absolute path or one that climbs out of it (``..``) is refused, naming the entry, before any file is
opened; no error quotes the bytes of a file that is not a safetensors shard. Every file is opened relative to
the checkpoint's directory, held open, without blocking, and read only when it is a regular file whose owner may
be trusted with what this loader reads (``engram_model._checkpoint_files``): a link to another user's file, a pipe
or a directory as a shard is a named error.
"""

from __future__ import annotations

import json
import math
import os
import struct
import weakref
from typing import Any

import numpy as np

from engram_store.durable import write_replacing
from engram_store.errors import InvalidArgument, describe

from ._checkpoint_files import CheckpointDir

INDEX_FILE = "model.safetensors.index.json"
#: Largest header accepted (as the safetensors reference implementation bounds it).
MAX_HEADER_BYTES = 100 << 20
#: How each safetensors dtype is mapped: raw bytes for the float8 types, bit patterns for BF16.
_DTYPES = {"F8_E4M3": np.dtype("u1"), "F8_E8M0": np.dtype("u1"), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
           "BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
           "I16": np.dtype("<i2"), "I32": np.dtype("<i4"), "I64": np.dtype("<i8"), "U16": np.dtype("<u2"),
           "U32": np.dtype("<u4"), "U64": np.dtype("<u8"), "BOOL": np.dtype("?")}
FLOATS = ("BF16", "F16", "F32", "F64")
#: Largest dimension of a tensor's shape (a size NumPy can index).
_MAX_DIM = 2 ** 63 - 1




class SafetensorsCheckpoint:
    """The tensors of a safetensors checkpoint, read on demand.

    ``path`` is a ``.safetensors`` file or a directory: with ``model.safetensors.index.json`` its ``weight_map``
    says which shard holds each tensor (only the shards asked for are opened), without one every
    ``*.safetensors`` file in it is read. Each shard stays open from its header on (:meth:`close`, or when the
    object goes, lets go). The checkpoint's directory is held open and its files opened relative to it, each only
    when it is a regular file of the directory's owner (or the loader's, in a directory of the loader's own or
    root's), never blocking on the way (``engram_model._checkpoint_files``).
    """

    def __init__(self, path: str | os.PathLike):
        where = os.fspath(path)
        self.path = where
        self._headers: dict[str, dict[str, Any]] = {}
        self._fds: dict[str, int] = {}
        self._names: dict[str, str] = {}  # a shard's path -> its name relative to the checkpoint's directory
        self._held: list[CheckpointDir] = []  # the checkpoint's directory, while open
        self._finalizer = weakref.finalize(self, _close_all, self._fds, self._held)
        try:
            self._held.append(CheckpointDir(where))
            self._dir_path = where
        except FileNotFoundError:
            raise InvalidArgument(f"path: no such checkpoint file or directory {where!r}") from None
        except NotADirectoryError:  # one .safetensors file
            self._dir_path = os.path.dirname(where)
            self._names[where] = os.path.basename(where)
            self._where = {name: where for name in self._header(where)}
            return
        try:
            fd = self._held[0].open_file(INDEX_FILE)
        except FileNotFoundError:
            shards = sorted(f for f in self._held[0].names() if f.endswith(".safetensors"))
            if not shards:
                raise InvalidArgument(f"path: {where!r} holds no {INDEX_FILE} and no .safetensors file") from None
            self._names.update((os.path.join(where, f), f) for f in shards)
            self._where = {name: file for file in self._names for name in self._header(file)}
            return
        self._where = self._read_index(fd, os.path.join(where, INDEX_FILE))

    def _read_index(self, fd: int, index: str) -> dict[str, str]:
        try:
            with open(fd, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
            raise InvalidArgument(f"{index}: not a safetensors index ({exc})") from None
        except RecursionError:
            raise InvalidArgument(f"{index}: not a safetensors index (it nests deeper than the JSON parser "
                                  "follows)") from None
        if not isinstance(weight_map, dict):
            raise InvalidArgument(f"{index}: expected a \"weight_map\" object, got {describe(weight_map)}")
        base = os.path.dirname(index)
        where = {str(name): _shard_in(index, base, str(name), file) for name, file in weight_map.items()}
        self._names.update((file, os.path.relpath(file, base)) for file in where.values())
        return where

    def close(self) -> None:
        """Close the shards opened so far and the checkpoint's directory (idempotent); reading again opens them
        again."""
        _close_all(self._fds, self._held)
        self._headers.clear()

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            if not self._held:
                self._held.append(CheckpointDir(self._dir_path))
            try:
                fd = self._fds[file] = self._held[0].open_file(self._names[file], file)
            except FileNotFoundError:
                raise InvalidArgument(f"{file}: shard listed in the index does not exist") from None
        return fd

    def _header(self, file: str) -> dict[str, Any]:
        header = self._headers.get(file)
        if header is not None:
            return header
        fd = self._fd(file)
        size = os.fstat(fd).st_size
        raw = os.pread(fd, 8, 0)
        (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):  # the length is not quoted: the file may be anyone's
            raise InvalidArgument(f"{file}: not a safetensors file (its first 8 bytes give no header length within "
                                  f"its {size} bytes)")
        text = np.empty(n, dtype=np.uint8)
        self._read_into(file, 8, text, "the header")
        try:
            header = json.loads(text.tobytes().decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidArgument(f"{file}: not a safetensors file (its header is not UTF-8 text)") from None
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{file}: not a safetensors file (header is not JSON: {exc})") from None
        except RecursionError:
            raise InvalidArgument(f"{file}: not a safetensors file (the header nests deeper than the JSON parser "
                                  "follows; a safetensors header is an object of flat tensor entries)") from None
        if not isinstance(header, dict):
            raise InvalidArgument(f"{file}: safetensors header must be a JSON object, got {type(header).__name__}")
        header.pop("__metadata__", None)
        data_bytes = size - 8 - n
        for name, info in header.items():
            _check_entry(file, name, info, data_bytes)
            info["_start"] = 8 + n + info["data_offsets"][0]
        _check_tiling(file, header, data_bytes)
        self._headers[file] = header
        return header

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return sorted(self._where)

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """``(safetensors dtype name, shape)`` of a tensor."""
        entry = self._entry(name)
        return entry["dtype"], tuple(entry["shape"])

    def _entry(self, name: str) -> dict[str, Any]:
        file = self._where.get(name)
        if file is None:
            raise InvalidArgument(f"{self.path}: no tensor {name!r}")
        entry = self._header(file).get(name)
        if entry is None:
            raise InvalidArgument(f"{file}: the index places {name!r} here, but the shard does not hold it")
        return entry

    def raw(self, name: str) -> np.ndarray:
        """The tensor's data read into a new array: uint8 for the float8 types, uint16 bits for BF16. (A layer's
        table is read in rows, :meth:`read_rows`.)"""
        entry = self._entry(name)
        out = np.empty(tuple(entry["shape"]), dtype=_DTYPES[entry["dtype"]])
        self._read_into(self._where[name], entry["_start"], out.reshape(-1).view(np.uint8), f"tensor {name!r}")
        return out

    def read_rows(self, name: str, start: int, out: np.ndarray) -> np.ndarray:
        """Rows ``[start, start + len(out))`` of a tensor (its first dimension) read into ``out`` (C-contiguous, of
        the tensor's dtype and row shape); returns ``out``."""
        entry = self._entry(name)
        shape, dtype = tuple(entry["shape"]), _DTYPES[entry["dtype"]]
        if out.dtype != dtype or tuple(out.shape[1:]) != shape[1:] or not out.flags.c_contiguous \
                or not 0 <= start <= shape[0] - out.shape[0]:
            raise InvalidArgument(f"out: expected a C-contiguous {dtype} array of rows {list(shape[1:])} within the "
                                  f"{shape[0]} rows of {name!r} from row {start}, got {out.dtype} {list(out.shape)}")
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        self._read_into(self._where[name], entry["_start"] + start * row_bytes, out.reshape(-1).view(np.uint8),
                        f"tensor {name!r}")
        return out

    def _read_into(self, file: str, offset: int, out: np.ndarray, what: str) -> None:
        """Read ``out.nbytes`` bytes at ``offset`` of the shard with ``pread``; a file that ends first (it shrank
        since its header was read) is an InvalidArgument naming it and ``what``."""
        fd, view, done = self._fd(file), memoryview(out), 0
        while done < out.nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise InvalidArgument(f"{file}: {what} needs bytes up to {offset + out.nbytes}, but the file ends at "
                                      f"{os.fstat(fd).st_size} bytes now: it was truncated or rewritten while it was "
                                      "read; nothing read from it was used")
            done += got

    def float32(self, name: str) -> np.ndarray:
        """A float tensor (BF16, F16, F32, F64) read into a new float32 array (BF16 widened exactly)."""
        dtype, _ = self.info(name)
        if dtype not in FLOATS:
            raise InvalidArgument(f"{name}: expected a float tensor ({', '.join(FLOATS)}), got {dtype}")
        arr = self.raw(name)
        if dtype == "BF16":
            return (arr.astype(np.uint32) << 16).view(np.float32)
        return np.array(arr, dtype=np.float32)


def _check_entry(file: str, name: str, info: Any, data_bytes: int) -> None:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise InvalidArgument(f"{file}: tensor {name!r} needs dtype, shape and data_offsets, got {describe(info)}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in _DTYPES:
        raise InvalidArgument(f"{file}: tensor {name!r} has dtype {dtype!r}, which this reader does not know "
                              f"(known: {', '.join(sorted(_DTYPES))})")
    if not (isinstance(shape, list) and all(type(d) is int and 0 <= d <= _MAX_DIM for d in shape)):
        raise InvalidArgument(f"{file}: tensor {name!r} has a bad shape {describe(shape)} (expected a list of "
                              f"ints in [0, {_MAX_DIM}])")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise InvalidArgument(f"{file}: tensor {name!r} has data_offsets {describe(offsets)} outside the "
                              f"{data_bytes} data bytes")
    need = math.prod(shape) * _DTYPES[dtype].itemsize  # Python ints: a product past int64 does not wrap to 0
    if offsets[1] - offsets[0] != need:
        raise InvalidArgument(f"{file}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes, but {dtype} "
                              f"{shape} needs {need}")


def _check_tiling(file: str, header: dict[str, Any], data_bytes: int) -> None:
    """The tensors must cover the data section exactly, one after another in order of offsets (as the
    safetensors format requires): no two share a byte, and no byte belongs to none."""
    spans = sorted((info["data_offsets"][0], info["data_offsets"][1], name) for name, info in header.items())
    at, last = 0, None
    for start, end, name in spans:
        if start < at:
            raise InvalidArgument(f"{file}: tensor {name!r} has data_offsets [{start}, {end}], which overlap tensor "
                                  f"{last[2]!r} at [{last[0]}, {last[1]}] (safetensors tensors must not share "
                                  "bytes)")
        if start > at:
            where = f"between {last[2]!r} and {name!r}" if last is not None else f"before {name!r}"
            raise InvalidArgument(f"{file}: bytes [{at}, {start}) of the data belong to no tensor ({where}); "
                                  "safetensors tensors must cover the data without holes")
        at, last = end, (start, end, name)
    if at != data_bytes:
        where = f"after {last[2]!r}" if last is not None else "the header lists no tensor"
        raise InvalidArgument(f"{file}: bytes [{at}, {data_bytes}) of the data belong to no tensor ({where}); "
                              "safetensors tensors must cover the data without holes")


def _shard_in(index: str, base: str, name: str, file: Any) -> str:
    """The path of the shard an index entry names, which must lie in the index's own directory."""
    parts = os.path.normpath(file).split(os.sep) if isinstance(file, str) and file and "\0" not in file else None
    if parts is None or os.path.isabs(file) or parts[0] == "..":
        raise InvalidArgument(f"{index}: weight_map entry {name!r} names {describe(file)}, outside the checkpoint's "
                              f"directory {base}; an index names shards in its own directory")
    return os.path.join(base, os.path.normpath(file))


def _close_all(fds: dict[str, int], held: list[CheckpointDir]) -> None:
    while fds:
        os.close(fds.popitem()[1])
    while held:
        held.pop().close()


def write_safetensors(path: str | os.PathLike, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """One safetensors file from ``{name: (dtype name, raw values)}`` (float8 and bf16 as their bytes)."""
    header, offset = {}, 0
    for name, (dtype, array) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)

    def write(f) -> None:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for _, array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())
    write_replacing(path, write, "write_safetensors")
