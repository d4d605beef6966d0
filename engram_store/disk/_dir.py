"""A directory of published disk layers: open, write, list, remove and verify them by layer id."""
from __future__ import annotations

import logging
import os
import re
from typing import Callable, Sequence

import numpy as np
import xxhash

from ..errors import ObjectNotFound, StoreError
from .._layer_dir import LayerDir
from . import _kernels as k
from ._cache import RowCache
from ._files import LayerFiles, aligned_empty
from ._layout import DATA_FILE, DiskLayout, check_layer_id, layer_dir_name, page_checks, read_manifest_at
from ._checksum import first_bad_block
from ._reader import DiskLayer, DiskReadError, IOEngine, damaged_block
from ._writer import DEFAULT_CHUNK_BYTES, DEFAULT_LOCK_TIMEOUT_S, HeadSource, LayerWriter, write_layer

log = logging.getLogger(__name__)

_LAYER_DIR = re.compile(r"^layer-(\d+)$")
#: What a remover renames a layer to before deleting it; one that is still there when nobody holds the
#: layer's lock was left by a remover that died.
REMOVING = ".removing"
_REMOVING_DIR = re.compile(r"^layer-(\d+)\.removing$")
#: How much of a layer ``verify`` reads at a time.
VERIFY_CHUNK_BYTES = 32 << 20


