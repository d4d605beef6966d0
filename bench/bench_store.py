"""Put and get throughput of the store, next to a raw ZeroMQ round trip of the same bytes.

    python bench/bench_store.py [--quick] [--json PATH]

One ``engram-master`` and one ``engram-segment`` process on 127.0.0.1, and two clients in this process:

- put: ``put(key, data)`` of a new key (master ``put_start``, the bytes to the segment in 16 MiB chunks, master
  ``put_end``); the key is removed after each timed put, untimed.
- get local: ``get_into(key, buffer)`` from a client that maps the segment's shared memory (local-direct: one
  master ``get_replicas`` request, then a memory copy).
- get remote: the same from a client built with ``local_direct=False``, so the bytes come over ZeroMQ from the
  segment process even though its memory is on this host.
- raw zmq: a DEALER asks an echo server (a bare ROUTER in another process) for that many bytes and receives
  them into a caller buffer with ``recv_into``: no master, no header, no range checks; the floor for any
  network read on this machine.

GB/s is object bytes / median time of one call (10^9 bytes per second). remote/raw above 1 cannot happen
unless the store overlaps requests the raw round trip does not (it sends chunks of large objects in parallel).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from _common import EchoClient, EchoServer, TIMEOUT_MS, default_json_path, fmt, measure, print_table, \
    size_label, start_cluster, write_json
from engram_store import DistributedStore

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 1 << 20, 16 << 20]


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"sizes {[size_label(s) for s in QUICK_SIZES]}, "
                                                        "shorter timing (a smoke run of ~20 s)")
    p.add_argument("--json", default=default_json_path("bench_store"), help="where to write the results")
    args = p.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    data = np.random.default_rng(0).integers(0, 256, size=max(sizes), dtype=np.uint8)
    # Room for the object read back plus the one being put, with slack for allocator alignment.
    segment_size = max(256 << 20, 4 * max(sizes))

    rows = []
    print(f"store throughput: 1 segment process of {size_label(segment_size)}, sizes "
          f"{', '.join(size_label(s) for s in sizes)}{' (quick)' if args.quick else ''}", flush=True)
    with start_cluster(segments=1, segment_size=segment_size) as cluster, EchoServer() as server, \
            EchoClient(server.address) as echo, \
            DistributedStore.connect(cluster.address, timeout_ms=TIMEOUT_MS, local_direct=True) as local, \
            DistributedStore.connect(cluster.address, timeout_ms=TIMEOUT_MS, local_direct=False) as remote:
        for size in sizes:
            row = _bench_size(size, data, local, remote, echo, args.quick)
            rows.append(row)
            print(f"  {size_label(size)}: puts {row['put_local']['reps']}/{row['put_remote']['reps']} reps, gets {row['get_local']['reps']}/"
                  f"{row['get_remote']['reps']}/{row['raw_zmq']['reps']} reps", flush=True)

    print_table(
        ["size", "put local GB/s", "put remote GB/s", "get local GB/s", "get remote GB/s", "raw zmq GB/s",
         "remote/raw", "get remote p50 us", "raw p50 us"],
        [[size_label(r["size"]), fmt(r["put_local"]["gb_per_s"], 3), fmt(r["put_remote"]["gb_per_s"], 3),
          fmt(r["get_local"]["gb_per_s"], 3),
          fmt(r["get_remote"]["gb_per_s"], 3), fmt(r["raw_zmq"]["gb_per_s"], 3), fmt(r["remote_over_raw"], 2),
          fmt(r["get_remote"]["p50_us"]), fmt(r["raw_zmq"]["p50_us"])] for r in rows],
        title="GB/s = bytes / median call time (10^9 B/s)")
    write_json(args.json, {"benchmark": "bench_store", "quick": args.quick, "segment_size": segment_size,
                           "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
