"""SGLang's general plugin (entry point group ``sglang.srt.plugins``, name ``engram``).

SGLang calls :func:`register` in its processes (the launching process, each scheduler; ``SGLANG_PLUGINS`` may leave
it out), then applies the hooks registered with its ``HookRegistry``. Without ``ENGRAM_TABLES`` it does nothing.
With it, the model families' hooks are registered (DeepSeek-V4.1: :mod:`engram_engines.v41._sglang`; they check the
tables and refuse a bad configuration where SGLang builds the Engram modules, since SGLang logs and swallows what a
plugin function raises), the server's metrics directory is made (first process), and the ``/metrics`` SGLang serves
(``--enable-metrics``: prometheus_client's multiprocess collector) gets engram's collector beside it.
"""

from __future__ import annotations

import logging
import os

from ._settings import TABLES, enabled
from ._stats import ensure_metrics_dir

log = logging.getLogger(__name__)

#: Where SGLang defines the function that mounts its /metrics (its hooks reach the modules that imported it).
METRICS_MOUNT = "sglang.srt.utils.common.add_prometheus_middleware"


def register() -> None:
    if not enabled():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from ._families import install

    install("sglang")
    ensure_metrics_dir()
    HookRegistry.register(METRICS_MOUNT, add_prometheus_middleware, HookType.REPLACE)
    log.info("engram: serving Engram tables from %s=%s", TABLES, os.environ[TABLES])


def add_prometheus_middleware(app) -> None:
    """SGLang's ``/metrics`` route with engram's collector in it (:func:`engram_engines._prometheus.mount_sglang`)."""
    from ._prometheus import mount_sglang

    mount_sglang(app)
