"""EngramStore lookup latency against its floors: an in-process NumPy gather and a bare ZeroMQ round trip.

    python bench/bench_engram_store.py [--quick] [--full | --rows-scale S] [--threads N] [--no-mooncake]
                                       [--backend {engram,mooncake}] [--json PATH]

1. Mooncake's benchmark scenario: 8 heads x 50,000 rows x D=16, L=1, B in 1, 4, 16, 64, 128, 256.
2. A layer of DeepSeek's demo config: 16 heads x 646,403 rows x D=64 float32 (2.65 GB) at B=1, L=4096 (a
   prefill) and B=256, L=1 (a decode step). By default the tables are scaled to ``--rows-scale`` (0.1: 64,640
   rows a head) so the run stays short; ``--full`` uses the real size (~6 GB of RAM: the tables here plus the
   segment's copy).

Paths (the store paths read the tables from one ``engram-segment`` process on this host):

- numpy: ``np.stack([tables[h][ids[..., h]] for h in range(H)], axis=-2)`` on the tables in this process: the
  floor of a local read, and the baseline every "vs numpy" ratio refers to.
- numpy-loop: the same rows written head by head into a fresh ``[B, L, H, D]`` array, which skips
  ``np.stack``'s extra copy: the strongest plain-NumPy contender, for reference.
- local: ``EngramStore.lookup`` through a client that maps the segment's shared memory (local-direct).
- local-threaded: the same with ``EngramStore(..., threads=N)`` (``--threads``, default: the CPU count).
- remote: ``lookup`` through a client with ``local_direct=False``: every read goes over ZeroMQ.
- floor: a bare pyzmq DEALER/ROUTER round trip carrying the same frames as that lookup's request and reply
  (a header of the same size and the same (offset, length) pairs out; a header and as many row bytes back),
  answered by a Python ROUTER in its own process that does nothing else: the floor of a remote read over
  ZeroMQ.
- tcp floor: the same bytes over a bare blocking TCP socket, answered by a Python thread in its own process
  that does nothing else: the floor of the raw read channel the remote path uses (see ``engram_store.raw``).
- prefetch: ``prefetch(ids).result()`` on the local-direct client (the background-thread hand-off included).
- mooncake: Mooncake's own ``mooncake.store.EngramStore`` (from its wheel, ``pip install "engram[mooncake]"``)
  reading the same tables over TCP from a ``mooncake_client`` segment process (Mooncake's scenario only;
  ``--no-mooncake`` skips it, and it is left out where the wheel does not load).

``--backend mooncake`` instead runs this project's EngramStore code on a real Mooncake store (local = a client
mounting its own segment; remote = one reading a ``mooncake_client`` segment process); results go to
``bench/results/bench_engram_store_mooncake.json``.

These calls run back to back. ``bench/bench_cadence.py`` measures remote lookups as serving makes them: spaced
1, 5 and 30 ms apart, with busy model threads in the client, beside a bare TCP echo of the same bytes, and from
several client processes at once.

Latencies are per call, in microseconds; tokens/s = B x L / p50; "vs numpy" = NumPy p50 / path p50 (above 1:
faster than the NumPy gather); "/floor" = remote p50 / floor p50 (1 = no overhead over a bare round trip);
"mooncake/remote" = Mooncake p50 / remote p50. The paths are timed in interleaved rounds so that a burst of
noise on a shared machine does not land on one path only.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import ExitStack, contextmanager

import msgpack
import numpy as np

from _common import TIMEOUT_MS, FrameEcho, FrameEchoClient, Stats, TcpEcho, TcpEchoClient, default_json_path, \
    fmt, print_table, start_cluster, time_ns, write_json
from engram_store import DistributedStore, EngramStore, EngramStoreConfig
from engram_store.wire._protocol import PROTOCOL_VERSION
from engram_store.tables import _plan
from engram_store import kernels as _kernels

MOONCAKE_HEADS, MOONCAKE_ROWS, MOONCAKE_DIM = 8, 50_000, 16
MOONCAKE_BATCHES = (1, 4, 16, 64, 128, 256)
FULL_HEADS, FULL_ROWS, FULL_DIM = 16, 646_403, 64
FULL_SHAPES = ((1, 4096), (256, 1))  # (B, L)
DEFAULT_ROWS_SCALE = 0.1
QUICK_ROWS_SCALE = 0.02
#: Distinct id batches per shape, cycled, so no path is timed on one cache-hot batch only.
ID_POOL = 16
#: Targets, checked on the p50.
FLOOR_RATIO_TARGET = 1.2
MOONCAKE_RATIO_TARGET = 5.0
MOONCAKE_RATIO_TARGET_B256 = 100.0
LOCAL_VS_NUMPY_TARGET = 2.0  # local-direct at <= 0.5x NumPy's time at the full-size prefill shape


def _timing(quick: bool, big: bool) -> dict:
    """Warm-up calls, and per-path repetition bounds summed over all rounds."""
    if quick:
        return dict(warmup=3, min_reps=5 if big else 40, min_time_s=0.12 if big else 0.08, rounds=2)
    return dict(warmup=5 if big else 20, min_reps=40 if big else 400, min_time_s=2.0 if big else 1.0, rounds=4)


def _tables(sizes: list[int], dim: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.random((n, dim), dtype=np.float32) for n in sizes]


def _id_pool(sizes: list[int], batch: int, length: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # (B, L, H) int64, head h drawing from [0, N_h)
    return [np.stack([rng.integers(0, n, size=(batch, length), dtype=np.int64) for n in sizes], axis=-1)
            for _ in range(ID_POOL)]


def _floor_frames(layer: EngramStore, pool: list[np.ndarray]) -> list[tuple[bytes, bytes, int]]:
    """Per id batch, the frames of the remote lookup's request (header, pairs) and the size of its reply.

    The header stands in for ``{v, id, op: "read_ranges"}`` at the same length, its first 8 bytes telling the
    floor server how many row bytes to send back; the pairs are the very ranges the lookup requests.
    """
    lay = layer._layer(None)
    placement = layer._source.placements.get(lay, set())
    header_len = len(msgpack.packb({"v": PROTOCOL_VERSION, "id": 1 << 20, "op": "read_ranges"}))
    frames = []
    for ids in pool:
        ids2 = ids.reshape(-1, lay.num_heads)
        if _plan.reads_direct(placement, ids2):  # every row in output order, as the lookup asks
            pairs = _kernels.direct_pairs(ids2, placement.order, placement.bases, lay.row_bytes)
        else:  # distinct rows as merged ranges
            pairs = _kernels.plan_reads(ids2, placement.order, placement.bases, lay.row_bytes).pairs
        nbytes = int(pairs[:, 1].sum())
        frames.append((nbytes.to_bytes(8, "little").ljust(header_len, b"\0"), pairs.tobytes(), nbytes))
    return frames


def _bench_shape(name: str, tables: list[np.ndarray], layers: dict[str, EngramStore], batch: int, length: int,
                 timing: dict, seed: int, floor: FrameEchoClient | None, mooncake_layer,
                 tcp_floor: TcpEchoClient | None = None) -> dict:
    """Time every path on one (B, L); check each path returns what NumPy returns."""
    H, D = len(tables), tables[0].shape[1]
    pool = _id_pool([t.shape[0] for t in tables], batch, length, seed)

    def numpy_gather(ids: np.ndarray) -> np.ndarray:
        return np.stack([tables[h][ids[..., h]] for h in range(H)], axis=-2)  # (B, L, H, D)

    def numpy_loop(ids: np.ndarray) -> np.ndarray:
        out = np.empty((batch, length, H, D), dtype=np.float32)  # (B, L, H, D)
        for h in range(H):
            out[:, :, h] = tables[h][ids[..., h]]  # (B, L, D)
        return out

    calls = {
        "numpy": lambda i: numpy_gather(pool[i % ID_POOL]),
        "numpy-loop": lambda i: numpy_loop(pool[i % ID_POOL]),
        "local": lambda i: layers["local"].lookup(pool[i % ID_POOL]),
    }
    if "local-threaded" in layers:
        calls["local-threaded"] = lambda i: layers["local-threaded"].lookup(pool[i % ID_POOL])
    calls["remote"] = lambda i: layers["remote"].lookup(pool[i % ID_POOL])
    checked = dict(calls)
    if floor is not None:
        layers["remote"].lookup(pool[0])  # a fresh placement to plan with
        frames = _floor_frames(layers["remote"], pool)
        calls["floor"] = lambda i: floor.round_trip(*frames[i % ID_POOL])
        if tcp_floor is not None:
            calls["tcp floor"] = lambda i: tcp_floor.round_trip(frames[i % ID_POOL][1], frames[i % ID_POOL][2])
    calls["prefetch"] = lambda i: layers["local"].prefetch(pool[i % ID_POOL]).result()
    checked["prefetch"] = calls["prefetch"]
    if mooncake_layer is not None:
        calls["mooncake"] = checked["mooncake"] = lambda i: mooncake_layer.lookup(pool[i % ID_POOL])
    for path, call in calls.items():
        if path in checked:
            expected = numpy_gather(pool[0])
            got = call(0)
            assert got.shape == (batch, length, H, D) and np.array_equal(got, expected), \
                f"{name} B={batch} L={length}: path {path!r} returned rows that differ from NumPy's"
        for i in range(timing["warmup"]):
            call(i)
    layers["remote"].stats(reset=True)

    rounds = timing["rounds"]
    samples: dict[str, list[int]] = {p: [] for p in calls}
    for r in range(rounds):
        for path, call in calls.items():
            slow = path == "mooncake"  # tens of ms a call at large B: a few calls say enough
            samples[path] += time_ns(call, min_reps=max(1, -(-timing["min_reps"] // rounds) // (8 if slow else 1)),
                                     min_time_s=timing["min_time_s"] / rounds, start=len(samples[path]))
    remote_counts = layers["remote"].stats()

    row_bytes = batch * length * H * D * 4
    result = {"scenario": name, "B": batch, "L": length, "H": H, "D": D, "bytes_returned": row_bytes, "paths": {}}
    for path in calls:
        s = Stats.from_ns(samples[path]).as_dict()
        s["tokens_per_s"] = batch * length / (s["p50_us"] / 1e6)
        s["gb_per_s"] = row_bytes / (s["p50_us"] * 1e3)
        result["paths"][path] = s
    numpy_p50 = result["paths"]["numpy"]["p50_us"]
    for path in calls:
        result["paths"][path]["vs_numpy"] = numpy_p50 / result["paths"][path]["p50_us"]
    if floor is not None:
        result["remote_vs_floor"] = result["paths"]["remote"]["p50_us"] / result["paths"]["floor"]["p50_us"]
    if "tcp floor" in result["paths"]:
        result["remote_vs_tcp_floor"] = result["paths"]["remote"]["p50_us"] / result["paths"]["tcp floor"]["p50_us"]
    if mooncake_layer is not None:
        result["mooncake_vs_remote"] = result["paths"]["mooncake"]["p50_us"] / result["paths"]["remote"]["p50_us"]
    lookups = max(remote_counts["lookups"], 1)
    result["remote_per_lookup"] = {"requests": remote_counts["remote_requests"] / lookups,
                                   "rows": remote_counts["remote_rows"] / lookups,
                                   "bytes": remote_counts["remote_bytes"] / lookups}
    return result


def _run_scenario(name: str, layer_id: int, sizes: list[int], dim: int, shapes: list[tuple[int, int]],
                  stores: dict, quick: bool, threads: int, backend: str = "engram",
                  floor: FrameEchoClient | None = None, mooncake_store=None,
                  tcp_floor: TcpEchoClient | None = None) -> tuple[list[dict], dict]:
    t0 = time.perf_counter()
    tables = _tables(sizes, dim, seed=layer_id)
    total = sum(t.nbytes for t in tables)
    print(f"\n[{name}] {len(sizes)} heads x {sizes[0]:,} rows x D={dim} float32 = {total / 1e9:.3f} GB "
          f"(tables made in {time.perf_counter() - t0:.1f} s)", flush=True)
    config = EngramStoreConfig(table_vocab_sizes=sizes, embedding_dim=dim)
    layers = {path: EngramStore(layer_id, config, stores[path]) for path in ("local", "remote")}
    if threads > 1 and backend == "engram":
        layers["local-threaded"] = EngramStore(layer_id, config, stores["local"], threads=threads)
    # engram: all clients share one cluster; mooncake: each path has its own master, so each is populated.
    populated = ("local",) if backend == "engram" else ("local", "remote")
    mooncake_layer = None
    try:
        for path in populated:
            layers[path].remove_from_store(force=True)  # a leftover of an interrupted run
        t0 = time.perf_counter()
        layers["local"].populate(tables)
        elapsed = time.perf_counter() - t0
        for path in populated[1:]:
            layers[path].populate(tables)
        populate = {"bytes": total, "seconds": elapsed, "gb_per_s": total / elapsed / 1e9}
        print(f"[{name}] populate: {elapsed:.2f} s = {populate['gb_per_s']:.2f} GB/s", flush=True)
        if mooncake_store is not None:
            mooncake_layer = _mooncake_engram_store(layer_id, sizes, dim, mooncake_store, tables)
        results = []
        for batch, length in shapes:
            big = batch * length * len(sizes) * dim * 4 >= 1 << 20  # a call returns >= 1 MiB: fewer reps
            r = _bench_shape(name, tables, layers, batch, length, _timing(quick or backend == "mooncake", big),
                             seed=1000 * layer_id + batch * 7 + length, floor=floor, mooncake_layer=mooncake_layer,
                             tcp_floor=tcp_floor)
            results.append(r)
            print(f"[{name}] B={batch} L={length}: " + ", ".join(
                f"{p} p50 {s['p50_us']:.1f} us ({s['reps']} reps)" for p, s in r["paths"].items()), flush=True)
        return results, populate
    finally:
        for layer in layers.values():
            layer.close()
        for path in populated:
            layers[path].remove_from_store(force=True)
        if mooncake_layer is not None:
            mooncake_layer.remove_from_store(True)


def _mooncake_engram_store(layer_id: int, sizes: list[int], dim: int, store, tables: list[np.ndarray]):
    """Mooncake's own EngramStore (its C++ class from the wheel) on ``store``, populated with ``tables``."""
    from mooncake.store import EngramStore as MooncakeEngramStore, EngramStoreConfig as MooncakeConfig

    config = MooncakeConfig()
    config.table_vocab_sizes = list(sizes)
    config.embedding_dim = dim
    layer = MooncakeEngramStore(layer_id, config, store)
    layer.remove_from_store(True)
    layer.populate(list(tables))
    return layer


