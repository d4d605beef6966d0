"""The engram metadata master: segments, object placement, leases, heartbeats and an optional journal."""

from ._allocator import ALIGNMENT, FreeListAllocator
from ._journal import Journal
from ._service import DEFAULT_PORT, MasterServer
from ._state import MasterState

__all__ = ["ALIGNMENT", "DEFAULT_PORT", "FreeListAllocator", "Journal", "MasterServer", "MasterState"]
