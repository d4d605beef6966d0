"""Mooncake's ``MooncakeDistributedStore`` over this project's store: integer codes, raw buffer addresses."""

from __future__ import annotations

import ctypes
import enum
import logging
import socket
from typing import Any, Sequence

import numpy as np

from ..client import DistributedStore
from .._config import DEFAULT_EMBEDDED_SEGMENT_SIZE, StoreConfig
from .._errors import (
    EngramError,
    InvalidArgument,
    InvalidType,
    LeaseActive,
    MasterUnavailable,
    ObjectExists,
    ObjectNotFound,
    OutOfSpace,
    Unavailable,
)

log = logging.getLogger("engram_store.compat")

#: Mooncake reads its configuration with ``MooncakeConfig.load_from_env()``; the fields are the same.
MooncakeConfig = StoreConfig


class ErrorCode(enum.IntEnum):
    """The subset of Mooncake's error codes this layer returns."""

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
    NOT_SET_UP = -1001


_CODES = [
    (ObjectNotFound, ErrorCode.OBJECT_NOT_FOUND),
    (ObjectExists, ErrorCode.OBJECT_ALREADY_EXISTS),
    (LeaseActive, ErrorCode.OBJECT_HAS_LEASE),
    (OutOfSpace, ErrorCode.NO_AVAILABLE_HANDLE),
    (MasterUnavailable, ErrorCode.RPC_FAIL),
    (Unavailable, ErrorCode.TRANSFER_FAIL),
    (InvalidArgument, ErrorCode.INVALID_PARAMS),
    (InvalidType, ErrorCode.INVALID_PARAMS),
]


def error_code(exc: BaseException) -> int:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return int(code)
    return int(ErrorCode.INTERNAL_ERROR)


class ReplicateConfig:
    """Mooncake's replication settings; ``replica_num`` is honoured, pinning is implied (tables never evict).

    The other fields are accepted so that code setting them runs; placement here is the master's choice.
    """

    def __init__(self, replica_num: int = 1):
        self.replica_num = replica_num
        self.nof_replica_num = 0
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.prefer_alloc_in_same_node = False


def _view(ptr: int, size: int, name: str) -> np.ndarray:
    """A uint8 array over ``size`` bytes at address ``ptr`` (the caller vouches for the memory)."""
    if not isinstance(ptr, int) or ptr <= 0:
        raise InvalidArgument(f"{name}: expected a buffer address (int > 0), got {ptr!r}")
    if not isinstance(size, int) or size < 0:
        raise InvalidArgument(f"{name}: expected a size (int >= 0), got {size!r}")
    if size == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer((ctypes.c_char * size).from_address(ptr), dtype=np.uint8)