def _print_results(title: str, results: list[dict]) -> None:
    paths = list(results[0]["paths"])
    detail = []
    for r in results:
        for path in paths:
            s = r["paths"][path]
            detail.append([f"B={r['B']} L={r['L']}", path, fmt(s["mean_us"]), fmt(s["p50_us"]), fmt(s["p99_us"]),
                           fmt(s["tokens_per_s"], 0), fmt(s["gb_per_s"], 3), fmt(s["vs_numpy"], 2) + "x"])
    print_table(["shape", "path", "mean us", "p50 us", "p99 us", "tokens/s", "GB/s", "vs numpy"], detail,
                title=f"{title}: per path")
    short = {"numpy-loop": "loop", "local-threaded": "local-thr", "tcp floor": "tcp"}
    head = ["shape"] + [f"{short.get(p, p)} us" for p in paths] + [f"{short.get(p, p)} x" for p in paths[1:]
                                                                   if p not in ("floor", "tcp floor", "mooncake")]
    extra = []
    if "floor" in paths:
        extra.append("remote/floor")
    if "tcp floor" in paths:
        extra.append("remote/tcp")
    if "mooncake" in paths:
        extra.append("mooncake/remote")
    rows = []
    for r in results:
        p = r["paths"]
        row = [f"B={r['B']} L={r['L']}"] + [fmt(p[path]["p50_us"]) for path in paths] \
            + [fmt(p[path]["vs_numpy"], 2) + "x" for path in paths[1:] if path not in ("floor", "tcp floor", "mooncake")]
        if "floor" in paths:
            row.append(fmt(r["remote_vs_floor"], 2) + "x")
        if "tcp floor" in paths:
            row.append(fmt(r["remote_vs_tcp_floor"], 2) + "x")
        if "mooncake" in paths:
            row.append(fmt(r["mooncake_vs_remote"], 1) + "x")
        rows.append(row)
    print_table(head + extra, rows, title=f"{title}: side by side (p50 us; x = numpy p50 / path p50)")


