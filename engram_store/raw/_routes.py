"""What a client knows of its segments' raw read channels: where each listens (learnt from a ping), which to leave
alone for a while (one that refused a read, one whose segment did not answer), and the channels its threads hold
open. One lock guards it; each thread keeps its own channels (a channel serves one thread at a time), in its
thread-local storage only: a thread that ends takes its channels with it, each closing its socket as it is
collected (the routes know them weakly, to close or retime them all).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple

from ..errors import EngramError, SegmentUnavailable
from .frame import VERSION as RAW_VERSION
from ._client import RawChannel, RawChannelRefused

log = logging.getLogger("engram_store.client")

#: After a raw read channel failed, how long the ping that looks for the segment again may take: a dead
#: segment then fails reads within this, not the full timeout; a restarted one answers with its new port.
REDISCOVERY_TIMEOUT_MS = 2000
#: A segment that did not answer that ping is not asked again for this long: reads to it fail at once (and
#: fail over to other replicas) instead of each waiting out the ping until the master drops the segment.
DEAD_HOLD_S = 2.0
#: After a segment's raw read channel refused a read (busy, or a new connection refused or closed before any
#: answer) while its ZeroMQ socket answers, this client reads from it over ZeroMQ for this long.
RAW_BACKOFF_S = 1.0

#: ``ping(timeout_ms)``: a segment's ping reply (raises SegmentUnavailable when it does not answer in time).
Ping = Callable[[int], dict]


class RawPort(NamedTuple):
    """Where a segment's raw read channel listens, and whether a new connection needs a one-time token first."""
    host: str
    port: int
    needs_token: bool


@dataclass(frozen=True)
class Unanswered:
    """A segment that did not answer the ping that looked for it after a failure, at ``since`` (monotonic)."""
    since: float


class _Suspect:
    """A segment whose channel failed: its port is asked again, briefly, before the next read."""

    def __repr__(self) -> str:
        return "SUSPECT"


SUSPECT = _Suspect()

#: What a client knows of one segment: nothing yet (absent), its port, None (no raw channel: read over ZeroMQ),
#: SUSPECT, or Unanswered.
PortState = RawPort | None | _Suspect | Unanswered


def port_of(address: str, ping: dict) -> RawPort | None:
    """The raw channel a segment's ping reply offers, or None to read over ZeroMQ (no channel, or one of another
    version)."""
    port = int(ping.get("raw_port") or 0)
    if not port:
        return None
    version = ping.get("raw_version", 1)
    if version != RAW_VERSION:
        log.warning("%s serves raw read channel version %s, this client speaks version %d: reading from it "
                    "over ZeroMQ", address, version, RAW_VERSION)
        return None
    return RawPort(address.rpartition(":")[0].strip("[]"), port, bool(ping.get("raw_token")))


