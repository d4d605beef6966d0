"""The plain Python and NumPy twins of the raw read channel's kernels (:mod:`.raw_io`), which the tests hold them
to: the same request bytes, the same answer to every reply, the same reply to every request (or the same refusal
to answer it in a kernel)."""
from __future__ import annotations

import struct

import numpy as np

from ._generations_table import HOLDS, check_table
from .raw_io import (
    BAD_ID,
    CLOSED,
    FAILED,
    HEADER_BYTES,
    HEADER_LAYOUT,
    OK,
    P_MAX_BYTES,
    P_MAX_RANGES,
    P_OK_KIND,
    P_READ_KIND,
    P_STREAM_MIN,
    P_STREAM_PIECE,
    PAIR_BYTES,
    PAIR_WORDS,
    PLAN_C,
    PLAN_K,
    PLAN_ORDER,
    PROTOCOL,
    REFUSED,
    TIMEOUT,
    _LOW48,
)

#: A header's three words (kind, request id, count), as raw_io.HEADER_LAYOUT lays them out.
_WORDS = struct.Struct("<" + "q" * len(HEADER_LAYOUT.names))


def direct_request_numpy(ids: np.ndarray, plan: np.ndarray, row_bytes: int, kind: int, request_id: int) -> bytes:
    """The request :func:`read_direct` sends, built with NumPy: header, checks, :func:`direct_pairs`'s ranges."""
    K, C = int(plan[PLAN_K]), int(plan[PLAN_C])
    order, bases = plan[PLAN_ORDER:PLAN_ORDER + K], plan[PLAN_ORDER + K:PLAN_ORDER + 2 * K]
    c0 = PLAN_ORDER + 3 * K
    checks = plan[c0:c0 + PAIR_WORDS * C].reshape(C, PAIR_WORDS)
    pairs = np.stack([(bases[None, :] + ids[:, order] * row_bytes).reshape(-1),
                      np.full(ids.shape[0] * K, row_bytes, dtype=np.int64)], axis=1)
    return _WORDS.pack(kind, request_id, C + ids.shape[0] * K) + checks.tobytes() + pairs.tobytes()


def read_direct_python(sock, ids: np.ndarray, plan: np.ndarray, row_bytes: int, kind: int, ok_kind: int,
                       request_id: int, out: np.ndarray) -> int:
    """:func:`read_direct` with the socket module (``sock`` blocking, with its own timeouts)."""
    K = int(plan[PLAN_K])
    rows = ids[:, plan[PLAN_ORDER:PLAN_ORDER + K]]
    if ((rows < 0) | (rows >= plan[PLAN_ORDER + 2 * K:PLAN_ORDER + 3 * K])).any():
        return BAD_ID
    expected = ids.shape[0] * K * row_bytes
    try:
        sock.sendall(direct_request_numpy(ids, plan, row_bytes, kind, request_id))
    except (BrokenPipeError, ConnectionResetError):
        return CLOSED
    except (BlockingIOError, TimeoutError):
        return TIMEOUT
    except OSError:
        return FAILED
    got = bytearray()
    try:
        while len(got) < HEADER_BYTES:
            chunk = sock.recv(HEADER_BYTES - len(got))
            if not chunk:
                return CLOSED if not got else FAILED
            got += chunk
        word0, rid, count = _WORDS.unpack(bytes(got))
        if word0 != ok_kind:
            return REFUSED if (word0 & _LOW48) == (ok_kind & _LOW48) else PROTOCOL
        if rid != request_id or count != expected:
            return PROTOCOL
        view = memoryview(out)[:expected]
        have = 0
        while have < expected:
            k = sock.recv_into(view[have:])
            if k == 0:
                return FAILED
            have += k
    except ConnectionResetError:
        return CLOSED if not got else FAILED
    except (BlockingIOError, TimeoutError):
        return TIMEOUT
    except OSError:
        return FAILED
    return OK


def serve_read_python(message: bytes, segment: np.ndarray, table: np.ndarray, params: np.ndarray,
                      reply_capacity: int) -> bytes | None:
    """The reply :func:`serve_read` sends for one whole ``message``, or None where it leaves the message to its
    caller (PYTHON): plain Python and NumPy over the same checks."""
    if len(message) < HEADER_BYTES:
        return None
    word0, request_id, count = _WORDS.unpack(message[:HEADER_BYTES])
    if word0 != params[P_READ_KIND] or not 0 <= count <= params[P_MAX_RANGES] \
            or len(message) != HEADER_BYTES + PAIR_BYTES * count:
        return None
    pairs = np.frombuffer(message, dtype=np.int64, offset=HEADER_BYTES).reshape(count, PAIR_WORDS)
    K = int(np.argmax(pairs[:, 0] >= 0)) if count and (pairs[:, 0] >= 0).any() else count
    if K:
        if table.size == 0 or K % 2:
            return None
        if check_table(table, np.ascontiguousarray(pairs[:K]))[0] != HOLDS:
            return None
    ranges = pairs[K:]
    o, n = ranges[:, 0], ranges[:, 1]
    if ((o < 0) | (n < 0) | (o > segment.size) | (n > segment.size - o)).any():
        return None
    total = int(n.sum())
    if total > params[P_MAX_BYTES] or total > params[P_STREAM_MIN] or HEADER_BYTES + total > reply_capacity \
            or (ranges.shape[0] == 1 and total >= params[P_STREAM_PIECE]):
        return None
    body = b"".join(segment[a:a + b].tobytes() for a, b in ranges.tolist())
    return _WORDS.pack(int(params[P_OK_KIND]), request_id, total) + body
