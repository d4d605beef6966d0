"""Store configuration: one dataclass, one loader fed by a JSON file, the environment, or keywords.

Names follow Mooncake's ``MooncakeConfig`` so existing deployment files and variables work unchanged:

============================== ===================================== =========================================
field                          environment (engram, then Mooncake)   meaning
============================== ===================================== =========================================
master_server_address          ENGRAM_MASTER, MOONCAKE_MASTER        master ``host:port``; empty = embedded
global_segment_size            ENGRAM_SEGMENT_SIZE,                  bytes this client mounts as a segment
                               MOONCAKE_GLOBAL_SEGMENT_SIZE          (``"4GiB"`` accepted); 0 = none
local_buffer_size              MOONCAKE_LOCAL_BUFFER_SIZE            accepted for compatibility; unused
local_hostname                 ENGRAM_HOST, MOONCAKE_LOCAL_HOSTNAME  address a mounted segment binds
metadata_server                MOONCAKE_TE_META_DATA_SERVER          accepted for compatibility; unused
protocol                       MOONCAKE_PROTOCOL                     accepted ("tcp"); unused
device_name                    MOONCAKE_DEVICE                       accepted; unused
timeout_ms                     ENGRAM_TIMEOUT_MS                     per-call timeout
auth_dir                       ENGRAM_AUTH_DIR                       key directory of a cluster run with
                                                                     ``--auth`` (``engram-master keygen``);
                                                                     empty = no authentication
============================== ===================================== =========================================

``ENGRAM_CONFIG_PATH`` (or ``MOONCAKE_CONFIG_PATH``) names a JSON file with any of these fields; variables
set in the environment override the file. Loading reads only; it starts nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Mapping

from .errors import ConfigError, InvalidType, describe
from .units import parse_address, parse_size

DEFAULT_TIMEOUT_MS = 10_000
DEFAULT_EMBEDDED_SEGMENT_SIZE = 1 << 30

_ENV = {
    "master_server_address": ("ENGRAM_MASTER", "MOONCAKE_MASTER"),
    "global_segment_size": ("ENGRAM_SEGMENT_SIZE", "MOONCAKE_GLOBAL_SEGMENT_SIZE"),
    "local_buffer_size": ("MOONCAKE_LOCAL_BUFFER_SIZE",),
    "local_hostname": ("ENGRAM_HOST", "MOONCAKE_LOCAL_HOSTNAME"),
    "metadata_server": ("MOONCAKE_TE_META_DATA_SERVER",),
    "protocol": ("MOONCAKE_PROTOCOL",),
    "device_name": ("MOONCAKE_DEVICE",),
    "timeout_ms": ("ENGRAM_TIMEOUT_MS",),
    "auth_dir": ("ENGRAM_AUTH_DIR",),
}
_CONFIG_PATH_ENV = ("ENGRAM_CONFIG_PATH", "MOONCAKE_CONFIG_PATH")


@dataclass
class StoreConfig:
    master_server_address: str = ""
    global_segment_size: int = 0
    local_buffer_size: int = 0
    local_hostname: str = "127.0.0.1"
    metadata_server: str = ""
    protocol: str = "tcp"
    device_name: str = ""
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    # Only the path: the keys are read when a store connects, so loading a config touches no file.
    auth_dir: str = ""

    def __post_init__(self) -> None:
        self.global_segment_size = parse_size(self.global_segment_size, "global_segment_size")
        self.local_buffer_size = parse_size(self.local_buffer_size, "local_buffer_size")
        if self.auth_dir is None:
            self.auth_dir = ""
        for name in ("master_server_address", "local_hostname", "metadata_server", "protocol", "device_name",
                     "auth_dir"):
            if not isinstance(getattr(self, name), str):
                raise InvalidType(f"{name}: expected a string, got {describe(getattr(self, name))}")
        if self.master_server_address:
            host, port = parse_address(self.master_server_address, "master_server_address", default_port=50051)
            self.master_server_address = f"{host}:{port}"
        # A Mooncake hostname may carry a port ("host:12345"); the segment picks its own port.
        host, sep, port = self.local_hostname.rpartition(":")
        if sep and port.isdigit():
            self.local_hostname = host
        if isinstance(self.timeout_ms, str) and self.timeout_ms.strip().isdigit():
            self.timeout_ms = int(self.timeout_ms)
        if not isinstance(self.timeout_ms, int) or isinstance(self.timeout_ms, bool) or self.timeout_ms <= 0:
            raise ConfigError(f"timeout_ms: expected a positive integer, got {describe(self.timeout_ms)}")

    @property
    def master(self) -> str:
        return self.master_server_address

    @classmethod
    def from_mapping(cls, values: Mapping[str, object], source: str = "config") -> "StoreConfig":
        known = {f.name for f in fields(cls)}
        aliases = {"master": "master_server_address", "segment_size": "global_segment_size"}
        kwargs = {}
        for key, value in values.items():
            name = aliases.get(key, key)
            if name not in known:
                raise ConfigError(f"{source}: unknown field {key!r}; known fields: {sorted(known | set(aliases))}")
            kwargs[name] = value
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str) -> "StoreConfig":
        try:
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} does not exist") from None
        except ValueError as exc:
            raise ConfigError(f"config file {path!r} is not valid JSON: {exc}") from exc
        if not isinstance(values, dict):
            raise ConfigError(f"config file {path!r}: expected a JSON object, got {type(values).__name__}")
        return cls.from_mapping(values, source=f"config file {path!r}")

    @classmethod
    def load_from_env(cls, environ: Mapping[str, str] | None = None) -> "StoreConfig":
        """Read the JSON file named by ENGRAM_CONFIG_PATH / MOONCAKE_CONFIG_PATH, then the variables above."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for var in _CONFIG_PATH_ENV:
            if env.get(var):
                values.update(vars(cls.from_file(env[var])))
                break
        for name, variables in _ENV.items():
            for var in variables:
                if env.get(var):
                    values[name] = env[var]
                    break
        try:
            return cls.from_mapping(values, source="environment")
        except ConfigError as exc:
            raise ConfigError(f"{exc} (while reading {', '.join(v for vs in _ENV.values() for v in vs)})") from exc
