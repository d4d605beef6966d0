"""Compile every Numba kernel of engram ahead of time: ``engram-warmup`` (or ``python -m engram_model.warmup``).

The store's kernels (row gathers, range reads, planning), then each model family's through its package's public
door, ``warmup()``: the demo architecture's hashing (prefill and decode), DeepSeek-V4.1's (hash, its
continuous-batching step, FP8 row decoding fused with the gather for 12 and 24 columns, gate, checkpoint packing,
the engines' row gathers) and Qwen4-Exp's PLE hash and row gathers.
Nothing needs this: kernels compile on first use and are cached on disk (see :mod:`engram_store.warmup` for
where, and ``NUMBA_CACHE_DIR``). Run it when building a deployment image, so no request pays for compilation.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

from engram_store import cli


def _timed(what: str, warm: Callable[[], None], verbose: bool) -> float:
    start = time.perf_counter()
    warm()
    elapsed = time.perf_counter() - start
    if verbose:
        print(f"{what} kernels ready in {elapsed:.1f} s", flush=True)
    return elapsed


def warm_model(verbose: bool = True) -> float:
    """The demo architecture's hash, prefill and decode (:func:`engram_model.demo.warmup`); returns seconds."""
    from . import demo

    return _timed("engram_model.demo", demo.warmup, verbose)


def warm_v41(verbose: bool = True) -> float:
    """DeepSeek-V4.1's kernels (:func:`engram_model.v41.warmup`); returns seconds."""
    from . import v41

    return _timed("engram_model.v41", v41.warmup, verbose)


def warm_ple(verbose: bool = True) -> float:
    """Qwen4-Exp's PLE kernels (:func:`engram_model.ple.warmup`); returns seconds."""
    from . import ple

    return _timed("engram_model.ple", ple.warmup, verbose)


PROG = "engram-warmup"


def _groups() -> list[tuple[str, object]]:
    """The kernel groups, in the order they are compiled: (what they are, a call that compiles them)."""
    from engram_store import disk, kernels

    return [("store: row gathers, read planning, sorting, hot-row cache", kernels.warmup),
            ("store: SSD tier (page packing, reads, row cache)", disk.warmup),
            ("model: N-gram hashing, prefill and decode", lambda: warm_model(verbose=False)),
            ("DeepSeek-V4.1: hash, ragged steps, FP8 gather + decode, gate, checkpoint packing",
             lambda: warm_v41(verbose=False)),
            ("Qwen4-Exp PLE: hash, ragged steps, the engines' row gathers", lambda: warm_ple(verbose=False))]


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str] | None) -> int:
    p = cli.parser(PROG, "Compile every Numba kernel of engram ahead of time (the store's, the model's hashing,\n"
                          "DeepSeek-V4.1's and Qwen4-Exp's PLE hash), for deployment images: kernels otherwise\n"
                          "compile on first use. Compiled kernels are cached on disk, next to the installed\n"
                          "sources or in Numba's user cache where those are read-only; set NUMBA_CACHE_DIR to\n"
                          "choose. With a warm cache this takes seconds.")
    cli.add_log_level(p, "WARNING")
    cli.setup_logging(p.parse_args(argv).log_level)
    if os.environ.get("NUMBA_DISABLE_JIT") == "1":
        print(f"{PROG}: NUMBA_DISABLE_JIT=1: nothing to compile", flush=True)
        return 0
    from engram_store.warmup import cache_location

    groups = _groups()
    print(f"{PROG}: compiling {len(groups)} kernel groups into {cache_location()} (an empty cache takes 10-30 s; a "
          "warm one a few seconds)", flush=True)
    total = time.perf_counter()
    for i, (what, warm) in enumerate(groups, 1):
        print(f"  [{i}/{len(groups)}] {what} ...", end="", flush=True)
        start = time.perf_counter()
        warm()
        print(f" {time.perf_counter() - start:.1f} s", flush=True)
    print(f"{PROG}: every kernel ready in {time.perf_counter() - total:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
