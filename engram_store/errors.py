"""The exception tree of the whole project.

Every error engram raises derives from :class:`EngramError`::

    EngramError
    ├── InvalidArgument (ValueError)      a value is out of range, the wrong shape, or malformed
    │   └── ConfigError                   a configuration field (file, environment, CLI) is invalid
    ├── InvalidType (TypeError)           an argument has the wrong type or dtype
    ├── NotConnected                      an object built without a store was asked to read or write
    └── StoreError                        the store refused or failed an operation
        ├── ObjectNotFound (KeyError)     no object under that key
        ├── ObjectExists                  a create-only write found the key already present
        ├── LeaseActive                   remove refused: a reader holds a lease on the object
        ├── OutOfSpace                    no segment (or not enough distinct segments) has room
        │   └── CatalogUnwritable         a durable segment refuses new puts: it cannot write its catalogue now
        ├── Unavailable                   a server did not answer in time, or is gone
        │   ├── MasterUnavailable
        │   └── SegmentUnavailable
        │       └── ObjectLost            every replica of the object sat on segments now dead
        ├── WriteFenced                   a write of a put that was revoked, expired or forgotten was refused
        ├── StalePlacement                a segment refused a read of an object another put has overwritten
        ├── DiskReadError                 reading a layer's file on SSD failed, or it was shorter than its layout
        ├── JournalError                  the master's journal could not be written (the change was not made), or
        │                                 the journal it starts on is damaged
        ├── UnsafeFile                    a file or directory in a shared place is not this user's own (owner, link,
        │                                 mode), so engram will not use it
        ├── LockTimeout                   another process held a lock engram waits for longer than the wait allows
        ├── TableClosed                   a table (an EngramStore's layer, a disk layer, a directory of layers) was
        │                                 read or opened after its close()
        ├── ResourceExhausted             this process ran out of open files (ulimit -n)
        ├── ProtocolError                 a peer sent a message that does not follow the wire protocol
        ├── RemoteError                   a server failed while handling a valid request
        └── AuthError                     a server refused this client's credentials

Servers send errors as ``{ok: false, code, message}``; :func:`error_from_reply` maps the code
back to the class here, so a client sees the same exception a local call would raise.
"""

from __future__ import annotations

import errno
import os

import numpy as np


class EngramError(Exception):
    """Root of every error raised by engram."""

    code = "ERROR"


class InvalidArgument(EngramError, ValueError):
    """An argument has the right type but a bad value: out of range, wrong shape, malformed."""

    code = "INVALID_ARGUMENT"


class ConfigError(InvalidArgument):
    """A configuration field, from a file, the environment or the command line, is invalid."""

    code = "CONFIG"


class InvalidType(EngramError, TypeError):
    """An argument has the wrong type or dtype."""

    code = "INVALID_TYPE"


class NotConnected(EngramError, RuntimeError):
    """An object built without a store (metadata only) was asked to read or write tables."""

    code = "NOT_CONNECTED"


class StoreError(EngramError):
    """The store refused or failed an operation."""

    code = "STORE"


