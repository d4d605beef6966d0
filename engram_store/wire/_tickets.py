"""Write tickets: what lets a writer write one range of one segment for one put (see DESIGN.md, "Fencing").

The master places a put's replicas and hands the writer, per replica, a ticket: the put's id, the offset and size
it may write, and a MAC under the secret ``write_key`` the segment chose for its current registration. The segment
checks the MAC, the range and that the put has not been fenced before any byte of a write lands. A segment that
registers again picks a new key, so every ticket of its old registration (and of a master that forgot its pending
puts) stops working at once.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

#: put id, offset and size (little-endian uint64 each), then the first MAC_BYTES of an HMAC-SHA256 under the
#: segment's write key of (segment id, those 24 bytes).
BODY = struct.Struct("<QQQ")
MAC_BYTES = 16
TICKET_BYTES = BODY.size + MAC_BYTES
#: Random bytes of a write key (a segment makes a new one at every registration).
WRITE_KEY_BYTES = 32


def _mac(write_key: bytes, segment_id: str, body: bytes) -> bytes:
    return hmac.new(write_key, segment_id.encode() + body, hashlib.sha256).digest()[:MAC_BYTES]


def make_ticket(write_key: bytes, segment_id: str, put_id: int, offset: int, size: int) -> bytes:
    """The ticket that lets a writer write ``[offset, offset + size)`` of one segment for put ``put_id``."""
    body = BODY.pack(put_id, offset, size)
    return body + _mac(write_key, segment_id, body)


def read_ticket(write_key: bytes, segment_id: str, ticket: bytes) -> tuple[int, int, int] | None:
    """``(put_id, offset, size)`` of a ticket issued under ``write_key`` for this segment, else None."""
    if len(ticket) != TICKET_BYTES or not write_key:
        return None
    body = bytes(ticket[:BODY.size])
    if not hmac.compare_digest(bytes(ticket[BODY.size:]), _mac(write_key, segment_id, body)):
        return None
    return BODY.unpack(body)
