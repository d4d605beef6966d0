"""A segment's catalogue: the complete objects it holds, kept so that it can offer them back, verified."""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid

import numpy as np
import xxhash

from ..errors import CatalogUnwritable, ConfigError, StoreError
from .._shared_dirs import open_own
from ._files import SegmentFiles

log = logging.getLogger(__name__)


class Catalog:
    """The complete objects this segment holds, as the master last listed them: ``[key, offset, size, replica_num,
    checksum]`` entries (checksum: xxh3_64 of the object's bytes, in hex).

    Every segment keeps it, so a segment that the master dropped (it missed heartbeats) or forgot (it restarted
    without a journal) offers its objects back when it registers again, each one only after its bytes are
    verified against its checksum (:meth:`verified`). A file-backed segment also keeps it next to its data file
    (``<file>.manifest``, JSON ``{"segment_id", "size", "catalog", "objects"}``, in the directory its ``files``
    hold open), written atomically (a private temporary made exclusively, fsync, rename) and only after the data
    file was flushed, so it never names bytes that are not on disk. It is made as the data file is (never through
    a link, mode 0644 less the umask) and read only when it is this user's own (``engram_store._shared_dirs``).

    A catalogue that cannot be written (a full disk, an I/O error) says why in :attr:`unwritable` until a write
    succeeds again: the segment takes no put meanwhile (:meth:`check_writable`), since its next start would not
    offer that put back.
    """

    def __init__(self, files: SegmentFiles | None, size: int):
        self.files = files
        self.name, self.path = files.join(".manifest") if files is not None else (None, None)
        self.size = size
        self.segment_id = uuid.uuid4().hex
        self.version = -1
        self.objects: list[list] = []
        #: Why the catalogue cannot be written now ("" while it can).
        self.unwritable = ""
        self._lock = threading.Lock()  # the heartbeat thread records the master's list, writers add to it
        if files is None:
            return
        try:
            fd, _ = open_own(self.name, os.O_RDONLY, "segment manifest", dir_fd=files.dir.fd, create=False)
        except FileNotFoundError:
            self.record(self.version, [])
            return
        try:
            with open(fd, encoding="utf-8") as f:
                record = json.load(f)
            self.segment_id = str(record["segment_id"])
            recorded_size = int(record["size"])
            self.objects = [list(o) for o in record.get("objects", [])]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"segment manifest {self.path!r} is unreadable ({exc}); move it away to start "
                              "the segment empty") from None
        if recorded_size != size:
            raise ConfigError(f"segment manifest {self.path!r} was written for a {recorded_size}-byte segment, "
                              f"not {size}")

    @classmethod
    def open(cls, file: str | None, size: int, segment_id: str | None = None) -> "Catalog":
        """The catalogue of a segment of ``size`` bytes: of the durable segment file ``file`` (its owner lock taken
        first, :class:`SegmentFiles`, held in ``files`` until the segment closes them), or in memory only. Its
        ``segment_id``: a durable segment's is the one its manifest records (ConfigError if ``segment_id`` names
        another), else ``segment_id`` or a new one."""
        files = SegmentFiles(file) if file is not None else None
        try:
            catalog = cls(files, size)
            if files is not None and segment_id is not None and segment_id != catalog.segment_id:
                raise ConfigError(f"segment_id: the manifest of {files.path!r} names {catalog.segment_id}, not "
                                  f"{segment_id}")
        except BaseException:
            if files is not None:
                files.close()
            raise
        if files is None and segment_id is not None:
            catalog.segment_id = segment_id
        return catalog

    @property
    def durable(self) -> bool:
        return self.path is not None

    def check_writable(self, segment_id: str) -> None:
        """Raise CatalogUnwritable while the catalogue cannot be written (a put taken now could be lost)."""
        reason = self.unwritable
        if reason:
            raise CatalogUnwritable(f"segment {segment_id} takes no new puts: {reason}; the master places them on "
                                    "other segments, and this one takes puts again once its catalogue is written")

    def record(self, version: int, objects: list[list]) -> None:
        """Keep the master's latest list (and write it to the manifest file of a file-backed segment)."""
        with self._lock:
            self._record(version, objects)

    def add(self, entries: list[list]) -> int:
        """Objects a writer has just published here (``[key, offset, size, replica_num, checksum, generation]``,
        checked by the caller): kept until the master's next list, which names them too. Returns how many were new."""
        with self._lock:
            known = {(e[0], int(e[1])) for e in self.objects}
            new = [e for e in entries if (e[0], int(e[1])) not in known]
            if new:
                self._record(self.version, self.objects + new)
            return len(new)

    def drop(self, entries: list[list]) -> int:
        """Objects removed from here (``[key, offset, generation]``): not offered back if the master forgets."""
        with self._lock:
            gone = {(str(e[0]), int(e[1])) for e in entries}
            kept = [e for e in self.objects if (e[0], int(e[1])) not in gone]
            if len(kept) != len(self.objects):
                self._record(self.version, kept)
            return len(self.objects) - len(kept)

    def _record(self, version: int, objects: list[list]) -> None:
        """Keep ``objects``; a durable segment writes them to its manifest first. A manifest that cannot be written
        keeps the old file and the old version, so the next heartbeat fetches the list and tries again, and says
        why in ``unwritable`` until then; the list in memory is the new one either way."""
        if self.files is not None:
            data = json.dumps({"segment_id": self.segment_id, "size": self.size, "catalog": version,
                               "objects": objects}, separators=(",", ":")).encode()
            try:
                os.close(self.files.dir.replace_bytes(self.name, data))
            except OSError as exc:
                self.objects = objects
                self.unwritable = f"cannot write its catalogue to {self.path}: {exc.strerror or exc}"
                raise CatalogUnwritable(f"segment {self.segment_id}: {self.unwritable} (the previous one stays; "
                                        "writing it again at the next heartbeat)") from exc
            if self.unwritable:
                log.warning("segment %s: its catalogue is written again (%s); taking puts again", self.segment_id,
                            self.path)
            self.unwritable = ""
        self.version, self.objects = version, objects

    def matching(self, memory: np.ndarray, candidates: list) -> list[str]:
        """The keys of ``candidates`` (``[key, offset, size, checksum]``, lost objects the master asks about) whose
        bytes in ``memory`` match their checksum."""
        keys = []
        for entry in candidates:
            try:
                key, offset, size, checksum = str(entry[0]), int(entry[1]), int(entry[2]), str(entry[3])
            except (IndexError, TypeError, ValueError):
                log.warning("segment %s: ignoring a malformed object to verify: %r", self.segment_id, entry)
                continue
            if (checksum and 0 <= offset <= self.size - size
                    and xxhash.xxh3_64_hexdigest(memory[offset:offset + size]) == checksum):
                keys.append(key)
        return keys

    def verified(self, memory: np.ndarray) -> tuple[list[list], list[list]]:
        """``(intact, damaged)``: the entries whose bytes in ``memory`` still match their checksum (a manifest
        written before checksums were kept has none: its entries are trusted, as the file was flushed before they
        were written), and ``[key, offset, generation]`` of the others, which are dropped from the catalogue: bytes
        that rotted at rest are never offered back, nor served."""
        good, bad = [], []
        for entry in self.objects:
            key, offset, size = entry[0], int(entry[1]), int(entry[2])
            checksum = entry[4] if len(entry) > 4 else None
            if not 0 <= offset <= self.size - size or (
                    checksum and xxhash.xxh3_64_hexdigest(memory[offset:offset + size]) != checksum):
                bad.append([key, offset, int(entry[5]) if len(entry) > 5 and entry[5] else 0])
            else:
                good.append(list(entry))
        if bad:
            log.error("segment %s: %d object(s) no longer match their checksums (damaged at rest): not offered back "
                      "and not served; the master hears of them and lists them as lost where no other replica is "
                      "left (e.g. %s)", self.segment_id, len(bad), ", ".join(repr(e[0]) for e in bad[:3]))
            try:
                self.drop(bad)
            except StoreError as exc:  # the manifest keeps them; the next verification finds them again
                log.warning("%s", exc)
        return good, bad
