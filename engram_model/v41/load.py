"""``engram-load-v41``: stream the Engram tables of a DeepSeek-V4.1 checkpoint into a running store, or onto SSD.

    engram-load-v41 CHECKPOINT_DIR (--master HOST:PORT | --disk-dir PATH | --local-dir PATH) [--layers 1 14]
                    [--config PATH]
                    [--replica-num N] [--auth DIR] [--verify] [--progress | --no-progress] [--log-level INFO]

Reads ``config.json`` (or ``--config``) for the layout, then each layer's ``layers.{L}.engram.embed.weight`` and
``embed.scale`` from the safetensors shards (read, not mapped), packs them column by column into 264-byte rows and
populates them as head shards of the layer, so memory stays bounded by one column (about 4.2 GB for the
release). With ``--disk-dir`` the layer is written as page-aligned files on local SSD instead (tables larger than
memory), chunk by chunk, and published when whole; with ``--local-dir`` as files in memory (such as under
``/dev/shm``, in 2 MiB pages) that every process of the host maps, and that outlive the servers reading them. A layer already there is refused; a load that fails leaves
nothing of the layer behind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any, Sequence

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
--local-dir as files in memory (a directory under /dev/shm; in 2 MiB pages) that every process of
the host maps and that outlive the servers reading them (ENGRAM_TABLES=PATH serves them to vLLM and SGLang). A
layer already there is refused (remove it with engram-layers remove); a load that fails leaves
nothing of the layer behind."""


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    return cli.run(lambda args: _main(args, prog), argv)


def parse(argv: Sequence[str] | None, prog: str, description: str, family: str = "Engram",
          layer_ids: str = "engram_layer_ids", unit: str = "column") -> argparse.Namespace:
    """The command line of a checkpoint loader (this one's, and ``engram-load``'s for every family)."""
    parser = cli.parser(prog, description)
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                        help="directory of the safetensors shards (or one .safetensors file with --config)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--master", metavar="HOST:PORT",
                       help="address of the running engram-master (required: this, --disk-dir or --local-dir)")
    where.add_argument("--disk-dir", metavar="PATH", help="directory on local SSD to write the layers under, read "
                       "with EngramStore(..., disk_dir=PATH) (required: this, --master or --local-dir)")
    where.add_argument("--local-dir", metavar="PATH", help="directory in memory (/dev/shm/..., or a tmpfs) "
                       "to write the layers under as files every process of the host maps, read with "
                       "EngramStore(..., local_dir=PATH) (required: this, --master or --disk-dir)")
    parser.add_argument("--config", metavar="PATH", help="config.json to read (default: CHECKPOINT_DIR/config.json)")
    parser.add_argument("--layers", type=int, nargs="+", metavar="L",
                        help=f"{family} layers to load (default: every layer of {layer_ids})")
    parser.add_argument("--replica-num", type=int, default=1, metavar="N", help=f"replicas of every {unit}")
    parser.add_argument("--auth", metavar="DIR", default=os.environ.get("ENGRAM_AUTH_DIR") or None,
                        help="key directory of a cluster started with --auth (default: $ENGRAM_AUTH_DIR if set, "
                             "else none)")
    parser.add_argument("--verify", action="store_true",
                        help=f"read every {unit} back and check it against the checksum its writer gave the store")
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


def paths_exist(args: argparse.Namespace, config_path: str, prog: str = PROG) -> bool:
    """Whether the checkpoint and its config.json are there (else said, in the command line's words)."""
    if not os.path.exists(config_path):
        flag = "--config" if args.config else "CHECKPOINT_DIR"
        print(f"{prog}: {flag}: no such file or directory: {config_path}", file=sys.stderr)
        return False
    if args.config and not os.path.exists(args.checkpoint):
        print(f"{prog}: CHECKPOINT_DIR: no such file or directory: {args.checkpoint}", file=sys.stderr)
        return False
    if not args.config and os.path.isdir(config_path) and not os.path.isfile(os.path.join(config_path,
                                                                                         "config.json")):
        print(f"{prog}: CHECKPOINT_DIR: no config.json in {config_path} (pass --config PATH to read another)",
              file=sys.stderr)
        return False
    return True


def _main(argv: Sequence[str] | None, prog: str = PROG) -> int:
    args = parse(argv, prog, DESCRIPTION)
    cli.setup_logging(args.log_level)
    return run(args, prog)


