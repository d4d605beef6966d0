"""Mooncake's ``ReplicateConfig`` and ``SoftPinAction``, and the checks Mooncake's master makes of them on a write.

Fields are typed as Mooncake's binding types them (assigning the wrong type raises ``TypeError``; unknown
attributes raise ``AttributeError``). At write time :func:`write_replicas` applies the checks Mooncake's
``PutStart``/``UpsertStart`` make, in its order, and returns the replica count this store honours; what this
store cannot do (NVMe-oF and DFS replicas, soft-pin lifetimes, preferred segments, groups) is refused or
accepted as Mooncake's wheel without those features would (see docs/mooncake-compat.md).
"""

from __future__ import annotations

import enum
from typing import Any, Callable

from ..errors import InvalidArgument, InvalidType, Unavailable, describe

#: Mooncake master's default ``max_kv_soft_pin_ttl``: an ``ENABLE`` with a longer ``soft_pin_ttl_ms`` is refused.
MAX_SOFT_PIN_TTL_MS = 24 * 60 * 60 * 1000
_UINT64_END = 1 << 64


class SoftPinAction(enum.Enum):
    """The soft-pin transition a write asks for: keep an existing deadline, start a lifetime, or drop it.

    Accepted and checked as Mooncake's master checks them; objects here are never evicted, so every object
    behaves as pinned whatever is asked.
    """

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2

    def __int__(self) -> int:
        return self.value


class DfsUnavailable(Unavailable):
    """A write asked for a DFS replica: this store has no shared-filesystem tier (Mooncake's code -1601)."""


