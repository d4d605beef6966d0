"""A serving replay: worker processes stepping continuous batches of real text through V4.1's Engram rows on SSD.

    python bench/bench_serving.py [--dir DIR] [--layer-bytes 30GB] [--workers 1,2,4] [--cache-bytes 1GiB]
                                  [--configs none,process,host,dram] [--steps 300] [--warmup-steps 100]
                                  [--step-ms 20] [--running 32] [--drafts 0] [--quick] [--json PATH]

Each worker process (this script with ``--worker``) serves its own stream of requests, seeded by its index so
every configuration replays the same traffic: Poisson arrivals, each request a random stretch of the corpus
(``bench/corpus.py``: the standard library through DeepSeek-V4's tokenizer), a prompt of lognormal length
(median 384 tokens) prefilled in chunks of at most ``--chunk`` tokens, then its real continuation decoded a token
a step (with ``--drafts K``, K speculative tokens a step as well, hashed without committing and a random prefix of
them accepted). Each step's tokens are hashed at once with ``V41Hasher.step_ragged`` (released config, layers 1 and
14) and both layers' rows read with one ``EngramStore.lookup_layers``; then the worker sleeps the rest of a
``--step-ms`` step, as an engine waits for its GPU. V4.1's ids (24 columns of ~16M rows a layer) are folded into
the benchmark's layers (row ``r`` of column c -> ``r mod rows[c]``): two layers of 24 heads of 264-byte rows,
``--layer-bytes`` in all, written once under ``--dir`` (row r of head h starts with ``layer << 48 | h << 40 | r``,
checked in the first measured step).

Configurations, for 1, 2 and 4 workers, run one after the other in this order for each worker count:

* ``none``: the layers on SSD, no cache;
* ``process``: a cache of ``--cache-bytes`` in each worker (``cache_scope="process"``);
* ``host``: one cache of ``--cache-bytes`` in all, shared by the workers (``cache_scope="host"``);
* ``host+warm``: the same, warm-started (``EngramStore.warm_cache``) from a profile of the corpus's first fifth,
  which the requests never come from (they are drawn from the rest);
* ``dram``: the same layers in memory (``local_dir`` under ``/dev/shm``, shared by the workers' mappings; of
  ``--dram-bytes``, by default the SSD layers' size up to half the host's memory, deleted at the end).

Per step: the time of the hash and the rows (p50/p99 over all workers' measured steps), pages read, rows looked
up; per configuration: hit rate (and by n-gram order), the host's memory (the workers' PSS summed, which counts
shared pages once, plus the tables' own bytes in /dev/shm for ``dram``). The headline is the ratio of the host
cache's p50 to the in-memory layers' (``p50/dram``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from _common import default_json_path, print_table, write_json

import corpus as corpus_mod
from engram_store import EngramStore, EngramStoreConfig
from engram_store.units import parse_size
from engram_store.disk import DiskDir

LAYER_IDS = (1, 14)
COLS = 24
ROW_BYTES = 264
DRAM_DIR = "/dev/shm/engram-serving-bench"
#: The share of the corpus a warm-start profile is counted on; requests are drawn from the rest.
PROFILE_FRAC = 0.2


def write_profile(corpus, sizes: list[int], path: str) -> None:
    """The warm-start profile of the corpus's first PROFILE_FRAC, folded into the benchmark's layers as lookups
    are (what ``engram-stats --v41 --profile`` writes for the real layers)."""
    from engram_model.stats import profile_rows
    from engram_model.v41 import V41Config
    from engram_store.disk import save_profile

    config = V41Config(layer_ids=LAYER_IDS)
    end = int(corpus.doc_starts[-1] * PROFILE_FRAC)
    fold = np.asarray(sizes, dtype=np.int64)
    save_profile(path, {lid: profile_rows((np.asarray(corpus.rows[lid][:end], np.int64) - config.offsets(lid)) % fold)
                        for lid in LAYER_IDS})


# ---- the layers -------------------------------------------------------------------------------------------------

def layer_sizes(total_bytes: int) -> list[int]:
    """Rows of each of the 24 heads of one of the two layers sharing ``total_bytes`` (15 rows a 4 KiB page)."""
    rows = total_bytes // len(LAYER_IDS) // 4096 * (4096 // ROW_BYTES)
    return [rows // COLS - h for h in range(COLS)]


def pattern(layer: int, head: int, start: int, out: np.ndarray) -> None:
    """Rows ``start ..`` of a head into ``out`` ``[n, ROW_BYTES]``: the 8 bytes of ``layer << 48 | head << 40 |
    row``, then that value mod 251."""
    keys = (np.int64(layer) << 48) | (np.int64(head) << 40) | np.arange(start, start + out.shape[0], dtype=np.int64)
    out[:, :8] = keys.view(np.uint8).reshape(-1, 8)
    out[:, 8:] = (keys % 251).astype(np.uint8)[:, None]


def configs(sizes: list[int]) -> dict[int, EngramStoreConfig]:
    return {lid: EngramStoreConfig(list(sizes), ROW_BYTES, row_format="bytes") for lid in LAYER_IDS}


def ensure_disk_layers(directory: str, sizes: list[int]) -> None:
    d = DiskDir(directory)
    for lid in LAYER_IDS:
        manifest = os.path.join(d.layer_path(lid), "manifest.json")
        if os.path.isfile(manifest):
            with open(manifest) as f:
                if json.load(f)["sizes"] == sizes:
                    continue
            d.remove(lid)
        need = -(-sizes[0] // 15) * 4096 * COLS
        free = shutil.disk_usage(directory).free
        if need > free - (4 << 30):
            sys.exit(f"{directory}: {free / 1e9:.1f} GB free, layer {lid} needs {need / 1e9:.1f} GB (--layer-bytes)")
        t0 = time.perf_counter()
        d.write(lid, ROW_BYTES, sizes, [lambda start, out, h=h, lid=lid: pattern(lid, h, start, out)
                                        for h in range(COLS)])
        print(f"wrote layer {lid}: {need / 1e9:.1f} GB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def ensure_dram_layers(sizes: list[int]) -> None:
    from engram_store.tables._local_dir import layout_text

    for lid in LAYER_IDS:  # layers of another size, from an earlier run: written again
        try:
            with open(os.path.join(DRAM_DIR, f"layer-{lid}", "layout"), "rb") as f:
                if f.read() != layout_text(ROW_BYTES, sizes):
                    shutil.rmtree(os.path.join(DRAM_DIR, f"layer-{lid}"))
        except FileNotFoundError:
            pass
    with EngramStore(configs(sizes), local_dir=DRAM_DIR) as store:
        for lid in LAYER_IDS:
            if os.path.isdir(os.path.join(DRAM_DIR, f"layer-{lid}")):
                continue  # a mismatching layout raises when the workers open it
            tables = []
            for h, n in enumerate(sizes):
                t = np.empty((n, ROW_BYTES), dtype=np.uint8)
                pattern(lid, h, 0, t)
                tables.append(t)
            store.populate(tables, layer=lid)
            del tables


# ---- one worker -------------------------------------------------------------------------------------------------

class Traffic:
    """One worker's requests: Poisson arrivals, prompts and outputs from the corpus, a continuous batch."""

    def __init__(self, corpus, seed: int, running: int, chunk: int, budget: int, drafts: int):
        self.rng = np.random.default_rng(seed)
        self.tokens = np.asarray(corpus.tokens, dtype=np.int64)
        starts = corpus.doc_starts
        past = int(starts[-1] * PROFILE_FRAC)  # requests come from the rest: the profile never saw them
        self.docs = [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:]) if b - a >= 64 and a >= past]
        self.chunk, self.budget, self.drafts = chunk, budget, drafts
        self.rate = running / 220.0  # arrivals a step: Little's law with ~220 steps a request
        self.free = list(range(4 * running))
        self.active: list[dict] = []

    def _arrive(self, hasher_state) -> None:
        for _ in range(self.rng.poisson(self.rate)):
            if not self.free:
                return
            a, b = self.docs[int(self.rng.integers(len(self.docs)))]
            prompt = int(np.clip(self.rng.lognormal(np.log(384), 0.8), 16, 4096))
            output = int(np.clip(self.rng.lognormal(np.log(160), 0.7), 8, 1024))
            prompt = min(prompt, max(8, (b - a) // 2))
            output = min(output, b - a - prompt)
            at = int(self.rng.integers(a, b - prompt - output + 1))
            slot = self.free.pop()
            hasher_state.reset([slot])
            self.active.append({"slot": slot, "at": at, "prompt": prompt, "end": at + prompt + output, "done": at})

    def step(self, hasher_state) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
        """The next step: tokens [T], slots [R], query_start_loc [R + 1] and each request's tokens to commit."""
        self._arrive(hasher_state)
        pieces, slots, commit = [], [], []
        budget = self.budget
        for r in sorted(self.active, key=lambda r: r["done"] < r["at"] + r["prompt"]):  # decodes first
            left = r["end"] - r["done"]
            if r["done"] < r["at"] + r["prompt"]:
                n = min(self.chunk, r["at"] + r["prompt"] - r["done"], budget)
                accept = n
            else:
                n = min(1 + self.drafts, left)
                accept = min(n, 1 + int(self.rng.integers(0, self.drafts + 1)))
            if n <= 0:
                continue
            budget -= n
            pieces.append(self.tokens[r["done"]:r["done"] + n])
            slots.append(r["slot"])
            commit.append(accept)
        lengths = [p.size for p in pieces]
        qsl = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        tokens = np.concatenate(pieces) if pieces else np.empty(0, np.int64)
        return tokens, np.asarray(slots, np.int64), qsl, commit

    def advance(self, slots: np.ndarray, commit: list[int]) -> None:
        by_slot = {r["slot"]: r for r in self.active}
        for s, n in zip(slots.tolist(), commit):
            by_slot[s]["done"] += n
        for r in [r for r in self.active if r["done"] >= r["end"]]:
            self.active.remove(r)
            self.free.append(r["slot"])


def pss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def worker_main(args) -> int:
    from engram_model.v41 import V41Config, V41Hasher

    corpus = corpus_mod.load(args.corpus_dir)
    sizes = layer_sizes(parse_size(args.layer_bytes))
    config = V41Config(layer_ids=LAYER_IDS)
    hasher = V41Hasher(config, corpus.token_map)
    offsets = {lid: config.offsets(lid) for lid in LAYER_IDS}
    fold = np.asarray(sizes, dtype=np.int64)
    if args.config == "dram":
        sizes = layer_sizes(parse_size(args.dram_bytes))
        fold = np.asarray(sizes, dtype=np.int64)
    kw = (dict(local_dir=DRAM_DIR) if args.config == "dram" else
          dict(disk_dir=args.dir, row_cache_bytes=0 if args.config == "none" else parse_size(args.cache_bytes),
               cache_scope="host" if args.config.startswith("host") else "process"))
    traffic = Traffic(corpus, 1000 + args.index, args.running, args.chunk, args.budget, args.drafts)
    state = hasher.begin(len(traffic.free))
    with EngramStore(configs(sizes), **kw) as store:
        if args.config.endswith("+warm"):
            for lid in LAYER_IDS:
                store.warm_cache(args.profile, layer=lid)
        while not os.path.exists(args.go):  # all workers start stepping together
            time.sleep(0.002)
        times, hash_times, pages, rows = [], [], [], []
        total = args.warmup_steps + args.steps
        for step in range(total):
            t_start = time.perf_counter()
            tokens, slots, qsl, commit = traffic.step(state)
            t0 = time.perf_counter_ns()
            ids = hasher.step_ragged(state, tokens, slots, qsl, commit=args.drafts == 0)     # [T, 2, 24]
            t1 = time.perf_counter_ns()
            want = {lid: ((ids[:, j, :] - offsets[lid]) % fold)[None] for j, lid in enumerate(LAYER_IDS)}
            got = store.lookup_layers(want) if tokens.size else {}
            t2 = time.perf_counter_ns()
            if args.drafts:
                accepted = np.concatenate([tokens[qsl[i]:qsl[i] + n] for i, n in enumerate(commit)])
                qacc = np.concatenate(([0], np.cumsum(commit))).astype(np.int64)
                hasher.commit(state, accepted, slots, qacc)
            traffic.advance(slots, commit)
            if step == args.warmup_steps:
                store.stats(reset=True)
                for j, lid in enumerate(LAYER_IDS if tokens.size else ()):  # every row is the one its id names
                    head = got[lid].reshape(-1, COLS, ROW_BYTES)[:, :, :8].copy().view(np.int64)[..., 0]
                    expect = (np.int64(lid) << 48) | (np.arange(COLS, dtype=np.int64) << 40) | want[lid][0]
                    assert np.array_equal(head, expect), f"wrong rows in layer {lid}"
                last_pages = 0
            if step >= args.warmup_steps:
                p = store.stats()["pages_read"]
                times.append(t2 - t0)
                hash_times.append(t1 - t0)
                pages.append(p - last_pages)
                rows.append(int(tokens.size) * COLS * len(LAYER_IDS))
                last_pages = p
            rest = args.step_ms / 1e3 - (time.perf_counter() - t_start)
            if rest > 0:
                time.sleep(rest)
        s = store.stats()
        result = {"times_ns": times, "hash_ns": hash_times, "pages": pages, "rows": rows,
                  "hits_per_head": s.get("cache_hits_per_head", []), "misses_per_head": s.get("cache_misses_per_head", []),
                  "cache_hits": s["cache_hits"], "cache_misses": s["cache_misses"], "pss": pss_bytes(),
                  "host_cache": {k: v for k, v in s.items() if k.startswith("host_cache_")}}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# ---- the driver -------------------------------------------------------------------------------------------------

def run(args, config: str, n: int) -> dict:
    go = os.path.join(tempfile.mkdtemp(prefix="engram-serving-"), "go")
    base = [sys.executable, os.path.abspath(__file__), "--worker", "--config", config, "--go", go,
            "--dir", args.dir, "--layer-bytes", args.layer_bytes, "--cache-bytes", args.cache_bytes,
            "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps), "--step-ms", str(args.step_ms),
            "--running", str(args.running), "--chunk", str(args.chunk), "--budget", str(args.budget),
            "--drafts", str(args.drafts), "--dram-bytes", args.dram_bytes, "--profile", args.profile or ""] \
        + (["--corpus-dir", args.corpus_dir] if args.corpus_dir else [])
    procs = [subprocess.Popen(base + ["--index", str(i)], stdout=subprocess.PIPE, text=True) for i in range(n)]
    try:
        time.sleep(1.0)
        open(go, "w").close()
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(os.path.dirname(go), ignore_errors=True)
    results = []
    for p, out in zip(procs, outs):
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if p.returncode != 0 or not line:
            raise SystemExit(f"a {config} worker failed (exit {p.returncode}):\n{out[-2000:]}")
        results.append(json.loads(line[0][7:]))
    times = np.concatenate([r["times_ns"] for r in results]) / 1e3
    hash_us = np.concatenate([r["hash_ns"] for r in results]) / 1e3
    cached = config not in ("none", "dram")
    hits = np.sum([r["hits_per_head"] for r in results if r["hits_per_head"]], axis=0) if cached else None
    misses = np.sum([r["misses_per_head"] for r in results if r["misses_per_head"]], axis=0) if hits is not None else None
    by_order = ([float(hits[i:i + 8].sum() / max(1, (hits + misses)[i:i + 8].sum())) for i in range(0, COLS, 8)]
                if hits is not None else None)
    lookups = sum(r["cache_hits"] + r["cache_misses"] for r in results)
    return {"config": config, "workers": n, "p50_us": float(np.percentile(times, 50)),
            "p99_us": float(np.percentile(times, 99)), "hash_p50_us": float(np.percentile(hash_us, 50)),
            "pages_per_step": float(np.mean(np.concatenate([r["pages"] for r in results]))),
            "rows_per_step": float(np.mean(np.concatenate([r["rows"] for r in results]))),
            "hit_rate": (sum(r["cache_hits"] for r in results) / lookups) if hits is not None and lookups else None,
            "hit_rate_by_order": by_order, "pss_bytes": int(sum(r["pss"] for r in results)),
            "host_memory_bytes": int(sum(r["pss"] for r in results)),
            "host_cache": results[0]["host_cache"] if config.startswith("host") else None}


def hot_path(args) -> dict:
    """A decode-sized lookup (64 tokens x 24 rows of layer 1) served wholly from a process cache and from a host
    cache, interleaved call by call: what sharing costs where nothing is read."""
    from engram_store.disk import HostRowCache, RowCache

    sizes = layer_sizes(parse_size(args.layer_bytes))
    rng = np.random.default_rng(0)
    ids = np.stack([rng.integers(0, n, 64) for n in sizes], axis=1).astype(np.int64)
    out = np.empty(ids.size * ROW_BYTES, np.uint8)
    d = DiskDir(args.dir)
    with tempfile.TemporaryDirectory(prefix="engram-serving-shm-") as shm, \
            HostRowCache(64 << 20, ROW_BYTES, scope="bench-serving-hot-path", directory=shm) as host, \
            d.open(LAYER_IDS[0], cache=RowCache(64 << 20, ROW_BYTES, "always")) as a, \
            d.open(LAYER_IDS[0], cache=host) as b:
        times: dict[str, list[int]] = {"process": [], "host": []}
        for layer in (a, b):
            layer.read_rows(ids, out)  # now cached
        for _ in range(4000):
            for name, layer in (("process", a), ("host", b)):
                t0 = time.perf_counter_ns()
                layer.read_rows(ids, out)
                times[name].append(time.perf_counter_ns() - t0)
        assert a.stats()["cache_misses"] == b.stats()["cache_misses"] == ids.size, "every timed row was a hit"
    p50 = {name: float(np.percentile(t, 50)) / 1e3 for name, t in times.items()}
    print_table(["cache", "p50 us", "p99 us"], [[name, f"{p50[name]:.1f}", f"{np.percentile(t, 99) / 1e3:.1f}"]
                                               for name, t in times.items()],
                title=f"hot path: a 64 x 24-row lookup served wholly from the cache, 4,000 interleaved calls; "
                      f"host / process = {p50['host'] / p50['process']:.2f}")
    return {"p50_us": p50, "ratio": p50["host"] / p50["process"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/var/tmp/engram-serving-bench", help="where the layers are written once")
    p.add_argument("--layer-bytes", default="30GB", help="both layers' files together (default 30GB)")
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--configs", default="none,process,host,host+warm,dram")
    p.add_argument("--dram-bytes", default=None, help="the in-memory layers' size (default: --layer-bytes, at "
                                                      "most half the host's memory)")
    p.add_argument("--cache-bytes", default="1GiB", help="per worker (process) or in all (host)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--step-ms", type=float, default=20.0, help="a step's period: the worker sleeps the rest")
    p.add_argument("--running", type=int, default=32, help="requests in flight per worker, on average")
    p.add_argument("--chunk", type=int, default=512, help="most prefill tokens of a request per step")
    p.add_argument("--budget", type=int, default=2048, help="most tokens per step")
    p.add_argument("--drafts", type=int, default=0, help="speculative tokens per decode step")
    p.add_argument("--corpus-dir", default=None)
    p.add_argument("--quick", action="store_true", help="60 steps after 20, workers 1 and 2")
    p.add_argument("--hot-path", action="store_true", help="only compare a cached lookup's cost in a process "
                                                           "cache and a host cache (the layers must exist)")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--config", "--go", "--profile"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.hot_path:
        write_json(args.json or default_json_path("bench_serving_hot_path"), {"args": vars(args), **hot_path(args)})
        return 0
    if args.quick:
        args.steps, args.warmup_steps, args.workers = 60, 20, "1,2"
    corpus = corpus_mod.ensure(args.corpus_dir)
    sizes = layer_sizes(parse_size(args.layer_bytes))
    half_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    args.dram_bytes = args.dram_bytes or str(min(parse_size(args.layer_bytes), half_memory))
    names = args.configs.split(",")
    if "dram" in names:
        ensure_dram_layers(layer_sizes(parse_size(args.dram_bytes)))
    if any(name.endswith("+warm") for name in names):
        args.profile = os.path.join(tempfile.mkdtemp(prefix="engram-serving-"), "profile.npz")
        write_profile(corpus, sizes, args.profile)
    if set(names) - {"dram"}:
        os.makedirs(args.dir, exist_ok=True)
        ensure_disk_layers(args.dir, sizes)
    rows = []
    for n in [int(x) for x in args.workers.split(",")]:
        for name in names:
            r = run(args, name, n)
            rows.append(r)
            print(f"  {n} x {name}: p50 {r['p50_us']:.0f} us", file=sys.stderr)
    table = []
    for r in rows:
        dram = next((x for x in rows if x["config"] == "dram" and x["workers"] == r["workers"]), None)
        table.append([r["workers"], r["config"], f"{r['hash_p50_us']:.0f}", f"{r['p50_us']:.0f}", f"{r['p99_us']:.0f}",
                      f"{r['rows_per_step']:,.0f}", f"{r['pages_per_step']:,.0f}",
                      "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}",
                      "-" if r["hit_rate_by_order"] is None else " / ".join(f"{x:.0%}" for x in r["hit_rate_by_order"]),
                      f"{r['host_memory_bytes'] / 2**30:.2f}",
                      "-" if dram is None else f"{r['p50_us'] / dram['p50_us']:.2f}"])
    print_table(["workers", "config", "hash p50 us", "step p50 us", "step p99 us", "rows/step", "pages/step",
                 "hit rate", "by order 2/3/4", "host GiB", "p50/dram"], table,
                title=f"serving replay: hash + rows of both layers per step ({args.layer_bytes} of layers on SSD, "
                      f"{args.dram_bytes} bytes in memory for dram, cache "
                      f"{args.cache_bytes} per worker (process) or in all (host), {args.steps} steps after "
                      f"{args.warmup_steps})")
    if args.profile:
        shutil.rmtree(os.path.dirname(args.profile), ignore_errors=True)
    shutil.rmtree(DRAM_DIR, ignore_errors=True)  # its memory back
    write_json(args.json or default_json_path("bench_serving"), {"args": vars(args), "sizes": sizes, "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
