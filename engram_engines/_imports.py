"""Run a function right after a module is imported (or now, if it already is).

A plugin patches an engine's classes; importing the engine's model code itself at plugin load would load it (and
what it imports: CUDA, kernels) in processes that never build a model, such as vLLM's API server. A finder ahead
of the others on ``sys.meta_path`` lets the import happen as the engine asks for it, then calls the patch.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Callable

_PENDING: dict[str, list[Callable[[object], None]]] = {}
_LOCK = threading.Lock()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, name)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, loader, name: str):
        self.loader, self.name = loader, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        with _LOCK:
            callbacks = _PENDING.pop(self.name, [])
        for callback in callbacks:
            callback(module)


_FINDER = _Finder()


def when_imported(name: str, callback: Callable[[object], None]) -> None:
    """Call ``callback(module)`` once module ``name`` is imported: now if it is, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    with _LOCK:
        _PENDING.setdefault(name, []).append(callback)
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
