"""Parsing of byte sizes ("512MiB", "4GiB", "1.5 GB", 1048576) and host:port addresses, in one place."""

from __future__ import annotations

import re

from .errors import ConfigError, InvalidType, describe

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object, name: str = "size") -> int:
    """Parse a byte count: an int, or a string such as ``"512MiB"``, ``"4GiB"``, ``"1.5GB"``, ``"4096"``.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB) powers of 1000.
    """
    if isinstance(value, bool):
        raise InvalidType(f"{name}: expected a byte count (int or a string like '4GiB'), got {describe(value)}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}: expected a non-negative byte count, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if not isinstance(value, str):
        raise InvalidType(f"{name}: expected a byte count (int or a string like '4GiB'), got {describe(value)}")
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ConfigError(
            f"{name}: expected a byte count such as '512MiB', '4GiB' or '1048576', got {describe(value)}"
        )
    number = float(match.group(1)) * _UNITS[unit]
    if not number.is_integer():
        raise ConfigError(f"{name}: {describe(value)} is not a whole number of bytes")
    return int(number)


def format_size(n: int) -> str:
    """Render a byte count with a binary unit, e.g. ``1536 -> '1.5 KiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_address(value: object, name: str = "address", default_port: int | None = None) -> tuple[str, int]:
    """Parse ``"host:port"`` (or ``"tcp://host:port"``) into ``(host, port)``."""
    if not isinstance(value, str):
        raise InvalidType(f"{name}: expected 'host:port', got {describe(value)}")
    text = value.strip()
    if text.startswith("tcp://"):
        text = text[len("tcp://"):]
    host, sep, port_text = text.rpartition(":")
    if not sep:
        if default_port is None:
            raise ConfigError(f"{name}: expected 'host:port', got {describe(value)}")
        host, port_text = text, str(default_port)
    host = host.strip("[]")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"{name}: expected 'host:port' with a port in 1..65535, got {describe(value)}")
    return host, int(port_text)


def endpoint(host: str, port: int) -> str:
    """The ZeroMQ TCP endpoint for a host and port."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

__all__ = ["format_size", "parse_address", "parse_size"]
