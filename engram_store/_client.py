"""DistributedStore: the native client. Metadata from the master, bytes from segment servers.

Reads prefer a replica in a segment mapped on this host (local-direct: a memory copy, no request);
otherwise the client sends one request per segment server, to all servers at once, and fails over to
another replica when a server does not answer. Writes follow Mooncake's lifecycle: ``put_start`` (the
master places replicas on distinct segments), the bytes go to every replica, ``put_end`` publishes; any
failure revokes, so a failed write leaves nothing behind.
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
import mmap
import numbers
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import xxhash
import zmq

from . import kernels as _kernels
from ._auth import AUTH_DIR_ENV, load_keys, resolve_auth_dir
from ._config import DEFAULT_EMBEDDED_SEGMENT_SIZE, StoreConfig
from ._errors import (
    ConfigError,
    EngramError,
    InvalidArgument,
    InvalidType,
    MasterUnavailable,
    ProtocolError,
    SegmentUnavailable,
    StoreError,
    Unavailable,
    WriteFenced,
    describe,
    error_from_reply,
)
from ._protocol import frame_bytes
from ._raw import VERSION as RAW_VERSION
from ._raw import RawChannel, RawChannelRefused, raw_reads_default
from ._segment import SegmentServer, host_id, pwrite_all
from ._transport import ZERO_COPY_SEND_BYTES, Connection, ConnectionPool, wait_all
from ._units import parse_size

log = logging.getLogger(__name__)

#: Size of one read message for large objects; several are kept in flight per server.
CHUNK_BYTES = 16 << 20
#: Size of one write message to a remote segment, and how many are kept in flight per segment server
#: (a sliding window). Measured with bench/bench_store.py's puts on 2-core VMs: 2-16 MiB chunks with 4-8
#: in flight move the same ~2.5 GB/s within noise, 16 MiB a little less and 32 MiB clearly less; 8 x 8
#: MiB keeps the segment's receive buffers at 64 MiB.
WRITE_CHUNK_BYTES = 8 << 20
WINDOW = 8
#: Same-host puts go into the segment file in pieces of this size (the progress callback's granularity).
LOCAL_WRITE_CHUNK_BYTES = 64 << 20
MAX_KEY_LEN = 1024
#: Replies at least this large are received without a copy (smaller ones are cheaper to copy).
ZERO_COPY_REPLY_BYTES = 64 << 10
#: After a raw read channel failed, how long the ping that looks for the segment again may take: a dead
#: segment then fails reads within this, not the full timeout; a restarted one answers with its new port.
REDISCOVERY_TIMEOUT_MS = 2000
#: A segment that did not answer that ping is not asked again for this long: reads to it fail at once (and
#: fail over to other replicas) instead of each waiting out the ping until the master drops the segment.
DEAD_HOLD_S = 2.0
#: After a segment's raw read channel refused a read (busy, or a new connection refused or closed before any
#: answer) while its ZeroMQ socket answers, this client reads from it over ZeroMQ for this long.
RAW_BACKOFF_S = 1.0
_SUSPECT = "suspect"
#: How long a put waits, at least, for segments to register with a master that has just restarted.
PUT_START_WAIT_S = 5.0
#: How long connect() waits for the master's first answer.
DEFAULT_CONNECT_TIMEOUT_MS = 3000
#: A put of at least this many bytes computes its checksums in a thread while its bytes go out.
CHECKSUM_THREAD_BYTES = 4 << 20
#: A writer renews its pending puts this many times per put timeout of the master.
RENEWALS_PER_TIMEOUT = 3


@dataclass(frozen=True)
class Replica:
    """Where one copy of an object lives.

    ``read_addresses`` are the segment's reader sockets (``read_ranges`` and ``ping`` only), empty for a
    segment without readers; ``address`` serves every operation.
    """

    segment_id: str
    address: str
    offset: int
    shm_path: str
    host_id: str
    segment_size: int
    read_addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    replicas: tuple[Replica, ...]
    #: xxh3_64 of the object's bytes (hex) as its writer computed them; "" where none was given.
    checksum: str = ""


def _replica(d: dict) -> Replica:
    return Replica(d["segment_id"], d["address"], d["offset"], d["shm_path"], d["host_id"], d["size"],
                   tuple(d.get("read_addresses") or ()))


def _check_key(key: object, name: str = "key") -> str:
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


class DistributedStore:
    """The native client of the engram store. A context manager; ``close()`` is idempotent.

    Build it with :meth:`connect` (a running master), :meth:`embedded` (master and segment inside this
    process) or :meth:`from_env`. Every call has a timeout (``timeout_ms``) and raises a
    :class:`~engram_store.StoreError` subclass on failure. With ``auth_dir`` (a key directory from
    ``engram-master keygen``) every connection, to the master and to segments, uses CURVE with its keys.
    """

    def __init__(self, master: str, *, timeout_ms: int = 10_000, local_direct: bool = True,
                 auth_dir: str | None = None, raw_reads: bool | None = None, _owned: Sequence[Any] = ()):
        self.master_address = master
        self._raw_channels: list[RawChannel] = []
        self.timeout_ms = timeout_ms
        self.local_direct = bool(local_direct)
        self.auth_dir = auth_dir or None
        self._auth = load_keys(auth_dir, server=False) if auth_dir else None
        self._pool = ConnectionPool(curve=self._auth.client_curve if self._auth else None)
        self._owned = list(_owned)  # servers this client started (mounted segment, embedded master)
        self._maps: dict[str, np.ndarray | None] = {}
        self._wfds: dict[str, int | None] = {}  # segment files open for same-host puts (None: not here)
        self._retired_fds: list[int] = []
        self._maps_lock = threading.Lock()
        self._mmaps: list[mmap.mmap] = []
        self._host_id = host_id()
        self._closed = False
        self.local_segment: SegmentServer | None = None
        self.raw_reads = raw_reads_default() if raw_reads is None else bool(raw_reads)
        self._raw_info: dict[str, tuple | str | float | None] = {}
        self._raw_backoff: dict[str, float] = {}  # address -> until when its reads go over ZeroMQ
        self._raw_local = threading.local()
        # Threads of this client spread their reads over a segment's reader sockets, from a random start so
        # that clients spread too.
        self._thread_slot = threading.local()
        self._slots = itertools.count(int.from_bytes(os.urandom(2), "little"))

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def connect(cls, master: str, segment_size: int | str = 0, *, timeout_ms: int = 10_000,
                host: str = "127.0.0.1", local_direct: bool = True, auth_dir: str | None = None,
                raw_reads: bool | None = None, connect_timeout_ms: int = DEFAULT_CONNECT_TIMEOUT_MS
                ) -> "DistributedStore":
        """Connect to the master at ``host:port``; a non-zero ``segment_size`` mounts a segment in this process.

        Data in a mounted segment lives only as long as this process; run ``engram-segment`` for
        segments that outlive clients. ``local_direct=False`` sends every read over the network even when
        the segment is mapped on this host (to measure or test the remote path). ``auth_dir`` is the key
        directory of a cluster started with ``--auth`` (default: ``$ENGRAM_AUTH_DIR``; a mounted segment then
        needs its server keys too). The master must answer within ``connect_timeout_ms``; a master that refuses
        this client's keys looks like one that does not answer (MasterUnavailable), and an address that answers
        as something else (a segment) is refused at once (ConfigError).
        """
        config = StoreConfig(master_server_address=master, global_segment_size=segment_size,
                             local_hostname=host, timeout_ms=timeout_ms,
                             auth_dir=os.fspath(auth_dir) if auth_dir else resolve_auth_dir(None) or "")
        if not isinstance(connect_timeout_ms, numbers.Integral) or isinstance(connect_timeout_ms, bool) \
                or connect_timeout_ms <= 0:
            raise InvalidArgument(f"connect_timeout_ms: expected a positive integer, got {describe(connect_timeout_ms)}")
        store = cls(config.master_server_address, timeout_ms=config.timeout_ms, local_direct=local_direct,
                    auth_dir=config.auth_dir, raw_reads=raw_reads)
        try:
            try:
                reply = store._master_call("ping", timeout_ms=int(connect_timeout_ms))
            except MasterUnavailable as exc:
                hint = (f"check that the master runs with --auth and that auth_dir={store.auth_dir!r} holds its keys"
                        if store.auth_dir else
                        f"if it runs with --auth, pass auth_dir= or set {AUTH_DIR_ENV} to its key directory")
                raise MasterUnavailable(
                    f"no engram master answered at {config.master_server_address} within "
                    f"{connect_timeout_ms / 1000:g} s ({exc}); is the address right and engram-master running "
                    f"there? {hint}") from exc
            role = reply.get("role", "master")
            if role != "master":
                raise ConfigError(f"master: {config.master_server_address} is an engram {role}, not a master; pass "
                                  "the master's HOST:PORT (engram-master prints it when it starts)")
            if config.global_segment_size:
                store._mount(config.global_segment_size, config.local_hostname)
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def embedded(cls, segment_size: int | str = DEFAULT_EMBEDDED_SEGMENT_SIZE, *, timeout_ms: int = 10_000,
                 lease_ttl_s: float = 5.0, heartbeat_timeout_s: float = 10.0,
                 local_direct: bool = True, auth_dir: str | None = None,
                 raw_reads: bool | None = None) -> "DistributedStore":
        """A master and one segment inside this process, on 127.0.0.1 ports chosen by the OS.

        The default for demos, notebooks and tests: nothing to start by hand, everything stops on close.
        With ``auth_dir`` the master and segment require CURVE keys from that directory, so other processes
        on this host need the keys too.
        """
        from master import MasterServer  # the master depends on this package, not the reverse

        size = parse_size(segment_size, "segment_size")
        if size <= 0:
            raise InvalidArgument(f"segment_size: an embedded store needs a segment of > 0 bytes, got {size}")
        server_auth = load_keys(auth_dir, server=True) if auth_dir else None
        master = MasterServer("127.0.0.1", 0, lease_ttl_s=lease_ttl_s,
                              heartbeat_timeout_s=heartbeat_timeout_s, auth=server_auth).start()
        try:
            store = cls(master.address, timeout_ms=timeout_ms, local_direct=local_direct, auth_dir=auth_dir,
                        raw_reads=raw_reads, _owned=[master])
        except BaseException:
            master.close()
            raise
        try:
            store._mount(size, "127.0.0.1")
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def from_config(cls, config: StoreConfig) -> "DistributedStore":
        if not config.master_server_address:
            return cls.embedded(config.global_segment_size or DEFAULT_EMBEDDED_SEGMENT_SIZE,
                                timeout_ms=config.timeout_ms, auth_dir=config.auth_dir or None)
        return cls.connect(config.master_server_address, config.global_segment_size,
                           timeout_ms=config.timeout_ms, host=config.local_hostname,
                           auth_dir=config.auth_dir or None)

    @classmethod
    def from_env(cls) -> "DistributedStore":
        """Build from ENGRAM_MASTER / ENGRAM_SEGMENT_SIZE / ENGRAM_AUTH_DIR / ENGRAM_CONFIG_PATH (or Mooncake's names).

        With no master configured, an embedded store is started.
        """
        return cls.from_config(StoreConfig.load_from_env())

    def _mount(self, size: int, host: str) -> None:
        auth = load_keys(self.auth_dir, server=True) if self.auth_dir else None
        segment = SegmentServer(size, self.master_address, host=host, port=0, auth=auth).start()
        self._owned.insert(0, segment)
        self.local_segment = segment
        with self._maps_lock:
            self._maps[segment.segment_id] = segment.memory.array

    @property
    def timeout_ms(self) -> int:
        """The timeout of every call, in milliseconds. It may be changed at any time; calls made after the change
        (including reads on connections already open) use the new value."""
        return self._timeout_ms

    @timeout_ms.setter
    def timeout_ms(self, value: int) -> None:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise InvalidType(f"timeout_ms: expected a positive integer, got {describe(value)}")
        if value <= 0:
            raise InvalidArgument(f"timeout_ms: expected a positive integer, got {describe(value)}")
        value = int(value)
        self._timeout_ms = value
        for channel in list(self._raw_channels):
            channel.set_timeout(value / 1000.0)

    # ---- plumbing -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

    def _master_call(self, op: str, fields: dict | None = None, timeout_ms: int | None = None) -> dict:
        self._check_open()
        conn = self._pool.get(self.master_address, MasterUnavailable)
        header, _ = conn.call(op, fields, timeout_ms=timeout_ms or self.timeout_ms)
        return header

    def _segment_conn(self, address: str) -> Connection:
        self._check_open()
        return self._pool.get(address, SegmentUnavailable)

    def ping(self) -> dict:
        """Ask the master to answer; returns its reply (raises MasterUnavailable on timeout)."""
        return self._master_call("ping")

    def status(self) -> dict:
        """The master's view: segments (address, size, used), object count and bytes."""
        header = self._master_call("status")
        return {k: v for k, v in header.items() if k not in ("v", "id", "ok")}

    def local_view(self, replica: Replica) -> np.ndarray | None:
        """The whole segment holding ``replica`` as a read-only uint8 array, if it is mapped on this host.

        A mapping outlives a killed segment process (its file stays until reaped), so reads through it keep
        returning the intact bytes until the master declares the segment dead and ``locate`` stops naming it.
        """
        if not self.local_direct:
            return None
        view = self._maps.get(replica.segment_id, False)
        if view is not False:
            return view
        with self._maps_lock:
            if replica.segment_id in self._maps:
                return self._maps[replica.segment_id]
            view = None
            if replica.host_id == self._host_id and replica.shm_path:
                try:
                    fd = os.open(replica.shm_path, os.O_RDONLY)
                    try:
                        if os.fstat(fd).st_size == replica.segment_size:
                            mm = mmap.mmap(fd, replica.segment_size, mmap.MAP_SHARED, mmap.PROT_READ)
                            self._mmaps.append(mm)
                            view = np.frombuffer(mm, dtype=np.uint8)
                    finally:
                        os.close(fd)
                except OSError as exc:
                    log.debug("segment %s not mappable here (%s); reading remotely", replica.segment_id, exc)
            self._maps[replica.segment_id] = view
            return view

    def _local_write_fd(self, replica: dict, nbytes: int) -> int | None:
        """A write descriptor of the segment file of a freshly placed replica, if that file is on this host.

        Writes to a same-host segment are then ``pwrite`` calls into its file (memory speed, no page faults
        in this process) instead of requests; the master still decides where they go, and the object stays
        invisible until ``put_end``. The file is opened once per segment and kept open.
        """
        if not self.local_direct or replica.get("host_id") != self._host_id or not replica.get("shm_path"):
            return None
        segment_id = replica["segment_id"]
        fd = self._wfds.get(segment_id, False)
        if fd is False:
            with self._maps_lock:
                fd = self._wfds.get(segment_id, False)
                if fd is False:
                    fd = None
                    try:
                        fd = os.open(replica["shm_path"], os.O_WRONLY | os.O_CLOEXEC)
                        if os.fstat(fd).st_size != replica["size"]:
                            os.close(fd)
                            fd = None
                    except OSError as exc:
                        log.debug("segment %s not writable here (%s); writing remotely", segment_id, exc)
                    self._wfds[segment_id] = fd
        if fd is None or not 0 <= replica["offset"] <= replica["size"] - nbytes:
            return None
        return fd

    def forget_segment(self, segment_id: str) -> None:
        """Stop using a mapping of a segment (after it was declared dead)."""
        with self._maps_lock:
            if self.local_segment is None or segment_id != self.local_segment.segment_id:
                self._maps.pop(segment_id, None)
            fd = self._wfds.pop(segment_id, None)
            if fd is not None:
                self._retired_fds.append(fd)  # another thread may be writing with it; closed with the client

    # ---- metadata -------------------------------------------------------------------------------

    def locate(self, keys: Sequence[str], lease: bool = True, timeout_ms: int | None = None) -> list[ObjectInfo]:
        """Replica placement of each key, in one master request (raises ObjectNotFound / ObjectLost);
        ``timeout_ms`` overrides the store's timeout for this request."""
        header = self._master_call("get_replicas", {"keys": list(keys), "lease": lease}, timeout_ms)
        out = []
        for key, obj in zip(keys, header["objects"]):
            if not obj.get("ok"):
                raise error_from_reply(obj.get("code"), obj.get("message"))
            out.append(ObjectInfo(key, obj["size"], tuple(_replica(r) for r in obj["replicas"]),
                                  str(obj.get("checksum") or "")))
        return out

    def is_exist(self, key: str) -> bool:
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> list[bool]:
        keys = [_check_key(k, f"keys[{i}]") for i, k in enumerate(keys)]
        if not keys:
            return []
        return [bool(x) for x in self._master_call("exist", {"keys": keys})["exist"]]

    def get_size(self, key: str) -> int:
        return self.locate([_check_key(key)], lease=False)[0].size

    def remove(self, key: str, force: bool = False) -> None:
        """Remove an object; refused with LeaseActive while a read lease is live, unless ``force``."""
        self._master_call("remove", {"key": _check_key(key), "force": bool(force)})

    def remove_all(self, force: bool = False) -> int:
        """Remove every object (those under a live lease only with ``force``); returns how many were removed."""
        return int(self._master_call("remove_all", {"force": bool(force)})["removed"])

    # ---- writes ---------------------------------------------------------------------------------

    def put(self, key: str, data: object, replica_num: int = 1) -> None:
        """Store ``data`` (bytes-like or a C-contiguous array) under a new key; create-only."""
        self.batch_put_from([key], [data], replica_num=replica_num)

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[object], replica_num: int = 1,
                       progress: Callable[[int], None] | None = None) -> None:
        """Store each buffer under its key, all or nothing: on any failure nothing of this call stays.

        ``progress(n)`` is called with the bytes written so far (all replicas counted once).
        """
        self.put_objects(keys, buffers, replica_num=replica_num, progress=progress)

    def put_objects(self, keys: Sequence[str], buffers: Sequence[object], replica_num: int = 1,
                    progress: Callable[[int], None] | None = None) -> list[str]:
        """:meth:`batch_put_from`, returning the xxh3_64 checksum (hex) of each object's bytes.

        The master records each checksum, so a segment that comes back after the master lost track of it (a
        restart without a journal, missed heartbeats) can prove the object intact and have it adopted again.
        Every write carries the ticket the master issued for its replica; the put is renewed with the master
        while it is written, so a writer that dies or hangs lets go of its keys after the master's put timeout,
        and a write of a put that was ended meanwhile is refused (:class:`WriteFenced`) instead of landing in
        space another object owns.
        """
        keys = [_check_key(k, f"keys[{i}]") for i, k in enumerate(keys)]
        if len(buffers) != len(keys):
            raise InvalidArgument(f"buffers: expected {len(keys)} buffers (one per key), got {len(buffers)}")
        if len(set(keys)) != len(keys):
            raise InvalidArgument("keys: the same key appears more than once")
        if not isinstance(replica_num, int) or isinstance(replica_num, bool) or replica_num < 1:
            raise InvalidArgument(f"replica_num: expected an integer >= 1, got {describe(replica_num)}")
        views = [as_bytes_view(b, f"buffers[{i}]") for i, b in enumerate(buffers)]
        if not keys:
            return []
        results, put_timeout_ms = self._put_start(keys, [v.nbytes for v in views], replica_num)
        started = [k for k, r in zip(keys, results) if r.get("ok")]
        writes = _Writes(self, started, put_timeout_ms)
        checksums: Any = None
        try:
            for result in results:
                if not result.get("ok"):
                    raise error_from_reply(result.get("code"), result.get("message"))
            # The checksums are computed while the bytes go out (xxh3 releases the GIL).
            if sum(v.nbytes for v in views) >= CHECKSUM_THREAD_BYTES:
                checksums = _checksum_pool().submit(_checksums, views)
            jobs, direct = [], []
            for view, result in zip(views, results):
                for r in result["replicas"]:
                    share = 1 / len(result["replicas"])
                    fd = self._local_write_fd(r, view.nbytes) if r.get("direct_writes") else None
                    if fd is not None and writes.open_direct(r):  # a segment file on this host: pwrite, no request
                        direct.append((fd, r, view, share))
                        continue
                    for start in range(0, view.nbytes, WRITE_CHUNK_BYTES):
                        chunk = view[start:start + WRITE_CHUNK_BYTES]
                        jobs.append((r["address"], {"offset": r["offset"] + start, "ticket": r["ticket"]}, chunk,
                                     chunk.nbytes * share))
            done = 0.0
            for fd, r, view, share in direct:
                for start in range(0, view.nbytes, LOCAL_WRITE_CHUNK_BYTES):
                    writes.renew_if_due()
                    chunk = view[start:start + LOCAL_WRITE_CHUNK_BYTES]
                    _pwrite_all(fd, chunk, r["offset"] + start, r)
                    done += chunk.nbytes * share
                    if progress is not None:
                        progress(int(done))
            self._run_writes(jobs, progress, done, writes)
            writes.close_direct()  # raises if a put was fenced while its bytes went straight into the file
            if direct:
                # A mapping outlives its segment process: make sure every segment written to directly is alive
                # before the objects are published, so a segment that died mid-write fails the put.
                self._ping_segments({r["address"] for _, r, _, _ in direct})
            sums = checksums.result() if checksums is not None else _checksums(views)
            ended = self._master_call("put_end", {"keys": keys, "checksums": sums})["results"]
            for key, result in zip(keys, ended):
                if not result.get("ok"):
                    raise error_from_reply(result.get("code"), result.get("message"))
            return sums
        except BaseException:
            writes.close_direct(quiet=True)
            self._revoke(started, settled=writes.in_flight == 0)
            if checksums is not None:
                checksums.cancel()
            raise

    def _put_start(self, keys: list[str], sizes: list[int], replica_num: int) -> tuple[list[dict], int]:
        """``put_start`` of every key; while segments are registering with a master that just restarted, the master
        asks to retry, and this does so until the timeout. Returns the per-key results and the put timeout."""
        deadline = time.monotonic() + max(self.timeout_ms / 1000.0, PUT_START_WAIT_S)
        while True:
            header = self._master_call("put_start", {"keys": keys, "sizes": sizes, "replica_num": replica_num})
            results = header["results"]
            waiting = any(not r.get("ok") and r.get("code") == SegmentUnavailable.code for r in results)
            if not waiting or time.monotonic() > deadline:
                return results, int(header.get("put_timeout_ms") or 30_000)
            self._revoke([k for k, r in zip(keys, results) if r.get("ok")], settled=True)  # nothing written yet
            time.sleep(0.05)

    def _ping_segments(self, addresses: set[str]) -> None:
        """Ping segment servers, all at once; raise SegmentUnavailable if one does not answer in time."""
        pending = []
        for address in sorted(addresses):
            conn = self._segment_conn(address)
            pending.append((conn, conn.send("ping")))
        for result in wait_all(pending, time.monotonic() + self.timeout_ms / 1000.0, "ping"):
            if isinstance(result, BaseException):
                raise result

    def _run_writes(self, jobs: list, progress: Callable[[int], None] | None, done_bytes: float,
                    writes: "_Writes") -> None:
        """Keep up to WINDOW write requests in flight per segment server, all servers at once.

        A server gets its next chunk as soon as one of its writes is answered (whichever server answers
        first), so no pipe drains between batches and a slow server does not hold up a fast one. Replies on
        one connection come in the order its requests went out. ``writes.in_flight`` counts the requests sent and
        not yet answered (on failure, a revoke frees the space at once only when none is left).
        """
        queues: dict[str, deque] = {}
        for job in jobs:
            queues.setdefault(job[0], deque()).append(job)
        in_flight: dict[str, deque] = {address: deque() for address in queues}  # (request id, weight, deadline)
        conns = {address: self._segment_conn(address) for address in queues}
        timeout_s = self.timeout_ms / 1000.0
        poller = zmq.Poller()
        waiting: dict[Any, str] = {}  # socket -> address, for servers with writes in flight

        def fill(address: str) -> None:
            queue, sent, conn = queues[address], in_flight[address], conns[address]
            while queue and len(sent) < WINDOW:
                _, fields, chunk, weight = queue.popleft()
                writes.in_flight += 1
                sent.append((conn.send("write", fields, [chunk]), weight, time.monotonic() + timeout_s))
            if sent and conn.socket not in waiting:
                waiting[conn.socket] = address
                poller.register(conn.socket, zmq.POLLIN)

        for address in queues:
            fill(address)
        while waiting:
            writes.renew_if_due()
            deadline = min(in_flight[a][0][2] for a in waiting.values())
            ready = dict(poller.poll(max(0, int((min(deadline, writes.next_renewal) - time.monotonic()) * 1000))))
            if not ready and time.monotonic() < deadline:
                continue  # woke up to renew the put
            addresses = [waiting[sock] for sock in ready] or [min(waiting.values(), key=lambda a: in_flight[a][0][2])]
            for address in addresses:
                conn = conns[address]
                request_id, weight, request_deadline = in_flight[address][0]
                sock = conn.socket
                try:
                    conn.recv(request_id, request_deadline, "write")  # raises on an error reply or past the deadline
                except EngramError as exc:
                    if not isinstance(exc, Unavailable):
                        writes.in_flight -= 1  # answered, with an error
                    raise
                in_flight[address].popleft()
                writes.in_flight -= 1
                done_bytes += weight
                if not in_flight[address] and not queues[address]:
                    poller.unregister(sock)
                    del waiting[sock]
                else:
                    fill(address)
            if progress is not None:
                progress(int(done_bytes))

    def _revoke(self, keys: list[str], settled: bool = False) -> None:
        """Give up unfinished puts. ``settled``: every write sent for them was answered (none can land later), so
        the master frees their space at once; otherwise it fences them first."""
        if not keys:
            return
        try:
            self._master_call("put_revoke", {"keys": keys, "settled": bool(settled)})
        except EngramError as exc:
            log.warning("could not revoke %d unfinished write(s) (the master frees them after its put "
                        "timeout): %s", len(keys), exc)

    # ---- reads ----------------------------------------------------------------------------------

    def get(self, key: str, lease: bool = True) -> bytes:
        """The bytes stored under ``key``; ``lease=False`` reads without taking a read lease."""
        info = self.locate([_check_key(key)], lease=lease)[0]
        out = np.empty(info.size, dtype=np.uint8)
        self.read_object(info, out)
        return out.tobytes()

    def get_into(self, key: str, buffer: object) -> int:
        """Copy the object into ``buffer`` (at least as large as the object); returns the byte count."""
        dst = as_bytes_view(buffer, "buffer", writable=True)
        info = self.locate([_check_key(key)])[0]
        if dst.nbytes < info.size:
            raise InvalidArgument(f"buffer: object {key!r} is {info.size} bytes, the buffer holds {dst.nbytes}")
        self.read_object(info, dst[:info.size])
        return info.size

    def read_object(self, info: ObjectInfo, dst: np.ndarray) -> None:
        """Read a whole object in CHUNK_BYTES pieces (so large objects span several requests in flight)."""
        work = []
        for start in range(0, info.size, CHUNK_BYTES):
            offsets = np.array([start], dtype=np.int64)
            lengths = np.array([min(CHUNK_BYTES, info.size - start)], dtype=np.int64)
            work.append((info, offsets, lengths, dst, offsets))
        self.read_into(work)

    def get_into_ranges(self, buffers: Sequence[object], all_keys: Sequence[Sequence[str]],
                        all_dst_offsets: Sequence, all_src_offsets: Sequence, all_sizes: Sequence) -> list:
        """Mooncake's ranged read: for each buffer i and key j, copy ranges of the object into buffer i.

        ``all_dst_offsets[i][j][k]`` / ``all_src_offsets[i][j][k]`` / ``all_sizes[i][j][k]`` describe range k
        of key j for buffer i. Returns the same nesting with the bytes copied per range. All keys are
        located in one master request; all segment servers are read at once.
        """
        n = len(buffers)
        for name, seq in (("all_keys", all_keys), ("all_dst_offsets", all_dst_offsets),
                          ("all_src_offsets", all_src_offsets), ("all_sizes", all_sizes)):
            if len(seq) != n:
                raise InvalidArgument(f"{name}: expected {n} entries (one per buffer), got {len(seq)}")
        dsts = [as_bytes_view(b, f"buffers[{i}]", writable=True) for i, b in enumerate(buffers)]
        unique = sorted({_check_key(k, "all_keys") for keys in all_keys for k in keys})
        infos = dict(zip(unique, self.locate(unique))) if unique else {}
        work = []
        result = []
        for i, keys in enumerate(all_keys):
            if not (len(all_dst_offsets[i]) == len(all_src_offsets[i]) == len(all_sizes[i]) == len(keys)):
                raise InvalidArgument(f"buffer {i}: expected one offset/size list per key ({len(keys)} keys)")
            per_key = []
            for j, key in enumerate(keys):
                dst_off = np.asarray(all_dst_offsets[i][j], dtype=np.int64).reshape(-1)
                src_off = np.asarray(all_src_offsets[i][j], dtype=np.int64).reshape(-1)
                sizes = np.asarray(all_sizes[i][j], dtype=np.int64).reshape(-1)
                if not (dst_off.size == src_off.size == sizes.size):
                    raise InvalidArgument(f"buffer {i}, key {key!r}: offsets and sizes differ in length")
                info = infos[key]
                bad = _kernels.check_ranges(src_off, sizes, info.size)
                if bad >= 0:
                    raise InvalidArgument(f"all_src_offsets[{i}][{j}][{bad}]: range ({int(src_off[bad])}, "
                                          f"{int(sizes[bad])}) is outside object {key!r} of {info.size} bytes")
                bad = _kernels.check_ranges(dst_off, sizes, dsts[i].nbytes)
                if bad >= 0:
                    raise InvalidArgument(f"all_dst_offsets[{i}][{j}][{bad}]: range ({int(dst_off[bad])}, "
                                          f"{int(sizes[bad])}) is outside buffer {i} of {dsts[i].nbytes} bytes")
                work.append((info, src_off, sizes, dsts[i], dst_off))
                per_key.append(sizes.tolist())
            result.append(per_key)
        self.read_into(work)
        return result

    def read_into(self, work: list) -> None:
        """Copy ranges of objects into buffers: ``work`` holds ``(info, src_offsets, sizes, dst, dst_offsets)``.

        Local-direct replicas are copied from the mapping; the rest is grouped by segment server, one
        request per server, all in flight at once; ranges whose server fails are retried on the next replica.
        """
        attempt = [0] * len(work)
        pending = list(range(len(work)))
        failed: set[str] = set()
        while pending:
            groups: dict[str, list[int]] = {}
            for w in pending:
                info = work[w][0]
                replica = self._choose(info, failed, attempt[w])
                if replica is None:
                    tried = ", ".join(sorted(r.address for r in info.replicas))
                    raise SegmentUnavailable(f"object {info.key!r}: no replica could be read (tried {tried})")
                view = self.local_view(replica)
                if view is not None:
                    src_off = work[w][1] + replica.offset
                    _copy_local(view, src_off, work[w][2], work[w][3], work[w][4])
                else:
                    groups.setdefault(replica.address, []).append(w)
            pending = []
            if not groups:
                break
            for address, failed_items in self._read_remote(work, groups, failed):
                failed.add(address)
                for w in failed_items:
                    attempt[w] += 1
                pending.extend(failed_items)

    def _choose(self, info: ObjectInfo, failed: set[str], attempt: int) -> Replica | None:
        live = [r for r in info.replicas if r.address not in failed]
        if not live:
            return None
        for r in live:
            if self.local_view(r) is not None:
                return r
        return live[(hash(info.key) + attempt) % len(live)]

    # ---- the read path: the raw channel where the segment offers it, else ZeroMQ ---------------------

    def read_endpoints(self, replica: Replica) -> tuple[str, ...]:
        """The addresses that serve reads of ``replica``'s segment: its reader sockets, else its main address."""
        return replica.read_addresses or (replica.address,)

    def pick_endpoint(self, endpoints: Sequence[str]) -> str:
        """One of a segment's read endpoints for the calling thread: threads (and clients) spread over them."""
        if len(endpoints) == 1:
            return endpoints[0]
        slot = getattr(self._thread_slot, "value", None)
        if slot is None:
            slot = self._thread_slot.value = next(self._slots)
        return endpoints[slot % len(endpoints)]

    def _raw_channel(self, address: str) -> RawChannel | None:
        """This thread's raw read channel to the segment at ``address``, or None to read over ZeroMQ.

        The segment's raw port is learnt once, from a ping; with CURVE keys each new connection first fetches
        a one-time token over ZeroMQ. A channel that fails is dropped, and the port asked again next time
        (a restarted segment listens on a new one).
        """
        if not self.raw_reads:
            return None
        channels = getattr(self._raw_local, "channels", None)
        if channels is None:
            channels = self._raw_local.channels = {}
        channel = channels.get(address)
        if channel is not None:
            return channel
        if self._raw_backoff and self._raw_backoff.get(address, 0.0) > time.monotonic():
            return None  # the channel refused a read a moment ago: ZeroMQ for now
        info = self._raw_info.get(address, False)
        if isinstance(info, float):  # did not answer the rediscovery ping at that time
            if time.monotonic() - info < DEAD_HOLD_S:
                raise SegmentUnavailable(f"read_ranges: {address} did not answer a ping "
                                         f"{time.monotonic() - info:.1f} s ago; not asked again before {DEAD_HOLD_S} s")
            info = _SUSPECT
        if info is False or info is _SUSPECT:
            # After a failure the segment may be dead (ask briefly) or restarted on a new port (ask again).
            timeout_ms = self.timeout_ms if info is False else min(self.timeout_ms, REDISCOVERY_TIMEOUT_MS)
            try:
                info = self._raw_info_from(address, self._segment_conn(address).call("ping", timeout_ms=timeout_ms)[0])
            except SegmentUnavailable:
                if info is _SUSPECT:
                    with self._maps_lock:
                        self._raw_info[address] = time.monotonic()
                raise
            except EngramError:
                info = None
            with self._maps_lock:
                self._raw_info[address] = info
        if info is None:
            return None
        host, port, needs_token = info

        def token() -> str:
            return str(self._segment_conn(address).call("channel_token", timeout_ms=self.timeout_ms)[0]["token"])

        channel = channels[address] = RawChannel(address, host, port, token if needs_token else None,
                                                 timeout_s=self.timeout_ms / 1000.0)
        with self._maps_lock:
            self._raw_channels.append(channel)
        return channel

    @staticmethod
    def _raw_info_from(address: str, ping: dict) -> tuple | None:
        """(host, port, needs_token) of the raw channel a segment's ping reply offers, or None to read over ZeroMQ
        (no channel, or one of another version)."""
        port = int(ping.get("raw_port") or 0)
        if not port:
            return None
        version = ping.get("raw_version", 1)
        if version != RAW_VERSION:
            log.warning("%s serves raw read channel version %s, this client speaks version %d: reading from it "
                        "over ZeroMQ", address, version, RAW_VERSION)
            return None
        return address.rpartition(":")[0].strip("[]"), port, bool(ping.get("raw_token"))

    def _close_raw(self, address: str) -> None:
        """Close and forget this thread's raw channel to ``address``."""
        channels = getattr(self._raw_local, "channels", None)
        channel = channels.pop(address, None) if channels is not None else None
        if channel is not None:
            channel.close()
            with self._maps_lock:
                if channel in self._raw_channels:
                    self._raw_channels.remove(channel)

    def _drop_raw(self, address: str) -> None:
        """After a failed read: close the channel, and look for the segment again (a ping) before the next one."""
        self._close_raw(address)
        with self._maps_lock:
            if isinstance(self._raw_info.get(address), tuple):
                self._raw_info[address] = _SUSPECT

    def _raw_refused(self, address: str, exc: RawChannelRefused) -> None:
        """``address``'s raw channel refused a read: read from it over ZeroMQ for RAW_BACKOFF_S. A busy answer
        comes from a live segment; after a refused or closed connection a ping tells a live segment (read it over
        ZeroMQ, or over the raw port it now names) from a gone one (SegmentUnavailable, as a failed read)."""
        self._close_raw(address)
        if not exc.busy:
            try:
                ping = self._segment_conn(address).call(
                    "ping", timeout_ms=min(self.timeout_ms, REDISCOVERY_TIMEOUT_MS))[0]
            except SegmentUnavailable as gone:
                with self._maps_lock:
                    self._raw_info[address] = time.monotonic()
                raise SegmentUnavailable(f"{exc}, and it did not answer a ping over ZeroMQ either") from gone
            info = self._raw_info_from(address, ping)
            with self._maps_lock:
                moved = info != self._raw_info.get(address)
                self._raw_info[address] = info
            if moved:
                return  # restarted on another port (or without the channel): the next read goes by the ping
        log.debug("%s; reading from it over ZeroMQ for %g s", exc, RAW_BACKOFF_S)
        with self._maps_lock:
            self._raw_backoff[address] = time.monotonic() + RAW_BACKOFF_S

    def _send_read(self, endpoint: str, pairs: np.ndarray, deadline: float) -> tuple[Any, int]:
        """Send a ``read_ranges`` of ``pairs`` to ``endpoint``, over its raw channel where it has one, else over
        ZeroMQ; returns the link it went on and the request id, for :meth:`_recv_read`."""
        channel = self._raw_channel(endpoint)
        if channel is not None:
            try:
                return channel, channel.send_read(pairs, deadline)
            except RawChannelRefused as exc:
                if exc.first:
                    self._raw_refused(endpoint, exc)
        conn = self._segment_conn(endpoint)
        return conn, conn.send_frames("read_ranges", (pairs,), copy=pairs.nbytes < ZERO_COPY_SEND_BYTES)

    def _recv_read(self, link: Any, endpoint: str, request_id: int, expected: int, deadline: float,
                   out: np.ndarray | None = None) -> Any:
        """The reply to a :meth:`_send_read`: ``expected`` bytes, in ``out`` if given (a flat writable uint8
        array), else in the raw channel's buffer (until its next read) or a received frame."""
        if isinstance(link, RawChannel):
            try:
                return link.recv_read(request_id, expected, deadline, out)
            except RawChannelRefused as exc:  # read it over ZeroMQ, with the full timeout from now
                pairs = exc.pairs
                if exc.first:  # (not again for the reads sent after it on that connection)
                    self._raw_refused(endpoint, exc)
                deadline = time.monotonic() + self.timeout_ms / 1000.0
                link = self._segment_conn(endpoint)
                request_id = link.send_frames("read_ranges", (pairs,), copy=pairs.nbytes < ZERO_COPY_SEND_BYTES)
        _, frames = link.recv(request_id, deadline, "read_ranges", copy=expected < ZERO_COPY_REPLY_BYTES)
        data = frame_bytes(frames[0]) if frames else None
        if data is None or len(data) != expected:
            raise ProtocolError(f"read_ranges: {endpoint} sent {0 if data is None else len(data)} bytes, "
                                f"expected {expected}")
        if out is None:
            return data
        out[:expected] = np.frombuffer(data, dtype=np.uint8)
        return out

    def read_pairs(self, endpoint: str, pairs: np.ndarray, expected: int, out: np.ndarray | None = None) -> Any:
        """One ``read_ranges`` of ``pairs`` (int64 ``[R, 2]``, C-contiguous) from ``endpoint``: the gathered bytes
        (``expected`` of them; over the raw channel they live in its buffer until its next read), or ``out`` (a
        flat writable uint8 array of that size) filled with them. The lookup's hot path when one server holds
        every remote head; raises on failure (``out`` may then hold part of a reply)."""
        self._check_open()
        deadline = time.monotonic() + self.timeout_ms / 1000.0
        try:
            link, request_id = self._send_read(endpoint, pairs, deadline)
            return self._recv_read(link, endpoint, request_id, expected, deadline, out)
        except SegmentUnavailable:
            self._drop_raw(endpoint)
            raise

    def read_pairs_many(self, requests: Sequence[tuple[str, np.ndarray]], outs: Sequence[Any] | None = None) -> list:
        """Send one ``read_ranges`` per ``(endpoint, pairs)`` (int64 ``[R, 2]`` byte offset and length), all at
        once; wait for every reply.

        Returns, aligned with ``requests``, the gathered bytes or the exception of that request; it does not
        raise for one server's failure, so the caller can fail over per server. ``outs[i]`` (a flat writable
        uint8 array of the reply's size, or None) receives reply i in place; the entry returned is then ``outs[i]``.
        """
        self._check_open()
        timeout_s = self.timeout_ms / 1000.0
        sent: list = [None] * len(requests)
        used: set[int] = set()
        # Servers whose channel is ready go first: looking for a segment after a failure (a ping) must not hold
        # up the reads of healthy ones. Each request gets the full timeout from when it is sent.
        ready = getattr(self._raw_local, "channels", None) or {}
        order = sorted(range(len(requests)), key=lambda i: requests[i][0] not in ready
                       and not isinstance(self._raw_info.get(requests[i][0], False), tuple))
        for i in order:
            endpoint, pairs = requests[i]
            deadline = time.monotonic() + timeout_s
            pairs = np.ascontiguousarray(pairs)
            expected = int(pairs[:, 1].sum()) if pairs.size else 0
            out = outs[i] if outs is not None else None
            try:
                link, request_id = self._send_read(endpoint, pairs, deadline)
            except SegmentUnavailable as exc:
                self._drop_raw(endpoint)
                sent[i] = exc
                continue
            if isinstance(link, RawChannel):
                if out is None and id(link) in used:  # the channel's buffer holds an earlier reply
                    out = np.empty(expected, dtype=np.uint8)
                used.add(id(link))
            sent[i] = (link, request_id, expected, out, deadline)
        result = []
        for item, (endpoint, _) in zip(sent, requests):
            if isinstance(item, BaseException):
                result.append(item)
                continue
            link, request_id, expected, out, deadline = item
            try:
                result.append(self._recv_read(link, endpoint, request_id, expected, deadline, out))
            except EngramError as exc:
                if isinstance(exc, SegmentUnavailable):
                    self._drop_raw(endpoint)
                result.append(exc)
        return result

    def _read_remote(self, work: list, groups: dict[str, list[int]], failed: set[str]):
        """Read grouped work items, one request per server (split past the reply limit); yield failures."""
        requests = []  # (address, items, offsets, lengths)
        for address, items in groups.items():
            batch, offs, lens, total = [], [], [], 0
            for w in items:
                info, src_off, sizes = work[w][0], work[w][1], work[w][2]
                replica = next(r for r in info.replicas if r.address == address)
                nbytes = int(sizes.sum())
                if batch and total + nbytes > CHUNK_BYTES:
                    requests.append((address, batch, np.concatenate(offs), np.concatenate(lens)))
                    batch, offs, lens, total = [], [], [], 0
                batch.append(w)
                offs.append(src_off + replica.offset)
                lens.append(sizes)
                total += nbytes
            requests.append((address, batch, np.concatenate(offs), np.concatenate(lens)))
        outs = []
        for _, items, _, lens in requests:
            # A request for one range of one item (a chunk of a whole object) lands straight in its destination.
            if len(items) == 1 and lens.size == 1:
                dst, dst_off = work[items[0]][3], work[items[0]][4]
                outs.append(dst[int(dst_off[0]):int(dst_off[0]) + int(lens[0])])
            else:
                outs.append(None)
        replies = self.read_pairs_many([(a, np.stack((o, n), axis=1)) for a, _, o, n in requests], outs)
        failures: dict[str, list[int]] = {}
        for (address, items, _, _), reply, out in zip(requests, replies, outs):
            if isinstance(reply, BaseException):
                if not isinstance(reply, SegmentUnavailable):
                    raise reply
                log.warning("read from %s failed (%s); trying other replicas", address, reply)
                failures.setdefault(address, []).extend(items)
                continue
            if out is not None:
                continue  # already in place
            data = np.frombuffer(reply, dtype=np.uint8)
            pos = 0
            for w in items:
                sizes, dst, dst_off = work[w][2], work[w][3], work[w][4]
                n = int(sizes.sum())
                _kernels.scatter_ranges(data[pos:pos + n], dst, dst_off, sizes)
                pos += n
        yield from failures.items()

    # ---- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close connections, stop any segment or master this client started; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._pool.close()
        with self._maps_lock:
            channels, self._raw_channels = self._raw_channels, []
        for channel in channels:
            channel.close()
        with self._maps_lock:
            self._maps.clear()
            fds = [fd for fd in self._wfds.values() if fd is not None] + self._retired_fds
            self._wfds.clear()
            self._retired_fds = []
        for fd in fds:
            os.close(fd)
        master_owned = any(not isinstance(server, SegmentServer) for server in self._owned)
        for server in self._owned:
            try:
                if isinstance(server, SegmentServer):
                    # With the master going too, unregistering would only log the loss of every object.
                    server.close(unregister=not master_owned)
                else:
                    server.close()
            except Exception:
                log.exception("closing %r failed", server)
        for mm in self._mmaps:
            try:
                mm.close()
            except BufferError:
                pass  # an array still views it; the GC unmaps it later
        self._mmaps.clear()

    def __enter__(self) -> "DistributedStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"DistributedStore(master={self.master_address!r}, {state})"


