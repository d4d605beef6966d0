"""A segment's catalogue: the complete objects it holds, kept so that it can offer them back, verified."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import uuid

import numpy as np
import xxhash

from .._errors import ConfigError, OutOfSpace, StoreError
from .._shared_dirs import open_own

log = logging.getLogger(__name__)


class Catalog:
    """The complete objects this segment holds, as the master last listed them: ``[key, offset, size, replica_num,
    checksum]`` entries (checksum: xxh3_64 of the object's bytes, in hex).

    Every segment keeps it, so a segment that the master dropped (it missed heartbeats) or forgot (it restarted
    without a journal) offers its objects back when it registers again, each one only after its bytes are
    verified against its checksum (:meth:`verified`). A file-backed segment also keeps it next to its data file
    (``<file>.manifest``, JSON ``{"segment_id", "size", "catalog", "objects"}``), written atomically (temporary
    file, fsync, rename) and only after the data file was flushed, so it never names bytes that are not on disk. It
    is made as the data file is (exclusively, never through a link, mode 0644 less the umask) and read only when it
    is this user's own (``engram_store._shared_dirs``).
    """

    def __init__(self, data_path: str | None, size: int):
        self.path = data_path + ".manifest" if data_path is not None else None
        self.size = size
        self.segment_id = uuid.uuid4().hex
        self.version = -1
        self.objects: list[list] = []
        self._lock = threading.Lock()  # the heartbeat thread records the master's list, writers add to it
        if self.path is None:
            return
        if os.path.lexists(self.path):
            try:
                fd, _ = open_own(self.path, os.O_RDONLY, "segment manifest", create=False)
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
        else:
            self.record(self.version, [])

    @property
    def durable(self) -> bool:
        return self.path is not None

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
        (a full disk) keeps the old file and the old version, so the next heartbeat fetches the list and tries
        again; the list in memory is the new one either way."""
        if self.path is not None:
            tmp = self.path + ".tmp"
            try:
                try:
                    os.unlink(tmp)  # a writer that died left it (unlink never follows a link)
                except FileNotFoundError:
                    pass
                fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                with open(fd, "w", encoding="utf-8") as f:
                    json.dump({"segment_id": self.segment_id, "size": self.size, "catalog": version,
                               "objects": objects}, f, separators=(",", ":"))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
                dir_fd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            except OSError as exc:
                self.objects = objects
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                raise (OutOfSpace if full else StoreError)(
                    f"segment {self.segment_id}: cannot write its catalogue to {self.path}: {exc.strerror} (the "
                    "previous one stays; writing it again at the next heartbeat)") from exc
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

    def verified(self, memory: np.ndarray) -> list[list]:
        """The entries whose bytes in ``memory`` still match their checksum (a manifest written before checksums
        were kept has none: its entries are trusted, as the file was flushed before they were written)."""
        good, bad = [], []
        for entry in self.objects:
            key, offset, size = entry[0], int(entry[1]), int(entry[2])
            checksum = entry[4] if len(entry) > 4 else None
            if not 0 <= offset <= self.size - size:
                bad.append(key)
            elif checksum and xxhash.xxh3_64_hexdigest(memory[offset:offset + size]) != checksum:
                bad.append(key)
            else:
                good.append(list(entry))
        if bad:
            log.warning("segment %s: %d object(s) no longer match their checksums and are not offered back (e.g. "
                        "%s)", self.segment_id, len(bad), ", ".join(map(repr, bad[:3])))
        return good
