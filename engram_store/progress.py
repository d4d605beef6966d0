"""A minimal progress bar on stderr, shown only when stderr is a terminal."""

from __future__ import annotations

import sys
import time

from .units import format_size


class Progress:
    """Call with the bytes done so far; prints at most ~10 updates a second; ``close()`` ends the line."""

    def __init__(self, total: int, label: str, enabled: bool | None = None, stream=None):
        self.stream = stream or sys.stderr
        self.total = max(total, 1)
        self.label = label
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._start = time.monotonic()
        self._last = 0.0
        self._done = 0

    def __call__(self, done: int) -> None:
        self._done = done
        now = time.monotonic()
        if self.enabled and (now - self._last >= 0.1 or done >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self._done / self.total, 1.0)
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        rate = self._done / max(now - self._start, 1e-9)
        self.stream.write(f"\r{self.label} [{bar}] {frac * 100:5.1f}% "
                          f"{format_size(self._done)}/{format_size(self.total)} {format_size(int(rate))}/s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

__all__ = ["Progress"]
