"""Backend discovery (entry points ``magi.backends``), selection and the active :class:`Backend` facade.

Every backend, magi-core's own CPU backend included, is found through the ``magi.backends``
entry-point group and loaded lazily (on the first :func:`get_backend` / :func:`list_backends`).
Each backend gets its own pluggy ``PluginManager``, so a hook call reaches that backend only and a
broken backend cannot disturb another. Selection order: :func:`use_backend` > ``MAGI_BACKEND`` >
the highest-priority available probe. Core code talks to the device through :func:`get_backend`.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import importlib_metadata
import pluggy
import torch

from magi_core._env import FALSE_WORDS, TRUE_WORDS, env_str, warn_unknown_env
from magi_core._once import first_time
from magi_core.errors import BackendError
from magi_core.plugin import spec as hookspecs
from magi_core.plugin.facade import Backend
from magi_core.plugin.spec import (
    DEVICE_MODULE_REQUIRED,
    ENTRY_POINT_GROUP,
    HOOKSPEC_VERSION,
    REQUIRED_HOOKS,
    Capabilities,
    ProbeResult,
)

logger = logging.getLogger(__name__)

#: Environment variable naming the backend to use (beaten only by :func:`use_backend`).
ENV_BACKEND = "MAGI_BACKEND"
#: Environment variable that, when set to a true word (``1``, ``true``, ``yes``, ``on``), logs every hook call.
ENV_TRACE = "MAGI_TRACE_HOOKS"
#: Hooks a backend may leave out; the facade then uses the documented default.
OPTIONAL_HOOKS = ("magi_range_push", "magi_range_pop", "magi_to_method_aliases", "magi_capabilities",
                  "magi_device_memory", "magi_limit_device_memory")
#: Hooks a backend may implement, required first.
ALL_HOOKS = REQUIRED_HOOKS + OPTIONAL_HOOKS
#: Attributes the device module must have (torch-style device module): selection fails without them.
DEVICE_MODULE_ATTRS = DEVICE_MODULE_REQUIRED


def package_hint(device_type: str) -> str:
    """The pip package that conventionally serves ``device_type``."""
    return f"magi-backend-{device_type}"


def spec_major(version: str) -> str:
    """The major part of a hook-spec version string (``"1.2"`` -> ``"1"``)."""
    return str(version).strip().split(".")[0]


_trace_warned: set[str] = set()


def tracing_enabled() -> bool:
    """True when ``MAGI_TRACE_HOOKS`` asks for every hook call to be logged.

    ``1/true/yes/on`` enable it and ``0/false/no/off`` (or unset, blank) leave it off; any other value
    enables it, with a warning (once per value) saying which words are understood.
    """
    raw = env_str(ENV_TRACE)
    if raw is None or raw.lower() in FALSE_WORDS:
        return False
    if raw.lower() not in TRUE_WORDS and first_time(_trace_warned, raw):
        logger.warning("%s=%r is not a boolean; tracing hook calls anyway (use %s to enable, %s to disable)",
                       ENV_TRACE, raw, "/".join(TRUE_WORDS), "/".join(FALSE_WORDS))
    return True


#: Where an error sends a backend author for the hooks' signatures.
HOOK_REFERENCE = ("the \"Hook specification\" page of the docs, docs/reference/hooks.md, generated from "
                  "magi_core/plugin/spec.py")


def _describe_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _traceback_text(exc: BaseException | None) -> str | None:
    """The formatted traceback of ``exc`` (None when there is none), for ``magi backends -v``."""
    if exc is None:
        return None
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


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
    spec_error: BaseException | None = None
    spec_versions: tuple[str, ...] = ()
    missing_required: tuple[str, ...] = ()
    missing_optional: tuple[str, ...] = ()
    unknown_hooks: tuple[str, ...] = ()
    callers: dict[str, Any] = field(default_factory=dict, repr=False)
    manager: pluggy.PluginManager | None = field(default=None, repr=False)

    @property
    def spec_compatible(self) -> bool:
        """True when the backend supports this magi-core's hook-spec major version."""
        return spec_major(HOOKSPEC_VERSION) in {spec_major(v) for v in self.spec_versions}

    @property
    def problem(self) -> str | None:
        """Why this backend cannot be used at all (load, hooks, version or probe), or None."""
        if self.load_error is not None:
            return f"failed to load: {_describe_exception(self.load_error)}"
        if self.missing_required:
            return (
                f"missing required hook(s) {', '.join(self.missing_required)}; "
                f"implement them with @magi_core.plugin.hookimpl (see {HOOK_REFERENCE})"
            )
        if self.spec_error is not None:
            return (f"magi_hookspec_versions failed: {_describe_exception(self.spec_error)}; return the spec "
                    f"versions it supports as a sequence of strings, e.g. (\"{spec_major(HOOKSPEC_VERSION)}\",)")
        if not self.spec_compatible:
            major = spec_major(HOOKSPEC_VERSION)
            return (
                f"incompatible hook-spec version: {self.package} {self.package_version} supports "
                f"{', '.join(self.spec_versions) or 'no version'}, magi-core publishes {HOOKSPEC_VERSION}; "
                f"install a {self.package} release that supports spec {major}, or a magi-core matching the backend"
            )
        if self.probe_error is not None:
            return f"probe raised {_describe_exception(self.probe_error)}"
        return None

    @property
    def available(self) -> bool:
        """True when the backend loaded, is compatible, probed without error and reports its hardware present."""
        return self.problem is None and self.probe is not None and self.probe.available

    @property
    def why_unavailable(self) -> str | None:
        """Human-readable reason this backend is not available, or None when it is."""
        if self.problem is not None:
            return self.problem
        if self.probe is None:
            return "not probed"
        return None if self.probe.available else (self.probe.reason or "probe reported unavailable")

    @property
    def device_type(self) -> str | None:
        """The device type the probe reported, or None when the backend could not be probed."""
        return self.probe.device_type if self.probe is not None else None

    @property
    def status(self) -> str:
        """``"refused"`` (load, hooks, spec or probe error), ``"unavailable"`` (probe says so) or ``"available"``."""
        if self.problem is not None:
            return "refused"
        return "available" if self.available else "unavailable"

    def lost_to(self, winner: BackendRecord | None, how: str | None) -> str | None:
        """Why this backend is not the selected one (None when it is ``winner``), in one line.

        ``"refused: <problem>"``, ``"unavailable: <reason>"``, ``"lower priority (P) than 'X' (Q)"``, or the
        explicit choice that beat it.
        """
        if winner is not None and winner.name == self.name:
            return None
        if self.problem is not None:
            return f"refused: {self.problem}"
        if not self.available:
            return f"unavailable: {self.why_unavailable}"
        if winner is None:
            return "available, but selection failed (see the selection error)"
        if how == "env":
            return f"available, but {ENV_BACKEND}={winner.name} selects {winner.name!r}"
        if how == "explicit":
            return f"available, but use_backend({winner.name!r}) / --backend selects {winner.name!r}"
        mine = self.probe.priority if self.probe is not None else None
        theirs = winner.probe.priority if winner.probe is not None else None
        return (f"lower priority ({mine}) than {winner.name!r} ({theirs}); select it with "
                f"{ENV_BACKEND}={self.name} or use_backend({self.name!r})")

    def serves(self, device_type: str) -> bool:
        """True when this backend drives ``device_type`` (by probe, or by name when it could not be probed)."""
        return self.device_type == device_type if self.probe is not None else self.name == device_type

    def call(self, hook: str, **kwargs: Any) -> Any:
        """Call ``hook`` on this backend only (raises :class:`BackendError` when it does not implement it)."""
        try:
            caller = self.callers[hook]
        except KeyError:
            raise BackendError(
                f"backend {self.name!r} ({self.package}) does not implement hook {hook!r}"
                + (f"; it cannot be used: {self.problem}" if self.problem else "")
            ) from None
        return caller(**kwargs)

    def to_dict(self, selected: bool = False, lost: str | None = None) -> dict[str, Any]:
        """A JSON-ready description of this backend (what ``magi backends --json`` prints).

        ``lost`` is why it was not selected (:meth:`lost_to`), which only the caller knows.
        """
        return {
            "name": self.name,
            "entry_point": self.entry_point,
            "package": self.package,
            "package_version": self.package_version,
            "version": self.probe.version if self.probe is not None else None,
            "device_type": self.device_type,
            "priority": self.probe.priority if self.probe is not None else None,
            "available": self.available,
            "why_unavailable": self.why_unavailable,
            "load_error": _describe_exception(self.load_error) if self.load_error is not None else None,
            "probe_error": _describe_exception(self.probe_error) if self.probe_error is not None else None,
            "spec_error": _describe_exception(self.spec_error) if self.spec_error is not None else None,
            "hookspec_versions": list(self.spec_versions),
            "missing_required_hooks": list(self.missing_required),
            "missing_optional_hooks": list(self.missing_optional),
            "unknown_hooks": list(self.unknown_hooks),
            "selected": selected,
            "status": self.status,
            "lost": lost,
            "error_traceback": _traceback_text(self.load_error or self.spec_error or self.probe_error),
        }


