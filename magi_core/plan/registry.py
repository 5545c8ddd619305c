"""Policy name -> scheduler factory: the built-ins, :func:`register_policy`, and the ``magi.policies`` entry points.

A plugin package adds a policy with an entry point whose object is a scheduler class (or any callable
returning an object with ``plan(profiles, bandwidth_Bps, config) -> Plan``)::

    [project.entry-points."magi.policies"]
    my_policy = "my_package.schedulers:MyScheduler"

Policy names are case-insensitive (stored upper-case).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import importlib_metadata

from magi_core.errors import ConfigError
from magi_core.plan.contract import Plan, UnitProfile
from magi_core.plan.heuristic import HeuristicScheduler
from magi_core.plan.lookahead import BaseScheduler, CostEffectiveScheduler

if TYPE_CHECKING:
    from magi_core.config import OffloadConfig

logger = logging.getLogger(__name__)

POLICY_ENTRY_POINT_GROUP = "magi.policies"


@runtime_checkable
class Scheduler(Protocol):
    """What a policy provides: pure planning from profiles, measured bandwidth (bytes/s) and the config."""

    def plan(self, profiles: Sequence[UnitProfile], bandwidth_Bps: float, config: OffloadConfig) -> Plan:
        """Return the static plan; apply ``config.bandwidth_safety_factor`` to ``bandwidth_Bps``."""
        ...


SchedulerFactory = Callable[[], Scheduler]

_BUILTIN: dict[str, SchedulerFactory] = {
    "BASE": BaseScheduler,
    "COST_EFFECTIVE": CostEffectiveScheduler,
    "HEURISTIC": HeuristicScheduler,
}
_lock = threading.RLock()
_registered: dict[str, SchedulerFactory] = {}
_discovered: dict[str, SchedulerFactory] | None = None
_load_errors: dict[str, str] = {}


def policy_key(name: str) -> str:
    """The canonical (upper-case) form of a policy name."""
    return name.strip().upper().replace("-", "_")


def register_policy(name: str, factory: SchedulerFactory, replace: bool = False) -> None:
    """Register ``factory`` (a scheduler class or zero-argument callable) under policy ``name``."""
    key = policy_key(name)
    if not key:
        raise ConfigError("register_policy: the policy name must not be empty")
    if not callable(factory):
        raise ConfigError(f"register_policy({name!r}): factory must be a scheduler class or a callable returning one")
    with _lock:
        if not replace and (key in _BUILTIN or key in _registered):
            raise ConfigError(f"policy {key!r} is already registered; pass replace=True to override it")
        _registered[key] = factory


def unregister_policy(name: str) -> None:
    """Remove a policy added with :func:`register_policy` (built-ins cannot be removed)."""
    with _lock:
        _registered.pop(policy_key(name), None)


def _discover() -> dict[str, SchedulerFactory]:
    global _discovered
    with _lock:
        if _discovered is None:
            found: dict[str, SchedulerFactory] = {}
            _load_errors.clear()
            for ep in importlib_metadata.entry_points(group=POLICY_ENTRY_POINT_GROUP):
                key = policy_key(ep.name)
                try:
                    obj = ep.load()
                except Exception as exc:  # reported in the log and when the policy is asked for
                    _load_errors[key] = f"{type(exc).__name__}: {exc}"
                    logger.error("magi policy %r (%s) failed to load: %s", ep.name, ep.value, exc)
                    continue
                if not callable(obj):
                    _load_errors[key] = f"{ep.value} is not a scheduler class or factory"
                    logger.error("magi policy %r: %s", ep.name, _load_errors[key])
                    continue
                found.setdefault(key, obj)
            _discovered = found
        return _discovered


def reload_policies() -> None:
    """Forget discovered entry-point policies; the next lookup scans ``magi.policies`` again."""
    global _discovered
    with _lock:
        _discovered = None


def known_policies() -> tuple[str, ...]:
    """Every policy name that can be used now: built-ins, registered, and loaded entry points."""
    with _lock:
        return tuple(dict.fromkeys([*_BUILTIN, *_registered, *_discover()]))


def get_scheduler(policy: str) -> Scheduler:
    """A new scheduler for ``policy`` (any case); unknown names raise :class:`ConfigError` listing known ones."""
    key = policy_key(str(policy))
    with _lock:
        factory = _registered.get(key) or _BUILTIN.get(key) or _discover().get(key)
        error = _load_errors.get(key)
    if factory is None:
        hint = f" (its entry point failed to load: {error})" if error else ""
        raise ConfigError(f"unknown offload policy {policy!r}{hint}; known policies: {', '.join(known_policies())}")
    scheduler = factory()
    if not callable(getattr(scheduler, "plan", None)):
        raise ConfigError(f"policy {key!r}: {factory!r} did not return an object with a plan() method")
    return scheduler
