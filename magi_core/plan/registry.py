"""Policy name -> scheduler factory: the built-ins, :func:`register_policy`, and the ``magi.policies`` entry points.

A plugin package adds a policy with an entry point whose object is a scheduler class (or any callable
returning an object with ``plan(profiles, bandwidth_Bps, config) -> Plan``)::

    [project.entry-points."magi.policies"]
    my_policy = "my_package.schedulers:MyScheduler"

Policy names are case-insensitive (stored upper-case; :func:`magi_core.config.normalize_policy`).
:func:`build_plan` plans with the config's policy; :func:`check_policy` checks a name early.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import importlib_metadata

from magi_core.config import OffloadConfig, Policy, normalize_policy, use_policy_names
from magi_core.errors import ConfigError
from magi_core.plan.contract import Plan, UnitProfile
from magi_core.plan.heuristic import HeuristicScheduler
from magi_core.plan.lookahead import BaseScheduler, CostEffectiveScheduler

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


def _key(name: Policy | str) -> str:
    return str(normalize_policy(name))


def register_policy(name: str, factory: SchedulerFactory, replace: bool = False) -> None:
    """Register ``factory`` (a scheduler class or zero-argument callable) under policy ``name``."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError("register_policy: the policy name must not be empty")
    key = _key(name)
    if not callable(factory):
        raise ConfigError(f"register_policy({name!r}): factory must be a scheduler class or a callable returning one")
    with _lock:
        if not replace and (key in _BUILTIN or key in _registered):
            raise ConfigError(f"policy {key!r} is already registered; pass replace=True to override it")
        _registered[key] = factory


def unregister_policy(name: str) -> None:
    """Remove a policy added with :func:`register_policy` (built-ins cannot be removed)."""
    with _lock:
        _registered.pop(_key(name), None)


def _discover() -> dict[str, SchedulerFactory]:
    global _discovered
    with _lock:
        if _discovered is None:
            found: dict[str, SchedulerFactory] = {}
            _load_errors.clear()
            for ep in importlib_metadata.entry_points(group=POLICY_ENTRY_POINT_GROUP):
                key = _key(ep.name)
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


def _unknown(policy: Policy | str, key: str, error: str | None) -> ConfigError:
    hint = f" (its entry point failed to load: {error})" if error else ""
    return ConfigError(
        f"unknown offload policy {str(policy)!r}{hint}; known policies: {', '.join(known_policies())}. "
        f"Plugins add policies with magi_core.plan.register_policy({key.lower()!r}, SchedulerClass) or an "
        f"entry point in the {POLICY_ENTRY_POINT_GROUP!r} group"
    )


def _factory(policy: Policy | str) -> SchedulerFactory:
    key = _key(policy)
    with _lock:
        factory = _registered.get(key) or _BUILTIN.get(key) or _discover().get(key)
        error = _load_errors.get(key)
    if factory is None:
        raise _unknown(policy, key, error)
    return factory


def check_policy(policy: Policy | str) -> str:
    """The canonical name of ``policy`` when a scheduler can be made for it; else :class:`ConfigError`.

    Raises listing the known policies and how to register one. Called early by :func:`magi_core.offload`,
    :func:`magi_core.api.compile_offloaded` and the ``magi_offload`` backend, so a typo fails before any work.
    """
    _factory(policy)
    return _key(policy)


def get_scheduler(policy: Policy | str) -> Scheduler:
    """A new scheduler for ``policy`` (any case); unknown names raise :class:`ConfigError` listing known ones."""
    factory = _factory(policy)
    scheduler = factory()
    if not callable(getattr(scheduler, "plan", None)):
        raise ConfigError(f"policy {_key(policy)!r}: {factory!r} did not return an object with a plan() method")
    return scheduler


def build_plan(profiles: Sequence[UnitProfile], bandwidth_Bps: float, config: OffloadConfig) -> Plan:
    """Plan with ``config.policy`` from profiles (execution order) and the *measured* bandwidth in bytes/s.

    The scheduler applies ``config.bandwidth_safety_factor``; the returned plan is validated.
    """
    plan = get_scheduler(config.policy).plan(list(profiles), bandwidth_Bps, config)
    plan.validate(profiles)
    return plan


use_policy_names(lambda: known_policies())  # configs check plugin policy names on construction
