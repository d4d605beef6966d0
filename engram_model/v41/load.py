"""``engram-load-v41``: stream the Engram tables of a DeepSeek-V4.1 checkpoint into a running store, or onto SSD.

    engram-load-v41 CHECKPOINT_DIR (--master HOST:PORT | --disk-dir PATH) [--layers 1 14] [--config PATH]
                    [--replica-num N] [--auth DIR] [--verify] [--progress | --no-progress] [--log-level INFO]

Reads ``config.json`` (or ``--config``) for the layout, then each layer's ``layers.{L}.engram.embed.weight`` and
``embed.scale`` from the safetensors shards (memory-mapped), packs them column by column into 264-byte rows and
populates them as head shards of the layer, so memory stays bounded by one column (about 4.2 GB for the
release). With ``--disk-dir`` the layer is written as page-aligned files on local SSD instead (tables larger than
memory), chunk by chunk, and published when whole. A layer already there is refused; a load that fails leaves
nothing of the layer behind.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from typing import Sequence

from engram_store import DistributedStore
from engram_store._errors import EngramError
from engram_store._units import format_size

from ._checkpoint import SafetensorsCheckpoint, load_v41_table
from ._config import V41Config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="engram-load-v41", description=__doc__.split("\n\n")[0].strip("`: "))
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                        help="directory of the safetensors shards (or one .safetensors file with --config)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--master", metavar="HOST:PORT", help="address of the running engram-master")
    where.add_argument("--disk-dir", metavar="PATH", help="directory on local SSD to write the layers under (read "
                       "them with EngramStore(..., disk_dir=PATH))")
    parser.add_argument("--config", metavar="PATH", help="config.json to read (default: CHECKPOINT_DIR/config.json)")
    parser.add_argument("--layers", type=int, nargs="+", metavar="L",
                        help="Engram layers to load (default: every layer of engram_layer_ids)")
    parser.add_argument("--replica-num", type=int, default=1, help="replicas of every column (default 1)")
    parser.add_argument("--auth", metavar="DIR", help="key directory of a cluster started with --auth")
    parser.add_argument("--verify", action="store_true",
                        help="read every column back and check it against the checksum its writer gave the store")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bars on stderr (default: when stderr is a terminal)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    args = parser.parse_args(argv)
    if args.replica_num < 1:
        parser.error("--replica-num must be >= 1")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = V41Config.from_hf_config(args.config or args.checkpoint)
        layers = args.layers or list(config.layer_ids)
        for layer_id in layers:
            config.layer_index(layer_id)
        checkpoint = SafetensorsCheckpoint(args.checkpoint)
        with (DistributedStore.connect(args.master, auth_dir=args.auth) if args.master
              else contextlib.nullcontext()) as store:
            for layer_id in layers:
                start = time.perf_counter()
                table = load_v41_table(checkpoint, config, layer_id, store, disk_dir=args.disk_dir,
                                       replica_num=args.replica_num, progress=args.progress)
                nbytes = config.num_embeddings(layer_id) * config.row_bytes
                elapsed = time.perf_counter() - start
                print(f"layer {layer_id}: {config.cols} columns, {config.num_embeddings(layer_id)} rows, "
                      f"{format_size(nbytes)} in {elapsed:.1f} s ({format_size(int(nbytes / max(elapsed, 1e-9)))}/s)",
                      flush=True)
                if args.verify:
                    print(f"layer {layer_id}: checksums of columns {table.verify()} verified", flush=True)
                table.close()
    except EngramError as exc:
        print(f"engram-load-v41: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