@dataclass(frozen=True)
class Selection:
    """Which backend would be (or is) selected and why, or the error that prevents selection."""

    name: str | None
    selected_by: str | None
    error: str | None = None


def _make_manager(name: str) -> pluggy.PluginManager:
    """A plugin manager holding the hook specs, with hook tracing when ``MAGI_TRACE_HOOKS`` asks for it."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if tracing_enabled():
        pm.trace.root.setwriter(lambda msg: logger.info("hook trace [%s] %s", name, msg.rstrip()))
        pm.enable_tracing()
    return pm


def _direct(caller: Any, argnames: tuple[str, ...], dispatch: Callable[..., Any]) -> Callable[..., Any] | None:
    """The single implementation of a hot per-step hook, called directly (``None`` when not implemented).

    Keeps ``dispatch`` (through pluggy) when hook tracing is on, or the hook has wrappers, several
    implementations or one taking other arguments than ``argnames`` positionally, so ``MAGI_TRACE_HOOKS``
    still sees every call and pluggy's argument matching still applies.
    """
    if caller is None:
        return None
    impls = caller.get_hookimpls()
    if tracing_enabled() or len(impls) != 1:
        return dispatch
    impl = impls[0]
    if impl.hookwrapper or getattr(impl, "wrapper", False) or tuple(impl.argnames) != argnames:
        return dispatch
    return impls[0].function


def _load(rec: BackendRecord, ep: importlib_metadata.EntryPoint) -> None:
    """Import the entry point and register it in its own plugin manager; errors go to ``rec.load_error``."""
    try:
        plugin = ep.load()
    except Exception as exc:  # reported in the listing and the log, never swallowed silently
        rec.load_error = exc
        logger.error("magi backend %r (%s): import of %s failed: %s", rec.name, rec.package, ep.value,
                     _describe_exception(exc))
        return
    pm = _make_manager(rec.name)
    try:
        pm.register(plugin, name=rec.name)
    except pluggy.PluginValidationError as exc:
        detail = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # one line in listings
        rec.load_error = BackendError(
            f"a hook implementation does not match magi-core's hook spec {HOOKSPEC_VERSION}: {detail}; fix its "
            f"signature to the spec's argument names ({HOOK_REFERENCE})"
        )
        logger.error("magi backend %r (%s) rejected by hook validation: %s", rec.name, rec.package, exc)
        return
    except Exception as exc:
        rec.load_error = exc
        logger.error("magi backend %r (%s) could not be registered: %s", rec.name, rec.package,
                     _describe_exception(exc))
        return
    rec.plugin, rec.manager = plugin, pm
    implemented = {h for h in ALL_HOOKS if getattr(pm.hook, h).get_hookimpls()}
    rec.missing_required = tuple(h for h in REQUIRED_HOOKS if h not in implemented)
    rec.missing_optional = tuple(h for h in OPTIONAL_HOOKS if h not in implemented)
    rec.unknown_hooks = tuple(sorted(
        hc.name for hc in pm.get_hookcallers(plugin) or () if not hc.has_spec()
    ))
    rec.callers = {h: getattr(pm.hook, h) for h in implemented}
    if rec.missing_required:
        logger.error("magi backend %r (%s) is missing required hook(s) %s", rec.name, rec.package,
                     ", ".join(rec.missing_required))
    if rec.unknown_hooks:
        logger.warning("magi backend %r (%s) implements hook(s) magi-core does not know: %s (typo, or a "
                       "newer hook spec than %s?)", rec.name, rec.package, ", ".join(rec.unknown_hooks),
                       HOOKSPEC_VERSION)


def _probe(rec: BackendRecord) -> None:
    """Ask the backend for its spec versions and, when compatible, its probe; errors go to the record."""
    if rec.load_error is not None or rec.missing_required:
        return
    try:
        versions = rec.call("magi_hookspec_versions")
        if isinstance(versions, str) or versions is None:
            raise TypeError(f"magi_hookspec_versions returned {versions!r}, expected a sequence like ('1',)")
        rec.spec_versions = tuple(str(v) for v in versions)
    except Exception as exc:
        rec.spec_error = exc
        logger.error("magi backend %r (%s): magi_hookspec_versions raised %s", rec.name, rec.package,
                     _describe_exception(exc))
        return
    if not rec.spec_compatible:
        logger.error("magi backend %r refused: %s", rec.name, rec.problem)
        return
    try:
        probe = rec.call("magi_probe")
        if not isinstance(probe, ProbeResult):
            raise TypeError(f"magi_probe returned {type(probe).__name__}, expected magi_core.plugin.ProbeResult")
        rec.probe = probe
    except Exception as exc:
        rec.probe_error = exc
        logger.error("magi backend %r (%s) probe raised %s", rec.name, rec.package, _describe_exception(exc))


def available_accelerator() -> str | None:
    """The device type of the accelerator torch was built for and sees at run time, or None."""
    accel = torch.accelerator.current_accelerator()
    if accel is None:
        return None
    return accel.type if torch.accelerator.is_available() else None


def cpu_fallback_message(records: dict[str, BackendRecord], selected: BackendRecord) -> str:
    """What the one-time warning says when the CPU backend is chosen by probe: each other backend and why not."""
    others = sorted((r for r in records.values() if r.name != selected.name), key=lambda r: r.name)
    lines = [f"magi-core runs on the CPU backend {selected.name!r}: torch reports no accelerator."]
    if others:
        lines.append("Installed backends not used:")
        lines += [f"  {r.name} ({r.package} {r.package_version}): {r.lost_to(selected, 'probe')}" for r in others]
        lines.append("Run `magi backends` for details (`magi backends --check NAME` checks one backend).")
    else:
        lines.append(
            f"No other backend is installed: install the one for your device ({package_hint('<device>')}, see the "
            "README's Install section), then run `magi backends`."
        )
    return "\n".join(lines)


class Registry:
    """Discovers backends lazily, selects one, and hands out the :class:`Backend` facade."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._records: dict[str, BackendRecord] | None = None
        self._explicit: str | None = None
        self._active: Backend | None = None
        self._logged_cpu = False

    # -- discovery -----------------------------------------------------------------------------
    def records(self) -> dict[str, BackendRecord]:
        """Every backend found under the ``magi.backends`` entry-point group, loaded and probed once."""
        with self._lock:
            if self._records is None:
                self._records = self._discover()
            return self._records

    @staticmethod
    def _discover() -> dict[str, BackendRecord]:
        records: dict[str, BackendRecord] = {}
        for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist
            rec = BackendRecord(
                name=ep.name,
                entry_point=ep.value,
                package=(dist.metadata["Name"] or "?") if dist is not None else "?",
                package_version=dist.version if dist is not None else "?",
            )
            prev = records.get(ep.name)
            if prev is not None:
                if prev.entry_point == ep.value:
                    continue  # the same distribution seen twice on sys.path
                prev.load_error = BackendError(
                    f"two packages register the backend name {ep.name!r}: {prev.package} ({prev.entry_point}) "
                    f"and {rec.package} ({ep.value}); uninstall one of them"
                )
                prev.callers, prev.probe = {}, None
                logger.error("%s", prev.load_error)
                continue
            records[ep.name] = rec
            _load(rec, ep)
            _probe(rec)
        return records

    # -- selection -----------------------------------------------------------------------------
    def use(self, name: str | None) -> Backend | None:
        """Select backend ``name`` explicitly (None returns to automatic selection)."""
        with self._lock:
            previous, explicit = self._active, self._explicit
            self._explicit, self._active = name, None
            if name is None:
                return None
            try:
                backend = self.active()
            except BaseException:
                self._explicit, self._active = explicit, previous
                raise
            if previous is not None and previous.name != backend.name:
                logger.warning("magi backend switched from %r to %r; objects created with %r keep using it",
                               previous.name, backend.name, previous.name)
            return backend

    def choose(self, explicit: str | None = None) -> tuple[BackendRecord, str]:
        """Pick the backend record and say why: ``explicit``, ``env`` or ``probe`` (raises :class:`BackendError`).

        ``explicit`` previews a :meth:`use` of that name without changing the selection.
        """
        with self._lock:
            records = self.records()
            wanted, how = explicit or self._explicit, "explicit"
            warn_unknown_env()  # a mistyped MAGI_* variable (e.g. MAGI_BACKNED) is named, not ignored silently
            from_env = env_str(ENV_BACKEND)
            if wanted is None and from_env is not None:
                wanted, how = from_env, "env"
            if wanted is None:
                return self._choose_by_probe(records), "probe"
            source = f"{ENV_BACKEND}={wanted}" if how == "env" else f"use_backend({wanted!r})"
            rec = records.get(wanted)
            if rec is None:
                raise BackendError(
                    f"magi backend {wanted!r} (asked for by {source}) is not installed; installed: "
                    f"{', '.join(sorted(records)) or 'none'}. Pick one of those"
                    + (f" or unset {ENV_BACKEND}" if how == "env" else "")
                    + f", or install {package_hint(wanted)}"
                )
            if not rec.available:
                raise BackendError(
                    f"magi backend {wanted!r} ({rec.package}, asked for by {source}) cannot be used: "
                    f"{rec.why_unavailable}"
                )
            return rec, how

    def _choose_by_probe(self, records: dict[str, BackendRecord]) -> BackendRecord:
        for rec in records.values():
            if rec.problem is not None:
                logger.warning("magi backend %r (%s) skipped: %s", rec.name, rec.package, rec.problem)
        usable = [r for r in records.values() if r.available]
        top = self._top(usable) if usable else None
        if top is None or top.device_type == "cpu":
            accel = available_accelerator()
            if accel is not None and accel != "cpu":
                # torch reports this accelerator: an available backend that drives it wins over the host,
                # whatever its priority (a backend may rank itself low so that only this picks it)
                serving = [r for r in usable if r.serves(accel)]
                if serving:
                    return self._top(serving)
                self._no_server(accel, records)
        if top is None:
            raise BackendError(
                "no magi backend is available (installed: "
                + (", ".join(f"{r.name}: {r.why_unavailable}" for r in records.values()) or "none")
                + "); reinstall magi-core (it ships the 'cpu' backend) or install a backend package, and run "
                "`magi backends` to see why each one was refused"
            )
        return top

    @staticmethod
    def _no_server(accel: str, records: dict[str, BackendRecord]) -> None:
        """Raise: torch sees an ``accel`` accelerator but no usable backend drives it."""
        servers = [r for r in records.values() if r.serves(accel)]
        installed = ", ".join(sorted(records)) or "none"
        if servers:
            raise BackendError(
                f"torch reports a {accel!r} accelerator but the magi backend(s) for it cannot be used: "
                + "; ".join(f"{r.name!r} ({r.package}): {r.why_unavailable}" for r in servers)
                + f". Fix that, or run on the host on purpose with {ENV_BACKEND}=cpu"
            )
        raise BackendError(
            f"torch reports a {accel!r} accelerator but no installed magi backend serves it "
            f"(installed: {installed}): pip install {package_hint(accel)}; or run on the host on purpose "
            f"with {ENV_BACKEND}=cpu"
        )

    @staticmethod
    def _top(candidates: list[BackendRecord]) -> BackendRecord:
        def prio(r: BackendRecord) -> int:
            assert r.probe is not None
            return r.probe.priority

        best = max(prio(r) for r in candidates)
        top = [r for r in candidates if prio(r) == best]
        if len(top) > 1:
            raise BackendError(
                f"backends with equal priority {best} are all available: "
                + " and ".join(f"{r.name!r} ({r.package} {r.package_version})" for r in top)
                + f"; choose one with magi_core.use_backend(NAME) or {ENV_BACKEND}=NAME, or uninstall one"
            )
        return top[0]

    def selection(self, explicit: str | None = None) -> Selection:
        """Which backend :meth:`choose` picks and why, or the error that :meth:`choose` or building its facade
        raises (nothing is kept: the selection itself does not change)."""
        with self._lock:
            if self._active is not None and explicit is None:
                return Selection(name=self._active.name, selected_by=self._active.selected_by)
        try:
            rec, how = self.choose(explicit)
            self._facade(rec, how)  # what get_backend() refuses (aliases, device module, capabilities) fails here too
        except BackendError as exc:
            return Selection(name=None, selected_by=None, error=str(exc))
        return Selection(name=rec.name, selected_by=how)

    def active(self) -> Backend:
        """The selected backend's facade, built once."""
        with self._lock:
            if self._active is None:
                rec, how = self.choose()
                self._active = self._facade(rec, how)
                if rec.device_type == "cpu" and how == "probe":
                    if not self._logged_cpu:  # expected on a machine without an accelerator: info, once
                        self._logged_cpu = True  # (a refused backend was already logged as a warning)
                        logger.info("%s", cpu_fallback_message(self.records(), rec))
                else:
                    logger.info("magi-core uses backend %r (%s %s, selected by %s)", rec.name, rec.package,
                                rec.package_version, how)
            return self._active

    @staticmethod
    def _facade(rec: BackendRecord, how: str) -> Backend:
        assert rec.probe is not None
        try:
            raw_aliases = rec.call("magi_to_method_aliases") if "magi_to_method_aliases" in rec.callers else None
            aliases = tuple(raw_aliases) if raw_aliases else ("to",)
            module = rec.call("magi_device_module")
            capabilities = rec.call("magi_capabilities") if "magi_capabilities" in rec.callers else None
        except Exception as exc:
            raise BackendError(
                f"backend {rec.name!r} ({rec.package}) failed while building the facade: {_describe_exception(exc)}"
            ) from exc
        if capabilities is not None and not isinstance(capabilities, Capabilities):
            raise BackendError(
                f"backend {rec.name!r} ({rec.package}): magi_capabilities returned {type(capabilities).__name__}, "
                "expected magi_core.plugin.Capabilities; return Capabilities(...) (or leave the hook out for the "
                "safe default)"
            )
        if "to" not in aliases:
            raise BackendError(f"backend {rec.name!r}: magi_to_method_aliases must include 'to', got {aliases}")
        missing = [a for a in DEVICE_MODULE_ATTRS if not hasattr(module, a)]
        if missing:
            raise BackendError(
                f"backend {rec.name!r} ({rec.package}): its device module {getattr(module, '__name__', module)!r} "
                f"lacks {', '.join(missing)}; magi_device_module must return a torch-style device module"
            )
        push: Any = rec.callers.get("magi_range_push")
        pop: Any = rec.callers.get("magi_range_pop")
        register = rec.callers["magi_host_register"]
        unregister = rec.callers["magi_host_unregister"]
        # called once per unit per step: bound to the backend's function itself, not dispatched through pluggy
        range_push: Callable[[str], Any] | None = _direct(push, ("name",), lambda name: push(name=name))
        range_pop: Callable[[], Any] | None = _direct(pop, (), lambda: pop())
        memory: Any = rec.callers.get("magi_device_memory")
        limit: Any = rec.callers.get("magi_limit_device_memory")
        return Backend(
            name=rec.name,
            package=rec.package,
            version=rec.probe.version,
            device_type=rec.probe.device_type,
            priority=rec.probe.priority,
            selected_by=how,
            device_module=module,
            to_method_aliases=aliases,
            _register=lambda ptr, nbytes: register(ptr=ptr, nbytes=nbytes),
            _unregister=lambda ptr: unregister(ptr=ptr),
            _range_push=range_push,
            _range_pop=range_pop,
            package_version=rec.package_version,
            hookspec_versions=rec.spec_versions,
            declared_capabilities=capabilities,
            _device_memory=(lambda index: memory(device_index=index)) if memory is not None else None,
            _limit_device_memory=(lambda index, nbytes: limit(device_index=index, nbytes=nbytes))
            if limit is not None else None,
        )

    def reset(self) -> None:
        """Forget discovery and selection (tests, or after installing a backend at run time)."""
        with self._lock:
            self._records = None
            self._explicit = None
            self._active = None


REGISTRY = Registry()


def get_backend() -> Backend:
    """The active backend's facade (selected on first use: explicit > ``MAGI_BACKEND`` > probe)."""
    return REGISTRY.active()


def use_backend(name: str | None) -> Backend | None:
    """Select backend ``name`` for this process, overriding ``MAGI_BACKEND`` and probing (None: automatic)."""
    return REGISTRY.use(name)


def list_backends() -> list[BackendRecord]:
    """Every discovered backend record, sorted by name."""
    records = REGISTRY.records()
    return [records[k] for k in sorted(records)]


def current_selection(explicit: str | None = None) -> Selection:
    """Which backend is (or would be, with ``explicit`` as if passed to :func:`use_backend`) selected and why."""
    return REGISTRY.selection(explicit)


__all__ = [
    "ENV_BACKEND",
    "ENV_TRACE",
    "OPTIONAL_HOOKS",
    "REGISTRY",
    "BackendRecord",
    "Registry",
    "Selection",
    "available_accelerator",
    "cpu_fallback_message",
    "current_selection",
    "get_backend",
    "list_backends",
    "package_hint",
    "use_backend",
]
