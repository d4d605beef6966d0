"""vLLM's general plugin (entry point group ``vllm.general_plugins``, name ``engram``).

vLLM calls :func:`register` in every process (argument parsing, the API server, the engine core, every worker;
``VLLM_PLUGINS`` may leave it out). Without ``ENGRAM_TABLES`` it does nothing. With it:

* the model families' patches are installed, each when vLLM imports the module it patches (DeepSeek-V4.1:
  :mod:`engram_engines.v41._vllm`); they check the tables and refuse a bad configuration where vLLM builds the
  Engram modules, since vLLM logs and swallows what a plugin function raises;
* the server's metrics directory is made (first process) and the registry vLLM serves ``/metrics`` from gets
  engram's collector (:mod:`engram_engines._prometheus`).
"""

from __future__ import annotations

import logging
import os

from ._imports import when_imported
from ._settings import TABLES, enabled
from ._stats import ensure_metrics_dir

log = logging.getLogger(__name__)

#: The modules whose ``get_prometheus_registry`` gives the registry vLLM serves (its home, and the router that
#: imported the name).
METRICS_MODULES = ("vllm.v1.metrics.prometheus", "vllm.entrypoints.serve.instrumentator.metrics")


def register() -> None:
    if not enabled():
        return
    from ._families import install

    install("vllm")
    ensure_metrics_dir()
    for name in METRICS_MODULES:
        when_imported(name, _patch_registry)
    log.info("engram: serving Engram tables from %s=%s", TABLES, os.environ[TABLES])


def _patch_registry(module) -> None:
    """vLLM's ``get_prometheus_registry()`` returns the registry its ``/metrics`` serves: add engram's collector."""
    original = getattr(module, "get_prometheus_registry", None)
    if original is None or getattr(original, "_engram", False):
        return

    def get_prometheus_registry():
        registry = original()
        try:
            from ._prometheus import register as register_collector

            register_collector(registry)
        except ImportError:  # prometheus_client is vLLM's dependency; never stop a server over metrics
            log.warning("engram: prometheus_client is not importable; no engram metrics on /metrics")
        return registry

    get_prometheus_registry._engram = True
    module.get_prometheus_registry = get_prometheus_registry
