"""Reading DeepSeek-V4.1's Engram tensors from safetensors shards, and streaming a layer's table into the store.

Per Engram layer L the checkpoint holds::

    layers.{L}.engram.embed.weight   F8_E4M3  [num_embeddings, head_dim]          the table's codes
    layers.{L}.engram.embed.scale    F8_E8M0  [num_embeddings, head_dim / 32]     one scale byte per 32 values
    layers.{L}.engram.wkv.weight     F8_E4M3  [(hc + 1) * hidden, cols * head_dim]
    layers.{L}.engram.wkv.scale      F8_E8M0  [(hc + 1) * hidden / 32, cols * head_dim / 32]   32x32 blocks
    layers.{L}.engram.q_weight       BF16     [hc, hidden]
    layers.{L}.engram.k_weight       BF16     [hc, hidden]

Other stacks add a ``model.`` prefix or call the scales ``weight_scale_inv``; both are accepted. NumPy has no
name for F8_E4M3, F8_E8M0 or BF16, so the header is parsed here and the data memory-mapped as bytes: a table
(101 GB in the release) is never read into memory at once. :func:`load_v41_table` copies it into the store one
column (one head shard of the layer) at a time, so memory stays bounded by one column (about 4.2 GB); the last
shard publishes the layer's manifest. If a column fails, the columns this call wrote are removed first.

Headers are held to the format: each tensor's bytes match its dtype and shape, and the tensors cover the data
section exactly, in order of offsets, without overlaps or holes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from typing import Any

import numpy as np

from engram_store import EngramStore
from engram_store._errors import EngramError, InvalidArgument, InvalidType, ObjectExists, ObjectNotFound, describe
from engram_store._progress import Progress

from .._fp8 import E4M3_TABLE
from . import _kernels
from ._config import FP8_BLOCK, V41Config, v41_store_config

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
#: Largest header accepted (as the safetensors reference implementation bounds it).
MAX_HEADER_BYTES = 100 << 20
#: Rows packed per chunk while a column is copied (16 MiB of 264-byte rows); the progress bar moves per chunk.
CHUNK_ROWS = 1 << 16
#: Columns smaller than this show no progress bar.
PROGRESS_MIN_BYTES = 64 << 20
#: How each safetensors dtype is mapped: raw bytes for the float8 types, bit patterns for BF16.
_DTYPES = {"F8_E4M3": np.dtype("u1"), "F8_E8M0": np.dtype("u1"), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
           "BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
           "I16": np.dtype("<i2"), "I32": np.dtype("<i4"), "I64": np.dtype("<i8"), "U16": np.dtype("<u2"),
           "U32": np.dtype("<u4"), "U64": np.dtype("<u8"), "BOOL": np.dtype("?")}
_FLOATS = ("BF16", "F16", "F32", "F64")
#: Largest dimension of a tensor's shape (a size NumPy can index).
_MAX_DIM = 2 ** 63 - 1


class SafetensorsCheckpoint:
    """The tensors of a safetensors checkpoint, memory-mapped on demand.

    ``path`` is a ``.safetensors`` file or a directory: with ``model.safetensors.index.json`` its ``weight_map``
    says which shard holds each tensor (only the shards asked for are opened), without one every
    ``*.safetensors`` file in it is read.
    """

    def __init__(self, path: str | os.PathLike):
        where = os.fspath(path)
        self.path = where
        self._headers: dict[str, dict[str, Any]] = {}
        if os.path.isfile(where):
            self._where = {name: where for name in self._header(where)}
        elif os.path.isdir(where):
            index = os.path.join(where, INDEX_FILE)
            if os.path.isfile(index):
                self._where = self._read_index(index)
            else:
                shards = sorted(f for f in os.listdir(where) if f.endswith(".safetensors"))
                if not shards:
                    raise InvalidArgument(f"path: {where!r} holds no {INDEX_FILE} and no .safetensors file")
                self._where = {name: os.path.join(where, f) for f in shards for name in self._header(
                    os.path.join(where, f))}
        else:
            raise InvalidArgument(f"path: no such checkpoint file or directory {where!r}")

    def _read_index(self, index: str) -> dict[str, str]:
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
            raise InvalidArgument(f"{index}: not a safetensors index ({exc})") from None
        except RecursionError:
            raise InvalidArgument(f"{index}: not a safetensors index (it nests deeper than the JSON parser "
                                  "follows)") from None
        if not isinstance(weight_map, dict):
            raise InvalidArgument(f"{index}: expected a \"weight_map\" object, got {describe(weight_map)}")
        base = os.path.dirname(index)
        return {str(name): os.path.join(base, str(file)) for name, file in weight_map.items()}

    def _header(self, file: str) -> dict[str, Any]:
        header = self._headers.get(file)
        if header is not None:
            return header
        try:
            size = os.path.getsize(file)
            with open(file, "rb") as f:
                raw = f.read(8)
                (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
                if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                    raise InvalidArgument(f"{file}: not a safetensors file (header length {n}, file {size} bytes)")
                header = json.loads(f.read(n).decode("utf-8"))
        except FileNotFoundError:
            raise InvalidArgument(f"{file}: shard listed in the index does not exist") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidArgument(f"{file}: not a safetensors file (header is not JSON: {exc})") from None
        except RecursionError:
            raise InvalidArgument(f"{file}: not a safetensors file (the header nests deeper than the JSON parser "
                                  "follows; a safetensors header is an object of flat tensor entries)") from None
        if not isinstance(header, dict):
            raise InvalidArgument(f"{file}: safetensors header must be a JSON object, got {describe(header)}")
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
        """A read-only memory map of the tensor's data: uint8 for the float8 types, uint16 bits for BF16."""
        entry = self._entry(name)
        dtype, shape = _DTYPES[entry["dtype"]], tuple(entry["shape"])
        count = math.prod(shape)
        if count == 0:
            return np.zeros(shape, dtype=dtype)
        return np.memmap(self._where[name], dtype=dtype, mode="r", offset=entry["_start"], shape=shape)

    def float32(self, name: str) -> np.ndarray:
        """A float tensor (BF16, F16, F32, F64) read into a new float32 array (BF16 widened exactly)."""
        dtype, _ = self.info(name)
        if dtype not in _FLOATS:
            raise InvalidArgument(f"{name}: expected a float tensor ({', '.join(_FLOATS)}), got {dtype}")
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


