"""The offload handle: the one object that owns what offloading made for a model, and its statistics.

:func:`magi_core.offload` attaches an :class:`OffloadHandle` to the model (``magi_core.handle(model)``). It
holds the host weights, the Dynamo backend bound to this model (:attr:`OffloadHandle.backend`), the runtimes
that backend compiled (one per graph Dynamo hands it: input shapes, guards) and their figures.
:meth:`OffloadHandle.release` frees everything: the resident device copies of every runtime, the registered
host ranges and the host mappings. Nothing is kept in module-level lists.

``torch.compile(model, backend=h.backend, options={...})`` with a fresh ``OffloadHandle()`` gives the same
view for a model compiled by hand (``backend="magi_offload"`` compiles without a handle).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch.fx

from magi_core.compile.backend import magi_offload_backend
from magi_core.errors import MagiError
from magi_core.execute.transfer.shared import SharedBuffer

if TYPE_CHECKING:
    from magi_core.compile.device_inputs import OffloadedForward
    from magi_core.compile.runtime import OffloadRuntime
    from magi_core.compile.submodules import SubmoduleEntry
    from magi_core.config import OffloadConfig
    from magi_core.host.materialize import HostWeights


@dataclass(frozen=True)
class RuntimeStats:
    """Figures of one compiled runtime (one Dynamo graph) at the time they were read."""

    units: int
    """Units the graph is split into (each runs with its weights resident or streamed)."""
    phase: str
    """``"warmup"``, ``"profile"`` (the warm-up call that times each unit), ``"planned"`` (the static plan runs) or
    ``"idle"`` (still warming up, holding nothing on the device since another graph of the model planned; its next
    call warms it up again) or ``"yielded"`` (planned, holding nothing since it gave its device memory to another
    graph of the model that could not run in what was left; its next call plans it again)."""
    steps: int
    """Calls of the graph run so far, warm-up calls included."""
    policy: str | None
    """The static plan's policy, e.g. ``"HEURISTIC"`` (None before planning)."""
    resident_bytes: int | None
    """Weight bytes the installed plan keeps on the device (None before a plan is installed)."""
    streamed_bytes_per_step: int | None
    """Weight bytes the installed plan copies to the device per step (None before a plan is installed)."""
    streamed_bytes_total: int
    """Weight bytes copied from the host so far, every step included."""
    weight_copies: int
    """Weights (host tensors) copied to the device so far."""
    predicted_step_ms: float | None
    """The static plan's steady-state step time at the planning bandwidth (None before planning)."""
    predicted_stall_ms: float | None
    """Time per step the static plan predicts compute waits for weights (None before planning)."""
    bandwidth_GBps: float | None
    """The host-to-device rate the plan was made from, in GB/s, before the safety factor (None before planning)."""
    copy_calls: int = 0
    """Host-to-device copy calls issued so far (one per unit and host storage with the unit transfer)."""
    transfer_buffer_bytes: int = 0
    """Device bytes the transfer holds for streamed weights (the unit transfer's planned buffer; 0 otherwise)."""
    predicted_peak_bytes: int | None = None
    """What the static plan holds on the device at peak: resident weights, copy buffer (or weights in flight) and
    the activations measured in warm-up (None before planning)."""
    measured_peak_bytes: int | None = None
    """Device memory a measured planned step held at peak: the weights held before it plus what it allocated (the
    second step after planning; None before it ran, or where the device module has no peak statistics)."""
    activation_bytes: int = 0
    """Device bytes a warm-up call allocated beyond its weights (activations, workspaces)."""
    device_budget_bytes: int | None = None
    """The device budget the plan was fitted to: what the device could spare, or the budget given (None: none)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for JSON."""
        return asdict(self)


#: Why an offloaded model cannot be deep-copied or pickled, and what to do instead.
NOT_COPYABLE = (
    "{name} is offloaded: its weights live in this process's pinned host mappings and its forward in runtimes "
    "compiled for them, which cannot be copied or pickled. Save or copy the weights instead "
    "(model.state_dict() works on an offloaded model; torch.save(model.state_dict(), ...)), or deep-copy the "
    "model before magi_core.offload, or after magi_core.release(model, restore=True)"
)


