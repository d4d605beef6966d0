"""What the client hands out about objects (their replicas), and the checks of keys and buffers it shares."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument, InvalidType, describe

MAX_KEY_LEN = 1024


@dataclass(frozen=True)
class Replica:
    """Where one copy of an object lives.

    ``read_addresses`` are the segment's reader sockets (``read_ranges`` and ``ping`` only), empty for a
    segment without readers; ``address`` serves every operation. ``shm_path`` is the segment's hand-over socket on
    its host (see ``engram_store.wire.handover``; empty for none), never a file to open.
    """

    segment_id: str
    address: str
    offset: int
    shm_path: str
    host_id: str
    segment_size: int
    read_addresses: tuple[str, ...] = ()
    #: The put whose bytes these are: reads name it, and a segment refuses them once another put wrote there.
    generation: int = 0


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    replicas: tuple[Replica, ...]
    #: xxh3_64 of the object's bytes (hex) as its writer computed them; "" where none was given.
    checksum: str = ""


@dataclass(frozen=True)
class KeyInfo:
    """One object as :meth:`DistributedStore.list_keys` lists it."""

    key: str
    size: int
    replica_num: int       # replicas asked for
    replicas: int          # replicas the master knows live (0 for a lost object)
    state: str             # "complete", "pending" (a write in progress) or "lost"
    lease_left_s: float    # how long a read lease still holds off a remove


def replica_of(d: dict) -> Replica:
    return Replica(d["segment_id"], d["address"], d["offset"], d["shm_path"], d["host_id"], d["size"],
                   tuple(d.get("read_addresses") or ()), int(d.get("generation") or 0))


def check_key(key: object, name: str = "key") -> str:
    if not isinstance(key, str):
        raise InvalidType(f"{name}: expected a string, got {describe(key)}")
    if not key or len(key) > MAX_KEY_LEN:
        raise InvalidArgument(f"{name}: expected a non-empty string of at most {MAX_KEY_LEN} characters, "
                              f"got {len(key)} characters")
    return key


def as_bytes_view(data: object, name: str, writable: bool = False) -> np.ndarray:
    """A flat uint8 view (no copy) of a bytes-like object or C-contiguous array."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise InvalidArgument(f"{name}: expected a C-contiguous array, got a non-contiguous one "
                                  f"(use np.ascontiguousarray)")
        if writable and not data.flags.writeable:
            raise InvalidArgument(f"{name}: expected a writable buffer, got a read-only array")
        return data.reshape(-1).view(np.uint8)
    try:
        mv = memoryview(data)
    except TypeError:
        raise InvalidType(f"{name}: expected bytes, bytearray, memoryview or a NumPy array, "
                          f"got {type(data).__name__}") from None
    if not mv.c_contiguous:
        raise InvalidArgument(f"{name}: expected a contiguous buffer")
    if writable and mv.readonly:
        raise InvalidArgument(f"{name}: expected a writable buffer, got a read-only {type(data).__name__}")
    return np.frombuffer(mv.cast("B"), dtype=np.uint8)
