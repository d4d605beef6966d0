"""An append-only journal of metadata changes (JSON lines), compacted at every start."""

from __future__ import annotations

import json
import logging
import os
from typing import Iterable

from engram_store._errors import ConfigError
from engram_store._owner import OwnerLock

log = logging.getLogger(__name__)


class Journal:
    """One JSON record per line. ``append`` flushes (and by default fsyncs) before it returns.

    At open, :meth:`read` returns the records written so far (a torn last line from a crash is skipped);
    :meth:`rewrite` then replaces the file atomically with a compact snapshot. One process owns a journal: opening
    it takes ``<path>.lock`` first, and a second master refuses (naming the first) before it reads or writes it.
    """

    def __init__(self, path: str, fsync: bool = True):
        self.path = os.path.abspath(path)
        self.fsync = fsync
        self._file = None
        directory = os.path.dirname(self.path)
        if not os.path.isdir(directory):
            try:
                os.makedirs(directory, mode=0o700)  # a first start on a fresh machine
                log.info("journal: created directory %s", directory)
            except OSError as exc:
                raise ConfigError(f"journal: cannot create directory {directory!r} for {self.path!r}: "
                                  f"{exc.strerror or exc}; choose a path you may write (--journal PATH)") from None
        self.owner = OwnerLock(self.path, "journal")

    def read(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        records = []
        with open(self.path, "rb") as f:
            lines = f.read().split(b"\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                if number == len(lines):
                    log.warning("journal %s: skipping a torn last record", self.path)
                    continue
                raise ConfigError(f"journal {self.path}: line {number} is not valid JSON; refusing to start")
            if isinstance(record, dict):
                records.append(record)
        return records

    def rewrite(self, records: Iterable[dict]) -> None:
        """Atomically replace the journal with ``records`` and open it for appending."""
        self.close()
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")

    def append(self, record: dict) -> None:
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        """Close the file (``rewrite`` and ``append`` open it again)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def release(self) -> None:
        """Close and let another process own the journal."""
        self.close()
        self.owner.release()
