"""A directory of layers resolved one component at a time (``_layer_dir.resolve_dir``, ``check_dir``) under Ctrl-C:
whichever descriptor close the interrupt follows, it propagates as KeyboardInterrupt and no descriptor is closed twice
(a second close of a number another thread has taken since closes that thread's file). The explorer's SIGINT to a
client opening a ``disk_dir`` found the walk up through ``..`` closing one twice: a raw ``OSError: [Errno 9]``."""
from __future__ import annotations

import os

import pytest

from engram_store import _layer_dir


@pytest.mark.parametrize("nth", range(1, 12))
def test_an_interrupt_after_any_close_of_the_walk_closes_nothing_twice(tmp_path, monkeypatch, nth):
    deep = tmp_path / "a" / "b" / "layers"
    deep.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a")  # (an absolute link restarts the walk from /)
    real_open, real_close = os.open, os.close
    live: set[int] = set()   # descriptors the walk opened and has not closed
    twice: list[int] = []    # closes of a descriptor the walk had closed already
    closes = 0

    def open_(*args, **kwargs) -> int:
        fd = real_open(*args, **kwargs)
        live.add(fd)
        return fd

    def close(fd: int) -> None:
        nonlocal closes
        if fd not in live:
            twice.append(fd)
        live.discard(fd)
        real_close(fd)
        closes += 1
        if closes == nth:
            raise KeyboardInterrupt

    monkeypatch.setattr(_layer_dir.os, "open", open_)
    monkeypatch.setattr(_layer_dir.os, "close", close)
    try:
        _layer_dir.LayerDir(str(tmp_path / "link" / "b" / "layers"), "disk_dir").close()
    except KeyboardInterrupt:
        pass
    finally:
        monkeypatch.undo()
        for fd in live:  # (what an interrupt leaked: one descriptor at most)
            real_close(fd)
    assert not twice, f"descriptors closed twice: {twice} (an interrupt after close {nth})"
    assert len(live) <= 2, f"descriptors left open by an interrupt after close {nth}: {sorted(live)}"
