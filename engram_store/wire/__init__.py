"""The wire room: what the master, segments and clients share.

* ``_protocol``: messages (a msgpack header frame, then raw frames) and typed access to request fields;
* ``_transport``: ZeroMQ servers (``RpcServer``) and client connections with timeouts;
* ``_auth``: CURVE keys of a cluster and the ZAP authenticator;
* ``_tickets``: the tickets that let a writer write one range of one segment (fencing);
* ``_raw``: the raw read channel's framing.
"""

from ._auth import AUTH_DIR_ENV, AuthKeys, exposure_warning, keygen, load_keys, resolve_auth_dir
from ._protocol import PROTOCOL_VERSION, Request, decode, encode
from ._tickets import make_ticket, read_ticket
from ._transport import Connection, ConnectionPool, RpcServer, serve_until_signalled, wait_all

__all__ = [
    "AUTH_DIR_ENV",
    "PROTOCOL_VERSION",
    "AuthKeys",
    "Connection",
    "ConnectionPool",
    "Request",
    "RpcServer",
    "decode",
    "encode",
    "exposure_warning",
    "keygen",
    "load_keys",
    "make_ticket",
    "read_ticket",
    "resolve_auth_dir",
    "serve_until_signalled",
    "wait_all",
]
