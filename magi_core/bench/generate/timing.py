"""Timing one greedy ``generate``: the prefill, each decode step, and the host time inside each forward call.

transformers calls the logits processors once per new token, right after the forward that produced its logits;
:class:`StepClock` waits there for the stream that computed them and takes the time, so the first stamp ends the
prefill and each next one ends a decode step (the step's forward, its bookkeeping in ``generate`` and its token
choice). ``generate`` itself waits on that stream once per step (it checks on the host whether every sequence
finished), so the clock adds no wait of its own. It never waits for the whole device: copies a step issued for the
next one (magi-core's prefetch on its copy stream) run on while the host prepares that step, as in a user's
``generate``; a device-wide wait would drain them at every token and leave the copy stream idle while the next
step's first units are launched. :class:`ForwardTimer` wraps the model's forward to take the host time of
each call and, on magi-core, the time the executors blocked waiting for their copies (their host-lead limit): what
is left is the host's own work per step.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class StepClock:
    """A logits processor that only takes the time, after ``synchronize`` (the compute stream's), once per new
    token."""

    def __init__(self, synchronize: Callable[[], None]) -> None:
        self._sync = synchronize
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._sync()
        self.stamps.append(time.perf_counter())
        return scores


class ForwardTimer:
    """Wraps the model's call (from here until :meth:`restore`): host ms of each call and, with ``waits`` (total ns
    the executors blocked so far), the ms each call blocked.

    What is wrapped is what ``model(...)`` runs, outside anything compiled: the compiled call a model holds
    (``_compiled_call_impl``: magi-core's offloaded forward, which traces ``forward`` itself), else ``forward``
    (a forward ``torch.compile``'d by hand, accelerate's hooked forward, an eager one).
    """

    def __init__(self, model: nn.Module, waits: Callable[[], int] | None = None) -> None:
        self.model = model
        self.attr = "_compiled_call_impl" if getattr(model, "_compiled_call_impl", None) is not None else "forward"
        self._had_own = self.attr in model.__dict__
        inner = getattr(model, self.attr)
        self._inner = inner
        self.host_ms: list[float] = []
        self.blocked_ms: list[float] = []

        @functools.wraps(inner)  # generate reads the forward's signature (cache_position, logits_to_keep, ...)
        def timed(*args: Any, **kwargs: Any) -> Any:
            w0 = waits() if waits is not None else 0
            t0 = time.perf_counter_ns()
            out = inner(*args, **kwargs)
            self.host_ms.append((time.perf_counter_ns() - t0) / 1e6)
            if waits is not None:
                self.blocked_ms.append((waits() - w0) / 1e6)
            return out

        setattr(model, self.attr, timed)

    def restore(self) -> None:
        """Put the model's own call back."""
        if self._had_own:
            setattr(self.model, self.attr, self._inner)
        else:
            delattr(self.model, self.attr)


@dataclass(frozen=True)
class GenerateTiming:
    """What one timed ``generate`` took and produced."""

    prefill_ms: float
    decode_ms: list[float]
    """Each decode step (new tokens after the first), in order."""
    total_ms: float
    tokens: list[list[int]]
    """The new token ids of each sequence."""
    forward_host_ms: list[float]
    forward_blocked_ms: list[float]

    @property
    def decode_median_ms(self) -> float | None:
        """Median decode step (None with a single new token)."""
        return statistics.median(self.decode_ms) if self.decode_ms else None

    def decode_host_ms(self) -> tuple[float | None, float | None]:
        """Median host ms inside the forward of a decode step, and the median ms of it spent blocked on copies."""
        host = self.forward_host_ms[1:]  # the first forward is the prefill
        blocked = self.forward_blocked_ms[1:]
        return (statistics.median(host) if host else None, statistics.median(blocked) if blocked else None)


def generate(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, cache: str,
             processors: list[Any] | None = None, **kwargs: Any) -> Any:
    """Greedy ``model.generate`` of ``new_tokens`` tokens (``cache``: dynamic or static) under ``no_grad``."""
    from transformers import LogitsProcessorList

    if cache == "static":
        kwargs["cache_implementation"] = "static"
    run: Any = model.generate  # transformers' GenerationMixin: nn.Module's typing does not know it
    with torch.no_grad():
        return run(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, use_cache=True,
                   logits_processor=LogitsProcessorList(processors or []), return_dict_in_generate=True, **kwargs)


@contextmanager
def timed_forward(model: nn.Module, waits: Callable[[], int] | None) -> Iterator[ForwardTimer]:
    """Time every forward call of ``model`` inside the block."""
    timer = ForwardTimer(model, waits)
    try:
        yield timer
    finally:
        timer.restore()


def timed_generate(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, cache: str,
                   synchronize: Callable[[], None], waits: Callable[[], int] | None = None,
                   step_synchronize: Callable[[], None] | None = None, **kwargs: Any) -> GenerateTiming:
    """One greedy ``generate`` between two device synchronisations, the time taken after every new token once
    ``step_synchronize`` (the compute stream's wait; default ``synchronize``) returns."""
    clock = StepClock(step_synchronize or synchronize)
    with timed_forward(model, waits) as timer:
        synchronize()
        t0 = time.perf_counter()
        out = generate(model, ids, mask, new_tokens, cache, [clock], **kwargs)
        synchronize()
        total = time.perf_counter() - t0
    if not clock.stamps:
        raise RuntimeError("generate produced no token: the step clock was never called")
    stamps = clock.stamps
    return GenerateTiming(
        prefill_ms=(stamps[0] - t0) * 1e3,
        decode_ms=[(b - a) * 1e3 for a, b in zip(stamps, stamps[1:], strict=False)],
        total_ms=total * 1e3,
        tokens=out.sequences[:, ids.shape[1]:].tolist(),
        forward_host_ms=list(timer.host_ms),
        forward_blocked_ms=list(timer.blocked_ms),
    )
