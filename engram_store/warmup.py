"""Compile the store's Numba kernels ahead of time: ``python -m engram_store.warmup``.

Nothing needs this: every kernel compiles on its first use (a fraction of a second each) and is cached on
disk. It is for deployment images and CI, so that the first lookup of a fresh container pays nothing.
The cache lives next to the package's sources (``__pycache__``) or, where those are read-only, in Numba's
user cache directory; set ``NUMBA_CACHE_DIR`` to put it elsewhere (e.g. a directory baked into the image).
``engram-warmup`` (from ``engram_model``) warms the model's hashing kernels too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def cache_location() -> str:
    """Where Numba keeps this package's compiled kernels."""
    from .kernels import gather_rows_unchecked as _gather_rows

    return _gather_rows.stats.cache_path


def warm_store(verbose: bool = True) -> float:
    """Compile (or load) every store kernel for every word size; returns the seconds it took."""
    start = time.perf_counter()
    from . import disk, kernels

    kernels.warmup()
    disk.warmup()
    elapsed = time.perf_counter() - start
    if verbose:
        print(f"engram_store kernels ready in {elapsed:.1f} s (cache: {cache_location()})", flush=True)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engram_store.warmup", description=__doc__.split("\n\n")[0])
    p.parse_args(argv)
    if os.environ.get("NUMBA_DISABLE_JIT") == "1":
        print("NUMBA_DISABLE_JIT=1: nothing to compile", flush=True)
        return 0
    warm_store()
    return 0


if __name__ == "__main__":
    sys.exit(main())
