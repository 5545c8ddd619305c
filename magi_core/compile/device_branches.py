"""Detect model code that branches on the device type while Dynamo traces it with host tensors.

Hazard: the offload backend receives a graph Dynamo traced with the weights on the host, so
``if x.is_<accelerator>:`` or ``if x.device.type == "<accelerator>":`` took its host branch at trace time,
silently and for good (a fused accelerator kernel is never used). Dynamo does not record the branch in the
graph, and its tensor guards cover the device without naming the test, so the check reads the code objects
Dynamo traced (``TracingContext.traced_code``) and looks for:

- a ``Tensor.is_<device>`` flag (``x.is_<accelerator>``, ``x.is_cpu``);
- ``Tensor.get_device()`` (-1 on the host, the device index on an accelerator);
- a device-type string (``"cpu"``, ``"<accelerator>"``, ``"<accelerator>:0"``) or a tuple / set of them
  compared on a source line of a function that reads ``.device``: ``x.device.type == ...``,
  ``x.device.type in (...)``, ``str(x.device) == ...`` / ``.startswith(...)``, ``x.device == torch.device(...)``.

Only tests that come out differently for the host (``"cpu"``, where tracing happens) and for the *target*
device type (the active backend's, :func:`target_device_type`) are reported: ``x.device.type == "mps"`` is
False on the host and on any other accelerator, so it is harmless there and stays silent (transformers and
diffusers carry such tests); on the CPU backend nothing differs, so nothing is reported. Each hazard is
reported once per function, with :func:`warnings.warn_explicit` at the function's line (category
:class:`DeviceBranchWarning`: the model code is at fault) and in the log. It can miss branches hidden behind
helpers Dynamo did not trace or values kept in variables of other functions, and may flag a harmless use.
Fix in model code: decide the path from a config flag or ``magi_core.get_backend().device_type`` rather
than from the tensor's device.
"""

from __future__ import annotations

import dis
import functools
import logging
import types
import warnings
from collections.abc import Iterable

import torch

from magi_core._once import first_time

logger = logging.getLogger(__name__)

#: Where Dynamo traces the model: its weights (and inputs, or their proxies) are host tensors.
HOST_DEVICE_TYPE = "cpu"
_COMPARE_OPS = frozenset({"COMPARE_OP", "CONTAINS_OP", "IS_OP"})
_STRING_TESTS = frozenset({"startswith", "endswith", "__eq__", "__ne__", "__contains__"})

_warned: set[tuple[str, str, int]] = set()


class DeviceBranchWarning(UserWarning):
    """Model code branches on a tensor's device type; the offloaded graph keeps the host branch."""


@functools.lru_cache(maxsize=1)
def device_type_names() -> frozenset[str]:
    """Device types ``torch.Tensor`` has an ``is_<type>`` flag for (``meta`` excluded), plus the PrivateUse1 name."""
    names = set()
    for attr in dir(torch.Tensor):
        if not attr.startswith("is_"):
            continue
        kind = attr[3:]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.device(kind)
        except (RuntimeError, ValueError):
            continue
        if kind not in ("meta", "mkldnn"):
            names.add(kind)
    names.add(torch._C._get_privateuse1_backend_name())
    return frozenset(names)


def target_device_type() -> str:
    """The device type the offloaded model runs on: the active backend's (``"cpu"`` on the CPU backend)."""
    from magi_core.plugin.manager import get_backend

    return get_backend().device_type


