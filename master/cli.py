"""``engram-master``: run the metadata master, or ask a running one for its status.

    engram-master [--host 127.0.0.1] [--port 50051] [--lease-ttl 5] [--heartbeat-timeout 10]
                  [--journal PATH] [--log-level INFO]
    engram-master status --master HOST:PORT
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

from engram_store._errors import EngramError
from engram_store._units import format_size, parse_address

from ._service import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_LEASE_TTL_S, DEFAULT_PORT, MasterServer


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engram-master", description="Run the engram metadata master.",
                                epilog="Other commands: 'engram-master status --master HOST:PORT'.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to bind (default: {DEFAULT_PORT})")
    p.add_argument("--lease-ttl", type=_positive_float, default=DEFAULT_LEASE_TTL_S, metavar="SECONDS",
                   help=f"how long a read lease blocks remove (default: {DEFAULT_LEASE_TTL_S:g})")
    p.add_argument("--heartbeat-timeout", type=_positive_float, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                   metavar="SECONDS", help="a segment silent this long (while the master runs) is declared dead "
                   f"(default: {DEFAULT_HEARTBEAT_TIMEOUT_S:g})")
    p.add_argument("--journal", metavar="PATH", help="append metadata changes to PATH and replay it at start")
    p.add_argument("--re-replicate", action="store_true",
                   help="copy objects that lost a replica (their segment died) onto another live segment")
    p.add_argument("--no-fsync", action="store_true", help="do not fsync the journal after each record")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _status_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engram-master status", description="Print a running master's status.")
    p.add_argument("--master", default=f"127.0.0.1:{DEFAULT_PORT}", help="HOST:PORT of the master")
    p.add_argument("--timeout", type=_positive_float, default=5.0, metavar="SECONDS")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    return p


def status(argv: list[str]) -> int:
    args = _status_parser().parse_args(argv)
    from engram_store._errors import MasterUnavailable
    from engram_store._transport import Connection

    host, port = parse_address(args.master, "--master")
    conn = Connection(f"{host}:{port}", unavailable=MasterUnavailable)
    try:
        header, _ = conn.call("status", timeout_ms=int(args.timeout * 1000))
    except EngramError as exc:
        print(f"engram-master status: {exc}", file=sys.stderr)
        return 1
    finally:
        conn.close()
    header = {k: v for k, v in header.items() if k not in ("v", "id", "ok")}
    if args.json:
        print(json.dumps(header, indent=2))
        return 0
    segments = header["segments"]
    print(f"master {host}:{port}: {len(segments)} segment(s), {header['objects']} object(s), "
          f"{format_size(header['object_bytes'])} stored" + (f", {header['pending']} write(s) in progress"
                                                             if header["pending"] else ""))
    if segments:
        width = max(len(s["address"]) for s in segments)
        print(f"  {'address':<{width}}  {'size':>12}  {'used':>12}  {'used%':>6}  segment")
        for s in segments:
            pct = 100.0 * s["used"] / s["size"] if s["size"] else 0.0
            print(f"  {s['address']:<{width}}  {format_size(s['size']):>12}  {format_size(s['used']):>12}  "
                  f"{pct:5.1f}%  {s['segment_id']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "status":
        return status(argv[1:])
    args = _serve_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = MasterServer(args.host, args.port, lease_ttl_s=args.lease_ttl,
                              heartbeat_timeout_s=args.heartbeat_timeout, journal_path=args.journal,
                              journal_fsync=not args.no_fsync, re_replicate=args.re_replicate)
    except EngramError as exc:
        print(f"engram-master: {exc}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("engram-master").warning(
            "binding %s without authentication: any host that can reach this port can read and write", args.host)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    logging.getLogger("engram-master").info("serving on %s", server.address)
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
