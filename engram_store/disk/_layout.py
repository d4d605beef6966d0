"""Where each row of a layer lies in its file, and the manifest that records it.

A published layer is a directory::

    <dir>/layer-<L>/manifest.json   layer id, row_bytes, sizes, the layout below, xxh3_64 of each head's rows
    <dir>/layer-<L>/rows.bin        every head's table, one after the other (mode 0444)
    <dir>/layer-<L>.lock            flock'd by a writer or remover for its whole work (a remove deletes it)
    <dir>/layer-<L>.tmp/            where a writer stages both files before one rename publishes them
    <dir>/layer-<L>.removing/       where a remover renames the layer before deleting it

A ``.tmp`` or ``.removing`` directory found while holding the layer's lock was left by a writer or remover
that died (a live one holds the lock until its directory is gone): the next writer of the layer deletes a
``.tmp``; the next writer or remover of the layer, and every ``DiskDir`` opened on the directory, a ``.removing``.

No row straddles a 4 KiB page, so one row costs one page read: rows of at most 4 KiB are packed
``4096 // row_bytes`` to a page (264-byte rows: 15 a page, 136 bytes of padding), larger rows start on a page
boundary and take whole pages. Each head's table starts on a page boundary. The unit of a read, the *block*, is
one page for small rows and one row's pages for large ones.

The checksum of a head is xxh3_64 of its logical rows (``N_h * row_bytes`` bytes, no padding), the value
``EngramStore`` records in its own manifests for the same table.

Every block read back is checked as well, where its rows leave room: a layer of format ``engram-disk-v2`` whose
blocks have at least 8 bytes of padding (264-byte rows: 136) keeps XXH64 of each block's other bytes in its last 8
(see ``_checksum``), and the reader checks each block as it lands, before any of its rows is served or cached. Its
manifest says so (``"page_checksum": {"algorithm": "xxh64", ...}``, or ``null`` for rows that fill their pages to
within 8 bytes, which are read unchecked). Layers written before (``engram-disk-v1``) are read unchecked.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import ConfigError, InvalidArgument, InvalidType, StoreError, describe
from .._layer_dir import read_at
from ._checksum import CHECKSUM_BYTES

PAGE_BYTES = 4096
FORMAT = "engram-disk-v2"
#: Layers written before page checksums: read unchecked.
FORMAT_V1 = "engram-disk-v1"
#: What a v2 manifest records of its page checksums.
PAGE_CHECKSUM = {"algorithm": "xxh64", "seed": "block offset", "at": "last 8 bytes of each block"}
MANIFEST = "manifest.json"
#: A manifest larger than this is refused unread (one of a 10^5-head layer takes a few MB).
MAX_MANIFEST_BYTES = 16 << 20
DATA_FILE = "rows.bin"
#: A key's row part in the hot-row cache has 40 bits: no layer may hold more rows than that.
MAX_LAYER_ROWS = 1 << 40


def layer_dir_name(layer_id: int) -> str:
    return f"layer-{layer_id}"


def check_layer_id(layer_id: Any) -> int:
    if isinstance(layer_id, bool) or not hasattr(layer_id, "__index__"):
        raise InvalidType(f"layer_id: expected an int >= 0, got {describe(layer_id)}")
    value = int(layer_id.__index__())
    if value < 0:
        raise InvalidArgument(f"layer_id: expected an int >= 0, got {value}")
    return value


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidType(f"{name}: expected an int > 0, got {describe(value)}")
    value = int(value.__index__())
    if value <= 0:
        raise InvalidArgument(f"{name}: expected an int > 0, got {value}")
    return value


@dataclass(frozen=True)
class DiskLayout:
    """The geometry of one layer's file. Build it with :meth:`of`; every field follows from ``row_bytes`` and
    ``sizes``."""

    row_bytes: int
    sizes: tuple[int, ...]            # rows of each head's table
    rows_per_block: int               # rows in one block (1 for rows over a page)
    block_bytes: int                  # bytes of one block: a page, or one large row's pages
    head_offsets: tuple[int, ...]     # byte offset of each head's first block in the file (page-aligned)
    file_bytes: int                   # the file's size: a whole number of pages
    checked: bool = False             # each block's last 8 bytes hold its checksum (see _checksum)

    @classmethod
    def of(cls, row_bytes: int, sizes: Sequence[int], checked: bool = False) -> "DiskLayout":
        """The geometry of ``sizes`` rows of ``row_bytes``; ``checked``: with page checksums where the rows leave
        room for them (see :attr:`room`)."""
        row_bytes = _positive_int(row_bytes, "row_bytes")
        if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__len__") or len(sizes) == 0:
            raise InvalidArgument(f"sizes: expected a non-empty list of row counts, one per head, "
                                  f"got {describe(sizes)}")
        sizes = tuple(_positive_int(n, f"sizes[{h}]") for h, n in enumerate(sizes))
        if sum(sizes) > MAX_LAYER_ROWS:
            raise InvalidArgument(f"sizes: expected at most {MAX_LAYER_ROWS} rows in all, got {sum(sizes)}")
        if row_bytes <= PAGE_BYTES:
            rows_per_block, block_bytes = PAGE_BYTES // row_bytes, PAGE_BYTES
        else:
            rows_per_block, block_bytes = 1, -(-row_bytes // PAGE_BYTES) * PAGE_BYTES
        offsets, at = [], 0
        for n in sizes:
            offsets.append(at)
            at += -(-n // rows_per_block) * block_bytes
        room = block_bytes - rows_per_block * row_bytes >= CHECKSUM_BYTES
        return cls(row_bytes, sizes, rows_per_block, block_bytes, tuple(offsets), at, bool(checked) and room)

    @property
    def room(self) -> bool:
        """Whether a block's rows leave room for its checksum (8 bytes)."""
        return self.block_bytes - self.rows_per_block * self.row_bytes >= CHECKSUM_BYTES

    @property
    def summed_bytes(self) -> int:
        """The bytes of a block its checksum covers (all but its last 8), or 0 for a layout without checksums."""
        return self.block_bytes - CHECKSUM_BYTES if self.checked else 0

    @property
    def num_heads(self) -> int:
        return len(self.sizes)

    def head_blocks(self, head: int) -> int:
        return -(-self.sizes[head] // self.rows_per_block)

    def row_offset(self, head: int, row: int) -> int:
        """File offset of row ``row`` of head ``head``."""
        block, slot = divmod(row, self.rows_per_block)
        return self.head_offsets[head] + block * self.block_bytes + slot * self.row_bytes

    def as_dict(self) -> dict:
        return {"page_bytes": PAGE_BYTES, "rows_per_block": self.rows_per_block, "block_bytes": self.block_bytes,
                "head_offsets": list(self.head_offsets), "file": DATA_FILE, "file_bytes": self.file_bytes}


def manifest(layer_id: int, layout: DiskLayout, checksums: Sequence[str]) -> dict:
    return {"format": FORMAT, "layer_id": layer_id, "row_bytes": layout.row_bytes, "sizes": list(layout.sizes),
            "layout": layout.as_dict(), "checksum": {"algorithm": "xxh3_64", "heads": list(checksums)},
            "page_checksum": dict(PAGE_CHECKSUM) if layout.checked else None}


def page_checks(record: dict, layout: DiskLayout) -> str:
    """How a layer's pages are checked as they are read, in words: ``"xxh64"``, or why they are not."""
    if layout.checked:
        return "xxh64"
    if record.get("format") == FORMAT_V1:
        return "unchecked (written before page checksums)"
    if layout.room:
        return "unchecked (written without page checksums)"
    return "unchecked (its rows fill the pages: no room for a checksum)"


def read_manifest_at(dir_fd: int, path: str) -> tuple[dict, DiskLayout]:
    """The manifest of the layer directory held open as ``dir_fd`` (``path`` names it in messages), checked as a file
    read under a ``disk_dir`` is (``_layer_dir.open_at``), and the layout it describes (checked against its fields).
    FileNotFoundError when it is not there."""
    file = os.path.join(path, MANIFEST)
    try:
        data = read_at(dir_fd, MANIFEST, file, "disk layer", MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise StoreError(f"disk layer: cannot read {file}: {exc.strerror}") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise StoreError(f"disk layer: {file} holds more than {MAX_MANIFEST_BYTES} bytes; it is not a manifest")
    return parse_manifest(data, file)


def parse_manifest(data: bytes, file: str) -> tuple[dict, DiskLayout]:
    """A manifest's record and the layout it describes, checked against its fields (``file`` names it)."""
    try:
        record = json.loads(data)
    except ValueError as exc:
        raise StoreError(f"disk layer: {file} is not valid JSON: {exc}") from None
    if not isinstance(record, dict) or record.get("format") not in (FORMAT, FORMAT_V1):
        raise StoreError(f"disk layer: {file} is not an {FORMAT} (or {FORMAT_V1}) manifest (format "
                         f"{describe(record.get('format') if isinstance(record, dict) else record)})")
    pages = record.get("page_checksum") if record["format"] == FORMAT else None
    try:
        layout = DiskLayout.of(record["row_bytes"], record["sizes"], checked=pages is not None)
        stored = record["layout"]
        checksums = record["checksum"]["heads"]
    except (KeyError, TypeError, InvalidArgument, InvalidType) as exc:
        raise StoreError(f"disk layer: {file} is malformed: {exc}") from None
    if pages is not None and (pages != PAGE_CHECKSUM or not layout.checked):
        raise StoreError(f"disk layer: {file} records page checksums {describe(pages, 200)}, expected "
                         f"{PAGE_CHECKSUM}" + ("" if layout.room else f" (and {layout.row_bytes}-byte rows leave "
                                                                      "no room for them)"))
    if stored != layout.as_dict() or len(checksums) != layout.num_heads:
        raise StoreError(f"disk layer: {file} records layout {describe(stored, 200)}, but row_bytes="
                         f"{layout.row_bytes} and {layout.num_heads} heads give {describe(layout.as_dict(), 200)}")
    return record, layout


def check_expected(path: str, layout: DiskLayout, row_bytes: int | None, sizes: Sequence[int] | None) -> None:
    """Raise ConfigError if the caller expects another geometry than the published one."""
    want_rows = layout.row_bytes if row_bytes is None else row_bytes
    want_sizes = layout.sizes if sizes is None else tuple(int(n) for n in sizes)
    if want_rows != layout.row_bytes or want_sizes != layout.sizes:
        def show(rb, sz):
            listed = ", ".join(str(n) for n in sz[:8]) + (", ..." if len(sz) > 8 else "")
            return f"row_bytes={rb}, sizes=[{listed}] ({len(sz)} heads)"
        raise ConfigError(f"disk layer at {path} was published with {show(layout.row_bytes, layout.sizes)}, "
                          f"but the caller expects {show(want_rows, want_sizes)}")


def dumps(record: dict) -> bytes:
    return (json.dumps(record, indent=1) + "\n").encode()