def _as_checkpoint(path: Any) -> SafetensorsCheckpoint:
    return path if isinstance(path, SafetensorsCheckpoint) else SafetensorsCheckpoint(path)


def tensor_name(ckpt: SafetensorsCheckpoint, layer_id: int, part: str) -> str:
    """The checkpoint's name for ``layers.{L}.engram.{part}``, with or without ``model.``; ``weight_scale_inv``
    stands for ``scale``."""
    parts = [part] + ([part[:-len("scale")] + "weight_scale_inv"] if part.endswith(".scale") else [])
    tried = [f"{prefix}layers.{layer_id}.engram.{p}" for prefix in ("", "model.") for p in parts]
    for name in tried:
        if name in ckpt:
            return name
    raise InvalidArgument(f"{ckpt.path}: layer {layer_id} has no Engram tensor {part!r} (tried {', '.join(tried)})")


def _expect(ckpt: SafetensorsCheckpoint, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...]) -> str:
    dtype, got = ckpt.info(name)
    if dtype not in dtypes:
        raise InvalidArgument(f"{name}: expected dtype {' or '.join(dtypes)}, got {dtype}")
    if got != shape:
        raise InvalidArgument(f"{name}: expected shape {list(shape)} for this config, got {list(got)}")
    return dtype


def load_v41_weights(path: Any, config: V41Config, layer_id: int) -> dict[str, np.ndarray]:
    """``{"wkv", "q_weight", "k_weight"}`` of one layer as float32, ``wkv`` dequantised by its 32x32 block scales."""
    ckpt = _as_checkpoint(path)
    config.layer_index(layer_id)
    hc, hidden, K = config.hc_mult, config.hidden_size, config.cols * config.head_dim
    out: dict[str, np.ndarray] = {}
    for part in ("q_weight", "k_weight"):
        name = tensor_name(ckpt, layer_id, part)
        _expect(ckpt, name, _FLOATS, (hc, hidden))
        out[part] = ckpt.float32(name)
    name = tensor_name(ckpt, layer_id, "wkv.weight")
    shape = ((hc + 1) * hidden, K)
    dtype = _expect(ckpt, name, ("F8_E4M3",) + _FLOATS, shape)
    if dtype in _FLOATS:  # already dequantised by another stack
        out["wkv"] = ckpt.float32(name)
        return out
    scale_name = tensor_name(ckpt, layer_id, "wkv.scale")
    blocks = (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))
    scale_dtype = _expect(ckpt, scale_name, ("F8_E8M0", "U8") + _FLOATS, blocks)
    if scale_dtype in _FLOATS:  # scales stored as their values
        scales = ckpt.float32(scale_name)
    else:
        raw = np.asarray(ckpt.raw(scale_name))
        if (raw == 255).any():
            i, j = (int(v) for v in np.argwhere(raw == 255)[0])
            raise InvalidArgument(f"{scale_name}: block [{i}, {j}] has e8m0 byte 255 (NaN)")
        scales = np.ldexp(1.0, raw.astype(np.int64) - 127).astype(np.float32)
    wkv = np.empty(shape, dtype=np.float32)
    bad = _kernels.dequantize_blocks(np.asarray(ckpt.raw(name)), np.ascontiguousarray(scales), E4M3_TABLE, wkv)
    if bad >= 0:
        raise InvalidArgument(f"{name}: e4m3 NaN code at {list(divmod(int(bad), shape[1]))}")
    out["wkv"] = wkv
    return out


