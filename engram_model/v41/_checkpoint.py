"""Reading DeepSeek-V4.1's Engram tensors from safetensors shards, and streaming a layer's table into the store.

Per Engram layer L the checkpoint holds::

    layers.{L}.engram.embed.weight   F8_E4M3  [num_embeddings, head_dim]          the table's codes
    layers.{L}.engram.embed.scale    F8_E8M0  [num_embeddings, head_dim / 32]     one scale byte per 32 values
    layers.{L}.engram.wkv.weight     F8_E4M3  [(hc + 1) * hidden, cols * head_dim]
    layers.{L}.engram.wkv.scale      F8_E8M0  [(hc + 1) * hidden / 32, cols * head_dim / 32]   32x32 blocks
    layers.{L}.engram.q_weight       BF16     [hc, hidden]
    layers.{L}.engram.k_weight       BF16     [hc, hidden]

Other stacks add a ``model.`` prefix or call the scales ``weight_scale_inv``; both are accepted. The shards are read
by :class:`SafetensorsCheckpoint` (``_safetensors``: headers held to the format, data read with ``pread``, so a shard
truncated mid-load is a named error and not SIGBUS, and index entries confined to the checkpoint's directory).
:func:`load_v41_table` copies a table into the store one column (one head shard of the layer) at a time, reading a
run of rows at a time, so memory stays bounded by one column (about 4.2 GB); the last shard publishes the layer's
manifest. If a column fails, the columns this call wrote are removed first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engram_store import EngramStore
from engram_store.errors import InvalidArgument
from engram_store.progress import Progress

from .._rows_format import E4M3_TABLE
from .._safetensors import FLOATS as _FLOATS
from .._safetensors import SafetensorsCheckpoint
from .._table_load import (CHUNK_ROWS, PROGRESS_MIN_BYTES, as_checkpoint, expect, open_or_load, populate_heads,
                           table_options, write_to_disk, write_to_local_dir)
from . import _kernels
from ._config import FP8_BLOCK, V41Config, v41_store_config


def tensor_name(ckpt: SafetensorsCheckpoint, layer_id: int, part: str) -> str:
    """The checkpoint's name for ``layers.{L}.engram.{part}``, with or without ``model.``; ``weight_scale_inv``
    stands for ``scale``."""
    parts = [part] + ([part[:-len("scale")] + "weight_scale_inv"] if part.endswith(".scale") else [])
    tried = [f"{prefix}layers.{layer_id}.engram.{p}" for prefix in ("", "model.") for p in parts]
    for name in tried:
        if name in ckpt:
            return name
    raise InvalidArgument(f"{ckpt.path}: layer {layer_id} has no Engram tensor {part!r} (tried {', '.join(tried)})")


def load_v41_weights(path: Any, config: V41Config, layer_id: int) -> dict[str, np.ndarray]:
    """``{"wkv", "q_weight", "k_weight"}`` of one layer as float32, ``wkv`` dequantised by its 32x32 block scales."""
    ckpt = as_checkpoint(path)
    config.layer_index(layer_id)
    hc, hidden, K = config.hc_mult, config.hidden_size, config.cols * config.head_dim
    out: dict[str, np.ndarray] = {}
    for part in ("q_weight", "k_weight"):
        name = tensor_name(ckpt, layer_id, part)
        expect(ckpt, name, _FLOATS, (hc, hidden))
        out[part] = ckpt.float32(name)
    name = tensor_name(ckpt, layer_id, "wkv.weight")
    shape = ((hc + 1) * hidden, K)
    dtype = expect(ckpt, name, ("F8_E4M3",) + _FLOATS, shape)
    if dtype in _FLOATS:  # already dequantised by another stack
        out["wkv"] = ckpt.float32(name)
        return out
    scale_name = tensor_name(ckpt, layer_id, "wkv.scale")
    blocks = (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))
    scale_dtype = expect(ckpt, scale_name, ("F8_E8M0", "U8") + _FLOATS, blocks)
    if scale_dtype in _FLOATS:  # scales stored as their values
        scales = ckpt.float32(scale_name)
    else:
        raw = ckpt.raw(scale_name)
        if (raw == 255).any():
            i, j = (int(v) for v in np.argwhere(raw == 255)[0])
            raise InvalidArgument(f"{scale_name}: block [{i}, {j}] has e8m0 byte 255 (NaN)")
        scales = np.ldexp(1.0, raw.astype(np.int64) - 127).astype(np.float32)
    wkv = np.empty(shape, dtype=np.float32)
    bad = _kernels.dequantize_blocks(ckpt.raw(name), np.ascontiguousarray(scales), E4M3_TABLE, wkv)
    if bad >= 0:
        raise InvalidArgument(f"{name}: e4m3 NaN code at {list(divmod(int(bad), shape[1]))}")
    out["wkv"] = wkv
    return out


class _TableRows:
    """A layer's table in the checkpoint, read a run of rows at a time into buffers it reuses: ``rows(start, count)``
    gives ``(codes [count, head_dim], scale bytes [count, head_dim / 32])``."""

    def __init__(self, ckpt: SafetensorsCheckpoint, weight: str, scale: str, head_dim: int):
        self.ckpt, self.weight, self.scale = ckpt, weight, scale
        self.codes = np.empty((0, head_dim), np.uint8)
        self.scales = np.empty((0, head_dim // FP8_BLOCK), np.uint8)

    def __call__(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        if count > self.codes.shape[0]:
            self.codes = np.empty((count, self.codes.shape[1]), np.uint8)
            self.scales = np.empty((count, self.scales.shape[1]), np.uint8)
        return (self.ckpt.read_rows(self.weight, start, self.codes[:count]),
                self.ckpt.read_rows(self.scale, start, self.scales[:count]))


def _table_tensors(ckpt: SafetensorsCheckpoint, config: V41Config, layer_id: int) -> _TableRows:
    rows, hd = config.num_embeddings(layer_id), config.head_dim
    weight = tensor_name(ckpt, layer_id, "embed.weight")
    expect(ckpt, weight, ("F8_E4M3", "U8"), (rows, hd))
    scale = tensor_name(ckpt, layer_id, "embed.scale")
    expect(ckpt, scale, ("F8_E8M0", "U8"), (rows, hd // FP8_BLOCK))
    return _TableRows(ckpt, weight, scale, hd)


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
    ckpt = as_checkpoint(path)
    layout = v41_store_config(config, layer_id)
    table = _table_tensors(ckpt, config, layer_id)  # the tensors are checked before anything else
    options = table_options(layer_id, store, disk_dir, local_dir, row_cache_bytes, cache_scope)
    if disk_dir is not None:
        return write_to_disk(layout, layer_id, disk_dir, _column_fills(table, config, layer_id), progress, options)
    if local_dir is not None:
        return write_to_local_dir(layout, layer_id, _column_fills(table, config, layer_id), options)
    offsets, primes = config.offsets(layer_id).tolist(), layout.table_vocab_sizes
    buffer = np.empty((max(primes), config.row_bytes), dtype=np.uint8)
    return populate_heads(store, layout, layer_id, options, replica_num, lambda c: _pack_column(
        table, offsets[c], buffer[:primes[c]], layer_id, c, config.cols, progress), "column")


def open_v41_table(path: Any, config: V41Config, layer_id: int, store: Any = None, *, disk_dir: Any = None,
                   local_dir: Any = None, replica_num: int = 1, progress: bool | None = None, row_cache_bytes: int = 0,
                   cache_scope: str = "process") -> EngramStore:
    """The layer's EngramStore in ``store``, under ``disk_dir`` or under ``local_dir``: opened where the layer is
    there already, else streamed in from the checkpoint first (:func:`load_v41_table`, which takes the same
    arguments). A layer partly in a store (an interrupted load) is refused: remove it and load it again."""
    layout = v41_store_config(config, layer_id)
    options = table_options(layer_id, store, disk_dir, local_dir, row_cache_bytes, cache_scope)
    load = dict(disk_dir=disk_dir, local_dir=local_dir, replica_num=replica_num, progress=progress,
                row_cache_bytes=row_cache_bytes, cache_scope=cache_scope)
    return open_or_load(layout, layer_id, store, options, lambda: load_v41_table(path, config, layer_id, store,
                                                                                 **load), "column")


def _pack_column(table: _TableRows, offset: int, column: np.ndarray, layer_id: int, c: int, cols: int,
                 progress: bool | None) -> np.ndarray:
    """Pack column ``c``'s rows (``column.shape[0]`` of them from table row ``offset``) into ``column``: codes then
    scale bytes, refusing NaN codes, chunk by chunk with a progress bar."""
    prime, row_bytes = column.shape
    bar = Progress(column.nbytes, f"layer {layer_id} column {c + 1}/{cols}",
                   enabled=progress if progress is not None else (None if column.nbytes >= PROGRESS_MIN_BYTES
                                                                  else False))
    try:
        for lo in range(0, prime, CHUNK_ROWS):
            hi = min(lo + CHUNK_ROWS, prime)
            bad = _kernels.pack_rows(*table(offset + lo, hi - lo), column[lo:hi])
            if bad >= 0:
                raise InvalidArgument(f"layer {layer_id}: table row {offset + lo + int(bad)} (column {c}) holds an "
                                      "e4m3 NaN code or e8m0 byte 255")
            bar(hi * row_bytes)
    finally:
        bar.close()
    return column


def _column_fills(table: _TableRows, config: V41Config, layer_id: int) -> list:
    """One ``fill(start_row, out)`` per column: its rows packed (codes, then scale bytes) chunk by chunk, NaNs
    refused naming the table row."""
    def column(c: int, offset: int):
        def fill(start: int, out: np.ndarray) -> None:
            bad = _kernels.pack_rows(*table(offset + start, out.shape[0]), out)
            if bad >= 0:
                raise InvalidArgument(f"layer {layer_id}: table row {offset + start + int(bad)} (column {c}) holds an "
                                      "e4m3 NaN code or e8m0 byte 255")
        return fill
    return [column(c, offset) for c, offset in enumerate(config.offsets(layer_id).tolist())]