class OffloadHandle:
    """What offloading made for one model: host weights, compiled runtimes and their statistics."""

    def __init__(self, name: str = "model", config: OffloadConfig | None = None) -> None:
        self.name = name
        self.config = config
        self.host: HostWeights | None = None
        """The model's weights in host memory (``None`` when the handle only tracks a hand-compiled model)."""
        self.forward: OffloadedForward | None = None
        """The host-side forward ``offload`` installed on the model."""
        self.methods: dict[str, OffloadedForward] = {}
        """The other methods ``offload(..., methods=...)`` installed, by name."""
        self.submodules: dict[str, SubmoduleEntry] = {}
        """What a direct call of each submodule holding weights runs, by qualified name."""
        self.submodule_forwards: dict[str, Callable[..., Any]] = {}
        """The submodules' offloaded forwards compiled so far (on a direct call with device inputs), by name."""
        self.released = False
        self._lock = threading.Lock()
        self._plan_lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._buffers: dict[str, SharedBuffer] = {}
        self._runtimes: list[weakref.ref[OffloadRuntime]] = []
        self._compiles = 0
        self.backend = _BoundBackend(self)
        """The ``magi_offload`` Dynamo backend bound to this handle (``torch.compile(model, backend=...)``): every
        graph it compiles is recorded here."""

    # -- runtimes ----------------------------------------------------------------------------------
    def add_runtime(self, runtime: OffloadRuntime) -> None:
        """Record a runtime the bound backend compiled (weakly: Dynamo's cache owns it)."""
        with self._lock:
            self._compiles += 1
            self._runtimes = [r for r in self._runtimes if r() is not None]
            self._runtimes.append(weakref.ref(runtime))
        # the model's runtimes share its device budget and plan one at a time; they run one step at a time, in
        # one copy buffer per device
        ref = weakref.ref(self)
        runtime.peers = lambda: h.runtimes if (h := ref()) is not None else []
        runtime.plan_lock = self._plan_lock
        ex = runtime.executor
        with self._lock:
            shared = self._buffers.get(str(ex.device))
            if shared is None:
                b = ex.backend
                shared = self._buffers[str(ex.device)] = SharedBuffer(b.record_stream, b.device_module.Event)
        ex.join_model(self._step_lock, shared)

    @property
    def runtimes(self) -> list[OffloadRuntime]:
        """The runtimes compiled for this model that are still alive, oldest first."""
        with self._lock:
            return [r for r in (ref() for ref in self._runtimes) if r is not None]

    @property
    def runtime(self) -> OffloadRuntime:
        """The most recently compiled live runtime (the one serving the last new input shape)."""
        live = self.runtimes
        if not live:
            raise MagiError(f"{self.name}: nothing compiled yet; call the offloaded model once first")
        return live[-1]

    @property
    def compile_count(self) -> int:
        """How many graphs were compiled for this model (recompiles included)."""
        return self._compiles

    def stats(self) -> list[RuntimeStats]:
        """Figures of every live runtime, oldest first."""
        return [runtime_stats(r) for r in self.runtimes]

    def weights_changed(self) -> None:
        """Re-copy every device copy kept across calls at the next call (after edits the checks cannot see)."""
        for runtime in self.runtimes:
            runtime.executor.weights_changed()

    # -- lifecycle ---------------------------------------------------------------------------------
    def check_usable(self) -> None:
        """Raise a clear error once the handle was released."""
        if self.released:
            raise MagiError(
                f"{self.name} was released with magi_core.release(); its weights are gone. Offload a fresh model, "
                "or release with restore=True to keep using it on the host"
            )

    def release(self, *, restore: bool = False) -> None:
        """Free the device copies of every runtime, then unpin and unmap the host weights (idempotent)."""
        with self._lock:
            if self.released:
                return
            self.released = True
            live = [r for r in (ref() for ref in self._runtimes) if r is not None]
        for runtime in live:
            runtime.close()
        if self.host is not None:
            self.host.release(restore=restore)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise MagiError(NOT_COPYABLE.format(name=self.name))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise MagiError(NOT_COPYABLE.format(name=self.name))

    def __repr__(self) -> str:
        state = "released" if self.released else f"{len(self.runtimes)} runtime(s), {self._compiles} compile(s)"
        return f"OffloadHandle({self.name!r}, {state})"


class _BoundBackend:
    """The ``magi_offload`` Dynamo backend bound to one handle: every runtime it compiles is recorded there."""

    __name__ = "magi_offload"

    def __init__(self, handle: OffloadHandle) -> None:
        self._handle = weakref.ref(handle)

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Callable[..., Any]:
        handle = self._handle()
        if handle is not None:
            handle.check_usable()
        runtime = magi_offload_backend(gm, example_inputs, options, host=None if handle is None else handle.host,
                                       **kwargs)
        if handle is not None:
            handle.add_runtime(runtime)
        return runtime


def runtime_stats(runtime: OffloadRuntime) -> RuntimeStats:
    """The figures of one runtime now."""
    ex = runtime.executor
    actions = ex.actions
    plan = runtime.plan
    return RuntimeStats(
        units=ex.n_units,
        phase=runtime.phase,
        steps=ex.stats.steps,
        policy=None if plan is None else str(plan.policy),
        resident_bytes=None if actions is None else int(actions.resident_bytes),
        streamed_bytes_per_step=None if actions is None else int(actions.streamed_bytes),
        streamed_bytes_total=int(ex.transfer.bytes_copied),
        weight_copies=int(ex.transfer.copies),
        predicted_step_ms=None if plan is None else plan.predicted_step_ms,
        predicted_stall_ms=None if plan is None else plan.predicted_stall_ms,
        bandwidth_GBps=None if runtime.bandwidth_Bps is None else runtime.bandwidth_Bps / 1e9,
        copy_calls=int(getattr(ex.transfer, "copy_calls", ex.transfer.copies)),
        transfer_buffer_bytes=int(getattr(ex.transfer, "buffer_bytes", 0)),
        predicted_peak_bytes=runtime.predicted_peak_bytes,
        measured_peak_bytes=runtime.measured_peak_bytes,
        activation_bytes=runtime.activation_bytes,
        device_budget_bytes=runtime.device_budget_bytes,
    )