def _targets(mooncake: list[dict], full: list[dict], full_size: bool) -> list[str]:
    lines = []
    over = [f"B={r['B']} L={r['L']} ({r['remote_vs_floor']:.2f}x)" for r in mooncake + full
            if "remote_vs_floor" in r and r["remote_vs_floor"] > FLOOR_RATIO_TARGET]
    if any("remote_vs_floor" in r for r in mooncake + full):
        lines.append(f"remote <= {FLOOR_RATIO_TARGET}x the bare ZeroMQ round trip at every shape: "
                     + ("met" if not over else "MISSED at " + ", ".join(over)))
    if any("mooncake_vs_remote" in r for r in mooncake):
        slow = [f"B={r['B']} ({r['mooncake_vs_remote']:.1f}x)" for r in mooncake
                if r["mooncake_vs_remote"] < (MOONCAKE_RATIO_TARGET_B256 if r["B"] == 256 else MOONCAKE_RATIO_TARGET)]
        lines.append(f"remote >= {MOONCAKE_RATIO_TARGET:g}x faster than Mooncake's EngramStore at every B "
                     f"(>= {MOONCAKE_RATIO_TARGET_B256:g}x at B=256): " + ("met" if not slow else "MISSED at " +
                                                                          ", ".join(slow)))
    slow = [f"B={r['B']} ({r['paths']['local']['vs_numpy']:.2f}x)" for r in mooncake
            if r["paths"]["local"]["vs_numpy"] < 1.0]
    lines.append("local-direct faster than NumPy at every B of Mooncake's scenario: "
                 + ("met" if not slow else "MISSED at " + ", ".join(slow)))
    prefill = next((r for r in full if r["B"] == 1 and r["L"] == 4096), None)
    if prefill is not None:
        ratio = prefill["paths"]["local"]["vs_numpy"]
        lines.append(f"local-direct at <= 0.5x NumPy's time at the full-size prefill shape: {ratio:.2f}x faster: "
                     + ("met" if ratio >= LOCAL_VS_NUMPY_TARGET else "MISSED")
                     + ("" if full_size else " (tables scaled down: run --full for the real size)"))
    return lines