class DiskDir:
    """Layers published under one directory (see ``_layout`` for the files), held open from here on (a
    ``LayerDir``: every file under it is opened relative to the directory this opened, whatever the path names
    later). Creates the directory unless ``create=False``. A context manager; ``close()`` is idempotent."""

    def __init__(self, path: str | os.PathLike, *, create: bool = True, flag: str = "disk_dir"):
        self.dir = LayerDir(path, flag, create=create)
        self.path = self.dir.path
        #: Whether this DiskDir made the directory: a layer not published there then may be a mistyped path, which
        #: a reader is told (a writer, which makes a new directory on purpose, is not warned).
        self.created = self.dir.created
        try:
            self._remove_dead_removers_leftovers()
        except BaseException:
            self.dir.close()
            raise

    def _remove_dead_removers_leftovers(self) -> None:
        """Delete each ``layer-<L>.removing`` whose layer nobody holds the lock of (a live remover holds it until
        its directory is gone; one busy now is left to its holder, and to the next remove of the layer)."""
        for name in sorted(self.dir.names()):
            if not _REMOVING_DIR.match(name):
                continue
            layer = name[:-len(REMOVING)]
            try:
                lock = self.dir.lock(layer + ".lock", 0)
            except StoreError:
                continue  # a remover (or writer) of the layer is at work
            except OSError as exc:
                log.warning("cannot lock %s to remove the leftover %s: %s", self.dir.join(layer + ".lock"),
                            self.dir.join(name), exc)
                continue
            try:
                self.dir.remove_leftover(name, "remover")
            except StoreError as exc:  # readers of the directory need not be able to delete in it
                log.warning("%s", exc)
            finally:
                lock.close(unlink=True)

    def layer_path(self, layer_id: int) -> str:
        return self.dir.join(layer_dir_name(check_layer_id(layer_id)))

    def layers(self) -> list[int]:
        """The ids of the published layers, sorted."""
        found = (_LAYER_DIR.match(name) for name in self.dir.names())
        return sorted(int(m.group(1)) for m in found if m and self.dir.is_dir(m.group(0)))

    def open(self, layer_id: int, row_bytes: int | None = None, sizes: Sequence[int] | None = None, *,
             cache: RowCache | None = None, engine: IOEngine | None = None, direct: bool = True) -> DiskLayer | None:
        """The published layer (see :class:`DiskLayer`), or None if it is not published (yet)."""
        if not self.dir.is_dir(layer_dir_name(check_layer_id(layer_id))):
            return None
        try:
            return DiskLayer(self.dir, layer_id, row_bytes, sizes, cache=cache, engine=engine, direct=direct)
        except ObjectNotFound:
            return None  # removed since the look above

    def writer(self, layer_id: int, row_bytes: int, sizes: Sequence[int], **kwargs) -> LayerWriter:
        """A :class:`LayerWriter` for a new layer here (keyword arguments as LayerWriter's)."""
        return LayerWriter(self.dir, layer_id, row_bytes, sizes, **kwargs)

    def write(self, layer_id: int, row_bytes: int, sizes: Sequence[int], heads: Sequence[HeadSource], *,
              progress: Callable[[int], None] | bool | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
              direct: bool = True) -> str:
        """Write and publish a layer (see :func:`write_layer`); returns its directory."""
        return write_layer(self.dir, layer_id, row_bytes, sizes, heads, progress=progress, chunk_bytes=chunk_bytes,
                           direct=direct)

    def remove(self, layer_id: int, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> None:
        """Unpublish a layer (ObjectNotFound if it is not published) and delete its files, leaving nothing of it
        in the directory. Readers that have it open keep reading the removed file until they close it."""
        name = layer_dir_name(check_layer_id(layer_id))
        lock = self.dir.lock(name + ".lock", lock_timeout_s)
        try:
            self.dir.remove_leftover(name + REMOVING, "remover")  # under the lock: a remover that died mid-way
            if not self.dir.is_dir(name):
                raise ObjectNotFound(f"disk layer {layer_id} is not published under {self.path}")
            try:
                self.dir.retire(name, name + REMOVING)  # readers opening it stop seeing it at once
            except OSError as exc:
                raise StoreError(f"disk layer {layer_id}: cannot remove {self.dir.join(name)} (renamed to "
                                 f"{self.dir.join(name + REMOVING)} first): {exc}") from exc
        finally:
            lock.close(unlink=True)  # the lock file goes too: a waiter that opened it locks a fresh one

    def manifest(self, layer_id: int) -> tuple[dict, DiskLayout]:
        """The published layer's manifest and the layout it describes (ObjectNotFound if it is not published)."""
        name = layer_dir_name(check_layer_id(layer_id))
        found = self.dir.open_published(name, read_manifest_at)
        if found is None:
            raise ObjectNotFound(f"disk layer {layer_id} is not published under {self.path}")
        return found

    def page_checks(self, layer_id: int) -> str:
        """How the layer's pages are checked as they are read: ``"xxh64"``, or ``"unchecked (why)"``."""
        return page_checks(*self.manifest(layer_id))

    def verify(self, layer_id: int) -> None:
        """Re-read a published layer and check each page against its checksum (DiskReadError naming the first
        damaged one) and each head against the manifest's checksum (StoreError if one differs). Reads the whole
        file once, with O_DIRECT where allowed."""
        verify_layer(self.dir, layer_id)

    @property
    def closed(self) -> bool:
        return self.dir.held.closed

    def close(self) -> None:
        self.dir.close()

    def __enter__(self) -> "DiskDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def verify_layer(directory: str | os.PathLike | LayerDir, layer_id: int) -> None:
    """See :meth:`DiskDir.verify` (``directory``: a path, or a held ``LayerDir``)."""
    held = directory if isinstance(directory, LayerDir) else LayerDir(directory, "directory", create=False)
    layer_id = check_layer_id(layer_id)

    def missing(file: str) -> DiskReadError:
        return DiskReadError(f"disk layer {layer_id}: cannot open {file} to verify it: No such file or directory; the "
                             "layer's files are damaged: remove it with remove_from_store() and populate it again")

    try:
        files = held.open_published(layer_dir_name(layer_id),
                                    lambda fd, shown: LayerFiles.open(fd, shown, layer_id, None, None, True), missing)
    finally:
        if held is not directory:
            held.close()
    if files is None:
        raise ObjectNotFound(f"disk layer {layer_id} is not published under {held.path}")
    try:
        _verify_heads(files.fd, os.path.join(held.join(layer_dir_name(layer_id)), DATA_FILE), layer_id, files.record,
                      files.layout)
    finally:
        os.close(files.fd)


def _verify_heads(fd: int, file: str, layer_id: int, record: dict, lay: DiskLayout) -> None:
    """Read every head of the open data file ``fd`` and check its pages and its checksum."""
    blocks_per_chunk = max(1, VERIFY_CHUNK_BYTES // lay.block_bytes)
    buf = aligned_empty(blocks_per_chunk * lay.block_bytes)
    rows = np.empty(blocks_per_chunk * lay.rows_per_block * lay.row_bytes, dtype=np.uint8)
    for h, expected in enumerate(record["checksum"]["heads"]):
        hasher = xxhash.xxh3_64()
        left = lay.sizes[h]
        offset = lay.head_offsets[h]
        while left > 0:
            count = min(left, blocks_per_chunk * lay.rows_per_block)
            nbytes = -(-count // lay.rows_per_block) * lay.block_bytes
            got = _read_exact(fd, buf[:nbytes], offset, file)
            assert got == nbytes, "short reads raise"
            bad = first_bad_block(buf, lay.block_bytes, nbytes // lay.block_bytes, offset) if lay.checked else -1
            if bad >= 0:
                raise DiskReadError(damaged_block(layer_id, lay, file, offset + bad * lay.block_bytes))
            k._unpack_rows(buf, lay.row_bytes, lay.rows_per_block, lay.block_bytes, count, rows)
            hasher.update(rows[:count * lay.row_bytes])
            offset += nbytes
            left -= count
        if hasher.hexdigest() != expected:
            raise StoreError(f"disk layer {layer_id}: head {h} of {file} has checksum {hasher.hexdigest()}, the "
                             f"manifest records {expected} (the file was damaged)")


def _read_exact(fd: int, buf: np.ndarray, offset: int, file: str) -> int:
    view = memoryview(buf)
    try:
        got = os.preadv(fd, [view], offset)
    except OSError as exc:
        raise DiskReadError(f"reading {view.nbytes} bytes of {file} at offset {offset} failed: {exc.strerror}") from None
    if got != view.nbytes:
        raise DiskReadError(f"short read of {file} at offset {offset}: got {got} of {view.nbytes} bytes "
                            "(truncated?)")
    return got
