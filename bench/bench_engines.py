"""V4.1 rows for the serving engines: ``V41Rows.gather_into`` beside the engines' own CPU gather; and Qwen4-Exp's PLE
rows (``PLERows``), in ``_engines_ple.py``.

    python bench/bench_engines.py [--quick] [--families v41,ple] [--rows-per-column N] [--threads N] [--json PATH]
                                  [--sections memory,local_dir,disk,remote,critical,startup] [--startup-gb G]
                                  [--ple-rows-per-head N] [--ple-dtypes float8_e4m3fn,bfloat16]
                                  [--ple-engine-threads N]

One layer in the released row format (24 columns of 264-byte rows: 256 e4m3 codes, 8 e8m0 scale bytes), with
``--rows-per-column`` rows per column (default 250,000: 6M rows, 1.6 GB; the release has 16M per column), random
bytes. Per layer and step, on the same ids (uniform over each column, as hashes are) and the same bytes:

* a decode step (64 tokens x 24 columns) and a prefill chunk (4,096 x 24);
* the engine's CPU gather: SGLang 0.5.23's ``EngramRowStager._gather`` (``torch.index_select`` of the weight and
  the scale tables, each in 16 threads, into fresh tensors), or where torch is not installed NumPy's ``take``
  into reused arrays; the tables in the engine's own layout (weight ``[rows, 256]`` and scale ``[rows, 8]``);
* engram, from memory (the same bytes bound with ``bind_local``), into caller buffers: the split form (codes and
  scales, as SGLang stages them), the packed form (vLLM's uint8 lookup) and bf16 (vLLM's bf16 lookup, decoded in
  the gather kernel); ratios are to the engine's gather;
* engram from other tables: ``local_dir`` (files in /dev/shm), ``disk_dir`` behind a host-wide row cache (256 MiB;
  every call reads ids of its own, so the hit rate, printed, is about the cache's share of the table: the SSD's
  random-read rate sets the time), a remote segment (``engram-segment`` process, reads over TCP).

Two sections measure the engine plugins (``engram_engines``; ``_engines_paths.py`` says how): ``critical``, a decode
step's host work from ids on the host to layer 1's rows staged, per tier, beside the floor (NumPy's take from the
engine's own table) in the same run, as wall and CPU time; ``startup``, the time until the tables are ready for a
table of ``--startup-gb`` GB (vLLM's loader filling its /dev/shm storage from the checkpoint, against the plugin
opening an existing local_dir and disk_dir).

Times are medians of calls interleaved round by round (each candidate once per round), in one process, on a
shared machine: compare rows within one run. Every call reads an id set of its own (the sets in turn), so none
finds rows in the CPU's caches that the call before brought in: the engine's gather and engram's read cold rows
alike, as a serving step does.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from _common import default_json_path, fmt, interleaved_times, print_table, start_cluster, write_json
from _engines_paths import critical_path, startup

import _engines_ple
from engram_model.v41 import V41Config, V41Rows, v41_store_config
from engram_store import DistributedStore, EngramStore

STEPS = {"decode": 64, "prefill": 4096}
SGLANG_THREADS = 16  # sglang.srt.layers.engram_staging._GATHER_THREADS
HOST_CACHE_BYTES = 256 << 20
#: Distinct id sets per step, used in turn (the same set by every candidate of a round): more rows than the CPU's
#: caches hold, as a serving engine's steps read.
SETS = {"decode": 128, "prefill": 10}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and a smaller table")
    parser.add_argument("--rows-per-column", type=int, default=None, help="rows of each of the 24 columns")
    parser.add_argument("--sections", default="memory,local_dir,disk,remote,critical,startup")
    parser.add_argument("--startup-gb", type=float, default=None, help="table size of the start-up section "
                        "(default 4, --quick 1)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="V41Rows threads for large gathers")
    parser.add_argument("--json", default=None, help="default: bench/results/bench_engines.json, or "
                        "bench_engines_ple.json for the PLE part alone")
    parser.add_argument("--families", default="v41,ple", help="the model families' rows to run: v41, ple or both")
    _engines_ple.add_arguments(parser)
    args = parser.parse_args()
    if "v41" not in args.families.split(","):  # the PLE part alone
        write_json(args.json or default_json_path("bench_engines_ple"), {"ple": _engines_ple.run(args, args.sections.split(","))})
        return 0
    per_column = args.rows_per_column or (60_000 if args.quick else 250_000)
    rounds = {"decode": 15 if args.quick else 60, "prefill": 3 if args.quick else 9}
    sections = args.sections.split(",")

    config = V41Config(layer_ids=[1, 14], engram_vocab_size=per_column, hidden_size=64, hc_mult=1)
    layer = config.layer_ids[0]
    packed, tables = _tables(config, layer)
    print(f"table: {config.cols} columns, {packed.shape[0]:,} rows of {config.row_bytes} B "
          f"({packed.nbytes / 2**30:.2f} GiB); threads: engram {args.threads}, engine {SGLANG_THREADS}")
    rng = np.random.default_rng(1)
    bounds = np.append(config.offsets(layer), config.num_embeddings(layer))
    ids = {step: [np.stack([rng.integers(bounds[c], bounds[c + 1], T) for c in range(config.cols)], axis=1)
                  for _ in range(SETS[step])] for step, T in STEPS.items()}

    results: dict = {"rows_per_column": per_column, "table_bytes": int(packed.nbytes), "steps": {}}
    engine = _engine_gather(packed, config)
    for step, T in STEPS.items():
        bufs = _buffers(config, T)
        cands = {f"engine ({engine.name})": lambda r, s=step: engine(ids[s][r].reshape(-1))}
        if "memory" in sections:
            with EngramStore(layer, v41_store_config(config, layer), None) as es:
                es.bind_local(tables)
                rows = V41Rows(es, config, layer, threads=args.threads)
                cands.update(_engram_candidates("memory", rows, ids[step], bufs))
                results["steps"][step] = _run(step, T, cands, rounds[step], f"engine ({engine.name})")
    for section in ("local_dir", "disk", "remote"):
        if section in sections:
            _other_table(section, config, layer, tables, ids, rounds, args.threads, results)
    if "critical" in sections:
        results["critical"] = critical_path(config, tables, 300 if args.quick else 2000, HOST_CACHE_BYTES)
    del packed, tables, engine
    if "startup" in sections:
        results["startup"] = startup(args.startup_gb or (1.0 if args.quick else 4.0), HOST_CACHE_BYTES)
    if "ple" in args.families.split(","):  # memory, local_dir, disk and remote of the PLE tables
        results["ple"] = _engines_ple.run(args, sections)
    write_json(args.json or default_json_path("bench_engines"), results)
    return 0


def _tables(config: V41Config, layer: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The layer's rows (random codes, never NaN; scale bytes 110..139) and each column's view of them."""
    rng = np.random.default_rng(0)
    total = config.num_embeddings(layer)
    packed = rng.integers(0, 256, (total, config.row_bytes), dtype=np.uint8)
    packed[:, :config.head_dim] &= 0xF7  # clearing bit 3 keeps e4m3 codes finite
    packed[:, config.head_dim:] = rng.integers(110, 140, (total, config.row_bytes - config.head_dim), dtype=np.uint8)
    bounds = np.append(config.offsets(layer), total)
    return packed, [packed[bounds[c]:bounds[c + 1]] for c in range(config.cols)]


