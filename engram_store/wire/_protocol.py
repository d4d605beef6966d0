"""The wire protocol: one msgpack header frame, then zero or more raw binary frames.

Every request header is a map ``{v: PROTOCOL_VERSION, id: int, op: str, ...fields}``; every reply header is
``{v, id, ok: True, ...}`` or ``{v, id, ok: False, code: str, message: str}``. Bulk data (object bytes,
offset/length arrays, gathered rows) travels in the raw frames after the header, never inside msgpack.

:func:`encode` / :func:`decode` (and the serving loop's :func:`pack_header` / :func:`unpack_header`, which they
use) are the only places that pack and unpack headers; :class:`Request` gives servers typed, bounded access to
header fields so that every field is validated before it is acted on.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Sequence

import msgpack
import numpy as np

from ..errors import EngramError, InvalidArgument, ProtocolError, describe

#: 2: writes carry tickets (fencing); segments register with a write key and acknowledge fences in heartbeats.
PROTOCOL_VERSION = 2
#: A header larger than this is refused before it is unpacked.
MAX_HEADER_BYTES = 1 << 20
#: Limits on what msgpack may allocate while unpacking a header.
_UNPACK_LIMITS = dict(
    max_str_len=1 << 16, max_bin_len=1 << 16, max_array_len=1 << 16, max_map_len=256, max_ext_len=0
)


_unpackb = functools.partial(msgpack.unpackb, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
_packb = functools.partial(msgpack.packb, use_bin_type=True)


def encode(header: dict, frames: Iterable[Any] = ()) -> list:
    """Pack a header (a dict with ``v`` added) and append the raw frames unchanged."""
    head = {"v": PROTOCOL_VERSION, **header}
    return [_packb(head), *frames]


def pack_header(header: dict) -> bytes:
    """The msgpack bytes of a header that already holds ``v`` (the serving loop's reply path)."""
    return _packb(header)


def unpack_header(raw: Any) -> dict:
    """Unpack and check one header frame (bytes-like); raise ProtocolError if it is not a versioned map."""
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame of {len(raw)} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    try:
        header = _unpackb(raw)
    except Exception as exc:  # msgpack raises several unrelated classes for bad input
        reason = str(exc) or {"OutOfData": "the frame ends in the middle of a value",
                              "FormatError": "the bytes are not a msgpack encoding (a reserved type byte)",
                              "StackError": "values nested too deeply",
                              "ExtraData": "bytes follow the header's value"}.get(type(exc).__name__,
                                                                                  "unreadable bytes")
        raise ProtocolError(f"header frame ({len(raw)} bytes) is not valid msgpack: {type(exc).__name__}"
                            + (f": {reason}" if reason else "")) from exc
    if type(header) is not dict:
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    version = header.get("v")
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise ProtocolError(f"protocol version: expected {PROTOCOL_VERSION}, got {describe(version)}")
    return header


def decode(frames: Sequence[Any]) -> tuple[dict, list]:
    """Split a multipart message into ``(header, raw_frames)``; raise ProtocolError if it is malformed.

    Frames may be ``bytes`` or ``zmq.Frame``; raw frames are returned as they came (zero-copy).
    """
    if not frames:
        raise ProtocolError("empty message: expected a msgpack header frame")
    first = frames[0]
    return unpack_header(first.buffer if hasattr(first, "buffer") else first), list(frames[1:])


def ok_reply(request_id: int, fields: dict | None = None) -> dict:
    return {"id": request_id, "ok": True, **(fields or {})}


def error_reply(request_id: object, exc: BaseException) -> dict:
    code = exc.code if isinstance(exc, EngramError) else "REMOTE"
    rid = request_id if isinstance(request_id, int) and not isinstance(request_id, bool) else -1
    return {"id": rid, "ok": False, "code": code, "message": str(exc) or type(exc).__name__}


def frame_bytes(frame: Any) -> memoryview:
    """A zero-copy view of a received frame (``zmq.Frame`` or bytes)."""
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def frame_array(frame: Any, dtype: Any, name: str, count: int | None = None) -> np.ndarray:
    """View a raw frame as a 1-D array of ``dtype``; check its length is a whole number of items (and ``count``)."""
    buf = frame_bytes(frame)
    dt = np.dtype(dtype)
    if buf.nbytes % dt.itemsize:
        raise InvalidArgument(f"{name}: frame of {buf.nbytes} bytes is not a whole number of {dt.name} items")
    arr = np.frombuffer(buf, dtype=dt)
    if count is not None and arr.size != count:
        raise InvalidArgument(f"{name}: expected {count} {dt.name} items, got {arr.size}")
    return arr


class Request:
    """Typed, validated access to the fields of a request header.

    Each getter raises :class:`InvalidArgument` naming the field, what was expected and what came, so a
    server answers a bad request with an error reply instead of acting on it.
    """

    __slots__ = ("header", "frames", "op", "id")

    def __init__(self, header: dict, frames: list):
        self.header = header
        self.frames = frames
        rid = header.get("id")
        if not isinstance(rid, int) or isinstance(rid, bool):
            raise ProtocolError(f"field 'id': expected an integer request id, got {describe(rid)}")
        op = header.get("op")
        if not isinstance(op, str):
            raise ProtocolError(f"field 'op': expected a string, got {describe(op)}")
        self.id = rid
        self.op = op

    @classmethod
    def checked(cls, header: dict, frames: list, rid: int, op: str) -> "Request":
        """A request whose ``id`` and ``op`` the caller already validated (the serving loop's fast path)."""
        req = cls.__new__(cls)
        req.header, req.frames, req.id, req.op = header, frames, rid, op
        return req

    def _get(self, name: str, default: Any) -> Any:
        if name in self.header:
            return self.header[name]
        if default is _REQUIRED:
            raise InvalidArgument(f"op {self.op!r}: missing field {name!r}")
        return default

    def int(self, name: str, lo: int | None = None, hi: int | None = None, default: Any = None) -> int:
        value = self._get(name, _REQUIRED if default is None else default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgument(f"field {name!r}: expected an integer, got {describe(value)}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise InvalidArgument(f"field {name!r}: expected an integer in [{lo}, {hi}], got {value}")
        return value

    def float(self, name: str, lo: float | None = None, default: Any = None) -> float:
        value = self._get(name, _REQUIRED if default is None else default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            raise InvalidArgument(f"field {name!r}: expected a number, got {describe(value)}")
        if lo is not None and value < lo:
            raise InvalidArgument(f"field {name!r}: expected a number >= {lo}, got {value}")
        return float(value)

    def str(self, name: str, max_len: int = 4096, default: Any = None, allow_empty: bool = False) -> str:
        value = self._get(name, _REQUIRED if default is None else default)
        if not isinstance(value, str):
            raise InvalidArgument(f"field {name!r}: expected a string, got {describe(value)}")
        if len(value) > max_len or (not value and not allow_empty):
            raise InvalidArgument(
                f"field {name!r}: expected a {'' if allow_empty else 'non-empty '}string of at most "
                f"{max_len} characters, got {len(value)} characters"
            )
        return value

    def bytes(self, name: str, max_len: int = 4096, default: Any = None) -> bytes:
        value = self._get(name, _REQUIRED if default is None else default)
        if not isinstance(value, (bytes, bytearray)) or len(value) > max_len:
            raise InvalidArgument(f"field {name!r}: expected binary data of at most {max_len} bytes, "
                                  f"got {describe(value)}")
        return bytes(value)

    def int_list(self, name: str, max_items: int = 1 << 16, lo: int = 0, hi: int = (1 << 63) - 1,
                 default: Any = None) -> list[int]:
        value = self._get(name, _REQUIRED if default is None else default)
        if not isinstance(value, list) or len(value) > max_items:
            raise InvalidArgument(f"field {name!r}: expected a list of at most {max_items} integers, "
                                  f"got {describe(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, int) or isinstance(item, bool) or not lo <= item <= hi:
                raise InvalidArgument(f"field {name!r}[{i}]: expected an integer in [{lo}, {hi}], got {describe(item)}")
        return value

    def ranges(self, name: str, max_items: int = 1 << 16, default: Any = None) -> list[tuple[int, int]]:
        """A list of ``[offset, size]`` pairs of non-negative integers."""
        value = self._get(name, _REQUIRED if default is None else default)
        if not isinstance(value, list) or len(value) > max_items:
            raise InvalidArgument(f"field {name!r}: expected a list of at most {max_items} [offset, size] pairs, "
                                  f"got {describe(value)}")
        out = []
        for i, item in enumerate(value):
            if not (isinstance(item, list) and len(item) == 2
                    and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 for v in item)):
                raise InvalidArgument(f"field {name!r}[{i}]: expected [offset, size], got {describe(item)}")
            out.append((item[0], item[1]))
        return out

    def bool(self, name: str, default: Any = None) -> bool:
        value = self._get(name, _REQUIRED if default is None else default)
        if not isinstance(value, bool):
            raise InvalidArgument(f"field {name!r}: expected true or false, got {describe(value)}")
        return value

    def str_list(self, name: str, max_items: int = 1 << 16, max_len: int = 4096, default: Any = None) -> list[str]:
        value = self._get(name, _REQUIRED if default is None else default)
        if not isinstance(value, list) or len(value) > max_items:
            raise InvalidArgument(f"field {name!r}: expected a list of at most {max_items} strings, got {describe(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item or len(item) > max_len:
                raise InvalidArgument(f"field {name!r}[{i}]: expected a non-empty string, got {describe(item)}")
        return value


_REQUIRED = object()