class _Writes:
    """One put call's dealings beside the bytes: renewing its pending keys with the master, the same-host writers it
    opened at segments (see :mod:`engram_store._fence`), and how many write requests are still unanswered."""

    def __init__(self, store: DistributedStore, keys: list[str], put_timeout_ms: int):
        self.store = store
        self.keys = keys
        self.interval_s = max(0.05, put_timeout_ms / 1000.0 / RENEWALS_PER_TIMEOUT)
        self.next_renewal = time.monotonic() + self.interval_s
        self.in_flight = 0
        self.opened: list[dict] = []

    def renew_if_due(self) -> None:
        """Tell the master the keys are still being written, when it is time; raise WriteFenced if it ended them."""
        now = time.monotonic()
        if now < self.next_renewal or not self.keys:
            return
        self.next_renewal = now + self.interval_s
        try:
            renewed = self.store._master_call("put_renew", {"keys": self.keys})["renewed"]
        except MasterUnavailable as exc:
            self.next_renewal = now + min(self.interval_s, 1.0)
            log.warning("could not renew %d pending put(s) with the master (%s); trying again", len(self.keys), exc)
            return
        ended = [k for k, ok in zip(self.keys, renewed) if not ok]
        if ended:
            raise WriteFenced(f"put of {ended[0]!r}: the master ended it while it was being written (it expired, "
                              "was removed with force, or the master restarted); nothing of it is published")

    def open_direct(self, replica: dict) -> bool:
        """Tell a same-host segment that this process writes the replica straight into its file; False when the
        segment cannot watch this process (then the replica is written through requests)."""
        conn = self.store._segment_conn(replica["address"])
        try:
            conn.call("write_open", {"ticket": replica["ticket"], "pid": os.getpid()}, timeout_ms=self.store.timeout_ms)
        except (InvalidArgument, ProtocolError) as exc:
            log.debug("segment %s takes no direct writes from this process (%s); writing through requests",
                      replica["segment_id"], exc)
            return False
        self.opened.append(replica)
        return True

    def close_direct(self, quiet: bool = False) -> None:
        """Tell the segments the direct writes are done; raise WriteFenced if a put was fenced meanwhile (``quiet``:
        after a failure, best effort)."""
        opened, self.opened = self.opened, []
        fenced = []
        for replica in opened:
            try:
                header, _ = self.store._segment_conn(replica["address"]).call(
                    "write_close", {"ticket": replica["ticket"]}, timeout_ms=self.store.timeout_ms)
                if header.get("fenced"):
                    fenced.append(replica)
            except EngramError:
                if not quiet:
                    raise
        if fenced and not quiet:
            raise WriteFenced(f"segment {fenced[0]['segment_id']} fenced a put while its bytes were being written "
                              "(it expired, was removed with force, or the master restarted); nothing of it is "
                              "published")