class ObjectNotFound(StoreError, KeyError):
    """No object is stored (or visible yet) under the key."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return Exception.__str__(self)


class ObjectExists(StoreError):
    """A create-only write found the key already present."""

    code = "EXISTS"


class LeaseActive(StoreError):
    """`remove` was refused because a reader holds a live lease; pass ``force=True`` to override."""

    code = "LEASE_ACTIVE"


class OutOfSpace(StoreError):
    """No segment, or not enough distinct segments for the replica count, has room for the object."""

    code = "OUT_OF_SPACE"


class CatalogUnwritable(OutOfSpace):
    """A durable segment refuses new puts because it cannot write its catalogue (``<file>.manifest``) now: a full
    disk, an I/O error, a directory it may no longer write. A put it took then would be missing from the catalogue
    its next start offers back, so it takes none until a write of the catalogue succeeds again (it tries at every
    heartbeat); the master places puts on other segments meanwhile. Nothing of the refused put landed."""

    code = "CATALOG_UNWRITABLE"


class Unavailable(StoreError):
    """A server did not answer within the timeout, or is known to be gone."""

    code = "UNAVAILABLE"


class MasterUnavailable(Unavailable):
    """The metadata master did not answer within the timeout."""

    code = "MASTER_UNAVAILABLE"


class SegmentUnavailable(Unavailable):
    """A segment server did not answer within the timeout, or was declared dead by the master."""

    code = "SEGMENT_UNAVAILABLE"


class ObjectLost(SegmentUnavailable):
    """Every replica of the object was on segments that have since been declared dead."""

    code = "OBJECT_LOST"


class WriteFenced(StoreError):
    """A segment refused a write because its put is no longer live: revoked, expired (its writer stopped renewing
    it), removed with ``force``, or forgotten by a master that restarted or dropped the segment meanwhile. Nothing
    of the write landed; write the object again."""

    code = "FENCED"


class StalePlacement(StoreError):
    """A segment refused a read because the object the reader named (by its place and the put that wrote it) is no
    longer there: another put has written that space since. The reader's placement is stale: it was removed, and
    its space reused, while this client could not ask the master (a partition, a stalled master). Nothing of the
    read was returned; ask the master again where the object is."""

    code = "STALE_PLACEMENT"


class MixedLayer(StoreError):
    """A published layer whose heads are not all the tables its manifest names: the checksum the store keeps of a
    head is not the manifest's, so the layer would give rows of two populates. A master that restarted without a
    journal takes objects back from the segments, and a segment that was away while the layer was removed and
    populated again brings back a head of the earlier populate. The layer is not read; remove it and populate it
    again."""

    code = "MIXED_LAYER"


class DiskReadError(StoreError):
    """Reading a layer's file on local SSD (``disk_dir``) failed: an I/O error, or fewer bytes than the layout
    promises (a truncated file). The message names the file and the offset."""

    code = "DISK_READ"


class JournalError(StoreError):
    """The master's journal could not be written (a full or read-only file system, an I/O error), so the change
    asked for was not made: the master writes a change's record before it makes the change. At start: the journal
    cannot be read or rewritten, or it is damaged (the message names the line and what is wrong with it)."""

    code = "JOURNAL"


class UnsafeFile(StoreError):
    """A file or directory engram would create, open or map in a place other users share (``/dev/shm``, ``/tmp``, a
    directory a flag or a peer names) is not this user's own: it belongs to another user, is a symbolic link, is not
    a regular file (or directory), or others may write to it. Nothing was read from it or written to it; the message
    says what was found and what to do (remove it, fix its mode, or choose another place)."""

    code = "UNSAFE_FILE"


class LockTimeout(StoreError):
    """A lock engram takes on a file (a layer's writer lock, the host row cache's lock) stayed held by another
    process for longer than the wait allows. Nothing was changed; the message names the lock file."""

    code = "LOCK_TIMEOUT"


class TableClosed(StoreError):
    """A table was read, or a layer opened, after its ``close()``: an EngramStore's layer under ``local_dir`` or
    ``disk_dir`` or bound with ``bind_local``, a ``DiskLayer``, a ``DiskDir``. A read already running when the close
    came finishes first, on the files it began with (a closed table never reads through a descriptor another open
    has taken since); only reads that begin after it are refused. Open the table again to read it."""

    code = "TABLE_CLOSED"


class ResourceExhausted(StoreError):
    """This process cannot open another file, socket or connection: it holds as many as ``ulimit -n`` allows (or
    the host's limit is reached). The message says so and names what it was opening; the peer is not at fault."""

    code = "RESOURCE_EXHAUSTED"


#: The errnos of a process (or host) out of file descriptors.
NO_FILES = (errno.EMFILE, errno.ENFILE)


def too_many_open_files(what: str) -> ResourceExhausted:
    """The error for ``what`` (e.g. "connecting to HOST:PORT") failing because no file descriptor is left."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    except (ImportError, OSError, ValueError):
        limit = "?"
    try:
        held = f"; {len(os.listdir('/proc/self/fd')) - 1} open"
    except OSError:
        held = ""
    return ResourceExhausted(f"too many open files (ulimit -n {limit}{held}): {what} needs another; raise the "
                             "limit (ulimit -n) or open fewer files, sockets and stores in this process")


def out_of_files() -> bool:
    """Whether this process cannot open another file descriptor now (it tries one)."""
    try:
        os.close(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
    except OSError as exc:
        return exc.errno in NO_FILES
    return False


class ProtocolError(StoreError):
    """A peer sent a message that does not follow the wire protocol (or a different version of it)."""

    code = "PROTOCOL"


class RemoteError(StoreError):
    """A server failed while handling a valid request; the message carries its explanation."""

    code = "REMOTE"


class AuthError(StoreError):
    """A server refused this client's credentials (a raw read channel token that is unknown or expired)."""

    code = "AUTH"


_BY_CODE = {
    cls.code: cls
    for cls in (
        EngramError, InvalidArgument, ConfigError, InvalidType, NotConnected, StoreError,
        ObjectNotFound, ObjectExists, LeaseActive, OutOfSpace, CatalogUnwritable, Unavailable, MasterUnavailable,
        SegmentUnavailable, ObjectLost, WriteFenced, StalePlacement, DiskReadError, JournalError, UnsafeFile,
        LockTimeout, TableClosed, ResourceExhausted, ProtocolError, RemoteError, AuthError,
    )
}


def error_from_reply(code: object, message: object, endpoint: str | None = None) -> EngramError:
    """Build the exception a server's error reply stands for (unknown codes become RemoteError)."""
    cls = _BY_CODE.get(code if isinstance(code, str) else "", RemoteError)
    text = str(message)
    if endpoint:
        text = f"{text} (from {endpoint})"
    return cls(text)


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (NumPy's integer scalars included), and not a bool: the one check behind
    every integer argument's error."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def describe(value: object, limit: int = 80) -> str:
    """A short, safe rendering of a value for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: The tree's classes and the two helpers every package words its errors with: what ``engram_store`` exports.
__all__ = sorted(name for name, value in list(globals().items())
                 if isinstance(value, type) and issubclass(value, EngramError)) + ["describe", "is_int"]
