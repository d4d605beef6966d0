"""The embedded cluster's master: one started inside this process, on a 127.0.0.1 port the OS picks, for the
stores that need no servers started by hand (:meth:`DistributedStore.embedded`, a configuration that names no
master, and Mooncake's ``setup`` without a master address). Its segments are mounted by the store that owns it."""
from __future__ import annotations

from ..master import MasterServer
from ..wire import load_keys


def start_master(auth_dir: str | None = None, **settings) -> MasterServer:
    """A master on ``127.0.0.1:0``, started; with ``auth_dir`` it admits only clients with CURVE keys from there.
    ``settings``: :class:`MasterServer`'s (``lease_ttl_s``, ``heartbeat_timeout_s``)."""
    auth = load_keys(auth_dir, server=True) if auth_dir else None
    return MasterServer("127.0.0.1", 0, auth=auth, **settings).start()
