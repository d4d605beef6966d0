"""Loading the PLE tables of a Qwen4-Exp checkpoint (Qwen/Qwen3.8-Flash-Next) into a running store, onto SSD or
into shared memory: what ``engram-load`` runs for a ``config.json`` with ``ple_layer_ids``.

    engram-load CHECKPOINT_DIR (--master HOST:PORT | --disk-dir PATH | --local-dir PATH) [--layers 2]
                [--config PATH] [--replica-num N] [--auth DIR] [--verify] [--progress | --no-progress]

Reads ``config.json`` (or ``--config``) for the layout, the checkpoint's hash buffers (which take precedence over
the config's; a disagreement is logged), then each layer's ``ngram_embedding.shard_{k}.weight`` row ranges, re-sliced
into the layer's 16 prime-sized heads (:func:`engram_model.ple.load_ple_table`). The pieces are the V4.1 loader's
(:mod:`engram_model.v41.load`): the same flags, refusals and messages.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from engram_store import cli

from .._safetensors import SafetensorsCheckpoint
from ..v41.load import parse, run_family
from ._checkpoint import load_ple_hash_buffers, load_ple_table
from ._config import PLEConfig

PROG = "engram-load"
DESCRIPTION = """\
Stream the PLE tables of a Qwen4-Exp checkpoint (Qwen/Qwen3.8-Flash-Next) into a running store,
onto local SSD, or into files in memory.

Reads config.json (or --config) for the layout and the checkpoint's hash buffers, then each PLE
layer's ple_embedding.ngram_embedding.shard_{k}.weight row ranges from the safetensors shards (read,
not mapped), re-sliced into the layer's 16 prime-sized heads, and populates them as head shards of
the layer, so memory stays bounded by one head (3.2 GB FP8, 6.4 GB bf16 for the release). With
--disk-dir the layer is written as page-aligned files on local SSD instead, with --local-dir as files
in memory, chunk by chunk, and published when whole. A layer already there is refused; a load that
fails leaves nothing of the layer behind."""


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    return cli.run(lambda args: _main(args, prog), argv)


def _main(argv: Sequence[str] | None, prog: str) -> int:
    args = parse(argv, prog, DESCRIPTION, family="PLE", layer_ids="ple_layer_ids", unit="head")
    cli.setup_logging(args.log_level)
    return run(args, prog)


def run(args: argparse.Namespace, prog: str = PROG) -> int:
    """Load the PLE tables the parsed command line names; the exit status."""
    def prepare(checkpoint: SafetensorsCheckpoint, config: PLEConfig, layers: list[int]) -> tuple[Any, Any]:
        buffers = load_ple_hash_buffers(checkpoint, config, layers)  # every layer checked before anything is written
        return (lambda layer_id, store: load_ple_table(
            checkpoint, config, layer_id, store, disk_dir=args.disk_dir, local_dir=args.local_dir,
            replica_num=args.replica_num, progress=args.progress, buffers=buffers[layer_id]),
            lambda layer_id: f"{config.heads} heads of {sum(buffers[layer_id].sizes)} rows of {config.row_format}")

    return run_family(args, prog, PLEConfig.from_hf, lambda config: config.ple_layer_ids,
                      lambda config, layer_id: config.ple_index(layer_id), prepare, "heads")


if __name__ == "__main__":
    sys.exit(main())
