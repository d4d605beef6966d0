"""Full-size tables: populate throughput, and lookup cost against table size.

    python bench/bench_scale.py [--quick] [--json PATH]

1. Populate both Engram layers of DeepSeek's demo config (layers 1 and 15; 16 heads each of about 646,400
   rows x 64 float32, about 5.3 GB in all) across two ``engram-segment`` processes, twice: from a client on the
   segments' host (writes into the segments' memory as file writes, no request per chunk) and from a client that
   sends everything over the network (``local_direct=False``: ZeroMQ to the segment processes). Beside them,
   ``np.copyto`` of the same tables into memory already mapped: the floor of any copy on this machine.
2. For tables of 10^4 to 6.5 x 10^5 rows per head (16 heads, D = 64), the lookup latency at B=256, L=1 and at
   B=1, L=4096, on the remote path (every read over the network to the segment processes) and the local-direct
   path (the segments' shared memory mapped in this process). The cost depends on the rows asked for, not on the
   size of the table they come from: the curve is flat.

``--quick`` uses the same shapes with tables scaled down (the largest 6.5 x 10^4 rows), for a smoke run.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from _common import default_json_path, write_json

from engram_model import BackboneConfig, EngramConfig, NgramHashMapping
from engram_store import DistributedStore, EngramStore, EngramStoreConfig
from engram_store.testing import Cluster

DIM = 64


def _demo_sizes() -> dict[int, list[int]]:
    """Per-layer head table sizes (primes) of DeepSeek's demo config."""
    config = EngramConfig()
    mapping = NgramHashMapping.from_config(config, BackboneConfig())
    return {layer: mapping.get_table_vocab_sizes(layer) for layer in config.layer_ids}


def _tables(sizes: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, DIM), dtype=np.float32) for n in sizes]


def _latency_ms(layer: EngramStore, sizes: list[int], batch: int, length: int, reps: int) -> dict:
    rng = np.random.default_rng(batch * 7 + length)
    batches = [np.stack([rng.integers(0, n, size=(batch, length)) for n in sizes], axis=-1) for _ in range(8)]
    out = np.empty((batch, length, len(sizes), DIM), dtype=np.float32)
    layer.lookup_into(batches[0], out)  # placement and kernels warm
    times = []
    for i in range(reps):
        t0 = time.perf_counter_ns()
        layer.lookup_into(batches[i % len(batches)], out)
        times.append(time.perf_counter_ns() - t0)
    t = np.array(times) / 1e6
    return {"mean_ms": float(t.mean()), "p50_ms": float(np.median(t)), "p99_ms": float(np.percentile(t, 99))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tables scaled down by 10x")
    p.add_argument("--json", default=default_json_path("bench_scale"))
    args = p.parse_args(argv)
    scale = 10 if args.quick else 1
    demo = {layer: [n // scale for n in sizes] for layer, sizes in _demo_sizes().items()}
    total_bytes = sum(n * DIM * 4 for sizes in demo.values() for n in sizes)
    segment_size = max(total_bytes // 2 + (256 << 20), 512 << 20)
    row_counts = [n // scale for n in (10_000, 30_000, 100_000, 300_000, 650_000)]
    reps = 20 if args.quick else 50
    result: dict = {"scale": scale}

    with Cluster(segments=2, segment_size=str(segment_size), heartbeat_timeout_s=30.0) as cluster:
        with DistributedStore.connect(cluster.address, timeout_ms=60_000, local_direct=False) as remote, \
                DistributedStore.connect(cluster.address, timeout_ms=60_000) as local:
            # 1. Both demo layers, as a deployment would load them: from this host, then over the network.
            print(f"populating layers {sorted(demo)}: {len(demo)} x {len(next(iter(demo.values())))} heads, "
                  f"{total_bytes / 1e9:.2f} GB over 2 segments", flush=True)
            rows = []
            floor_s = 0.0
            for label, client in (("same host", local), ("network", remote)):
                elapsed = 0.0
                for layer_id, sizes in demo.items():
                    tables = _tables(sizes, layer_id)
                    if label == "same host":  # the floor: the same bytes into memory already mapped
                        dst = [np.ones_like(t) for t in tables]
                        t0 = time.perf_counter()
                        for d, t in zip(dst, tables):
                            np.copyto(d, t)
                        floor_s += time.perf_counter() - t0
                        del dst
                    layer = EngramStore(layer_id, EngramStoreConfig(sizes, DIM), client)
                    t0 = time.perf_counter()
                    layer.populate(tables)
                    elapsed += time.perf_counter() - t0
                    del tables
                    assert layer.verify() == list(range(len(sizes))), f"{label}: stored rows differ"
                for layer_id, sizes in demo.items():
                    EngramStore(layer_id, EngramStoreConfig(sizes, DIM), client).remove_from_store(force=True)
                rows.append({"path": label, "bytes": total_bytes, "seconds": elapsed,
                             "gb_per_s": total_bytes / elapsed / 1e9})
            floor = {"path": "np.copyto", "bytes": total_bytes, "seconds": floor_s,
                     "gb_per_s": total_bytes / floor_s / 1e9}
            print(f"\n{'populate':<12} {'GB':>6} {'seconds':>8} {'GB/s':>6} {'of copyto':>9}")
            for row in rows + [floor]:
                print(f"{row['path']:<12} {row['bytes'] / 1e9:>6.2f} {row['seconds']:>8.2f} {row['gb_per_s']:>6.2f} "
                      f"{row['gb_per_s'] / floor['gb_per_s']:>8.0%}", flush=True)
            result["populate"] = {"paths": rows, "np_copyto": floor}

            # 2. Lookup latency against table size.
            print(f"\n{'rows/head':>10} {'shape':>12} {'remote p50 ms':>14} {'remote p99':>11} "
                  f"{'local p50 ms':>13} {'local p99':>10}")
            curve = []
            for rows in row_counts:
                sizes = [rows + h for h in range(16)]
                layer_id = 100 + rows
                writer = EngramStore(layer_id, EngramStoreConfig(sizes, DIM), remote)
                writer.populate(_tables(sizes, rows))
                reader = EngramStore(layer_id, EngramStoreConfig(sizes, DIM), local)
                for batch, length in ((256, 1), (1, 4096)):
                    r = _latency_ms(writer, sizes, batch, length, reps)
                    lo = _latency_ms(reader, sizes, batch, length, reps)
                    curve.append({"rows_per_head": rows, "batch": batch, "length": length, "remote": r, "local": lo})
                    print(f"{rows:>10} {f'{batch}x{length}':>12} {r['p50_ms']:>14.3f} {r['p99_ms']:>11.3f} "
                          f"{lo['p50_ms']:>13.3f} {lo['p99_ms']:>10.3f}", flush=True)
                writer.remove_from_store(force=True)
            result["lookup_vs_table_size"] = curve

    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
