"""``MooncakeDistributedStore.setup``: its two overloads read into one request, and the session it opens.

Mooncake's client owns a transfer endpoint named ``host:port`` (``get_hostname()``): the port given in
``local_hostname``, else one picked at random from 12300-14300 (``MC_STORE_CLIENT_MIN_PORT`` /
``MC_STORE_CLIENT_MAX_PORT``). Here that endpoint is the segment this client mounts (``global_segment_size``
bytes), bound on that port; a client that mounts nothing holds the port with a bound socket, as Mooncake's port
binder does, so the name stays unique on the host. An empty master address starts a master in this process.
"""

from __future__ import annotations

import logging
import os
import random
import re
import socket
from dataclasses import dataclass
from typing import Any, Mapping

from ..client import DistributedStore, start_master
from ..master import MasterServer
from ..segment import SegmentServer, default_readers
from ..wire import load_keys, resolve_auth_dir
from .._config import DEFAULT_EMBEDDED_SEGMENT_SIZE, DEFAULT_TIMEOUT_MS
from ..errors import EngramError, InvalidArgument, InvalidType, MasterUnavailable, Unavailable, describe

log = logging.getLogger("engram_store.compat")

#: The dictionary overload's defaults (Mooncake's ``DEFAULT_GLOBAL_SEGMENT_SIZE`` and friends).
DICT_DEFAULTS = {"global_segment_size": 16 << 20, "local_buffer_size": 16 << 20, "protocol": "tcp",
                 "rdma_devices": "", "master_server_addr": "127.0.0.1:50051"}
#: Sizes the dictionary overload accepts: 0 (none), or at least 1 KiB; a local buffer at most 1 TiB.
MIN_SEGMENT_SIZE = 1 << 10
MAX_SEGMENT_SIZE = 1 << 40
#: Where the transfer endpoint's port is picked when ``local_hostname`` names none, and how many are tried.
PORT_RANGE = (12300, 14300)
PORT_ATTEMPTS = 20
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30,
          "T": 1 << 40, "TB": 1 << 40}
_SIZE_RE = re.compile(r"^([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)$")
_TRUE, _FALSE = {"1", "true", "yes", "on", "enable"}, {"0", "false", "no", "off", "disable"}


