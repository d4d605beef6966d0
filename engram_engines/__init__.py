"""engram_engines: serving engines (vLLM, SGLang) read their models' Engram tables through engram, as plugins.

Installing engram registers two entry points: ``vllm.general_plugins`` -> :func:`engram_engines.vllm.register`
and ``sglang.srt.plugins`` -> :func:`engram_engines.sglang.register`. Both do nothing unless ``ENGRAM_TABLES``
names a table directory that ``engram-load-v41`` wrote (docs/engines.md is the guide). Shared by every model
family (DeepSeek-V4.1 now, in :mod:`engram_engines.v41`)::

    EngineSettings, settings_from_env   the documented variables (ENGRAM_TABLES, ENGRAM_ROW_CACHE, ...) parsed once
    ServingRefused                      a configuration the tables cannot serve, refused at start by name
    TableDir, table_dir                 the table directory: its kind (local_dir, disk_dir), its layers, each opened
                                        once per process
    GatherStats, STATS                  gathers counted and timed per layer, form and tier (for /metrics)
    StepGathers                         a step's per-layer gathers on one worker thread, the first layer first

What is family-specific (which engine classes to patch, the checks of a table's layout against the model's
config.json) lives in the family's subpackage, listed in ``engram_engines._families``; ``engram_engines._prometheus``
is the collector the engines' ``/metrics`` include (the one module that imports ``prometheus_client``).
"""

from ._pipeline import StepGathers
from ._settings import VARIABLES, EngineSettings, ServingRefused, enabled, settings_from_env
from ._stats import STATS, GatherStats
from ._tables import TableDir, table_dir

__all__ = [
    "EngineSettings",
    "GatherStats",
    "STATS",
    "ServingRefused",
    "StepGathers",
    "TableDir",
    "VARIABLES",
    "enabled",
    "settings_from_env",
    "table_dir",
]
