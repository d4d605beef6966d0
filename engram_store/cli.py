"""What every console script shares, for the other packages' scripts (``engram-master``, ``engram-demo``,
``engram-stats``, ``engram-warmup``, ``engram-load-v41``): one help style, one set of log levels, quiet pipes,
waits that speak, a server's open-files limit raised at start. Built in ``engram_store._cli``; this is the door the
other packages use.
"""

from __future__ import annotations

from ._cli import add_log_level, announce_after, non_negative, parser, raise_open_files_limit, run, setup_logging

__all__ = ["add_log_level", "announce_after", "non_negative", "parser", "raise_open_files_limit", "run",
           "setup_logging"]
