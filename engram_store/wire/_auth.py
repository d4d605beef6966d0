"""CURVE authentication: one key directory per cluster, a ZAP authenticator in every server process.

``engram-master keygen DIR`` writes (with :func:`zmq.auth.create_certificates`)::

    DIR/server.key, server.key_secret    the key pair every master and segment serves with
    DIR/client.key, client.key_secret    the key pair clients use (and segments, as clients of the master)
    DIR/authorized_clients/client.key    public certificates of the clients servers admit

A server started with ``--auth DIR`` makes its ROUTER a CURVE server and admits a client only if the
client's public key has a certificate in ``DIR/authorized_clients`` (checked by a ZAP authenticator,
:class:`zmq.auth.thread.ThreadAuthenticator`, one per ZeroMQ context). A client machine needs only
``server.key``, ``client.key`` and ``client.key_secret``. Refused connections are logged at WARNING with
the peer address, at most once per peer and reason every :data:`REFUSAL_LOG_INTERVAL_S`.

See the CurveZMQ (RFC 26) and ZAP (RFC 27) specifications, and pyzmq's ``zmq.auth``.
"""

from __future__ import annotations

import atexit
import hashlib
import ipaddress
import logging
import os
import threading
from dataclasses import dataclass
from typing import Mapping

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from ..errors import ConfigError
from .._peers import REFUSAL_LOG_INTERVAL_S, REFUSALS  # noqa: F401 (REFUSAL_LOG_INTERVAL_S: named in docs)

log = logging.getLogger(__name__)

AUTH_DIR_ENV = "ENGRAM_AUTH_DIR"
SERVER_NAME = "server"
CLIENT_NAME = "client"
AUTHORIZED_DIR = "authorized_clients"


@dataclass(frozen=True)
class AuthKeys:
    """The CURVE keys of one cluster, loaded from its key directory (Z85-encoded, as ZeroMQ takes them).

    ``server_secret`` and ``authorized_dir`` are set only when loaded for a server.
    """

    directory: str
    server_public: bytes
    client_public: bytes
    client_secret: bytes
    server_secret: bytes | None = None
    authorized_dir: str | None = None

    @property
    def client_curve(self) -> tuple[bytes, bytes, bytes]:
        """``(server public, client public, client secret)``: what a connecting socket needs."""
        return self.server_public, self.client_public, self.client_secret

    def __repr__(self) -> str:  # never print a secret key
        role = "server" if self.server_secret is not None else "client"
        return f"AuthKeys({self.directory!r}, {role}, server_public={self.server_public.decode()!r})"


