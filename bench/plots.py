"""Draw the curves of docs/benchmarks.md from the JSON results in bench/results/ (PNG files in docs/img/).

    python bench/plots.py [--results bench/results] [--out docs/img]

matplotlib is not a dependency of engram: install it to redraw (``pip install matplotlib``); without it this
script says so and draws nothing. Each plot reads one results file and skips itself when that file is absent.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load(results: Path, name: str) -> dict | None:
    path = results / name
    return json.loads(path.read_text()) if path.exists() else None


def lookup_latency(plt, results: Path, out: Path) -> str | None:
    """p50 of a lookup against the batch size B, every path of bench_engram_store.py's Mooncake scenario."""
    data = _load(results, "bench_engram_store.json")
    if data is None:
        return None
    rows = data["scenarios"]["mooncake"]["results"]
    paths = [("numpy", "NumPy gather (in process)"), ("local", "local-direct"), ("remote", "remote (one segment)"),
             ("floor", "ZeroMQ round trip (floor)"), ("tcp floor", "TCP round trip (floor)"),
             ("prefetch", "prefetch (result only)"), ("mooncake", "Mooncake's EngramStore")]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    batches = [r["B"] for r in rows]
    for key, label in paths:
        if all(key in r["paths"] for r in rows):
            ax.plot(batches, [r["paths"][key]["p50_us"] for r in rows], marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="batch B (L=1, 8 heads x D=16)", ylabel="p50 per lookup (us)",
           title="EngramStore.lookup against its floors")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "lookup_latency_vs_batch.png")


def cache_hit_rate(plt, results: Path, out: Path) -> str | None:
    """Hit rate and p50 of a V4.1 decode lookup on SSD against the hot-row cache's size (bench_disk.py tier)."""
    data = _load(results, "bench_disk.json")
    if data is None or not data.get("tier"):
        return None
    fig, (hits, latency) = plt.subplots(1, 2, figsize=(9, 3.8))
    for stream, label in (("zipf 1", "Zipf(1.0) ids"), ("uniform", "uniform ids")):
        points = sorted((r["cache"], r["hit_rate"], r["latency"]["p50_us"] / 1000) for r in data["tier"]
                        if r["stream"] == stream and r["lookup"] == "decode")
        if not points:
            continue
        sizes = [100 * c for c, _, _ in points]
        hits.plot(sizes, [100 * h for _, h, _ in points], marker="o", label=label)
        latency.plot(sizes, [ms for _, _, ms in points], marker="o", label=label)
    hits.set(xlabel="cache size (% of the 30 GB layer)", ylabel="rows served by the cache (%)", title="hit rate")
    latency.set(xlabel="cache size (% of the 30 GB layer)", ylabel="p50 per decode lookup (ms)",
                title="latency (64 requests x 48 rows)")
    for ax in (hits, latency):
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xticks([0, 1, 10, 50], ["0", "1", "10", "50"])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out / "ssd_cache_hit_rate.png")


def readers(plt, results: Path, out: Path) -> str | None:
    """Lookups/s summed over client processes against one segment (bench_store.py --sections readers)."""
    data = _load(results, "bench_store_readers.json")
    if data is None:
        return None
    rows = data["readers"]["clients"]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for key, label in (("readers_1", "1 reader socket"), ("readers_2", "2 reader sockets")):
        points = [(r["clients"], r[key]["lookup"]["per_s"]) for r in rows if key in r]
        if points:
            ax.plot([c for c, _ in points], [v for _, v in points], marker="o", label=label)
    ax.set(xlabel="client processes", ylabel="lookups/s, all clients (B=256, L=1)",
           title="many clients on one segment (2 cores in all)")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["clients"] for r in rows], [str(r["clients"]) for r in rows])
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "readers_throughput.png")


def table_size(plt, results: Path, out: Path) -> str | None:
    """p50 of a lookup against the rows per head (bench_scale.py): cost follows rows asked for, not table size."""
    data = _load(results, "bench_scale.json")
    if data is None:
        return None
    rows = data["lookup_vs_table_size"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for batch, length, shape in ((256, 1, "decode B=256, L=1"), (1, 4096, "prefill B=1, L=4096")):
        points = sorted((r["rows_per_head"], r["remote"]["p50_ms"], r["local"]["p50_ms"]) for r in rows
                        if r["batch"] == batch and r["length"] == length)
        ax.plot([n for n, _, _ in points], [ms for _, ms, _ in points], marker="o", label=f"{shape}, remote")
        ax.plot([n for n, _, _ in points], [ms for _, _, ms in points], marker="s", linestyle="--",
                label=f"{shape}, local-direct")
    ax.set(xscale="log", yscale="log", xlabel="rows per head (16 heads x D=64)", ylabel="p50 per lookup (ms)",
           title="lookup cost against table size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "lookup_vs_table_size.png")


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    # no timestamps in the file, so an unchanged plot is an unchanged file
    fig.savefig(path, dpi=110, metadata={"Software": None})
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="directory of the JSON results")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="directory to write the PNG files to")
    args = p.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        print("bench/plots.py: the plots need matplotlib, which engram does not depend on: pip install matplotlib",
              file=sys.stderr)
        return 1
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for plot in (lookup_latency, cache_hit_rate, readers, table_size):
        written = plot(plt, args.results, args.out)
        print(f"{plot.__name__}: {written or 'skipped (no results file)'}")
        plt.close("all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
