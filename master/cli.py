"""``engram-master``: run the metadata master, or ask a running one for its status.

    engram-master [--host 127.0.0.1] [--port 50051] [--lease-ttl 5] [--heartbeat-timeout 10]
                  [--put-timeout 30] [--journal PATH] [--auth DIR] [--log-level INFO]
    engram-master status --master HOST:PORT [--auth DIR]
    engram-master keygen DIR [--force]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from engram_store.wire._auth import AUTH_DIR_ENV, exposure_warning, keygen, load_keys, resolve_auth_dir
from engram_store._errors import EngramError
from engram_store.wire._transport import serve_until_signalled
from engram_store._units import format_size, parse_address

from ._service import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_PORT,
    DEFAULT_PUT_TIMEOUT_S,
    DEFAULT_REUSE_DELAY_S,
    MasterServer,
)


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
                                epilog="Other commands: 'engram-master status --master HOST:PORT', "
                                       "'engram-master keygen DIR'.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to bind (default: {DEFAULT_PORT})")
    p.add_argument("--lease-ttl", type=_positive_float, default=DEFAULT_LEASE_TTL_S, metavar="SECONDS",
                   help=f"how long a read lease blocks remove (default: {DEFAULT_LEASE_TTL_S:g})")
    p.add_argument("--heartbeat-timeout", type=_positive_float, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                   metavar="SECONDS", help="a segment silent this long (while the master runs) is declared dead "
                   f"(default: {DEFAULT_HEARTBEAT_TIMEOUT_S:g})")
    p.add_argument("--put-timeout", type=_positive_float, default=DEFAULT_PUT_TIMEOUT_S, metavar="SECONDS",
                   help="a write whose client has not said it is still writing for this long (it died or hung) is "
                        "fenced and its key and space freed; clients renew several times per period "
                        f"(default: {DEFAULT_PUT_TIMEOUT_S:g})")
    p.add_argument("--journal", metavar="PATH", help="append metadata changes to PATH and replay it at start "
                   "(its directory must exist)")
    p.add_argument("--reuse-delay", type=float, default=DEFAULT_REUSE_DELAY_S, metavar="SECONDS",
                   help="reuse a removed object's space only after this long, so readers holding its old placement "
                        f"never see another object's bytes (default: {DEFAULT_REUSE_DELAY_S:g})")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (default: off)")
    p.add_argument("--re-replicate", action="store_true",
                   help="copy objects that lost a replica (their segment died) onto another live segment")
    p.add_argument("--no-fsync", action="store_true", help="do not fsync the journal after each record")
    p.add_argument("--auth", metavar="DIR", default=resolve_auth_dir(None),
                   help="require CURVE authentication with the keys in DIR (from 'engram-master keygen DIR'); "
                        f"default: ${AUTH_DIR_ENV} if set")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _status_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engram-master status", description="Print a running master's status.")
    p.add_argument("--master", default=f"127.0.0.1:{DEFAULT_PORT}", help="HOST:PORT of the master")
    p.add_argument("--timeout", type=_positive_float, default=5.0, metavar="SECONDS")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument("--auth", metavar="DIR", default=resolve_auth_dir(None),
                   help=f"key directory of a master started with --auth (default: ${AUTH_DIR_ENV} if set)")
    return p


def _keygen_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engram-master keygen",
                                description="Create a cluster's CURVE keys for --auth (a server and a client key "
                                            "pair) in a new directory readable only by you.")
    p.add_argument("dir", metavar="DIR", help="directory to create (mode 0700)")
    p.add_argument("--force", action="store_true", help="replace keys already in DIR")
    return p


def keygen_command(argv: list[str]) -> int:
    args = _keygen_parser().parse_args(argv)
    try:
        written = keygen(args.dir, force=args.force)
    except EngramError as exc:
        print(f"engram-master keygen: {exc}", file=sys.stderr)
        return 1
    print(f"engram-master keygen: wrote CURVE keys to {args.dir}:")
    for path in written:
        print(f"  {path}")
    print(f"""
