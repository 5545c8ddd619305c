"""``magi backends --check NAME``: load one backend and check it against the spec without initialising the device.

Each finding is a :class:`Problem` naming the hook it concerns, what is wrong and what to change. The check
calls the hooks selection calls (``magi_to_method_aliases``, ``magi_device_module``, ``magi_capabilities``) but
never creates a stream, an event or a tensor: classes are inspected, not instantiated, so a device that
initialises on first use stays uninitialised (the check ends by asking the module's ``is_initialized``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from magi_core.plugin.facade import default_capabilities
from magi_core.plugin.manager import HOOK_REFERENCE, REGISTRY, BackendRecord, package_hint
from magi_core.plugin.spec import (
    DEVICE_MODULE_EXPECTED,
    DEVICE_MODULE_REQUIRED,
    HOOKSPEC_VERSION,
    Capabilities,
)

#: Where a conforming device module to copy lives (named in fixes).
REFERENCE_MODULE = "magi_core.plugin.cpu.device"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a backend: the hook (or ``"load"``, ``"install"``), what is wrong, what to change."""

    hook: str
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.hook}: {self.what}\n    fix: {self.fix}"


@dataclass
class CheckReport:
    """What ``magi backends --check NAME`` found."""

    backend: str
    problems: list[Problem] = field(default_factory=list)
    #: Facts worth knowing that are not problems (capabilities, defaults applied).
    notes: list[str] = field(default_factory=list)
    #: Checks that need the device and could not be made here (the device is absent), each with why.
    skipped: list[str] = field(default_factory=list)
    #: The device module's ``is_initialized()`` after the check (None when it could not be asked).
    initialised: bool | None = None

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return not self.problems

    def add(self, hook: str, what: str, fix: str) -> None:
        """Record a problem."""
        self.problems.append(Problem(hook, what, fix))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``magi backends --json --check NAME``)."""
        return {
            "backend": self.backend,
            "ok": self.ok,
            "problems": [{"hook": p.hook, "what": p.what, "fix": p.fix} for p in self.problems],
            "notes": list(self.notes),
            "skipped": list(self.skipped),
            "initialised": self.initialised,
        }

    def format(self) -> str:
        """Human-readable form: one entry per problem with its fix, then the notes."""
        lines = [self.headline()]
        lines += [f"  {i}. " + str(p).replace("\n", "\n  ") for i, p in enumerate(self.problems, 1)]
        lines += [f"  skipped: {n}" for n in self.skipped]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def headline(self) -> str:
        """``check of backend 'X': N problem(s)`` (or none), and how many checks were skipped without the device."""
        head = f"check of backend {self.backend!r}: " + (
            "no problems found" if self.ok else f"{len(self.problems)} problem(s)"
        )
        return head + (f"; {len(self.skipped)} check(s) skipped: its device is absent here" if self.skipped else "")


def _call(report: CheckReport, rec: BackendRecord, hook: str) -> tuple[bool, Any]:
    """``(True, result)`` of calling ``hook`` on the backend, or ``(False, None)`` with the exception reported."""
    try:
        return True, rec.call(hook)
    except Exception as exc:
        report.add(hook, f"raised {type(exc).__name__}: {exc}",
                   "make it return without raising (run `magi -v backends --check` for the traceback)")
        return False, None


def _accepts_keyword(obj: Any, name: str) -> bool | None:
    """Whether calling ``obj`` accepts keyword ``name`` (None when its signature cannot be read)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = sig.parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def check_device_module(module: Any) -> list[Problem]:
    """Problems of a device module against the contract, found without creating a stream, an event or a tensor."""
    report = CheckReport("?")
    hook = "magi_device_module"
    label = getattr(module, "__name__", repr(module))
    if module is torch.cpu:
        report.add(hook, "returns torch.cpu, which does not conform (no timing events, no memory statistics, its "
                         "Stream is not a torch.Stream)", f"return {REFERENCE_MODULE} (or a copy of it)")
        return report.problems
    for attr in DEVICE_MODULE_REQUIRED:
        if not callable(getattr(module, attr, None)):
            report.add(hook, f"device module {label} lacks {attr} (required: selection fails without it)",
                       f"add {attr} as in {REFERENCE_MODULE}")
    for attr, used_by in DEVICE_MODULE_EXPECTED.items():
        if not callable(getattr(module, attr, None)):
            report.add(hook, f"device module {label} lacks {attr}, used by {used_by}",
                       f"add {attr}() as in {REFERENCE_MODULE}")
    stream_cls = getattr(module, "Stream", None)
    if stream_cls is not None and not (isinstance(stream_cls, type) and issubclass(stream_cls, torch.Stream)):
        report.add(hook, f"{label}.Stream is not a torch.Stream subclass: Tensor.record_stream, which the executor "
                         "calls for every streamed weight, rejects its streams",
                   f"derive Stream from torch.Stream (see {REFERENCE_MODULE}.Stream)")
    event_cls = getattr(module, "Event", None)
    if event_cls is not None and _accepts_keyword(event_cls, "enable_timing") is False:
        report.add(hook, f"{label}.Event does not accept enable_timing: the profiler times units with "
                         "Event(enable_timing=True)",
                   "accept enable_timing (and time elapsed_time() in milliseconds when it is True)")
    context = getattr(module, "stream", None)
    if context is not None and inspect.isclass(context) and not hasattr(context, "__enter__"):
        report.add(hook, f"{label}.stream is not a context manager", "make stream(s) a context manager")
    return report.problems