def mooncake_size(value: Any, name: str) -> int:
    """A byte count as Mooncake reads one: an int, or a string like ``"3200MB"``, ``"16 MB"``, ``"1.5GB"``.

    Units are Mooncake's: K/KB, M/MB, G/GB, T/TB are powers of 1024 (``"16MB"`` is 16 MiB); no percentages.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise InvalidArgument(f"{name}: expected a byte count >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise InvalidType(f"{name}: expected a byte count (an int, or a string like '3200MB'), got {describe(value)}")
    match = _SIZE_RE.match(value.strip())
    unit = match.group(2).upper() if match else None
    if unit not in _UNITS:
        raise InvalidArgument(f"{name}: expected a byte count like 16777216, '16MB' or '1.5 GB' (K, M, G, T are "
                              f"powers of 1024), got {describe(value)}")
    return int(float(match.group(1)) * _UNITS[unit])


def _flag(value: Any, name: str, default: bool) -> bool:
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    log.warning("setup: %s=%r is not a boolean; using %s (as Mooncake does)", name, value, default)
    return default


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise InvalidType(f"{name}: expected a string, got {describe(value)}")
    return value


@dataclass(frozen=True)
class SetupRequest:
    """What a ``setup`` call asks for, from either overload, checked."""

    host: str
    port: int | None                      # the port ``local_hostname`` names, if any
    metadata_server: str                  # accepted; this store needs no metadata service
    global_segment_size: int
    local_buffer_size: int                # put/get of Python bytes stage through a buffer of this size
    protocol: str                         # accepted; bytes move over TCP whatever is named
    rdma_devices: str                     # accepted; unused
    master: str                           # "" starts a master in this process
    tenant_id: str = "default"
    enable_ssd_offload: bool = False      # accepted; nothing is evicted here, so nothing is offloaded
    enable_client_http_server: bool = False

    def __post_init__(self) -> None:
        if not self.host:
            raise InvalidArgument("local_hostname: expected a host name, got ''")
        if self.port is not None and not 0 < self.port < 65536:
            raise InvalidArgument(f"local_hostname: expected a port in 1..65535, got {self.port}")
        if self.tenant_id != "default":
            raise InvalidArgument(f"tenant_id: this store has one key namespace (run a master per tenant); "
                                  f"expected 'default', got {self.tenant_id!r}")
        if self.enable_client_http_server:
            raise InvalidArgument("enable_client_http_server: this client serves no HTTP endpoints (engram-master "
                                  "--metrics-port serves /metrics); expected False, got True")
        if self.enable_ssd_offload:
            log.warning("setup: enable_ssd_offload is accepted and unused: objects here are never evicted, so "
                        "nothing is offloaded (EngramStore(disk_dir=...) keeps tables on SSD)")

    @classmethod
    def from_args(cls, local_hostname: Any, metadata_server: Any, global_segment_size: Any, local_buffer_size: Any,
                  protocol: Any, rdma_devices: Any, master_server_addr: Any, engine: Any = None,
                  enable_ssd_offload: bool = False, ssd_offload_path: str = "", tenant_id: str = "default",
                  enable_client_http_server: bool = False, client_http_port: int = 9300) -> "SetupRequest":
        """Mooncake's positional overload (its keyword names; ``None`` for a text argument means empty)."""
        if engine is not None:
            raise InvalidArgument(f"engine: this store has no TransferEngine to share; expected None, got "
                                  f"{describe(engine)}")
        texts = {name: "" if value is None else _text(value, name) for name, value in (
            ("local_hostname", local_hostname), ("metadata_server", metadata_server), ("protocol", protocol),
            ("rdma_devices", rdma_devices), ("master_server_addr", master_server_addr),
            ("ssd_offload_path", ssd_offload_path), ("tenant_id", tenant_id))}
        host, port = _split_host(texts["local_hostname"] or "127.0.0.1")
        return cls(host, port, texts["metadata_server"], mooncake_size(global_segment_size, "global_segment_size"),
                   mooncake_size(local_buffer_size, "local_buffer_size"), texts["protocol"] or "tcp",
                   texts["rdma_devices"], texts["master_server_addr"], texts["tenant_id"] or "default",
                   bool(enable_ssd_offload), bool(enable_client_http_server))

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "SetupRequest":
        """Mooncake's dictionary overload: every value read as its text, as Mooncake does; unknown keys ignored.

        ``local_hostname`` and ``metadata_server`` are required; ``device_name`` and ``master_server_address``
        (the names ``MooncakeConfig`` uses) are read too where Mooncake's own keys are absent.
        """
        values = {str(k): str(v) for k, v in config.items()}
        for name in ("local_hostname", "metadata_server"):
            if not values.get(name):
                raise InvalidArgument(f"config[{name!r}]: required, got {describe(config.get(name, '(missing)'))}")
        sizes = {}
        for name in ("global_segment_size", "local_buffer_size"):
            sizes[name] = mooncake_size(values.get(name, str(DICT_DEFAULTS[name])), f"config[{name!r}]")
            if 0 < sizes[name] < MIN_SEGMENT_SIZE:
                raise InvalidArgument(f"config[{name!r}]: expected 0 or at least {MIN_SEGMENT_SIZE} bytes, "
                                      f"got {sizes[name]}")
        if sizes["local_buffer_size"] > MAX_SEGMENT_SIZE:
            raise InvalidArgument(f"config['local_buffer_size']: expected at most {MAX_SEGMENT_SIZE} bytes, got "
                                  f"{sizes['local_buffer_size']}")
        port_text = values.get("client_http_port", "9300").strip()
        if not port_text.lstrip("+-").isdigit():
            raise InvalidArgument(f"config['client_http_port']: expected an integer, got {port_text!r}")
        host, port = _split_host(values["local_hostname"])
        devices = values.get("rdma_devices", values.get("device_name", DICT_DEFAULTS["rdma_devices"]))
        master = values.get("master_server_addr", values.get("master_server_address",
                                                             DICT_DEFAULTS["master_server_addr"]))
        return cls(host, port, values["metadata_server"], sizes["global_segment_size"], sizes["local_buffer_size"],
                   values.get("protocol", DICT_DEFAULTS["protocol"]), devices, master,
                   values.get("tenant_id", "default"),
                   _flag(values.get("enable_ssd_offload", "false"), "enable_ssd_offload", False),
                   _flag(values.get("enable_client_http_server", "false"), "enable_client_http_server", False))


