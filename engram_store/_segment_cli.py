"""``engram-segment``: run one segment server that registers with a master.

    engram-segment --master 127.0.0.1:50051 --size 4GiB [--host 127.0.0.1] [--port 0]
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from ._errors import EngramError
from ._segment import SegmentServer
from ._units import parse_address, parse_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="engram-segment", description="Serve one engram memory segment.")
    p.add_argument("--master", default="127.0.0.1:50051", help="HOST:PORT of the master (default: 127.0.0.1:50051)")
    p.add_argument("--size", default="1GiB", help="segment size, e.g. 512MiB, 4GiB (default: 1GiB)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind and advertise (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to bind (default: any free port)")
    p.add_argument("--file", metavar="PATH",
                   help="keep the segment in PATH (memory-mapped) with a manifest in PATH.manifest, so a restart on "
                        "the same file brings its objects back (default: shared memory, gone at exit)")
    p.add_argument("--register-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long to keep trying to reach the master at start (default: 30)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        size = parse_size(args.size, "--size")
        host, port = parse_address(args.master, "--master")
        server = SegmentServer(size, f"{host}:{port}", host=args.host, port=args.port,
                               register_timeout_s=args.register_timeout, file=args.file)
    except EngramError as exc:
        print(f"engram-segment: {exc}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("engram-segment").warning(
            "binding %s without authentication: any host that can reach this port can read and write", args.host)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    print(f"engram-segment ready on {server.address} segment_id={server.segment_id} size={size}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
