"""``engram-load-v41``: stream the Engram tables of a DeepSeek-V4.1 checkpoint into a running store, or onto SSD.

    engram-load-v41 CHECKPOINT_DIR (--master HOST:PORT | --disk-dir PATH | --local-dir PATH) [--layers 1 14]
                    [--config PATH]
                    [--replica-num N] [--auth DIR] [--verify] [--progress | --no-progress] [--log-level INFO]

Reads ``config.json`` (or ``--config``) for the layout, then each layer's ``layers.{L}.engram.embed.weight`` and
``embed.scale`` from the safetensors shards (read, not mapped), packs them column by column into 264-byte rows and
populates them as head shards of the layer, so memory stays bounded by one column (about 4.2 GB for the
release). With ``--disk-dir`` the layer is written as page-aligned files on local SSD instead (tables larger than
memory), chunk by chunk, and published when whole; with ``--local-dir`` as files in memory (``/dev/shm`` or a
hugetlbfs mount) that every process of the host maps, and that outlive the servers reading them. A layer already there is refused; a load that fails leaves
nothing of the layer behind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Sequence

from engram_store import DistributedStore, MasterUnavailable, ObjectExists
from engram_store import cli
from engram_store.errors import EngramError
from engram_store.units import format_size

from ._checkpoint import SafetensorsCheckpoint, load_v41_table
from ._config import V41Config


PROG = "engram-load-v41"
DESCRIPTION = """\
Stream the Engram tables of a DeepSeek-V4.1 checkpoint into a running store, or onto local SSD.

