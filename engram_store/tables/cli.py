"""``engram-layers``: list, verify and remove the Engram layers of a store, a ``local_dir`` or a ``disk_dir``.

    engram-layers list   (--master HOST:PORT [--auth DIR] | --local-dir PATH | --disk-dir PATH) [--json]
    engram-layers verify [LAYER ...] (--master HOST:PORT [--auth DIR] | --local-dir PATH | --disk-dir PATH)
    engram-layers remove LAYER [LAYER ...] (--master ... | --local-dir PATH | --disk-dir PATH) [--yes] [--force]

What each place holds and what the states mean: :mod:`._inventory`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

import numpy as np

from .. import cli as _cli
from ..errors import EngramError, MasterUnavailable
from ..units import format_size
from ._inventory import DiskDirLayers, LayerInfo, LocalDirLayers, StoreLayers
from ._layout import ROW_FORMATS

PROG = "engram-layers"
DESCRIPTION = """\
List, verify and remove the Engram layers of one place: the store behind a running master
(--master), the layers published as files under a local_dir (--local-dir), or on local SSD under
a disk_dir (--disk-dir).

A layer is published (readers see it whole), partial (a populate running or interrupted),
under-replicated (some of its objects have fewer replicas than asked for) or lost (every replica
of one of its objects was on segments that died)."""
EPILOG = f"""\
Examples:
  {PROG} list --master 127.0.0.1:50051
  {PROG} verify --disk-dir /nvme/engram 1 14
  {PROG} remove --master 127.0.0.1:50051 --yes 1

