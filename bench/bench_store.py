"""Store throughput: object puts and gets, bulk puts beside np.copyto, and reads from many client processes.

    python bench/bench_store.py [--quick] [--sections objects,puts,readers] [--populate] [--json PATH]

Three sections (``--sections`` picks some), plus an optional fourth:

- objects: ``put`` / ``get_into`` of one object, 4 KiB to 64 MiB, next to a raw ZeroMQ round trip of the same
  bytes (one ``engram-master`` and one ``engram-segment`` process on 127.0.0.1; clients in this process):
  put local/remote (``local_direct`` True/False), get local (the segment's mapping), get remote (over ZeroMQ),
  raw zmq (a DEALER asking an echo server in another process for that many bytes, ``recv_into`` a buffer).
- puts: ``DistributedStore.batch_put_from`` of many objects of 16-300 MB (a few GB in all) into two segment
  processes, same-host (pwrite into the segments' files) and network (``local_direct=False``: write requests
  over ZeroMQ), beside ``np.copyto`` of the same objects into a buffer already in memory, in the same run.
- readers: 1, 2, 4 and 8 client processes (started and reaped here), each doing B=256, L=1 remote lookups of
  Mooncake's scenario (8 heads x 50,000 rows x D=16) against one segment process started with ``--readers 1``
  and one with ``--readers 2``: ``EngramStore.lookup`` (the client picks the socket), and raw
  ``read_ranges`` requests of the same ranges sent to the segment's reader sockets (client i to reader
  i mod N), which shows what the readers serve whatever socket the client chooses. Then one client's raw reads
  go to the main socket, and to a reader socket, while another client streams puts into the same segment.
- populate (``--populate``, ~10 GB of RAM): ``EngramStore.populate`` of both Engram layers of DeepSeek's demo
  config (16 heads x ~646,400 rows x D=64 float32 = 2.65 GB a layer) into two segment processes, same-host
  and network. It includes the manifest checksums, computed while the tables upload.

GB/s is 10^9 bytes / s. Puts: total bytes / time of the call, median of the repetitions (the best in the JSON).
Readers: every measurement alternates between the two segments (both up at once) and reports the best of
``--reps`` runs (all runs in the JSON), the figure least moved by load from elsewhere on the machine.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time

import numpy as np

from _common import HEARTBEAT_TIMEOUT_S, EchoClient, EchoServer, TIMEOUT_MS, default_json_path, fmt, measure, \
    print_table, size_label, start_cluster, write_json
from engram_store import DistributedStore, EngramStore, EngramStoreConfig, SegmentUnavailable
from engram_store.segment import default_readers
from engram_store.wire import Connection

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 1 << 20, 16 << 20]
#: Bulk puts: objects of 16-300 MB adding up to these totals (GB).
PUT_TOTALS_GB = [0.5, 2.0, 5.0]
QUICK_PUT_TOTALS_GB = [0.25, 1.0]
PUT_REPS = 3
CLIENT_COUNTS = [1, 2, 4, 8]
QUICK_CLIENT_COUNTS = [1, 2]
READ_SECONDS = 3.0
QUICK_READ_SECONDS = 1.0
READ_REPS = 2
#: Mooncake's benchmark scenario for the many-readers part.
HEADS, ROWS, DIM, BATCH = 8, 50_000, 16, 256
DEMO_DIM = 64


# ---- objects --------------------------------------------------------------------------------------------


def _reps(size: int, quick: bool) -> dict:
    """Repetition bounds: many calls for small objects (a p50 of a few µs needs them), fewer for large ones."""
    if quick:
        return dict(warmup=2, min_reps=5 if size >= 16 << 20 else 20, min_time_s=0.25, max_reps=5_000)
    return dict(warmup=3, min_reps=20 if size >= 16 << 20 else 200, min_time_s=1.5, max_reps=100_000)


def _bench_size(size: int, data: np.ndarray, local: DistributedStore, remote: DistributedStore,
                echo: EchoClient, quick: bool) -> dict:
    reps = _reps(size, quick)
    obj = data[:size]
    buf = np.empty(size, dtype=np.uint8)

    put_key = f"bench:put:{size}"
    puts = {name: measure(lambda i, s=store: s.put(f"{put_key}:{i}", obj),
                          between=lambda i, s=store: s.remove(f"{put_key}:{i}", force=True), **reps)
            for name, store in (("put_local", local), ("put_remote", remote))}

    key = f"bench:get:{size}"
    local.put(key, obj)
    try:
        results = {}
        for name, store in (("get_local", local), ("get_remote", remote)):
            buf.fill(0)
            assert store.get_into(key, buf) == size and np.array_equal(buf, obj), f"{name}: wrong bytes back"
            results[name] = measure(lambda i, s=store: s.get_into(key, buf), **reps)
    finally:
        local.remove(key, force=True)
    buf.fill(0)
    echo.read_into(buf, size)
    results["raw_zmq"] = measure(lambda i: echo.read_into(buf, size), **reps)

    row = {"size": size}
    row.update({name: s.as_dict() for name, s in {**puts, **results}.items()})
    for name in ("put_local", "put_remote", "get_local", "get_remote", "raw_zmq"):
        row[name]["gb_per_s"] = size / (row[name]["p50_us"] * 1e3)
    row["remote_over_raw"] = row["get_remote"]["gb_per_s"] / row["raw_zmq"]["gb_per_s"]
    return row


def objects_section(quick: bool) -> list[dict]:
    sizes = QUICK_SIZES if quick else SIZES
    data = np.random.default_rng(0).integers(0, 256, size=max(sizes), dtype=np.uint8)
    # Room for the object read back plus the one being put, with slack for allocator alignment.
    segment_size = max(256 << 20, 4 * max(sizes))
    rows = []
    print(f"objects: 1 segment process of {size_label(segment_size)}, sizes "
          f"{', '.join(size_label(s) for s in sizes)}", flush=True)
    with start_cluster(segments=1, segment_size=segment_size) as cluster, EchoServer() as server, \
            EchoClient(server.address) as echo, \
            DistributedStore.connect(cluster.address, timeout_ms=TIMEOUT_MS, local_direct=True) as local, \
            DistributedStore.connect(cluster.address, timeout_ms=TIMEOUT_MS, local_direct=False) as remote:
        for size in sizes:
            row = _bench_size(size, data, local, remote, echo, quick)
            rows.append(row)
            print(f"  {size_label(size)}: puts {row['put_local']['reps']}/{row['put_remote']['reps']} reps, gets "
                  f"{row['get_local']['reps']}/{row['get_remote']['reps']}/{row['raw_zmq']['reps']} reps", flush=True)
    print_table(
        ["size", "put local GB/s", "put remote GB/s", "get local GB/s", "get remote GB/s", "raw zmq GB/s",
         "remote/raw", "get remote p50 us", "raw p50 us"],
        [[size_label(r["size"]), fmt(r["put_local"]["gb_per_s"], 3), fmt(r["put_remote"]["gb_per_s"], 3),
          fmt(r["get_local"]["gb_per_s"], 3),
          fmt(r["get_remote"]["gb_per_s"], 3), fmt(r["raw_zmq"]["gb_per_s"], 3), fmt(r["remote_over_raw"], 2),
          fmt(r["get_remote"]["p50_us"]), fmt(r["raw_zmq"]["p50_us"])] for r in rows],
        title="objects: GB/s = bytes / median call time (10^9 B/s)")
    return rows


# ---- bulk puts ------------------------------------------------------------------------------------------


def _object_sizes(total: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(int(rng.integers(16_000_000, 300_000_001)))
    return sizes


def _put_round(store: DistributedStore, prefix: str, objects: list[np.ndarray]) -> float:
    keys = [f"{prefix}:{i}" for i in range(len(objects))]
    t0 = time.perf_counter()
    store.batch_put_from(keys, objects)
    elapsed = time.perf_counter() - t0
    for key in keys:
        store.remove(key, force=True)
    return elapsed


def puts_section(totals_gb: list[float]) -> list[dict]:
    totals = [int(t * 1e9) for t in totals_gb]
    source = np.random.default_rng(1).integers(0, 256, 300_000_000, dtype=np.uint8)
    floor_dst = np.empty_like(source)
    floor_dst.fill(0)  # in memory before the clock starts, like the segments' reserved pages
    segment_size = max(totals) // 2 + (768 << 20)
    print(f"\nputs: objects of 16-300 MB, {', '.join(f'{t:g} GB' for t in totals_gb)} in all, into 2 segment "
          f"processes of {segment_size / 2**30:.2f} GiB; {PUT_REPS} repetitions each", flush=True)
    rows = []
    with start_cluster(segments=2, segment_size=segment_size) as cluster, \
            DistributedStore.connect(cluster.address, timeout_ms=TIMEOUT_MS, local_direct=True) as same_host, \
            DistributedStore.connect(cluster.address, timeout_ms=TIMEOUT_MS, local_direct=False) as network:
        # Untimed: every page of both segments written once, connections and files opened.
        warm = [source[:n] for n in _object_sizes(max(totals), 0)]
        for store in (same_host, network):
            _put_round(store, "bench:warm", warm)
        check = source[:20_000_001]
        for store in (same_host, network):
            store.put("bench:check", check)
            assert network.get("bench:check") == check.tobytes(), "a put did not read back exactly"
            network.remove("bench:check", force=True)
        for total, gb in zip(totals, totals_gb):
            objects = [source[:n] for n in _object_sizes(total, 2)]
            nbytes = sum(o.nbytes for o in objects)
            times: dict[str, list[float]] = {"copyto": [], "same_host": [], "network": []}
            for rep in range(PUT_REPS):  # interleaved, so a burst of noise does not land on one path only
                t0 = time.perf_counter()
                for o in objects:
                    np.copyto(floor_dst[:o.size], o)
                times["copyto"].append(time.perf_counter() - t0)
                times["same_host"].append(_put_round(same_host, f"bench:s{rep}", objects))
                times["network"].append(_put_round(network, f"bench:n{rep}", objects))
            row = {"total_bytes": nbytes, "objects": len(objects)}
            for name, ts in times.items():
                row[name] = {"seconds": ts, "gb_per_s": nbytes / float(np.median(ts)) / 1e9,
                             "best_gb_per_s": nbytes / min(ts) / 1e9}
            rows.append(row)
            print(f"  {gb:g} GB: {len(objects)} objects done", flush=True)
    print_table(
        ["total", "objects", "np.copyto GB/s", "same-host GB/s", "network GB/s", "same-host/copyto",
         "network/copyto"],
        [[f"{r['total_bytes'] / 1e9:.2f} GB", r["objects"], fmt(r["copyto"]["gb_per_s"], 2),
          fmt(r["same_host"]["gb_per_s"], 2), fmt(r["network"]["gb_per_s"], 2),
          fmt(r["same_host"]["gb_per_s"] / r["copyto"]["gb_per_s"], 2),
          fmt(r["network"]["gb_per_s"] / r["copyto"]["gb_per_s"], 2)] for r in rows],
        title="puts: DistributedStore.batch_put_from of every object in one call, median of "
              f"{PUT_REPS} (best in the JSON)")
    return rows


# ---- populate -------------------------------------------------------------------------------------------


def _demo_sizes() -> dict[int, list[int]]:
    from engram_model import BackboneConfig, EngramConfig, NgramHashMapping

    config = EngramConfig()
    mapping = NgramHashMapping.from_config(config, BackboneConfig())
    return {layer: mapping.get_table_vocab_sizes(layer) for layer in config.layer_ids}


def populate_section() -> list[dict]:
    demo = _demo_sizes()
    heads = max(len(s) for s in demo.values())
    rows_max = max(n for s in demo.values() for n in s)
    rng = np.random.default_rng(3)
    # One set of tables serves both layers (the bytes do not matter, only their amount), sliced per layer.
    pool = [rng.standard_normal((rows_max, DEMO_DIM), dtype=np.float32) for _ in range(heads)]
    total = sum(n * DEMO_DIM * 4 for s in demo.values() for n in s)
    segment_size = -(-(total // 2 + (384 << 20)) // (1 << 20)) << 20
    print(f"\npopulate: layers {sorted(demo)} of the demo config, {total / 1e9:.2f} GB over 2 segment processes "
          f"of {segment_size / 2**30:.2f} GiB", flush=True)
    rows = []
    with start_cluster(segments=2, segment_size=segment_size) as cluster:
        for mode, local_direct in (("same_host", True), ("network", False)):
            with DistributedStore.connect(cluster.address, timeout_ms=TIMEOUT_MS, local_direct=local_direct) as store:
                elapsed = {}
                layers = []
                for layer_id, sizes in demo.items():
                    layer = EngramStore(layer_id, EngramStoreConfig(sizes, DEMO_DIM), store)
                    tables = [pool[h][:n] for h, n in enumerate(sizes)]
                    t0 = time.perf_counter()
                    layer.populate(tables)
                    elapsed[layer_id] = time.perf_counter() - t0
                    layers.append(layer)
                seconds = sum(elapsed.values())
                rows.append({"mode": mode, "bytes": total, "seconds": seconds, "gb_per_s": total / seconds / 1e9,
                             "per_layer_s": elapsed})
                print(f"  {mode}: {total / seconds / 1e9:.2f} GB/s", flush=True)
                for layer in layers:
                    layer.remove_from_store(force=True)
    print_table(["populate", "GB", "seconds", "GB/s"],
                [[r["mode"].replace("_", "-"), f"{r['bytes'] / 1e9:.2f}", fmt(r["seconds"], 2), fmt(r["gb_per_s"], 2)]
                 for r in rows],
                title="populate: EngramStore.populate of both demo layers (checksums included)")
    return rows


# ---- many readers ---------------------------------------------------------------------------------------


def reader_client_main(spec: dict) -> int:
    """One client process of the readers section: lookups, then raw read_ranges, each on a 'go' line."""
    from engram_store import kernels as _kernels

    sizes = [ROWS] * HEADS
    with DistributedStore.connect(spec["master"], timeout_ms=TIMEOUT_MS, local_direct=False) as store:
        layer = EngramStore(spec["layer_id"], EngramStoreConfig(sizes, DIM), store)
        rng = np.random.default_rng(spec["seed"])
        batches = [np.stack([rng.integers(0, n, size=(BATCH, 1)) for n in sizes], axis=-1) for _ in range(64)]
        out = np.empty((BATCH, 1, HEADS, DIM), dtype=np.float32)
        infos = store.locate([f"engram:l{spec['layer_id']}:h{h}" for h in range(HEADS)], lease=False)
        base = np.array([info.replicas[0].offset for info in infos], dtype=np.int64)
        order = np.arange(HEADS, dtype=np.int64)
        plans = [_kernels.plan_reads(b.reshape(-1, HEADS), order, base, DIM * 4).pairs for b in batches]
        expected = [int(p[:, 1].sum()) for p in plans]
        conn = Connection(spec["endpoint"], unavailable=SegmentUnavailable)

        def lookup(i: int) -> None:
            layer.lookup_into(batches[i % 64], out)

        def raw(i: int) -> None:
            _, frames = conn.call("read_ranges", None, [plans[i % 64]], timeout_ms=TIMEOUT_MS)
            assert frames[0].buffer.nbytes == expected[i % 64]

        calls = {"lookup": lookup, "raw": raw}
        try:
            for name in spec.get("modes", ["lookup", "raw"]):
                call = calls[name]
                for i in range(20):  # warm: kernels, placement, connections
                    call(i)
                print(f"ready {name}", flush=True)
                if sys.stdin.readline().strip() != "go":
                    return 1
                lat = []
                t_end = time.perf_counter() + spec["seconds"]
                i = 0
                t0 = time.perf_counter()
                while t0 < t_end:
                    call(i)
                    t1 = time.perf_counter()
                    lat.append(t1 - t0)
                    t0 = t1
                    i += 1
                print(json.dumps({"mode": name, "count": i, "lat_us": [round(x * 1e6, 1) for x in lat]}), flush=True)
        finally:
            conn.close()
    return 0


class _Worker:
    """A reader client process (this script with --reader-client), driven line by line over its pipes."""

    def __init__(self, spec: dict):
        self.popen = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--reader-client", json.dumps(spec)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._buf = ""

    def line(self, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while "\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError("reader client: no answer within its timeout")
            ready, _, _ = select.select([self.popen.stdout], [], [], min(remaining, 1.0))
            if ready:
                chunk = os.read(self.popen.stdout.fileno(), 1 << 20).decode()
                if not chunk:
                    raise RuntimeError(f"reader client exited (code {self.popen.poll()})")
                self._buf += chunk
        line, self._buf = self._buf.split("\n", 1)
        return line

    def send(self, text: str) -> None:
        self.popen.stdin.write(text + "\n")
        self.popen.stdin.flush()

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=30)
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe is not None:
                pipe.close()


def _summary(results: list[dict], seconds: float) -> dict:
    lat = np.concatenate([np.asarray(r["lat_us"], dtype=np.float64) for r in results])
    return {"per_s": sum(r["count"] for r in results) / seconds, "p50_us": float(np.percentile(lat, 50)),
            "p99_us": float(np.percentile(lat, 99)), "count": int(lat.size)}


def _run_clients(master: str, endpoints: list[str], n: int, seconds: float,
                 modes: tuple[str, ...] = ("lookup", "raw"), background=None) -> dict:
    """Start ``n`` client processes, run each mode on all of them at once, reap them; ``background(stop)``
    (if given) runs in a thread of this process while each mode is measured."""
    workers = [_Worker({"master": master, "layer_id": 1, "seed": 100 + i, "seconds": seconds, "modes": list(modes),
                        "endpoint": endpoints[i % len(endpoints)]}) for i in range(n)]
    try:
        out = {}
        for mode in modes:
            for w in workers:
                assert w.line() == f"ready {mode}", f"reader client not ready for {mode}"
            stop = threading.Event()
            thread = threading.Thread(target=background, args=(stop,), daemon=True) if background else None
            if thread is not None:
                thread.start()
            try:
                for w in workers:
                    w.send("go")
                results = [json.loads(w.line(timeout_s=seconds + 120)) for w in workers]
            finally:
                stop.set()
                if thread is not None:
                    thread.join()
            out[mode] = _summary(results, seconds)
        return out
    finally:
        for w in workers:
            w.close()


def _stream_puts(master: str, stop: threading.Event, result: dict) -> None:
    """Put 64 MiB objects into the segment over the network until ``stop`` (a writer next to the readers)."""
    payload = np.random.default_rng(9).integers(0, 256, 64 << 20, dtype=np.uint8)
    moved, t0 = 0, time.perf_counter()
    try:
        with DistributedStore.connect(master, timeout_ms=TIMEOUT_MS, local_direct=False) as store:
            i = 0
            while not stop.is_set():
                store.put(f"bench:stream:{i}", payload)
                store.remove(f"bench:stream:{i}", force=True)
                moved += payload.nbytes
                i += 1
    except Exception as exc:  # reported by the caller: a measurement without its writer is not one
        result["error"] = exc
    result["gb_per_s"] = moved / (time.perf_counter() - t0) / 1e9


def readers_section(client_counts: list[int], seconds: float, reps: int) -> dict:
    from engram_store.testing import Cluster

    configs = [1, 2]
    tables = [np.random.default_rng(h).standard_normal((ROWS, DIM), dtype=np.float32) for h in range(HEADS)]
    print(f"\nreaders: {', '.join(map(str, client_counts))} client processes x B={BATCH}, L=1 remote lookups "
          f"({HEADS} heads x {ROWS:,} rows x D={DIM}), {seconds:g} s each, against a segment with --readers "
          f"{' and '.join(map(str, configs))} (the default here: {default_readers()}); best of {reps} alternating "
          "runs", flush=True)
    rows = {n: {"clients": n} for n in client_counts}
    during_puts: dict = {}
    with contextlib.ExitStack() as stack:
        # Both segments (each with its own master) are up at once and the runs alternate between them, so a
        # burst of load from elsewhere does not land on one configuration only.
        segments = {}
        for readers in configs:
            cluster = stack.enter_context(Cluster(segments=0, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                                                  extra=["--reuse-delay", "0"]))
            segment = cluster.add_segment("256MiB", ["--readers", str(readers)])
            with DistributedStore.connect(cluster.address, timeout_ms=TIMEOUT_MS) as store:
                EngramStore(1, EngramStoreConfig([ROWS] * HEADS, DIM), store).populate(tables)
            segments[readers] = (cluster, segment)
        for n in client_counts:
            runs: dict[int, list[dict]] = {readers: [] for readers in configs}
            for _ in range(reps):
                for readers, (cluster, segment) in segments.items():
                    runs[readers].append(_run_clients(cluster.address, segment.read_addresses, n, seconds))
            for readers in configs:
                best = {mode: max((run[mode] for run in runs[readers]), key=lambda r: r["per_s"])
                        for mode in ("lookup", "raw")}
                rows[n][f"readers_{readers}"] = {**best, "runs": runs[readers]}
                print(f"  --readers {readers}, {n} client(s): {best['lookup']['per_s']:,.0f} lookups/s, "
                      f"raw {best['raw']['per_s']:,.0f} req/s", flush=True)
        # One reading client while another streams puts into the same segment: reads queued on the main
        # socket wait behind the writes; a reader socket serves them in the meantime.
        cluster, segment = segments[configs[-1]]
        for name, endpoint in (("main", segment.address), ("reader", segment.read_addresses[0])):
            put_rate: dict = {}
            result = _run_clients(cluster.address, [endpoint], 1, seconds, modes=("raw",),
                                  background=lambda stop: _stream_puts(cluster.address, stop, put_rate))
            if "error" in put_rate:
                raise RuntimeError(f"the writer beside the readers failed: {put_rate['error']}")
            during_puts[name] = {**result["raw"], "puts_gb_per_s": put_rate.get("gb_per_s")}
            print(f"  raw reads to the {name} socket during puts: p99 {result['raw']['p99_us']:,.0f} us", flush=True)
    table = list(rows.values())
    a, b = (f"readers_{r}" for r in configs)
    for mode, title in (("lookup", "EngramStore.lookup, B=256 L=1, remote (the client picks the socket)"),
                        ("raw", "raw read_ranges of the same ranges to the reader sockets (client i -> reader i mod N)")):
        print_table(
            ["clients", f"r={configs[0]} /s", "p50 us", "p99 us", f"r={configs[1]} /s", "p50 us", "p99 us",
             f"r={configs[1]}/r={configs[0]}"],
            [[r["clients"], fmt(r[a][mode]["per_s"], 0), fmt(r[a][mode]["p50_us"]), fmt(r[a][mode]["p99_us"]),
              fmt(r[b][mode]["per_s"], 0), fmt(r[b][mode]["p50_us"]), fmt(r[b][mode]["p99_us"]),
              fmt(r[b][mode]["per_s"] / r[a][mode]["per_s"], 2)] for r in table],
            title=f"readers: {title}; /s in total over all clients, best of {reps}")
    print_table(["read_ranges sent to", "req/s", "p50 us", "p99 us", "puts GB/s meanwhile"],
                [[f"the {name} socket", fmt(r["per_s"], 0), fmt(r["p50_us"]), fmt(r["p99_us"]),
                  fmt(r["puts_gb_per_s"], 2)] for name, r in during_puts.items()],
                title=f"readers: 1 client's raw reads while another client streams 64 MiB puts into the same segment "
                      f"(--readers {configs[-1]})")
    return {"clients": table, "during_puts": during_puts}


# ---- main -----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes, smaller totals, 1 and 2 clients, shorter runs")
    p.add_argument("--sections", default="objects,puts,readers",
                   help="comma-separated sections to run: objects, puts, readers (default: all three)")
    p.add_argument("--populate", action="store_true",
                   help="also EngramStore.populate of both demo layers (5.3 GB; about 10 GB of RAM)")
    p.add_argument("--put-totals", type=float, nargs="+", metavar="GB", default=None,
                   help=f"bulk put totals in GB (default {PUT_TOTALS_GB}; --quick {QUICK_PUT_TOTALS_GB})")
    p.add_argument("--clients", type=int, nargs="+", default=None,
                   help=f"client process counts (default {CLIENT_COUNTS}; --quick {QUICK_CLIENT_COUNTS})")
    p.add_argument("--seconds", type=float, default=None, help="seconds each reader measurement runs")
    p.add_argument("--reps", type=int, default=None,
                   help=f"alternating runs per reader measurement, the best reported (default {READ_REPS}; --quick 1)")
    p.add_argument("--json", default=default_json_path("bench_store"), help="where to write the results")
    p.add_argument("--reader-client", metavar="SPEC", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.reader_client:
        return reader_client_main(json.loads(args.reader_client))
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - {"objects", "puts", "readers"}
    if unknown:
        p.error(f"--sections: unknown {sorted(unknown)}; expected objects, puts, readers")

    record: dict = {"benchmark": "bench_store", "quick": args.quick}
    if "objects" in sections:
        record["results"] = objects_section(args.quick)
    if "puts" in sections:
        record["puts"] = puts_section(args.put_totals or (QUICK_PUT_TOTALS_GB if args.quick else PUT_TOTALS_GB))
    if args.populate:
        record["populate"] = populate_section()
    if "readers" in sections:
        seconds = args.seconds or (QUICK_READ_SECONDS if args.quick else READ_SECONDS)
        record["readers"] = readers_section(args.clients or (QUICK_CLIENT_COUNTS if args.quick else CLIENT_COUNTS),
                                            seconds, args.reps or (1 if args.quick else READ_REPS))
    write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