def _split_host(local_hostname: str) -> tuple[str, int | None]:
    """``"host:port"`` -> ``(host, port)``; a name without a port -> ``(host, None)``."""
    host, sep, port = local_hostname.rpartition(":")
    if sep and port.isdigit() and host and not host.endswith(":"):
        return host.strip("[]"), int(port)
    return local_hostname, None


def _port_range() -> tuple[int, int]:
    """Mooncake's range for picking a port, from its environment variables (their defaults where invalid)."""
    try:
        low = int(os.environ.get("MC_STORE_CLIENT_MIN_PORT", PORT_RANGE[0]))
        high = int(os.environ.get("MC_STORE_CLIENT_MAX_PORT", PORT_RANGE[1]))
    except ValueError:
        return PORT_RANGE
    return (low, high) if 0 < low <= high < 65536 else PORT_RANGE


class Session:
    """What a successful ``setup`` holds: the client, the segment it mounts, a master it started, its name."""

    def __init__(self, request: SetupRequest):
        self.request = request
        self.master: MasterServer | None = None
        self.segment: SegmentServer | None = None
        self._port_holder: socket.socket | None = None
        self.store: DistributedStore | None = None
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        request = self.request
        master = request.master
        size = request.global_segment_size
        auth_dir = resolve_auth_dir(None)  # $ENGRAM_AUTH_DIR: a cluster run with --auth
        if not master:
            self.master = start_master(auth_dir)
            master = self.master.address
            size = size or DEFAULT_EMBEDDED_SEGMENT_SIZE
        self.store = DistributedStore.connect(master, 0, timeout_ms=DEFAULT_TIMEOUT_MS, host=request.host,
                                              auth_dir=auth_dir)
        self.port = self._mount(master, size) if size else self._hold_port()

    @property
    def hostname(self) -> str:
        """``host:port`` of this client's transfer endpoint (Mooncake's ``get_hostname()``)."""
        return f"{self.request.host}:{self.port}"

    def _ports(self) -> list[int]:
        if self.request.port is not None:
            return [self.request.port]
        low, high = _port_range()
        return random.sample(range(low, high + 1), min(PORT_ATTEMPTS, high - low + 1))

    def _mount(self, master: str, size: int) -> int:
        """Mount a segment of ``size`` bytes on this client's port (its reader sockets on the ports after it)."""
        auth = load_keys(self.store.auth_dir, server=True) if self.store.auth_dir else None
        readers = default_readers()
        error: EngramError | None = None
        for port in self._ports():
            if port + readers >= 65536:
                continue
            try:
                self.segment = SegmentServer(size, master, host=self.request.host, port=port, auth=auth,
                                             readers=readers).start()
                return port
            except MasterUnavailable:
                raise
            except Unavailable as exc:  # the port (or a reader's) is taken: try another, as Mooncake does
                error = exc
        raise Unavailable(f"local_hostname: could not mount a segment on {self.request.host} at any of "
                          f"{self._describe_ports()} ({error})")

    def _hold_port(self) -> int:
        """A client that mounts nothing still names itself ``host:port``: hold the port so the name is unique."""
        error: OSError | None = None
        for port in self._ports():
            holder = socket.socket(socket.AF_INET6 if ":" in self.request.host else socket.AF_INET)
            try:
                holder.bind((self.request.host, port))
            except OSError as exc:
                holder.close()
                error = exc
                continue
            self._port_holder = holder
            return port
        raise Unavailable(f"local_hostname: no free port on {self.request.host} among {self._describe_ports()} "
                          f"({error})")

    def _describe_ports(self) -> str:
        if self.request.port is not None:
            return f"port {self.request.port} (from local_hostname)"
        low, high = _port_range()
        return f"{PORT_ATTEMPTS} random ports in {low}..{high}"

    def close(self) -> None:
        """Stop the client, then its segment (whose objects go with it), then a master it started."""
        store, segment, master, holder = self.store, self.segment, self.master, self._port_holder
        self.store = self.segment = self.master = self._port_holder = None
        if store is not None:
            store.close()
        if segment is not None:
            segment.close(unregister=master is None)  # a master going too needs no goodbye
        if master is not None:
            master.close()
        if holder is not None:
            holder.close()