def _table_tensors(ckpt: SafetensorsCheckpoint, config: V41Config, layer_id: int) -> tuple[np.ndarray, np.ndarray]:
    rows, hd = config.num_embeddings(layer_id), config.head_dim
    weight = tensor_name(ckpt, layer_id, "embed.weight")
    _expect(ckpt, weight, ("F8_E4M3", "U8"), (rows, hd))
    scale = tensor_name(ckpt, layer_id, "embed.scale")
    _expect(ckpt, scale, ("F8_E8M0", "U8"), (rows, hd // FP8_BLOCK))
    return np.asarray(ckpt.raw(weight)), np.asarray(ckpt.raw(scale))


def load_v41_table(path: Any, config: V41Config, layer_id: int, store: Any = None, *, disk_dir: Any = None,
                   local_dir: Any = None, replica_num: int = 1, progress: bool | None = None, row_cache_bytes: int = 0,
                   cache_scope: str = "process") -> EngramStore:
    """Stream one layer's FP8 table from the checkpoint into ``store`` (a DistributedStore), under ``disk_dir`` (a
    directory on local SSD, for tables larger than memory) or under ``local_dir`` (files in memory, e.g. in
    /dev/shm, shared by the host's processes), column by column.

    Into a store, each column is packed (codes then scale bytes, checked for NaNs) into one reused buffer and
    populated as a head shard of the layer; the last publishes the layer's manifest. Under ``disk_dir`` or
    ``local_dir`` the writer pulls the rows column by column in chunks and publishes the layer's files at the end.
    Either way memory stays bounded by one column (store) or one chunk (files). Refuses a layer already (or partly)
    there. On any failure nothing this load wrote stays (each column written is taken back with
    :meth:`EngramStore.undo_populate`: a layer that another process removed with force and loaded meanwhile stays
    whole). ``progress`` shows a bar on stderr (None: where stderr is a terminal and the data is large). Returns
    the layer's EngramStore, opened with ``row_cache_bytes`` and ``cache_scope`` (as :class:`EngramStore` takes
    them), ready for :class:`V41Engram` and :class:`V41Rows`.
    """
    ckpt = _as_checkpoint(path)
    layout = v41_store_config(config, layer_id)
    weight, scale = _table_tensors(ckpt, config, layer_id)  # the tensors are checked before anything else
    options = _table_options(layer_id, store, disk_dir, local_dir, row_cache_bytes, cache_scope)
    if disk_dir is not None:
        return _load_to_disk(ckpt, config, layer_id, disk_dir, progress, options)
    if local_dir is not None:
        return _load_to_local_dir(ckpt, config, layer_id, options)
    layer = _store_layer(store, layout, layer_id, options)
    present = [k for k, e in zip(layer.get_store_keys(), store.batch_is_exist(layer.get_store_keys())) if e]
    if present:
        layer.close()
        raise ObjectExists(f"layer {layer_id}: {len(present)} of {config.cols} columns are already in the store "
                           f"(first {present[0]!r}); remove the layer first")
    offsets, primes = config.offsets(layer_id), layout.table_vocab_sizes
    buffer = np.empty((max(primes), config.row_bytes), dtype=np.uint8)
    written: list[EngramStore] = []
    try:
        for c, (offset, prime) in enumerate(zip(offsets.tolist(), primes)):
            column = _pack_column(weight, scale, offset, buffer[:prime], layer_id, c, config.cols, progress)
            shard = EngramStore(layer_id, layout, store, heads=[c])
            shard.populate([column], replica_num=replica_num)
            written.append(shard)
            log.info("layer %d: column %d/%d written (%d rows)", layer_id, c + 1, config.cols, prime)
    except BaseException:
        for shard in written:
            try:  # this load's columns only: another process may have removed the layer and loaded it since
                shard.undo_populate()
            except EngramError as exc:  # keep the original error; say what could not be cleaned up
                log.error("layer %d: removing a column this load wrote failed: %s", layer_id, exc)
        layer.close()
        raise
    finally:
        for shard in written:
            shard.close()
    return layer


def open_v41_table(path: Any, config: V41Config, layer_id: int, store: Any = None, *, disk_dir: Any = None,
                   local_dir: Any = None, replica_num: int = 1, progress: bool | None = None, row_cache_bytes: int = 0,
                   cache_scope: str = "process") -> EngramStore:
    """The layer's EngramStore in ``store``, under ``disk_dir`` or under ``local_dir``: opened where the layer is
    there already, else streamed in from the checkpoint first (:func:`load_v41_table`, which takes the same
    arguments). A layer partly in a store (an interrupted load) is refused: remove it and load it again."""
    layout = v41_store_config(config, layer_id)
    options = _table_options(layer_id, store, disk_dir, local_dir, row_cache_bytes, cache_scope)
    load = dict(disk_dir=disk_dir, local_dir=local_dir, replica_num=replica_num, progress=progress,
                row_cache_bytes=row_cache_bytes, cache_scope=cache_scope)
    if disk_dir is not None:
        from engram_store.disk import DiskDir

        if layer_id in DiskDir(disk_dir).layers():
            return EngramStore(layer_id, layout, None, **options)
        return load_v41_table(path, config, layer_id, **load)
    if local_dir is not None:
        layer = EngramStore(layer_id, layout, None, **options)
        try:
            layer.local_tables()  # raises ObjectNotFound where the layer is not published there
        except ObjectNotFound:
            layer.close()
            return load_v41_table(path, config, layer_id, **load)
        return layer
    layer = _store_layer(store, layout, layer_id, options)
    present = store.batch_is_exist(layer.get_store_keys())
    if all(present):
        return layer
    layer.close()
    if any(present):
        raise InvalidArgument(f"store: {sum(present)} of {config.cols} columns of layer {layer_id} are in the store "
                              f"(an interrupted load?); engram-layers remove --master {store.master_address} "
                              f"{layer_id}, then load it again")
    _say_why_loading(store, layer_id)
    return load_v41_table(path, config, layer_id, store, **load)


def _table_options(layer_id: int, store: Any, disk_dir: Any, local_dir: Any, row_cache_bytes: int,
                   cache_scope: str) -> dict[str, Any]:
    """The EngramStore keywords of the one place a layer's table is (refusing none or several)."""
    places = {name: value for name, value in (("store", store), ("disk_dir", disk_dir), ("local_dir", local_dir))
              if value is not None}
    if len(places) != 1:
        got = ", ".join(f"{name}={describe(value)}" for name, value in places.items()) or "none"
        raise InvalidArgument(f"store, disk_dir, local_dir: expected exactly one place for the table of layer "
                              f"{layer_id}, got {got}")
    options: dict[str, Any] = {"row_cache_bytes": row_cache_bytes, "cache_scope": cache_scope}
    if store is None:
        options.update(places)
    return options


def _store_layer(store: Any, layout: Any, layer_id: int, options: dict[str, Any]) -> EngramStore:
    if isinstance(store, EngramStore) or not hasattr(store, "batch_is_exist"):
        raise InvalidType(f"store: expected a DistributedStore (the table goes in as head shards of layer "
                          f"{layer_id}), got {type(store).__name__}")
    return EngramStore(layer_id, layout, store, **options)


def _say_why_loading(store: Any, layer_id: int) -> None:
    """Log why a layer is streamed into a store: it was never there, or the store lost it (a loss must not hide
    behind a silent reload)."""
    lost = [k.key for k in store.list_keys(f"engram:l{layer_id}:") if k.state == "lost"] \
        if hasattr(store, "list_keys") else []
    if lost:
        log.warning("layer %d: the store lost %d of its objects (%s%s; engram-master status lists them); streaming "
                    "the layer from the checkpoint again", layer_id, len(lost), ", ".join(lost[:3]),
                    ", ..." if len(lost) > 3 else "")
    else:
        log.info("layer %d is not in the store yet: streaming it from the checkpoint", layer_id)


def _pack_column(weight: np.ndarray, scale: np.ndarray, offset: int, column: np.ndarray, layer_id: int, c: int,
                 cols: int, progress: bool | None) -> np.ndarray:
    """Pack column ``c``'s rows (``column.shape[0]`` of them from table row ``offset``) into ``column``: codes then
    scale bytes, refusing NaN codes, chunk by chunk with a progress bar."""
    prime, row_bytes = column.shape
    bar = Progress(column.nbytes, f"layer {layer_id} column {c + 1}/{cols}",
                   enabled=progress if progress is not None else (None if column.nbytes >= PROGRESS_MIN_BYTES
                                                                  else False))
    try:
        for lo in range(0, prime, CHUNK_ROWS):
            hi = min(lo + CHUNK_ROWS, prime)
            bad = _kernels.pack_rows(weight[offset + lo:offset + hi], scale[offset + lo:offset + hi], column[lo:hi])
            if bad >= 0:
                raise InvalidArgument(f"layer {layer_id}: table row {offset + lo + int(bad)} (column {c}) holds an "
                                      "e4m3 NaN code or e8m0 byte 255")
            bar(hi * row_bytes)
    finally:
        bar.close()
    return column


def _load_to_disk(ckpt: "SafetensorsCheckpoint", config: V41Config, layer_id: int, disk_dir: Any,
                  progress: bool | None, options: dict[str, Any]) -> EngramStore:
    """:func:`load_v41_table` into a ``disk_dir``: each column's rows are packed chunk by chunk as the writer asks."""
    from engram_store.disk import DiskDir

    layout = v41_store_config(config, layer_id)
    weight, scale = _table_tensors(ckpt, config, layer_id)
    directory = DiskDir(disk_dir)
    if layer_id in directory.layers():
        raise ObjectExists(f"layer {layer_id} is already published under disk_dir {directory.path}; remove it first")
    nbytes = config.num_embeddings(layer_id) * config.row_bytes
    bar = Progress(nbytes, f"layer {layer_id} to {directory.path}",
                   enabled=progress if progress is not None else (None if nbytes >= PROGRESS_MIN_BYTES else False))
    try:
        directory.write(layer_id, config.row_bytes, layout.table_vocab_sizes,
                        _column_fills(weight, scale, config, layer_id), progress=bar)
    finally:
        bar.close()
    return EngramStore(layer_id, layout, **{**options, "disk_dir": directory.path})


def _column_fills(weight: np.ndarray, scale: np.ndarray, config: V41Config, layer_id: int) -> list:
    """One ``fill(start_row, out)`` per column: its rows packed (codes, then scale bytes) chunk by chunk, NaNs
    refused naming the table row."""
    def column(c: int, offset: int):
        def fill(start: int, out: np.ndarray) -> None:
            rows = slice(offset + start, offset + start + out.shape[0])
            bad = _kernels.pack_rows(weight[rows], scale[rows], out)
            if bad >= 0:
                raise InvalidArgument(f"layer {layer_id}: table row {offset + start + int(bad)} (column {c}) holds an "
                                      "e4m3 NaN code or e8m0 byte 255")
        return fill
    return [column(c, offset) for c, offset in enumerate(config.offsets(layer_id).tolist())]


def _load_to_local_dir(ckpt: "SafetensorsCheckpoint", config: V41Config, layer_id: int,
                       options: dict[str, Any]) -> EngramStore:
    """:func:`load_v41_table` under a ``local_dir``: each column's file is written from its rows chunk by chunk."""
    weight, scale = _table_tensors(ckpt, config, layer_id)
    layer = EngramStore(layer_id, v41_store_config(config, layer_id), None, **options)
    try:
        layer.populate(_column_fills(weight, scale, config, layer_id))
    except BaseException:
        layer.close()
        raise
    return layer