def _walk(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _walk(const)


def _differs(kinds: Iterable[str], target: str | None) -> bool:
    """Whether "the device type is one of ``kinds``" comes out differently on the host and on ``target``.

    ``target`` None: on some accelerator (any device type other than the host's).
    """
    kinds = set(kinds)
    if target is None:
        return bool(kinds)
    return (HOST_DEVICE_TYPE in kinds) != (target in kinds)


def _device_kinds(value: object, known: frozenset[str]) -> set[str] | None:
    """The device types a constant names (``"x"``, ``"x:0"``, or a tuple / frozenset of those), else None."""
    items = value if isinstance(value, (tuple, frozenset)) else (value,)
    kinds = set()
    for item in items:
        if isinstance(item, str) and item.split(":", 1)[0] in known:
            kinds.add(item.split(":", 1)[0])
    return kinds or None


def _line(instr: dis.Instruction, current: int | None) -> int | None:
    pos = getattr(instr, "positions", None)
    if pos is not None and pos.lineno is not None:
        return int(pos.lineno)
    number = getattr(instr, "line_number", None)  # Python 3.13
    if isinstance(number, int):
        return number
    start = instr.starts_line
    return start if isinstance(start, int) and not isinstance(start, bool) else current


def _compared_constants(code: types.CodeType) -> list[object]:
    """Constants loaded on a source line of ``code`` that also compares (==, !=, in, is, startswith, ...)."""
    by_line: dict[int | None, tuple[list[object], list[bool]]] = {}
    line: int | None = None
    for instr in dis.get_instructions(code):
        line = _line(instr, line)
        consts, compares = by_line.setdefault(line, ([], []))
        if instr.opname == "LOAD_CONST":
            consts.append(instr.argval)
        elif instr.opname in _COMPARE_OPS or (
            instr.opname in ("LOAD_ATTR", "LOAD_METHOD") and instr.argval in _STRING_TESTS
        ):
            compares.append(True)
    return [c for consts, compares in by_line.values() if compares for c in consts]


def _on(target: str | None) -> str:
    return f"on {target}" if target is not None else "on an accelerator"


def device_branch_reasons(code: types.CodeType, target: str | None = None) -> list[str]:
    """What in ``code`` looks like a device-type branch decided differently on the host and on ``target``.

    ``target`` None: on some accelerator (every device-type test that is not constant). Empty when nothing does.
    """
    known = device_type_names() | ({target} if target is not None else set())
    reasons: list[str] = []
    for c in _walk(code):
        names = set(c.co_names)
        flags = sorted(n for n in names if n.startswith("is_") and n[3:] in known and _differs({n[3:]}, target))
        if flags:
            reasons.append(f"reads Tensor.{', Tensor.'.join(flags)} (decided on the host while tracing, "
                           f"differently {_on(target)})")
        if "get_device" in names and target != HOST_DEVICE_TYPE:
            reasons.append(f"reads Tensor.get_device() (-1 on the host while tracing, the device index {_on(target)})")
        if "device" not in names:
            continue
        hits: list[str] = []
        for const in _compared_constants(c):
            kinds = _device_kinds(const, known)
            if kinds is not None and _differs(kinds, target) and repr(const) not in hits:
                hits.append(repr(const))
        if hits:
            reasons.append(f"compares the device (x.device.type, str(x.device), torch.device(...)) with "
                           f"{', '.join(hits)} (decided on the host while tracing, differently {_on(target)})")
    return reasons


def traced_code() -> list[types.CodeType]:
    """Code objects Dynamo traced into the graph being compiled now (empty outside a Dynamo compile)."""
    try:
        from torch._guards import TracingContext

        ctx = TracingContext.try_get()
        return list(getattr(ctx, "traced_code", None) or []) if ctx is not None else []
    except Exception:  # noqa: BLE001 - a private API: detection is best effort
        return []


def warn_device_branches(codes: Iterable[types.CodeType] | None = None, target: str | None = None) -> list[str]:
    """Warn once per function that seems to branch on the device type; return the messages issued now.

    ``codes``: the code objects to check (default: what Dynamo traced for the graph being compiled);
    ``target``: the device type the model runs on (default: :func:`target_device_type`). Silent when the
    target is the host: every branch is then decided as it will run.
    """
    codes = traced_code() if codes is None else list(codes)
    if not codes:
        return []
    target = target_device_type() if target is None else target
    if target == HOST_DEVICE_TYPE:
        return []
    messages = []
    for code in codes:
        key = (code.co_filename, code.co_name, code.co_firstlineno)
        if key in _warned:
            continue
        reasons = device_branch_reasons(code, target)
        if not reasons or not first_time(_warned, key):
            continue
        msg = (
            f"{code.co_name} ({code.co_filename}:{code.co_firstlineno}) {'; '.join(reasons)}. The magi offload "
            "backend traces with weights on the host, so a device-type branch took its host path for good; "
            "choose the path from a flag or magi_core.get_backend().device_type instead of the tensor's device"
        )
        logger.warning(msg)
        warnings.warn_explicit(msg, DeviceBranchWarning, code.co_filename, code.co_firstlineno)
        messages.append(msg)
    return messages
