"""The model families the plugins serve, and where each keeps its engines' patches.

A family is a subpackage with ``_vllm.install()`` and ``_sglang.install()``: what is particular to its tables (the
checks of a layout against its config.json) and to the engine classes it patches. Everything else (the variables,
the table directory, the step pipeline, metrics, refusals) is shared. Each install is lazy: it patches an engine's
module only once the engine imports it, so a family whose model is not served costs nothing.
"""

from __future__ import annotations

import importlib

#: Family name -> its subpackage. Qwen4-Exp's PLE table joins here with its own subpackage.
FAMILIES = {"DeepSeek-V4.1": "engram_engines.v41"}


def install(engine: str) -> None:
    """Install every family's patches of ``engine`` (``"vllm"`` or ``"sglang"``)."""
    for package in FAMILIES.values():
        importlib.import_module(f"{package}._{engine}").install()
