"""Where a store layer's head tables are: which are mapped on this host and which are read from which server.

Published layers are immutable, but another client may remove one and populate it again elsewhere; the master
keeps a removed table's space unallocated for its reuse delay (2 s by default), so a placement checked with the
master within that delay never leads to another object's bytes. A placement younger than PLACEMENT_TTL_S is used
as it is; up to PLACEMENT_STALE_S it is used while a background thread checks it; older (a client that was idle),
it is checked before use. A placement read only through segments that check each read (REMOTE_PLACEMENT_TTL_S)
is checked far more rarely: its segments refuse what changed. When the master does not answer, reads go on from the
last placement it gave and the check is retried in the background; only a layer this client never resolved needs
the master to be read.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import numpy as np

from .. import _fork
from .. import kernels as _kernels
from ..errors import (EngramError, MixedLayer, ObjectNotFound, SegmentUnavailable, StalePlacement, StoreError,
                      Unavailable)
from ..client import MappedCheck, read_mapped
from ._layout import Layer
from ._source import InMemory, gather

log = logging.getLogger(__name__)
T = TypeVar("T")

#: How long a resolved table placement is used before it is checked with the master again (one request, in the
#: background up to PLACEMENT_STALE_S, before use past it). Reads never depend on them for their correctness
#: (segments check what they serve, and tables mapped here are checked past Placements.local_safe_s): they say how
#: soon a layer written again is seen. Each placement carries its pair (Placement.ttl_s, stale_s).
PLACEMENT_TTL_S = 0.5
PLACEMENT_STALE_S = 1.0
#: The same for a placement whose every table is read through its segment, each read naming the put that wrote it
#: (no table mapped here, no generation unknown). Such a segment refuses a read of an object that another put has
#: written over, or whose remove it heard of (the remover tells it at once), so the check with the master only
#: finds what reads do not: a remove whose segment did not hear of it (away then, or ``remove_all``), new
#: replicas. At a model step's cadence a check is the only other thread a lookup wakes in the client, and a
#: wake-up there held up the next lookups by a scheduler tick now and then: checked this rarely, that is under
#: 0.5% of lookups at a 30 ms step.
REMOTE_PLACEMENT_TTL_S = 10.0
REMOTE_PLACEMENT_STALE_S = 20.0
#: The longest a lookup waits for the master to check a placement it already has, before reading from it anyway.
REFRESH_TIMEOUT_MS = 2000
#: After the master failed a placement check, lookups do not wait for it for this long (checks go on behind).
MASTER_RETRY_S = 2.0
#: At most one warning per EngramStore this often while the master does not answer.
MASTER_WARN_INTERVAL_S = 10.0


@dataclass
class Placement:
    """Where a layer's head tables live, as the master said at ``checked_at``."""

    memory: InMemory                  # the heads whose tables are mapped on this host
    remote: list[tuple[str, tuple, int, int]]  # (segment address, endpoints that serve its reads, j0, j1): the
                                               # segment holds heads order[j0:j1]
    order: np.ndarray                 # remote heads, grouped by server (read-only int64)
    bases: np.ndarray                 # byte offset of head order[j]'s table in its segment (read-only int64)
    signature: tuple = ()             # (size, replicas) per head, to spot changes
    checked_at: float = 0.0           # time.monotonic() of the last check with the master
    checks: tuple = ()                # per remote server: the check pairs naming its tables (read-only int64
                                      # [2K, 2]); its reads lead with them, so it never serves another object
    local_checks: tuple = ()          # per mapped segment, a client.MappedCheck: its generation table, the check
                                      # pairs of the tables read from it, and the bytes they need of its mapped file
    local_checked: bool = False       # every mapped table can be checked that way (else: time is the proof)
    ttl_s: float = PLACEMENT_TTL_S    # used as it is while younger
    stale_s: float = PLACEMENT_STALE_S  # used while younger, checked in the background (both REMOTE_PLACEMENT_*
                                        # where every read is checked by its segment; see _build)

    def reads_from(self, failed: set[str]) -> bool:
        return any(address in failed for address, *_ in self.remote)


def _ttls(local: bool, local_tables: list, remote: dict) -> tuple[float, float]:
    """A placement's (ttl_s, stale_s): how often it is checked with the master, not what may be read (mapped tables
    pass read_mapped, remote reads name their puts). Where every table is read through its segment (none mapped
    here, the mappings looked for: ``local``, not a placement built without them while the master did not answer)
    and every read names its put, a segment refuses what changed: the master is asked far more rarely (see
    REMOTE_PLACEMENT_TTL_S)."""
    if local and not local_tables and all(r.generation for entries in remote.values() for _, _, r in entries):
        return REMOTE_PLACEMENT_TTL_S, REMOTE_PLACEMENT_STALE_S
    return PLACEMENT_TTL_S, PLACEMENT_STALE_S