def resolve_auth_dir(value: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """``value`` if given, else ``$ENGRAM_AUTH_DIR``, else None (no authentication)."""
    if value:
        return value
    env = os.environ if environ is None else environ
    return env.get(AUTH_DIR_ENV) or None


def key_files(directory: str) -> list[str]:
    """The files :func:`keygen` writes into ``directory``."""
    names = [f"{SERVER_NAME}.key", f"{SERVER_NAME}.key_secret", f"{CLIENT_NAME}.key", f"{CLIENT_NAME}.key_secret",
             os.path.join(AUTHORIZED_DIR, f"{CLIENT_NAME}.key")]
    return [os.path.join(directory, n) for n in names]


def keygen(directory: str, force: bool = False) -> list[str]:
    """Create ``directory`` (mode 0700) with a server and a client key pair; returns the files written.

    Refuses (ConfigError) to overwrite existing keys unless ``force``.
    """
    if not zmq.has("curve"):
        raise ConfigError("this libzmq has no CURVE support; install pyzmq's wheel (bundled libzmq) to use --auth")
    existing = [p for p in key_files(directory) if os.path.exists(p)]
    if existing and not force:
        names = ", ".join(os.path.relpath(p, directory) for p in existing)
        raise ConfigError(f"{directory}: keys already exist ({names}); "
                          "pass --force to replace them (every server and client must then get the new keys)")
    authorized = os.path.join(directory, AUTHORIZED_DIR)
    try:
        os.makedirs(authorized, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        for name in (SERVER_NAME, CLIENT_NAME):
            public_file, secret_file = zmq.auth.create_certificates(directory, name)
            os.chmod(secret_file, 0o600)
            os.chmod(public_file, 0o644)
        with open(os.path.join(directory, f"{CLIENT_NAME}.key"), encoding="utf-8") as src:
            text = src.read()
        with open(os.path.join(authorized, f"{CLIENT_NAME}.key"), "w", encoding="utf-8") as dst:
            dst.write(text)
    except OSError as exc:
        raise ConfigError(f"{directory}: cannot write keys: {exc}") from exc
    return key_files(directory)


def _load(path: str, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"auth_dir: cannot read key file {path!r} ({exc}); create the key directory with "
                          "'engram-master keygen DIR'") from None
    if secret and not secret_key:
        raise ConfigError(f"auth_dir: {path!r} holds no secret key")
    return public, secret_key


def load_keys(directory: str, *, server: bool) -> AuthKeys:
    """Load a cluster's keys; ``server=True`` also loads the server secret key and checks authorized_clients."""
    if not isinstance(directory, (str, os.PathLike)):
        raise ConfigError(f"auth_dir: expected a directory path, got {type(directory).__name__}")
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise ConfigError(f"auth_dir: {directory!r} is not a directory; create it with 'engram-master keygen DIR'")
    if not zmq.has("curve"):
        raise ConfigError("auth_dir: this libzmq has no CURVE support; install pyzmq's wheel (bundled libzmq)")
    server_public, _ = _load(os.path.join(directory, f"{SERVER_NAME}.key"), secret=False)
    client_public, client_secret = _load(os.path.join(directory, f"{CLIENT_NAME}.key_secret"), secret=True)
    if not server:
        return AuthKeys(directory, server_public, client_public, client_secret)
    spub, server_secret = _load(os.path.join(directory, f"{SERVER_NAME}.key_secret"), secret=True)
    if spub != server_public:
        raise ConfigError(f"auth_dir: {directory!r}: server.key and server.key_secret are not one key pair")
    authorized = os.path.join(directory, AUTHORIZED_DIR)
    if not os.path.isdir(authorized) or not zmq.auth.load_certificates(authorized):
        raise ConfigError(f"auth_dir: {authorized!r} holds no client certificate (*.key), so no client could "
                          "connect; 'engram-master keygen' creates it")
    return AuthKeys(directory, server_public, client_public, client_secret, server_secret, authorized)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, auth: object) -> str | None:
    """The warning a CLI prints when it binds a non-loopback address without ``--auth``."""
    if auth or is_loopback(host):
        return None
    return (f"WARNING: binding {host} without --auth: anyone who can reach this port can read and remove every "
            "object (create keys with 'engram-master keygen DIR' and start every server with --auth DIR)")


class _EngramAuthenticator(ThreadAuthenticator):
    """pyzmq's ThreadAuthenticator, plus a WARNING (with address and key) for each refused client."""

    def __init__(self, context: zmq.Context):
        super().__init__(context, log=logging.getLogger(__name__ + ".zap"))
        self._request: tuple[str, str] = ("?", "")

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # One request at a time on the authenticator's thread: remember who asks for the reply below.
        address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        key = z85.encode(msg[6]).decode("ascii") if len(msg) > 6 and len(msg[6]) == 32 else ""
        self._request = (address, key)
        await super().handle_zap_message(msg)

    def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous") -> None:
        if status_code != b"200":
            address, key = self._request
            reason = status_text.decode("utf-8", "replace")
            REFUSALS.refused("auth", address, f"client key {key or '?'} is not authorised ({reason})")
        super()._send_zap_reply(request_id, status_code, status_text, user_id)

    def __del__(self) -> None:
        pass  # stopped by _stop_authenticators at exit, never from the GC during interpreter shutdown


_authenticators: dict[int, tuple[zmq.Context, _EngramAuthenticator]] = {}
_authenticators_lock = threading.Lock()


def _stop_authenticators() -> None:
    with _authenticators_lock:
        items = list(_authenticators.values())
        _authenticators.clear()
    for _, auth in items:
        try:
            auth.stop()
        except Exception:  # exiting anyway
            pass


atexit.register(_stop_authenticators)


def zap_domain(keys: AuthKeys) -> str:
    """The ZAP domain of servers using ``keys``: one per authorized_clients directory."""
    digest = hashlib.sha256(os.path.realpath(keys.authorized_dir or "").encode()).hexdigest()[:16]
    return f"engram-{digest}"


def ensure_authenticator(context: zmq.Context, keys: AuthKeys) -> str:
    """Start (once per context) the ZAP authenticator and admit the clients of ``keys``; returns the domain.

    Idempotent: servers of one process (an embedded master and segment) share the authenticator, and
    servers of different clusters in one process get one ZAP domain each.
    """
    if keys.authorized_dir is None:
        raise ConfigError("auth: keys were loaded for a client; a server needs load_keys(..., server=True)")
    domain = zap_domain(keys)
    with _authenticators_lock:
        entry = _authenticators.get(id(context))
        if entry is None or entry[0] is not context:
            auth = _EngramAuthenticator(context)
            auth.start()
            _authenticators[id(context)] = (context, auth)
        else:
            auth = entry[1]
        # Reloads the certificates, so keys added to authorized_clients count for servers started later.
        auth.configure_curve(domain=domain, location=keys.authorized_dir)
    return domain