Exit status: 0 done, 1 a layer failed (not found, a checksum differs, a lease is live), 2 bad usage."""


_layer_id = _cli.non_negative("a layer id")


def _place_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False, formatter_class=_cli.HelpFormatter)
    where = common.add_argument_group("where the layers are (one of)")
    place = where.add_mutually_exclusive_group(required=True)
    place.add_argument("--master", metavar="HOST:PORT",
                       help="the store behind this running engram-master (required: this, --local-dir or --disk-dir)")
    place.add_argument("--local-dir", metavar="PATH",
                       help="layers published as files under PATH, local_dir= (required: this, --master or --disk-dir)")
    place.add_argument("--disk-dir", metavar="PATH",
                       help="layers on local SSD under PATH, disk_dir= (required: this, --master or --local-dir)")
    where.add_argument("--auth", metavar="DIR", default=os.environ.get("ENGRAM_AUTH_DIR") or None,
                       help="with --master: key directory of a cluster started with --auth (default: "
                            "$ENGRAM_AUTH_DIR if set, else none)")
    _cli.add_log_level(common, "WARNING")
    return common


def _parser() -> argparse.ArgumentParser:
    p = _cli.parser(PROG, DESCRIPTION, epilog=EPILOG,
                    usage=f"{PROG} {{list,verify,remove}} (--master HOST:PORT | --local-dir PATH | --disk-dir PATH) "
                          "...")
    commands = p.add_subparsers(dest="command", metavar="{list,verify,remove}", required=True)
    common = _place_options()
    ls = commands.add_parser("list", parents=[common], formatter_class=_cli.HelpFormatter,
                             help="each layer's id, heads, rows, row format, bytes, replicas and state",
                             description="Print each layer's id, heads, rows, row format, bytes, replicas and state.")
    ls.add_argument("--json", action="store_true", help="print the layers as JSON, for scripts")
    verify = commands.add_parser("verify", parents=[common], formatter_class=_cli.HelpFormatter,
                                 help="read layers back and check them against their manifests",
                                 description="Read layers back and check each head against its manifest's checksum "
                                             "(local_dir layers, which carry none: their file sizes).")
    verify.add_argument("layers", metavar="LAYER", type=_layer_id, nargs="*",
                        help="layer ids (default: every published layer)")
    remove = commands.add_parser("remove", parents=[common], formatter_class=_cli.HelpFormatter,
                                 help="remove layers (asks first; --yes does not)",
                                 description="Remove layers: the manifest first, so readers never see half a layer, "
                                             "then every table. Asks first on a terminal; refuses without one unless "
                                             "--yes.")
    remove.add_argument("layers", metavar="LAYER", type=_layer_id, nargs="+", help="layer ids")
    remove.add_argument("--yes", "-y", action="store_true", help="remove without asking")
    remove.add_argument("--force", action="store_true",
                        help="remove even while a read lease is live or a write is in progress (a store's layers)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return _cli.run(_main, argv)


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    _cli.setup_logging(args.log_level)
    try:
        place, closing = _open(args)
    except EngramError as exc:
        print(f"{PROG} {args.command}: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, MasterUnavailable) else 2
    try:
        return {"list": _list, "verify": _verify, "remove": _remove}[args.command](args, place)
    except EngramError as exc:
        print(f"{PROG} {args.command}: {exc}", file=sys.stderr)
        return 1
    finally:
        for thing in closing:
            thing.close()


def _open(args: argparse.Namespace) -> tuple[Any, list]:
    if args.local_dir is not None or args.disk_dir is not None:
        place = LocalDirLayers(args.local_dir) if args.local_dir is not None else DiskDirLayers(args.disk_dir)
        return place, [place]
    from ..client import DistributedStore

    try:
        with _cli.announce_after(f"connecting to the master at {args.master} (up to 3 s)", PROG):
            store = DistributedStore.connect(args.master, auth_dir=args.auth)
    except MasterUnavailable:
        hint = (f"check that the master runs with --auth and that --auth {args.auth} holds its keys" if args.auth
                else "if it runs with --auth, pass --auth DIR (or set ENGRAM_AUTH_DIR) with its key directory")
        raise MasterUnavailable(f"no engram master answered at --master {args.master} within 3 s; is engram-master "
                                f"running there? ({hint})") from None
    place = StoreLayers(store, args.auth)
    return place, [place, store]


def _row_format(info: LayerInfo) -> str:
    if not info.row_bytes:
        return "?"
    if info.row_format == "bytes":
        return f"bytes ({info.row_bytes} B)"
    return f"{info.row_format} x {info.row_bytes // np.dtype(ROW_FORMATS[info.row_format]).itemsize}"


def _list(args: argparse.Namespace, place: Any) -> int:
    layers = place.list()
    if args.json:
        print(json.dumps({"where": place.where, "layers": [info.as_dict() for info in layers], "notes": place.notes},
                         indent=2))
        return 0
    print(f"{place.where}: {len(layers)} layer(s)")
    if layers:
        print(f"  {'layer':>5}  {'heads':>5}  {'rows':>13}  {'row format':<16}  {'bytes':>10}  {'replicas':>8}  state")
        for info in layers:
            rows = f"{info.rows:,}" if info.rows else "?"
            print(f"  {info.layer_id:>5}  {info.heads:>5}  {rows:>13}  {_row_format(info):<16}  "
                  f"{format_size(info.bytes):>10}  {info.replicas:>8}  {info.state}"
                  + (f": {info.detail}" if info.detail else ""))
    for note in place.notes:
        print(f"  note: {note}")
    return 0


def _verify(args: argparse.Namespace, place: Any) -> int:
    wanted = args.layers or [info.layer_id for info in place.list() if info.state != "partial"]
    if not wanted:
        print(f"{place.where}: no published layer to verify")
        return 0
    failed = 0
    for layer_id in wanted:
        try:
            with _cli.announce_after(f"layer {layer_id}: reading every head back ...", PROG):
                done = place.verify(layer_id)
            print(f"layer {layer_id}: {done}", flush=True)
        except EngramError as exc:
            print(f"{PROG} verify: layer {layer_id}: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def _remove(args: argparse.Namespace, place: Any) -> int:
    if not args.yes:
        if not sys.stdin.isatty():
            print(f"{PROG} remove: not removing layer(s) {', '.join(map(str, args.layers))} from the {place.where} "
                  "without asking, and standard input is not a terminal to ask on; pass --yes", file=sys.stderr)
            return 2
        answer = input(f"Remove layer(s) {', '.join(map(str, args.layers))} from the {place.where}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 1
    failed = 0
    for layer_id in args.layers:
        try:
            with _cli.announce_after(f"layer {layer_id}: still removing (waiting for a writer of the layer to finish, "
                                     "if one holds it) ...", PROG):
                done = place.remove(layer_id, args.force)
            print(f"layer {layer_id}: {done}", flush=True)
        except EngramError as exc:
            print(f"{PROG} remove: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
