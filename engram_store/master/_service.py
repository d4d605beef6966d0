"""The master server: MasterState behind a ZeroMQ ROUTER socket."""

from __future__ import annotations

import logging
import time
from typing import Any
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from engram_store.errors import EngramError, InvalidArgument, JournalError, SegmentUnavailable, Unavailable
from engram_store.metrics import MetricsEndpoint, gauge, labels
from engram_store.wire import PROTOCOL_VERSION, AuthKeys, Connection, Request, RpcServer
from engram_store.units import parse_address
from engram_store.pages import trim_heap

from ._config import DEFAULT_PORT, MasterConfig
from ._journal import Journal
from ._records import Segment
from ._repairs import RepairJob
from ._state import MasterState

log = logging.getLogger(__name__)

MAX_KEY_LEN = 1024
MAX_BATCH = 1 << 16
MAX_MANIFEST_OBJECTS = 1 << 20
MAX_OBJECT_BYTES = 1 << 50
#: At most this many reader sockets per segment (engram-segment --readers allows 64).
MAX_READ_ADDRESSES = 256
#: A gap between two liveness checks longer than this means the master itself was not running.
STALL_GAP_S = 1.0
TICK_MS = 100
REPAIR_WORKERS = 2
REPAIR_IN_FLIGHT = 8
REPAIR_SCAN_S = 1.0
#: Objects are copied between segments in pieces of this size (below the segments' write limit).
REPAIR_CHUNK = 16 << 20
#: Keys of lost and under-replicated objects listed in a status reply (the counts are complete).
STATUS_KEYS = 20
#: How often the master hands memory freed by bursts of large messages (a flood of garbage, a register of a
#: segment with a million objects) back to the system: the allocator keeps it otherwise.
TRIM_S = 10.0
#: A change the journal refuses in the periodic work (a dead segment's drop) is tried at every tick; said this often.
JOURNAL_WARN_S = 10.0


