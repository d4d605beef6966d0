"""The master's journal: an append-only file of metadata changes (JSON lines), compacted at every start.

Why it can be trusted, hazard by hazard:

- **A change and its record.** The master appends a change's record before it makes the change, and makes it only
  once the append returned (flushed, and by default fsynced): a change whose record could not be written is not
  made, and its caller gets :class:`~engram_store.JournalError`.
- **A failed append** (a full disk, an I/O error) may have written part of its line: the file is cut back to where
  the append began, so no half record ever sits between two whole ones. A journal that cannot even be cut back
  takes no more records (every later append is refused) until the master restarts on it.
- **A crash mid-append** leaves a last line without its newline (a line is written in one call, newline last):
  :meth:`read` drops it with a WARNING, and the rewrite at start leaves it out. Its change was never made.
- **Bytes that rot, lines lost or repeated, records that are not records**: refused by line at :meth:`read`
  (sequence numbers, checksums and the schema, :mod:`._journal_format`).
- **Whole records cut from the end** look like a shorter journal: the master finds out when segments register and
  offer back objects the journal does not know, and takes them back (:mod:`._adoption`).
- **One owner**: opening a journal takes ``<path>.lock`` first, and a second master refuses (naming the first)
  before it reads or writes it.
- **Another local user** (``engram_store.durable``): the journal's directory is checked once and held open, and
  the journal, its lock and its temporaries are reached relative to it. A rewrite writes a private temporary made
  exclusively (never a name another user made first, never through a link) and renames it into place; the journal
  read at start must be this user's own file that no one else may write. Temporaries a crash left are removed,
  under the lock, only when they are this user's.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable

from engram_store.errors import ConfigError, JournalError
from engram_store.durable import DurableDir

from ._journal_format import Reader, encode, header

log = logging.getLogger(__name__)

_ADVICE = "free space on its disk, or give the master a journal path it may write (--journal PATH)"


class Journal:
    """One checked JSON record per line (see the module); ``append`` flushes (and by default fsyncs) before it
    returns, and raises JournalError, having written nothing, when it cannot."""

    def __init__(self, path: str, fsync: bool = True):
        self.path = os.path.abspath(path)
        self.name = os.path.basename(self.path)
        self.fsync = fsync
        self._fd: int | None = None
        self._size = 0  # bytes of whole records in the file
        self._seq = 0  # the sequence number of the next record
        self._broken = ""  # why appends are refused: a failed append could not be cut back
        directory = os.path.dirname(self.path)
        if not os.path.isdir(directory):
            try:
                os.makedirs(directory, mode=0o700)  # a first start on a fresh machine
                log.info("journal: created directory %s", directory)
            except OSError as exc:
                raise ConfigError(f"journal: cannot create directory {directory!r} for {self.path!r}: "
                                  f"{exc.strerror or exc}; choose a path you may write (--journal PATH)") from None
        # Checked once and held: the journal, its lock and its temporaries are reached relative to it.
        self.dir = DurableDir(directory, "journal", "choose another --journal PATH")
        try:
            self.owner = self.dir.lock(self.name, "journal")
            self.dir.remove_stale(self.name)  # temporaries of a master of ours that crashed mid-rewrite
        except OSError as exc:
            self.dir.close()
            raise JournalError(f"journal {self.path}: cannot take its lock file {self.path}.lock: "
                               f"{exc.strerror or exc}; {_ADVICE}") from None
        except BaseException:
            self.dir.close()
            raise

    def read(self) -> list[dict]:
        """The records written so far, each checked (JournalError naming the first line that is not as written);
        a torn last line (a crash while it was appended) is dropped with a WARNING. A journal that is not this
        user's own file (a link, another user's, writable by others) is refused (UnsafeFile)."""
        try:
            fd, _ = self.dir.open(self.name, os.O_RDONLY, create=False)
            with open(fd, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise JournalError(f"journal {self.path}: cannot read it: {exc.strerror or exc}") from None
        return parse(data, self.path)

    def rewrite(self, records: Iterable[dict]) -> None:
        """Atomically replace the journal with ``records`` (after a header) and open it for appending: written
        under a private temporary name in the held directory (made exclusively, never through a link), renamed
        over the journal, and kept open for appending (never opened again by its name)."""
        self.close()
        lines = []
        for seq, record in enumerate([header(), *records]):
            lines.append(encode(record, seq))
        data = b"".join(lines)
        try:
            self._fd = self.dir.replace_bytes(self.name, data, 0o644, os.O_APPEND)
        except OSError as exc:
            raise JournalError(f"journal {self.path}: cannot rewrite it: {exc.strerror or exc}; {_ADVICE}") from None
        self._size, self._seq, self._broken = len(data), len(lines), ""

    def append(self, record: dict) -> None:
        """Write one record (one line, in one call) and flush it; JournalError, the file as it was, when that
        fails."""
        if self._broken:
            raise JournalError(self._broken)
        if self._fd is None:
            raise JournalError(f"journal {self.path} is closed")
        line = encode(record, self._seq)
        try:
            written = 0
            while written < len(line):
                written += os.write(self._fd, line[written:])
            if self.fsync:
                os.fsync(self._fd)
        except OSError as exc:
            self._cut_back(exc)
            raise JournalError(f"journal {self.path}: cannot write a record: {exc.strerror or exc}; the change was "
                               f"not made ({_ADVICE})") from None
        self._size += len(line)
        self._seq += 1

    def _cut_back(self, exc: OSError) -> None:
        """Take back what a failed append wrote; if even that fails, refuse every later append."""
        try:
            os.ftruncate(self._fd, self._size)
        except OSError as again:
            self._broken = (f"journal {self.path}: a record that failed ({exc.strerror or exc}) could not be taken "
                            f"back ({again.strerror or again}); no more changes are taken until the master "
                            "restarts on the journal")
            log.error("%s", self._broken)

    def describe_owner(self, serving: str) -> None:
        """Name what the owner serves in the lock file (best effort: a full disk may leave the line as it was)."""
        try:
            self.owner.describe(serving=serving)
        except OSError as exc:
            log.warning("journal %s: cannot write the lock file's holder line: %s", self.path, exc.strerror or exc)

    def close(self) -> None:
        """Close the file (``rewrite`` opens it again)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        """Close and let another process own the journal."""
        self.close()
        self.owner.release()
        self.dir.close()


def parse(data: bytes, path: str) -> list[dict]:
    """The records of a journal's bytes (see :meth:`Journal.read`)."""
    lines = data.split(b"\n")
    torn = lines.pop()  # what follows the last newline: empty unless a crash cut the last append short
    if torn:
        log.warning("journal %s: its last record (line %d, %d bytes) was cut short by a crash while it was "
                    "written; dropped (its change was never made)", path, len(lines) + 1, len(torn))
    reader = Reader(path)
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip() and not reader.versioned:
            continue  # blank lines of older journals
        records.append(reader.decode(line, number))
    return records[1:] if reader.versioned else records
