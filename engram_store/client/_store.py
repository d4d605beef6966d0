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
import numbers
import os
import threading
import time
from typing import Any, Sequence


from .. import _fork
from .._config import DEFAULT_EMBEDDED_SEGMENT_SIZE, StoreConfig
from ..errors import (
    ConfigError,
    EngramError,
    InvalidArgument,
    InvalidType,
    MasterUnavailable,
    SegmentUnavailable,
    StoreError,
    describe,
    error_from_reply,
    is_int,
)
from ..units import parse_size
from ..raw import RawRoutes, raw_reads_default
from ..segment import SegmentServer, host_id
from ._embedded import start_master
from ..wire import AUTH_DIR_ENV, Connection, ConnectionPool, load_keys, resolve_auth_dir, wait_all
from ._local_segments import LocalSegments
from ._objects import KeyInfo, ObjectInfo, check_key, replica_of
from ._reads import ReadPath
from ._writes import WritePath

log = logging.getLogger("engram_store.client")

#: How long connect() waits for the master's first answer.
DEFAULT_CONNECT_TIMEOUT_MS = 3000


class DistributedStore(ReadPath, WritePath):
    """The native client of the engram store. A context manager; ``close()`` is idempotent.

    Build it with :meth:`connect` (a running master), :meth:`embedded` (master and segment inside this
    process) or :meth:`from_env`. Every call has a timeout (``timeout_ms``) and raises a
    :class:`~engram_store.StoreError` subclass on failure. With ``auth_dir`` (a key directory from
    ``engram-master keygen``) every connection, to the master and to segments, uses CURVE with its keys.
    """

    def __init__(self, master: str, *, timeout_ms: int = 10_000, local_direct: bool = True,
                 auth_dir: str | None = None, raw_reads: bool | None = None, _owned: Sequence[Any] = ()):
        self.master_address = master
        #: The raw read channels: where each segment's listens, and those this client's threads hold open.
        self.raw_routes = RawRoutes(timeout_ms / 1000.0)
        self.timeout_ms = timeout_ms
        #: The master's reuse delay (its replies say it): how long a removed object's space stays unused, so how
        #: long a placement may be trusted without asking again.
        self.reuse_delay_s = 2.0
        self.local_direct = bool(local_direct)
        self.auth_dir = auth_dir or None
        self._auth = load_keys(auth_dir, server=False) if auth_dir else None
        self._pool = ConnectionPool(curve=self._auth.client_curve if self._auth else None)
        self._owned = list(_owned)  # servers this client started (mounted segment, embedded master)
        #: This host's segment files, mapped for local-direct reads and opened for same-host writes.
        self.local_segments = LocalSegments(host_id())
        self._closed = False
        self.local_segment: SegmentServer | None = None
        self.raw_reads = raw_reads_default() if raw_reads is None else bool(raw_reads)
        # Threads of this client spread their reads over a segment's reader sockets, from a random start so
        # that clients spread too.
        self._thread_slot = threading.local()
        self._slots = itertools.count(int.from_bytes(os.urandom(2), "little"))
        _fork.in_child(self._forked)

    def _forked(self) -> None:
        """In a child forked from the process that connected: the parent's connections, raw channels and servers
        stay the parent's (never closed from here); this process connects afresh on first use (see ``_fork``)."""
        _fork.keep(self._pool, self.raw_routes, self._owned)
        self._pool = ConnectionPool(curve=self._auth.client_curve if self._auth else None)
        self.raw_routes = RawRoutes(self.timeout_ms / 1000.0)
        self._owned = []  # the parent's master and segment: the parent stops them
        self.local_segment = None
        self.local_segments.forked()

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
        size = parse_size(segment_size, "segment_size")
        if size <= 0:
            raise InvalidArgument(f"segment_size: an embedded store needs a segment of > 0 bytes, got {size}")
        master = start_master(auth_dir, lease_ttl_s=lease_ttl_s, heartbeat_timeout_s=heartbeat_timeout_s)
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
        self.local_segments.adopt(segment.segment_id, segment.memory.array, segment.generations.table)

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
        self.raw_routes.set_timeout(value / 1000.0)

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

    def forget_segment(self, segment_id: str) -> None:
        """Stop using a mapping of a segment (after it was declared dead)."""
        mine = self.local_segment is not None and segment_id == self.local_segment.segment_id
        self.local_segments.forget(segment_id, keep_mapping=mine)

    # ---- metadata -------------------------------------------------------------------------------

    def locate(self, keys: Sequence[str], lease: bool = True, timeout_ms: int | None = None) -> list[ObjectInfo]:
        """Replica placement of each key, in one master request (raises ObjectNotFound / ObjectLost);
        ``timeout_ms`` overrides the store's timeout for this request."""
        header = self._master_call("get_replicas", {"keys": list(keys), "lease": lease}, timeout_ms)
        if "reuse_delay_ms" in header:
            self.reuse_delay_s = max(0.0, float(header["reuse_delay_ms"]) / 1000.0)
        out = []
        for key, obj in zip(keys, header["objects"]):
            if not obj.get("ok"):
                raise error_from_reply(obj.get("code"), obj.get("message"))
            out.append(ObjectInfo(key, obj["size"], tuple(replica_of(r) for r in obj["replicas"]),
                                  str(obj.get("checksum") or "")))
        return out

    def is_exist(self, key: str) -> bool:
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> list[bool]:
        keys = [check_key(k, f"keys[{i}]") for i, k in enumerate(keys)]
        if not keys:
            return []
        return [bool(x) for x in self._master_call("exist", {"keys": keys})["exist"]]

    def get_size(self, key: str) -> int:
        return self.locate([check_key(key)], lease=False)[0].size

    def remove(self, key: str, force: bool = False) -> None:
        """Remove an object; refused with LeaseActive while a read lease is live, unless ``force``."""
        header = self._master_call("remove", {"key": check_key(key), "force": bool(force)})
        self._tell_dropped({key: header.get("replicas") or []})

    def remove_many(self, keys: Sequence[str], force: bool = False,
                    generations: Sequence[int] | None = None) -> list[str]:
        """Remove several objects all or nothing: while a read lease (or, without ``force``, a write in progress)
        holds any of them, none is removed and LeaseActive names it. Absent keys are skipped; returns the keys
        removed. ``generations`` (one per key, from :meth:`put_generations`) removes only the objects those puts
        wrote: a key holding another put's object is skipped like an absent one."""
        keys = [check_key(k, f"keys[{i}]") for i, k in enumerate(keys)]
        request: dict = {"keys": keys, "force": bool(force)}
        if generations is not None:
            generations = list(generations)
            if len(generations) != len(keys) or not all(is_int(g) and g > 0 for g in generations):
                raise InvalidArgument(f"generations: expected {len(keys)} put ids > 0 (one per key), got "
                                      f"{describe(generations)}")
            request["generations"] = [int(g) for g in generations]
        if not keys:
            return []
        removed = self._master_call("remove_many", request)["removed"]
        self._tell_dropped(removed)
        return [k for k in keys if k in removed]

    def _tell_dropped(self, removed: dict) -> None:
        """Tell the segments that held removed objects at once, naming the put that wrote each: they refuse reads
        of them from then on (readers holding an older placement learn of the remove at their next read), and
        their catalogues drop them (else learnt on a heartbeat; a master restarted without a journal meanwhile would
        bring the objects back). Best effort."""
        by_segment: dict[str, list] = {}
        for key, replicas in removed.items():
            for address, offset, *generation in replicas:  # (a master before generations names none)
                by_segment.setdefault(address, []).append([key, offset, *generation[:1]])
        pending = []
        for address, objects in by_segment.items():
            try:
                conn = self._segment_conn(address)
                pending.append((conn, conn.send("catalog_drop", {"objects": objects})))
            except EngramError:
                pass
        if pending:
            wait_all(pending, time.monotonic() + min(self.timeout_ms / 1000.0, 1.0), "catalog_drop")

    def list_keys(self, prefix: str = "", limit: int | None = None) -> list[KeyInfo]:
        """The objects whose key starts with ``prefix``, in key order (complete, being written, or lost), in pages
        of at most 65,536 per master request; at most ``limit`` of them."""
        if not isinstance(prefix, str):
            raise InvalidType(f"prefix: expected a string, got {type(prefix).__name__}")
        out: list[KeyInfo] = []
        after = ""
        while limit is None or len(out) < limit:
            header = self._master_call("list_keys", {"prefix": prefix, "after": after})
            out += [KeyInfo(k, size, replica_num, replicas, state, lease_ms / 1000.0)
                    for k, size, replica_num, replicas, state, lease_ms in header["objects"]]
            if not header.get("more") or not header["objects"]:
                break
            after = header["objects"][-1][0]
        return out if limit is None else out[:limit]

    def remove_all(self, force: bool = False) -> int:
        """Remove every object (those under a live lease only with ``force``); returns how many were removed."""
        return int(self._master_call("remove_all", {"force": bool(force)})["removed"])

    # ---- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close connections, stop any segment or master this client started; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._pool.close()
        self.raw_routes.close_all()
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
        self.local_segments.close()

    def __enter__(self) -> "DistributedStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"DistributedStore(master={self.master_address!r}, {state})"