class RawRoutes:
    """A client's raw read channels, by segment address (see the module docstring)."""

    def __init__(self, timeout_s: float):
        self.ports: dict[str, PortState] = {}
        self.backoff: dict[str, float] = {}  # address -> until when its reads go over ZeroMQ
        self.channels: weakref.WeakSet[RawChannel] = weakref.WeakSet()  # every open channel, of every thread
        self._timeout_s = timeout_s
        self._local = threading.local()
        self._lock = threading.Lock()

    def _mine(self) -> dict[str, RawChannel]:
        channels = getattr(self._local, "channels", None)
        if channels is None:
            channels = self._local.channels = {}
        return channels

    def open_channel(self, address: str) -> RawChannel | None:
        """This thread's open channel to ``address``, if it has one."""
        channels = getattr(self._local, "channels", None)
        return channels.get(address) if channels else None

    def ready(self, address: str) -> bool:
        """Whether a read to ``address`` goes out without asking for its port first."""
        return self.open_channel(address) is not None or isinstance(self.ports.get(address), RawPort)

    def channel(self, address: str, ping: Ping, token: Callable[[], str]) -> RawChannel | None:
        """This thread's channel to ``address``, opened if need be, or None to read over ZeroMQ.

        The port is learnt once, from a ping (with the full timeout the first time; after a failure briefly, and
        a segment that did not answer then is not asked again for DEAD_HOLD_S: SegmentUnavailable at once). With
        ``token`` (CURVE keys) each new connection first fetches a one-time token over ZeroMQ.
        """
        channels = self._mine()
        channel = channels.get(address)
        if channel is not None:
            return channel
        if self.backoff and self.backoff.get(address, 0.0) > time.monotonic():
            return None  # the channel refused a read a moment ago: ZeroMQ for now
        state = self.ports.get(address, False)
        if isinstance(state, Unanswered):
            waited = time.monotonic() - state.since
            if waited < DEAD_HOLD_S:
                raise SegmentUnavailable(f"read_ranges: {address} did not answer a ping {waited:.1f} s ago; "
                                         f"not asked again before {DEAD_HOLD_S} s")
            state = SUSPECT
        if state is False or state is SUSPECT:
            try:
                if state is SUSPECT:  # dead (ask briefly) or restarted on a new port (ask again)
                    state = self._rediscover(address, ping)
                else:
                    state = port_of(address, ping(int(self._timeout_s * 1000)))
            except SegmentUnavailable:
                raise
            except EngramError:
                state = None
            with self._lock:
                self.ports[address] = state
        if state is None:
            return None
        channel = channels[address] = RawChannel(address, state.host, state.port,
                                                 token if state.needs_token else None, timeout_s=self._timeout_s)
        with self._lock:
            self.channels.add(channel)
        return channel

    def close(self, address: str) -> None:
        """Close and forget this thread's channel to ``address``."""
        channels = getattr(self._local, "channels", None)
        channel = channels.pop(address, None) if channels is not None else None
        if channel is not None:
            channel.close()
            with self._lock:
                self.channels.discard(channel)

    def drop(self, address: str) -> None:
        """After a failed read: close the channel, and look for the segment again (a ping) before the next one."""
        self.close(address)
        with self._lock:
            if isinstance(self.ports.get(address), RawPort):
                self.ports[address] = SUSPECT

    def refused(self, address: str, exc: RawChannelRefused, ping: Ping) -> None:
        """``address``'s channel refused a read: read from it over ZeroMQ for RAW_BACKOFF_S. A busy answer comes
        from a live segment; after a refused or closed connection a ping tells a live segment (read it over ZeroMQ,
        or over the raw port it now names) from a gone one (SegmentUnavailable, as a failed read). A reply cut off
        (``exc.cut``) came from a segment that may be well: after the ping, the channel is used again at once."""
        self.close(address)
        if not exc.busy:
            try:
                state = self._rediscover(address, ping)
            except SegmentUnavailable as gone:
                raise SegmentUnavailable(f"{exc}, and it did not answer a ping over ZeroMQ either") from gone
            with self._lock:
                moved = state != self.ports.get(address)
                self.ports[address] = state
            if moved or exc.cut:
                return  # restarted on another port (or without the channel): the next read goes by the ping
        log.debug("%s; reading from it over ZeroMQ for %g s", exc, RAW_BACKOFF_S)
        with self._lock:
            self.backoff[address] = time.monotonic() + RAW_BACKOFF_S

    def _rediscover(self, address: str, ping: Ping) -> RawPort | None:
        """Ask a segment whose channel failed where its channel is now, within REDISCOVERY_TIMEOUT_MS; one that does
        not answer is marked Unanswered (SegmentUnavailable)."""
        try:
            return port_of(address, ping(min(int(self._timeout_s * 1000), REDISCOVERY_TIMEOUT_MS)))
        except SegmentUnavailable:
            with self._lock:
                self.ports[address] = Unanswered(time.monotonic())
            raise

    def set_timeout(self, timeout_s: float) -> None:
        """The timeout of every channel, open and to come."""
        self._timeout_s = timeout_s
        with self._lock:
            channels = list(self.channels)
        for channel in channels:
            channel.set_timeout(timeout_s)

    def close_all(self) -> None:
        """Close every thread's channels (the client is closing)."""
        with self._lock:
            channels, self.channels = list(self.channels), weakref.WeakSet()
        for channel in channels:
            channel.close()
