"""Qwen4-Exp PLE rows for the serving engines (``bench_engines.py``'s PLE part): ``PLERows.gather_into`` beside
the engines' own CPU gathers.

One PLE layer in the released layout (16 heads, rows of 160 values), ``--ple-rows-per-head`` rows per head
(default 250,000: 4M rows, 0.6 GiB FP8 and 1.2 GiB bf16; the release has 20M per head), random bytes, for each of
the two released row formats (FP8: 160 e4m3 bytes; bf16: 320 bytes). Per step, on the same ids (uniform over each
head, as hashes are) and the same bytes:

* a decode step (64 tokens x 16 heads) and a prefill chunk (4,096 x 16);
* the engines' CPU gathers, at one rank (the whole table): vLLM 0.33's (``VocabParallelEmbedding.forward`` at
  tp 1: ``quant_method.embedding``, ``F.embedding(ids, weight)`` of the storage dtype, into a fresh tensor: the raw
  rows) and SGLang 0.5.23's (``_embed_local_shard`` at tp 1: ``F.embedding(ids, weight).to(bfloat16)``: the bf16
  rows; for a bf16 table the same call), the weight in the engine's layout (``[rows, 160]``); where torch is not
  installed, NumPy's ``take`` into reused arrays (and a table lookup of the codes' bf16 bits);
* engram, from memory (the same bytes bound with ``bind_local``), into caller buffers: the raw form (vLLM's
  ``_lookup_ple_embedding_from_pinned_kernel``) and bf16 (SGLang's ``_gather_ple_embedding_from_pinned_kernel``),
  each beside the engine gather of its form, through ``gather_into`` and through a buffer bound once
  (``PLERows.bind``, an engine's decode path); the goal is at most 0.7x;
* engram from other tables: ``local_dir`` (files in /dev/shm), ``disk_dir`` behind a host-wide row cache (256
  MiB; every call reads ids of its own, so its hit rate, printed, is about the cache's share of the table), a
  remote segment (an ``engram-segment`` process, reads over TCP).

Times are medians (and the best call) of calls interleaved round by round, every call reading an id set of its own
(``_common.interleaved_times``): compare rows within one run. torch's gathers run on ``--ple-engine-threads``
intra-op threads (default ``--threads``), engram's large ones on ``--threads``.
"""
from __future__ import annotations

import argparse
import tempfile

import numpy as np
from _common import fmt, interleaved_times, print_table, start_cluster

from engram_model.ple import PLEConfig, PLERows, ple_store_config
from engram_model.ple._rows import E4M3_BF16
from engram_store import DistributedStore, EngramStore

LAYER = 2
HEADS = 16
STEPS = {"decode": 64, "prefill": 4096}
#: Distinct id sets per step, used in turn: more rows than the CPU's caches hold.
SETS = {"decode": 128, "prefill": 10}
HOST_CACHE_BYTES = 256 << 20
DTYPES = ("float8_e4m3fn", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ple-rows-per-head", type=int, default=None,
                        help="PLE: rows of each of the 16 heads (default 250,000; --quick 60,000)")
    parser.add_argument("--ple-dtypes", default=",".join(DTYPES), help="PLE: the table formats to run")
    parser.add_argument("--ple-engine-threads", type=int, default=None,
                        help="PLE: torch's intra-op threads for the engines' gathers (default: --threads)")


def run(args: argparse.Namespace, sections: list[str]) -> dict:
    """Every PLE section of ``sections`` for each table format; the results, for the JSON."""
    try:
        import torch
    except ImportError:
        return _run(args, sections)
    saved = torch.get_num_threads()
    torch.set_num_threads(args.ple_engine_threads or args.threads)
    try:
        return _run(args, sections)
    finally:
        torch.set_num_threads(saved)


