"""Detect model code that branches on the device type while Dynamo traces it with host tensors.

Hazard: the offload backend receives a graph Dynamo traced with the weights on the
host, so ``if x.is_<accelerator>:`` or ``if x.device.type == "<accelerator>":`` took its host branch at
trace time, silently and for good (a fused accelerator kernel is never used). Dynamo does not record the
branch in the graph, and its tensor guards cover the device without naming the test, so the check reads
the code objects Dynamo traced (``TracingContext.traced_code``): a ``Tensor.is_<device>`` attribute, or
``.type`` together with a device-type string constant, triggers a one-time warning naming the function.
It can miss branches hidden behind helpers Dynamo did not trace, and may flag a harmless ``.type`` use.
Fix in model code: decide the path from a config flag or ``magi_core.get_backend().device_type`` rather
than from the tensor's device.
"""

from __future__ import annotations

import functools
import logging
import types
import warnings
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

_warned: set[tuple[str, str, int]] = set()


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


def _walk(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _walk(const)


def device_branch_reasons(code: types.CodeType) -> list[str]:
    """What in ``code`` looks like a device-type branch (empty when nothing does)."""
    kinds = device_type_names()
    flags = {f"is_{k}" for k in kinds}
    reasons: list[str] = []
    for c in _walk(code):
        names = set(c.co_names)
        hit = sorted(names & flags)
        if hit:
            reasons.append(f"reads Tensor.{', Tensor.'.join(hit)}")
        if "device" in names and "type" in names:
            consts = sorted(k for k in c.co_consts if isinstance(k, str) and k in kinds)
            if consts:
                reasons.append(f"compares device.type with {', '.join(map(repr, consts))}")
    return reasons


def traced_code() -> list[types.CodeType]:
    """Code objects Dynamo traced into the graph being compiled now (empty outside a Dynamo compile)."""
    try:
        from torch._guards import TracingContext

        ctx = TracingContext.try_get()
        return list(getattr(ctx, "traced_code", None) or []) if ctx is not None else []
    except Exception:  # noqa: BLE001 - a private API: detection is best effort
        return []


def warn_device_branches(codes: Iterable[types.CodeType] | None = None) -> list[str]:
    """Warn once per function that seems to branch on the device type; return the messages issued now."""
    messages = []
    for code in traced_code() if codes is None else codes:
        key = (code.co_filename, code.co_name, code.co_firstlineno)
        if key in _warned:
            continue
        reasons = device_branch_reasons(code)
        if not reasons:
            continue
        _warned.add(key)
        msg = (
            f"{code.co_name} ({code.co_filename}:{code.co_firstlineno}) {'; '.join(reasons)}. The magi offload "
            "backend traces with weights on the host, so a device-type branch took its host path for good; "
            "choose the path from a flag or magi_core.get_backend().device_type instead of the tensor's device"
        )
        logger.warning(msg)
        messages.append(msg)
    return messages