@contextmanager
def _engram_stores(segment_size: int):
    """One master and one segment process; a local-direct client and a ``local_direct=False`` one."""
    with start_cluster(segments=1, segment_size=segment_size) as cluster, \
            DistributedStore.connect(cluster.address, timeout_ms=TIMEOUT_MS, local_direct=True) as local, \
            DistributedStore.connect(cluster.address, timeout_ms=TIMEOUT_MS, local_direct=False) as remote:
        yield {"local": local, "remote": remote}


def _mooncake_procs():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "mooncake"))
    import mooncake_procs

    return mooncake_procs


@contextmanager
def _mooncake_stores(segment_size: int):
    """Real Mooncake: local = a client mounting the segment itself; remote = one reading a mooncake_client's."""
    procs = _mooncake_procs()
    with procs.MooncakeMaster() as local_master, procs.MooncakeMaster() as remote_master, \
            procs.MooncakeSegment(remote_master, size=segment_size):
        stores = {"local": procs.connect(local_master.address, segment_size=segment_size),
                  "remote": procs.connect(remote_master.address, segment_size=0)}
        try:
            yield stores
        finally:
            for store in stores.values():
                store.close()


@contextmanager
def _mooncake_reader(segment_size: int):
    """A MooncakeDistributedStore that mounts nothing, reading a ``mooncake_client`` segment process over TCP."""
    procs = _mooncake_procs()
    with procs.MooncakeMaster() as master, procs.MooncakeSegment(master, size=segment_size):
        store = procs.connect(master.address, segment_size=0)
        try:
            yield store
        finally:
            store.close()


