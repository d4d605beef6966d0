"""Soak test: client processes hammer a real cluster while a segment is killed and a new one joins.

    python bench/soak.py --clients 4 --duration 60

Each client process loops over mixed work until the time is up: ``EngramStore.lookup`` of random rows (every
row compared with a local copy of the tables), and put / get / remove churn of random objects (every byte
compared). A third of the way in, one segment is killed with SIGKILL; two thirds in, a fresh segment joins.
The tables are written with ``replica_num=2`` and the master runs with ``--re-replicate``, so lookups must
keep answering correctly throughout; churn objects written with one replica may be lost with the killed
segment, which shows up as errors by class, never as wrong bytes.

Prints operations done, errors by class, wrong rows and bytes (must be 0), and each server's resident memory
at start and end; writes JSON; exits 1 on any wrong row or byte.
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import sys
import threading
import time

import numpy as np
from _common import default_json_path, write_json

from engram_store import DistributedStore, EngramError, EngramStore, EngramStoreConfig
from engram_store.testing import Cluster

SIZES = [50_021, 50_023, 50_033, 50_047, 50_051, 50_053, 50_069, 50_077]
DIM = 16
LAYER = 7


def _tables() -> list[np.ndarray]:
    rng = np.random.default_rng(1234)
    return [rng.standard_normal((n, DIM), dtype=np.float32) for n in SIZES]


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _client(index: int, master: str, deadline: float, local_direct: bool, results: mp.Queue) -> None:
    tables = _tables()
    rng = np.random.default_rng(index)
    counts: collections.Counter = collections.Counter()
    errors: collections.Counter = collections.Counter()
    wrong_rows = wrong_bytes = 0
    with DistributedStore.connect(master, timeout_ms=3000, local_direct=local_direct) as store:
        layer = EngramStore(LAYER, EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=DIM), store)
        serial = 0
        while time.time() < deadline:
            try:
                if rng.random() < 0.8:
                    batch = int(rng.choice([1, 16, 256]))
                    ids = np.stack([rng.integers(0, n, size=(batch, 1)) for n in SIZES], axis=-1)
                    rows = layer.lookup(ids)
                    expected = np.stack([tables[h][ids[..., h]] for h in range(len(SIZES))], axis=-2)
                    wrong_rows += int((rows != expected).any(axis=-1).sum())
                    counts["lookup"] += 1
                else:
                    serial += 1
                    key = f"soak-{index}-{serial}"
                    data = rng.bytes(int(rng.integers(1, 256 << 10)))
                    store.put(key, data)
                    counts["put"] += 1
                    got = store.get(key)
                    wrong_bytes += int(got != data)
                    counts["get"] += 1
                    store.remove(key, force=True)
                    counts["remove"] += 1
            except EngramError as exc:
                errors[type(exc).__name__] += 1
    results.put({"client": index, "ops": dict(counts), "errors": dict(errors), "wrong_rows": wrong_rows,
                 "wrong_bytes": wrong_bytes})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--segments", type=int, default=3, help="segments at start (default 3)")
    p.add_argument("--json", default=default_json_path("soak"))
    args = p.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or args.segments < 2:
        p.error("need --clients >= 1, --duration > 0 and --segments >= 2 (tables keep two replicas)")

    with Cluster(segments=args.segments, segment_size="128MiB", heartbeat_timeout_s=2.0,
                 extra=["--re-replicate"]) as cluster:
        with DistributedStore.connect(cluster.address, timeout_ms=10_000) as store:
            layer = EngramStore(LAYER, EngramStoreConfig(table_vocab_sizes=SIZES, embedding_dim=DIM), store)
            layer.populate(_tables(), replica_num=2)
            rss_start = {f"{p.name}:{p.pid}": _rss_kib(p.pid) for p in cluster.procs}
            start = time.time()
            deadline = start + args.duration
            results: mp.Queue = mp.get_context("spawn").Queue()
            ctx = mp.get_context("spawn")
            clients = [ctx.Process(target=_client, args=(i, cluster.address, deadline, i % 2 == 0, results))
                       for i in range(args.clients)]
            for c in clients:
                c.start()
            events = []

            def chaos() -> None:
                time.sleep(args.duration / 3)
                victim = cluster.segments[0]
                victim.kill()
                events.append(f"t={time.time() - start:.1f}s killed segment {victim.address}")
                time.sleep(args.duration / 3)
                fresh = cluster.add_segment("128MiB")
                events.append(f"t={time.time() - start:.1f}s added segment {fresh.address}")

            chaos_thread = threading.Thread(target=chaos, daemon=True)
            chaos_thread.start()
            reports = [results.get(timeout=args.duration + 120) for _ in clients]
            for c in clients:
                c.join(timeout=30)
            chaos_thread.join(timeout=args.duration)
            rss_end = {f"{p.name}:{p.pid}": _rss_kib(p.pid) for p in cluster.procs if p.alive()}
            status = store.status()
            layer.remove_from_store(force=True)

    ops: collections.Counter = collections.Counter()
    errors: collections.Counter = collections.Counter()
    for r in reports:
        ops.update(r["ops"])
        errors.update(r["errors"])
    wrong_rows = sum(r["wrong_rows"] for r in reports)
    wrong_bytes = sum(r["wrong_bytes"] for r in reports)
    print(f"soak: {args.clients} clients for {args.duration:g} s against {args.segments} segments")
    for e in events:
        print(f"  {e}")
    print(f"  operations: {dict(ops)} ({sum(ops.values()) / args.duration:.0f}/s)")
    print(f"  errors by class: {dict(errors) or 'none'}")
    print(f"  wrong rows: {wrong_rows}   wrong bytes: {wrong_bytes}")
    print(f"  under-replicated at end: {status.get('under_replicated')}")
    print("  server RSS (KiB)    start        end")
    for name, kib in rss_start.items():
        print(f"  {name:<18} {kib:>8} {rss_end.get(name, 'dead'):>10}")
    for name, kib in rss_end.items():
        if name not in rss_start:
            print(f"  {name:<18} {'-':>8} {kib:>10}")
    write_json(args.json, {"args": vars(args), "events": events, "ops": dict(ops), "errors": dict(errors),
                           "wrong_rows": wrong_rows, "wrong_bytes": wrong_bytes, "rss_start_kib": rss_start,
                           "rss_end_kib": rss_end, "clients": reports})
    return 1 if wrong_rows or wrong_bytes else 0


if __name__ == "__main__":
    sys.exit(main())