def _run(args: argparse.Namespace, sections: list[str]) -> dict:
    per_head = args.ple_rows_per_head or (60_000 if args.quick else 250_000)
    rounds = {"decode": 15 if args.quick else 60, "prefill": 3 if args.quick else 25}
    results: dict = {"rows_per_head": per_head, "threads": args.threads,
                     "engine_threads": args.ple_engine_threads or args.threads, "tables": {}}
    for dtype in args.ple_dtypes.split(","):
        config = PLEConfig(ple_layer_ids=[LAYER], ngram_vocab_size_base=per_head, hidden_size=64, hc_count=4,
                           ple_embed_dim=2560, ple_embedding_dtype=dtype)
        table = _table(config)
        print(f"\nPLE table ({dtype}): {HEADS} heads, {table.shape[0]:,} rows of {config.row_bytes} B "
              f"({table.nbytes / 2**30:.2f} GiB); threads: engram {args.threads}")
        bounds = np.append(config.head_offsets(LAYER), sum(config.head_vocab_sizes(LAYER)))
        rng = np.random.default_rng(1)
        ids = {step: [np.stack([rng.integers(bounds[h], bounds[h + 1], T) for h in range(HEADS)], axis=1)
                      for _ in range(SETS[step])] for step, T in STEPS.items()}
        heads = [table[bounds[h]:bounds[h + 1]] for h in range(HEADS)]
        out = results["tables"][dtype] = {"table_bytes": int(table.nbytes), "steps": {}}
        if "memory" in sections:
            engines = _Engines(table, config)
            with EngramStore(LAYER, ple_store_config(config, LAYER), None) as es:
                es.bind_local(heads)
                rows = PLERows(es, config, LAYER, threads=args.threads)
                for step, T in STEPS.items():
                    cands = {**engines.candidates(ids[step]), **_engram("memory", rows, ids[step], config, T, True)}
                    out["steps"][step] = _report(f"{dtype}, {step}", T, cands, rounds[step], engines)
        for section in ("local_dir", "disk", "remote"):
            if section in sections:
                _other_table(section, config, heads, ids, rounds, args.threads, out)
    return results


def _table(config: PLEConfig) -> np.ndarray:
    """The layer's rows in the store's dtype: e4m3 codes never NaN, or bf16 bits of finite values."""
    rng = np.random.default_rng(0)
    total, fmt_ = sum(config.head_vocab_sizes(LAYER)), config.row_format
    if fmt_.codes == "e4m3":
        return rng.integers(0, 256, (total, fmt_.values), dtype=np.uint8) & 0xF7  # bit 3 clear: no NaN code
    return rng.integers(0, 1 << 15, (total, fmt_.values), dtype=np.uint16) & 0xBFFF  # exponent never all ones


class _Engines:
    """The engines' CPU gathers of the table (see the module docstring), each a candidate taking a set index."""

    def __init__(self, table: np.ndarray, config: PLEConfig):
        self.fp8 = config.row_format.codes == "e4m3"
        try:
            import torch
        except ImportError:
            self.torch, self.table, self._out = None, table, {}
            self.names = {"raw": "engine: NumPy take", "bf16": "engine: NumPy take + bf16 bits"}
            return
        self.torch = torch
        self.weight = torch.from_numpy(table.view(np.uint8 if self.fp8 else np.int16)).view(
            torch.float8_e4m3fn if self.fp8 else torch.bfloat16)
        self.names = {"raw": "vLLM: F.embedding", "bf16": "SGLang: F.embedding .to(bf16)"}

    def candidates(self, ids: list[np.ndarray]) -> dict:
        if self.torch is None:
            return {self.names["raw"]: lambda r: self._take(ids[r], False),
                    self.names["bf16"]: lambda r: self._take(ids[r], True)}
        F, bf16 = self.torch.nn.functional, self.torch.bfloat16
        t_ids = [self.torch.from_numpy(i) for i in ids]
        return {self.names["raw"]: lambda r: F.embedding(t_ids[r], self.weight),
                self.names["bf16"]: lambda r: F.embedding(t_ids[r], self.weight).to(bf16)}

    def _take(self, ids: np.ndarray, bf16: bool) -> np.ndarray:
        key = (ids.shape, bf16)
        if key not in self._out:
            self._out[key] = np.empty(ids.shape + (self.table.shape[1],), np.uint16 if bf16 else self.table.dtype)
        out = self._out[key]
        if bf16 and self.fp8:
            np.take(E4M3_BF16, np.take(self.table, ids, axis=0), out=out)
        else:
            np.take(self.table, ids, axis=0, out=out)
        return out


