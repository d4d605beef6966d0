"""Pages of memory, for the other packages: ``trim_heap`` hands freed heap pages back to the OS (the master, after a
burst of large messages). Built in ``engram_store._pages``; this is the door the other packages use.
"""

from __future__ import annotations

from ._pages import trim_heap

__all__ = ["trim_heap"]