Reads config.json (or --config) for the layout, then each layer's layers.{L}.engram.embed.weight
and embed.scale from the safetensors shards (read, not mapped), packs them column by column into
264-byte rows and populates them as head shards of the layer, so memory stays bounded by one
column (about 4.2 GB for the release). With --disk-dir the layer is written as page-aligned files
on local SSD instead (tables larger than memory), chunk by chunk, and published when whole; with
--local-dir as files in memory (/dev/shm or a hugetlbfs mount) that every process of the host maps
and that outlive the servers reading them (ENGRAM_TABLES=PATH serves them to vLLM and SGLang). A
layer already there is refused (remove it with engram-layers remove); a load that fails leaves
nothing of the layer behind."""


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(_main, argv)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(PROG, DESCRIPTION)
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                        help="directory of the safetensors shards (or one .safetensors file with --config)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--master", metavar="HOST:PORT",
                       help="address of the running engram-master (required, or --disk-dir)")
    where.add_argument("--disk-dir", metavar="PATH", help="directory on local SSD to write the layers under, read "
                       "with EngramStore(..., disk_dir=PATH) (required: this, --master or --local-dir)")
    where.add_argument("--local-dir", metavar="PATH", help="directory in memory (/dev/shm/..., a hugetlbfs mount) "
                       "to write the layers under as files every process of the host maps, read with "
                       "EngramStore(..., local_dir=PATH) (required: this, --master or --disk-dir)")
    parser.add_argument("--config", metavar="PATH", help="config.json to read (default: CHECKPOINT_DIR/config.json)")
    parser.add_argument("--layers", type=int, nargs="+", metavar="L",
                        help="Engram layers to load (default: every layer of engram_layer_ids)")
    parser.add_argument("--replica-num", type=int, default=1, metavar="N", help="replicas of every column")
    parser.add_argument("--auth", metavar="DIR", default=os.environ.get("ENGRAM_AUTH_DIR") or None,
                        help="key directory of a cluster started with --auth (default: $ENGRAM_AUTH_DIR if set, "
                             "else none)")
    parser.add_argument("--verify", action="store_true",
                        help="read every column back and check it against the checksum its writer gave the store")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bars on stderr (default: when stderr is a terminal)")
    cli.add_log_level(parser)
    args = parser.parse_args(argv)
    if args.replica_num < 1:
        parser.error(f"--replica-num: expected an integer >= 1, got {args.replica_num}")
    if args.verify and args.local_dir:
        parser.error("--verify: a --local-dir layer keeps no checksums to read back against (Mooncake's layout); "
                     "load with --disk-dir or --master to verify")
    return args


def _paths_exist(args: argparse.Namespace, config_path: str) -> bool:
    """Whether the checkpoint and its config.json are there (else said, in the command line's words)."""
    if not os.path.exists(config_path):
        flag = "--config" if args.config else "CHECKPOINT_DIR"
        print(f"{PROG}: {flag}: no such file or directory: {config_path}", file=sys.stderr)
        return False
    if args.config and not os.path.exists(args.checkpoint):
        print(f"{PROG}: CHECKPOINT_DIR: no such file or directory: {args.checkpoint}", file=sys.stderr)
        return False
    if not args.config and os.path.isdir(config_path) and not os.path.isfile(os.path.join(config_path,
                                                                                         "config.json")):
        print(f"{PROG}: CHECKPOINT_DIR: no config.json in {config_path} (pass --config PATH to read another)",
              file=sys.stderr)
        return False
    return True


def _main(argv: Sequence[str] | None) -> int:
    args = _parse(argv)
    cli.setup_logging(args.log_level)
    place = (f"--master {args.master}" if args.master else f"--disk-dir {args.disk_dir}" if args.disk_dir
             else f"--local-dir {args.local_dir}")
    config_path = args.config or args.checkpoint
    if not _paths_exist(args, config_path):
        return 2
    try:
        config = V41Config.from_hf_config(config_path)
        layers = args.layers or list(config.layer_ids)
        for layer_id in layers:
            config.layer_index(layer_id)
        if args.local_dir and not _room_in_memory(args.local_dir, config, layers):
            return 1
        try:
            checkpoint = SafetensorsCheckpoint(args.checkpoint)
        except EngramError as exc:  # the library names its parameter; the user gave CHECKPOINT_DIR
            print(f"{PROG}: CHECKPOINT_DIR: {str(exc).removeprefix('path: ')}", file=sys.stderr)
            return 2
        with _connect(args) if args.master else contextlib.nullcontext() as store:
            for layer_id in layers:
                start = time.perf_counter()
                try:
                    table = load_v41_table(checkpoint, config, layer_id, store, disk_dir=args.disk_dir,
                                           local_dir=args.local_dir, replica_num=args.replica_num,
                                           progress=args.progress)
                except ObjectExists as exc:
                    print(f"{PROG}: {exc}: engram-layers remove {place} {layer_id}", file=sys.stderr)
                    return 1
                nbytes = config.num_embeddings(layer_id) * config.row_bytes
                elapsed = time.perf_counter() - start
                print(f"layer {layer_id}: {config.cols} columns, {config.num_embeddings(layer_id)} rows, "
                      f"{format_size(nbytes)} in {elapsed:.1f} s ({format_size(int(nbytes / max(elapsed, 1e-9)))}/s)",
                      flush=True)
                if args.verify:
                    print(f"layer {layer_id}: checksums of columns {table.verify()} verified", flush=True)
                table.close()
    except _NoMaster as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except EngramError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    return 0


#: File systems whose files are memory: a local_dir elsewhere is read from the page cache, evicted at will.
MEMORY_FILE_SYSTEMS = ("tmpfs", "hugetlbfs", "ramfs")


def _room_in_memory(path: str, config: V41Config, layers: Sequence[int]) -> bool:
    """Whether ``--local-dir`` can hold the layers (else say so, before anything is written); warn where it is not
    a file system in memory."""
    where = os.path.abspath(path)
    existing = where
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    fs = _file_system(existing)
    if fs not in MEMORY_FILE_SYSTEMS:
        print(f"{PROG}: --local-dir {path} is on {fs or 'an unknown file system'}, not in memory (tmpfs such as "
              f"/dev/shm, or hugetlbfs): its rows are read from the page cache", file=sys.stderr)
    need = sum(config.num_embeddings(lid) * config.row_bytes for lid in layers)
    stat = os.statvfs(existing)
    free = stat.f_bavail * stat.f_frsize
    if need > free:
        print(f"{PROG}: --local-dir {path}: the layers need {format_size(need)}, {existing} ({fs}) has "
              f"{format_size(free)} free; grow it (a container's /dev/shm is 64 MiB unless run with --shm-size) or "
              "load them with --disk-dir", file=sys.stderr)
        return False
    return True


def _file_system(path: str) -> str:
    """The type of the file system ``path`` is on (the longest mount point of /proc/mounts above it), or ""."""
    best, kind = "", ""
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) >= len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


class _NoMaster(Exception):
    """No master answered at --master (said in the command line's words)."""


def _connect(args: argparse.Namespace) -> DistributedStore:
    try:
        with cli.announce_after(f"connecting to the master at {args.master} (up to 3 s)", PROG):
            return DistributedStore.connect(args.master, auth_dir=args.auth)
    except MasterUnavailable:
        hint = (f"check that the master runs with --auth and that --auth {args.auth} holds its keys" if args.auth
                else "if it runs with --auth, pass --auth DIR (or set ENGRAM_AUTH_DIR) with its key directory")
        raise _NoMaster(f"no engram master answered at --master {args.master} within 3 s; is engram-master running "
                        f"there? ({hint})") from None


if __name__ == "__main__":
    sys.exit(main())
