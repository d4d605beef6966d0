"""The exception tree, for the other packages: ``engram_model`` and ``master`` raise and catch these.

The tree and its helpers live in ``engram_store._errors`` (the store's own modules import it there); this is the
door the others use, so what stays private there may change without them knowing. ``describe`` and ``is_int``
word the errors' "expected ... got ..." the same way in every package.
"""

from __future__ import annotations

from ._errors import (AuthError, CatalogUnwritable, ConfigError, DiskReadError, EngramError, InvalidArgument, InvalidType,
                      JournalError, LeaseActive, LockTimeout, MasterUnavailable, NotConnected, ObjectExists,
                      ObjectLost, ObjectNotFound, OutOfSpace, ProtocolError, RemoteError, ResourceExhausted,
                      SegmentUnavailable, StalePlacement, StoreError, TableClosed, Unavailable, UnsafeFile, WriteFenced,
                      describe, is_int)

__all__ = ["AuthError", "CatalogUnwritable", "ConfigError", "DiskReadError", "EngramError", "InvalidArgument", "InvalidType",
           "JournalError", "LeaseActive", "LockTimeout", "MasterUnavailable", "NotConnected", "ObjectExists",
           "ObjectLost", "ObjectNotFound", "OutOfSpace", "ProtocolError", "RemoteError", "ResourceExhausted",
           "SegmentUnavailable", "StalePlacement", "StoreError", "TableClosed", "Unavailable", "UnsafeFile",
           "WriteFenced", "describe", "is_int"]