class MasterServer:
    """Serves metadata requests; a context manager. ``start()`` serves from a thread, ``serve_forever()`` blocks."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, auth: AuthKeys | None = None,
                 config: MasterConfig | None = None, **fields: Any):
        """``config`` (a :class:`MasterConfig`), or its fields as keyword arguments (``lease_ttl_s=``, ...)."""
        config = config if config is not None else MasterConfig(host, port, **fields)
        self.config = config
        self.state = MasterState(lease_ttl_s=config.lease_ttl_s, heartbeat_timeout_s=config.heartbeat_timeout_s,
                                 reuse_delay_s=config.reuse_delay_s, put_timeout_s=config.put_timeout_s)
        self.journal = self._open_journal(config)
        self._last_tick = time.monotonic()
        self._journal_warned = -JOURNAL_WARN_S
        self._next_trim = self._last_tick + TRIM_S
        self.re_replicate = config.re_replicate
        self._rpc_timeout_ms = max(1000, int(config.heartbeat_timeout_s * 1000))
        self._repairs: dict[Future, RepairJob] = {}
        self._repair_pool = ThreadPoolExecutor(REPAIR_WORKERS, thread_name_prefix="engram-repair") \
            if config.re_replicate else None
        self._next_repair_scan = 0.0
        self._unrepairable_reported: frozenset[str] = frozenset()
        # Copies between segments (re-replication) connect to them as a client of the cluster.
        self._client_curve = auth.client_curve if auth is not None else None
        self.server, self.metrics = self._serve(config, auth)

    def _open_journal(self, config: MasterConfig) -> Journal | None:
        """Own the journal (its lock), replay it into the state and compact it; None without one."""
        if not config.journal_path:
            return None
        journal = Journal(config.journal_path, fsync=config.journal_fsync)
        try:
            records = journal.read()
            self.state.replay(records)
            journal.rewrite(self.state.snapshot())  # a journal that cannot be written is refused here, at start
        except BaseException:
            journal.release()
            raise
        self.state.journal = journal.append
        log.info("journal %s: replayed %d records: %d segments, %d objects, %d lost", config.journal_path,
                 len(records), len(self.state.segments), len(self.state.objects), len(self.state.lost))
        return journal

    def _serve(self, config: MasterConfig, auth: AuthKeys | None) -> tuple[RpcServer, MetricsEndpoint | None]:
        """Bind the master's socket (and the metrics endpoint); on failure let go of the journal."""
        handlers = {
            "ping": self._ping,
            "register_segment": self._register_segment,
            "heartbeat": self._heartbeat,
            "segment_objects": self._segment_objects,
            "offer_objects": self._offer_objects,
            "unregister_segment": self._unregister_segment,
            "put_start": self._put_start,
            "put_end": self._put_end,
            "put_renew": self._put_renew,
            "put_revoke": self._put_revoke,
            "get_replicas": self._get_replicas,
            "exist": self._exist,
            "remove": self._remove,
            "remove_many": self._remove_many,
            "list_keys": self._list_keys,
            "remove_all": self._remove_all,
            "status": self._status,
        }
        server = metrics = None
        try:
            server = RpcServer(config.host, config.port, "master", handlers, tick=self._tick, tick_ms=TICK_MS,
                               max_message_bytes=16 << 20, auth=auth, metrics_prefix="engram_master")
            if config.metrics_port is not None:
                try:
                    metrics = MetricsEndpoint(config.metrics_host, config.metrics_port)
                except OSError as exc:
                    raise Unavailable(f"metrics: cannot serve on {config.metrics_host}:{config.metrics_port}: "
                                      f"{exc}") from exc
        except BaseException:
            if server is not None:
                server.close()
            if self.journal is not None:
                self.journal.release()
            raise
        if self.journal is not None:
            self.journal.describe_owner(serving=server.address)
        return server, metrics

    @property
    def address(self) -> str:
        return self.server.address

    def start(self) -> "MasterServer":
        self.server.start()
        return self

    def serve_forever(self) -> None:
        self.server.serve_forever()

    def stop(self) -> None:
        self.server.stop()

    def close(self) -> None:
        self.server.close()
        if self.metrics is not None:
            self.metrics.close()
        if self._repair_pool is not None:
            self._repair_pool.shutdown(wait=True, cancel_futures=True)
        if self.journal is not None:
            self.journal.release()

    def __enter__(self) -> "MasterServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- periodic work --------------------------------------------------------------------------

    def _tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_trim:
            self._next_trim = now + TRIM_S
            trim_heap()
        gap = now - self._last_tick
        self._last_tick = now
        stalled = gap - TICK_MS / 1000.0 if gap > STALL_GAP_S else 0.0
        if stalled:
            log.warning("master did not run for %.1f s; not counting that time against segment heartbeats", gap)
        self._journalled(self.state.expire_segments, stalled)
        self.state.expire_puts()
        self.state.release_quarantine()
        if self._repair_pool is not None:
            self._tend_repairs(now)
        if self.metrics is not None:
            self.metrics.publish(self._metric_lines(now))

    def _journalled(self, task, *args) -> None:
        """Run a periodic task that journals; one the journal refuses is tried again at the next tick, and said
        at most every JOURNAL_WARN_S."""
        try:
            task(*args)
        except JournalError as exc:
            now = time.monotonic()
            if now >= self._journal_warned + JOURNAL_WARN_S:
                self._journal_warned = now
                log.warning("%s (trying again)", exc)

    def _metric_lines(self, now: float) -> list[str]:
        """The Prometheus exposition of the master's state and request statistics (built in the serving thread)."""
        state = self.state
        complete = [m for m in state.objects.values() if m.state == "complete"]
        clock = state.clock()
        lines = gauge("engram_master_objects", "Complete objects.", [("", len(complete))])
        lines += gauge("engram_master_object_bytes", "Bytes of complete objects (one replica each).",
                       [("", sum(m.size for m in complete))])
        lines += gauge("engram_master_pending_writes", "Writes started and not yet finished.",
                       [("", len(state.objects) - len(complete))])
        lines += gauge("engram_master_leases_active", "Objects with a live read lease.",
                       [("", sum(1 for m in complete if m.lease_until > clock))])
        lines += gauge("engram_master_under_replicated", "Objects with fewer replicas than asked for.",
                       [("", len(state.under_replicated()))])
        lines += gauge("engram_master_segments_alive", "Registered segments.", [("", len(state.segments))])
        # Segments by id; their addresses only when asked for (--metrics-addresses): the page is plain HTTP.
        named = [(labels(segment=s.segment_id, **({"address": s.address} if self.config.metrics_addresses else {})),
                  s) for s in state.segments.values()]
        lines += gauge("engram_master_segment_capacity_bytes", "Size of each segment.",
                       [(name, s.size) for name, s in named])
        lines += gauge("engram_master_segment_used_bytes", "Allocated bytes of each segment.",
                       [(name, s.allocator.used) for name, s in named])
        return lines + self.server.metrics.render()

    def _tend_repairs(self, now: float) -> None:
        """Record finished copies; start new ones for objects below their replica count."""
        for future in [f for f in self._repairs if f.done()]:
            job = self._repairs.pop(future)
            exc = future.exception()
            if exc is not None:
                log.warning("re-replication of %r to %s failed: %s", job.key, job.target_address, exc)
            if self.state.finish_repair(job, ok=exc is None):
                log.info("re-replicated %r (%d bytes) to segment %s", job.key, job.size, job.target_id)
        if now < self._next_repair_scan:
            return
        self._next_repair_scan = now + REPAIR_SCAN_S
        busy = {job.key for job in self._repairs.values()}
        for job in self.state.plan_repairs(busy, REPAIR_IN_FLIGHT - len(self._repairs)):
            future = self._repair_pool.submit(_copy_object, job, self._rpc_timeout_ms, self._client_curve)
            self._repairs[future] = job
        busy = {job.key for job in self._repairs.values()}
        unrepairable = frozenset(k for k in self.state.under_replicated() if k not in busy)
        if unrepairable and unrepairable != self._unrepairable_reported:
            log.warning("%d object(s) below their replica count with no segment to copy them to (e.g. %s)",
                        len(unrepairable), ", ".join(sorted(unrepairable)[:5]))
        self._unrepairable_reported = unrepairable

    # ---- handlers -------------------------------------------------------------------------------

    def _ping(self, req: Request) -> dict:
        return {"role": "master", "protocol": PROTOCOL_VERSION}

    def _register_segment(self, req: Request) -> dict:
        write_key = req.bytes("write_key", 64)
        if len(write_key) < 16:
            raise InvalidArgument(f"field 'write_key': expected at least 16 random bytes, got {len(write_key)}")
        damaged = _damaged_objects(req)
        known = self.state.register_segment(
            req.str("segment_id", 128), req.str("address", 512), req.int("size", 0, MAX_OBJECT_BYTES),
            req.str("shm_path", 4096, default="", allow_empty=True), req.str("host_id", 256, default="", allow_empty=True),
            req.str("public_key", 128, default="", allow_empty=True), _manifest_objects(req),
            read_addresses=_read_addresses(req), write_key=write_key, registration=req.str("registration", 64),
            held=req.ranges("held", default=[]), direct_writes=req.bool("direct_writes", default=False),
        )
        self.state.drop_damaged(req.str("segment_id", 128), damaged)
        return {"known": known, "heartbeat_interval_ms": self._heartbeat_interval_ms(),
                "verify": self.state.verification_candidates(req.str("segment_id", 128))}

    def _offer_objects(self, req: Request) -> dict:
        """A segment's answer to the ``verify`` list of its registration: the keys whose bytes matched."""
        restored = self.state.offer_verified(req.str("segment_id", 128), req.str("registration", 64),
                                             self._keys(req))
        return {"restored": restored}

    def _heartbeat_interval_ms(self) -> int:
        return int(self.state.heartbeat_timeout_s * 1000 / 4)

    def _heartbeat(self, req: Request) -> dict:
        segment = self.state.heartbeat(req.str("segment_id", 128), req.str("registration", 64),
                                       req.int_list("fenced", default=[]), req.ranges("held", default=[]),
                                       req.str("refusing_puts", 1024, default="", allow_empty=True))
        if segment is None:
            return {"known": False, "catalog": -1, "fence": []}
        return {"known": True, "catalog": segment.catalog_version, "fence": sorted(segment.fences)}

    def _segment_objects(self, req: Request) -> dict:
        version, objects = self.state.segment_objects(req.str("segment_id", 128))
        return {"catalog": version, "objects": objects}

    def _unregister_segment(self, req: Request) -> dict:
        lost = self.state.drop_segment(req.str("segment_id", 128), "shut down")
        return {"lost": lost}

    def _keys(self, req: Request) -> list[str]:
        return req.str_list("keys", MAX_BATCH, MAX_KEY_LEN)

    def _put_start(self, req: Request) -> dict:
        keys = self._keys(req)
        sizes = req.header.get("sizes")
        if not isinstance(sizes, list) or len(sizes) != len(keys):
            raise InvalidArgument(f"field 'sizes': expected a list of {len(keys)} byte counts, got {sizes!r:.80}")
        for i, size in enumerate(sizes):
            if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_OBJECT_BYTES:
                raise InvalidArgument(f"field 'sizes'[{i}]: expected an integer in [0, {MAX_OBJECT_BYTES}], got {size!r:.40}")
        if len(set(keys)) != len(keys):
            raise InvalidArgument("field 'keys': contains the same key more than once")
        replica_num = req.int("replica_num", 1, 64)
        results = []
        for key, size in zip(keys, sizes):
            try:
                placed = self.state.put_start(key, size, replica_num)
                put_id = self.state.objects[key].put_id
                results.append({"ok": True, "generation": put_id, "replicas": [
                    {**self._replica(s, o), "ticket": self.state.ticket(s, put_id, o, size),
                     "direct_writes": s.direct_writes} for s, o in placed]})
            except EngramError as exc:
                results.append({"ok": False, "code": exc.code, "message": str(exc)})
        return {"results": results, "put_timeout_ms": int(self.state.put_timeout_s * 1000)}

    def _generations(self, req: Request, keys: list[str]) -> list[int]:
        """The optional ``generations`` field: the put id of each key (0 where the writer names none)."""
        if req.header.get("generations") is None:
            return [0] * len(keys)
        generations = req.int_list("generations", MAX_BATCH)
        if len(generations) != len(keys):
            raise InvalidArgument(f"field 'generations': expected {len(keys)} put ids (one per key), got "
                                  f"{len(generations)}")
        return generations

    def _put_renew(self, req: Request) -> dict:
        keys = self._keys(req)
        return {"renewed": [self.state.put_renew(k, g) for k, g in zip(keys, self._generations(req, keys))]}

    def _put_end(self, req: Request) -> dict:
        keys = self._keys(req)
        generations = self._generations(req, keys)
        checksums = req.str_list("checksums", MAX_BATCH, 64, default=[]) if req.header.get("checksums") else []
        if checksums and len(checksums) != len(keys):
            raise InvalidArgument(f"field 'checksums': expected {len(keys)} checksums (one per key), got "
                                  f"{len(checksums)}")
        requires = req.str_list("requires", MAX_BATCH, MAX_KEY_LEN, default=[])  # objects the puts describe
        required = req.int_list("required_generations", MAX_BATCH, lo=1, default=[])
        if len(required) != len(requires):
            raise InvalidArgument(f"field 'required_generations': expected {len(requires)} put ids (one per key of "
                                  f"'requires'), got {len(required)}")
        errors = self.state.put_end_many([(key, checksums[i] if checksums else "", generations[i])
                                          for i, key in enumerate(keys)], list(zip(requires, required)))
        return {"results": [{"ok": True} if exc is None else {"ok": False, "code": exc.code, "message": str(exc)}
                            for exc in errors]}

    def _put_revoke(self, req: Request) -> dict:
        settled = req.bool("settled", default=False)
        keys = self._keys(req)
        for key, generation in zip(keys, self._generations(req, keys)):
            try:
                self.state.put_revoke(key, settled=settled, generation=generation)
            except EngramError as exc:
                log.warning("put_revoke %r: %s", key, exc)
        return {}

    def _get_replicas(self, req: Request) -> dict:
        lease = req.bool("lease", default=True)
        objects = []
        for key in self._keys(req):
            try:
                meta = self.state.get(key, lease=lease)
            except EngramError as exc:
                objects.append({"ok": False, "code": exc.code, "message": str(exc)})
                continue
            replicas = [self._replica(self.state.segments[r.segment_id], r.offset, r.generation)
                        for r in meta.replicas]
            objects.append({"ok": True, "size": meta.size, "replicas": replicas, "checksum": meta.checksum})
        return {"objects": objects, "lease_ttl_ms": int(self.state.lease_ttl_s * 1000),
                "reuse_delay_ms": int(self.state.reuse_delay_s * 1000)}

    def _exist(self, req: Request) -> dict:
        return {"exist": [self.state.exists(k) for k in self._keys(req)]}

    def _remove(self, req: Request) -> dict:
        """Remove an object; the reply names where its replicas were and the put that wrote each (``replicas``:
        ``[[address, offset, generation], ...]``), so the remover can tell those segments at once: they refuse
        reads of it from then on (their catalogues learn it on a heartbeat otherwise)."""
        replicas = self.state.remove(req.str("key", MAX_KEY_LEN), req.bool("force", default=False)) or []
        return {"replicas": self._where(replicas)}

    def _remove_many(self, req: Request) -> dict:
        """Remove ``keys`` all or nothing (see MasterState.remove_many); the reply names where each removed
        object's replicas were, as :meth:`_remove` does (``removed``: ``{key: [[address, offset, generation],
        ...]}``)."""
        keys = self._keys(req)
        removed = self.state.remove_many(keys, req.bool("force", default=False), self._generations(req, keys))
        return {"removed": {key: self._where(replicas) for key, replicas in removed.items()}}

    def _where(self, replicas: list) -> list[list]:
        """``[[address, offset, generation], ...]`` of the replicas on segments still registered."""
        segments = self.state.segments
        return [[segments[r.segment_id].address, r.offset, r.generation] for r in replicas if r.segment_id in segments]

    def _list_keys(self, req: Request) -> dict:
        """Objects by key prefix, a page at a time: ``objects`` ``[[key, size, replica_num, replicas, state,
        lease_ms], ...]`` in key order after ``after``, and ``more`` when the page was full."""
        rows, more = self.state.list_keys(req.str("prefix", MAX_KEY_LEN, default="", allow_empty=True),
                                          req.str("after", MAX_KEY_LEN, default="", allow_empty=True),
                                          req.int("limit", 1, MAX_BATCH, default=MAX_BATCH))
        return {"objects": rows, "more": more}

    def _remove_all(self, req: Request) -> dict:
        removed, refused = self.state.remove_all(req.bool("force", default=False))
        return {"removed": removed, "refused": refused}

    def _status(self, req: Request) -> dict:
        complete = [m for m in self.state.objects.values() if m.state == "complete"]
        under = self.state.under_replicated()
        return {
            "segments": [s.describe() for s in self.state.segments.values()],
            "objects": len(complete),
            "object_bytes": sum(m.size for m in complete),
            "pending": len(self.state.objects) - len(complete),
            "fencing_bytes": self.state.fencing_bytes(),
            "lease_ttl_s": self.state.lease_ttl_s,
            "heartbeat_timeout_s": self.state.heartbeat_timeout_s,
            "put_timeout_s": self.state.put_timeout_s,
            "journal": self.journal.path if self.journal else None,
            "under_replicated": len(under),
            "under_replicated_keys": sorted(under)[:STATUS_KEYS],
            "lost": len(self.state.lost),
            "lost_keys": list(self.state.lost)[-STATUS_KEYS:],
            "re_replicating": len(self._repairs),
        }

    @staticmethod
    def _replica(segment: Segment, offset: int, generation: int = 0) -> dict:
        """A replica as clients see it; ``generation`` (the put that wrote it) lets segments refuse stale reads."""
        return {"segment_id": segment.segment_id, "address": segment.address, "offset": offset,
                "shm_path": segment.shm_path, "host_id": segment.host_id, "size": segment.size,
                "public_key": segment.public_key, "read_addresses": list(segment.read_addresses),
                "generation": generation}


