"""The progress bar of long loads, for the other packages (a V4.1 checkpoint's tables streamed into a store).
Built in ``engram_store._progress``; this is the door the other packages use.
"""

from __future__ import annotations

from ._progress import Progress

__all__ = ["Progress"]
