"""A layer's manifest: its layout (head sizes, row format) and a checksum per head, written last and read first.

A layer in a store is published by its manifest object (``engram:l{L}:manifest``): readers refuse a layer without
one (never populated, or a populate that died half-way) and one stored with another layout than theirs.
"""

from __future__ import annotations

import json
import zlib
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import xxhash

from ..errors import ConfigError, MixedLayer, ObjectNotFound, StoreError
from ._layout import Layer

#: Version of the layout manifest written with each layer (1: crc32 checksums; 2: xxh3_64 or crc32, named).
MANIFEST_VERSION = 2


def manifest_record(lay: Layer, checksums: Mapping[int, str | None] | None = None, algorithm: str = "xxh3_64") -> dict:
    """The manifest of ``lay``; ``checksums`` by head index (heads without one record None)."""
    checksums = checksums or {}
    return {"format": "engram-layer", "version": MANIFEST_VERSION, "layer_id": lay.layer_id,
            "table_vocab_sizes": list(lay.layer_sizes), "embedding_dim": lay.dim, "row_format": lay.row_format,
            "checksum": algorithm, "checksums": [checksums.get(h) for h in range(len(lay.layer_sizes))]}


def encode(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True).encode()


def decode(lay: Layer, data: Any) -> dict:
    """The manifest in ``data`` (bytes-like), checked to be one."""
    try:
        record = json.loads(bytes(data))
    except ValueError:
        raise StoreError(f"{lay.manifest_key!r} does not hold a layout manifest (not JSON)") from None
    if not isinstance(record, dict) or record.get("format") != "engram-layer":
        raise StoreError(f"{lay.manifest_key!r} does not hold an engram layer manifest")
    return record


def check(lay: Layer, record: dict | None) -> None:
    """Refuse a layer that is not published, or stored with another layout than ``lay``'s configuration."""
    if record is None:
        raise ObjectNotFound(f"layer {lay.layer_id} is not published: {lay.manifest_key!r} is missing "
                             "(the layer was never populated, a populate is still running, or one was "
                             "interrupted; remove_from_store(force=True) and populate again)")
    if record.get("version") not in (1, MANIFEST_VERSION):
        raise StoreError(f"layer {lay.layer_id}: manifest version {record.get('version')!r}; this engram "
                         f"reads versions 1 to {MANIFEST_VERSION}")
    mine = manifest_record(lay)
    for name in ("table_vocab_sizes", "embedding_dim", "row_format"):
        if record.get(name) != mine[name]:
            raise ConfigError(f"layer {lay.layer_id} is stored with {name}={record.get(name)!r}, but this "
                              f"EngramStore is configured with {name}={mine[name]!r}; use the configuration "
                              "it was populated with")


def check_heads(lay: Layer, record: dict, stored: Sequence[str]) -> None:
    """Refuse a layer whose heads are not the tables its manifest names: ``stored`` holds the checksum the store
    keeps of each of ``lay``'s heads (xxh3_64 of its bytes, as the populate that wrote it gave it; "" where it
    keeps none), and a head whose checksum is not the manifest's was written by another populate. A master that
    restarted without a journal learns the objects back from the segments, and a segment that was away then
    brings back heads of an earlier populate of the layer beside a later one's: read, the layer would give rows of
    both. Heads or manifests without checksums (other stores, a manifest of crc32s) are taken as they are."""
    recorded = record.get("checksums")
    if record.get("checksum") != "xxh3_64" or not isinstance(recorded, list):
        return
    for j, h in enumerate(lay.heads):
        want = recorded[h] if 0 <= h < len(recorded) else None
        got = stored[j] if j < len(stored) else ""
        if want and got and want != got:
            raise MixedLayer(f"layer {lay.layer_id}: head {h} ({lay.keys[j]!r}) holds another table (xxh3_64 {got}) "
                             f"than its manifest names ({want}): the layer mixes heads of two populates (a master "
                             "that restarted without a journal took them back from different segments); it is not "
                             "read. remove_from_store(force=True) and populate it again")


def checksums(tables: Sequence[np.ndarray], algorithm: str | None = None) -> tuple[str, list[str]]:
    """Checksums of each table's bytes as hex strings: xxh3_64 (about 11 GB/s here, GIL released) unless
    ``algorithm`` names another (verify of a manifest written with crc32: zlib, about 2.3 GB/s)."""
    algorithm = algorithm or "xxh3_64"
    if algorithm == "xxh3_64":
        return algorithm, [xxhash.xxh3_64_hexdigest(t.reshape(-1).view(np.uint8)) for t in tables]
    if algorithm == "crc32":
        return algorithm, [f"{zlib.crc32(t.reshape(-1).view(np.uint8)) & 0xFFFFFFFF:08x}" for t in tables]
    raise StoreError(f"manifest checksum {algorithm!r} is not one this engram computes (xxh3_64, crc32)")


def verify(lay: Layer, record: dict, read_head: Callable[[int], np.ndarray]) -> list[int]:
    """Compare the checksums ``record`` holds for ``lay``'s heads with their bytes (``read_head(j)``: the table of
    this store's j-th head, flat); returns the heads checked, raises StoreError naming the first that differs."""
    if record.get("version") == 1:
        algorithm, values = "crc32", record.get("crc32", [])
    else:
        algorithm, values = record.get("checksum"), record.get("checksums", [])
    checked = []
    for j, h in enumerate(lay.heads):
        expected = values[h] if h < len(values) else None
        if expected is None:
            continue
        got = checksums([read_head(j)], algorithm)[1][0]
        if got != expected:
            raise StoreError(f"layer {lay.layer_id} head {h}: stored rows have {algorithm} {got}, the manifest "
                             f"says {expected}")
        checked.append(h)
    return checked