def _uint(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _UINT64_END:
        raise InvalidType(f"{name}: expected an integer in [0, 2**64), got {describe(value)}")
    return value


def _optional_uint(name: str, value: Any) -> int | None:
    return None if value is None else _uint(name, value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidType(f"{name}: expected True or False, got {describe(value)}")
    return value


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidType(f"{name}: expected a string, got {describe(value)}")
    return value


def _strings(name: str, value: Any) -> list[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) \
            or not all(isinstance(v, str) for v in value):
        raise InvalidType(f"{name}: expected a list of strings, got {describe(value)}")
    return list(value)


def _optional_strings(name: str, value: Any) -> list[str] | None:
    return None if value is None else _strings(name, value)


def _action(name: str, value: Any) -> SoftPinAction:
    if not isinstance(value, SoftPinAction):
        raise InvalidType(f"{name}: expected a SoftPinAction (PRESERVE, ENABLE or DISABLE), got {describe(value)}")
    return value


#: field -> (check on assignment, default factory), in Mooncake's order.
_FIELDS: dict[str, tuple[Callable[[str, Any], Any], Callable[[], Any]]] = {
    "replica_num": (_uint, lambda: 1),
    "nof_replica_num": (_uint, lambda: 0),
    "dfs_replica_num": (_uint, lambda: 0),
    "soft_pin_action": (_action, lambda: SoftPinAction.PRESERVE),
    "soft_pin_ttl_ms": (_optional_uint, lambda: None),
    "with_hard_pin": (_bool, lambda: False),
    "preferred_segments": (_strings, list),
    "preferred_segment": (_str, str),
    "preferred_nof_segments": (_strings, list),
    "prefer_alloc_in_same_node": (_bool, lambda: False),
    "group_ids": (_optional_strings, lambda: None),
}


class ReplicateConfig:
    """Mooncake's replication settings for a write. ``replica_num`` copies go to distinct segments.

    Every field of Mooncake's is here with its default and type; ``with_soft_pin`` (Mooncake's older flag) is
    kept as ``soft_pin_action == ENABLE``. Objects here are never evicted, so ``with_hard_pin`` and soft pins
    change nothing; placement is the master's, so preferred segments are accepted and not followed.
    """

    __slots__ = tuple(_FIELDS)

    def __init__(self, replica_num: int = 1):
        for name, (_, default) in _FIELDS.items():
            object.__setattr__(self, name, default())
        self.replica_num = replica_num

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "with_soft_pin":
            self.soft_pin_action = SoftPinAction.ENABLE if _bool(name, value) else SoftPinAction.PRESERVE
            return
        if name not in _FIELDS:
            raise AttributeError(f"'ReplicateConfig' object has no attribute {name!r}")
        object.__setattr__(self, name, _FIELDS[name][0](name, value))

    @property
    def with_soft_pin(self) -> bool:
        return self.soft_pin_action is SoftPinAction.ENABLE

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else str(self.soft_pin_ttl_ms)
        text = (f"ReplicateConfig: {{ replica_num: {self.replica_num}, nof_replica_num: {self.nof_replica_num}, "
                f"dfs_replica_num: {self.dfs_replica_num}, soft_pin_action: {self.soft_pin_action.name}, "
                f"soft_pin_ttl_ms: {ttl}, with_hard_pin: {int(self.with_hard_pin)}, "
                f"preferred_segments: [{', '.join(self.preferred_segments)}]")
        if self.preferred_segment:
            text += f", preferred_segment (deprecated): {self.preferred_segment}"
        text += (f", preferred_nof_segments: [{', '.join(self.preferred_nof_segments)}], "
                 f"prefer_alloc_in_same_node: {int(self.prefer_alloc_in_same_node)}")
        if self.group_ids is not None:
            text += f", group_ids: [{', '.join(self.group_ids)}]"
        return text + " }"

    __repr__ = __str__


def write_replicas(config: Any, keys: int, staged: bool) -> int:
    """The replica count a write with ``config`` (None: defaults) stores, after Mooncake's checks of it.

    ``keys``: how many objects the call writes (``group_ids`` must name one group per key); ``staged``: the call
    copies through the local buffer (``put``, ``upsert``...), where Mooncake refuses ``prefer_alloc_in_same_node``.
    Raises InvalidArgument (Mooncake's -600) or DfsUnavailable (-1601) as Mooncake's master would.
    """
    if config is None:
        return 1
    if not isinstance(config, ReplicateConfig):
        raise InvalidType(f"config: expected a ReplicateConfig or None, got {describe(config)}")
    if staged and config.prefer_alloc_in_same_node:
        raise InvalidArgument("config.prefer_alloc_in_same_node: not supported by put/upsert from Python bytes "
                              "(as in Mooncake); expected False, got True")
    if config.replica_num == 0 and config.nof_replica_num == 0 and config.dfs_replica_num == 0:
        raise InvalidArgument("config.replica_num: expected at least one replica, got 0 (and no NoF or DFS replica)")
    if config.dfs_replica_num > 1 or (config.dfs_replica_num and config.replica_num == 0):
        raise InvalidArgument(f"config.dfs_replica_num: expected 0, or 1 with replica_num >= 1; got "
                              f"{config.dfs_replica_num} with replica_num {config.replica_num}")
    if config.dfs_replica_num:
        raise DfsUnavailable("config.dfs_replica_num: this store has no DFS tier; expected 0, got 1")
    if config.nof_replica_num:
        raise InvalidArgument(f"config.nof_replica_num: this store has no NVMe-oF pool (as a Mooncake wheel built "
                              f"without it); expected 0, got {config.nof_replica_num}")
    ttl = config.soft_pin_ttl_ms
    if ttl is not None and config.soft_pin_action is not SoftPinAction.ENABLE:
        raise InvalidArgument(f"config.soft_pin_ttl_ms: only valid with soft_pin_action ENABLE; got {ttl} with "
                              f"{config.soft_pin_action.name}")
    if ttl is not None and ttl > MAX_SOFT_PIN_TTL_MS:
        raise InvalidArgument(f"config.soft_pin_ttl_ms: expected at most {MAX_SOFT_PIN_TTL_MS} (Mooncake's "
                              f"max_kv_soft_pin_ttl), got {ttl}")
    if config.group_ids is not None and len(config.group_ids) != keys:
        raise InvalidArgument(f"config.group_ids: expected {keys} group id(s), one per key, got "
                              f"{len(config.group_ids)}")
    return config.replica_num
