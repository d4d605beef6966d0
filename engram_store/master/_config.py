"""What a master is started with: one validated record that the CLI and Python callers fill alike."""

from __future__ import annotations

from dataclasses import dataclass

from engram_store.errors import InvalidArgument, is_int

DEFAULT_PORT = 50051
DEFAULT_LEASE_TTL_S = 5.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
#: Removed objects' space is reused only after this long (see MasterState.reuse_delay_s). Reads never depend on it
#: for correctness (segments check what they serve); clients that map a segment read in place without asking it
#: only within half of it.
DEFAULT_REUSE_DELAY_S = 2.0
#: A pending put whose writer has not renewed it for this long is fenced (``engram-master --put-timeout``).
DEFAULT_PUT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class MasterConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S        # how long a read lease holds off a remove
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S  # a segment silent this long (master running) is dead
    journal_path: str | None = None                 # append every durable change here; replayed at start
    journal_fsync: bool = True                      # fsync each record (off: faster, loses the last on a crash)
    metrics_port: int | None = None                 # serve Prometheus metrics on this port
    metrics_host: str = "127.0.0.1"                 # ... bound here: plain HTTP, readable by whoever reaches it
    metrics_addresses: bool = False                 # label segments' series with their addresses (else ids only)
    reuse_delay_s: float = DEFAULT_REUSE_DELAY_S
    re_replicate: bool = False                      # copy objects that lost a replica onto another segment
    put_timeout_s: float = DEFAULT_PUT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise InvalidArgument(f"host: expected an address to bind, got {self.host!r}")
        if not is_int(self.port) or not 0 <= self.port < 65536:
            raise InvalidArgument(f"port: expected an integer in [0, 65535], got {self.port!r}")
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise InvalidArgument(f"metrics_host: expected an address to bind, got {self.metrics_host!r}")
        if self.metrics_port is not None and (not is_int(self.metrics_port) or not 0 <= self.metrics_port < 65536):
            raise InvalidArgument(f"metrics_port: expected an integer in [0, 65535] or None, got {self.metrics_port!r}")
        for name in ("lease_ttl_s", "heartbeat_timeout_s", "put_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name}: expected > 0, got {getattr(self, name)}")
        if not self.reuse_delay_s >= 0:
            raise InvalidArgument(f"reuse_delay_s: expected >= 0, got {self.reuse_delay_s}")
