"""The two sections ``bench_engines.py`` adds for the engine plugins: a decode step's critical path, and start-up.

**critical** (``ids on the host -> rows staged``, per tier): what the host does for layer 1 of a decode step of 64
requests x 24 columns, through the plugins' own objects: the gather of the packed rows into the (pinned, here plain)
staging buffer by ``LayerReader.bind`` (the host path of vLLM and SGLang), and where an engine hashes on the host,
``V41Hasher.step_ragged`` of the 64 tokens for both layers. Beside it the floor in the same run: NumPy's ``take`` of
the same rows from an in-memory copy of the table (the engine's own host table). Each is timed as wall time and as
the calling thread's CPU time ("host work"); and the two-layer step through ``StepGathers`` (layer 1 ready, then
layer 14 behind it on the worker thread). A ``disk_dir``'s host cache is timed fresh and in service (after it has
served other rows: its hit-rate curves then sample as a serving cache's do).

**startup** (a table of several GB; ``--startup-gb``): the time until the tables are ready to serve. vLLM's own
way: its loader fills its ``/dev/shm`` shared storage (``DPSharedEngramStorage``) from the checkpoint, each tensor
read with safetensors' ``get_tensor`` (as its weight iterator does) and copied in by its weight loader, the
checkpoint's pages dropped first (a restart). The plugin's way: open an existing ``local_dir`` (map the files) or
``disk_dir`` (and its host cache), as ``ENGRAM_TABLES`` does at start. Also the one-time ``engram-load-v41
--local-dir`` that made the local_dir. Everything it writes is removed at the end.
"""
from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import tempfile
import time

import numpy as np
from _common import fmt, print_table

from engram_engines import STATS, StepGathers, settings_from_env
from engram_engines._tables import forget_table_dirs
from engram_engines.v41 import LayerReader, open_layer
from engram_model.v41 import V41Config, V41Hasher, load_v41_table, v41_store_config
from engram_store import EngramStore

DECODE_REQUESTS = 64
#: Decode steps of other rows a host cache serves before the "in service" case is timed (393,216 rows).
PRIME_STEPS = 256
#: A vocabulary as large as DeepSeek's tokenizer's (the hash reads it through the token map).
VOCAB = 129_280


def _timed(fn, rounds: int) -> dict:
    wall, cpu = [], []
    for r in range(rounds):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        fn(r)
        cpu.append(time.thread_time_ns() - c0)
        wall.append(time.perf_counter_ns() - t0)
    w, c = np.array(wall) / 1e3, np.array(cpu) / 1e3
    return {"wall_p50_us": float(np.median(w)), "wall_p90_us": float(np.percentile(w, 90)),
            "cpu_p50_us": float(np.median(c)), "cpu_p90_us": float(np.percentile(c, 90)), "rounds": rounds}


def critical_path(config: V41Config, tables: list[np.ndarray], rounds: int, cache_bytes: int) -> dict:
    """The critical-path section (see the module docstring); ``tables``: layer 1's columns."""
    layer, T = config.layer_ids[0], DECODE_REQUESTS
    bounds = np.append(config.offsets(layer), config.num_embeddings(layer))
    rng = np.random.default_rng(11)
    sets = [np.stack([rng.integers(bounds[c], bounds[c + 1], T) for c in range(config.cols)], 1).astype(np.int32)
            for _ in range(256)]
    whole = np.concatenate(tables)  # the engine's own host table of the layer
    staged = np.empty((T, config.cols, config.row_bytes), np.uint8)
    flat = np.empty((T * config.cols, config.row_bytes), np.uint8)
    results = {"floor: NumPy take from the engine's own table": _timed(
        lambda r: np.take(whole, sets[r % 256].reshape(-1), axis=0, out=flat), rounds)}
    hasher = V41Hasher(config, np.arange(VOCAB) % config.compressed_vocab_size)
    state = hasher.begin(256)
    tokens = rng.integers(0, VOCAB, (256, T))
    slots, starts = np.arange(T), np.arange(T + 1)
    results["hash: 64 decode tokens, both layers (V41Hasher.step_ragged)"] = _timed(
        lambda r: hasher.step_ragged(state, tokens[r % 256], slots, starts), rounds)
    with tempfile.TemporaryDirectory(prefix="bench-critical-", dir="/dev/shm") as local, \
            tempfile.TemporaryDirectory(prefix="bench-critical-") as disk:
        for kw in ({"local_dir": local}, {"disk_dir": disk}):
            with EngramStore(layer, v41_store_config(config, layer), None, **kw) as es:
                es.populate(tables)
        # A warm host cache: the timed steps' rows (16 sets) are all in it (a larger working set meets the cache's
        # set conflicts, and one miss in a step costs an SSD read: the disk section measures that traffic). Timed
        # twice: as a fresh cache that has seen only those 24,576 rows, whose hit-rate curves (``disk._mrc``) then
        # sample one row in 4, and after the cache has also served PRIME_STEPS steps of other rows, as a cache in
        # service has, when the curves sample one in 64 (a curve tracks 8,192 rows at most).
        cases = (("local_dir", local, {}, 256, 0),
                 ("disk_dir + warm host cache, fresh", disk, {"ENGRAM_ROW_CACHE": str(cache_bytes)}, 16, 0),
                 ("disk_dir + warm host cache, in service", disk, {"ENGRAM_ROW_CACHE": str(cache_bytes)}, 16,
                  PRIME_STEPS))
        for tier, where, env, n_sets, prime in cases:
            settings = settings_from_env({"ENGRAM_TABLES": where, **env})
            table = open_layer(settings, _one_layer(config), layer, "bench")
            reader = LayerReader(settings, table, config, layer)
            gather = reader.bind(staged)
            for _ in range(prime):  # other rows first (SSD reads)
                gather(np.stack([rng.integers(bounds[c], bounds[c + 1], T) for c in range(config.cols)], 1)
                       .astype(np.int32))
            for _ in range(2):
                for ids in sets[:n_sets]:
                    gather(ids)
            table.stats(reset=True)
            results[f"engram {tier}: layer 1's rows staged (packed)"] = _timed(
                lambda r: gather(sets[r % n_sets]), rounds)
            if tier != "local_dir":
                stats = table.stats(reset=True)
                results[f"engram {tier}: layer 1's rows staged (packed)"]["hit_rate"] = \
                    stats.get("cache_hits", 0) / max(1, stats.get("cache_hits", 0) + stats.get("cache_misses", 0))
            results[f"engram {tier}: step of both layers, layer 1 ready"] = _two_layers(gather, sets[:n_sets], rounds)
            forget_table_dirs()  # closes the tables (and the host cache: the next case's starts empty)
    STATS.reset()
    _print_critical(results, T * config.cols)
    return results