class _Engine:
    """The engine's own CPU gather of one layer's rows for flat ids, from its own table layout."""

    def __init__(self, packed: np.ndarray, head_dim: int):
        self.weight = np.ascontiguousarray(packed[:, :head_dim])
        self.scale = np.ascontiguousarray(packed[:, head_dim:])
        try:
            import torch
        except ImportError:
            self.torch = None
            self.name = "NumPy take"
            self._out: dict = {}
        else:
            self.torch = torch
            self.name = f"SGLang _gather, {SGLANG_THREADS} threads"
            self.pool = ThreadPoolExecutor(SGLANG_THREADS)
            self.tables = (torch.from_numpy(self.weight), torch.from_numpy(self.scale))

    def __call__(self, ids: np.ndarray):
        if self.torch is None:
            n = ids.size
            if n not in self._out:
                self._out[n] = (np.empty((n, self.weight.shape[1]), np.uint8),
                                np.empty((n, self.scale.shape[1]), np.uint8))
            w, s = self._out[n]
            np.take(self.weight, ids, axis=0, out=w)
            np.take(self.scale, ids, axis=0, out=s)
            return w, s
        t_ids = self.torch.from_numpy(ids)
        return self._gather(self.tables[0], t_ids), self._gather(self.tables[1], t_ids)

    def _gather(self, table, ids):
        # As sglang.srt.layers.engram_staging.EngramRowStager._gather (pin_memory needs a GPU: plain CPU tensors).
        out = self.torch.empty((ids.numel(), table.shape[1]), dtype=table.dtype)
        step = -(-ids.numel() // SGLANG_THREADS)
        chunks = [self.pool.submit(self.torch.index_select, table, 0, ids[i:i + step], out=out[i:i + step])
                  for i in range(0, ids.numel(), step)]
        for chunk in chunks:
            chunk.result()
        return out


def _engine_gather(packed: np.ndarray, config: V41Config) -> _Engine:
    return _Engine(packed, config.head_dim)


def _buffers(config: V41Config, T: int) -> dict:
    N = T * config.cols
    return {"codes": np.empty((N, config.head_dim), np.uint8),
            "scales": np.empty((N, config.head_dim // 32), np.uint8),
            "packed": np.empty((T, config.cols, config.row_bytes), np.uint8),
            "bf16": np.empty((T, config.cols, config.head_dim), np.uint16)}


def _engram_candidates(where: str, rows: V41Rows, ids: list, bufs: dict) -> dict:
    """The three forms; each candidate takes the round's index and reads that round's id set."""
    return {f"engram {where}: split": lambda r: rows.gather_into(ids[r].reshape(-1), bufs["codes"],
                                                                 scales_out=bufs["scales"]),
            f"engram {where}: packed": lambda r: rows.gather_into(ids[r], bufs["packed"]),
            f"engram {where}: bf16": lambda r: rows.gather_into(ids[r], bufs["bf16"])}


def _run(step: str, T: int, cands: dict, rounds: int, baseline: str | None, extra: dict | None = None) -> dict:
    """Median microseconds of each candidate, calls interleaved round by round; print the table. Every call reads
    an id set of its own, the sets in turn: no candidate finds rows that the one before it brought into the CPU's
    caches (a serving step reads rows the step before did not), and over the rounds each reads them all."""
    times = interleaved_times(cands, rounds, SETS[step.split(", ")[-1]])
    med = {name: float(np.median(v)) for name, v in times.items()}
    base = med.get(baseline) if baseline else None
    rows = []
    for name, us in med.items():
        note = (extra or {}).get(name, "")
        rows.append([name, fmt(us), fmt(us / (T * 24) * 1e3), fmt(us / base, 2) if base else "-", note])
    print_table(["candidate", "p50 us", "ns/row", "x engine", "note"], rows,
                title=f"{step}: {T} tokens x 24 columns ({T * 24:,} rows)")
    return {name: {"p50_us": us, "rounds": rounds, **({"note": (extra or {})[name]} if name in (extra or {}) else {})}
            for name, us in med.items()}


def _other_table(section: str, config: V41Config, layer: int, tables: list, ids: dict, rounds: dict,
                 threads: int, results: dict) -> None:
    """engram from local_dir, disk_dir behind a host cache, or a remote segment: populate, then time each step."""
    layout = v41_store_config(config, layer)
    with tempfile.TemporaryDirectory(prefix="bench-engines-", dir="/dev/shm" if section == "local_dir" else None) as d:
        if section == "remote":
            nbytes = sum(t.nbytes for t in tables)
            with start_cluster(segments=1, segment_size=nbytes + (64 << 20)) as cluster, \
                    DistributedStore.connect(cluster.address, local_direct=False) as store:
                with EngramStore(layer, layout, store) as es:
                    es.populate(tables)
                    _time_table("remote segment", es, config, layer, ids, rounds, threads, results)
                    es.remove_from_store(force=True)
            return
        kw = {"local_dir": d} if section == "local_dir" else {"disk_dir": d}
        with EngramStore(layer, layout, None, **kw) as es:
            es.populate(tables)
        if section == "local_dir":
            with EngramStore(layer, layout, None, local_dir=d) as es:
                _time_table("local_dir", es, config, layer, ids, rounds, threads, results)
            return
        with EngramStore(layer, layout, None, disk_dir=d, row_cache_bytes=HOST_CACHE_BYTES, cache_scope="host") as es:
            _time_table("disk_dir + host cache", es, config, layer, ids, rounds, threads, results, disk=True)


def _time_table(where: str, es: EngramStore, config: V41Config, layer: int, ids: dict, rounds: dict, threads: int,
                results: dict, disk: bool = False) -> None:
    rows = V41Rows(es, config, layer, threads=threads)
    for step, T in STEPS.items():
        bufs = _buffers(config, T)
        cands = _engram_candidates(where, rows, ids[step], bufs)
        if disk:  # every call reads ids of its own: the host cache's hit rate is that of uniform traffic
            es.stats(reset=True)
        out = _run(f"{where}, {step}", T, cands, max(3, rounds[step] // 3), None)
        if disk:
            out["host_cache_hit_rate"] = _hit_rate(es.stats(reset=True))
            print(f"host cache ({HOST_CACHE_BYTES >> 20} MiB) hit rate over these calls: "
                  f"{out['host_cache_hit_rate']:.1%}")
        results["steps"].setdefault(step, {}).update(out)


def _hit_rate(stats: dict) -> float:
    hits, misses = stats.get("host_cache_hits", 0), stats.get("host_cache_misses", 0)
    return hits / max(1, hits + misses)


if __name__ == "__main__":
    sys.exit(main())