def _read_addresses(req: Request) -> tuple[str, ...]:
    """The optional ``read_addresses`` field of ``register_segment``: the segment's reader sockets as
    ``"host:port"`` strings (absent from segments that predate reader sockets: none)."""
    addresses = req.str_list("read_addresses", MAX_READ_ADDRESSES, 512, default=[])
    for i, address in enumerate(addresses):
        parse_address(address, f"field 'read_addresses'[{i}]")
    return tuple(addresses)


def _manifest_objects(req: Request) -> list[tuple]:
    """The optional ``objects`` field of ``register_segment``: ``[[key, offset, size, replica_num(, checksum(,
    generation))], ...]`` (the checksum, xxh3_64 in hex, is absent from manifests written before segments verified
    their objects; the generation, the id of the put that wrote them, from those written before reads named it)."""
    raw = req.header.get("objects", [])
    if not isinstance(raw, list) or len(raw) > MAX_MANIFEST_OBJECTS:
        raise InvalidArgument(f"field 'objects': expected a list of at most {MAX_MANIFEST_OBJECTS} entries, "
                              f"got {type(raw).__name__}")
    objects = []
    for i, entry in enumerate(raw):
        ok = (isinstance(entry, list) and len(entry) in (4, 5, 6) and isinstance(entry[0], str)
              and 0 < len(entry[0]) <= MAX_KEY_LEN
              and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_OBJECT_BYTES
                      for v in entry[1:4])
              and (len(entry) == 4 or isinstance(entry[4], str) and len(entry[4]) <= 64)
              and (len(entry) < 6 or isinstance(entry[5], int) and not isinstance(entry[5], bool)
                   and 0 <= entry[5] < 1 << 64))
        if not ok:
            raise InvalidArgument(f"field 'objects'[{i}]: expected [key, offset, size, replica_num, checksum, "
                                  f"generation], got {entry!r:.80}")
        objects.append(tuple(entry))
    return objects


