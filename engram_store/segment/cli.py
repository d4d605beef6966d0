"""``engram-segment``: run one segment server that registers with a master.

    engram-segment [--master 127.0.0.1:50051] [--size 1GiB] [--host 127.0.0.1] [--port 0] [--readers 2]
                   [--file PATH] [--auth DIR] [--no-raw-reads] [--raw-max-connections N] [--log-level INFO]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

import zmq

from .. import cli as _cli
from ..errors import EngramError, MasterUnavailable
from ..units import parse_address, parse_size
from ..wire import (AUTH_DIR_ENV, exposure_warning, load_keys, resolve_auth_dir, serve_until_signalled,
                    stop_on_signal_while_starting)
from ..raw.limits import MAX_CONNECTIONS as RAW_MAX_CONNECTIONS
from ._server import DEFAULT_READERS, MAX_READERS, READERS_MIN_CPUS, SegmentServer, default_readers


PROG = "engram-segment"


def main(argv: Sequence[str] | None = None) -> int:
    return _cli.run(_main, argv)


def _parser() -> argparse.ArgumentParser:
    p = _cli.parser(PROG, "Serve one engram memory segment: register it with a master, keep its objects in shared\n"
                          "memory (or in --file), and serve reads and writes of them.")
    p.add_argument("--master", default="127.0.0.1:50051", metavar="HOST:PORT", help="the master's address")
    p.add_argument("--size", default="1GiB", help="segment size, e.g. 512MiB, 4GiB")
    p.add_argument("--host", default="127.0.0.1", help="address to bind and advertise")
    p.add_argument("--port", type=int, default=0, help="port to bind (default: any free port)")
    p.add_argument("--file", metavar="PATH",
                   help="keep the segment in PATH (memory-mapped) with a manifest in PATH.manifest, so a restart on "
                        "the same file brings its objects back (default: shared memory, gone at exit)")
    p.add_argument("--readers", type=int, default=None, metavar="N",
                   help=f"reader threads, each serving reads on a socket of its own (ports PORT+1.. with --port, "
                        f"else any free ports), registered with the master for clients to spread reads over; "
                        f"0 serves reads on the main socket only (default: {DEFAULT_READERS}, or 1 on hosts with "
                        f"fewer than {READERS_MIN_CPUS} CPUs; here {default_readers()}; at most {MAX_READERS})")
    p.add_argument("--register-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long to keep trying to reach the master at start (default: 30)")
    p.add_argument("--auth", metavar="DIR", default=resolve_auth_dir(None),
                   help=f"require CURVE authentication with the keys in DIR (from 'engram-master keygen DIR'); "
                        f"default: ${AUTH_DIR_ENV} if set")
    p.add_argument("--no-raw-reads", action="store_true",
                   help="serve range reads over ZeroMQ only, not also on a plain TCP port (the raw read channel is "
                        "authenticated with --auth but not encrypted)")
    p.add_argument("--raw-max-connections", type=int, default=None, metavar="N",
                   help=f"connections the raw read channel holds at once; past them a new one is answered busy and "
                        f"its client reads over ZeroMQ (default: {RAW_MAX_CONNECTIONS}, or half of what the open-files "
                        f"limit leaves for connections; engram-segment raises its soft limit toward the hard one)")
    _cli.add_log_level(p)
    return p


def _main(argv: Sequence[str] | None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    _cli.setup_logging(args.log_level)
    if args.raw_max_connections is not None and args.raw_max_connections < 1:
        p.error(f"--raw-max-connections: expected an integer >= 1, got {args.raw_max_connections}")
    _cli.raise_open_files_limit()  # each connection holds a descriptor
    warning = exposure_warning(args.host, args.auth)
    if warning:
        print(f"{PROG}: {warning}", file=sys.stderr, flush=True)
    if args.readers is None:
        args.readers = default_readers()
    if args.readers > 0:
        # Before any socket exists: one I/O thread for the main socket, one for the readers (SegmentServer).
        zmq.Context.instance(io_threads=2)
    if args.file is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.file))):
        print(f"{PROG}: --file {args.file}: no directory {os.path.dirname(os.path.abspath(args.file))} to keep the "
              "segment in (create it first)", file=sys.stderr)
        return 2
    try:
        size = parse_size(args.size, "--size")
        host, port = parse_address(args.master, "--master")
        auth = load_keys(args.auth, server=True) if args.auth else None
        with _cli.announce_after(f"waiting for the master at {host}:{port} to answer (up to "
                                 f"{args.register_timeout:g} s, --register-timeout)", PROG), \
                stop_on_signal_while_starting():
            server = SegmentServer(size, f"{host}:{port}", host=args.host, port=args.port,
                                   register_timeout_s=args.register_timeout, file=args.file, auth=auth,
                                   readers=args.readers, raw_reads=not args.no_raw_reads,
                                   raw_max_connections=args.raw_max_connections)
    except OSError as exc:  # the segment's --file or its catalogue beside it
        print(f"{PROG}: {exc.filename or args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except EngramError as exc:
        hint = ("; if the master runs with --auth, pass --auth DIR with its key directory"
                if isinstance(exc, MasterUnavailable) and not args.auth else "")
        print(f"{PROG}: {exc}{hint}", file=sys.stderr)
        return 2
    readers = ",".join(server.read_addresses) or "-"
    print(f"engram-segment ready on {server.address} segment_id={server.segment_id} size={size} readers={readers}",
          flush=True)
    return serve_until_signalled(server)


if __name__ == "__main__":
    sys.exit(main())
