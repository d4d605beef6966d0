"""Errors as Mooncake's binding raises them: RuntimeError twins of this project's classes, and argument checks."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

from ..errors import (
    ConfigError,
    EngramError,
    InvalidArgument,
    InvalidType,
    LeaseActive,
    MasterUnavailable,
    ObjectExists,
    ObjectLost,
    ObjectNotFound,
    OutOfSpace,
    ProtocolError,
    RemoteError,
    SegmentUnavailable,
    StoreError,
    Unavailable,
    WriteFenced,
    is_int,
)

#: Mooncake's ``EngramStoreConfig()`` defaults. ``row_bytes`` 0 is Mooncake's too: it must be set before a
#: byte-row EngramStore is built.
DEFAULT_TABLE_VOCAB_SIZES = (1024,)
DEFAULT_EMBEDDING_DIM = 64
DEFAULT_ROW_BYTES = 0

_UNSET: Any = object()


def _runtime_twin(cls: type) -> type:
    """``cls``, also a RuntimeError: what Mooncake's binding raises when its C++ code reports a failure."""
    summary = (cls.__doc__ or cls.__name__).strip().splitlines()[0]
    return type(cls.__name__, (cls, RuntimeError),
                {"__module__": "engram_store.compat", "__doc__": f"{summary} (Also a RuntimeError, as Mooncake raises it.)"})


#: Each engram error class as this layer raises it where Mooncake raises RuntimeError (``except EngramError``,
#: ``except ObjectExists`` and ``except RuntimeError`` all catch it).
_RUNTIME_ERRORS: dict[type, type] = {cls: _runtime_twin(cls) for cls in (
    EngramError, InvalidArgument, ConfigError, InvalidType, StoreError, ObjectNotFound, ObjectExists, LeaseActive,
    OutOfSpace, Unavailable, MasterUnavailable, SegmentUnavailable, ObjectLost, WriteFenced, ProtocolError,
    RemoteError)}
_RuntimeInvalidArgument = _RUNTIME_ERRORS[InvalidArgument]
_RuntimeInvalidType = _RUNTIME_ERRORS[InvalidType]


def _as_runtime_error(exc: EngramError, message: str | None = None) -> EngramError:
    """``exc`` as a RuntimeError of its own class (itself if it is one already and keeps its message)."""
    text = str(exc) if message is None else message
    if isinstance(exc, RuntimeError):
        return exc if message is None else type(exc)(text)
    cls = next(c for c in type(exc).__mro__ if c in _RUNTIME_ERRORS)
    return _RUNTIME_ERRORS[cls](text)


@contextlib.contextmanager
def _runtime_errors() -> Iterator[None]:
    """Raise the engram errors of the block as RuntimeErrors of their own class, as Mooncake does."""
    try:
        yield
    except EngramError as exc:
        mapped = _as_runtime_error(exc)
        if mapped is exc:
            raise
        raise mapped from exc


_is_int = is_int  # the project's one integer check, under the name this room's modules use


def _describe_array(value: Any) -> str:
    if not isinstance(value, np.ndarray):
        return type(value).__name__
    return (f"{value.dtype} array of shape {value.shape}" + ("" if value.flags.c_contiguous else " (not C-contiguous)")
            + ("" if value.flags.writeable else " (read-only)"))


def _lookup_error(exc: EngramError, from_store: bool) -> EngramError:
    """A failed lookup's error as Mooncake raises it (a RuntimeError); a missing table says what that means."""
    if from_store and isinstance(exc, ObjectNotFound):
        return _as_runtime_error(exc, f"{exc}: the layer is not in the store (never populated, or removed)")
    return _as_runtime_error(exc)