def _one_layer(config: V41Config) -> V41Config:
    """The bench's tables hold one layer: a config naming that one (the plugins check every layer is there)."""
    from dataclasses import replace

    return replace(config, layer_ids=(config.layer_ids[0],))


def _two_layers(gather, sets, rounds: int) -> dict:
    """Layer 1's rows ready through the step pipeline, layer 14's gathered behind them on the worker (the
    second gather reads the first's rows again: the same work)."""
    steps = StepGathers("bench-steps")
    waits = []

    def step(r: int) -> None:
        n = len(sets)
        futures = steps.start([lambda: gather(sets[r % n]), lambda: gather(sets[(r + 1) % n])])
        futures[0].result(60)
        waits.append(futures[1])

    out = _timed(step, rounds)
    for future in waits:
        future.result(60)
    steps.close()
    return out


def _print_critical(results: dict, rows: int) -> None:
    base = results["floor: NumPy take from the engine's own table"]["cpu_p50_us"]
    table = [[name, fmt(r["cpu_p50_us"]), fmt(r["cpu_p90_us"]), fmt(r["wall_p50_us"]), fmt(r["wall_p90_us"]),
              fmt(r["cpu_p50_us"] / base, 2)] for name, r in results.items()]
    print_table(["decode critical path", "CPU p50 us", "CPU p90 us", "wall p50 us", "wall p90 us", "x floor"], table,
                title=f"ids on the host -> rows staged: 64 requests x 24 columns ({rows:,} rows), load "
                      f"{os.getloadavg()[0]:.1f}")


# ---- start-up ----------------------------------------------------------------------------------------------------


def startup(gigabytes: float, cache_bytes: int) -> dict:
    """The start-up section (see the module docstring): a checkpoint of two Engram layers of ``gigabytes`` in all."""
    per_column = int(gigabytes * 1e9 / 2 / 24 / 264)
    config = V41Config(layer_ids=[1, 14], engram_vocab_size=per_column, hidden_size=64, hc_mult=1)
    results: dict = {"table_bytes": sum(config.num_embeddings(lid) for lid in config.layer_ids) * config.row_bytes}
    root = tempfile.mkdtemp(prefix="bench-startup-")
    local = tempfile.mkdtemp(prefix="bench-startup-", dir="/dev/shm")
    try:
        checkpoint = _write_checkpoint(os.path.join(root, "checkpoint"), config)
        results["vLLM: its loader fills its /dev/shm shared storage from the checkpoint"] = \
            _vllm_shared_storage(checkpoint, config)
        results["engram-load-v41 --local-dir (once, from the checkpoint)"] = _timed_once(
            lambda: [load_v41_table(checkpoint, config, lid, local_dir=os.path.join(local, "t")).close()
                     for lid in config.layer_ids])
        results["engram-load-v41 --disk-dir (once, from the checkpoint)"] = _timed_once(
            lambda: [load_v41_table(checkpoint, config, lid, disk_dir=os.path.join(root, "disk")).close()
                     for lid in config.layer_ids])
        shutil.rmtree(checkpoint)
        results["plugin: ENGRAM_TABLES=local_dir, tables opened and mapped"] = _timed_once(
            lambda: _open_tables(os.path.join(local, "t"), config, {}))
        results["plugin: ENGRAM_TABLES=disk_dir, tables and host cache opened"] = _timed_once(
            lambda: _open_tables(os.path.join(root, "disk"), config, {"ENGRAM_ROW_CACHE": str(cache_bytes)}))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
        forget_table_dirs()
    rows = [[name, fmt(r["seconds"], 2)] for name, r in results.items() if isinstance(r, dict)]
    print_table(["start-up", "seconds"], rows, title=f"time until the Engram tables are ready: "
                f"{results['table_bytes'] / 2**30:.2f} GiB in two layers")
    return results


