"""Read planning: which rows go out in which requests, in which rounds, and what happens when a server fails.

For a store's layers (:func:`read_native`): tables mapped on this host are gathered in place; a layer whose remote
heads all sit on one server asks for each (m, h) row in output order, so the reply lands in the output as it is
(no sort, no deduplication, no scatter: a repeated row travels again, which costs less than sorting and
scattering at every size measured, ``bench/bench_read_plans.py``); a layer spread over several servers reads each
distinct row once and scatters it. Every layer of a call that goes to one server travels in one request, all
servers at once; large lookups go in rounds of at most READ_ROUND_BYTES of output and READ_ROUND_ROWS rows, so no
request outgrows a segment's limits; heads on a server that fails are re-resolved and read from another replica.

:func:`read_jobs` sends each source its jobs (sources on the same store together); ``EngramStore``'s
``lookup_many`` and ``prefetch_many`` read the layers of several EngramStores with it.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from .. import _fork
from .. import kernels as _kernels
from ..errors import InvalidType, NotConnected, SegmentUnavailable, StalePlacement, StoreError, describe
from ._placement import Placement
from ._source import Job

log = logging.getLogger(__name__)

#: A lookup from the native store reads at most this many output bytes and rows per round (one request per
#: segment server); a larger one, or several layers batched together, is read in several rounds. This keeps
#: every request well inside a segment's limits (MAX_READ_BYTES, MAX_RANGES).
READ_ROUND_BYTES = 64 << 20
READ_ROUND_ROWS = 1 << 20
#: A remote lookup of at most this many rows, with every head of its layer on one server, reads each (m, h) row
#: as it is into the output. A layer spread over several servers reads each distinct row once and scatters it:
#: there the reply is not the output, and placing it by head cost more than deduplication saved once rows repeat.
DIRECT_MAX_ROWS = READ_ROUND_ROWS
#: How many times a lookup re-resolves placement after a segment fails before giving up.
FAILOVER_ROUNDS = 2
#: Said of a read in place of a failed server's address: a segment refused it as stale (the layer must be
#: resolved again with the master; no server failed).
STALE = "(stale placement)"


class LookupHandle:
    """A lookup that may be running in the background: ``done()``, ``result(timeout=None)``, ``cancel()``.

    ``result()`` returns the rows (the caller's ``out`` buffer if one was given) or raises what the read raised.
    The one handle type of the project's background reads: the Engram modules' prefetch handles are this, with
    what their ``forward`` checks added.
    """

    def __init__(self, future: Future, row_ids: Any):
        self._future = future
        self.row_ids = row_ids

    @property
    def future(self) -> Future:
        """The read's :class:`concurrent.futures.Future` (for ``add_done_callback``, ``asyncio.wrap_future``)."""
        return self._future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Any:
        return self._future.result(timeout)

    def cancel(self) -> bool:
        return self._future.cancel()


def read_jobs(jobs: list[Job]) -> None:
    """Read validated jobs ``(source, layer, ids [M, H], out bytes)``: each source reads its own, and sources that
    share a batch key (EngramStores on one store) read theirs together."""
    groups: dict[Any, list[Job]] = {}
    for job in jobs:
        key = job.source.batch_key
        groups.setdefault(id(job) if key is None else key, []).append(job)
    for group in groups.values():
        group[0][0].read(group)


def fits_one_round(ids: np.ndarray, flat: np.ndarray) -> bool:
    """Whether a lookup of ``ids`` into ``flat`` (output bytes) is read in one round (see READ_ROUND_BYTES)."""
    return ids.size <= READ_ROUND_ROWS and flat.size <= READ_ROUND_BYTES


def _read_rounds(jobs: list[Job]) -> list[list]:
    """``jobs`` regrouped into rounds of at most READ_ROUND_BYTES of output and READ_ROUND_ROWS rows each, in
    order: a larger job is cut into position ranges."""
    rounds: list[list] = []
    current: list = []
    size = rows = 0
    for job in jobs:
        owner, lay, ids, flat = job.source, job.layer, job.ids, job.out
        M, H = ids.shape
        per_m = H * lay.row_bytes
        if fits_one_round(ids, flat):
            pieces = [(ids, flat)]
        else:
            step = max(1, min(READ_ROUND_BYTES // per_m, READ_ROUND_ROWS // H))
            pieces = [(ids[m0:m0 + step], flat[m0 * per_m:(m0 + step) * per_m]) for m0 in range(0, M, step)]
        for ids_part, flat_part in pieces:
            if current and (size + flat_part.size > READ_ROUND_BYTES or rows + ids_part.size > READ_ROUND_ROWS):
                rounds.append(current)
                current, size, rows = [], 0, 0
            current.append(Job(owner, lay, ids_part, flat_part))
            size += flat_part.size
            rows += ids_part.size
    if current:
        rounds.append(current)
    return rounds


def read_native(native: Any, jobs: list[Job], failed: set[str] | None = None) -> None:
    """Read jobs ``(owner, layer, ids [M, H], out bytes)`` from one DistributedStore: tables mapped on this
    host are gathered in place; the rest goes out as one request per segment server for all jobs, all at
    once (in rounds of at most READ_ROUND_BYTES); heads on a server that fails (or is in ``failed`` already)
    are re-resolved and read from another replica."""
    failed = set(failed or ())
    for round_jobs in _read_rounds(jobs):
        _read_round(native, round_jobs, failed)
    for job in jobs:  # one lookup per job, however many rounds it took
        job.layer.counters.add(lookups=1)


def _read_round(native: Any, jobs: list[Job], failed: set[str]) -> None:
    """One round of :func:`read_native`; servers that fail are added to ``failed``, for the next rounds."""
    pending = jobs
    for round_ in range(FAILOVER_ROUNDS + 1):
        remote_jobs, cached_jobs, placed = [], [], []
        counts: dict[int, dict] = {}  # remote counters of this attempt, per job: counted only if the job is done
        for job in pending:
            owner, lay, ids, flat = job.source, job.layer, job.ids, job.out
            placement = owner.placements.get(lay, failed)
            placed.append(placement)
            try:
                owner.placements.gather(lay, placement, ids, flat, owner.threads)
            except StalePlacement as exc:  # a mapped table was written over: resolved again in the next round
                owner.placements.stale(lay, exc)
                continue
            if placement.remote:
                jobs_of = cached_jobs if lay.state.cache is not None else remote_jobs
                jobs_of.append((owner, lay, placement, ids, flat))
        bad = _read_remote(native, remote_jobs, counts) if remote_jobs else set()
        for owner, lay, placement, ids, flat in cached_jobs:
            bad |= owner.read_cached(lay, placement, ids, flat, counts)
        retry = []
        for job, placement in zip(pending, placed):
            lay, ids, flat = job.layer, job.ids, job.out
            if lay.state.stale is not None and lay.state.placement is None:
                retry.append(job)  # a segment refused it as stale: ask the master again
            elif any(address in bad for address, *_ in placement.remote):
                retry.append(job)
                with lay.lock:
                    lay.state.placement = None  # re-resolve: the master may have dropped the dead segment
            else:
                lay.counters.add(rows=ids.size, local_rows=placement.memory.heads * ids.shape[0], retries=round_,
                                 **counts.get(id(flat), {}))
        if not retry:
            return
        stale = any(job.layer.state.stale is not None for job in retry)  # (a STALE in bad marked its layer)
        bad.discard(STALE)
        failed |= bad
        log.warning("layers %s: %s; retrying", sorted({job.layer.layer_id for job in retry}),
                    "; ".join(([f"segment(s) {sorted(bad)} failed"] if bad else [])
                              + (["a segment refused the placement as stale"] if stale else [])))
        pending = retry
    raise _exhausted(pending, failed)


def _exhausted(pending: list[Job], failed: set[str]) -> StoreError:
    """The error of a round whose jobs still failed after every failover: StalePlacement where each replica tried
    last refused its layer's placement as stale (the master kept naming objects its segments had removed or written
    over), SegmentUnavailable otherwise."""
    layers = sorted({job.layer.layer_id for job in pending})
    stale = [job.layer.state.stale for job in pending if job.layer.state.stale is not None]
    if len(stale) == len(pending):
        return StalePlacement(f"layers {layers}: every replica refused the master's placement as stale "
                              f"{FAILOVER_ROUNDS + 1} times, the last: {stale[0]}")
    also = f"; and some were refused as stale: {stale[0]}" if stale else ""
    return SegmentUnavailable(f"layers {layers}: no live replica answered for some heads "
                              f"(failed: {', '.join(sorted(failed)) or 'none'}){also}")


def reads_direct(placement: Placement, ids: np.ndarray) -> bool:
    """Whether a remote read asks for each (m, h) row in output order (see DIRECT_MAX_ROWS): every head of the
    layer on one server, and at most DIRECT_MAX_ROWS rows."""
    return not placement.memory.sources and len(placement.remote) == 1 and ids.size <= DIRECT_MAX_ROWS


def tally(counts: dict, flat: np.ndarray, **deltas: int) -> None:
    """Add counters of one attempt at the job whose output is ``flat``."""
    entry = counts.setdefault(id(flat), {})
    for name, delta in deltas.items():
        entry[name] = entry.get(name, 0) + delta


class Part(NamedTuple):
    """One layer's share of a request to one segment server."""
    owner: Any
    layer: Any
    scatter: tuple | None  # (plan, heads, first row) to scatter the reply's distinct rows; None: read in output order
    pairs: np.ndarray      # its byte ranges
    rows: int              # rows its ranges return
    out: np.ndarray        # the job's output bytes


def server_parts(owner: Any, lay: Any, placement: Placement, ids: np.ndarray, flat: np.ndarray) -> list[Part]:
    """A layer's remote read of ``ids`` into ``flat`` as one part per server of ``placement.remote``, in its order:
    where every head is on one server (:func:`reads_direct`), each (m, h) row in output order, so that the reply is
    the output; else each distinct row once, to be scattered (see DIRECT_MAX_ROWS)."""
    if reads_direct(placement, ids):
        pairs = _kernels.direct_pairs_unchecked(ids, placement.order, placement.bases, lay.row_bytes)
        return [Part(owner, lay, None, pairs, ids.size, flat)]
    plan = _kernels.plan_reads(ids, placement.order, placement.bases, lay.row_bytes, checked=True)
    return [Part(owner, lay, (plan, placement.order[j0:j1], int(plan.head_rows[j0])),
                 plan.pairs[plan.head_ranges[j0]:plan.head_ranges[j1]], int(plan.head_rows[j1] - plan.head_rows[j0]),
                 flat) for _, _, j0, j1 in placement.remote]


def place_reply(part: Part, data: np.ndarray, address: str) -> None:
    """Put the reply of ``part`` (``data``, its bytes, read-only uint8) into its output: copied where it was not
    received there already, or scattered."""
    lay, flat = part.layer, part.out
    if part.scatter is None:
        if data.size < flat.size:
            raise StoreError(f"layer {lay.layer_id}: {address} returned too few rows")
        if flat.ctypes.data != data.ctypes.data:
            flat[:] = data[:flat.size]
        return
    plan, heads, r0 = part.scatter
    if data.size < part.rows * lay.row_bytes \
            or _kernels.scatter_rows_prepared(data, plan.inverse, heads, r0, lay.row_bytes, flat) >= 0:
        raise StoreError(f"layer {lay.layer_id}: {address} returned too few rows")


class _Request(NamedTuple):
    """A request to one segment server: where it goes, the layers' parts, the checks of the tables it reads."""
    endpoint: str
    parts: list
    checks: list


def _requests(native: Any, jobs: list) -> dict[str, _Request]:
    """Every job's remote heads as parts of one request per segment server (by address), each led by the checks
    of the tables it reads."""
    requests: dict[str, _Request] = {}  # by segment address
    for owner, lay, placement, ids, flat in jobs:
        for (address, endpoints, _, _), checks, part in zip(placement.remote, placement.checks,
                                                            server_parts(owner, lay, placement, ids, flat)):
            request = requests.setdefault(address, _Request(native.pick_endpoint(endpoints), [], []))
            request.parts.append(part)
            request.checks.append(checks)
    return requests


def _read_remote(native: Any, jobs: list, counts: dict) -> set[str]:
    """One read per segment server for every job's remote heads; scatter the replies; the addresses that failed.

    A job whose heads all live on one server reads its rows as they are, in output order (the reply is its
    output); others read each distinct row once and scatter it (see :func:`server_parts`)."""
    requests = _requests(native, jobs)
    batch, outs = [], []
    for request in requests.values():
        # The checks of every table read lead the request (the segment serves it only while they all hold).
        pieces = [c for c in request.checks if c.size] + [part.pairs for part in request.parts]
        batch.append((request.endpoint, pieces[0] if len(pieces) == 1 else np.concatenate(pieces)))
        lone = request.parts[0]
        outs.append(lone.out if len(request.parts) == 1 and lone.scatter is None else None)  # straight into the output
    results = native.read_pairs_many(batch, outs)
    failed = set()
    for (address, request), result in zip(requests.items(), results):
        parts = request.parts
        if isinstance(result, BaseException):
            if isinstance(result, SegmentUnavailable):
                failed.add(address)
                continue
            if isinstance(result, StalePlacement):
                for part in parts:
                    part.owner.placements.stale(part.layer, result)
                failed.add(STALE)
                continue
            raise result
        data = _kernels.readonly(np.frombuffer(result, dtype=np.uint8))
        pos = 0
        for part in parts:
            n = part.rows * part.layer.row_bytes
            place_reply(part, data[pos:pos + n], address)
            tally(counts, part.out, remote_requests=1, remote_rows=part.rows, remote_bytes=n)
            pos += n
    return failed


class Background:
    """The pool that reads in the background for one owner (an EngramStore): two threads, made on first use,
    refused once closed."""

    def __init__(self, owner: str, thread_name: str) -> None:
        self._owner, self._thread_name = owner, thread_name
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise NotConnected(f"{self._owner} is closed")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix=self._thread_name)
            return self._executor

    def forked(self) -> None:
        """In a forked child: the parent's pool has no thread here and its lock may be held; made again on use."""
        _fork.keep(self._executor)
        self._lock, self._executor = threading.Lock(), None

    def close(self) -> None:
        """Refuse new reads and wait for those running; safe to call twice."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


def layer_jobs(row_ids: Mapping[Any, Any], out: Mapping[Any, Any] | None, job: Callable[..., tuple[Job, Any]],
               layer_id: Callable[[Any], Any]) -> tuple[list[Job], dict[Any, Any]]:
    """The checked jobs of a call over several layers (``{layer_id: [B, L, H] ids}``, ``out`` a buffer per layer or
    None), and what it returns (``{layer_id: rows}``): ``job(row_ids, out, layer)`` makes one, ``layer_id(layer)`` is
    the id the result is keyed by."""
    if not isinstance(row_ids, Mapping) or not row_ids:
        raise InvalidType(f"row_ids: expected a non-empty {{layer_id: [B, L, H] ids}} mapping, "
                          f"got {describe(row_ids)}")
    if out is not None and not isinstance(out, Mapping):
        raise InvalidType(f"out: expected a {{layer_id: buffer}} mapping or None, got {type(out).__name__}")
    jobs, results = [], {}
    for lid, layer_row_ids in row_ids.items():
        one, results[layer_id(lid)] = job(layer_row_ids, out.get(lid) if out is not None else None, lid)
        jobs.append(one)
    return jobs, results


def start_reads(jobs: list, result: Any, row_ids: Any, background: ThreadPoolExecutor | None) -> LookupHandle:
    """Read ``jobs`` in ``background`` (an executor), or now when it is None; the handle's ``result()`` is
    ``result`` once they are read (or raises what the read raised)."""
    def run() -> Any:
        read_jobs(jobs)
        return result

    if background is not None:
        return LookupHandle(background.submit(run), row_ids)
    future: Future = Future()
    try:
        future.set_result(run())
    except BaseException as exc:
        future.set_exception(exc)
    return LookupHandle(future, row_ids)
