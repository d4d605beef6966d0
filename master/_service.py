"""The master server: MasterState behind a ZeroMQ ROUTER socket."""

from __future__ import annotations

import logging
import time

from engram_store._errors import EngramError, InvalidArgument
from engram_store._protocol import PROTOCOL_VERSION, Request
from engram_store._transport import RpcServer

from ._journal import Journal
from ._state import MasterState, Segment

log = logging.getLogger(__name__)

DEFAULT_PORT = 50051
DEFAULT_LEASE_TTL_S = 5.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
MAX_KEY_LEN = 1024
MAX_BATCH = 1 << 16
MAX_OBJECT_BYTES = 1 << 50
#: A gap between two liveness checks longer than this means the master itself was not running.
STALL_GAP_S = 1.0
TICK_MS = 100


class MasterServer:
    """Serves metadata requests; a context manager. ``start()`` serves from a thread, ``serve_forever()`` blocks."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        journal_path: str | None = None,
        journal_fsync: bool = True,
        curve_secret_key: bytes | None = None,
    ):
        if lease_ttl_s <= 0:
            raise InvalidArgument(f"lease_ttl_s: expected > 0, got {lease_ttl_s}")
        if heartbeat_timeout_s <= 0:
            raise InvalidArgument(f"heartbeat_timeout_s: expected > 0, got {heartbeat_timeout_s}")
        self.state = MasterState(lease_ttl_s=lease_ttl_s, heartbeat_timeout_s=heartbeat_timeout_s)
        self.journal = None
        if journal_path:
            self.journal = Journal(journal_path, fsync=journal_fsync)
            records = self.journal.read()
            self.state.replay(records)
            self.journal.rewrite(self.state.snapshot())
            self.state.journal = self.journal.append
            log.info("journal %s: replayed %d records: %d segments, %d objects", journal_path, len(records),
                     len(self.state.segments), len(self.state.objects))
        self._last_tick = time.monotonic()
        handlers = {
            "ping": self._ping,
            "register_segment": self._register_segment,
            "heartbeat": self._heartbeat,
            "unregister_segment": self._unregister_segment,
            "put_start": self._put_start,
            "put_end": self._put_end,
            "put_revoke": self._put_revoke,
            "get_replicas": self._get_replicas,
            "exist": self._exist,
            "remove": self._remove,
            "remove_all": self._remove_all,
            "status": self._status,
        }
        self.server = RpcServer(host, port, "master", handlers, tick=self._tick, tick_ms=TICK_MS,
                                max_message_bytes=16 << 20, curve_secret_key=curve_secret_key)

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
        if self.journal is not None:
            self.journal.close()

    def __enter__(self) -> "MasterServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- periodic work --------------------------------------------------------------------------

    def _tick(self) -> None:
        now = time.monotonic()
        gap = now - self._last_tick
        self._last_tick = now
        stalled = gap - TICK_MS / 1000.0 if gap > STALL_GAP_S else 0.0
        if stalled:
            log.warning("master did not run for %.1f s; not counting that time against segment heartbeats", gap)
        self.state.expire_segments(running_gap_s=stalled)
        self.state.expire_puts()

    # ---- handlers -------------------------------------------------------------------------------

    def _ping(self, req: Request) -> dict:
        return {"role": "master", "protocol": PROTOCOL_VERSION}

    def _register_segment(self, req: Request) -> dict:
        known = self.state.register_segment(
            req.str("segment_id", 128), req.str("address", 512), req.int("size", 0, MAX_OBJECT_BYTES),
            req.str("shm_path", 4096, default="", allow_empty=True), req.str("host_id", 256, default="", allow_empty=True),
            req.str("public_key", 128, default="", allow_empty=True),
        )
        return {"known": known, "heartbeat_interval_ms": int(self.state.heartbeat_timeout_s * 1000 / 4)}

    def _heartbeat(self, req: Request) -> dict:
        return {"known": self.state.heartbeat(req.str("segment_id", 128))}

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
                results.append({"ok": True, "replicas": [self._replica(s, o) for s, o in placed]})
            except EngramError as exc:
                results.append({"ok": False, "code": exc.code, "message": str(exc)})
        return {"results": results}

    def _put_end(self, req: Request) -> dict:
        results = []
        for key in self._keys(req):
            try:
                self.state.put_end(key)
                results.append({"ok": True})
            except EngramError as exc:
                results.append({"ok": False, "code": exc.code, "message": str(exc)})
        return {"results": results}

    def _put_revoke(self, req: Request) -> dict:
        for key in self._keys(req):
            try:
                self.state.put_revoke(key)
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
            replicas = [self._replica(self.state.segments[r.segment_id], r.offset) for r in meta.replicas]
            objects.append({"ok": True, "size": meta.size, "replicas": replicas})
        return {"objects": objects, "lease_ttl_ms": int(self.state.lease_ttl_s * 1000)}

    def _exist(self, req: Request) -> dict:
        return {"exist": [self.state.exists(k) for k in self._keys(req)]}

    def _remove(self, req: Request) -> dict:
        self.state.remove(req.str("key", MAX_KEY_LEN), req.bool("force", default=False))
        return {}

    def _remove_all(self, req: Request) -> dict:
        removed, refused = self.state.remove_all(req.bool("force", default=False))
        return {"removed": removed, "refused": refused}

    def _status(self, req: Request) -> dict:
        complete = [m for m in self.state.objects.values() if m.state == "complete"]
        return {
            "segments": [s.describe() for s in self.state.segments.values()],
            "objects": len(complete),
            "object_bytes": sum(m.size for m in complete),
            "pending": len(self.state.objects) - len(complete),
            "lease_ttl_s": self.state.lease_ttl_s,
            "heartbeat_timeout_s": self.state.heartbeat_timeout_s,
            "journal": self.journal.path if self.journal else None,
        }

    @staticmethod
    def _replica(segment: Segment, offset: int) -> dict:
        return {"segment_id": segment.segment_id, "address": segment.address, "offset": offset,
                "shm_path": segment.shm_path, "host_id": segment.host_id, "size": segment.size,
                "public_key": segment.public_key}
