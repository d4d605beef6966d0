"""Layers kept as objects of a key-value store: one per head (``engram:l{L}:h{h}``) and the layer's manifest.

What this project's store and a Mooncake store have in common: populate is create-only and all-or-nothing and
publishes the manifest last; remove takes the manifest first, so readers see a layer whole or not at all; verify
reads each head back against the manifest's checksums. The subclasses say how to put, get, test and remove keys.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import numpy as np

from ..errors import EngramError, InvalidArgument, ObjectExists, ObjectLost, StoreError
from . import _manifest as manifest
from ._layout import Layer
from ._source import Source, progress

log = logging.getLogger(__name__)


class Upload(NamedTuple):
    """What :meth:`KeyedSource.put_tables` wrote: each table's checksum and, where the store names them, the
    generation of each head's object (so undoing the upload removes those objects and nothing put since)."""
    algorithm: str
    checksums: list[str]
    generations: list[int] | None = None


class Written(NamedTuple):
    """What a populate wrote: its heads (``upload``) and, if it published the layer, the manifest (with the
    manifest object's generation where the store names one)."""
    upload: Upload
    manifest: bool
    manifest_generation: int | None = None


class KeyedSource(Source):
    """A layer's heads and manifest as keys of a store (the primitives below are the subclass's)."""

    def __init__(self, store: Any, require_manifest: bool, threads: int = 1):
        super().__init__(threads)
        self.store = store
        self.require_manifest = require_manifest
        self.where = type(store).__name__

    # ---- primitives -------------------------------------------------------------------------------------------

    def exists(self, keys: list[str]) -> list[bool]:
        raise NotImplementedError

    def get_manifest(self, lay: Layer) -> bytes | None:
        """The manifest's bytes, or None when the layer has none (never taking a lease that would block remove)."""
        raise NotImplementedError

    def put_manifest(self, lay: Layer, data: bytes, replica_num: int,
                     heads: dict[str, int] | None = None) -> int | None:
        """Put the manifest; the generation of its object, where the store names one. ``heads``: the generation of
        each head this populate wrote (key -> put id), where the store names them: a store that can publishes the
        manifest only while every head of the layer is still there (so no remove can leave a manifest without
        its heads), and raises WriteFenced otherwise."""
        raise NotImplementedError

    def put_tables(self, lay: Layer, tables: list[np.ndarray], replica_num: int, bar: Any) -> Upload:
        """Upload this store's heads; all or nothing."""
        raise NotImplementedError

    def undo_written(self, lay: Layer, written: Written) -> int:
        """Remove the manifest (if ``written`` published it), then the heads ``written`` wrote; heads removed. By
        key where the store names no generations: a head another writer put under the same key after a forced
        remove would go too."""
        if written.manifest:
            self.remove_keys([lay.manifest_key], force=True)
        return self.remove_keys(lay.keys, force=True)

    def remove_key(self, key: str, force: bool) -> bool:
        """Remove one key; False when it was not there."""
        raise NotImplementedError

    def read_head(self, lay: Layer, j: int) -> np.ndarray:
        """This store's j-th head's whole table as flat bytes (for verify)."""
        raise NotImplementedError

    def recorded_checksums(self, lay: Layer) -> dict[int, str]:
        """Checksums the store itself recorded for the layer's heads (none by default)."""
        return {}

    def forget(self, lay: Layer) -> None:
        """The layer is about to change: drop what was learnt about where its tables are."""

    # ---- the layer lifecycle ----------------------------------------------------------------------------------

    def ready(self, lay: Layer, what: str) -> None:
        pass  # a store is there; whether the layer is published is checked by the read itself

    def populate(self, lay: Layer, tables: list[np.ndarray], replica_num: int) -> None:
        existing = [k for k, e in zip(lay.keys, self.exists(lay.keys)) if e]
        if existing:
            raise ObjectExists(f"populate layer {lay.layer_id}: key {existing[0]!r} already exists "
                               f"({len(existing)} of {len(lay.keys)} heads present); call "
                               "remove_from_store() first")
        published = self.read_manifest(lay, lost_is_absent=True)  # a lost layer may be written again
        if published is not None:
            manifest.check(lay, published)  # another shard published this layer: the layouts must agree
            if not lay.sharded:
                # Every head is gone (lost with its segments) and the manifest is what is left of the layer: it
                # names the lost heads, so it goes, and this populate publishes its own (kept, it would name
                # other tables than the heads written now: a reader refuses such a layer as mixed).
                self.remove_keys([lay.manifest_key], force=True)
        bar = progress(lay, tables)
        self.forget(lay)
        try:
            upload = self.put_tables(lay, tables, replica_num, bar)
        finally:
            bar.close()
        try:
            published = self.publish(lay, upload.checksums, replica_num, upload.algorithm, upload.generations)
        except BaseException:
            self.undo_failed_publish(lay, upload)  # all-or-nothing: no tables without their manifest, nor the reverse
            raise
        lay.written = Written(upload, *published)

    def undo_failed_publish(self, lay: Layer, upload: Upload) -> None:
        """Take back a populate whose publish raised. The manifest may be published all the same: the failure (an
        interrupt, a lost reply) can reach this process after the store took the manifest's put. So a manifest
        naming these heads (their checksums, where both have them) is removed first, then the heads; where the
        manifest cannot be read, the heads stay (unpublished, or published whole; ``remove_from_store`` takes them),
        never a manifest without its heads."""
        try:
            record = self.read_manifest(lay, lost_is_absent=True)
            if record is not None and _names_heads(record, lay, upload):
                self.remove_keys([lay.manifest_key], force=True)
        except EngramError as exc:
            log.warning("populate layer %d failed, and its manifest could not be looked at (%s): its heads are left "
                        "in the store; remove_from_store() removes them", lay.layer_id, exc)
            return
        self.undo_written(lay, Written(upload, manifest=False))

    def publish(self, lay: Layer, checksums: list[str], replica_num: int, algorithm: str = "xxh3_64",
                generations: list[int] | None = None) -> tuple[bool, int | None]:
        """Write the manifest last, once every head of the layer is in the store (this call's or other shards'),
        and only while they are (``generations``: this call's heads' puts; see :meth:`put_manifest`). Returns
        whether this call wrote it, and its object's generation where the store names one."""
        if self.read_manifest(lay, lost_is_absent=True) is not None:
            return False, None
        by_head = dict(zip(lay.heads, checksums))
        if lay.sharded:
            if not all(self.exists(lay.layer_keys)):
                return False, None  # other shards have yet to write their heads; the last one publishes
            if algorithm == "xxh3_64":
                # The other shards' checksums, as their writers gave them to the store with their tables.
                by_head = {**self.recorded_checksums(lay), **by_head}
        try:
            generation = self.put_manifest(lay, manifest.encode(manifest.manifest_record(lay, by_head, algorithm)),
                                           replica_num, dict(zip(lay.keys, generations)) if generations else None)
        except ObjectExists:
            manifest.check(lay, self.read_manifest(lay))  # a concurrent shard published first
            return False, None
        return True, generation

    def undo_populate(self, lay: Layer) -> int:
        written = lay.written
        if written is None:
            raise InvalidArgument(f"undo_populate: layer {lay.layer_id}: this EngramStore has no populate of it to "
                                  "undo (none succeeded since it was opened or last removed it, or it was undone "
                                  "already)")
        self.forget(lay)
        removed = self.undo_written(lay, written)
        lay.written = None  # (kept after a failure: undoing again is safe, and finishes the job)
        return removed

    def read_manifest(self, lay: Layer, lost_is_absent: bool = False) -> dict | None:
        """The layer's manifest, or None if it has none (not populated, or a populate still running). A manifest
        the store lost with its segments raises ObjectLost naming it (a reader must hear of the loss, not of a
        layer never published), unless ``lost_is_absent`` (a writer may publish the layer again)."""
        try:
            data = self.get_manifest(lay)
        except ObjectLost as exc:
            if lost_is_absent:
                return None
            raise ObjectLost(f"layer {lay.layer_id} is lost: {exc}; populate it again") from exc
        return manifest.decode(lay, data) if data else None

    def check_published(self, lay: Layer, stored: list[str] | None = None) -> None:
        """Refuse a layer that is not published or not as configured; with ``stored`` (the checksums the store keeps
        of the layer's heads, read before the manifest), one whose heads are not the manifest's
        (:class:`manifest.MixedLayer`)."""
        if self.require_manifest:
            record = self.read_manifest(lay)
            manifest.check(lay, record)
            if stored is not None:
                manifest.check_heads(lay, record, stored)

    def verify(self, lay: Layer) -> list[int]:
        record = self.read_manifest(lay)
        manifest.check(lay, record)
        return manifest.verify(lay, record, lambda j: self.read_head(lay, j))

    def remove(self, lay: Layer, force: bool) -> int:
        """The manifest goes first, so readers see the layer as unpublished, never half removed."""
        self.forget(lay)
        removed = self.remove_layer(lay, force)
        lay.written = None  # nothing of an earlier populate is left for undo_populate to take back
        return removed

    def remove_layer(self, lay: Layer, force: bool) -> int:
        """Remove the manifest, then the heads; returns how many heads were removed. A store that removes several
        keys at once, all or nothing, overrides this (a lease on one head then leaves the layer whole)."""
        self.remove_keys([lay.manifest_key], force)
        return self.remove_keys(lay.keys, force)

    def remove_keys(self, keys: list[str], force: bool) -> int:
        return sum(1 for key in keys if self.remove_key(key, force))


def _names_heads(record: dict, lay: Layer, upload: Upload) -> bool:
    """Whether the manifest ``record`` describes the heads ``upload`` wrote: their checksums, where the manifest and
    the upload both have them (otherwise it is taken to: it can only have been published over these heads)."""
    recorded = record.get("checksums")
    if record.get("checksum") != upload.algorithm or not isinstance(recorded, list) or not upload.checksums:
        return True
    return all(recorded[h] in (None, c) for h, c in zip(lay.heads, upload.checksums) if 0 <= h < len(recorded))


def check_code(code: Any, op: str, what: str) -> None:
    """Raise for a negative Mooncake return code."""
    if isinstance(code, (int, np.integer)) and code < 0:
        raise StoreError(f"{op} for {what} failed with code {int(code)}")
