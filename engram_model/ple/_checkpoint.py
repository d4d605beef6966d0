"""Reading Qwen4-Exp's PLE tensors from safetensors shards, and streaming a layer's table into the store.

Per PLE layer L (one-indexed; decoder layer ``i = L - 1``) the checkpoint holds, under
``model.language_model.layers.{i}.ple.`` (``model.layers.{i}.ple.`` in text-only exports)::

    ple_embedding.ngram_embedding.shard_{k}.weight   BF16 or F8_E4M3  [ceil(rows / parts), head_dim]  k < parts
    ple_embedding.ngram_embedding.weight_scale       F32 (or BF16)    [1]           FP8 exports: the table's scale
    ple_embedding.layer_multipliers                  I64   [ngram_size]
    ple_embedding.ngram_heads_vocab_sizes            I64   [heads]
    ple_embedding.ngram_heads_offsets                I64   [heads]
    key_proj.weight                                  [hc * hidden, ple_embed_dim]   (FP8 exports: F8_E4M3 and
    value_proj.weight                                [hidden, ple_embed_dim]         weight_scale_inv blocks)
    norm_key.weight, norm_query.weight, norm_conv.weight                             [hc * hidden]
    conv1d.weight                                    [hc * hidden, 1, ple_conv_kernel_size]

The table's rows are the shards one after the other (transformers concatenates them in the order of k), 128
contiguous row ranges in the release that cross head boundaries. :func:`load_ple_table` re-slices them into the
layer's prime-sized heads (the padding rows after the last head, which no id addresses, are checked and not
stored) and streams them with the V4.1 loader's pieces (:mod:`engram_model.v41._checkpoint`): into a store one
head shard at a time (memory bounded by one head, 3.2 GB FP8 or 6.4 GB bf16 for the release), or under
``disk_dir`` / ``local_dir`` chunk by chunk; published atomically, rolled back on failure. Rows holding an e4m3
NaN code or a bf16 NaN or infinity are refused, naming the table row.

The checkpoint's ``layer_multipliers``, ``ngram_heads_vocab_sizes`` and ``ngram_heads_offsets`` take precedence
over the config's, as in both engines; a disagreement is logged as a WARNING naming both
(:func:`load_ple_hash_buffers`).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from engram_store import EngramStore
from engram_store.errors import InvalidArgument
from engram_store.progress import Progress

from .._rows_format import E4M3_TABLE, RowFormat
from .._safetensors import FLOATS, SafetensorsCheckpoint
from .._table_load import (CHUNK_ROWS, PROGRESS_MIN_BYTES, as_checkpoint, expect, open_or_load, populate_heads,
                           table_options, write_to_disk, write_to_local_dir)
from ._config import PLEConfig, PLEHashBuffers, ple_store_config

log = logging.getLogger(__name__)

#: Where a layer's PLE tensors live, ``{i}`` the decoder layer index: multimodal exports first, then text-only ones.
PREFIXES = ("model.language_model.layers.{i}.ple.", "model.layers.{i}.ple.", "language_model.model.layers.{i}.ple.",
            "layers.{i}.ple.")
TABLE = "ple_embedding.ngram_embedding."
#: safetensors dtype of the table's shards, by row code.
TABLE_DTYPES = {"bf16": "BF16", "e4m3": "F8_E4M3"}
_INTS = ("I64", "I32")
#: Rows and columns of a weight that one ``weight_scale_inv`` scale covers in FP8 exports (fine-grained FP8, the
#: ``weight_block_size`` of their quantization_config).
FP8_WEIGHT_BLOCK = 128


def tensor_prefix(ckpt: SafetensorsCheckpoint, layer_id: int) -> str:
    """The prefix of layer ``layer_id``'s PLE tensors in the checkpoint (see :data:`PREFIXES`)."""
    tried = [p.format(i=int(layer_id) - 1) for p in PREFIXES]
    for prefix in tried:
        if prefix + "key_proj.weight" in ckpt or prefix + TABLE + "shard_0.weight" in ckpt:
            return prefix
    raise InvalidArgument(f"{ckpt.path}: PLE layer {layer_id} (decoder layer {int(layer_id) - 1}) has no PLE tensors "
                          f"(tried {', '.join(p + 'key_proj.weight' for p in tried)})")