Start every server of the cluster with the same directory:
  engram-master --auth {args.dir} ...
  engram-segment --auth {args.dir} --master HOST:PORT ...
  (or set {AUTH_DIR_ENV}={args.dir})
Clients pass it too: DistributedStore.connect(master, auth_dir="{args.dir}"), {AUTH_DIR_ENV}, or "auth_dir" in the
JSON config file. A client machine needs only server.key, client.key and client.key_secret;
keep the *.key_secret files private. To admit another client key pair, copy its public
certificate (*.key) into {args.dir}/authorized_clients/ and restart the servers.""")
    return 0


def status(argv: list[str]) -> int:
    args = _status_parser().parse_args(argv)
    from engram_store._errors import MasterUnavailable
    from engram_store.wire._transport import Connection

    try:
        host, port = parse_address(args.master, "--master")
        curve = load_keys(args.auth, server=False).client_curve if args.auth else None
    except EngramError as exc:
        print(f"engram-master status: {exc}", file=sys.stderr)
        return 2
    conn = Connection(f"{host}:{port}", unavailable=MasterUnavailable, curve=curve)
    try:
        header, _ = conn.call("status", timeout_ms=int(args.timeout * 1000))
    except EngramError as exc:
        hint = ("; if the master runs with --auth, pass --auth DIR" if isinstance(exc, MasterUnavailable)
                and not args.auth else "")
        print(f"engram-master status: {exc}{hint}", file=sys.stderr)
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
    for count, keys, what in ((header.get("under_replicated", 0), header.get("under_replicated_keys", []),
                               "under-replicated (fewer replicas than asked for)"),
                              (header.get("lost", 0), header.get("lost_keys", []),
                               "lost (every replica was on segments that died)")):
        if count:
            shown = ", ".join(keys) + (f", ... ({count - len(keys)} more)" if count > len(keys) else "")
            print(f"  {count} object(s) {what}: {shown}")
    if header.get("fencing_bytes"):
        print(f"  {format_size(header['fencing_bytes'])} of abandoned writes waiting for their segments to fence "
              "them")
    unconfirmed = sum(1 for s in segments if not s.get("confirmed", True))
    if unconfirmed:
        print(f"  {unconfirmed} segment(s) restored from the journal have not registered again yet")
    if segments:
        width = max(len(s["address"]) for s in segments)
        print(f"  {'address':<{width}}  {'size':>12}  {'used':>12}  {'used%':>6}  {'readers':>7}  segment")
        for s in segments:
            pct = 100.0 * s["used"] / s["size"] if s["size"] else 0.0
            readers = len(s.get("read_addresses") or ())
            print(f"  {s['address']:<{width}}  {format_size(s['size']):>12}  {format_size(s['used']):>12}  "
                  f"{pct:5.1f}%  {readers:>7}  {s['segment_id']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "status":
        return status(argv[1:])
    if argv and argv[0] == "keygen":
        return keygen_command(argv[1:])
    args = _serve_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    warning = exposure_warning(args.host, args.auth)
    if warning:
        print(f"engram-master: {warning}", file=sys.stderr, flush=True)
    try:
        auth = load_keys(args.auth, server=True) if args.auth else None
        server = MasterServer(args.host, args.port, lease_ttl_s=args.lease_ttl,
                              heartbeat_timeout_s=args.heartbeat_timeout, journal_path=args.journal,
                              journal_fsync=not args.no_fsync, re_replicate=args.re_replicate,
                              metrics_port=args.metrics_port, reuse_delay_s=args.reuse_delay, auth=auth,
                              put_timeout_s=args.put_timeout)
    except EngramError as exc:
        print(f"engram-master: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("engram-master").info("serving on %s%s", server.address,
                                            f" (CURVE authentication, keys in {args.auth})" if auth else "")
    return serve_until_signalled(server)


if __name__ == "__main__":
    sys.exit(main())