class MooncakeDistributedStore:
    """``mooncake.store.MooncakeDistributedStore`` with this project's store underneath."""

    def __init__(self) -> None:
        self._store: DistributedStore | None = None
        self._registered: dict[int, int] = {}
        self.last_error: EngramError | None = None

    @property
    def native_store(self) -> DistributedStore | None:
        """The :class:`DistributedStore` behind this object (None before ``setup``)."""
        return self._store

    def _fail(self, op: str, exc: BaseException) -> int:
        self.last_error = exc if isinstance(exc, EngramError) else None
        log.warning("%s failed: %s", op, exc)
        return error_code(exc)

    def _require(self) -> DistributedStore:
        if self._store is None:
            raise Unavailable("the store is not set up: call setup(...) first")
        return self._store

    # ---- setup ----------------------------------------------------------------------------------

    def setup(self, local_hostname: str = "127.0.0.1", metadata_server: str = "",
              global_segment_size: int = 16 << 20, local_buffer_size: int = 1 << 30, protocol: str = "tcp",
              rdma_devices: str = "", master_server_addr: str = "", **kwargs: Any) -> int:
        """Connect (and mount ``global_segment_size`` bytes as a segment); 0 on success.

        ``master_server_addr`` may also be passed as ``master_server_address``. An empty master address
        starts an embedded master and segment in this process. ``metadata_server``, ``local_buffer_size``,
        ``protocol`` and ``rdma_devices`` are accepted for compatibility; the transport is ZeroMQ over TCP.
        """
        master = kwargs.pop("master_server_address", master_server_addr)
        kwargs.pop("device_name", None)
        if kwargs:
            return self._fail("setup", InvalidArgument(f"setup: unexpected arguments {sorted(kwargs)}"))
        try:
            config = StoreConfig(master_server_address=master or "", global_segment_size=global_segment_size,
                                 local_buffer_size=local_buffer_size, local_hostname=local_hostname or "127.0.0.1",
                                 metadata_server=metadata_server or "", protocol=protocol or "tcp",
                                 device_name=rdma_devices or "")
            if not config.master_server_address and not config.global_segment_size:
                config.global_segment_size = DEFAULT_EMBEDDED_SEGMENT_SIZE
            self.close()
            self._store = DistributedStore.from_config(config)
            return 0
        except EngramError as exc:
            return self._fail("setup", exc)

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 16 << 20) -> int:
        """Mooncake's older set-up call: an embedded store with a segment of ``mount_segment_size``."""
        return self.setup("127.0.0.1", "", mount_segment_size, 0, protocol, device_name, "")

    def get_hostname(self) -> str:
        return socket.gethostname()

    def close(self) -> int:
        if self._store is not None:
            self._store.close()
            self._store = None
        self._registered.clear()
        return 0

    # ---- buffers --------------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Accepted for compatibility (no registration is needed here); 0."""
        self._registered[int(buffer_ptr)] = int(size)
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        self._registered.pop(int(buffer_ptr), None)
        return 0

    # ---- writes ---------------------------------------------------------------------------------

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        try:
            self._require().put(key, value, replica_num=_replicas(config))
            return 0
        except EngramError as exc:
            return self._fail("put", exc)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        try:
            self._require().put(key, _view(buffer_ptr, size, "buffer_ptr"), replica_num=_replicas(config))
            return 0
        except EngramError as exc:
            return self._fail("put_from", exc)

    def put_batch(self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None) -> int:
        try:
            self._require().batch_put_from(keys, values, replica_num=_replicas(config))
            return 0
        except EngramError as exc:
            return self._fail("put_batch", exc)

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        """Each key on its own: one code per key (Mooncake's semantics; the native call is all-or-nothing)."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            self._fail("batch_put_from", InvalidArgument(
                f"batch_put_from: {len(keys)} keys, {len(buffer_ptrs)} pointers, {len(sizes)} sizes"))
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        codes = []
        for key, ptr, size in zip(keys, buffer_ptrs, sizes):
            codes.append(self.put_from(key, ptr, size, config))
        return codes

    # ---- reads ----------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The object's bytes, or ``b""`` when it cannot be read (as Mooncake)."""
        try:
            return self._require().get(key)
        except EngramError as exc:
            self._fail("get", exc)
            return b""

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        try:
            return self._require().get_into(key, _view(buffer_ptr, size, "buffer_ptr"))
        except EngramError as exc:
            return self._fail("get_into", exc)

    def get_into_ranges(self, buffer_ptrs: Sequence[int], all_keys: Sequence[Sequence[str]], all_dst_offsets: Sequence,
                        all_src_offsets: Sequence, all_sizes: Sequence) -> list:
        """Ranged reads into registered buffers; per range the bytes read, or a negative code for all of a call."""
        try:
            store = self._require()
            buffers = []
            for i, ptr in enumerate(buffer_ptrs):
                limit = self._registered.get(int(ptr))
                if limit is None:
                    # Unregistered: size the view to cover exactly the ranges asked of it.
                    ends = [d + n for dsts, ns in zip(all_dst_offsets[i], all_sizes[i]) for d, n in zip(dsts, ns)]
                    limit = max(ends, default=0)
                buffers.append(_view(int(ptr), limit, f"buffer_ptrs[{i}]"))
            return store.get_into_ranges(buffers, all_keys, all_dst_offsets, all_src_offsets, all_sizes)
        except EngramError as exc:
            code = self._fail("get_into_ranges", exc)
            return [[[code] * len(sizes) for sizes in per_buffer] for per_buffer in all_sizes]

    def is_exist(self, key: str) -> int:
        """1 if the key exists, 0 if not, negative on error."""
        try:
            return int(self._require().is_exist(key))
        except EngramError as exc:
            return self._fail("is_exist", exc)

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        try:
            return [int(x) for x in self._require().batch_is_exist(list(keys))]
        except EngramError as exc:
            return [self._fail("batch_is_exist", exc)] * len(keys)

    def get_size(self, key: str) -> int:
        try:
            return self._require().get_size(key)
        except EngramError as exc:
            return self._fail("get_size", exc)

    # ---- removal --------------------------------------------------------------------------------

    def remove(self, key: str, force: bool = False) -> int:
        try:
            self._require().remove(key, force=force)
            return 0
        except EngramError as exc:
            return self._fail("remove", exc)

    def remove_all(self, force: bool = False) -> int:
        """The number of objects removed, or a negative code."""
        try:
            return self._require().remove_all(force=force)
        except EngramError as exc:
            return self._fail("remove_all", exc)


def _replicas(config: ReplicateConfig | None) -> int:
    return 1 if config is None else int(getattr(config, "replica_num", 1))
