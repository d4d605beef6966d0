"""The wire room: what the master, segments and clients share.

* ``_protocol``: messages (a msgpack header frame, then raw frames) and typed access to request fields;
* ``_transport``: ZeroMQ servers (``RpcServer``); ``_client``: client connections with timeouts;
* ``_auth``: CURVE keys of a cluster and the ZAP authenticator;
* ``_tickets``: the tickets that let a writer write one range of one segment (fencing);
* ``handover``: a segment's memory handed to processes on its host as descriptors over a Unix socket (public: the
  client and segment rooms speak it).
"""

from ._auth import AUTH_DIR_ENV, REFUSALS, AuthKeys, exposure_warning, keygen, load_keys, resolve_auth_dir
from ._protocol import PROTOCOL_VERSION, Request, decode, encode, frame_array, frame_bytes
from . import handover
from ._tickets import WRITE_KEY_BYTES, make_ticket, read_ticket
from ._sockets import io_threads
from ._client import Connection, ConnectionPool, wait_all
from ._transport import ZERO_COPY_SEND_BYTES, RpcServer, serve_until_signalled, stop_on_signal_while_starting

__all__ = [
    "AUTH_DIR_ENV",
    "PROTOCOL_VERSION",
    "REFUSALS",
    "WRITE_KEY_BYTES",
    "ZERO_COPY_SEND_BYTES",
    "frame_array",
    "frame_bytes",
    "io_threads",
    "stop_on_signal_while_starting",
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
    "handover",
    "wait_all",
]
