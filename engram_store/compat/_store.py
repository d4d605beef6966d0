"""Mooncake's ``MooncakeDistributedStore`` over this project's store: integer codes, raw buffer addresses.

Each method returns what Mooncake's returns: 0 or a byte count on success, a negative :class:`ErrorCode` on
failure (``b""`` or None from the calls that return data); the failure is logged and kept in ``last_error``.
Modules: ``_setup`` (both ``setup`` overloads and the session they open), ``_replicate`` (``ReplicateConfig``
and the checks of a write), ``_reads`` (per-key results over all-or-nothing reads), ``_buffers`` (addresses,
registrations, ``BufferHandle``), ``_codes`` (the codes). docs/mooncake-compat.md lists every method.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from ..client import DistributedStore, as_bytes_view
from .._config import StoreConfig
from ..errors import EngramError, InvalidArgument, InvalidType, NotConnected, ObjectExists, ObjectNotFound
from ._buffers import BufferHandle, Registrations, view
from ._codes import error_code
from ._reads import object_sizes, read_ranges, read_whole
from ._replicate import ReplicateConfig, write_replicas
from ._setup import Session, SetupRequest

log = logging.getLogger("engram_store.compat")

#: Mooncake reads its configuration with ``MooncakeConfig.load_from_env()``; the fields are the same.
MooncakeConfig = StoreConfig

#: How often ``upsert`` removes and writes again when another writer recreates the key in between.
UPSERT_ATTEMPTS = 3
#: ``init_all``'s local buffer, as Mooncake's.
INIT_ALL_BUFFER_SIZE = 1 << 30


class MooncakeDistributedStore:
    """``mooncake.store.MooncakeDistributedStore`` with this project's store underneath."""

    def __init__(self) -> None:
        self._session: Session | None = None
        self._registered = Registrations()
        self._lock = threading.Lock()
        self.last_error: EngramError | None = None

    @property
    def native_store(self) -> DistributedStore | None:
        """The :class:`DistributedStore` behind this object (None before ``setup``)."""
        return self._session.store if self._session is not None else None

    def _fail(self, op: str, exc: BaseException) -> int:
        self.last_error = exc if isinstance(exc, EngramError) else None
        level = logging.INFO if isinstance(exc, ObjectNotFound) else logging.WARNING
        log.log(level, "%s failed: %s", op, exc)
        return error_code(exc)

    def _live(self) -> Session:
        session = self._session
        if session is None or session.store is None:
            raise NotConnected("the store is not set up: call setup(...) first (0 means set up)")
        return session

    def _require(self) -> DistributedStore:
        return self._live().store

    def _stage(self, nbytes: int, what: str) -> None:
        """Mooncake copies put/get of Python bytes through its local buffer: more than it holds is refused."""
        limit = self._live().request.local_buffer_size
        if nbytes > limit:
            raise InvalidArgument(f"{what}: {nbytes} bytes do not fit the local buffer of {limit} bytes "
                                  f"(local_buffer_size; the zero-copy calls need none)")

    # ---- setup ----------------------------------------------------------------------------------

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """Connect, and mount ``global_segment_size`` bytes as this client's segment; 0 on success.

        Either Mooncake overload: ``setup(local_hostname, metadata_server, global_segment_size,
        local_buffer_size, protocol, rdma_devices, master_server_addr, ...)`` or ``setup(config_dict)``. An
        empty master address starts a master in this process.
        """
        try:
            if len(args) == 1 and not kwargs and isinstance(args[0], Mapping):
                request = SetupRequest.from_dict(args[0])
            elif not args and set(kwargs) == {"config"}:
                if not isinstance(kwargs["config"], Mapping):
                    raise InvalidType(f"config: expected a dict, got {type(kwargs['config']).__name__}")
                request = SetupRequest.from_dict(kwargs["config"])
            else:
                if "master_server_address" in kwargs:  # MooncakeConfig's name for it
                    kwargs["master_server_addr"] = kwargs.pop("master_server_address")
                if "device_name" in kwargs:
                    kwargs["rdma_devices"] = kwargs.pop("device_name")
                request = _positional(*args, **kwargs)
            with self._lock:
                self.close()
                self._session = Session(request)
            return 0
        except EngramError as exc:
            return self._fail("setup", exc)

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 16 << 20) -> int:
        """Mooncake's older set-up call: a master in this process and a segment of ``mount_segment_size``."""
        return self.setup("127.0.0.1", "", mount_segment_size, INIT_ALL_BUFFER_SIZE, protocol, device_name, "")

    def get_hostname(self) -> str:
        """``host:port`` of this client's transfer endpoint: the segment it mounts ("" before ``setup``)."""
        return self._session.hostname if self._session is not None else ""

    def close(self) -> int:
        """Stop this client; its segment, and every object on it, goes too. 0; safe to call twice."""
        session, self._session = self._session, None
        if session is not None:
            session.close()
        self._registered.clear()
        return 0

    def __del__(self) -> None:
        # As Mooncake's client does when its Python object goes away: unmount the segment, stop serving it.
        try:
            self.close()
        except Exception:  # interpreter shutdown may have torn down what closing needs
            pass

    # ---- buffers --------------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Accepted (no registration is needed to read or write here); a registered region bounds the ranged
        reads into it, as in Mooncake. 0, or -600 for an address or size that cannot be one."""
        try:
            self._registered.add(buffer_ptr, size)
            return 0
        except EngramError as exc:
            return self._fail("register_buffer", exc)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        self._registered.remove(buffer_ptr)
        return 0

    # ---- writes ---------------------------------------------------------------------------------

    def _write(self, op: str, key: str, data: Any, config: Any, staged: bool, upsert: bool) -> int:
        try:
            replicas = write_replicas(config, 1, staged)
            value = as_bytes_view(data, "value" if staged else "buffer_ptr")
            if value.nbytes == 0:
                raise InvalidArgument(f"{op}: expected a value of at least 1 byte, got 0")
            if staged:
                self._stage(value.nbytes, "value")
            if upsert:
                self._replace(key, value, replicas)
            else:
                self._create(key, value, replicas)
            return 0
        except EngramError as exc:
            return self._fail(op, exc)

    def _create(self, key: str, value: np.ndarray, replicas: int) -> None:
        """Mooncake's put: a key that exists keeps its object, and the put succeeds."""
        try:
            self._require().put(key, value, replica_num=replicas)
        except ObjectExists:
            log.debug("put: %r exists; its object stays (as in Mooncake)", key)

    def _replace(self, key: str, value: np.ndarray, replicas: int) -> None:
        """Upsert: write the key, removing what is there first (readers meanwhile find it missing)."""
        store = self._require()
        for _ in range(UPSERT_ATTEMPTS):
            try:
                store.put(key, value, replica_num=replicas)
                return
            except ObjectExists:
                pass
            try:
                store.remove(key, force=True)  # an in-flight read keeps its bytes: space is reused only later
            except ObjectNotFound:
                pass
        raise ObjectExists(f"upsert: key {key!r} was created again by another writer {UPSERT_ATTEMPTS} times "
                           "while it was being replaced")

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` under ``key``; 0 also when the key exists (its object stays, as in Mooncake)."""
        return self._write("put", key, value, config, staged=True, upsert=False)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """``put`` of ``size`` bytes at ``buffer_ptr`` (zero-copy: no local buffer needed)."""
        try:
            data = view(buffer_ptr, size, "buffer_ptr")
        except EngramError as exc:
            return self._fail("put_from", exc)
        return self._write("put_from", key, data, config, staged=False, upsert=False)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """``put`` of the parts joined into one object."""
        try:
            joined = b"".join(memoryview(part).cast("B") for part in parts)
        except TypeError as exc:
            return self._fail("put_parts", InvalidType(f"parts: expected bytes-like objects ({exc})"))
        return self._write("put_parts", key, joined, config, staged=True, upsert=False)

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` under ``key``, replacing the object there if any; 0 on success."""
        return self._write("upsert", key, value, config, staged=True, upsert=True)

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        try:
            data = view(buffer_ptr, size, "buffer_ptr")
        except EngramError as exc:
            return self._fail("upsert_from", exc)
        return self._write("upsert_from", key, data, config, staged=False, upsert=True)

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        try:
            joined = b"".join(memoryview(part).cast("B") for part in parts)
        except TypeError as exc:
            return self._fail("upsert_parts", InvalidType(f"parts: expected bytes-like objects ({exc})"))
        return self._write("upsert_parts", key, joined, config, staged=True, upsert=True)

    def put_batch(self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None) -> int:
        """``put`` of each value, as one write: keys that exist keep their objects; 0 or the failure's code.

        The keys not present are written all or nothing (Mooncake keeps the ones that succeeded)."""
        try:
            replicas = write_replicas(config, len(keys), staged=True)
            if len(values) != len(keys):
                raise InvalidArgument(f"values: expected {len(keys)} values (one per key), got {len(values)}")
            views = [as_bytes_view(v, f"values[{i}]") for i, v in enumerate(values)]
            if any(v.nbytes == 0 for v in views):
                raise InvalidArgument("values: expected values of at least 1 byte, got an empty one")
            self._stage(sum(v.nbytes for v in views), "values")
            store = self._require()
            pending = dict(zip(keys, views))
            for _ in range(UPSERT_ATTEMPTS):
                try:
                    store.batch_put_from(list(pending), list(pending.values()), replica_num=replicas)
                    return 0
                except ObjectExists:
                    present = store.batch_is_exist(list(pending))
                    pending = {k: v for (k, v), there in zip(pending.items(), present) if not there}
            raise ObjectExists("put_batch: keys kept being created by another writer while this batch was written")
        except EngramError as exc:
            return self._fail("put_batch", exc)

    def upsert_batch(self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None) -> int:
        """``upsert`` of each value; 0, or the first failure's code."""
        try:
            if len(values) != len(keys):
                raise InvalidArgument(f"values: expected {len(keys)} values (one per key), got {len(values)}")
            config = _per_key(config, len(keys), staged=True)
        except EngramError as exc:
            return self._fail("upsert_batch", exc)
        codes = [self.upsert(key, value, config) for key, value in zip(keys, values)]
        return next((code for code in codes if code), 0)

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        """``put_from`` of each key on its own: one code per key (Mooncake's semantics)."""
        return self._each("batch_put_from", self.put_from, keys, buffer_ptrs, sizes, config)

    def batch_upsert_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                          config: ReplicateConfig | None = None) -> list[int]:
        return self._each("batch_upsert_from", self.upsert_from, keys, buffer_ptrs, sizes, config)

    def _each(self, op: str, call, keys, buffer_ptrs, sizes, config) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            code = self._fail(op, InvalidArgument(
                f"{op}: expected as many pointers and sizes as keys ({len(keys)}), got {len(buffer_ptrs)} and "
                f"{len(sizes)}"))
            return [code] * len(keys)
        try:
            config = _per_key(config, len(keys), staged=False)
        except EngramError as exc:
            return [self._fail(op, exc)] * len(keys)
        return [call(key, ptr, size, config) for key, ptr, size in zip(keys, buffer_ptrs, sizes)]

    # ---- reads ----------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The object's bytes, or ``b""`` when it cannot be read (as Mooncake)."""
        try:
            data = self._require().get(key)
            self._stage(len(data), f"object {key!r}")
            return data
        except EngramError as exc:
            self._fail("get", exc)
            return b""

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        try:
            return self._require().get_into(key, view(buffer_ptr, size, "buffer_ptr"))
        except EngramError as exc:
            return self._fail("get_into", exc)

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        """Each object as a :class:`BufferHandle` (buffer protocol, ``size()``, ``ptr()``); None where it cannot
        be read, or does not fit what is left of the local buffer."""
        try:
            store = self._require()
        except EngramError as exc:
            self._fail("batch_get_buffer", exc)
            return [None] * len(keys)
        sizes = object_sizes(store, keys, self._fail, "batch_get_buffer")
        handles: list[BufferHandle | None] = [None] * len(keys)
        staged = 0
        for i, size in enumerate(sizes):
            if size < 0:
                continue
            try:
                self._stage(staged + size, f"object {keys[i]!r} (after {staged} bytes of the keys before it)")
            except EngramError as exc:
                self._fail("batch_get_buffer", exc)
                continue
            staged += size
            handles[i] = BufferHandle(size)
        wanted = [i for i, handle in enumerate(handles) if handle is not None]
        read = read_whole(store, [keys[i] for i in wanted], [np.frombuffer(handles[i], np.uint8) for i in wanted],
                          [sizes[i] for i in wanted], self._fail, "batch_get_buffer")
        for i, nbytes in zip(wanted, read):
            if nbytes < 0:
                handles[i] = None
        return handles

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object as a :class:`BufferHandle`, or None."""
        return self.batch_get_buffer([key])[0]

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """Each object's bytes; ``b""`` where it cannot be read."""
        return [b"" if handle is None else bytes(handle) for handle in self.batch_get_buffer(keys)]

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Each object into its buffer (``sizes[i]`` bytes at ``buffer_ptrs[i]``); per key the bytes read, or
        -704 (missing), -600 (buffer too small, or the three lists differ in length: every key)."""
        op = "batch_get_into"
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [self._fail(op, InvalidArgument(
                f"{op}: expected as many pointers and sizes as keys ({len(keys)}), got {len(buffer_ptrs)} and "
                f"{len(sizes)}"))] * len(keys)
        try:
            store = self._require()
        except EngramError as exc:
            return [self._fail(op, exc)] * len(keys)
        results = object_sizes(store, keys, self._fail, op)
        dsts: dict[int, np.ndarray] = {}
        for i, size in enumerate(results):
            if size < 0:
                continue
            try:
                dst = view(buffer_ptrs[i], sizes[i], f"buffer_ptrs[{i}]")
                if dst.nbytes < size:
                    raise InvalidArgument(f"sizes[{i}]: object {keys[i]!r} is {size} bytes, the buffer holds "
                                          f"{dst.nbytes}")
                dsts[i] = dst
            except EngramError as exc:
                results[i] = self._fail(op, exc)
        wanted = list(dsts)
        read = read_whole(store, [keys[i] for i in wanted], [dsts[i] for i in wanted], [results[i] for i in wanted],
                          self._fail, op)
        for i, nbytes in zip(wanted, read):
            results[i] = nbytes
        return results

    def get_into_ranges(self, buffer_ptrs: Sequence[int], all_keys: Sequence[Sequence[str]], all_dst_offsets: Sequence,
                        all_src_offsets: Sequence, all_sizes: Sequence) -> list:
        """Ranged reads, buffer-major: ``results[i][j][k]`` is the bytes of fragment k of key j read into buffer
        i, or a negative code for that fragment alone (Mooncake's shapes and codes; see ``_reads``)."""
        try:
            store = self._require()
        except EngramError as exc:
            code = self._fail("get_into_ranges", exc)
            return [[[code] * len(sizes) for sizes in per_buffer] for per_buffer in all_sizes]
        return read_ranges(store, self._registered, buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets,
                           all_sizes, self._fail)

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

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """``remove`` of each key: one code per key."""
        return [self.remove(key, force) for key in keys]

    def remove_all(self, force: bool = False) -> int:
        """The number of objects removed, or a negative code."""
        try:
            return self._require().remove_all(force=force)
        except EngramError as exc:
            return self._fail("remove_all", exc)


def _positional(local_hostname: Any = "127.0.0.1", metadata_server: Any = "", global_segment_size: Any = 16 << 20,
                local_buffer_size: Any = 1 << 30, protocol: Any = "tcp", rdma_devices: Any = "",
                master_server_addr: Any = "", **kwargs: Any) -> SetupRequest:
    """The positional overload's arguments (its defaults, where Mooncake requires them, are this layer's own)."""
    if isinstance(local_hostname, Mapping):
        raise InvalidType("local_hostname: expected a string (pass a config dict alone: setup(config)), got dict")
    try:
        return SetupRequest.from_args(local_hostname, metadata_server, global_segment_size, local_buffer_size,
                                      protocol, rdma_devices, master_server_addr, **kwargs)
    except TypeError as exc:  # an argument Mooncake's setup does not have
        raise InvalidType(f"setup: {exc}") from None


def _per_key(config: ReplicateConfig | None, keys: int, staged: bool) -> ReplicateConfig | None:
    """``config`` checked for a write of ``keys`` objects, as each object's write takes it: its ``group_ids``
    (one per key, checked here, and not kept by this store) dropped."""
    write_replicas(config, keys, staged)
    if config is None or config.group_ids is None:
        return config
    copy = ReplicateConfig()
    for name in ReplicateConfig.__slots__:
        setattr(copy, name, getattr(config, name))
    copy.group_ids = None
    return copy