class PlacementState:
    """What a store source knows of one layer: its placement, the master's last answer, the hot-row cache."""

    def __init__(self, cache: Any = None):
        self.placement: Placement | None = None
        self.remote_only: Placement | None = None  # the placement read through segments only (see Placements.get)
        self.stale: StalePlacement | None = None  # a segment said the placement was stale: the master must answer
        self.known: tuple | None = None  # (infos, signature, time) of the master's last answer
        self.validated: tuple = ()       # the signature whose manifest was checked
        self.refreshing = 0              # the id of the process whose background check is running (0: none)
        self.cache = cache
        self.lean: Any = None            # how a lookup reads the layer in one kernel call (the source's _Lean)


#: How many times a reader looks at a layer whose heads are not its manifest's before it refuses it as mixed.
LOOKS = 3


class Placements:
    """Resolves and keeps the placements of a store source's layers (see the module docstring)."""

    def __init__(self, native: Any, check_published: Callable[..., None],
                 clear_cache: Callable[[Layer, tuple], None]):
        self.native = native
        self.check_published = check_published
        self.clear_cache = clear_cache
        self._lock = threading.Lock()
        self._refresher: ThreadPoolExecutor | None = None
        self._trouble_at = 0.0
        self._warned_at = -MASTER_WARN_INTERVAL_S
        self._closed = False
        _fork.in_child(self._forked)

    def _forked(self) -> None:
        """In a forked child: the parent's checking thread is not here; the child starts its own on first use."""
        _fork.keep(self._refresher)
        self._lock, self._refresher = threading.Lock(), None

    def local_safe_s(self) -> float:
        """How long the master's answer alone proves what a mapping holds: half its reuse delay (a removed table's
        space stays unused that long). Past it, tables mapped here are checked against their segment's
        generation table around each read (:meth:`read_mapped`)."""
        return getattr(self.native, "reuse_delay_s", 2.0) / 2

    def read_mapped(self, lay: Layer, placement: Placement, read: Callable[[], T], age: float | None = None) -> T:
        """``read()`` of the tables ``placement`` maps on this host, by the one rule of mapped reads
        (``client.read_mapped``): as it is where it ends while the placement is younger than :meth:`local_safe_s`,
        else between a check of each segment's generation table (the named tables are still there) and a recheck
        (no put claimed their space meanwhile); StalePlacement otherwise, and nothing ``read`` wrote may be used. ``age``:
        the placement's age now, where the caller has just taken it."""
        asked_at = placement.checked_at if age is None else time.monotonic() - age
        return read_mapped(read, placement.local_checks, asked_at + self.local_safe_s(), f"layer {lay.layer_id}")

    def gather(self, lay: Layer, placement: Placement, ids: np.ndarray, flat: np.ndarray, threads: int,
               age: float | None = None) -> None:
        """Gather the rows of the heads mapped on this host (:meth:`read_mapped`: StalePlacement where the tables
        cannot be proven still there, and no row of this call is used)."""
        if placement.memory.sources:
            self.read_mapped(lay, placement, lambda: gather(lay, placement.memory, ids, flat, threads), age)

    def get(self, lay: Layer, failed: set[str]) -> Placement:
        """The layer's placement, checked with the master as the module docstring says.

        While the master does not answer, a placement older than half its reuse delay is no longer proof that the
        tables are where it says: its tables mapped on this host are then read through their segments too, which
        check every read against the put that wrote what they hold (see ``kernels.check_generations``), so a
        layer removed meanwhile, its space reused, is never read."""
        cached = lay.state.placement
        if cached is not None:
            age = time.monotonic() - cached.checked_at
            if age < cached.ttl_s:
                return cached
            if age < cached.stale_s:
                self.refresh_later(lay)
                return cached
            if self._trouble():
                self.refresh_later(lay)
                if cached.memory.sources and not cached.local_checked:
                    return self._remote_only(lay, cached, failed)
                return cached
            return self.resolve(lay, failed, timeout_ms=min(self.native.timeout_ms, REFRESH_TIMEOUT_MS))
        return self.resolve(lay, failed)

    def _remote_only(self, lay: Layer, cached: Placement, failed: set[str]) -> Placement:
        """``cached`` with every head read from its segment (checked there), none from a mapping."""
        state = lay.state
        kept = state.remote_only
        if kept is not None and kept.signature == cached.signature and kept.checked_at == cached.checked_at \
                and not kept.reads_from(failed):
            return kept
        infos, signature, checked_at = state.known
        placement = self._build(lay, infos, failed, signature, checked_at, local=False)
        state.remote_only = placement
        return placement

    def stale(self, lay: Layer, exc: StalePlacement) -> None:
        """A segment refused a read of the layer's placement: forget it (and the master's last answer); the next
        read asks the master, and fails with ``exc`` if it does not answer."""
        state = lay.state
        with lay.lock:
            state.placement = state.remote_only = None
            state.known = None
            state.stale = exc

    def resolve(self, lay: Layer, failed: set[str], timeout_ms: int | None = None) -> Placement:
        """Ask the master where the layer's heads are and build the placement (reading and checking the layer's
        manifest when its tables are new to this client or have moved); on a master that does not answer, rebuild
        it from the last answer, without the ``failed`` segments."""
        state = lay.state
        cached = state.placement
        now = time.monotonic()
        try:
            infos = self.native.locate(lay.keys, lease=False, timeout_ms=timeout_ms)
        except ObjectNotFound:
            self.check_published(lay)  # "not published" says more than a missing head
            raise
        except Unavailable as exc:
            if state.known is None:
                if state.stale is not None:
                    raise StalePlacement(f"layer {lay.layer_id}: {state.stale}; and the master did not answer "
                                         f"({exc}), so where the layer is now is not known") from exc
                raise
            self._unreachable(lay, exc)
            # Past half the reuse delay, the last answer no longer proves what a mapping holds: tables mapped here
            # are checked against their segment's generation table, or else read through the segment, which
            # checks each read against the put that wrote the bytes.
            local = now - state.known[2] < self.local_safe_s()
            if cached is not None and not cached.reads_from(failed):
                if local or cached.local_checked or not cached.memory.sources:
                    return cached
                return self._remote_only(lay, cached, failed)
            infos, signature, checked_at = state.known
        else:
            self._trouble_at = 0.0
            state.stale = None
            local = True
            signature = _signature(infos)
            checked_at = now
            if cached is not None and signature == cached.signature and not cached.reads_from(failed):
                cached.checked_at = now
                state.known = (infos, signature, now)
                return cached
            if signature != state.validated:
                # First read, or the layer changed: check its layout and that its heads are the manifest's (a
                # failover to the same tables does not).
                checked = self._check_heads(lay, infos, timeout_ms)
                if checked is not infos:  # written again meanwhile: the heads the manifest names, as now located
                    infos, signature = checked, _signature(checked)
                self.clear_cache(lay, signature)  # rows cached under an earlier placement: not this layer's now
                state.validated = signature
            state.known = (infos, signature, now)
        placement = self._build(lay, infos, failed, signature, checked_at)
        if not local and placement.memory.sources and not placement.local_checked:
            placement = self._build(lay, infos, failed, signature, checked_at, local=False)
        with lay.lock:
            state.placement = placement
        return placement

    def _check_heads(self, lay: Layer, infos: list, timeout_ms: int | None) -> list:
        """``check_published`` with the heads as ``infos`` located them; returns the heads checked. They were located
        before the manifest was read, so a layer removed and populated again in between looks mixed: the heads are
        located again, and a mix is refused only where they are the same objects both times (a layer that keeps
        changing is refused after a few looks)."""
        for look in range(LOOKS):
            try:
                self.check_published(lay, [getattr(info, "checksum", "") for info in infos])
                return infos
            except MixedLayer:
                if look == LOOKS - 1:
                    raise
                again = self.native.locate(lay.keys, lease=False, timeout_ms=timeout_ms)
                if _objects(again) == _objects(infos):
                    raise
                infos = again
        raise AssertionError("unreachable")

    def _build(self, lay: Layer, infos: list, failed: set[str], signature: tuple, checked_at: float,
               local: bool = True) -> Placement:
        """Which heads are read in place (a segment mapped on this host; none when not ``local``) and which from
        which server."""
        native = self.native
        lay.counters.add(placement_refreshes=1)
        local_tables: list[tuple[int, np.ndarray]] = []
        mapped: dict[str, list] = {}  # segment id -> [(table, offset, bytes, generation)] of the heads read in place
        remote: dict[str, list[tuple[int, int, Any]]] = {}
        for h, info in enumerate(infos):
            nbytes = lay.sizes[h] * lay.row_bytes
            if info.size != nbytes:
                raise StoreError(f"key {info.key!r} holds {info.size} bytes, but table_vocab_sizes[{h}] x "
                                 f"row bytes = {nbytes}; the stored layer was written with another geometry")
            live = [r for r in info.replicas if r.address not in failed]
            if not live:
                raise SegmentUnavailable(f"layer {lay.layer_id}: segment {', '.join(r.address for r in info.replicas)}"
                                         f" holding head {lay.heads[h]} ({info.key!r}) did not answer, and no other "
                                         "replica of it is left")
            for r in live if local else ():
                view = native.local_view(r)
                if view is not None and 0 <= r.offset <= view.size - nbytes:
                    local_tables.append((h, view[r.offset:r.offset + nbytes]))
                    mapped.setdefault(r.segment_id, []).append((native.local_table(r), r.offset, nbytes,
                                                                r.generation))
                    break
            else:
                r = live[h % len(live)]
                remote.setdefault(r.address, []).append((h, r.offset, r))
        order, bases, groups, checks = [], [], [], []
        for address, entries in remote.items():
            j0 = len(order)
            order += [h for h, _, _ in entries]
            bases += [offset for _, offset, _ in entries]
            groups.append((address, native.read_endpoints(entries[0][2]), j0, len(order)))
            checks.append(_kernels.readonly(_kernels.check_pairs_for(
                np.array([offset for _, offset, _ in entries], dtype=np.int64),
                np.array([lay.sizes[h] * lay.row_bytes for h, _, _ in entries], dtype=np.int64),
                np.array([r.generation for _, _, r in entries], dtype=np.int64))))
        # A segment with a table whose put is unknown (generation 0) cannot prove it: no table to check against.
        local_checks = tuple(MappedCheck(heads[0][0] if all(gen for *_, gen in heads) else None,
                                         _kernels.readonly(_kernels.check_pairs_for(
                                             *(np.array(column, dtype=np.int64) for column in list(zip(*heads))[1:]))),
                                         max(offset + nbytes for _, offset, nbytes, _ in heads),
                                         native.local_shrunk_probe(segment_id))
                             for segment_id, heads in mapped.items())
        checked = all(check.table is not None for check in local_checks)
        ttl, stale = _ttls(local, local_tables, remote)
        return Placement(InMemory.of(lay, local_tables), groups,
                         _kernels.readonly(np.asarray(order, dtype=np.int64)),
                         _kernels.readonly(np.asarray(bases, dtype=np.int64)), signature, checked_at, tuple(checks),
                         local_checks, checked, ttl, stale)

    def _trouble(self) -> bool:
        """Whether a placement check failed recently (then lookups do not wait for the master)."""
        return time.monotonic() - self._trouble_at < MASTER_RETRY_S

    def _unreachable(self, lay: Layer, exc: Exception) -> None:
        now = time.monotonic()
        self._trouble_at = now
        if now - self._warned_at >= MASTER_WARN_INTERVAL_S:
            self._warned_at = now
            log.warning("layer %d: the master did not answer a placement check (%s); reading from the placement it "
                        "gave %.1f s ago, and checking again in the background", lay.layer_id, exc,
                        now - lay.state.known[2])

    def refresh_later(self, lay: Layer) -> None:
        """Check the layer's placement with the master in a background thread (one check per layer at a time)."""
        with self._lock:
            if lay.state.refreshing == _fork.pid() or self._closed:
                return  # (a check the parent had running at a fork is not running in the child)
            lay.state.refreshing = _fork.pid()
            if self._refresher is None:
                self._refresher = ThreadPoolExecutor(1, thread_name_prefix="engram-placement")
            refresher = self._refresher
        refresher.submit(self._refresh, lay)

    def _refresh(self, lay: Layer) -> None:
        state = lay.state
        if state is None:  # the EngramStore closed meanwhile
            return
        try:
            # Bounded like a lookup's own check: a client closing (or exiting) waits for this call at most so long.
            self.resolve(lay, set(), timeout_ms=min(self.native.timeout_ms, REFRESH_TIMEOUT_MS))
        except Unavailable:
            pass  # logged by resolve; the next lookup past the TTL asks again
        except EngramError as exc:  # the layer is gone or changed: the next lookup resolves it and says so
            log.info("layer %d: placement check found %s; resolving again on the next lookup", lay.layer_id, exc)
            with lay.lock:
                state.placement = None
        except Exception:
            log.exception("layer %d: placement check failed", lay.layer_id)
        finally:
            state.refreshing = 0

    def close(self) -> None:
        with self._lock:
            self._closed = True
            refresher, self._refresher = self._refresher, None
        if refresher is not None:
            refresher.shutdown(wait=False, cancel_futures=True)  # a check waiting on a paused master ends by itself


def _signature(infos: list) -> tuple:
    """Where each head is: its size and replicas. The generation (the put that wrote a table) tells a layer written
    again in the same place apart."""
    return tuple((info.size, tuple((r.segment_id, r.address, r.offset, r.generation) for r in info.replicas))
                 for info in infos)


def _objects(infos: list) -> list:
    """Which object each head is (the puts that wrote its replicas)."""
    return [tuple(r.generation for r in info.replicas) for info in infos]