def _mooncake_available() -> str | None:
    """None if Mooncake's EngramStore can run here, else why not."""
    try:
        from mooncake.store import EngramStore  # noqa: F401
        _mooncake_procs().wheel_binary("mooncake_master")
    except Exception as exc:  # ImportError, a missing system library, a missing binary
        return f"{type(exc).__name__}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"fewer repetitions, full-size part at --rows-scale {QUICK_ROWS_SCALE} (a ~20 s smoke run)")
    p.add_argument("--full", action="store_true", help="the full-size part at its real size (2.65 GB of tables)")
    p.add_argument("--rows-scale", type=float, default=None,
                   help=f"fraction of the {FULL_ROWS:,} rows per head for the full-size part "
                        f"(default {DEFAULT_ROWS_SCALE}; 1 = --full)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads of the local-threaded path (default: the CPU count; 1 leaves the path out)")
    p.add_argument("--no-mooncake", action="store_true", help="leave out the column of Mooncake's EngramStore")
    p.add_argument("--backend", choices=("engram", "mooncake"), default="engram",
                   help="engram: this project's store (default); mooncake: this project's EngramStore on a real "
                        "MooncakeDistributedStore against mooncake_master processes from Mooncake's wheel")
    p.add_argument("--json", default=None, help="where to write the results (default bench/results/"
                                                "bench_engram_store[_mooncake].json)")
    args = p.parse_args(argv)
    if args.json is None:
        args.json = default_json_path("bench_engram_store" + ("_mooncake" if args.backend == "mooncake" else ""))
    if args.full and args.rows_scale not in (None, 1.0):
        p.error("--full and --rows-scale disagree; give one of them")
    scale = 1.0 if args.full else args.rows_scale if args.rows_scale is not None else \
        QUICK_ROWS_SCALE if args.quick else DEFAULT_ROWS_SCALE
    if not 0 < scale <= 1:
        p.error(f"--rows-scale: expected a fraction in (0, 1], got {scale}")
    if args.threads < 1:
        p.error(f"--threads: expected >= 1, got {args.threads}")

    rows = max(1000, round(FULL_ROWS * scale))
    full_sizes = [rows + 7 * h for h in range(FULL_HEADS)]  # distinct per head, as the real primes are
    mooncake_sizes = [MOONCAKE_ROWS] * MOONCAKE_HEADS
    full_bytes = sum(full_sizes) * FULL_DIM * 4
    # One scenario at a time lives in the segment; slack for the allocator, and >= 3 GiB at full size.
    segment_size = max(256 << 20, int(full_bytes * 1.05) + (64 << 20))
    segment_size = -(-segment_size // (1 << 20)) << 20
    if scale == 1.0:
        segment_size = max(segment_size, 3 << 30)
    print(f"engram store lookup: 1 segment process of {segment_size / (1 << 30):.2f} GiB; full-size part at "
          f"rows-scale {scale:g} ({rows:,} rows/head, {full_bytes / 1e9:.3f} GB)"
          f"{'; quick' if args.quick else ''}", flush=True)

    record: dict = {"benchmark": "bench_engram_store", "backend": args.backend, "quick": args.quick,
                    "rows_scale": scale, "segment_size": segment_size, "threads": args.threads, "scenarios": {}}
    with ExitStack() as stack:
        floor = tcp_floor = mooncake_store = None
        if args.backend == "mooncake":
            print("backend mooncake: local = a MooncakeDistributedStore mounting its own segment, remote = one "
                  "reading a mooncake_client segment process (one mooncake_master each); --quick repetition "
                  "counts", flush=True)
            stores = stack.enter_context(_mooncake_stores(segment_size))
        else:
            stores = stack.enter_context(_engram_stores(segment_size))
            floor = stack.enter_context(FrameEchoClient(stack.enter_context(FrameEcho()).address))
            tcp_floor = stack.enter_context(TcpEchoClient(stack.enter_context(TcpEcho()).address))
            why_not = "--no-mooncake" if args.no_mooncake else _mooncake_available()
            if why_not is None:
                mooncake_store = stack.enter_context(_mooncake_reader(256 << 20))
                print("mooncake column: Mooncake's EngramStore reading a mooncake_client segment process over TCP",
                      flush=True)
            else:
                print(f"mooncake column left out ({why_not})", flush=True)
        record["mooncake_column"] = mooncake_store is not None
        mooncake, mooncake_pop = _run_scenario(
            "mooncake", 1, mooncake_sizes, MOONCAKE_DIM, [(b, 1) for b in MOONCAKE_BATCHES], stores, args.quick,
            args.threads, args.backend, floor=floor, mooncake_store=mooncake_store, tcp_floor=tcp_floor)
        record["scenarios"]["mooncake"] = {"heads": MOONCAKE_HEADS, "rows_per_head": mooncake_sizes,
                                           "dim": MOONCAKE_DIM, "populate": mooncake_pop, "results": mooncake}
        full_name = "full-size" if scale == 1.0 else f"full-size x{scale:g}"
        full, full_pop = _run_scenario(full_name, 2, full_sizes, FULL_DIM, list(FULL_SHAPES), stores, args.quick,
                                       args.threads, args.backend, floor=floor, tcp_floor=tcp_floor)
        record["scenarios"]["full_size"] = {"heads": FULL_HEADS, "rows_per_head": full_sizes, "dim": FULL_DIM,
                                            "rows_scale": scale, "populate": full_pop, "results": full}

    title = "" if args.backend == "engram" else "[backend mooncake] "
    _print_results(f"{title}Mooncake scenario: {MOONCAKE_HEADS} heads x {MOONCAKE_ROWS:,} rows x D={MOONCAKE_DIM}, L=1",
                   mooncake)
    _print_results(f"{title}{full_name}: {FULL_HEADS} heads x {rows:,}+ rows x D={FULL_DIM} "
                   f"({full_bytes / 1e9:.3f} GB)", full)
    if args.backend == "engram":
        record["targets"] = _targets(mooncake, full, scale == 1.0)
        print("\ntargets (p50): " + "\n               ".join(record["targets"]))
    write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