class ShardedTable:
    """A layer's table as its checkpoint cuts it: shard k holds rows ``starts[k] .. starts[k + 1]``. Checked when
    built (names without gaps, the dtype of the config's rows, ``[n_k, head_dim]`` shapes); :meth:`read` fills any
    run of rows, across shards."""

    def __init__(self, ckpt: SafetensorsCheckpoint, config: PLEConfig, layer_id: int):
        prefix = tensor_prefix(ckpt, layer_id) + TABLE
        self.ckpt, self.fmt, self.layer_id = ckpt, config.row_format, int(layer_id)
        if f"{prefix}weight" in ckpt:
            names = [f"{prefix}weight"]  # an export that does not cut the table
        else:
            names = []
            while f"{prefix}shard_{len(names)}.weight" in ckpt:
                names.append(f"{prefix}shard_{len(names)}.weight")
        if not names:
            raise InvalidArgument(f"{ckpt.path}: PLE layer {layer_id} has no table ({prefix}shard_0.weight)")
        stray = sorted((n for n in ckpt.names() if n.startswith(prefix + "shard_") and n not in names),
                       key=lambda n: (len(n), n))  # shard_4 before shard_10
        if stray:
            gap = f"{prefix}shard_{len(names)}.weight is missing" if names[0] != f"{prefix}weight" else \
                f"{prefix}weight is there too"
            raise InvalidArgument(f"{ckpt.path}: {gap}, but {stray[0]} is there (the table is {prefix}weight, or "
                                  "shards numbered 0, 1, ... without gaps)")
        want = TABLE_DTYPES[self.fmt.codes]
        sizes = []
        for name in names:
            dtype, shape = ckpt.info(name)
            if dtype != want:
                raise InvalidArgument(f"{name}: expected dtype {want} (ple_embedding_dtype = "
                                      f"{config.ple_embedding_dtype!r} in config.json), got {dtype}")
            if len(shape) != 2 or shape[1] != self.fmt.values:
                raise InvalidArgument(f"{name}: expected shape [rows, {self.fmt.values}] (ple_embed_dim / heads), "
                                      f"got {list(shape)}")
            sizes.append(shape[0])
        self.names = names
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    @property
    def rows(self) -> int:
        """Rows of the whole table (padding included)."""
        return int(self.starts[-1])

    def read(self, start: int, out: np.ndarray) -> None:
        """Rows ``start .. start + len(out)`` of the table into ``out`` (``[n, head_dim]`` of the rows' dtype),
        refusing rows a table must not hold (naming the row, its head and its shard)."""
        end, at = start + out.shape[0], start
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        while at < end:
            hi = min(end, int(self.starts[k + 1]))
            part = out[at - start:hi - start]
            self.ckpt.read_rows(self.names[k], at - int(self.starts[k]), part)
            bad = self.fmt.first_bad_row(part)
            if bad >= 0:
                raise InvalidArgument(f"PLE layer {self.layer_id}: table row {at + bad} ({self.names[k]} row "
                                      f"{at + bad - int(self.starts[k])}) holds {self.fmt.why_bad(part[bad])}")
            at, k = hi, k + 1


def _ints(ckpt: SafetensorsCheckpoint, name: str, n: int) -> np.ndarray | None:
    if name not in ckpt:
        return None
    expect(ckpt, name, _INTS, (n,))
    return ckpt.raw(name).astype(np.int64)