def _timed_once(fn) -> dict:
    start = time.perf_counter()
    fn()
    return {"seconds": time.perf_counter() - start}


def _open_tables(where: str, config: V41Config, env: dict) -> None:
    forget_table_dirs()
    settings = settings_from_env({"ENGRAM_TABLES": where, **env})
    for lid in config.layer_ids:
        reader = LayerReader(settings, open_layer(settings, config, lid, "bench"), config, lid)
        if reader.in_place:
            reader.column_addresses()


def _write_checkpoint(directory: str, config: V41Config) -> str:
    """A safetensors checkpoint holding the Engram tables of ``config`` (random codes and scales, written in
    chunks: the whole never sits in memory) and its config.json."""
    os.makedirs(directory)
    tensors, offset = {}, 0
    for lid in config.layer_ids:
        rows = config.num_embeddings(lid)
        for part, dtype, width in (("weight", "F8_E4M3", config.head_dim), ("scale", "F8_E8M0", config.head_dim // 32)):
            tensors[f"layers.{lid}.engram.embed.{part}"] = {"dtype": dtype, "shape": [rows, width],
                                                          "data_offsets": [offset, offset + rows * width]}
            offset += rows * width
    header = json.dumps(tensors).encode()
    header += b" " * (-len(header) % 8)
    rng = np.random.default_rng(0)
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for name, info in tensors.items():
            left = info["data_offsets"][1] - info["data_offsets"][0]
            while left:
                n = min(left, 64 << 20)
                chunk = rng.integers(0, 256, n, dtype=np.uint8)
                chunk = chunk & 0xF7 if name.endswith("weight") else (chunk % 20 + 115).astype(np.uint8)
                f.write(chunk.tobytes())
                left -= n
    text = {"engram_layer_ids": list(config.layer_ids), "engram_max_ngram_size": config.max_ngram_size,
            "engram_n_heads": config.n_heads, "engram_head_dim": config.head_dim,
            "engram_vocab_size": config.engram_vocab_size, "engram_compressed_vocab_size": config.compressed_vocab_size,
            "engram_pad_token_id": config.pad_id, "hidden_size": config.hidden_size, "hc_mult": config.hc_mult,
            "rms_norm_eps": config.rms_norm_eps,
            "engram_num_embeddings": [config.num_embeddings(lid) for lid in config.layer_ids]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"text_config": text}, f)
    return directory


def _drop_pages(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _vllm_shared_storage(checkpoint: str, config: V41Config) -> dict:
    """vLLM 0.33.0's DP-shared host tables filled by its loader: one /dev/shm file per layer (weight rows, then
    scale rows), each checkpoint tensor read by safetensors' get_tensor and copied in by vLLM's weight loader
    (``_engram_head_shard_weight_loader`` where vLLM is installed, else the same ``copy_``)."""
    import torch
    from safetensors import safe_open

    try:
        from vllm.models.deepseek_v41.common.engram import _engram_head_shard_weight_loader as load
    except Exception:  # vLLM missing (or its import failing without a GPU): the loader's own copy
        def load(param, loaded):
            loaded = loaded.view(torch.uint8) if loaded.dtype == torch.float8_e8m0fnu else loaded
            param.data.copy_(loaded.narrow(0, 0, param.shape[0]))
    shard = os.path.join(checkpoint, "model.safetensors")
    _drop_pages(shard)
    start = time.perf_counter()
    files = []
    try:
        with safe_open(shard, framework="pt") as f:
            for lid in config.layer_ids:
                rows, dim = config.num_embeddings(lid), config.head_dim
                tmp = tempfile.NamedTemporaryFile(prefix="vllm_engram_", dir="/dev/shm")
                files.append(tmp)
                tmp.truncate(rows * (dim + dim // 32))
                storage = torch.from_numpy(np.frombuffer(mmap.mmap(tmp.fileno(), rows * (dim + dim // 32)), np.uint8))
                weight = storage[:rows * dim].view(torch.float8_e4m3fn).view(rows, dim)
                scale = storage[rows * dim:].view(rows, dim // 32)
                for param, name in ((weight, "weight"), (scale, "scale")):
                    param.engram_vocab_start = 0
                    load(param, f.get_tensor(f"layers.{lid}.engram.embed.{name}"))
        seconds = time.perf_counter() - start
    finally:
        for tmp in files:
            tmp.close()
    return {"seconds": seconds}
