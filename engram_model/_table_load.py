"""Streaming a model family's layer table into its place: a store (head shards), ``disk_dir`` or ``local_dir``.

What every family's loader shares (DeepSeek-V4.1's ``load_v41_table``, Qwen4-Exp's ``load_ple_table``): the one
place a table goes (:func:`table_options`), a layer opened where it is already there or else loaded
(:func:`open_or_load`), heads populated into a store one shard at a time and taken back on failure
(:func:`populate_heads`), ``fill(start_row, out)`` functions written under a ``disk_dir`` or ``local_dir``
(:func:`write_to_disk`, :func:`write_to_local_dir`), and the checks of a checkpoint's tensors (:func:`expect`).
"""

from __future__ import annotations

import logging
from typing import Any

from engram_store import EngramStore
from engram_store.errors import EngramError, InvalidArgument, InvalidType, ObjectExists, ObjectNotFound, describe
from engram_store.progress import Progress

from ._safetensors import SafetensorsCheckpoint

log = logging.getLogger(__name__)


#: Rows packed per chunk while a column is copied (16 MiB of 264-byte rows); the progress bar moves per chunk.
CHUNK_ROWS = 1 << 16


#: Columns smaller than this show no progress bar.
PROGRESS_MIN_BYTES = 64 << 20


def as_checkpoint(path: Any) -> SafetensorsCheckpoint:
    return path if isinstance(path, SafetensorsCheckpoint) else SafetensorsCheckpoint(path)


def expect(ckpt: SafetensorsCheckpoint, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...]) -> str:
    dtype, got = ckpt.info(name)
    if dtype not in dtypes:
        raise InvalidArgument(f"{name}: expected dtype {' or '.join(dtypes)}, got {dtype}")
    if got != shape:
        raise InvalidArgument(f"{name}: expected shape {list(shape)} for this config, got {list(got)}")
    return dtype


def populate_heads(store: Any, layout: Any, layer_id: int, options: dict[str, Any], replica_num: int,
                   head_table: Any, what: str = "head") -> EngramStore:
    """Populate the layer's heads into ``store`` one head shard at a time, ``head_table(h)`` making head h's table
    (into a buffer it may reuse); the last shard publishes the layer's manifest. Refuses a layer already (or partly)
    there; on any failure each shard written is taken back with :meth:`EngramStore.undo_populate` (a layer that
    another process removed with force and loaded meanwhile stays whole). Returns the layer's EngramStore."""
    layer = store_layer(store, layout, layer_id, options)
    heads = len(layout.table_vocab_sizes)
    present = [k for k, e in zip(layer.get_store_keys(), store.batch_is_exist(layer.get_store_keys())) if e]
    if present:
        layer.close()
        raise ObjectExists(f"layer {layer_id}: {len(present)} of {heads} {what}s are already in the store "
                           f"(first {present[0]!r}); remove the layer first")
    written: list[EngramStore] = []
    try:
        for h, rows in enumerate(layout.table_vocab_sizes):
            table = head_table(h)
            shard = EngramStore(layer_id, layout, store, heads=[h])
            shard.populate([table], replica_num=replica_num)
            written.append(shard)
            log.info("layer %d: %s %d/%d written (%d rows)", layer_id, what, h + 1, heads, rows)
    except BaseException:
        for shard in written:
            try:  # this load's heads only: another process may have removed the layer and loaded it since
                shard.undo_populate()
            except EngramError as exc:  # keep the original error; say what could not be cleaned up
                log.error("layer %d: removing a %s this load wrote failed: %s", layer_id, what, exc)
        layer.close()
        raise
    finally:
        for shard in written:
            shard.close()
    return layer


def open_or_load(layout: Any, layer_id: int, store: Any, options: dict[str, Any], load: Any,
                 what: str = "head") -> EngramStore:
    """The layer's EngramStore in the place ``options`` name (:func:`table_options`), opened where the layer is
    there already, else made by ``load()`` (which streams it in). A layer partly in a store is refused."""
    disk_dir, local_dir = options.get("disk_dir"), options.get("local_dir")
    if disk_dir is not None:
        from engram_store.disk import DiskDir

        if layer_id in DiskDir(disk_dir).layers():
            return EngramStore(layer_id, layout, None, **options)
        return load()
    if local_dir is not None:
        layer = EngramStore(layer_id, layout, None, **options)
        try:
            layer.local_tables()  # raises ObjectNotFound where the layer is not published there
        except ObjectNotFound:
            layer.close()
            return load()
        return layer
    layer = store_layer(store, layout, layer_id, options)
    present = store.batch_is_exist(layer.get_store_keys())
    if all(present):
        return layer
    layer.close()
    if any(present):
        raise InvalidArgument(f"store: {sum(present)} of {len(present)} {what}s of layer {layer_id} are in the store "
                              f"(an interrupted load?); engram-layers remove --master {store.master_address} "
                              f"{layer_id}, then load it again")
    _say_why_loading(store, layer_id)
    return load()


def table_options(layer_id: int, store: Any, disk_dir: Any, local_dir: Any, row_cache_bytes: int,
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


def store_layer(store: Any, layout: Any, layer_id: int, options: dict[str, Any]) -> EngramStore:
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


def write_to_disk(layout: Any, layer_id: int, disk_dir: Any, fills: list, progress: bool | None,
                  options: dict[str, Any]) -> EngramStore:
    """Write the layer under ``disk_dir`` from one ``fill(start_row, out)`` per head, chunk by chunk as the writer
    asks, and publish it; refuses a layer already there. Returns the layer's EngramStore."""
    from engram_store.disk import DiskDir

    directory = DiskDir(disk_dir)
    if layer_id in directory.layers():
        raise ObjectExists(f"layer {layer_id} is already published under disk_dir {directory.path}; remove it first")
    nbytes = sum(layout.table_vocab_sizes) * layout.row_bytes
    bar = Progress(nbytes, f"layer {layer_id} to {directory.path}",
                   enabled=progress if progress is not None else (None if nbytes >= PROGRESS_MIN_BYTES else False))
    try:
        directory.write(layer_id, layout.row_bytes, layout.table_vocab_sizes, fills, progress=bar)
    finally:
        bar.close()
    return EngramStore(layer_id, layout, **{**options, "disk_dir": directory.path})


def write_to_local_dir(layout: Any, layer_id: int, fills: list, options: dict[str, Any]) -> EngramStore:
    """Write the layer under ``local_dir`` from one ``fill(start_row, out)`` per head, each head's file chunk by
    chunk, and publish it. Returns the layer's EngramStore."""
    layer = EngramStore(layer_id, layout, None, **options)
    try:
        layer.populate(fills)
    except BaseException:
        layer.close()
        raise
    return layer