def load_ple_hash_buffers(path: Any, config: PLEConfig, layer_ids: Any = None) -> dict[int, PLEHashBuffers]:
    """Each PLE layer's hash layout, ``{layer_id: PLEHashBuffers}``: the checkpoint's ``layer_multipliers``,
    ``ngram_heads_vocab_sizes`` and ``ngram_heads_offsets`` where it has them (a WARNING names each that differs
    from the config's, and both values), the config's otherwise; the table's rows from its shards."""
    ckpt = as_checkpoint(path)
    return {lid: _layer_buffers(ckpt, config, lid) for lid in config.ple_layer_ids}


def _layer_buffers(ckpt: SafetensorsCheckpoint, config: PLEConfig, lid: int) -> PLEHashBuffers:
    prefix = tensor_prefix(ckpt, lid) + "ple_embedding."
    derived = config.hash_buffers(lid)
    found = {"layer_multipliers": _ints(ckpt, prefix + "layer_multipliers", config.ngram_size),
             "ngram_heads_vocab_sizes": _ints(ckpt, prefix + "ngram_heads_vocab_sizes", config.heads),
             "ngram_heads_offsets": _ints(ckpt, prefix + "ngram_heads_offsets", config.heads)}
    mine = {"layer_multipliers": derived.multipliers, "ngram_heads_vocab_sizes": derived.sizes,
            "ngram_heads_offsets": derived.offsets}
    for name, value in found.items():
        if value is not None and tuple(value.tolist()) != mine[name]:
            log.warning("PLE layer %d: the checkpoint's %s%s %s differs from the config's %s; using the "
                        "checkpoint's, as the engines do", lid, prefix, name, value.tolist(), list(mine[name]))
    rows = ShardedTable(ckpt, config, lid).rows
    if rows != derived.rows:
        log.warning("PLE layer %d: the checkpoint's table has %d rows, the config's %d; using the checkpoint's",
                    lid, rows, derived.rows)
    pick = {name: tuple(v.tolist()) if v is not None else mine[name] for name, v in found.items()}
    return PLEHashBuffers(lid, pick["layer_multipliers"], pick["ngram_heads_vocab_sizes"],
                          pick["ngram_heads_offsets"], rows)


def load_ple_weights(path: Any, config: PLEConfig, layer_id: int) -> dict[str, Any]:
    """One PLE layer's weights as float32: ``key_proj`` ``[hc * hidden, ple_embed_dim]``, ``value_proj``
    ``[hidden, ple_embed_dim]``, ``norm_key``, ``norm_query``, ``norm_conv`` ``[hc * hidden]`` (the stored ``w``;
    the norms scale by ``1 + w``), ``conv1d`` ``[hc * hidden, kernel]``, and ``table_scale``: the FP8 table's
    scale as a float (None for bf16 rows). FP8 projections are dequantised by their ``weight_scale_inv`` blocks
    (or one ``weight_scale``)."""
    ckpt = as_checkpoint(path)
    config.ple_index(layer_id)
    prefix = tensor_prefix(ckpt, layer_id)
    hc_hidden, E = config.hc_count * config.hidden_size, config.ple_embed_dim
    out: dict[str, Any] = {"key_proj": _linear(ckpt, prefix + "key_proj.weight", (hc_hidden, E)),
                           "value_proj": _linear(ckpt, prefix + "value_proj.weight", (config.hidden_size, E))}
    for norm in ("norm_key", "norm_query", "norm_conv"):
        name = prefix + f"{norm}.weight"
        expect(ckpt, name, FLOATS, (hc_hidden,))
        out[norm] = ckpt.float32(name)
    name = prefix + "conv1d.weight"
    expect(ckpt, name, FLOATS, (hc_hidden, 1, config.ple_conv_kernel_size))
    out["conv1d"] = ckpt.float32(name).reshape(hc_hidden, config.ple_conv_kernel_size)
    out["table_scale"] = _table_scale(ckpt, prefix + TABLE + "weight_scale", config.row_format)
    return out


