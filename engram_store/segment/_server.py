"""The segment server: owns one memory segment and serves writes and batched range reads.

By default the segment is anonymous shared memory (a memfd sealed against shrinking), which it hands to clients on
the same host as descriptors over a Unix socket (``_handover``), so they map it read-only and read with no request at
all ("local-direct"). Every offset and length a request carries is checked against the segment before any byte
moves.

Reads are served by the main socket and by ``readers`` reader threads, each with a ROUTER socket of its own
(registered with the master as the segment's ``read_addresses``); all gather from one read-only view of the
mapping with a kernel that releases the GIL. Writes go into the segment's file with ``pwrite`` rather than
through the mapping, so they never pay page faults; a background thread prefaults the mapping at start so
the first reads do not either.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np

from .. import kernels as _kernels
from ..errors import (
    ConfigError,
    EngramError,
    InvalidArgument,
    JournalError,
    MasterUnavailable,
    ProtocolError,
    RemoteError,
    describe,
    is_int,
)
from ..raw import VERSION as RAW_VERSION, RawReadServer
from ..wire import (PROTOCOL_VERSION, AuthKeys, Connection, Request, RpcServer, frame_array, frame_bytes,
                    io_threads)
from ._catalog import Catalog
from ._fence import WriteFence
from ._generations import Generations
from ._handover import MemoryHandover, start_handover
from ._memory import SegmentMemory, host_id
from ._readers import DEFAULT_READERS, MAX_READERS, READERS_MIN_CPUS, default_readers  # noqa: F401 (exported)

log = logging.getLogger(__name__)

#: A single read reply may carry at most this many bytes; clients split larger reads.
MAX_READ_BYTES = 256 << 20
#: A single write request may carry at most this many bytes; clients split larger writes.
MAX_WRITE_BYTES = 64 << 20
MAX_RANGES = 1 << 22
#: At most this many objects per catalog_add / catalog_drop request (a writer's batch of puts).
MAX_CATALOG_ENTRIES = 1 << 16
#: A single-range read at least this long is sent from the segment memory without a gather copy.
ZERO_COPY_BYTES = 1 << 20
#: After a failed heartbeat, the next one goes out this soon (or at the usual interval, if shorter).
RETRY_HEARTBEAT_S = 0.25


class SegmentServer:
    """One memory segment behind a ROUTER socket, registered with (and heartbeating to) a master.

    The main socket (``address``) serves everything: writes, reads and pings. ``readers`` reader threads
    (default :func:`default_readers`: 2, or 1 on a host with fewer than 4 CPUs; 0 for none) each bind a
    ROUTER socket of their own on the same host (ports ``port + 1 ...`` when ``port`` is given, else any free
    ports), serve ``read_ranges``, ``ping`` and ``channel_token`` only, and are registered with the master as
    ``read_addresses``; with ``auth`` they require the same CURVE keys as the main socket. They stop with the
    segment. With ``raw_reads`` (default) it also serves range reads on a plain TCP port, the raw read channel
    (:mod:`engram_store.raw`), holding at most ``raw_max_connections`` connections (default its MAX_CONNECTIONS).

    A context manager; :meth:`close` unregisters from the master, stops serving and lets go of its memory (and
    its hand-over socket). Use :meth:`start` to serve from a background thread (a segment mounted in a client
    process), or :meth:`serve_forever` to serve from the calling thread (the ``engram-segment`` CLI).
    """

    def __init__(
        self,
        size: int,
        master: str | None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        segment_id: str | None = None,
        register_timeout_s: float = 30.0,
        rpc_timeout_ms: int = 5000,
        file: str | None = None,
        auth: AuthKeys | None = None,
        readers: int | None = None,
        raw_reads: bool = True,
        raw_max_connections: int | None = None,
    ):
        readers = default_readers() if readers is None else readers
        if not is_int(readers) or not 0 <= readers <= MAX_READERS:
            raise InvalidArgument(f"readers: expected an integer in [0, {MAX_READERS}], got {readers!r}")
        # A durable segment owns its file (SegmentFiles) and keeps the identity its manifest records.
        self.catalog = Catalog.open(file, size, segment_id)
        self.files, self.segment_id = self.catalog.files, self.catalog.segment_id
        self.fence = WriteFence(self.segment_id)
        self.master_address = master
        # With auth: serve as a CURVE server, and reach the master as a client of the cluster.
        self._master_curve = auth.client_curve if auth is not None else None
        self._rpc_timeout_ms = rpc_timeout_ms
        self._register_timeout_s = register_timeout_s
        self.heartbeat_interval_s = 1.0
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._prefault_thread: threading.Thread | None = None
        self._closed = False
        self.generations: Generations | None = None
        self.handover: MemoryHandover | None = None
        self._damaged: list[list] = []  # [key, offset, generation] found damaged at rest, until the master hears
        self.server: RpcServer | None = None
        self._readers: list[RpcServer] = []
        self.raw: RawReadServer | None = None
        self.memory: SegmentMemory | None = None
        try:
            self.memory = SegmentMemory(size) if self.files is None else \
                SegmentMemory(size, self.files.path, keep_file=True, directory=self.files.dir)
            self._open_memory()
            self._bind(host, port, auth, readers, raw_reads, raw_max_connections)
            if self.files is not None:
                self.files.serving(self.segment_id, self.address)
            if master is not None:
                self._register(deadline=time.monotonic() + register_timeout_s)
        except BaseException:
            self._close_servers()
            self._release_memory()
            raise

    def _open_memory(self) -> None:
        """The segment's generation table, the hand-over of its memory to this host's processes, the read-only view
        reads gather from, and the thread that faults the mapping in."""
        # Which put wrote which range: checked by every read that names its objects, and published in a shared
        # table for readers on this host; a durable segment's objects as its manifest lists them. A durable
        # segment keeps its table in a file beside its own for its next run, which takes it over in place.
        table = {"table_path": self.memory.path + ".gen", "directory": self.files.dir} if self.files else {}
        self.generations = Generations(f"engram-generations-{os.getpid()}", self.size, **table)
        self.generations.seed(self.catalog.objects)
        self.handover = start_handover(self.segment_id, self.size, self.memory.fd, self.generations.table_fd,
                                       writable=not self.catalog.durable)
        # Reads gather from one read-only view of the mapping, built once; the mapping is faulted in the
        # background, so the first reads do not page-fault and start-up does not wait.
        self._src = _kernels.readonly(self.memory.array)
        self._prefault_thread = threading.Thread(target=self.memory.prefault, args=(self._stop,), daemon=True,
                                                 name=f"engram-prefault-{self.segment_id[:8]}")
        self._prefault_thread.start()

    def _bind(self, host: str, port: int, auth: AuthKeys | None, readers: int, raw_reads: bool,
              raw_max_connections: int | None) -> None:
        """The main socket, the reader sockets and the raw read channel."""
        # With two ZeroMQ I/O threads (engram-segment starts them when it has readers), the main socket's
        # traffic (large writes) goes through one and the readers' through the other, so reads do not queue
        # behind the bytes of a populate. Without, every socket shares the one I/O thread.
        main_io, read_io = (1, 2) if readers and io_threads() >= 2 else (0, 0)
        name = f"segment {self.segment_id[:8]}"
        max_bytes = MAX_WRITE_BYTES + (1 << 20)
        self.server = RpcServer(host, port, name, {"ping": self._ping, "write": self._write,
                                                   "write_open": self._write_open,
                                                   "write_close": self._write_close,
                                                   "read_ranges": self._read_ranges,
                                                   "channel_token": self._channel_token,
                                                   "catalog_add": self._catalog_add,
                                                   "catalog_drop": self._catalog_drop},
                                max_message_bytes=max_bytes, auth=auth, io_affinity=main_io)
        # Readers hand out raw-channel tokens too: a client asks the endpoint it reads from, and a reader's
        # socket requires the same CURVE keys as the main one.
        read_handlers = {"ping": self._ping, "read_ranges": self._read_ranges, "channel_token": self._channel_token}
        for i in range(readers):
            self._readers.append(RpcServer(host, port + 1 + i if port else 0, f"{name} reader {i}", read_handlers,
                                           max_message_bytes=max_bytes, auth=auth, io_affinity=read_io))
        if raw_reads:
            # Range reads on a plain TCP port as well (see _raw): lookups at the network stack's speed.
            self.raw = RawReadServer(host, self.memory.array, max_ranges=MAX_RANGES, max_bytes=MAX_READ_BYTES,
                                     require_token=auth is not None, name=name, metrics=self.server.metrics,
                                     max_connections=raw_max_connections, generations=self.generations)

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def read_addresses(self) -> list[str]:
        """``host:port`` of each reader thread's socket (``read_ranges``, ``ping`` and ``channel_token`` only)."""
        return [reader.address for reader in self._readers]

    @property
    def size(self) -> int:
        return self.memory.size

    # ---- master registration and heartbeats ------------------------------------------------------

    def _register(self, deadline: float) -> None:
        """Register with the master under a new write key (every ticket issued before is dead from now on),
        offering back the objects this segment still holds and can prove intact."""
        registration, key = self.fence.new_registration()
        objects, damaged = self.catalog.verified(self.memory.array)
        if damaged:  # refused to readers from now on, and told to the master until it has heard
            self.generations.drop([(offset, generation) for _, offset, generation in damaged])
            self._damaged += damaged
        conn = Connection(self.master_address, unavailable=MasterUnavailable, curve=self._master_curve)
        delay = 0.05
        warned = False
        try:
            while True:
                # Short attempts: a master that is not there yet (or at all) is said so at once, not after minutes.
                attempt_ms = max(50, min(self._rpc_timeout_ms, 2000, int((deadline - time.monotonic()) * 1000)))
                try:
                    header, _ = conn.call("register_segment", {
                        "segment_id": self.segment_id, "address": self.address, "size": self.size,
                        "read_addresses": self.read_addresses, "host_id": host_id(),
                        "shm_path": self.handover.path if self.handover is not None else "",
                        "public_key": self._master_curve[0].decode() if self._master_curve else "",
                        "objects": objects, "write_key": key, "registration": registration,
                        "held": self.fence.held(), "direct_writes": not self.catalog.durable,
                        "damaged": self._damaged,
                    }, timeout_ms=attempt_ms)
                    self._damaged = []
                    self.heartbeat_interval_s = max(0.05, header.get("heartbeat_interval_ms", 1000) / 1000.0)
                    log.info("segment %s registered with master %s (%d object(s) offered back)", self.segment_id,
                             self.master_address, len(objects))
                    self._answer_verify(conn, registration, header.get("verify") or [])
                    return
                except ProtocolError as exc:
                    raise ConfigError(f"segment {self.segment_id}: {self.master_address} is not an engram master "
                                      f"({self._what_answers(conn)}): {exc}; pass the master's HOST:PORT") from None
                except (MasterUnavailable, JournalError) as exc:  # the latter: it cannot record the registration
                    journal = isinstance(exc, JournalError)
                    if time.monotonic() + delay > deadline:
                        raise exc if journal else MasterUnavailable(
                            f"segment {self.segment_id}: master {self.master_address} did not answer "
                            f"within {self._register_timeout_s:g} s (is the address right, and is engram-master "
                            "running there?)") from None
                    if not warned:
                        warned = True
                        log.warning("segment %s: master %s %s; trying again for up to %.1f s%s", self.segment_id,
                                    self.master_address, f"could not record it ({exc})" if journal else
                                    "does not answer yet", max(0.0, deadline - time.monotonic()), "" if journal else
                                    " (is the address right, and is engram-master running there?)")
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
        finally:
            conn.close()

    def _answer_verify(self, conn: Connection, registration: str, candidates: list) -> None:
        """Check the objects the master asks about (lost ones: this segment was dropped before its catalogue named
        them; or ones its journal places here that the catalogue does not list) and tell it which are intact, still
        the object of the put it names; it keeps lost ones' space reserved until it hears back."""
        if not candidates:
            return
        keys = self.catalog.matching(self.memory.array, [c for c in candidates if self.generations is None
                                                         or not self.generations.disowns(c)])
        try:
            header, _ = conn.call("offer_objects", {"segment_id": self.segment_id, "registration": registration,
                                                    "keys": keys}, timeout_ms=self._rpc_timeout_ms)
        except EngramError as exc:
            log.warning("segment %s: could not tell master %s which of %d lost object(s) it holds intact: %s",
                        self.segment_id, self.master_address, len(candidates), exc)
            return
        log.info("segment %s: %d of %d lost object(s) the master asked about were intact; %d restored",
                 self.segment_id, len(keys), len(candidates), header.get("restored", 0))

    @staticmethod
    def _what_answers(conn: Connection) -> str:
        try:
            role = conn.call("ping", timeout_ms=2000)[0].get("role", "?")
        except EngramError as exc:
            return f"its ping failed: {exc}"
        return f"it answers as an engram {role}"

    def _heartbeat_loop(self) -> None:
        conn = Connection(self.master_address, unavailable=MasterUnavailable, curve=self._master_curve)
        wait_s = self.heartbeat_interval_s
        try:
            while not self._stop.wait(wait_s):
                wait_s = self.heartbeat_interval_s
                try:
                    fields = {**self.fence.heartbeat_fields(), "refusing_puts": self.catalog.unwritable[:1024]}
                    header, _ = conn.call("heartbeat", {"segment_id": self.segment_id, **fields},
                                          timeout_ms=max(200, int(self.heartbeat_interval_s * 1000)))
                    if not header.get("known", False):
                        log.warning("segment %s: master %s does not know this registration of the segment (it "
                                    "restarted, or dropped the segment); registering again", self.segment_id,
                                    self.master_address)
                        self._register(deadline=time.monotonic() + self._register_timeout_s)
                        wait_s = 0.0  # report the held writers and fetch the catalogue at once
                        continue
                    self.fence.acknowledged(fields["fenced"])
                    fence = header.get("fence") or []
                    if fence:
                        self.fence.fence(fence)
                        wait_s = 0.0  # acknowledge at once: the master frees the space only then
                    if header.get("catalog") != self.catalog.version or self.catalog.unwritable:
                        self._sync_catalog(conn)
                except EngramError as exc:
                    log.warning("segment %s: heartbeat to %s failed: %s", self.segment_id, self.master_address, exc)
                    # Ask again soon: a master that restarts has no segment to place puts on until this one
                    # registers with it again.
                    wait_s = min(self.heartbeat_interval_s, RETRY_HEARTBEAT_S)
                except Exception:  # a bug: heartbeats must go on, or the master drops a live segment
                    log.exception("segment %s: heartbeat failed", self.segment_id)
                    wait_s = min(self.heartbeat_interval_s, RETRY_HEARTBEAT_S)
        finally:
            conn.close()

    def _sync_catalog(self, conn: Connection) -> None:
        """Fetch this segment's catalogue from the master and keep it (a file-backed segment flushes its data and
        writes its manifest)."""
        header, _ = conn.call("segment_objects", {"segment_id": self.segment_id}, timeout_ms=self._rpc_timeout_ms)
        if self.catalog.durable:
            self.memory.flush()
        self.catalog.record(int(header["catalog"]), header["objects"])
        self.generations.seed(header["objects"])
        log.debug("segment %s: catalogue holds %d objects (version %d)", self.segment_id,
                  len(self.catalog.objects), self.catalog.version)

    # ---- handlers -------------------------------------------------------------------------------

    def _ping(self, req: Request) -> dict:
        # raw_stats: the raw channel's connections, refusals and deadlines (RawReadServer.stats).
        return {"role": "segment", "segment_id": self.segment_id, "size": self.size, "protocol": PROTOCOL_VERSION,
                "catalog": self.catalog.version, "registration": self.fence.registration,
                "raw_port": self.raw.port if self.raw is not None else 0, "raw_version": RAW_VERSION,
                "raw_token": self.raw is not None and self.raw.require_token,
                "raw_stats": self.raw.stats() if self.raw is not None else {}}

    def _channel_token(self, req: Request) -> dict:
        """A one-time token for the raw read channel (asked over ZeroMQ, so CURVE decides who gets one)."""
        if self.raw is None:
            raise InvalidArgument("channel_token: this segment serves reads over ZeroMQ only (--no-raw-reads)")
        return {"raw_port": self.raw.port, "token": self.raw.issue_token()}

    def _write(self, req: Request) -> dict:
        offset = req.int("offset", 0, self.size)
        ticket = req.bytes("ticket", 256)
        if len(req.frames) != 1:
            raise InvalidArgument(f"write: expected exactly 1 data frame, got {len(req.frames)}")
        data = frame_bytes(req.frames[0])
        if data.nbytes > self.size - offset:
            raise InvalidArgument(
                f"write: {data.nbytes} bytes at offset {offset} end past the segment's {self.size} bytes")
        put_id, start, size = self.fence.check(ticket, offset, data.nbytes)
        self.catalog.check_writable(self.segment_id)  # a put its next start would not offer back: none taken
        self.generations.claim(start, size, put_id)  # before any byte lands: readers of what was here are refused
        try:
            self.memory.write(offset, data)
        except OSError as exc:
            raise RemoteError(f"write: {data.nbytes} bytes at offset {offset} of segment {self.segment_id}: "
                              f"{exc.strerror or exc}") from exc
        return {"written": data.nbytes}

    def _write_open(self, req: Request) -> dict:
        """A writer on this host will write its put straight into the segment's file (see :mod:`._fence`)."""
        if self.catalog.durable:
            raise InvalidArgument(f"write_open: segment {self.segment_id} keeps its bytes in a file that outlives "
                                  "it; write through requests")
        put_id, offset, size = self.fence.open_direct(req.bytes("ticket", 256), req.int("pid", 1, 1 << 31))
        self.generations.claim(offset, size, put_id)  # the writer writes straight into the file from now on
        return {"offset": offset, "size": size}

    def _catalog_add(self, req: Request) -> dict:
        """A writer published objects written here: ``objects`` ``[[key, offset, size, replica_num, checksum,
        ticket], ...]``, each ticket this segment's own for exactly that range, whose put is still its latest writer.
        Kept in the catalogue at once, so a master restarted without a journal before the next heartbeat learns them
        from this segment all the same."""
        raw = req.header.get("objects")
        if not isinstance(raw, list) or len(raw) > MAX_CATALOG_ENTRIES:
            raise InvalidArgument(f"catalog_add: field 'objects': expected a list of at most {MAX_CATALOG_ENTRIES} "
                                  f"entries, got {type(raw).__name__}")
        entries = []
        for i, entry in enumerate(raw):
            ok = (isinstance(entry, list) and len(entry) == 6 and isinstance(entry[0], str) and entry[0]
                  and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entry[1:4])
                  and isinstance(entry[4], str) and isinstance(entry[5], (bytes, bytearray)))
            if not ok:
                raise InvalidArgument(f"catalog_add: field 'objects'[{i}]: expected [key, offset, size, replica_num, "
                                      f"checksum, ticket], got {entry!r:.80}")
            fields = self.fence.ticket_of(bytes(entry[5]))
            if fields is None or fields[1:] != (entry[1], entry[2]) or not self.generations.holds(*fields):
                continue  # not this registration's, or another put wrote there since: the master's list decides
            entries.append([entry[0], entry[1], entry[2], entry[3], entry[4], fields[0]])
        if entries and self.catalog.durable:
            self.memory.flush()  # the manifest never names bytes that are not on disk
        return {"added": self.catalog.add(entries)}

    def _catalog_drop(self, req: Request) -> dict:
        """Objects removed from here: ``objects`` ``[[key, offset, generation], ...]`` (the generation, the put
        that wrote the object, may be left out), dropped from the catalogue at once; each named with its put is
        marked removed in the generation record, so reads naming it are refused from now on."""
        raw = req.header.get("objects")
        if not isinstance(raw, list) or len(raw) > MAX_CATALOG_ENTRIES or not all(
                isinstance(e, list) and len(e) in (2, 3) and isinstance(e[0], str) and type(e[1]) is int
                and (len(e) == 2 or type(e[2]) is int) for e in raw):
            raise InvalidArgument(f"catalog_drop: field 'objects': expected a list of at most {MAX_CATALOG_ENTRIES} "
                                  f"[key, offset] or [key, offset, generation] entries, got {describe(raw)}")
        dropped = self.catalog.drop(raw)
        if self.generations is not None:
            self.generations.drop([(e[1], e[2]) for e in raw if len(e) == 3])
        return {"dropped": dropped}

    def _write_close(self, req: Request) -> dict:
        """The writer's direct writes are done; ``fenced``: the put was fenced meanwhile (do not publish it)."""
        return {"fenced": self.fence.close_direct(req.bytes("ticket", 256))}

    def _read_ranges(self, req: Request) -> tuple[dict, list]:
        """Gather byte ranges: one frame of int64 ``[R, 2]`` (offset, length) pairs, or the older two frames
        (offsets, lengths). Served by the main socket and every reader thread at once."""
        frames = req.frames
        if len(frames) == 1:
            buf = frame_bytes(frames[0])
            if buf.nbytes % 16:
                raise InvalidArgument(f"read_ranges: pairs frame of {buf.nbytes} bytes: expected a whole number "
                                      "of int64 (offset, length) pairs (16 bytes each)")
            pairs = np.frombuffer(buf, dtype=np.int64).reshape(-1, 2)
        elif len(frames) == 2:
            offsets = frame_array(frames[0], np.int64, "offsets")
            lengths = frame_array(frames[1], np.int64, "lengths", count=offsets.size)
            pairs = np.stack((offsets, lengths), axis=1)
        else:
            raise InvalidArgument(f"read_ranges: expected 1 frame (int64 [R, 2] offset, length pairs) or 2 frames "
                                  f"(offsets, lengths), got {len(frames)}")
        checked, version = pairs, 0
        if pairs.shape[0] and pairs[0, 0] < 0:
            pairs, version = self.generations.split(pairs, self.address)
        count = pairs.shape[0]
        if count > MAX_RANGES:
            raise InvalidArgument(f"read_ranges: at most {MAX_RANGES} ranges per request, got {count}")
        if count == 0:
            return {"bytes": 0}, [b""]
        lengths = pairs[:, 1]
        if lengths.min() < 0:
            bad = int(np.argmax(lengths < 0))
            raise InvalidArgument(f"read_ranges: range {bad} length: expected >= 0, got {int(lengths[bad])}")
        # Non-negative lengths of ranges the kernel checks against a segment far below 2**63 / MAX_RANGES
        # bytes: a sum that wrapped around int64 implies a range outside the segment, which the kernel refuses.
        total = int(lengths.sum())
        if not 0 <= total <= MAX_READ_BYTES:
            raise InvalidArgument(f"read_ranges: total length: expected at most {MAX_READ_BYTES} bytes per "
                                  f"request, got {total if total >= 0 else 'more than 2**63'}")
        if count == 1 and total >= ZERO_COPY_BYTES:
            # One long range (a chunk of a large object) goes out straight from the segment, no gather copy.
            start = int(pairs[0, 0])
            if not 0 <= start <= self.size - total:
                raise InvalidArgument(f"read_ranges: range 0 (offset {start}, length {total}) is outside the "
                                      f"segment of {self.size} bytes")
            if checked is not pairs:  # sent without a copy: a later write would change what goes out
                out = np.array(self._src[start:start + total])
                self.generations.recheck(checked, version, self.address)
                return {"bytes": total}, [out]
            return {"bytes": total}, [memoryview(self._src[start:start + total])]
        out = np.empty(total, dtype=np.uint8)
        bad = _kernels.gather_pairs(self._src, pairs, out, total)
        if bad >= 0:
            raise InvalidArgument(f"read_ranges: range {bad} (offset {int(pairs[bad, 0])}, length "
                                  f"{int(pairs[bad, 1])}) is outside the segment of {self.size} bytes")
        if checked is not pairs:
            self.generations.recheck(checked, version, self.address)
        return {"bytes": total}, [out]

    # ---- lifecycle ------------------------------------------------------------------------------

    def _start_heartbeats(self) -> None:
        if self.master_address is not None and self._heartbeat_thread is None:
            self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                                      name=f"engram-heartbeat-{self.segment_id[:8]}")
            self._heartbeat_thread.start()

    def _start_helpers(self) -> None:
        """Start what serves beside the main socket: heartbeats, reader threads, the raw read channel."""
        self._start_heartbeats()
        for reader in self._readers:
            if reader._thread is None:
                reader.start()
        if self.raw is not None:
            self.raw.start()

    def start(self) -> "SegmentServer":
        self._start_helpers()
        self.server.start()
        return self

    def serve_forever(self) -> None:
        self._start_helpers()
        self.server.serve_forever()

    def stop(self) -> None:
        self.server.stop()

    def _close_servers(self) -> None:
        """Stop and close the reader threads' sockets and the main socket (each join is bounded)."""
        for reader in self._readers:
            reader.stop()
        if self.server is not None:
            self.server.stop()
        for reader in self._readers:
            reader.close()
        if self.raw is not None:
            self.raw.close()
        if self.server is not None:
            self.server.close()

    def _release_memory(self) -> None:
        self._stop.set()
        if self._prefault_thread is not None:
            self._prefault_thread.join()  # at most one madvise chunk: the mapping must outlive it
        self._src = None
        if self.handover is not None:
            self.handover.close()
        if self.memory is not None:
            self.memory.close()
        if self.generations is not None:
            self.generations.close()
        if self.files is not None:
            self.files.close()  # the owner lock last: nothing of the files is open now

    def close(self, unregister: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=5)
        if self.catalog.durable and self.master_address is not None:
            # A durable segment stays registered: its objects are back as soon as it restarts on its file.
            unregister = False
            conn = Connection(self.master_address, unavailable=MasterUnavailable, curve=self._master_curve)
            try:
                self._sync_catalog(conn)
            except EngramError as exc:
                log.warning("segment %s: final manifest sync failed (%s); the manifest may lag the master",
                            self.segment_id, exc)
            finally:
                conn.close()
        if unregister and self.master_address is not None:
            conn = Connection(self.master_address, unavailable=MasterUnavailable, curve=self._master_curve)
            try:
                conn.call("unregister_segment", {"segment_id": self.segment_id}, timeout_ms=1000)
            except EngramError as exc:
                log.info("segment %s: could not unregister from %s: %s", self.segment_id, self.master_address, exc)
            finally:
                conn.close()
        self._close_servers()
        self._release_memory()
        self.fence.close()

    def __enter__(self) -> "SegmentServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
