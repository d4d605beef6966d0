"""What the serving engines' plugins read from the environment, parsed once, and the refusal they raise.

The plugins do nothing unless ``ENGRAM_TABLES`` is set (installing engram changes no engine by itself). Every other
variable has a default; each is documented in docs/engines.md::

    ENGRAM_TABLES       a directory engram-load-v41 wrote (--local-dir: files in memory; --disk-dir: on SSD)
    ENGRAM_ROW_CACHE    bytes of hot rows kept in memory for a disk_dir (default 4GiB; "0" for none)
    ENGRAM_CACHE_SCOPE  host (one cache in shared memory for every process of the host, the default) or process
    ENGRAM_THREADS      threads of a prefill's gather from memory (default: the host's CPUs, at most 16)
    ENGRAM_DEVICE_READ  auto (default: a GPU reads local_dir tables in place, through UVA) or host (the host
                        gathers every step's rows into pinned memory, then copies them)

A value that does not parse raises :class:`ServingRefused` naming the variable, the value and what was expected.
The engines' plugin loaders log and swallow what a plugin function raises, so the plugins parse these where the
engine builds its Engram modules: a bad value stops the server at start, never at the first request.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from engram_store.errors import ConfigError, EngramError
from engram_store.units import parse_size

TABLES = "ENGRAM_TABLES"
ROW_CACHE = "ENGRAM_ROW_CACHE"
CACHE_SCOPE = "ENGRAM_CACHE_SCOPE"
THREADS = "ENGRAM_THREADS"
DEVICE_READ = "ENGRAM_DEVICE_READ"
#: Every variable the plugins read, with its default (None: required to act at all).
VARIABLES = {TABLES: None, ROW_CACHE: "4GiB", CACHE_SCOPE: "host", THREADS: None, DEVICE_READ: "auto"}
SCOPES = ("host", "process")
DEVICE_READS = ("auto", "host")
MAX_THREADS = 16


class ServingRefused(ConfigError):
    """An engine cannot be served from the engram tables as configured: a variable that does not parse, a table
    directory that lacks the model's layers or disagrees with its config.json, or an engine setting the tables
    cannot serve. Raised where the engine builds its Engram modules, so the server stops at start."""


def refused(name: str, value: object, why: str) -> ServingRefused:
    """The refusal of variable ``name`` set to ``value``, saying what was found or expected."""
    return ServingRefused(f"{name}={value}: {why}")


@dataclass(frozen=True)
class EngineSettings:
    """The plugins' settings (see the module docstring); :func:`settings_from_env` builds them."""

    tables: str               # the table directory, absolute
    row_cache_bytes: int      # hot rows of a disk_dir kept in memory
    cache_scope: str          # "host" or "process"
    threads: int              # threads of a large gather from memory
    device_read: str          # "auto" or "host"


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``ENGRAM_TABLES`` asks the plugins to act (set and not empty)."""
    return bool((os.environ if environ is None else environ).get(TABLES, "").strip())


def settings_from_env(environ: Mapping[str, str] | None = None) -> EngineSettings | None:
    """The settings of ``environ`` (default ``os.environ``), or None when ``ENGRAM_TABLES`` is not set. Raises
    :class:`ServingRefused` for a value that does not parse."""
    env = os.environ if environ is None else environ
    if not enabled(env):
        return None
    tables = env[TABLES].strip()
    if not os.path.isdir(tables):
        why = "not a directory" if os.path.exists(tables) else "no such directory"
        raise refused(TABLES, tables, f"expected the directory engram-load-v41 wrote its tables into (--local-dir "
                                      f"or --disk-dir), found {why}")
    return EngineSettings(os.path.abspath(tables), _row_cache(env), _choice(env, CACHE_SCOPE, SCOPES),
                          _threads(env), _choice(env, DEVICE_READ, DEVICE_READS))


def _value(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "").strip()
    return value if value else str(VARIABLES[name])


def _row_cache(env: Mapping[str, str]) -> int:
    value = _value(env, ROW_CACHE)
    try:
        return parse_size(value, ROW_CACHE)
    except EngramError:
        raise refused(ROW_CACHE, value, "expected a byte count such as 512MiB, 4GiB or 0") from None


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    value = _value(env, name)
    if value.lower() not in choices:
        raise refused(name, value, f"expected one of {', '.join(choices)}")
    return value.lower()


def _threads(env: Mapping[str, str]) -> int:
    value = env.get(THREADS, "").strip()
    if not value:
        return min(MAX_THREADS, os.cpu_count() or 1)
    if not value.isdigit() or not 1 <= int(value) <= 256:
        raise refused(THREADS, value, "expected an integer from 1 to 256")
    return int(value)