def _damaged_objects(req: Request) -> list[tuple[str, int, int]]:
    """The optional ``damaged`` field of ``register_segment``: ``[[key, offset, generation], ...]``, objects the
    segment found no longer matching their checksums (generation 0: not known)."""
    raw = req.header.get("damaged", [])
    if not isinstance(raw, list) or len(raw) > MAX_MANIFEST_OBJECTS:
        raise InvalidArgument(f"field 'damaged': expected a list of at most {MAX_MANIFEST_OBJECTS} entries, "
                              f"got {type(raw).__name__}")
    for i, entry in enumerate(raw):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and 0 < len(entry[0]) <= MAX_KEY_LEN
                and all(type(v) is int and 0 <= v < 1 << 63 for v in entry[1:])):
            raise InvalidArgument(f"field 'damaged'[{i}]: expected [key, offset, generation], got {entry!r:.80}")
    return [(e[0], e[1], e[2]) for e in raw]


def _copy_object(job: RepairJob, timeout_ms: int, curve: tuple[bytes, bytes, bytes] | None = None) -> None:
    """Copy one object from its source segment into the reserved space on the target (a worker thread)."""
    source = Connection(job.source_address, unavailable=SegmentUnavailable, curve=curve)
    target = Connection(job.target_address, unavailable=SegmentUnavailable, curve=curve)
    try:
        for pos in range(0, max(job.size, 1), REPAIR_CHUNK):
            n = min(REPAIR_CHUNK, job.size - pos)
            if n <= 0:
                break
            _, frames = source.call("read_ranges", None,
                                    [np.array([job.source_offset + pos], dtype=np.int64),
                                     np.array([n], dtype=np.int64)], timeout_ms=timeout_ms)
            target.call("write", {"offset": job.target_offset + pos, "ticket": job.ticket}, frames[:1],
                        timeout_ms=timeout_ms)
    finally:
        source.close()
        target.close()