def _check_aliases(report: CheckReport, rec: BackendRecord) -> None:
    hook = "magi_to_method_aliases"
    if hook not in rec.callers:
        report.notes.append(f"{hook} not implemented: Tensor.to is matched as ('to',)")
        return
    ok, raw = _call(report, rec, hook)
    if not ok:
        return
    if isinstance(raw, str) or not isinstance(raw, Sequence):
        report.add(hook, f"returned {raw!r}, not a sequence of method names", 'return a tuple such as ("to",)')
        return
    aliases = tuple(raw) or ("to",)
    if "to" not in aliases:
        report.add(hook, f"returned {aliases}, without 'to' (selection fails)", 'include "to"')
    if len(set(aliases)) != len(aliases):
        report.add(hook, f"returned duplicates in {aliases}", "list each name once")
    for alias in aliases:
        if not isinstance(alias, str) or not callable(getattr(torch.Tensor, alias, None)):
            report.add(hook, f"{alias!r} is not a torch.Tensor method", "list only names Tensor.to appears under")


def _check_capabilities(report: CheckReport, rec: BackendRecord) -> None:
    hook = "magi_capabilities"
    device_type = rec.device_type or rec.name
    if hook not in rec.callers:
        caps = default_capabilities(device_type)
        report.notes.append(
            f"{hook} not implemented (a spec 1.0 backend): it gets the default {caps}; implement it (spec "
            f"{HOOKSPEC_VERSION}) to declare Inductor support and direct unit calls"
        )
        return
    ok, caps = _call(report, rec, hook)
    if not ok:
        return
    if not isinstance(caps, Capabilities):
        report.add(hook, f"returned {type(caps).__name__}, not magi_core.plugin.Capabilities (selection fails)",
                   "return Capabilities(...), or leave the hook out for the safe default")
        return
    report.notes.append(f"capabilities: {caps}")


def _check_device_memory(report: CheckReport, rec: BackendRecord, module: Any) -> None:
    """Notes on the device-memory hooks (spec 1.2); nothing is called: asking would initialise the device."""
    if "magi_device_memory" not in rec.callers:
        how = ("the device module's mem_get_info" if callable(getattr(module, "mem_get_info", None))
               else "nothing: its device module has no mem_get_info, so offloaded models get no default budget")
        report.notes.append(f"magi_device_memory not implemented: the device's memory is read from {how}")
    if "magi_limit_device_memory" not in rec.callers:
        report.notes.append("magi_limit_device_memory not implemented: capping the process's device memory "
                            "(magi_core.limit_device_memory, magi bench --device-memory) is refused for this backend")
    elif "magi_device_memory" not in rec.callers:
        report.add("magi_device_memory", "missing while magi_limit_device_memory is implemented: a cap would not show "
                   "in Backend.device_memory() (mem_get_info reports the whole device)",
                   "implement magi_device_memory reporting the cap as total (magi_core.plugin.FractionCap does both)")


