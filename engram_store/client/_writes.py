"""The write path of :class:`DistributedStore`: puts placed by the master, fenced by tickets, renewed while written.

Writes follow Mooncake's lifecycle: ``put_start`` (the master places replicas on distinct segments and hands a
ticket per replica), the bytes go to every replica (``pwrite`` into a segment file on this host, else write
requests, several in flight per server), ``put_end`` publishes with each object's checksum; any failure
revokes, so a failed write leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import xxhash
import zmq

from ..errors import (
    CatalogUnwritable,
    EngramError,
    InvalidArgument,
    MasterUnavailable,
    ProtocolError,
    SegmentUnavailable,
    Unavailable,
    WriteFenced,
    describe,
    error_from_reply,
    is_int,
)
from ..pools import SharedPool
from ..segment import pwrite_all
from ..wire import wait_all
from ._objects import as_bytes_view, check_key

log = logging.getLogger("engram_store.client")

#: Size of one write message to a remote segment, and how many are kept in flight per segment server
#: (a sliding window). Measured with bench/bench_store.py's puts on 2-core VMs: 2-16 MiB chunks with 4-8
#: in flight move the same ~2.5 GB/s within noise, 16 MiB a little less and 32 MiB clearly less; 8 x 8
#: MiB keeps the segment's receive buffers at 64 MiB.
WRITE_CHUNK_BYTES = 8 << 20
WINDOW = 8
#: Same-host puts go into the segment file in pieces of this size (the progress callback's granularity).
LOCAL_WRITE_CHUNK_BYTES = 64 << 20
#: How long a put waits, at least, for segments to register with a master that has just restarted.
PUT_START_WAIT_S = 5.0
#: A put of at least this many bytes computes its checksums in a thread while its bytes go out.
CHECKSUM_THREAD_BYTES = 4 << 20
#: A writer renews its pending puts this many times per put timeout of the master.
RENEWALS_PER_TIMEOUT = 3
#: How long a put, once published, waits for its segments to add the objects to their catalogues.
CATALOG_TELL_S = 1.0
#: After a segment refused a put's write (it cannot keep its catalogue), the put is placed again this late, until
#: the master has heard (a heartbeat) and places it elsewhere, for as long as a put waits for segments at most.
REFUSED_RETRY_S = 0.1


class WritePath:
    """The writes of a :class:`DistributedStore` (a mixin: the store holds the connections and open files)."""

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
        """:meth:`batch_put_from`, returning the xxh3_64 checksum (hex) of each object's bytes (see
        :meth:`put_generations`)."""
        return self.put_generations(keys, buffers, replica_num=replica_num, progress=progress)[0]

    def put_generations(self, keys: Sequence[str], buffers: Sequence[object], replica_num: int = 1,
                        progress: Callable[[int], None] | None = None, *,
                        requires: Sequence[tuple[str, int]] = ()) -> tuple[list[str], list[int]]:
        """:meth:`batch_put_from`, returning the xxh3_64 checksum (hex) of each object's bytes and its generation
        (the id of the put that wrote it): ``remove_many(keys, generations=...)`` removes those objects and never
        one another writer put under the same key since.

        The master records each checksum, so a segment that comes back after the master lost track of it (a
        restart without a journal, missed heartbeats) can prove the object intact and have it adopted again.
        Every write carries the ticket the master issued for its replica; the put is renewed with the master
        while it is written, so a writer that dies or hangs lets go of its keys after the master's put timeout,
        and a write of a put that was ended meanwhile is refused (:class:`WriteFenced`) instead of landing in
        space another object owns.

        ``requires``: ``(key, generation)`` of published objects these describe (a layer's heads, for its manifest):
        the master publishes these only while every one is still the object that put wrote, checked with the
        publication; otherwise nothing is published and WriteFenced is raised.
        """
        keys = [check_key(k, f"keys[{i}]") for i, k in enumerate(keys)]
        if len(buffers) != len(keys):
            raise InvalidArgument(f"buffers: expected {len(keys)} buffers (one per key), got {len(buffers)}")
        if len(set(keys)) != len(keys):
            raise InvalidArgument("keys: the same key appears more than once")
        if not is_int(replica_num) or replica_num < 1:
            raise InvalidArgument(f"replica_num: expected an integer >= 1, got {describe(replica_num)}")
        views = [as_bytes_view(b, f"buffers[{i}]") for i, b in enumerate(buffers)]
        requires = _check_requires(requires)
        if not keys:
            return [], []
        deadline = time.monotonic() + max(self.timeout_ms / 1000.0, PUT_START_WAIT_S)
        while True:
            try:
                return self._put(keys, views, replica_num, progress, requires)
            except _Refused as refused:  # (revoked): the master places the put elsewhere once it has heard
                if time.monotonic() > deadline:
                    raise refused.error from None
                log.info("put of %d key(s) refused by a segment (%s); placing it again", len(keys), refused.error)
                time.sleep(REFUSED_RETRY_S)

    def _put(self, keys: list[str], views: list[np.ndarray], replica_num: int,
             progress: Callable[[int], None] | None, requires: list[tuple[str, int]]) -> tuple[list[str], list[int]]:
        """One try of :meth:`put_generations`: placed, written, published, or revoked and raised."""
        results, put_timeout_ms = self._put_start(keys, [v.nbytes for v in views], replica_num)
        started = {k: r["generation"] for k, r in zip(keys, results) if r.get("ok")}  # key -> its put's id
        writes = _Writes(self, started, put_timeout_ms)
        checksums: Future | None = None
        try:
            for result in results:
                if not result.get("ok"):
                    raise error_from_reply(result.get("code"), result.get("message"))
            if sum(v.nbytes for v in views) >= CHECKSUM_THREAD_BYTES:  # computed while the bytes go out
                checksums = _CHECKSUM_POOL.get(1).submit(_checksums, views)
            remote, direct = self._plan_writes(views, results, writes)
            done = self._write_direct(direct, writes, progress)
            try:
                self._run_writes(remote, progress, done, writes)
            except CatalogUnwritable as exc:  # placed before the master heard that the segment takes no puts
                raise _Refused(exc) from None
            self._seal_direct(direct, writes)
            sums = checksums.result() if checksums is not None else _checksums(views)
            generations = [started[k] for k in keys]  # (every key started, or the loop above raised)
            self._put_end(keys, sums, generations, requires)
        except BaseException:
            writes.close_direct(quiet=True)
            self._revoke(started, settled=writes.in_flight == 0)
            if checksums is not None:
                checksums.cancel()
            raise
        refused = self._tell_catalogs(keys, views, results, sums, replica_num)
        if refused is not None:  # its next start would not offer them back: taken back, and placed again
            self.remove_many(keys, force=True, generations=generations)
            raise _Refused(refused)
        return sums, generations

    def _plan_writes(self, views: list[np.ndarray], results: list[dict],
                     writes: "_Writes") -> tuple[list["_RemoteWrite"], list["_DirectWrite"]]:
        """Each replica's bytes as requests to its segment, in WRITE_CHUNK_BYTES pieces, or, for a segment whose
        file is on this host and takes this process's writes, straight into that file."""
        remote, direct = [], []
        for view, result in zip(views, results):
            share = 1 / len(result["replicas"])  # progress counts every replica of an object once in all
            for r in result["replicas"]:
                fd = self._local_write_fd(r, view.nbytes) if r.get("direct_writes") else None
                if fd is not None and writes.open_direct(r):
                    direct.append(_DirectWrite(fd, r, view, share))
                    continue
                for start in range(0, view.nbytes, WRITE_CHUNK_BYTES):
                    chunk = view[start:start + WRITE_CHUNK_BYTES]
                    remote.append(_RemoteWrite(r["address"], {"offset": r["offset"] + start, "ticket": r["ticket"]},
                                               chunk, chunk.nbytes * share))
        return remote, direct

    @staticmethod
    def _write_direct(direct: list["_DirectWrite"], writes: "_Writes",
                      progress: Callable[[int], None] | None) -> float:
        """``pwrite`` the same-host replicas into their segments' files; returns the progress bytes written."""
        done = 0.0
        for job in direct:
            for start in range(0, job.view.nbytes, LOCAL_WRITE_CHUNK_BYTES):
                writes.renew_if_due()
                chunk = job.view[start:start + LOCAL_WRITE_CHUNK_BYTES]
                _pwrite_all(job.fd, chunk, job.replica["offset"] + start, job.replica)
                done += chunk.nbytes * job.share
                if progress is not None:
                    progress(int(done))
        return done

    def _seal_direct(self, direct: list["_DirectWrite"], writes: "_Writes") -> None:
        """Close the same-host writes (raises if a put was fenced while its bytes went into the file) and check
        their segments live: a mapping outlives its segment process, and a segment that died mid-write must fail
        the put before its objects are published."""
        writes.close_direct()
        if direct:
            self._ping_segments({job.replica["address"] for job in direct})

    def _put_end(self, keys: list[str], sums: list[str], generations: list[int],
                 requires: Sequence[tuple[str, int]] = ()) -> None:
        """Publish the objects with their checksums (while ``requires`` hold); raise the first key's refusal."""
        fields = {"keys": keys, "checksums": sums, "generations": generations}
        if requires:
            fields["requires"] = [key for key, _ in requires]
            fields["required_generations"] = [generation for _, generation in requires]
        ended = self._master_call("put_end", fields)["results"]
        for result in ended:
            if not result.get("ok"):
                raise error_from_reply(result.get("code"), result.get("message"))

    def _tell_catalogs(self, keys: list[str], views: list, results: list[dict], sums: list[str],
                       replica_num: int) -> CatalogUnwritable | None:
        """Tell each segment written to which published objects it now holds, before the put returns: its catalogue
        would learn them on its next heartbeat, and a master restarted without a journal in between would know
        them only from the catalogues. Best effort: a segment that does not answer learns on its heartbeat. Returns
        the refusal of a durable segment that could not write them into its catalogue, if one did."""
        entries: dict[str, list] = {}
        for key, view, result, checksum in zip(keys, views, results, sums):
            for r in result["replicas"]:
                entries.setdefault(r["address"], []).append([key, r["offset"], view.nbytes, replica_num, checksum,
                                                             r["ticket"]])
        pending = []
        for address, objects in entries.items():
            conn = self._segment_conn(address)
            try:
                pending.append((conn, conn.send("catalog_add", {"objects": objects})))
            except EngramError as exc:
                log.debug("catalog_add to %s: %s", address, exc)
        deadline = time.monotonic() + min(self.timeout_ms / 1000.0, CATALOG_TELL_S)
        refused = None
        for result in wait_all(pending, deadline, "catalog_add"):
            if isinstance(result, CatalogUnwritable):
                refused = refused or result
            elif isinstance(result, BaseException):
                log.debug("a segment did not take the new objects into its catalogue now (%s); it learns them on "
                          "its next heartbeat", result)
        return refused

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
            # Nothing was written yet.
            self._revoke({k: r["generation"] for k, r in zip(keys, results) if r.get("ok")}, settled=True)
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
        timeout_s = self.timeout_ms / 1000.0
        windows: dict[str, _Window] = {}
        for job in jobs:
            if job.address not in windows:
                windows[job.address] = _Window(self._segment_conn(job.address))
            windows[job.address].queue.append(job)
        poller = zmq.Poller()
        waiting: dict[Any, _Window] = {}  # socket -> the window of a server with writes in flight
        for window in windows.values():
            window.fill(writes, timeout_s, poller, waiting)
        while waiting:
            writes.renew_if_due()
            deadline = min(w.sent[0].deadline for w in waiting.values())
            ready = dict(poller.poll(max(0, int((min(deadline, writes.next_renewal) - time.monotonic()) * 1000))))
            if not ready and time.monotonic() < deadline:
                continue  # woke up to renew the put
            due = [waiting[sock] for sock in ready] or [min(waiting.values(), key=lambda w: w.sent[0].deadline)]
            for window in due:
                done_bytes += window.take_reply(writes)  # raises on an error reply or past the deadline
                window.fill(writes, timeout_s, poller, waiting)
            if progress is not None:
                progress(int(done_bytes))

    def _revoke(self, puts: dict[str, int], settled: bool = False) -> None:
        """Give up this call's puts (key -> put id), unfinished or published by a put_end that failed on another
        key. ``settled``: every write sent for them was answered (none can land later), so the master frees their
        space at once; otherwise it fences them first."""
        if not puts:
            return
        try:
            self._master_call("put_revoke", {"keys": list(puts), "generations": list(puts.values()),
                                             "settled": bool(settled)})
        except EngramError as exc:
            log.warning("could not revoke %d unfinished write(s) (the master frees them after its put "
                        "timeout): %s", len(puts), exc)

    def _local_write_fd(self, replica: dict, nbytes: int) -> int | None:
        """A write descriptor of the memory of a freshly placed replica's segment, if it is on this host and hands
        it over (``LocalSegments.write_fd``).

        Writes to a same-host segment are then ``pwrite`` calls into its memory (memory speed, no page faults
        in this process) instead of requests; the master still decides where they go, and the object stays
        invisible until ``put_end``. The descriptor is asked for once per segment and kept open.
        """
        return self.local_segments.write_fd(replica, nbytes) if self.local_direct else None


class _Refused(Exception):
    """A durable segment refused a put (:class:`CatalogUnwritable`): its write, or the put's entry in its catalogue.
    The put was revoked (or taken back): try it again."""

    def __init__(self, error: CatalogUnwritable):
        super().__init__(str(error))
        self.error = error


class _RemoteWrite(NamedTuple):
    """One write request: a piece of one replica's bytes for one segment server."""
    address: str
    fields: dict       # offset and ticket
    chunk: np.ndarray
    weight: float      # its bytes in progress terms (a replica's share of its object)


class _DirectWrite(NamedTuple):
    """One replica written straight into a same-host segment's file."""
    fd: int
    replica: dict
    view: np.ndarray
    share: float


class _Sent(NamedTuple):
    request_id: int
    weight: float
    deadline: float


class _Window:
    """The write requests of one segment server: those still to send and those in flight (at most WINDOW), whose
    replies come in the order they went out."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.queue: deque[_RemoteWrite] = deque()
        self.sent: deque[_Sent] = deque()

    def fill(self, writes: "_Writes", timeout_s: float, poller: zmq.Poller, waiting: dict) -> None:
        """Send until WINDOW requests are in flight; register the socket while any is, unregister it after."""
        while self.queue and len(self.sent) < WINDOW:
            job = self.queue.popleft()
            writes.in_flight += 1
            self.sent.append(_Sent(self.conn.send("write", job.fields, [job.chunk]), job.weight,
                                   time.monotonic() + timeout_s))
        sock = self.conn.socket
        if self.sent and sock not in waiting:
            waiting[sock] = self
            poller.register(sock, zmq.POLLIN)
        elif not self.sent and sock in waiting:
            poller.unregister(sock)
            del waiting[sock]

    def take_reply(self, writes: "_Writes") -> float:
        """Receive the oldest request's reply; returns its progress weight."""
        oldest = self.sent[0]
        try:
            self.conn.recv(oldest.request_id, oldest.deadline, "write")
        except EngramError as exc:
            if not isinstance(exc, Unavailable):
                writes.in_flight -= 1  # answered, with an error
            raise
        self.sent.popleft()
        writes.in_flight -= 1
        return oldest.weight


class _Writes:
    """One put call's dealings beside the bytes: renewing its pending keys with the master, the same-host writers it
    opened at segments (see :mod:`engram_store.segment._fence`), and how many write requests are still unanswered."""

    def __init__(self, store: Any, puts: dict[str, int], put_timeout_ms: int):
        self.store = store
        self.keys = list(puts)
        self.generations = list(puts.values())
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
            renewed = self.store._master_call("put_renew", {"keys": self.keys,
                                                            "generations": self.generations})["renewed"]
        except MasterUnavailable as exc:
            self.next_renewal = now + min(self.interval_s, 1.0)
            log.warning("could not renew %d pending put(s) with the master (%s); trying again", len(self.keys), exc)
            return
        ended = [k for k, ok in zip(self.keys, renewed) if not ok]
        if ended:
            raise WriteFenced(f"put of {ended[0]!r}: the master ended it while it was being written (it expired, "
                              "was removed with force, or the master restarted); nothing of it is published")

    def open_direct(self, replica: dict) -> bool:
        """Tell a same-host segment that this process writes the replica straight into its memory; False when the
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


#: Checksums computed while a put's bytes go out: one thread per process.
_CHECKSUM_POOL = SharedPool("engram-checksum")


def _check_requires(requires: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """``put_generations``' ``requires``: ``(key, generation)`` pairs, each generation a put id (> 0)."""
    checked = []
    for i, pair in enumerate(requires):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and is_int(pair[1]) and pair[1] > 0):
            raise InvalidArgument(f"requires[{i}]: expected a (key, generation) pair with a put id > 0, got "
                                  f"{describe(pair)}")
        checked.append((check_key(pair[0], f"requires[{i}]"), int(pair[1])))
    return checked


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
