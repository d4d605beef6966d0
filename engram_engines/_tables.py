"""The table directory ``ENGRAM_TABLES`` names: which kind it is, which layers it holds, each layer opened once.

``engram-load-v41 CHECKPOINT --local-dir DIR`` writes a ``local_dir`` (files in memory, such as under ``/dev/shm``, in
2 MiB pages, mapped read-only by every process of the host), ``--disk-dir DIR`` a ``disk_dir`` (page-aligned files on SSD,
read behind a row cache that every process of the host shares). A published layer is the directory
``layer-<L>`` holding ``layout`` (a local_dir, Mooncake's format) or ``manifest.json`` (a disk_dir); that is how
the kind is told apart. Everything else goes through the public :class:`EngramStore`.

A serving process opens each layer once (:func:`table_dir` keeps one :class:`TableDir` per directory), whatever
number of modules read it; the engines' modules of one layer share its EngramStore.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

from engram_store import EngramStore, EngramStoreConfig, metrics_text
from engram_store.errors import EngramError, ObjectNotFound

from ._settings import TABLES, EngineSettings, refused
from ._stats import publish_tables

LOCAL_DIR, DISK_DIR = "local_dir", "disk_dir"
_LAYER = re.compile(r"^layer-(\d+)$")
#: What marks a published layer of each kind (the file its writer renames into place last).
_MARKERS = {"layout": LOCAL_DIR, "manifest.json": DISK_DIR}


class TableDir:
    """The layers published under ``settings.tables`` (see the module docstring)."""

    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.path = settings.tables
        self.kinds = _published(self.path)
        if not self.kinds:
            raise refused(TABLES, self.path, "holds no published Engram layer (expected layer-<L> directories "
                                             "written by engram-load-v41 CHECKPOINT --local-dir or --disk-dir)")
        kinds = sorted(set(self.kinds.values()))
        if len(kinds) > 1:
            raise refused(TABLES, self.path, f"holds layers of both kinds ({self._listing()}); a directory is one "
                                             "local_dir or one disk_dir")
        self.kind = kinds[0]
        self._open: dict[int, EngramStore] = {}
        self._lock = threading.Lock()

    def layers(self) -> list[int]:
        return sorted(self.kinds)

    def _listing(self) -> str:
        return ", ".join(f"layer {lid}: {self.kinds[lid]}" for lid in self.layers())

    def require(self, layer_ids: list[int], source: str) -> None:
        """Refuse unless every layer of ``layer_ids`` (what ``source`` names) is published here."""
        missing = [lid for lid in layer_ids if lid not in self.kinds]
        if missing:
            raise refused(TABLES, self.path, f"{source} names Engram layers {list(layer_ids)}, but this {self.kind} "
                                             f"holds layers {self.layers()} (missing {missing}); load them with "
                                             f"engram-load-v41 CHECKPOINT --{self.kind.replace('_', '-')} {self.path}")

    def open(self, layer_id: int, layout: EngramStoreConfig, source: str) -> EngramStore:
        """Layer ``layer_id``'s table with ``layout`` (what ``source`` says it is), opened once per process; a
        table that is not there or disagrees with the layout is refused naming both."""
        with self._lock:
            table = self._open.get(layer_id)
            if table is None:
                table = self._open[layer_id] = self._opened(layer_id, layout, source)
                publish_tables(tables_text)
        if table.get_table_vocab_sizes() != list(layout.table_vocab_sizes) \
                or table.get_embedding_dim() != layout.embedding_dim:
            raise refused(TABLES, self.path, f"layer {layer_id} was opened with another layout than {source} "
                                             "gives now (two models with one table directory?)")
        return table

    def _opened(self, layer_id: int, layout: EngramStoreConfig, source: str) -> EngramStore:
        s = self.settings
        options: dict[str, Any] = {self.kind: self.path}
        if self.kind == DISK_DIR:
            options.update(row_cache_bytes=s.row_cache_bytes, cache_scope=s.cache_scope)
        try:
            table = EngramStore(layer_id, layout, None, threads=s.threads, **options)
        except EngramError as exc:
            raise refused(TABLES, self.path, f"layer {layer_id} disagrees with {source}: {exc}") from None
        try:
            table.local_tables()  # maps a local_dir layer now (and checks it is whole); None for a disk_dir
        except ObjectNotFound as exc:
            table.close()
            raise refused(TABLES, self.path, f"layer {layer_id}: {exc}") from None
        except EngramError as exc:
            table.close()
            raise refused(TABLES, self.path, f"layer {layer_id} disagrees with {source}: {exc}") from None
        return table

    def tables(self) -> list[EngramStore]:
        """The layers this process opened, in layer order (for metrics)."""
        with self._lock:
            return [self._open[lid] for lid in sorted(self._open)]

    def close(self) -> None:
        with self._lock:
            for table in self._open.values():
                table.close()
            self._open.clear()

    def __repr__(self) -> str:
        return f"TableDir({self.path!r}, {self.kind}, layers={self.layers()})"


def _published(path: str) -> dict[int, str]:
    """Layer id -> kind of every published layer under ``path``."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(path)
    except OSError as exc:
        raise refused(TABLES, path, f"cannot list the directory: {exc.strerror}") from None
    for name in names:
        m = _LAYER.match(name)
        if not m:
            continue
        for marker, kind in _MARKERS.items():
            if os.path.isfile(os.path.join(path, name, marker)):
                found[int(m.group(1))] = kind
    return found


_DIRS: dict[str, TableDir] = {}
_DIRS_LOCK = threading.Lock()


def table_dir(settings: EngineSettings) -> TableDir:
    """The process's one :class:`TableDir` of ``settings.tables``."""
    with _DIRS_LOCK:
        found = _DIRS.get(settings.tables)
        if found is None or found.settings != settings:
            found = _DIRS[settings.tables] = TableDir(settings)
        return found


def open_table_dirs() -> list[TableDir]:
    """Every TableDir this process made (for metrics)."""
    with _DIRS_LOCK:
        return list(_DIRS.values())


def tables_text() -> str:
    """The Prometheus text of every table this process opened (:func:`engram_store.metrics_text`), or ""."""
    tables = [table for found in open_table_dirs() for table in found.tables()]
    return metrics_text(tables) if tables else ""


def forget_table_dirs() -> None:
    """Close every table this process opened and forget the directories (tests; a model built again)."""
    with _DIRS_LOCK:
        for found in _DIRS.values():
            found.close()
        _DIRS.clear()
