"""Remote lookups at the cadence serving uses, beside a bare blocking TCP echo of the same bytes in the same run.

    python bench/bench_cadence.py [--quick] [--sections single,clients,cold] [--spacings 0,1,5,30]
                                  [--busy none,py,np,py+np] [--shapes b1,b64,prefill] [--clients 4]
                                  [--placements together,apart,shared] [--passes N] [--json PATH]

A serving engine reads its Engram rows once per model step and layer group, milliseconds to tens of
milliseconds apart, on a host whose cores are busy with the model. Back-to-back calls hide what that costs: by the
next step the caches, the branch predictors and the scheduler's favour are gone, and a busy model thread holds
the GIL. So the calls here are spaced as serving spaces them, with busy "model" threads in the client process,
and every lookup is measured beside its floor:

- remote: ``EngramStore.lookup`` through ``DistributedStore.connect(master, local_direct=False)`` against one
  ``engram-segment`` process on this host (default readers), so every row comes over the raw read channel;
- tcp: a bare blocking TCP round trip carrying the same request bytes (header, checks, ranges) and the same reply
  bytes (header, rows), answered by a Python thread in its own process that does nothing else (``_common.TcpEcho``).

Sections:

- single: one client process. For every busy set, shape and spacing the two paths alternate in short rounds
  (ROUND_CALLS calls each, the first path alternating), and the configurations are visited round-robin in
  ``--passes`` passes, so a burst of noise on a shared machine lands on both paths and spreads over all cells.
- clients: ``--clients`` client processes (4) at 30 ms spacing against the same segment, each alternating the two
  paths as above; p50 and p99 over every call of every process.
- cold: where a spaced lookup's time goes, with the CPU caches flushed before every call (a pass over 64 MiB) as a
  model step's work flushes them: the lookup, the bare kernel read it makes (``DistributedStore.read_direct`` of
  the same rows into a ready buffer: the round trip and nothing else) and the echo, taking turns; the Python around
  the read is the difference.

Spacings: 0 (back to back), 1, 5 and 30 ms (a decode step): the next call starts that long after the last one
started (calls that take longer start at once). Shapes: B=1 and B=64 of Mooncake's scenario (8 heads x 50,000
rows x D=16 float32, L=1: 8 and 512 rows, 512 B and 32 KiB), and a DeepSeek-V4.1 prefill chunk (4,096 tokens x
48 columns, the 24 of each of its two Engram layers, of 264-byte FP8 rows: 52 MB; 48 heads x 8,192 rows here).
Busy sets: none; py (one thread of pure-Python arithmetic: holds the GIL, giving it up every switch interval);
np (one thread of NumPy matmuls: releases the GIL inside BLAS and keeps the cores busy); py+np (both).

Placements (where the threads run; every section is run under each):

- together: the client's calling thread and both servers on the first CPU, the busy threads (and BLAS's) on any:
  each round trip is two hand-offs on one CPU, the floor of a wake-up.
- apart: both servers on the last CPU, the whole client process (busy threads and BLAS's too) on the others: a
  round trip crosses CPUs both ways, as it does to a segment on another host, whose cores the model does not use.
- shared: no pinning; the scheduler places everything. On a few CPUs one of the two servers then shares the
  client's CPU and the other does not, which one is settled in a cell's first calls and lasts it, and a
  round trip that crosses CPUs costs tens of microseconds more on a virtual machine whose idle CPUs halt: a
  ratio here says which server the scheduler put beside the client as much as what the code costs.

Columns: p50 and p99 of each path in microseconds, remote/tcp at each, and the share of each path's calls that
took 1 ms or more (a busy thread that holds the GIL keeps it up to a switch interval, 5 ms, from about 1% of
either path's calls: a p99 then says on which side of that 1% a path fell). Targets (p50 within 1.5x of the
echo, p99 within 2x, at every spacing and busy set for B <= 64) are checked and printed per placement;
``bench/results/bench_cadence.json`` holds every cell. Quiet the machine first: the fault explorer and other benchmarks move
these numbers far more than the code does.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import ExitStack

import numpy as np

from _common import TIMEOUT_MS, Stats, TcpEcho, TcpEchoClient, default_json_path, fmt, print_table, start_cluster, \
    write_json
from engram_store import DistributedStore, EngramStore, EngramStoreConfig
from engram_store import kernels as _kernels

MOONCAKE_HEADS, MOONCAKE_ROWS, MOONCAKE_DIM = 8, 50_000, 16
PREFILL_HEADS, PREFILL_ROWS, PREFILL_ROW_BYTES, PREFILL_TOKENS = 48, 8_192, 264, 4_096
#: name -> (layer id, B, L): the Mooncake layer (1) at B=1 and B=64, the V4.1-shaped layer (2) at a prefill chunk.
SHAPES = {"b1": (1, 1, 1), "b64": (1, 64, 1), "prefill": (2, 1, PREFILL_TOKENS)}
SPACINGS_MS = (0.0, 1.0, 5.0, 30.0)
BUSY = ("none", "py", "np", "py+np")
PLACEMENTS = ("together", "apart", "shared")
#: A call this slow or slower waited for something other than the round trip (the GIL, the scheduler).
SLOW_S = 1e-3
#: Calls of one path in a row before the other path takes over.
ROUND_CALLS = 5
#: Calls per path and cell over the whole run, by spacing (ms); the prefill shape takes PREFILL_CALLS.
CALLS = {0.0: 1000, 1.0: 600, 5.0: 400, 30.0: 300}
PREFILL_CALLS = 30
QUICK_DIVISOR = 6
ID_POOL = 16
P50_TARGET, P99_TARGET = 1.5, 2.0
CLIENTS_SPACING_MS = 30.0
#: The cold section: calls per path, and the bytes passed over before each call to flush the caches.
COLD_CALLS = 600
COLD_SCRATCH_BYTES = 64 << 20


# ---- busy "model" threads -----------------------------------------------------------------------------------------

class Busy:
    """Threads that keep this process busy as a model would: ``py`` holds the GIL, ``np`` runs BLAS without it."""

    def __init__(self, kind: str, cpus: set[int] | None = None):
        self.kind = kind
        self.cpus = cpus  # where the busy threads may run (None: where the thread that starts them may)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(target,), daemon=True, name=f"busy-{name}")
                         for name, target in (("py", self._python), ("np", self._numpy)) if name in kind.split("+")]

    def _run(self, target) -> None:
        if self.cpus is not None:
            os.sched_setaffinity(0, self.cpus)
        target()

    def _python(self) -> None:
        x = 0
        while not self._stop.is_set():
            for i in range(2000):  # pure-Python arithmetic: the interpreter, and the GIL, all the time
                x += i * i

    def _numpy(self) -> None:
        rng = np.random.default_rng(0)
        a, b = rng.random((256, 256)), rng.random((256, 256))
        while not self._stop.is_set():
            a @ b  # BLAS: the GIL released, the cores busy

    def __enter__(self) -> "Busy":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


class Placement:
    """Where a placement (see the module's docstring) runs the client's calling thread (``caller``), the rest of
    the client process (``model``: busy threads, BLAS's) and the servers (``servers``), among ``cpus``."""

    def __init__(self, name: str, cpus: set[int]):
        self.name = name
        ordered = sorted(cpus)
        if name == "shared" or len(ordered) < 2:
            self.caller = self.model = self.servers = set(ordered)
        elif name == "together":
            self.caller = self.servers = {ordered[0]}
            self.model = set(ordered)
        else:  # apart
            self.servers = {ordered[-1]}
            self.caller = self.model = set(ordered[:-1])

    def pin_client(self) -> None:
        """This process: the calling thread on ``caller``, every other thread (BLAS's) on ``model``."""
        me = threading.get_native_id()
        for tid in _threads_of(os.getpid()):
            _pin(tid, self.caller if tid == me else self.model)

    def pin_servers(self, pids: list[int]) -> None:
        """Every thread of these processes on ``servers`` (threads they start later inherit it)."""
        for pid in pids:
            for tid in _threads_of(pid):
                _pin(tid, self.servers)


def _threads_of(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def _pin(tid: int, cpus: set[int]) -> None:
    try:
        os.sched_setaffinity(tid, cpus)
    except (ProcessLookupError, PermissionError):
        pass  # a thread that ended meanwhile


# ---- the layers and their calls -------------------------------------------------------------------------------

def _configs() -> dict[int, EngramStoreConfig]:
    return {1: EngramStoreConfig([MOONCAKE_ROWS] * MOONCAKE_HEADS, MOONCAKE_DIM),
            2: EngramStoreConfig([PREFILL_ROWS + 7 * h for h in range(PREFILL_HEADS)], PREFILL_ROW_BYTES,
                                 row_format="bytes")}


def _tables(config: EngramStoreConfig, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    dtype = np.uint8 if config.row_format == "bytes" else np.float32
    if dtype == np.uint8:
        return [rng.integers(0, 256, (n, config.embedding_dim), dtype=np.uint8) for n in config.table_vocab_sizes]
    return [rng.random((n, config.embedding_dim), dtype=np.float32) for n in config.table_vocab_sizes]


class Calls:
    """One shape's two calls on one client: a remote lookup, and the echo of the same bytes."""

    def __init__(self, layer: EngramStore, config: EngramStoreConfig, batch: int, length: int, tcp: TcpEchoClient,
                 seed: int, tables: list[np.ndarray] | None = None):
        rng = np.random.default_rng(seed)
        sizes = config.table_vocab_sizes
        self.layer, self.tcp = layer, tcp
        self.ids = [np.stack([rng.integers(0, n, (batch, length)) for n in sizes], axis=-1) for _ in range(ID_POOL)]
        first = layer.lookup(self.ids[0])  # resolves the placement the echo's bytes come from
        if tables is not None:
            expected = np.stack([tables[h][self.ids[0][..., h]] for h in range(len(sizes))], axis=-2)
            assert np.array_equal(first, expected), "the remote lookup returned rows that differ from NumPy's"
        lay = layer._layer(None)
        placement = layer._source.placements.get(lay, set())
        self.requests = []  # the lookup's own request body (checks and ranges) and its reply's size, per id batch
        for ids in self.ids:
            ids2 = ids.reshape(-1, len(sizes))
            pairs = _kernels.direct_pairs(ids2, placement.order, placement.bases, lay.row_bytes)
            body = np.concatenate((placement.checks[0], pairs)) if placement.checks[0].size else pairs
            self.requests.append((body.tobytes(), int(pairs[:, 1].sum())))

    def remote(self, i: int) -> None:
        self.layer.lookup(self.ids[i % ID_POOL])

    def echo(self, i: int) -> None:
        self.tcp.round_trip(*self.requests[i % ID_POOL])


def _alternate(calls: Calls, spacing_ms: float, n: int, first: int, samples: dict) -> None:
    """``n`` calls of each path at ``spacing_ms``, ROUND_CALLS at a time, the paths taking turns (``first``: which
    leads); durations in ns appended to ``samples["remote"]`` and ``samples["tcp"]``."""
    paths = [("remote", calls.remote), ("tcp", calls.echo)]
    if first % 2:
        paths.reverse()
    spacing_s = spacing_ms / 1e3
    done = 0
    next_at = time.perf_counter()
    while done < n:
        k = min(ROUND_CALLS, n - done)
        for name, call in paths:
            out = samples[name]
            for j in range(k):
                if spacing_s:
                    wait = next_at - time.perf_counter()
                    if wait > 0:
                        time.sleep(wait)
                t0 = time.perf_counter()
                call(len(out))
                out.append(time.perf_counter() - t0)
                next_at = t0 + spacing_s
        done += k


def _cell(samples: dict) -> dict:
    remote = Stats.from_ns([int(s * 1e9) for s in samples["remote"]]).as_dict()
    tcp = Stats.from_ns([int(s * 1e9) for s in samples["tcp"]]).as_dict()
    return {"remote": remote, "tcp": tcp, "ratio_p50": remote["p50_us"] / tcp["p50_us"],
            "ratio_p99": remote["p99_us"] / tcp["p99_us"],
            "slow_share": {name: float(np.mean(np.asarray(samples[name]) >= SLOW_S)) for name in ("remote", "tcp")}}


# ---- sections ---------------------------------------------------------------------------------------------------

def _single(master: str, echo: str, tables: dict, placements: list[Placement], servers: list[int],
            args) -> list[dict]:
    """Every placement x busy set x shape x spacing in one client process, visited round-robin in ``args.passes``
    passes."""
    configs = _configs()
    cells: dict[tuple, dict] = {}
    with DistributedStore.connect(master, timeout_ms=TIMEOUT_MS, local_direct=False) as store, \
            TcpEchoClient(echo) as tcp:
        calls = {}
        for shape in args.shapes:
            layer_id, batch, length = SHAPES[shape]
            layer = EngramStore(layer_id, configs[layer_id], store)
            calls[shape] = Calls(layer, configs[layer_id], batch, length, tcp, seed=batch * 7 + length,
                                 tables=tables[layer_id])
            for i in range(20 if shape != "prefill" else 3):  # warm: kernels, connections, serving threads
                calls[shape].remote(i)
                calls[shape].echo(i)
        order = [(placement, busy, shape, spacing) for placement in placements for busy in args.busy
                 for shape in args.shapes for spacing in args.spacings]
        for p in range(args.passes):
            t0 = time.perf_counter()
            placed = None
            for k, (placement, busy, shape, spacing) in enumerate(order):
                if placement is not placed:
                    placement.pin_client()
                    placement.pin_servers(servers)
                    placed = placement
                total = PREFILL_CALLS if shape == "prefill" else CALLS.get(spacing, 300)
                n = max(ROUND_CALLS, total // (QUICK_DIVISOR if args.quick else 1) // args.passes)
                samples = cells.setdefault((placement.name, busy, shape, spacing), {"remote": [], "tcp": []})
                with Busy(busy, placement.model):
                    time.sleep(0.05)  # the busy threads under way
                    _alternate(calls[shape], spacing, n, p + k, samples)
            print(f"pass {p + 1}/{args.passes}: {time.perf_counter() - t0:.0f} s", flush=True)
        for c in calls.values():
            c.layer.close()
    results = []
    for (placement, busy, shape, spacing), samples in cells.items():
        _, batch, length = SHAPES[shape]
        rows = batch * length * (PREFILL_HEADS if shape == "prefill" else MOONCAKE_HEADS)
        results.append({"placement": placement, "busy": busy, "shape": shape, "B": batch, "L": length,
                        "rows": rows, "spacing_ms": spacing, **_cell(samples)})
    return results


def _cold(master: str, echo: str, placement: Placement, servers: list[int], args) -> list[dict]:
    """B=1 and B=64 lookups, their bare kernel reads and the echo, caches flushed before each call."""
    configs = _configs()
    placement.pin_servers(servers)
    scratch = np.zeros(COLD_SCRATCH_BYTES // 4, dtype=np.int32)
    n = COLD_CALLS // (QUICK_DIVISOR if args.quick else 1)
    out = []
    with DistributedStore.connect(master, timeout_ms=TIMEOUT_MS, local_direct=False) as store, \
            TcpEchoClient(echo) as tcp:
        placement.pin_client()
        for shape in ("b1", "b64"):
            layer_id, batch, length = SHAPES[shape]
            layer = EngramStore(layer_id, configs[layer_id], store)
            calls = Calls(layer, configs[layer_id], batch, length, tcp, seed=batch * 11 + length)
            for i in range(20):
                calls.remote(i)
            lay = layer._layer(None)
            lean = lay.state.lean  # how the lookup reads the layer in one kernel call
            if lean is None:
                raise RuntimeError("the layer is not read in one kernel call here (one segment, local_direct=False)")
            ids2 = [ids.reshape(-1, lay.num_heads) for ids in calls.ids]
            flat = np.empty(ids2[0].size * lay.row_bytes, dtype=np.uint8)

            def kernel(i: int) -> None:
                if not store.read_direct(lean.endpoint or store.pick_endpoint(lean.endpoints), lean.plan,
                                         ids2[i % ID_POOL], lay.row_bytes, flat):
                    raise RuntimeError("the bare kernel read did not go out")

            paths = [("lookup", calls.remote), ("kernel", kernel), ("tcp", calls.echo)]
            samples: dict[str, list[float]] = {name: [] for name, _ in paths}
            for k in range(n):
                for name, call in paths[k % 3:] + paths[:k % 3]:
                    scratch += 1  # the caches, as a model step leaves them
                    t0 = time.perf_counter()
                    call(k)
                    samples[name].append(time.perf_counter() - t0)
            layer.close()
            stats = {name: Stats.from_ns([int(v * 1e9) for v in values]).as_dict() for name, values in samples.items()}
            out.append({"placement": placement.name, "shape": shape, "rows": batch * length * MOONCAKE_HEADS, **stats,
                        "python_us": stats["lookup"]["p50_us"] - stats["kernel"]["p50_us"]})
    return out


def _clients(master: str, echo: str, placement: Placement, servers: list[int], args) -> dict:
    """``args.clients`` processes at CLIENTS_SPACING_MS, each alternating the two paths; all calls pooled."""
    n = max(ROUND_CALLS, CALLS[CLIENTS_SPACING_MS] // (QUICK_DIVISOR if args.quick else 1))
    placement.pin_servers(servers)
    start_at = time.time() + 20.0  # every worker connected, warmed and waiting by then
    cpus = ",".join(str(c) for c in sorted(placement.caller | placement.model | placement.servers))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", master, echo, str(start_at),
                               str(n), str(CLIENTS_SPACING_MS), str(w), placement.name, cpus],
                              stdout=subprocess.PIPE, text=True)
             for w in range(args.clients)]
    samples = {"remote": [], "tcp": []}
    per_client = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"a client process failed (status {proc.returncode})")
        got = json.loads(out.strip().splitlines()[-1])
        per_client.append(_cell(got))
        for name in samples:
            samples[name] += got[name]
    return {"placement": placement.name, "clients": args.clients, "spacing_ms": CLIENTS_SPACING_MS, "shape": "b1",
            "calls_per_client": n, **_cell(samples), "per_client": per_client}


def _worker(master: str, echo: str, start_at: float, n: int, spacing_ms: float, seed: int,
            placement: Placement) -> int:
    """A client process of the clients section: B=1 lookups and echoes at ``spacing_ms``; prints its samples."""
    layer_id, batch, length = SHAPES["b1"]
    with DistributedStore.connect(master, timeout_ms=TIMEOUT_MS, local_direct=False) as store, \
            TcpEchoClient(echo) as tcp:
        placement.pin_client()
        layer = EngramStore(layer_id, _configs()[layer_id], store)
        calls = Calls(layer, _configs()[layer_id], batch, length, tcp, seed=100 + seed)
        for i in range(20):
            calls.remote(i)
            calls.echo(i)
        time.sleep(max(0.0, start_at - time.time()))
        samples = {"remote": [], "tcp": []}
        _alternate(calls, spacing_ms, n, seed, samples)
        layer.close()
    print(json.dumps(samples))
    return 0


# ---- output -----------------------------------------------------------------------------------------------------

def _slow(cell: dict) -> str:
    share = cell["slow_share"]
    return f"{100 * share['remote']:.1f} / {100 * share['tcp']:.1f}"


def _print_cold(cold: list[dict]) -> None:
    print_table(["placement", "shape", "rows", "lookup p50", "kernel read p50", "python around it", "tcp p50",
                 "lookup / tcp"],
                [[c["placement"], c["shape"], str(c["rows"]), fmt(c["lookup"]["p50_us"]), fmt(c["kernel"]["p50_us"]),
                  fmt(c["python_us"]), fmt(c["tcp"]["p50_us"]),
                  fmt(c["lookup"]["p50_us"] / c["tcp"]["p50_us"], 2) + "x"] for c in cold],
                title="caches flushed before every call (us)")


def _print(results: list[dict], clients: list[dict]) -> list[str]:
    if not results and not clients:
        return []
    rows = []
    for r in results:
        rows.append([r["placement"], r["busy"], f"{r['spacing_ms']:g}", r["shape"], str(r["rows"]),
                     fmt(r["remote"]["p50_us"]), fmt(r["tcp"]["p50_us"]), fmt(r["ratio_p50"], 2) + "x",
                     fmt(r["remote"]["p99_us"]), fmt(r["tcp"]["p99_us"]), fmt(r["ratio_p99"], 2) + "x", _slow(r),
                     str(r["remote"]["reps"])])
    if rows:
        print_table(["placement", "busy", "spacing ms", "shape", "rows", "remote p50", "tcp p50", "p50 x",
                     "remote p99", "tcp p99", "p99 x", "% >= 1 ms", "calls"], rows,
                    title="remote lookup beside a bare TCP echo of the same bytes (us; % of calls >= 1 ms: "
                          "remote / tcp)")
    if clients:
        print_table(["placement", "clients", "spacing ms", "shape", "remote p50", "tcp p50", "p50 x", "remote p99",
                     "tcp p99", "p99 x", "% >= 1 ms"],
                    [[c["placement"], str(c["clients"]), f"{c['spacing_ms']:g}", c["shape"],
                      fmt(c["remote"]["p50_us"]), fmt(c["tcp"]["p50_us"]), fmt(c["ratio_p50"], 2) + "x",
                      fmt(c["remote"]["p99_us"]), fmt(c["tcp"]["p99_us"]), fmt(c["ratio_p99"], 2) + "x", _slow(c)]
                     for c in clients],
                    title="several client processes on one segment (us, every call of every process)")
    lines = []
    for placement in dict.fromkeys([r["placement"] for r in results] + [c["placement"] for c in clients]):
        small = [r for r in results if r["shape"] != "prefill" and r["placement"] == placement]
        for what, key, target in (("p50", "ratio_p50", P50_TARGET), ("p99", "ratio_p99", P99_TARGET)):
            over = [f"{r['busy']}/{r['spacing_ms']:g} ms/{r['shape']} ({r[key]:.2f}x)" for r in small
                    if r[key] > target]
            if small:
                lines.append(f"{placement}: remote {what} <= {target}x the echo's at every spacing and busy set, "
                             f"B <= 64: " + ("met" if not over else "MISSED at " + ", ".join(over)))
        if small:
            # What decides those p99: each path's share of calls that waited (the GIL, the scheduler), over the cells.
            share = {path: 100 * sum(r["slow_share"][path] * r[path]["reps"] for r in small)
                     / max(1, sum(r[path]["reps"] for r in small)) for path in ("remote", "tcp")}
            lines.append(f"{placement}: calls of 1 ms or more over those cells: remote {share['remote']:.2f}%, echo "
                         f"{share['tcp']:.2f}% (what decides a p99 near the 1% edge)")
        for c in clients:
            if c["placement"] != placement:
                continue
            for what, key, target in (("p50", "ratio_p50", P50_TARGET), ("p99", "ratio_p99", P99_TARGET)):
                lines.append(f"{placement}: {c['clients']} clients at {c['spacing_ms']:g} ms, remote {what} <= "
                             f"{target}x the echo's: " + ("met" if c[key] <= target else f"MISSED ({c[key]:.2f}x)"))
    print("\ntargets: " + "\n         ".join(lines))
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        master, echo, start_at, n, spacing, seed, placement, cpus = argv[1:9]
        return _worker(master, echo, float(start_at), int(n), float(spacing), int(seed),
                       Placement(placement, {int(c) for c in cpus.split(",")}))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"1/{QUICK_DIVISOR} of the calls (a ~1.5 min smoke run)")
    p.add_argument("--sections", default="single,clients,cold", help="single, clients, cold (default: all)")
    p.add_argument("--spacings", default=",".join(f"{s:g}" for s in SPACINGS_MS), help="ms between calls")
    p.add_argument("--busy", default=",".join(BUSY), help=f"busy sets in the client: {', '.join(BUSY)}")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"lookup shapes: {', '.join(SHAPES)}")
    p.add_argument("--clients", type=int, default=4, help="client processes of the clients section (4)")
    p.add_argument("--placements", default=",".join(PLACEMENTS),
                   help=f"where the threads run: {', '.join(PLACEMENTS)} (default: all; see the docstring)")
    p.add_argument("--passes", type=int, default=3, help="passes over every cell, interleaved (3)")
    p.add_argument("--json", default=None, help="where to write the results (default bench/results/bench_cadence.json)")
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    args.spacings = [float(s) for s in args.spacings.split(",") if s]
    args.busy = [b for b in args.busy.split(",") if b]
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.placements = [s for s in args.placements.split(",") if s]
    for name, got, known in (("--sections", args.sections, ("single", "clients", "cold")), ("--busy", args.busy, BUSY),
                             ("--shapes", args.shapes, tuple(SHAPES)), ("--placements", args.placements, PLACEMENTS)):
        bad = [g for g in got if g not in known]
        if bad:
            p.error(f"{name}: expected some of {', '.join(known)}, got {', '.join(bad)}")
    if args.passes < 1 or args.clients < 1:
        p.error(f"--passes and --clients: expected >= 1, got {args.passes} and {args.clients}")
    if args.json is None:
        args.json = default_json_path("bench_cadence")

    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2 and args.placements != ["shared"]:
        print("one CPU here: every placement is shared", flush=True)
        args.placements = ["shared"]
    placements = [Placement(name, cpus) for name in args.placements]
    configs = _configs()
    needed = sorted({SHAPES[s][0] for s in args.shapes} | ({1} if {"clients", "cold"} & set(args.sections) else set()))
    record: dict = {"benchmark": "bench_cadence", "quick": args.quick, "round_calls": ROUND_CALLS,
                    "passes": args.passes, "cpus": sorted(cpus)}
    with ExitStack() as stack:
        cluster = stack.enter_context(start_cluster(segments=1, segment_size=256 << 20))
        echo = stack.enter_context(TcpEcho())
        store = stack.enter_context(DistributedStore.connect(cluster.address, timeout_ms=TIMEOUT_MS))
        tables = {}
        for layer_id in needed:
            tables[layer_id] = _tables(configs[layer_id], seed=layer_id)
            layer = EngramStore(layer_id, configs[layer_id], store)
            layer.remove_from_store(force=True)
            layer.populate(tables[layer_id])
            stack.callback(layer.remove_from_store, force=True)
        print(f"engram-segment of 256 MiB, layers {needed} populated; sections {', '.join(args.sections)}",
              flush=True)
        servers = [proc.pid for proc in cluster.procs] + [echo.popen.pid]
        results = _single(cluster.address, echo.address, tables, placements, servers, args) \
            if "single" in args.sections else []
        clients = [_clients(cluster.address, echo.address, placement, servers, args) for placement in placements] \
            if "clients" in args.sections else []
        cold = [c for placement in placements for c in _cold(cluster.address, echo.address, placement, servers, args)] \
            if "cold" in args.sections else []
    record["results"] = results
    record["clients"] = clients
    record["cold"] = cold
    if cold:
        _print_cold(cold)
    record["targets"] = _print(results, clients)
    write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