def check_backend(name: str, records: dict[str, BackendRecord] | None = None) -> CheckReport:
    """Load backend ``name`` (already discovered) and check it: hooks, probe, device module, aliases, capabilities."""
    records = REGISTRY.records() if records is None else records
    report = CheckReport(name)
    rec = records.get(name)
    if rec is None:
        installed = ", ".join(sorted(records)) or "none"
        report.add("install", f"no backend named {name!r} is installed (installed: {installed})",
                   f"pip install the package that provides it (conventionally {package_hint(name)}), or check the "
                   "entry point's name under [project.entry-points.\"magi.backends\"]")
        return report
    if rec.load_error is not None:
        report.add("load", f"{rec.entry_point} could not be loaded: {type(rec.load_error).__name__}: {rec.load_error}",
                   "fix the import or the hook signature (`magi -v backends --check` shows the traceback)")
        return report
    for hook in rec.unknown_hooks:
        report.add(hook, f"is not a hook of spec {HOOKSPEC_VERSION} (never called)",
                   f"rename it to the hook you mean ({HOOK_REFERENCE}) or drop the @hookimpl marker")
    for hook in rec.missing_required:
        report.add(hook, "required hook missing (the backend is refused)", "implement it with @hookimpl")
    if rec.missing_required:
        return report
    if not rec.spec_compatible:
        major = HOOKSPEC_VERSION.split(".")[0]
        report.add("magi_hookspec_versions", rec.problem or "incompatible", f'return ("{major}",)')
        return report
    if rec.probe_error is not None:
        report.add("magi_probe", f"raised {type(rec.probe_error).__name__}: {rec.probe_error}",
                   "return ProbeResult(available=False, reason=...) instead of raising")
    absent = rec.probe_error is None and rec.probe is not None and not rec.probe.available
    if absent:  # not a fault of the backend: what needs the device is skipped, said as such
        assert rec.probe is not None
        report.skipped.append(
            f"the device: magi_probe reports it unavailable here ({rec.probe.reason or 'no reason given'}); run the "
            "check where the device is present to check the device module against it"
        )
    if ("magi_range_push" in rec.callers) != ("magi_range_pop" in rec.callers):
        have, lack = (("magi_range_push", "magi_range_pop") if "magi_range_push" in rec.callers
                      else ("magi_range_pop", "magi_range_push"))
        report.add(lack, f"missing while {have} is implemented: the executor then uses no-op ranges",
                   f"implement {lack} too, or neither")
    _check_aliases(report, rec)
    ok, module = _call(report, rec, "magi_device_module")
    if ok:
        found = check_device_module(module)
        if absent:  # e.g. the placeholder classes of a torch build without that accelerator: not conclusive here
            report.skipped += [f"{p.hook}: {p.what} (without the device this may be a placeholder; where the "
                               f"device is present, fix: {p.fix})" for p in found]
        else:
            report.problems += found
    _check_capabilities(report, rec)
    _check_device_memory(report, rec, module if ok else None)
    is_init = getattr(module, "is_initialized", None) if ok else None
    if callable(is_init):
        try:
            report.initialised = bool(is_init())
        except Exception as exc:
            report.add("magi_device_module", f"is_initialized() raised {type(exc).__name__}: {exc}",
                       "make is_initialized() answer without initialising")
        if report.initialised and rec.device_type == "cpu":
            report.notes.append("device type 'cpu': the host needs no initialisation (is_initialized() answers "
                                "True for it), so the check cannot blame the probe for it")
        elif report.initialised:
            report.add("magi_probe", "the device is initialised after probing and loading the backend (a forked "
                                     "child could no longer use it)",
                       "initialise nothing in magi_probe, magi_device_module or magi_capabilities: count devices "
                       "without creating a context, and defer runtime set-up to the first stream or allocation")
    return report


__all__ = ["CheckReport", "Problem", "check_backend", "check_device_module"]
