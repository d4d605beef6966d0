"""``engram-master``: run the metadata master, ask a running one for its status, or make a cluster's keys.

    engram-master [--host 127.0.0.1] [--port 50051] [--journal PATH] [--auth DIR] [...]
    engram-master status [--master HOST:PORT] [--wait-segments N] [--timeout SECONDS] [--json] [--auth DIR]
    engram-master keygen DIR [--force]
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import time
from typing import Any, Sequence

from engram_store import cli
from engram_store.wire import (AUTH_DIR_ENV, Connection, exposure_warning, keygen, load_keys, resolve_auth_dir,
                               serve_until_signalled, stop_on_signal_while_starting)
from engram_store.errors import EngramError, MasterUnavailable
from engram_store.units import format_size, parse_address

from ._config import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_PORT,
    DEFAULT_PUT_TIMEOUT_S,
    DEFAULT_REUSE_DELAY_S,
    MasterConfig,
)
from ._service import MasterServer

PROG = "engram-master"
USAGE = (f"{PROG} [options]                     run a master (options below)\n"
         f"       {PROG} status [--master HOST:PORT] [--wait-segments N] [--timeout SECONDS] [--json] [--auth DIR]\n"
         f"       {PROG} keygen DIR [--force]")
#: How long ``status`` waits for a first answer before it says that it is still waiting, and why it may be.
FIRST_ANSWER_S = 1.0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


_count = cli.non_negative("a number of segments")


def _auth_default_help(what: str) -> str:
    return f"{what} (default: ${AUTH_DIR_ENV} if set, else none)"


def _serve_parser() -> argparse.ArgumentParser:
    p = cli.parser(PROG, "Run the engram metadata master: the segment registry, object placement, leases,\n"
                          "write fencing and (with --journal) durable metadata.",
                    usage=USAGE,
                    epilog=f"Commands:\n  status   print a running master's segments and objects ({PROG} status -h)\n"
                           f"  keygen   create a cluster's CURVE keys for --auth ({PROG} keygen -h)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind")
    p.add_argument("--lease-ttl", type=_positive_float, default=DEFAULT_LEASE_TTL_S, metavar="SECONDS",
                   help="how long a read lease blocks remove")
    p.add_argument("--heartbeat-timeout", type=_positive_float, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                   metavar="SECONDS", help="a segment silent this long (while the master runs) is declared dead")
    p.add_argument("--put-timeout", type=_positive_float, default=DEFAULT_PUT_TIMEOUT_S, metavar="SECONDS",
                   help="a write whose client has not said it is still writing for this long (it died or hung) is "
                        "fenced and its key and space freed; clients renew several times per period")
    p.add_argument("--journal", metavar="PATH", help="append metadata changes to PATH and replay it at start; its "
                   "directory is created if missing, and PATH.lock keeps a second master off it (default: none, "
                   "metadata lives in memory only)")
    p.add_argument("--reuse-delay", type=float, default=DEFAULT_REUSE_DELAY_S, metavar="SECONDS",
                   help="reuse a removed object's space only after this long, so readers holding its old placement "
                        "never see another object's bytes")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on http://METRICS-HOST:PORT/metrics, plain HTTP that anyone who "
                        "reaches the port may read (default: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address the metrics page binds (another than loopback shows it to the network)")
    p.add_argument("--metrics-addresses", action="store_true",
                   help="label each segment's series on the metrics page with its address too, not only its id")
    p.add_argument("--re-replicate", action="store_true",
                   help="copy objects that lost a replica (their segment died) onto another live segment")
    p.add_argument("--no-fsync", action="store_true", help="do not fsync the journal after each record")
    p.add_argument("--auth", metavar="DIR", default=resolve_auth_dir(None),
                   help=_auth_default_help(f"require CURVE authentication with the keys in DIR (from '{PROG} "
                                           "keygen DIR')"))
    cli.add_log_level(p)
    return p


def _status_parser() -> argparse.ArgumentParser:
    p = cli.parser(f"{PROG} status", "Print a running master's segments, objects, and lost or under-replicated "
                                      "objects.")
    p.add_argument("--master", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT", help="the master's address")
    p.add_argument("--wait-segments", type=_count, default=0, metavar="N",
                   help="first wait until N segments have registered (for scripts that start a cluster); fails "
                        "after --timeout")
    p.add_argument("--timeout", type=_positive_float, default=5.0, metavar="SECONDS",
                   help="how long to wait for the master's answer (and for --wait-segments)")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument("--auth", metavar="DIR", default=resolve_auth_dir(None),
                   help=_auth_default_help("key directory of a master started with --auth"))
    return p


def _keygen_parser() -> argparse.ArgumentParser:
    p = cli.parser(f"{PROG} keygen", "Create a cluster's CURVE keys for --auth (a server and a client key pair) "
                                      "in a new directory readable only by you.")
    p.add_argument("dir", metavar="DIR", help="directory to create (mode 0700)")
    p.add_argument("--force", action="store_true", help="replace keys already in DIR")
    return p


def keygen_command(argv: Sequence[str]) -> int:
    args = _keygen_parser().parse_args(argv)
    try:
        written = keygen(args.dir, force=args.force)
    except EngramError as exc:
        print(f"{PROG} keygen: {exc}", file=sys.stderr)
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


def _nothing_listens(host: str, port: int) -> str | None:
    """Why nothing accepts TCP connections at ``host:port`` (e.g. "connection refused"), or None when something
    does: a plain connect answers at once, where a ZeroMQ request to nobody waits for its whole timeout."""
    try:
        with socket.create_connection((host, port), timeout=FIRST_ANSWER_S):
            return None
    except socket.timeout:
        return None  # a filtered port or a slow network: let the request itself find out
    except OSError as exc:
        return exc.strerror or str(exc)


def _first_status(conn: Connection, args: Any, prog: str, address: str, deadline: float,
                  auth_hint: str) -> dict | None:
    """The master's first answer to ``status`` (None: nothing listens, said on stderr). Asked at once; only when
    no answer came within a second is the port checked with a bare TCP connect, so a master that answers is never
    probed: one with --auth logs a connection closed before its handshake as a refused client."""
    host, _, port = address.rpartition(":")
    try:
        return conn.call("status", timeout_ms=int(max(0.05, min(FIRST_ANSWER_S, deadline - time.monotonic()))
                                                  * 1000))[0]
    except MasterUnavailable as exc:
        if "no reply" not in str(exc):
            raise
    why = None if args.wait_segments else _nothing_listens(host, int(port))
    if why is not None:
        print(f"{prog}: no reply from {address}: nothing listens there ({why}); is engram-master running on that "
              f"port? (start one with: {PROG} --host {host} --port {port})", file=sys.stderr)
        return None
    if time.monotonic() < deadline:
        waiting = (f"waiting up to {args.timeout:g} s for a master to answer on {address}" if args.wait_segments
                   else f"{address} accepts connections but has not answered in {FIRST_ANSWER_S:g} s; waiting up "
                        f"to {args.timeout:g} s ({auth_hint})")
        print(f"{prog}: {waiting}", file=sys.stderr, flush=True)
    return conn.call("status", timeout_ms=int(max(0.05, deadline - time.monotonic()) * 1000))[0]


def _registered(header: dict) -> int:
    """Segments that have registered with this master (not those a journal restored that have yet to)."""
    return sum(1 for s in header["segments"] if s.get("confirmed", True))


def _wait_for_segments(conn: Connection, header: dict, args: argparse.Namespace, prog: str, address: str,
                       deadline: float) -> dict | None:
    """Ask again until ``--wait-segments`` segments have registered: the last answer, or None (said why) when the
    deadline passed first."""
    announced = False
    while _registered(header) < args.wait_segments:
        left = deadline - time.monotonic()
        if left <= 0:
            print(f"{prog}: {_registered(header)} of {args.wait_segments} segment(s) registered with "
                  f"{address} within {args.timeout:g} s; are they running, and started with --master "
                  f"{address}? (raise --timeout to wait longer)", file=sys.stderr)
            return None
        if not announced and time.monotonic() + args.timeout - deadline > FIRST_ANSWER_S:
            print(f"{prog}: waiting up to {args.timeout:g} s for {args.wait_segments} segment(s) to register "
                  f"with {address} ({_registered(header)} so far)", file=sys.stderr, flush=True)
            announced = True
        time.sleep(min(0.1, left))
        # at least a second for the answer itself, so a loaded master is not mistaken for a silent one
        header, _ = conn.call("status", timeout_ms=int(max(1.0, deadline - time.monotonic()) * 1000))
    return header


def _print_status(header: dict, host: str, port: int) -> None:
    """The status answer for a reader: totals, the objects in trouble, then one line per segment."""
    segments = header["segments"]
    print(f"master {host}:{port}: {len(segments)} segment(s), {header['objects']} object(s), "
          f"{format_size(header['object_bytes'])} stored" + (f", {header['pending']} write(s) in progress"
                                                             if header["pending"] else ""))
    for count, keys, what in ((header.get("under_replicated", 0), header.get("under_replicated_keys", []),
                               "under-replicated (fewer replicas than asked for)"),
                              (header.get("lost", 0), header.get("lost_keys", []),
                               "lost (every replica was on segments that died, or damaged at rest)")):
        if count:
            shown = ", ".join(keys) + (f", ... ({count - len(keys)} more)" if count > len(keys) else "")
            print(f"  {count} object(s) {what}: {shown}")
    if header.get("fencing_bytes"):
        print(f"  {format_size(header['fencing_bytes'])} of abandoned writes waiting for their segments to fence "
              "them")
    unconfirmed = sum(1 for s in segments if not s.get("confirmed", True))
    if unconfirmed:
        print(f"  {unconfirmed} segment(s) restored from the journal have not registered again yet")
    for s in segments:
        if s.get("refusing_puts"):
            print(f"  segment {s['segment_id']} at {s['address']} takes no new puts: {s['refusing_puts']}")
    if segments:
        width = max(len(s["address"]) for s in segments)
        print(f"  {'address':<{width}}  {'size':>12}  {'used':>12}  {'used%':>6}  {'readers':>7}  segment")
        for s in segments:
            pct = 100.0 * s["used"] / s["size"] if s["size"] else 0.0
            readers = len(s.get("read_addresses") or ())
            print(f"  {s['address']:<{width}}  {format_size(s['size']):>12}  {format_size(s['used']):>12}  "
                  f"{pct:5.1f}%  {readers:>7}  {s['segment_id']}")


def status(argv: Sequence[str] | None) -> int:
    args = _status_parser().parse_args(argv)
    prog = f"{PROG} status"
    try:
        host, port = parse_address(args.master, "--master")
        curve = load_keys(args.auth, server=False).client_curve if args.auth else None
    except EngramError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    address = f"{host}:{port}"
    deadline = time.monotonic() + args.timeout
    auth_hint = ("a master started with --auth answers only clients that have its keys: pass --auth DIR" if not
                 args.auth else f"check that {args.auth} holds the keys the master was started with")
    conn = Connection(address, unavailable=MasterUnavailable, curve=curve)
    try:
        header = _first_status(conn, args, prog, address, deadline, auth_hint)
        if header is None:
            return 1
        if args.wait_segments:
            header = _wait_for_segments(conn, header, args, prog, address, deadline)
            if header is None:
                return 1
    except MasterUnavailable as exc:
        if "no reply" in str(exc) and _nothing_listens(host, port) is not None:
            print(f"{prog}: no reply from {address} within {args.timeout:g} s: nothing listens there; is "
                  f"engram-master running on that port?", file=sys.stderr)
        elif "no reply" in str(exc):
            print(f"{prog}: no reply from {address} within {args.timeout:g} s: something listens there but it did "
                  f"not answer as an engram master ({auth_hint})", file=sys.stderr)
        else:
            print(f"{prog}: {address}: {exc}", file=sys.stderr)
        return 1
    except EngramError as exc:
        print(f"{prog}: {address}: {exc}", file=sys.stderr)
        return 1
    finally:
        conn.close()
    header = {k: v for k, v in header.items() if k not in ("v", "id", "ok")}
    if args.json:
        print(json.dumps(header, indent=2))
        return 0
    _print_status(header, host, port)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "status":
        return status(argv[1:])
    if argv and argv[0] == "keygen":
        return keygen_command(argv[1:])
    args = _serve_parser().parse_args(argv)
    cli.setup_logging(args.log_level)
    warning = exposure_warning(args.host, args.auth)
    if warning:
        print(f"engram-master: {warning}", file=sys.stderr, flush=True)
    cli.raise_open_files_limit()  # each client connection holds a descriptor
    try:
        auth = load_keys(args.auth, server=True) if args.auth else None
        config = MasterConfig(args.host, args.port, lease_ttl_s=args.lease_ttl,
                              heartbeat_timeout_s=args.heartbeat_timeout, journal_path=args.journal,
                              journal_fsync=not args.no_fsync, metrics_port=args.metrics_port,
                              metrics_host=args.metrics_host, metrics_addresses=args.metrics_addresses,
                              reuse_delay_s=args.reuse_delay, re_replicate=args.re_replicate,
                              put_timeout_s=args.put_timeout)
        with stop_on_signal_while_starting():  # a journal replay that is stopped releases the journal
            server = MasterServer(auth=auth, config=config)
    except EngramError as exc:
        print(f"engram-master: {exc}", file=sys.stderr)
        return 2
    logging.getLogger(PROG).info("serving on %s%s", server.address,
                                            f" (CURVE authentication, keys in {args.auth})" if auth else "")
    return serve_until_signalled(server)


if __name__ == "__main__":
    sys.exit(main())
