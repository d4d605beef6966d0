"""The layers of one place, seen from outside any EngramStore: list them, verify them, remove them.

Three kinds of place hold layers, each with its own record of them:

* a store: a layer is the objects ``engram:l{L}:h{h}`` and its manifest ``engram:l{L}:manifest`` (:mod:`._manifest`);
  the master says which objects each segment holds, which are lost and which have fewer replicas than asked;
* ``local_dir``: ``layer-<L>/`` with its ``layout`` and ``head-<h>.bin`` files (:mod:`._local_dir`, Mooncake's);
* ``disk_dir``: ``layer-<L>/`` with ``manifest.json`` and ``rows.bin`` (:mod:`engram_store.disk`).

A layer's state is ``published`` (readers see it whole), ``partial`` (a populate running or interrupted: some of
its objects or files but no manifest, or staging files without a published layer), ``under-replicated`` (every
object there, some with fewer replicas than asked for) or ``lost`` (an object's every replica was on segments
that died). This is what ``engram-layers`` prints.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..errors import EngramError, LeaseActive, LockTimeout, ObjectNotFound, StoreError
from .._layer_dir import LayerDir, read_at
from ..disk import DiskDir
from ._layout import ROW_FORMATS, EngramStoreConfig
from ._local_dir import LAYOUT_MAGIC, LocalDir, layer_name

PUBLISHED, PARTIAL, UNDER_REPLICATED, LOST = "published", "partial", "under-replicated", "lost"
_KEY = re.compile(r"^engram:l(\d+):(?:h(\d+)|(manifest))$")
#: How long a remove under ``local_dir`` waits for the layer's writer to let go of its lock.
LOCK_TIMEOUT_S = 60.0
_LAYER_DIR = re.compile(r"^layer-(\d+)(\.tmp|\.removing)?$")


@dataclass
class LayerInfo:
    """One layer as ``engram-layers list`` shows it (``--json`` prints these fields)."""

    layer_id: int
    state: str
    heads: int                       # heads of its layout (or, with no layout to read, heads found)
    rows: int                        # rows of every head together
    row_format: str                  # float32, float16, bfloat16 or bytes
    row_bytes: int
    bytes: int                       # bytes of the tables (rows x row_bytes)
    replicas: int                    # fewest copies of any of its objects (1 for files on this host)
    table_vocab_sizes: list[int] = field(default_factory=list)
    detail: str = ""                 # why it is not published, what is missing

    def as_dict(self) -> dict:
        return asdict(self)


# ---- a store ----------------------------------------------------------------------------------------------------


class StoreLayers:
    """The layers of the store behind a running master (``--master HOST:PORT``, ``--auth DIR``)."""

    def __init__(self, store: Any, auth_dir: str | None):
        self.store = store
        self.where = f"store at {store.master_address}"
        self.notes: list[str] = []

    def close(self) -> None:
        pass

    def _objects(self) -> tuple[dict[str, list], dict]:
        """Every complete object of a layer by key, ``[size, replica_num, copies]``, and ``{"lost_keys": [...],
        "under_replicated_keys": [...], "pending": n}`` (the master's listing of keys ``engram:l...``)."""
        objects: dict[str, list] = {}
        status: dict = {"lost_keys": [], "under_replicated_keys": [], "pending": 0}
        for info in self.store.list_keys("engram:l"):
            if not _KEY.match(info.key):
                continue
            if info.state == "lost":
                status["lost_keys"].append(info.key)
            elif info.state == "pending":
                status["pending"] += 1
            else:
                objects[info.key] = [info.size, info.replica_num, info.replicas]
                if info.replicas < info.replica_num:
                    status["under_replicated_keys"].append(info.key)
        status["lost"] = len(status["lost_keys"])
        return objects, status

    def _manifest(self, layer_id: int) -> dict | None:
        try:
            record = json.loads(self.store.get(f"engram:l{layer_id}:manifest", lease=False))
        except (ObjectNotFound, EngramError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("format") == "engram-layer" else None

    def list(self) -> list[LayerInfo]:
        objects, status = self._objects()
        lost = set(status.get("lost_keys", []))
        under = set(status.get("under_replicated_keys", []))
        if status.get("pending"):
            self.notes.append(f"{status['pending']} write(s) in progress are not counted")
        layers: dict[int, dict] = {}
        for key in list(objects) + sorted(k for k in lost if _KEY.match(k)):
            m = _KEY.match(key)
            entry = layers.setdefault(int(m.group(1)), {"heads": set(), "manifest": False, "keys": set()})
            entry["keys"].add(key)
            if m.group(3):
                entry["manifest"] = True
            else:
                entry["heads"].add(int(m.group(2)))
        return [self._info(lid, layers[lid], objects, lost, under) for lid in sorted(layers)]

    def _info(self, layer_id: int, found: dict, objects: dict, lost: set, under: set) -> LayerInfo:
        record = self._manifest(layer_id) if found["manifest"] else None
        sizes = list(record.get("table_vocab_sizes", [])) if record else []
        row_format = record.get("row_format", "bytes") if record else "bytes"
        dim = int(record.get("embedding_dim", 0)) if record else 0
        row_bytes = dim * np.dtype(ROW_FORMATS.get(row_format, np.uint8)).itemsize  # 0: no manifest says it
        heads_here = [objects[k] for k in found["keys"] if k in objects and not k.endswith(":manifest")]
        copies = [entry[2] for entry in (objects[k] for k in found["keys"] if k in objects)]
        asked = max((objects[k][1] for k in found["keys"] if k in objects), default=1)
        info = LayerInfo(layer_id, PUBLISHED, len(sizes) or len(found["heads"]), sum(sizes), row_format, row_bytes,
                         sum(entry[0] for entry in heads_here), min(copies, default=0), sizes)
        gone = sorted(k for k in found["keys"] if k in lost)
        missing = [h for h in range(len(sizes)) if h not in found["heads"]]
        if gone:
            info.state, info.detail = LOST, (f"{len(gone)} object(s) lost with their segments ({', '.join(gone[:3])}"
                                             f"{', ...' if len(gone) > 3 else ''}); remove the layer and load it again"
                                             " or bring the segment back")
        elif record is None and found["manifest"]:
            info.state, info.detail = PARTIAL, "its manifest cannot be read"
        elif record is None:
            info.state, info.detail = PARTIAL, (f"{len(found['heads'])} head(s) and no manifest: a populate is "
                                                "running or was interrupted")
        elif missing:
            info.state, info.detail = PARTIAL, f"heads {missing[:8]}{'...' if len(missing) > 8 else ''} missing"
        elif any(k in under for k in found["keys"]) or info.replicas < asked:
            info.state, info.detail = UNDER_REPLICATED, f"{info.replicas} of {asked} replicas of some objects"
        return info

    def verify(self, layer_id: int) -> str:
        from ._store import EngramStore

        record = self._manifest(layer_id)
        if record is None:
            raise ObjectNotFound(f"layer {layer_id} is not published in the {self.where} (no readable "
                                 f"engram:l{layer_id}:manifest)")
        config = EngramStoreConfig(record["table_vocab_sizes"], record["embedding_dim"], record["row_format"])
        with EngramStore(layer_id, config, self.store) as layer:
            heads = layer.verify()
        return f"{len(heads)} head(s) match the checksums of the manifest"

    def remove(self, layer_id: int, force: bool) -> str:
        """The manifest and every head in one request, all or nothing: a read lease on any of them (or, without
        --force, a write in progress) refuses the whole remove and the layer stays as it was."""
        objects, status = self._objects()
        record = self._manifest(layer_id)
        heads = {int(m.group(2)) for key in list(objects) + list(status.get("lost_keys", []))
                 if (m := _KEY.match(key)) and int(m.group(1)) == layer_id and m.group(2)}
        heads |= set(range(len(record.get("table_vocab_sizes", [])))) if record else set()
        keys = [f"engram:l{layer_id}:manifest"] + [f"engram:l{layer_id}:h{h}" for h in sorted(heads)]
        try:
            removed = self.store.remove_many(keys, force=force)
        except LeaseActive as exc:
            key = re.search(r"remove ('[^']*')", str(exc))
            held = re.search(r"for ([\d.]+) s more", str(exc))
            why = (f"a read lease on it is live for {held.group(1)} s more" if held
                   else "a write of it is in progress" if "write" in str(exc) else "a read lease on it is live")
            raise LeaseActive(f"layer {layer_id}: {key.group(1) if key else 'an object'}: {why}; nothing was "
                              "removed. Run again when it has ended, or pass --force") from None
        if not removed:
            raise ObjectNotFound(f"layer {layer_id}: no object of it in the {self.where}")
        return f"removed {len(removed)} object(s)"


# ---- files on this host -----------------------------------------------------------------------------------------


def _staged(held: LayerDir) -> dict[int, list[str]]:
    """Layer ids of the ``layer-<L>.tmp`` and ``layer-<L>.removing`` entries of a directory of layers."""
    out: dict[int, list[str]] = {}
    for name in held.names():
        m = _LAYER_DIR.match(name)
        if m and m.group(2):
            out.setdefault(int(m.group(1)), []).append(name)
    return out


def _published(held: LayerDir) -> list[int]:
    """Layer ids of the published ``layer-<L>`` directories (a link named so is not one)."""
    return sorted(int(m.group(1)) for name in held.names()
                  if (m := _LAYER_DIR.match(name)) and not m.group(2) and held.is_dir(name))


def _partial(layer_id: int, names: list[str]) -> LayerInfo:
    return LayerInfo(layer_id, PARTIAL, 0, 0, "bytes", 0, 0, 0, [],
                     f"{', '.join(sorted(names))} without a published layer: a write or remove is running or died "
                     "(the next writer of the layer removes it)")


class LocalDirLayers:
    """Layers published under a ``local_dir`` (Mooncake's layout: no checksums, a layout file per layer), the
    directory held open (every file under it opened relative to it, checked as a reader checks it)."""

    def __init__(self, path: str):
        self.dir = LocalDir(path, create=False, flag="--local-dir")
        self.path = self.dir.path
        self.where = f"local_dir {self.path}"
        self.notes: list[str] = []

    def close(self) -> None:
        self.dir.close()

    def _layout(self, layer_id: int) -> tuple[int, list[int]]:
        file = os.path.join(self.dir.layer_path(layer_id), "layout")
        try:
            text = self.dir.dir.open_published(layer_name(layer_id),
                                               lambda fd, shown: read_at(fd, "layout", file, "local_dir", 1 << 20))
            lines = text.decode("ascii").split() if text is not None else []
        except (OSError, ValueError, EngramError) as exc:
            raise StoreError(f"layer {layer_id}: cannot read {file}: {exc}") from None
        if len(lines) < 3 or lines[0] != LAYOUT_MAGIC or not all(x.isdigit() for x in lines[1:]):
            raise StoreError(f"layer {layer_id}: {file} is not a {LAYOUT_MAGIC} layout")
        return int(lines[1]), [int(x) for x in lines[2:]]

    def list(self) -> list[LayerInfo]:
        out = []
        published = _published(self.dir.dir)
        for layer_id in published:
            try:
                row_bytes, sizes = self._layout(layer_id)
            except StoreError as exc:
                out.append(LayerInfo(layer_id, PARTIAL, 0, 0, "bytes", 0, 0, 1, [], str(exc)))
                continue
            out.append(LayerInfo(layer_id, PUBLISHED, len(sizes), sum(sizes), "bytes", row_bytes,
                                 sum(sizes) * row_bytes, 1, sizes))
        out += [_partial(lid, names) for lid, names in _staged(self.dir.dir).items() if lid not in published]
        return sorted(out, key=lambda info: info.layer_id)

    def verify(self, layer_id: int) -> str:
        if not self.dir.dir.is_dir(layer_name(layer_id)):
            raise ObjectNotFound(f"layer {layer_id} is not published under {self.where}")
        row_bytes, sizes = self._layout(layer_id)
        mapped = self.dir.open(layer_id, row_bytes, sizes, prefault_pages=False)
        if mapped is None:
            raise ObjectNotFound(f"layer {layer_id} is not published under {self.where}")
        mapped.close()
        return (f"{len(sizes)} head file(s) hold the sizes their layout says (local_dir layers carry no "
                "checksums)")

    def remove(self, layer_id: int, force: bool) -> str:
        """Under the layer's lock (writers hold it while they publish), move the layer to its staging name, which
        the next writer removes if this process dies, and delete it. The lock file stays: Mooncake's writers
        lock it by name and do not expect it to go."""
        held, name = self.dir.dir, layer_name(layer_id)
        final = self.dir.layer_path(layer_id)
        try:
            lock = held.lock(name + ".lock", LOCK_TIMEOUT_S, "local_dir")
        except LockTimeout:
            raise StoreError(f"layer {layer_id}: a writer holds {final}.lock (waited {LOCK_TIMEOUT_S:g} s); try "
                             "again when its populate has ended") from None
        try:
            if not held.is_dir(name):
                raise ObjectNotFound(f"layer {layer_id} is not published under {self.where}")
            held.discard(name + ".tmp")
            try:
                held.retire(name, name + ".tmp")
            except OSError as exc:
                raise StoreError(f"layer {layer_id}: cannot remove {final}: {exc}") from None
        finally:
            lock.close()
        return f"removed {final}"


class DiskDirLayers:
    """Layers published under a ``disk_dir`` (page-aligned files with checksums, :mod:`engram_store.disk`), the
    directory held open as every ``DiskDir`` holds it."""

    def __init__(self, path: str):
        self.dir = DiskDir(path, create=False, flag="--disk-dir")
        self.path = self.dir.path
        self.where = f"disk_dir {self.path}"
        self.notes: list[str] = []

    def close(self) -> None:
        self.dir.close()

    def list(self) -> list[LayerInfo]:
        out = []
        published = self.dir.layers()
        for layer_id in published:
            try:
                _, layout = self.dir.manifest(layer_id)
            except EngramError as exc:
                out.append(LayerInfo(layer_id, PARTIAL, 0, 0, "bytes", 0, 0, 1, [], f"cannot read its manifest: "
                                                                                      f"{exc}"))
                continue
            sizes = list(layout.sizes)
            out.append(LayerInfo(layer_id, PUBLISHED, len(sizes), sum(sizes), "bytes", layout.row_bytes,
                                 sum(sizes) * layout.row_bytes, 1, sizes, self._page_checks(layer_id)))
        out += [_partial(lid, names) for lid, names in _staged(self.dir.dir).items() if lid not in published]
        return sorted(out, key=lambda info: info.layer_id)

    def _page_checks(self, layer_id: int) -> str:
        """What ``list`` says of a layer's pages: nothing where each page read is checked, else that it is not."""
        try:
            checks = self.dir.page_checks(layer_id)
        except EngramError as exc:
            return f"its manifest does not open: {exc}"
        return "" if checks == "xxh64" else f"pages read {checks}"

    def verify(self, layer_id: int) -> str:
        self.dir.verify(layer_id)
        return "every page and every head match their checksums"

    def remove(self, layer_id: int, force: bool) -> str:
        path = self.dir.layer_path(layer_id)
        self.dir.remove(layer_id)
        return f"removed {path}"


