"""Byte sizes and host:port addresses, for the other packages: parsed and printed as the store does
(``engram_store._units``), so every script reads "4GiB" and writes "1.5 GiB" the same way.
"""

from __future__ import annotations

from ._units import format_size, parse_address, parse_size

__all__ = ["format_size", "parse_address", "parse_size"]
