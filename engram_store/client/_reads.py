"""The read path of :class:`DistributedStore`: local-direct copies, the raw channel where segments offer it, else
ZeroMQ; one request per segment server, all in flight at once, failing over to another replica.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import xxhash

from .. import kernels as _kernels
from ..errors import (EngramError, InvalidArgument, ObjectLost, ProtocolError, SegmentUnavailable,
                      StalePlacement)
from ..raw import RawChannel, RawChannelRefused
from ..wire import ZERO_COPY_SEND_BYTES, frame_bytes
from ._mapped import object_checks, read_mapped
from ._objects import ObjectInfo, Replica, as_bytes_view, check_key

log = logging.getLogger("engram_store.client")

#: Size of one read message for large objects; several are kept in flight per server.
CHUNK_BYTES = 16 << 20
#: Replies at least this large are received without a copy (smaller ones are cheaper to copy).
ZERO_COPY_REPLY_BYTES = 64 << 10


class Ranges(NamedTuple):
    """Ranges of one object to copy into a buffer: ``sizes[k]`` bytes from ``src_offsets[k]`` of the object to
    ``dst_offsets[k]`` of ``dst`` (a flat writable uint8 array)."""
    info: ObjectInfo
    src_offsets: np.ndarray
    sizes: np.ndarray
    dst: np.ndarray
    dst_offsets: np.ndarray


class ReadPath:
    """The reads of a :class:`DistributedStore` (a mixin: the store holds the connections, mappings and channels)."""

    def local_view(self, replica: Replica) -> np.ndarray | None:
        """The whole segment holding ``replica`` as a read-only uint8 array, if it is mapped on this host (and
        this client reads local-direct); see :meth:`LocalSegments.view`."""
        return self.local_segments.view(replica) if self.local_direct else None

    def local_shrunk_probe(self, segment_id: str) -> Callable[[int], bool] | None:
        """Whether segment ``segment_id``'s memory mapped on this host is a file now shorter than a read needs, as
        ``client.read_mapped`` asks it (see :meth:`LocalSegments.shrunk`); None where it cannot shrink."""
        return self.local_segments.shrunk_probe(segment_id)

    def local_table(self, replica: Replica) -> np.ndarray | None:
        """The generation table of a segment mapped on this host; see :meth:`LocalSegments.table`."""
        return self.local_segments.table(replica) if self.local_direct else None

    def get(self, key: str, lease: bool = True) -> bytes:
        """The bytes stored under ``key``; ``lease=False`` reads without taking a read lease."""
        info = self.locate([check_key(key)], lease=lease)[0]
        out = np.empty(info.size, dtype=np.uint8)
        self.read_object(info, out)
        return out.tobytes()

    def get_checked(self, key: str, lease: bool = True) -> bytes:
        """:meth:`get`, its bytes checked against the checksum the master recorded with the object: a copy that no
        longer matches (damaged at rest, and read from this host's mapping before its segment started again and
        found it) is passed over for the next replica. Raises ObjectLost naming the damage when no replica holds
        the object's bytes; an object written without a checksum is returned as read. For small objects (a
        layer's manifest): the check hashes every byte."""
        info = self.locate([check_key(key)], lease=lease)[0]
        out = np.empty(info.size, dtype=np.uint8)
        self.read_object(info, out)
        if not info.checksum or xxhash.xxh3_64_hexdigest(out) == info.checksum:
            return out.tobytes()
        damaged, unreadable = [], []
        for replica in info.replicas:
            try:
                self.read_object(replace(info, replicas=(replica,)), out)
            except (SegmentUnavailable, StalePlacement) as exc:
                unreadable.append(f"{replica.segment_id} ({type(exc).__name__})")
                continue
            if xxhash.xxh3_64_hexdigest(out) == info.checksum:
                log.warning("object %r: a copy read on this host no longer matches its checksum (damaged at rest); "
                            "read from segment %s instead", key, replica.segment_id)
                return out.tobytes()
            damaged.append(replica.segment_id)
        raise ObjectLost(f"object {key!r}: its bytes no longer match the checksum its writer recorded (damaged at "
                         f"rest) on {', '.join(damaged) or 'the copy mapped on this host'}"
                         + (f"; unreadable on {', '.join(unreadable)}" if unreadable else "")
                         + "; write it again (populate the layer again for a manifest)")

    def get_into(self, key: str, buffer: object) -> int:
        """Copy the object into ``buffer`` (at least as large as the object); returns the byte count."""
        dst = as_bytes_view(buffer, "buffer", writable=True)
        info = self.locate([check_key(key)])[0]
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
            work.append(Ranges(info, offsets, lengths, dst, offsets))
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
        unique = sorted({check_key(k, "all_keys") for keys in all_keys for k in keys})
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
                work.append(Ranges(info, src_off, sizes, dsts[i], dst_off))
                per_key.append(sizes.tolist())
            result.append(per_key)
        self.read_into(work)
        return result

    def read_into(self, work: list[Ranges]) -> None:
        """Copy ranges of objects into buffers.

        Local-direct replicas are copied from the mapping; the rest is grouped by segment server, one
        request per server, all in flight at once; ranges whose server fails are retried on the next replica.
        """
        attempt = [0] * len(work)
        pending = list(range(len(work)))
        failed: set[str] = set()
        while pending:
            groups: dict[str, list[int]] = {}
            for w in pending:
                info = work[w].info
                replica = self._choose(info, failed, attempt[w])
                if replica is None:
                    tried = ", ".join(sorted(r.address for r in info.replicas))
                    raise SegmentUnavailable(f"object {info.key!r}: no replica could be read (tried {tried})")
                view = self.local_view(replica)
                if view is None or not self._copy_mapped(view, replica, work[w]):
                    groups.setdefault(replica.address, []).append(w)
            pending = []
            if not groups:
                break
            for address, failed_items in self._read_remote(work, groups, failed):
                failed.add(address)
                for w in failed_items:
                    attempt[w] += 1
                pending.extend(failed_items)

    def _copy_mapped(self, view: np.ndarray, replica: Replica, item: Ranges) -> bool:
        """Copy ``item``'s ranges of ``replica`` from this host's mapping of its segment, by the one rule of mapped
        reads (:func:`read_mapped`; an ObjectInfo says not how old the master's answer is, so the segment's
        generation table must prove the object there): False where it cannot, and the ranges are read through the
        segment, which checks them (and refuses an object that is gone: StalePlacement)."""
        checks = object_checks(self.local_table(replica), replica.offset, item.info.size, replica.generation,
                               self.local_shrunk_probe(replica.segment_id))
        try:
            read_mapped(lambda: _copy_local(view, item.src_offsets + replica.offset, item.sizes, item.dst,
                                            item.dst_offsets), checks, 0.0, f"object {item.info.key!r}")
        except StalePlacement:
            return False
        return True

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
        """This thread's raw read channel to the segment at ``address``, or None to read over ZeroMQ (see
        :class:`RawRoutes`: the port is learnt from a ping, a failed channel is dropped and the port asked again)."""
        if not self.raw_reads:
            return None

        def token() -> str:
            return str(self._segment_conn(address).call("channel_token", timeout_ms=self.timeout_ms)[0]["token"])

        return self.raw_routes.channel(address, self._ping_segment(address), token)

    def _ping_segment(self, address: str):
        return lambda timeout_ms: self._segment_conn(address).call("ping", timeout_ms=timeout_ms)[0]

    def _drop_raw(self, address: str) -> None:
        """After a failed read: close the channel, and look for the segment again (a ping) before the next one."""
        self.raw_routes.drop(address)

    def _send_read(self, endpoint: str, pairs: np.ndarray, deadline: float) -> tuple[Any, int]:
        """Send a ``read_ranges`` of ``pairs`` to ``endpoint``, over its raw channel where it has one, else over
        ZeroMQ; returns the link it went on and the request id, for :meth:`_recv_read`."""
        channel = self._raw_channel(endpoint)
        if channel is not None:
            try:
                return channel, channel.send_read(pairs, deadline)
            except RawChannelRefused as exc:
                if exc.first:
                    self.raw_routes.refused(endpoint, exc, self._ping_segment(endpoint))
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
                    self.raw_routes.refused(endpoint, exc, self._ping_segment(endpoint))
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

    def read_direct(self, endpoint: str, plan: np.ndarray, ids: np.ndarray, row_bytes: int, out: np.ndarray) -> bool:
        """A lookup's read of every ``(m, head)`` row of ``ids`` under ``plan`` (``kernels.direct_read_plan`` of a
        placement whose remote heads all sit on ``endpoint``'s segment) into ``out``, in one kernel call on this
        thread's open raw channel to it: True when ``out`` holds the rows, False when that channel cannot take it
        (none open yet, reads in flight, or the read did not end in rows: :meth:`read_pairs` then reads it, and
        says why). Raises SegmentUnavailable when the segment did not answer within the timeout."""
        channel = self.raw_routes.open_channel(endpoint)
        if channel is None:
            return False
        try:
            return channel.read_direct(plan, ids, row_bytes, out)
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
        order = sorted(range(len(requests)), key=lambda i: not self.raw_routes.ready(requests[i][0]))
        for i in order:
            endpoint, pairs = requests[i]
            deadline = time.monotonic() + timeout_s
            pairs = np.ascontiguousarray(pairs)
            expected = reply_bytes(pairs)
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

    def _read_remote(self, work: list[Ranges], groups: dict[str, list[int]], failed: set[str]):
        """Read grouped work items, one request per server (split past the reply limit); yield failures."""
        requests = []  # (address, items, offsets, lengths, objects named: {(offset, size, generation)})
        for address, items in groups.items():
            batch, offs, lens, total, named = [], [], [], 0, set()
            for w in items:
                info, sizes = work[w].info, work[w].sizes
                replica = next(r for r in info.replicas if r.address == address)
                nbytes = int(sizes.sum())
                if batch and total + nbytes > CHUNK_BYTES:
                    requests.append((address, batch, np.concatenate(offs), np.concatenate(lens), named))
                    batch, offs, lens, total, named = [], [], [], 0, set()
                batch.append(w)
                offs.append(work[w].src_offsets + replica.offset)
                lens.append(sizes)
                total += nbytes
                named.add((replica.offset, info.size, replica.generation))
            requests.append((address, batch, np.concatenate(offs), np.concatenate(lens), named))
        outs = []
        for _, items, _, lens, _ in requests:
            # A request for one range of one item (a chunk of a whole object) lands straight in its destination.
            if len(items) == 1 and lens.size == 1:
                dst, dst_off = work[items[0]].dst, work[items[0]].dst_offsets
                outs.append(dst[int(dst_off[0]):int(dst_off[0]) + int(lens[0])])
            else:
                outs.append(None)
        replies = self.read_pairs_many([(a, with_checks(named, np.stack((o, n), axis=1)))
                                        for a, _, o, n, named in requests], outs)
        failures: dict[str, list[int]] = {}
        for (address, items, _, _, _), reply, out in zip(requests, replies, outs):
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
                item = work[w]
                n = int(item.sizes.sum())
                _kernels.scatter_ranges(data[pos:pos + n], item.dst, item.dst_offsets, item.sizes)
                pos += n
        yield from failures.items()


def reply_bytes(pairs: np.ndarray) -> int:
    """The bytes a read of ``pairs`` returns: its ranges' lengths (leading checks return nothing)."""
    if not pairs.size:
        return 0
    if pairs[0, 0] < 0:
        return int(pairs[pairs[:, 0] >= 0, 1].sum())
    return int(pairs[:, 1].sum())


def with_checks(named: set, pairs: np.ndarray) -> np.ndarray:
    """``pairs`` led by the checks of the objects it reads (``{(offset, size, generation)}``): the segment serves
    them only while those objects are still there (see ``kernels.check_generations``)."""
    if not named:
        return pairs
    offsets, sizes, generations = (np.array(column, dtype=np.int64) for column in zip(*sorted(named)))
    checks = _kernels.check_pairs_for(offsets, sizes, generations)
    return np.concatenate((checks, pairs)) if checks.size else pairs


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