def run(args: argparse.Namespace, prog: str = PROG) -> int:
    """Load the V4.1 tables the parsed command line names (:func:`parse`); the exit status."""
    def prepare(checkpoint: SafetensorsCheckpoint, config: V41Config, layers: list[int]) -> tuple[Any, Any]:
        return (lambda layer_id, store: load_v41_table(
            checkpoint, config, layer_id, store, disk_dir=args.disk_dir, local_dir=args.local_dir,
            replica_num=args.replica_num, progress=args.progress),
            lambda layer_id: f"{config.cols} columns, {config.num_embeddings(layer_id)} rows")

    return run_family(args, prog, V41Config.from_hf_config, lambda config: config.layer_ids,
                      lambda config, layer_id: config.layer_index(layer_id), prepare, "columns")


def run_family(args: argparse.Namespace, prog: str, read_config: Any, layer_ids: Any, check_layer: Any,
               prepare: Any, units: str) -> int:
    """A loader's run over the parsed command line (:func:`parse`), for any model family: the config read by
    ``read_config(path)``, the layers asked for (``--layers``, each checked by ``check_layer(config, layer_id)``) or
    all of ``layer_ids(config)``, ``--local-dir``'s room checked (the config's ``num_embeddings(layer_id)`` rows of
    ``row_bytes``), the checkpoint opened, then ``prepare(checkpoint, config, layers)`` gives the
    ``(load(layer_id, store), what(layer_id))`` of :func:`load_layers`; the exit status."""
    config_path = args.config or args.checkpoint
    if not paths_exist(args, config_path, prog):
        return 2
    try:
        config = read_config(config_path)
        layers = args.layers or list(layer_ids(config))
        for layer_id in layers:
            check_layer(config, layer_id)
        if args.local_dir and not room_in_memory(args.local_dir, sum(config.num_embeddings(layer_id) * config.row_bytes
                                                                     for layer_id in layers), prog):
            return 1
        checkpoint = open_checkpoint(args, prog)
        if checkpoint is None:
            return 2
        load, what = prepare(checkpoint, config, layers)  # may read the checkpoint: every layer checked first
    except EngramError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    return load_layers(args, prog, layers, load, what, units)


def open_checkpoint(args: argparse.Namespace, prog: str) -> SafetensorsCheckpoint | None:
    """The checkpoint at CHECKPOINT_DIR, or None once a bad one is said in the command line's words."""
    try:
        return SafetensorsCheckpoint(args.checkpoint)
    except EngramError as exc:  # the library names its parameter; the user gave CHECKPOINT_DIR
        print(f"{prog}: CHECKPOINT_DIR: {str(exc).removeprefix('path: ')}", file=sys.stderr)
        return None


def load_layers(args: argparse.Namespace, prog: str, layers: Sequence[int], load: Any, what: Any,
                units: str) -> int:
    """Load each layer with ``load(layer_id, store)`` (None: the place is --disk-dir or --local-dir), print what
    each took (``what(layer_id)`` describes it) and, with --verify, check it; the exit status."""
    place = (f"--master {args.master}" if args.master else f"--disk-dir {args.disk_dir}" if args.disk_dir
             else f"--local-dir {args.local_dir}")
    try:
        with _connect(args) if args.master else contextlib.nullcontext() as store:
            for layer_id in layers:
                start = time.perf_counter()
                try:
                    table = load(layer_id, store)
                except ObjectExists as exc:
                    print(f"{prog}: {exc}: engram-layers remove {place} {layer_id}", file=sys.stderr)
                    return 1
                nbytes = sum(table.get_table_vocab_sizes()) * table.get_row_bytes()
                elapsed = time.perf_counter() - start
                print(f"layer {layer_id}: {what(layer_id)}, {format_size(nbytes)} in {elapsed:.1f} s "
                      f"({format_size(int(nbytes / max(elapsed, 1e-9)))}/s)", flush=True)
                if args.verify:
                    print(f"layer {layer_id}: checksums of {units} {table.verify()} verified", flush=True)
                table.close()
    except (_NoMaster, EngramError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    return 0


#: File systems whose files are memory: a local_dir elsewhere is read from the page cache, evicted at will.
MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")


def room_in_memory(path: str, need: int, prog: str = PROG) -> bool:
    """Whether ``--local-dir`` can hold ``need`` bytes of layers (else say so, before anything is written); warn
    where it is not a file system in memory."""
    where = os.path.abspath(path)
    existing = where
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    fs = _file_system(existing)
    if fs not in MEMORY_FILE_SYSTEMS:
        print(f"{prog}: --local-dir {path} is on {fs or 'an unknown file system'}, not in memory (tmpfs such as "
              f"/dev/shm): its rows are read from the page cache", file=sys.stderr)
    stat = os.statvfs(existing)
    free = stat.f_bavail * stat.f_frsize
    if need > free:
        print(f"{prog}: --local-dir {path}: the layers need {format_size(need)}, {existing} ({fs}) has "
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