_CHECKSUM_POOL: ThreadPoolExecutor | None = None
_CHECKSUM_POOL_LOCK = threading.Lock()


def _checksum_pool() -> ThreadPoolExecutor:
    global _CHECKSUM_POOL
    with _CHECKSUM_POOL_LOCK:
        if _CHECKSUM_POOL is None:
            _CHECKSUM_POOL = ThreadPoolExecutor(1, thread_name_prefix="engram-checksum")
        return _CHECKSUM_POOL


def _checksums(views: Sequence[np.ndarray]) -> list[str]:
    """xxh3_64 of each object's bytes, in hex (about 11 GB/s, with the GIL released)."""
    return [xxhash.xxh3_64_hexdigest(v) for v in views]


def _pwrite_all(fd: int, chunk: np.ndarray, offset: int, replica: dict) -> None:
    """Write all of ``chunk`` at ``offset`` of a same-host segment's file; a failure is the segment's."""
    try:
        pwrite_all(fd, chunk, offset)
    except OSError as exc:
        raise SegmentUnavailable(f"write of {chunk.nbytes} bytes at offset {offset} into segment "
                                 f"{replica['segment_id']} ({replica['shm_path']}): {exc.strerror or exc}") from exc


def _copy_local(view: np.ndarray, src_off: np.ndarray, sizes: np.ndarray, dst: np.ndarray,
                dst_off: np.ndarray) -> None:
    """Copy ranges of a mapped segment straight into a destination buffer."""
    if sizes.size == 1:
        s, n, d = int(src_off[0]), int(sizes[0]), int(dst_off[0])
        dst[d:d + n] = view[s:s + n]
        return
    tmp = np.empty(int(sizes.sum()), dtype=np.uint8)
    _kernels.gather_ranges(view, src_off, sizes, tmp)
    _kernels.scatter_ranges(tmp, dst, dst_off, sizes)