def _table_scale(ckpt: SafetensorsCheckpoint, name: str, fmt: RowFormat) -> float | None:
    if fmt.scale != "table":
        if name in ckpt:
            raise InvalidArgument(f"{name}: the checkpoint scales its table, but config.json describes bf16 rows "
                                  "(set ple_embedding_dtype to float8_e4m3fn)")
        return None
    if name not in ckpt:
        raise InvalidArgument(f"{ckpt.path}: the FP8 table has no scale ({name})")
    dtype, shape = ckpt.info(name)
    if dtype not in FLOATS or int(np.prod(shape)) != 1:
        raise InvalidArgument(f"{name}: expected one float (shape [1]), got {dtype} {list(shape)}")
    scale = float(ckpt.float32(name).reshape(-1)[0])
    if not np.isfinite(scale):
        raise InvalidArgument(f"{name}: expected a finite scale, got {scale}")
    return scale


def _linear(ckpt: SafetensorsCheckpoint, name: str, shape: tuple[int, int]) -> np.ndarray:
    """A projection's weight as float32: a float tensor, or e4m3 codes times their scales."""
    dtype = expect(ckpt, name, FLOATS + ("F8_E4M3",), shape)
    if dtype in FLOATS:
        return ckpt.float32(name)
    base = name.removesuffix("weight")
    codes = ckpt.raw(name)
    bad = np.flatnonzero((codes.reshape(-1) & 0x7F) == 0x7F)
    if bad.size:
        raise InvalidArgument(f"{name}: e4m3 NaN code at {list(divmod(int(bad[0]), shape[1]))}")
    values = E4M3_TABLE[codes]
    if base + "weight_scale_inv" in ckpt:
        scales = ckpt.float32(base + "weight_scale_inv")
        blocks = (-(-shape[0] // FP8_WEIGHT_BLOCK), -(-shape[1] // FP8_WEIGHT_BLOCK))
        if scales.shape != blocks:
            raise InvalidArgument(f"{base}weight_scale_inv: expected {list(blocks)} scales (one per "
                                  f"{FP8_WEIGHT_BLOCK} x {FP8_WEIGHT_BLOCK} block of the weight {list(shape)}), "
                                  f"got {list(scales.shape)}")
        expanded = np.repeat(np.repeat(scales, FP8_WEIGHT_BLOCK, axis=0), FP8_WEIGHT_BLOCK, axis=1)
        return (values * expanded[:shape[0], :shape[1]]).astype(np.float32)
    if base + "weight_scale" in ckpt and int(np.prod(ckpt.info(base + "weight_scale")[1])) == 1:
        return (values * ckpt.float32(base + "weight_scale").reshape(-1)[0]).astype(np.float32)
    raise InvalidArgument(f"{name}: an F8_E4M3 weight needs {base}weight_scale_inv (blocks) or {base}weight_scale "
                          "(one scale)")


def _buffers(ckpt: SafetensorsCheckpoint, config: PLEConfig, layer_id: int,
             buffers: PLEHashBuffers | None) -> PLEHashBuffers:
    """The layer's hash layout: ``buffers``, else the checkpoint's (:func:`load_ple_hash_buffers`)."""
    config.ple_index(layer_id)
    if buffers is None:
        return _layer_buffers(ckpt, config, int(layer_id))
    if not isinstance(buffers, PLEHashBuffers) or buffers.layer_id != int(layer_id):
        raise InvalidArgument(f"buffers: expected the PLEHashBuffers of layer {layer_id}, got {buffers!r}")
    return buffers


def _head_fills(table: ShardedTable, buffers: PLEHashBuffers) -> list:
    """One ``fill(start_row, out)`` per head: its rows read from the shards (out: the head's rows, as bytes)."""
    def head(offset: int):
        def fill(start: int, out: np.ndarray) -> None:
            table.read(offset + start, out.view(table.fmt.dtype))
        return fill
    return [head(offset) for offset in buffers.offsets]


def load_ple_table(path: Any, config: PLEConfig, layer_id: int, store: Any = None, *, disk_dir: Any = None,
                   local_dir: Any = None, replica_num: int = 1, progress: bool | None = None, row_cache_bytes: int = 0,
                   cache_scope: str = "process", buffers: PLEHashBuffers | None = None) -> EngramStore:
    """Stream one PLE layer's table from the checkpoint into ``store`` (a DistributedStore: one head shard at a
    time), under ``disk_dir`` (files on local SSD) or under ``local_dir`` (files in memory, shared by the host's
    processes), re-sliced from the checkpoint's row-range shards into the layer's heads (the layout of
    :func:`ple_store_config`, by the checkpoint's head sizes: ``buffers``, else :func:`load_ple_hash_buffers`).

    Refuses a layer already (or partly) there; on any failure nothing this load wrote stays. ``progress`` shows a
    bar on stderr (None: where stderr is a terminal and the data is large). Returns the layer's EngramStore,
    opened with ``row_cache_bytes`` and ``cache_scope`` (as :class:`EngramStore` takes them).
    """
    ckpt = as_checkpoint(path)
    buffers = _buffers(ckpt, config, layer_id, buffers)
    layout = ple_store_config(config, layer_id, buffers)
    table = ShardedTable(ckpt, config, layer_id)   # the tensors are checked before anything else
    if table.rows != buffers.rows:
        raise InvalidArgument(f"buffers: layer {layer_id}'s table has {buffers.rows} rows there, the checkpoint's "
                              f"{table.rows}")
    if buffers.padding:  # rows no id addresses: read (and so checked) once, not stored
        table.read(sum(buffers.sizes), np.empty((buffers.padding, layout.embedding_dim), table.fmt.dtype))
    options = table_options(layer_id, store, disk_dir, local_dir, row_cache_bytes, cache_scope)
    fills = _head_fills(table, buffers)
    if disk_dir is not None:
        return write_to_disk(layout, layer_id, disk_dir, fills, progress, options)
    if local_dir is not None:
        return write_to_local_dir(layout, layer_id, fills, options)
    buffer = np.empty((max(buffers.sizes), layout.embedding_dim), dtype=table.fmt.dtype)
    return populate_heads(store, layout, layer_id, options, replica_num,
                          lambda h: _read_head(fills[h], buffer[:buffers.sizes[h]], layer_id, h, progress))


def _read_head(fill: Any, out: np.ndarray, layer_id: int, h: int, progress: bool | None) -> np.ndarray:
    """Head ``h``'s rows into ``out``, chunk by chunk with a progress bar."""
    bar = Progress(out.nbytes, f"PLE layer {layer_id} head {h}",
                   enabled=progress if progress is not None else (None if out.nbytes >= PROGRESS_MIN_BYTES else False))
    try:
        for lo in range(0, out.shape[0], CHUNK_ROWS):
            hi = min(lo + CHUNK_ROWS, out.shape[0])
            fill(lo, out[lo:hi].view(np.uint8))
            bar(hi * out.strides[0])
    finally:
        bar.close()
    return out


def open_ple_table(path: Any, config: PLEConfig, layer_id: int, store: Any = None, *, disk_dir: Any = None,
                   local_dir: Any = None, replica_num: int = 1, progress: bool | None = None, row_cache_bytes: int = 0,
                   cache_scope: str = "process", buffers: PLEHashBuffers | None = None) -> EngramStore:
    """The layer's EngramStore in ``store``, under ``disk_dir`` or under ``local_dir``: opened where the table is
    there already, else streamed in from the checkpoint first (:func:`load_ple_table`, same arguments). A table
    partly in a store (an interrupted load) is refused: remove it and load it again."""
    ckpt = as_checkpoint(path)
    buffers = _buffers(ckpt, config, layer_id, buffers)
    options = table_options(layer_id, store, disk_dir, local_dir, row_cache_bytes, cache_scope)
    load = dict(disk_dir=disk_dir, local_dir=local_dir, replica_num=replica_num, progress=progress,
                row_cache_bytes=row_cache_bytes, cache_scope=cache_scope, buffers=buffers)
    return open_or_load(ple_store_config(config, layer_id, buffers), layer_id, store, options,
                        lambda: load_ple_table(ckpt, config, layer_id, store, **load))
