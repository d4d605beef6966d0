"""The engram metadata master: segments, object placement, leases, heartbeats and an optional journal."""

from ._allocator import ALIGNMENT, FreeListAllocator
from ._config import DEFAULT_PORT, MasterConfig
from ._journal import Journal
from ._service import MasterServer
from ._state import MasterState

__all__ = ["ALIGNMENT", "DEFAULT_PORT", "FreeListAllocator", "Journal", "MasterConfig", "MasterServer", "MasterState"]
