"""Backend discovery (entry points ``magi.backends``), selection and the active :class:`Backend` facade."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import importlib_metadata
import pluggy
import torch

from magi_core import hookspecs
from magi_core.backend import Backend
from magi_core.errors import BackendError
from magi_core.hookspecs import HOOKSPEC_VERSION, REQUIRED_HOOKS, ProbeResult

logger = logging.getLogger(__name__)

from magi_core.plugin import ENTRY_POINT_GROUP
ENV_BACKEND = "MAGI_BACKEND"
ENV_TRACE = "MAGI_TRACE_HOOKS"
OPTIONAL_HOOKS = ("magi_range_push", "magi_range_pop", "magi_to_method_aliases")


def package_hint(device_type: str) -> str:
    """The pip package that conventionally serves ``device_type``."""
    return f"magi-backend-{device_type}"


@dataclass
class BackendRecord:
    """One discovered backend: where it came from, what its probe said, and what is wrong with it."""

    name: str
    entry_point: str
    package: str
    package_version: str
    plugin: Any = None
    load_error: BaseException | None = None
    probe: ProbeResult | None = None
    probe_error: BaseException | None = None
    spec_versions: tuple[str, ...] = ()
    missing_required: tuple[str, ...] = ()
    missing_optional: tuple[str, ...] = ()
    callers: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def available(self) -> bool:
        """True when the backend loaded, probed without error and reports its hardware present."""
        return self.problem is None and self.probe is not None and self.probe.available

    @property
    def problem(self) -> str | None:
        """Why this backend cannot be used at all (load, probe, hooks or version), or None."""
        if self.load_error is not None:
            return f"import failed: {type(self.load_error).__name__}: {self.load_error}"
        if self.missing_required:
            return f"missing required hook(s): {', '.join(self.missing_required)}"
        if self.probe_error is not None:
            return f"probe raised {type(self.probe_error).__name__}: {self.probe_error}"
        major = HOOKSPEC_VERSION.split(".")[0]
        if major not in self.spec_versions:
            return (
                f"supports hook-spec version(s) {', '.join(self.spec_versions) or 'none'} but magi-core "
                f"publishes {HOOKSPEC_VERSION}; install a {self.package} release for spec {major}"
                " or a magi-core matching the backend"
            )
        return None

    @property
    def why_unavailable(self) -> str | None:
        """Human-readable reason this backend is not available, or None when it is."""
        if self.problem is not None:
            return self.problem
        assert self.probe is not None
        return None if self.probe.available else (self.probe.reason or "probe reported unavailable")

    def call(self, hook: str, **kwargs: Any) -> Any:
        """Call ``hook`` on this backend only."""
        return self.callers[hook](**kwargs)


class Registry:
    """Discovers backends lazily, selects one, and hands out the :class:`Backend` facade."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._pm: pluggy.PluginManager | None = None
        self._records: dict[str, BackendRecord] | None = None
        self._explicit: str | None = None
        self._active: Backend | None = None

    # -- discovery -----------------------------------------------------------------------------
    def _manager(self) -> pluggy.PluginManager:
        if self._pm is None:
            pm = pluggy.PluginManager(hookspecs.PROJECT)
            pm.add_hookspecs(hookspecs)
            if os.environ.get(ENV_TRACE, "") not in ("", "0"):
                pm.trace.root.setwriter(lambda msg: logger.info("hook %s", msg.rstrip()))
                pm.enable_tracing()
            self._pm = pm
        return self._pm

    def records(self) -> dict[str, BackendRecord]:
        """Every backend found under the ``magi.backends`` entry-point group, loaded and probed once."""
        with self._lock:
            if self._records is None:
                self._records = self._discover()
            return self._records

    def _discover(self) -> dict[str, BackendRecord]:
        pm = self._manager()
        records: dict[str, BackendRecord] = {}
        for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist
            rec = BackendRecord(
                name=ep.name,
                entry_point=ep.value,
                package=dist.metadata["Name"] if dist is not None else "?",
                package_version=dist.version if dist is not None else "?",
            )
            if ep.name in records:
                if records[ep.name].entry_point == ep.value:
                    continue
                raise BackendError(
                    f"two packages register the backend name {ep.name!r}: {records[ep.name].package} "
                    f"({records[ep.name].entry_point}) and {rec.package} ({ep.value}); uninstall one"
                )
            records[ep.name] = rec
            try:
                rec.plugin = ep.load()
                pm.register(rec.plugin, name=ep.name)
            except Exception as exc:  # reported in the listing and the log, never swallowed silently
                rec.load_error = exc
                logger.error("magi backend %r (%s) failed to load: %s", ep.name, rec.package, exc)
                continue
        for rec in records.values():
            if rec.plugin is not None:
                self._bind(pm, rec, [r.plugin for r in records.values() if r is not rec and r.plugin is not None])
        return records

    def _bind(self, pm: pluggy.PluginManager, rec: BackendRecord, others: Sequence[Any]) -> None:
        implemented = {
            hook for hook in REQUIRED_HOOKS + OPTIONAL_HOOKS
            if any(impl.plugin is rec.plugin for impl in getattr(pm.hook, hook).get_hookimpls())
        }
        rec.missing_required = tuple(h for h in REQUIRED_HOOKS if h not in implemented)
        rec.missing_optional = tuple(h for h in OPTIONAL_HOOKS if h not in implemented)
        rec.callers = {h: pm.subset_hook_caller(h, remove_plugins=others) for h in implemented}
        if rec.missing_required:
            logger.error("magi backend %r is missing required hook(s) %s", rec.name, rec.missing_required)
            return
        try:
            rec.spec_versions = tuple(str(v) for v in rec.call("magi_hookspec_versions"))
            probe = rec.call("magi_probe")
            if not isinstance(probe, ProbeResult):
                raise TypeError(f"magi_probe returned {type(probe).__name__}, expected ProbeResult")
            rec.probe = probe
        except Exception as exc:
            rec.probe_error = exc
            logger.error("magi backend %r (%s) probe raised: %r", rec.name, rec.package, exc)

    # -- selection -----------------------------------------------------------------------------
    def use(self, name: str | None) -> Backend | None:
        """Select backend ``name`` explicitly (None returns to automatic selection)."""
        with self._lock:
            self._explicit = name
            self._active = None
            return self.active() if name is not None else None

    def choose(self) -> tuple[BackendRecord, str]:
        """Pick the backend record and say why: ``explicit``, ``env`` or ``probe``."""
        records = self.records()
        wanted, how = self._explicit, "explicit"
        if wanted is None and os.environ.get(ENV_BACKEND):
            wanted, how = os.environ[ENV_BACKEND], "env"
        if wanted is not None:
            rec = records.get(wanted)
            if rec is None:
                raise BackendError(
                    f"magi backend {wanted!r} ({how}) is not installed; installed: "
                    f"{', '.join(sorted(records)) or 'none'}. Install {package_hint(wanted)} or pick one of those"
                    + (f" (unset {ENV_BACKEND})" if how == "env" else "")
                )
            if not rec.available:
                raise BackendError(f"magi backend {wanted!r} ({how}) cannot be used: {rec.why_unavailable}")
            return rec, how
        return self._choose_by_probe(records), "probe"

    def _choose_by_probe(self, records: dict[str, BackendRecord]) -> BackendRecord:
        for rec in records.values():
            if rec.problem is not None:
                logger.warning("magi backend %r skipped: %s", rec.name, rec.problem)
        usable = [r for r in records.values() if r.available]
        accel = torch.accelerator.current_accelerator(check_available=False)
        if accel is not None:
            serving = [r for r in usable if r.probe is not None and r.probe.device_type == accel.type]
            if serving:
                return self._top(serving)
            if not any(r.probe is not None and r.probe.device_type == accel.type for r in records.values()):
                if torch.accelerator.current_accelerator(check_available=True) is not None:
                    raise BackendError(
                        f"torch reports a {accel.type!r} accelerator but no installed magi backend serves it: "
                        f"pip install {package_hint(accel.type)} (installed: {', '.join(sorted(records)) or 'none'})"
                    )
        if not usable:
            raise BackendError(
                "no magi backend is available; install magi-core (it ships the 'cpu' backend) or a backend "
                "package, and run `magi backends` to see why each one was refused"
            )
        return self._top(usable)

    @staticmethod
    def _top(candidates: list[BackendRecord]) -> BackendRecord:
        def prio(r: BackendRecord) -> int:
            assert r.probe is not None
            return r.probe.priority

        best = max(prio(r) for r in candidates)
        top = [r for r in candidates if prio(r) == best]
        if len(top) > 1:
            raise BackendError(
                "backends with equal priority %d are both available: %s; choose one with "
                "magi_core.use_backend(NAME) or %s=NAME, or uninstall one"
                % (best, " and ".join(f"{r.name!r} ({r.package})" for r in top), ENV_BACKEND)
            )
        return top[0]

    def active(self) -> Backend:
        """The selected backend's facade, built once."""
        with self._lock:
            if self._active is None:
                rec, how = self.choose()
                self._active = self._facade(rec, how)
                level = logging.INFO if rec.name != "cpu" or how != "probe" else logging.WARNING
                logger.log(level, "magi-core uses backend %r (%s, selected by %s)", rec.name, rec.package, how)
            return self._active

    @staticmethod
    def _facade(rec: BackendRecord, how: str) -> Backend:
        assert rec.probe is not None
        aliases = tuple(rec.call("magi_to_method_aliases") or ("to",)) if "magi_to_method_aliases" in rec.callers \
            else ("to",)
        if "to" not in aliases:
            raise BackendError(f"backend {rec.name!r}: magi_to_method_aliases must include 'to', got {aliases}")
        push = rec.callers.get("magi_range_push")
        pop = rec.callers.get("magi_range_pop")
        register = rec.callers["magi_host_register"]
        unregister = rec.callers["magi_host_unregister"]
        return Backend(
            name=rec.name,
            package=rec.package,
            version=rec.probe.version,
            device_type=rec.probe.device_type,
            priority=rec.probe.priority,
            selected_by=how,
            device_module=rec.call("magi_device_module"),
            to_method_aliases=aliases,
            _register=lambda ptr, nbytes: register(ptr=ptr, nbytes=nbytes),
            _unregister=lambda ptr: unregister(ptr=ptr),
            _range_push=(lambda name: push(name=name)) if push is not None else None,
            _range_pop=(lambda: pop()) if pop is not None else None,
        )

    def reset(self) -> None:
        """Forget discovery and selection (tests, or after installing a backend at run time)."""
        with self._lock:
            self._pm = None
            self._records = None
            self._explicit = None
            self._active = None


REGISTRY = Registry()


def get_backend() -> Backend:
    """The active backend's facade (selected on first use: explicit > ``MAGI_BACKEND`` > probe)."""
    return REGISTRY.active()


def use_backend(name: str | None) -> Backend | None:
    """Select backend ``name`` for this process, overriding ``MAGI_BACKEND`` and probing."""
    return REGISTRY.use(name)


def list_backends() -> list[BackendRecord]:
    """Every discovered backend record, sorted by name."""
    return [REGISTRY.records()[k] for k in sorted(REGISTRY.records())]
