"""Files engram keeps in a directory a flag or an argument names, for the other packages (the master's journal, what
a model saves): the directory held open and checked, files made exclusively and never through a link, files
replaced whole through a private temporary, one owner per file. Built in ``engram_store._durable``; this is the door
the other packages use.
"""

from __future__ import annotations

from ._durable import DurableDir, HeldDir, HeldLock, write_replacing

__all__ = ["DurableDir", "HeldDir", "HeldLock", "write_replacing"]