def _engram(where: str, rows: PLERows, ids: list[np.ndarray], config: PLEConfig, T: int, bound: bool = False) -> dict:
    """Both forms through gather_into, and with ``bound`` through a buffer bound once (``PLERows.bind``, as an
    engine's decode path would)."""
    raw = np.empty((T, HEADS, config.row_bytes), np.uint8)
    bf16 = np.empty((T, HEADS, config.head_dim), np.uint16)
    cands = {f"engram {where}: raw": lambda r: rows.gather_into(ids[r], raw),
             f"engram {where}: bf16": lambda r: rows.gather_into(ids[r], bf16)}
    if bound:
        bound_raw, bound_bf16 = rows.bind(np.empty_like(raw)), rows.bind(np.empty_like(bf16))
        cands.update({f"engram {where} (bound): raw": lambda r: bound_raw(ids[r]),
                      f"engram {where} (bound): bf16": lambda r: bound_bf16(ids[r])})
    return cands


def _report(title: str, T: int, cands: dict, rounds: int, engines: _Engines | None, extra: str = "") -> dict:
    """Time the candidates, print the table: p50 and the best call, each engram form's ratios to the engine gather
    of its form (p50 to p50, best to best: the best call is the one a loaded machine disturbed least)."""
    times = interleaved_times(cands, rounds, SETS[title.split(", ")[-1]])
    med = {name: (float(np.median(v)), float(v.min())) for name, v in times.items()}
    rows, out = [], {}
    for name, (p50, best) in med.items():
        form = "bf16" if name.endswith("bf16") else "raw" if name.endswith("raw") else None
        base = med.get(engines.names[form]) if engines and form else None
        ratio = (p50 / base[0], best / base[1]) if base else None
        rows.append([name, fmt(p50), fmt(best), fmt(p50 / (T * HEADS) * 1e3)]
                    + ([fmt(ratio[0], 2), fmt(ratio[1], 2)] if ratio else ["-", "-"]))
        out[name] = {"p50_us": p50, "best_us": best, "rounds": rounds,
                     **({"x_engine_p50": ratio[0], "x_engine_best": ratio[1]} if ratio else {})}
    print_table(["candidate", "p50 us", "best us", "ns/row (p50)", "x engine (p50)", "x engine (best)"], rows,
                title=f"PLE {title}: {T} tokens x {HEADS} heads ({T * HEADS:,} rows){extra}")
    return out


def _other_table(section: str, config: PLEConfig, heads: list, ids: dict, rounds: dict, threads: int,
                 out: dict) -> None:
    """engram from local_dir, disk_dir behind a host cache, or a remote segment: populate, then time each step."""
    layout = ple_store_config(config, LAYER)
    with tempfile.TemporaryDirectory(prefix="bench-ple-", dir="/dev/shm" if section == "local_dir" else None) as d:
        if section == "remote":
            nbytes = sum(h.nbytes for h in heads)
            with start_cluster(segments=1, segment_size=nbytes + (64 << 20)) as cluster, \
                    DistributedStore.connect(cluster.address, local_direct=False) as store:
                with EngramStore(LAYER, layout, store) as es:
                    es.populate(heads)
                    _time_table("remote segment", es, config, ids, rounds, threads, out)
                    es.remove_from_store(force=True)
            return
        kw = {"local_dir": d} if section == "local_dir" else {"disk_dir": d}
        with EngramStore(LAYER, layout, None, **kw) as es:
            es.populate(heads)
        options = {} if section == "local_dir" else {"row_cache_bytes": HOST_CACHE_BYTES, "cache_scope": "host"}
        with EngramStore(LAYER, layout, None, **kw, **options) as es:
            _time_table("local_dir" if section == "local_dir" else "disk_dir + host cache", es, config, ids, rounds,
                        threads, out, disk=section == "disk")


def _time_table(where: str, es: EngramStore, config: PLEConfig, ids: dict, rounds: dict, threads: int, out: dict,
                disk: bool = False) -> None:
    rows = PLERows(es, config, LAYER, threads=threads)
    for step, T in STEPS.items():
        if disk:
            es.stats(reset=True)
        result = _report(f"{where}, {step}", T, _engram(where, rows, ids[step], config, T), max(3, rounds[step] // 3),
                         None, f", {config.ple_embedding_dtype}")
        if disk:
            stats = es.stats(reset=True)
            hits, misses = stats.get("host_cache_hits", 0), stats.get("host_cache_misses", 0)
            result["host_cache_hit_rate"] = hits / max(1, hits + misses)
            print(f"host cache ({HOST_CACHE_BYTES >> 20} MiB) hit rate over these calls: "
                  f"{result['host_cache_hit_rate']:.1%}")
        out["steps"].setdefault(step, {}).update(result)
