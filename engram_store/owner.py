"""One owner per durable file, for the other packages (the master's journal): an exclusive ``flock`` on
``<path>.lock`` that names its holder. Built in ``engram_store._owner``; this is the door the other packages use.
"""

from __future__ import annotations

from ._owner import FileInUse, OwnerLock

__all__ = ["FileInUse", "OwnerLock"]
