"""``engram-load``: stream a checkpoint's n-gram tables into a running store, onto local SSD, or into files in
memory; the model family is read from its ``config.json``.

    engram-load CHECKPOINT_DIR (--master HOST:PORT | --disk-dir PATH | --local-dir PATH) [--layers L ...]
                [--config PATH] [--replica-num N] [--auth DIR] [--verify] [--progress | --no-progress]

A ``config.json`` whose text fields (under ``text_config`` or at the top) have ``ple_layer_ids`` is a Qwen4-Exp
checkpoint (Qwen/Qwen3.8-Flash-Next): its PLE tables are loaded by :mod:`engram_model.ple.load`. One with
``engram_layer_ids`` is DeepSeek-V4.1's: its Engram tables are loaded as ``engram-load-v41`` loads them
(:mod:`engram_model.v41.load`).
"""

from __future__ import annotations

import sys
from typing import Mapping, Sequence

from engram_store import cli
from engram_store.errors import EngramError

from ._checkpoint_files import read_json
from .ple import load as ple_load
from .v41 import load as v41_load

PROG = "engram-load"
DESCRIPTION = """\
Stream the n-gram tables of a checkpoint into a running store, onto local SSD, or into files in
memory (--local-dir, e.g. under /dev/shm). The model family comes from config.json: ple_layer_ids
(Qwen4-Exp, Qwen/Qwen3.8-Flash-Next: its PLE tables, re-sliced from the checkpoint's row ranges into
16 prime-sized heads) or engram_layer_ids (DeepSeek-V4.1: its Engram tables, 264-byte FP8 rows, as
engram-load-v41 loads them). Memory stays bounded by one head (store) or one chunk (files); a layer
already there is refused; a load that fails leaves nothing of the layer behind."""


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: Sequence[str] | None) -> int:
    args = v41_load.parse(argv, PROG, DESCRIPTION, family="n-gram",
                          layer_ids="ple_layer_ids or engram_layer_ids", unit="head")
    cli.setup_logging(args.log_level)
    config_path = args.config or args.checkpoint
    if not v41_load.paths_exist(args, config_path, PROG):
        return 2
    try:
        raw = read_json(config_path, "--config" if args.config else "CHECKPOINT_DIR")
    except EngramError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    text = raw.get("text_config", raw)
    text = text if isinstance(text, Mapping) else raw
    if "ple_layer_ids" in text:
        return ple_load.run(args, PROG)
    if "engram_layer_ids" in text:
        return v41_load.run(args, PROG)
    print(f"{PROG}: {config_path}: neither ple_layer_ids (Qwen4-Exp) nor engram_layer_ids (DeepSeek-V4.1) in its "
          f"config.json (architectures {raw.get('architectures')!r}, model_type {raw.get('model_type')!r}): not a "
          "checkpoint with n-gram tables this command knows", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
