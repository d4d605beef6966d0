"""Mooncake's integer return codes, and the code of each failure this project raises."""

from __future__ import annotations

import enum

from ..errors import (
    InvalidArgument,
    InvalidType,
    LeaseActive,
    MasterUnavailable,
    NotConnected,
    ObjectExists,
    ObjectNotFound,
    OutOfSpace,
    Unavailable,
)
from ._replicate import DfsUnavailable


class ErrorCode(enum.IntEnum):
    """The subset of Mooncake's error codes this layer returns (same names, same values)."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    NO_AVAILABLE_HANDLE = -200
    INVALID_PARAMS = -600
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    NOT_SET_UP = -1001  # kept for code that names it; a call before setup returns INVALID_PARAMS, as Mooncake's
    DFS_SERVICE_UNAVAILABLE = -1601


#: First match wins: a subclass before its base.
_CODES = [
    (ObjectNotFound, ErrorCode.OBJECT_NOT_FOUND),
    (ObjectExists, ErrorCode.OBJECT_ALREADY_EXISTS),
    (LeaseActive, ErrorCode.OBJECT_HAS_LEASE),
    (OutOfSpace, ErrorCode.NO_AVAILABLE_HANDLE),
    (DfsUnavailable, ErrorCode.DFS_SERVICE_UNAVAILABLE),
    (MasterUnavailable, ErrorCode.RPC_FAIL),
    (Unavailable, ErrorCode.TRANSFER_FAIL),
    (InvalidArgument, ErrorCode.INVALID_PARAMS),
    (InvalidType, ErrorCode.INVALID_PARAMS),
    (NotConnected, ErrorCode.INVALID_PARAMS),  # Mooncake: "Client is not initialized"
]


def error_code(exc: BaseException) -> int:
    """Mooncake's code for ``exc`` (``INTERNAL_ERROR`` for anything without one)."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return int(code)
    return int(ErrorCode.INTERNAL_ERROR)
