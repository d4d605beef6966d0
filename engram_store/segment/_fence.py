"""A segment's side of fencing: which writes may land (see :mod:`engram_store.wire._tickets` and DESIGN.md, "Fencing").

Every write carries a ticket from the master. :class:`WriteFence` admits a write only if its ticket was issued
under the segment's current write key, its put has not been fenced, and its bytes lie inside the ticket's range.
The key changes at every registration, so tickets of a master that forgot its pending puts, or of puts the master
ended while it had dropped this segment, stop working before the master can hand their space to anyone.

Same-host writers put bytes straight into the segment's file (``pwrite``), past any check. They first open their
put here (:meth:`WriteFence.open_direct`, with their process id) and close it when done; a writer whose put is
fenced while it is still alive is *held*: its range is reported to the master with every heartbeat and stays
reserved until the writer closes the put or its process exits (watched through a pidfd, so a reused pid is never
mistaken for it).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import uuid
from dataclasses import dataclass

from ..errors import InvalidArgument, WriteFenced
from ..wire import WRITE_KEY_BYTES, read_ticket

log = logging.getLogger(__name__)

#: Fenced put ids kept per registration; older ones are forgotten first (a ticket that old is long expired).
MAX_FENCED = 1 << 20


@dataclass
class _DirectWriter:
    put_id: int
    offset: int
    size: int
    pidfd: int
    registration: str
    fenced: bool = False

    def alive(self) -> bool:
        """Whether the writer's process still runs (a pidfd becomes readable when it exits). poll, not select: a
        segment holding many connections has descriptors past select's limit of 1024."""
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        try:
            return not poller.poll(0)
        except OSError:
            return False


class WriteFence:
    """The checks a segment makes before a write lands; thread-safe (writes, heartbeats and the direct-write
    handlers run on different threads)."""

    def __init__(self, segment_id: str):
        self.segment_id = segment_id
        self._lock = threading.Lock()
        self.key = b""
        self.registration = ""
        self._fenced: dict[int, None] = {}  # put ids fenced under the current key, oldest first
        self._acks: set[int] = set()        # fenced put ids to acknowledge with the next heartbeat
        self._direct: dict[bytes, _DirectWriter] = {}  # open same-host writers, by ticket

    def new_registration(self) -> tuple[str, bytes]:
        """A fresh registration id and write key: every ticket issued before stops working now. Call it before
        registering with a master; writers still writing straight into the file under the old key are fenced."""
        with self._lock:
            self.key = os.urandom(WRITE_KEY_BYTES)
            self.registration = uuid.uuid4().hex
            self._fenced.clear()
            self._acks.clear()
            for writer in self._direct.values():
                writer.fenced = True  # redundant today: each check of a writer compares its registration too
            return self.registration, self.key

    def _admit(self, ticket: bytes, what: str) -> tuple[int, int, int]:
        """``(put_id, offset, size)`` of a ticket of a live put (under the lock); raise WriteFenced otherwise."""
        fields = read_ticket(self.key, self.segment_id, ticket)
        if fields is None:
            raise WriteFenced(f"{what}: segment {self.segment_id} did not issue this ticket under its current "
                              "registration (it registered again since, or the master restarted): the put is fenced")
        if fields[0] in self._fenced:
            raise WriteFenced(f"{what}: put {fields[0]} was fenced (revoked, expired, or removed with force)")
        return fields

    def check(self, ticket: bytes, offset: int, nbytes: int) -> tuple[int, int, int]:
        """``(put_id, start, size)`` of the ticket's put and range; raise unless ``nbytes`` at ``offset`` may be
        written under ``ticket``."""
        with self._lock:
            put_id, start, size = self._admit(ticket, "write")
        if offset < start or offset + nbytes > start + size:
            raise InvalidArgument(f"write: bytes [{offset}, {offset + nbytes}) lie outside the range [{start}, "
                                  f"{start + size}) the ticket of put {put_id} allows")
        return put_id, start, size

    def ticket_of(self, ticket: bytes) -> tuple[int, int, int] | None:
        """``(put_id, offset, size)`` of a ticket issued under the current registration (fenced or not), else
        None."""
        return read_ticket(self.key, self.segment_id, ticket)

    def open_direct(self, ticket: bytes, pid: int) -> tuple[int, int, int]:
        """A same-host writer (process ``pid``) starts writing its put straight into the file; returns the put and
        the range it may write, ``(put_id, offset, size)``. Raises WriteFenced for a dead put, InvalidArgument when ``pid`` cannot be watched from here
        (another pid namespace, or no pidfd support): the writer then writes through requests."""
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError) as exc:
            raise InvalidArgument(f"write_open: cannot watch process {pid} from segment {self.segment_id} "
                                  f"({getattr(exc, 'strerror', None) or exc}); write through requests") from None
        with self._lock:
            try:
                put_id, offset, size = self._admit(ticket, "write_open")
            except BaseException:
                os.close(pidfd)
                raise
            old = self._direct.pop(bytes(ticket), None)
            if old is not None:
                os.close(old.pidfd)
            self._direct[bytes(ticket)] = _DirectWriter(put_id, offset, size, pidfd, self.registration)
        return put_id, offset, size

    def close_direct(self, ticket: bytes) -> bool:
        """A same-host writer is done with its put; returns whether the put was fenced meanwhile (then what it
        wrote must not be published)."""
        with self._lock:
            writer = self._direct.pop(bytes(ticket), None)
            # Each of the last three is redundant today given the others: fence() and new_registration() mark a
            # writer fenced as its put goes into _fenced or the registration changes.
            fenced = writer is None or writer.fenced or writer.registration != self.registration \
                or writer.put_id in self._fenced
        if writer is not None:
            os.close(writer.pidfd)
        return fenced

    def fence(self, put_ids) -> None:
        """The master fenced these puts (a heartbeat reply): refuse their writes from now on."""
        with self._lock:
            for put_id in put_ids:
                self._fenced[put_id] = None
                self._acks.add(put_id)
                for writer in self._direct.values():
                    if writer.put_id == put_id and writer.registration == self.registration:
                        writer.fenced = True
            while len(self._fenced) > MAX_FENCED:
                self._fenced.pop(next(iter(self._fenced)))

    def heartbeat_fields(self) -> dict:
        """What a heartbeat reports: the registration, fences applied since the last one, ranges held by live
        writers of fenced puts. Writers that exited are forgotten here."""
        with self._lock:
            held, gone = [], []
            for ticket, writer in self._direct.items():
                if not writer.alive():
                    gone.append(ticket)
                elif writer.fenced or writer.registration != self.registration:
                    held.append([writer.offset, writer.size])
            for ticket in gone:
                writer = self._direct.pop(ticket)
                os.close(writer.pidfd)
                if writer.fenced or writer.registration != self.registration:
                    log.info("segment %s: the writer of fenced put %d (pid gone) no longer holds [%d, %d)",
                             self.segment_id, writer.put_id, writer.offset, writer.offset + writer.size)
            return {"registration": self.registration, "fenced": sorted(self._acks), "held": held}

    def acknowledged(self, put_ids) -> None:
        """The master received the acknowledgement of these fences."""
        with self._lock:
            self._acks.difference_update(put_ids)

    def held(self) -> list[list[int]]:
        return self.heartbeat_fields()["held"]

    def close(self) -> None:
        with self._lock:
            writers, self._direct = list(self._direct.values()), {}
        for writer in writers:
            os.close(writer.pidfd)
