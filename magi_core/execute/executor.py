"""The offload executor: runs a split graph unit by unit while weights stream in on a copy stream.

Per step: inputs are prepared (:mod:`.inputs`), resident weights the plan has no copy of yet copied first
(:mod:`.residency`), copy batches issued where the plan's precomputed action lists say (:mod:`.actions`), each
unit launched on the compute stream after waiting on its weights' copy events only, and each streamed weight
handed back after its last user with ``record_stream``. Just before each unit, the resident weights it uses first
are checked for host edits (:mod:`.freshness`) and refreshed where they changed: past the first unit that check
overlaps the device's work. The warm-up state machine (:mod:`magi_core.compile.runtime`) swaps in the static plan.

Runs under ``torch.no_grad()``: the offload runtime is for inference.

Copies issued before unit ``i`` (the plan's ``prefetch_at[i]``, on-demand copies, and the next step's carry
at the last unit) start on the device no earlier than unit ``i`` does: the copy stream waits on an event
recorded on the compute stream just before unit ``i`` is launched. The scheduler's predicted peak memory
assumes exactly this; without the gate a copy could start as soon as the host issued it.

With a transfer that allocates per fetch (:class:`~magi_core.execute.transfer.PerTensorTransfer`), the host
never runs more than :data:`HOST_LEAD_UNITS` units ahead of the device before issuing copies, so
allocations of streamed weights stay within the plan's working set plus about one unit (a transfer whose
device memory is fixed by the plan, :class:`~magi_core.execute.transfer.UnitTransfer`, needs no such limit:
the host enqueues the whole step without blocking). It adds no bubble:
in a transfer-bound steady state unit ``i - HOST_LEAD_UNITS`` ends about when its own weights' copy ends,
at least one full copy before the copy stream drains, so the next copy is always queued in time.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from magi_core.errors import MagiError
from magi_core.execute.actions import StepActions, build_actions
from magi_core.execute.freshness import WeightWatch
from magi_core.execute.inputs import InputPreparer
from magi_core.execute.program import build_program
from magi_core.execute.residency import RESIDENT, ResidentSet, ResidentStore
from magi_core.execute.transfer import PerTensorTransfer, UnitTransfer, WeightTransfer
from magi_core.execute.transfer.shared import SharedBuffer
from magi_core.execute.unit_compile import CompiledUnits, UnitFn, unit_callable
from magi_core.passes.units import SplitGraph
from magi_core.plan.contract import Plan
from magi_core.plugin.facade import Backend

logger = logging.getLogger(__name__)

#: Before issuing copies at unit ``i``, the host waits until unit ``i - HOST_LEAD_UNITS`` has finished
#: (a fixed property of the executor, not a tuning knob: it bounds the streamed allocations pending on the
#: copy stream; 2 leaves a unit of slack for host jitter before the copy stream could run dry).
HOST_LEAD_UNITS = 2

#: Why a step of a closed executor is refused.
RELEASED = ("this offloaded model was released (magi_core.release) while the call was on its way; its weights are "
            "gone. Offload a fresh model, or release with restore=True to keep using it on the host")

#: Transfers by ``OffloadConfig.transfer`` name.
TRANSFER_KINDS: dict[str, Callable[[Backend, torch.device], WeightTransfer]] = {
    "per_tensor": PerTensorTransfer,
    "unit": UnitTransfer,
}
#: The transfer "auto" (the default) means when set; None: :class:`UnitTransfer` on accelerators, and
#: :class:`PerTensorTransfer` on the host backend (whose "copies" are the host tensors themselves).
DEFAULT_TRANSFER: Callable[[Backend, torch.device], WeightTransfer] | None = None


def make_transfer(name: str | None, backend: Backend, device: torch.device) -> WeightTransfer:
    """The transfer ``OffloadConfig.transfer`` names ("auto" or None: by backend kind, see :data:`DEFAULT_TRANSFER`)."""
    if name in (None, "auto"):
        if DEFAULT_TRANSFER is not None:
            return DEFAULT_TRANSFER(backend, device)
        return (UnitTransfer if backend.is_accelerator else PerTensorTransfer)(backend, device)
    return TRANSFER_KINDS[name](backend, device)


class ExecutorSuspended(MagiError):
    """A step reached an executor that gave its device memory up (:meth:`OffloadExecutor.suspend`): its runtime
    installs a plan again and runs the step then."""


class UnitTimerLike:
    """What the executor needs of a unit timer: ``start(i)`` / ``stop(i)`` around each unit's launch."""

    def start(self, index: int) -> None:  # pragma: no cover - protocol
        """Mark the start of unit ``index`` on the compute stream."""

    def stop(self, index: int) -> None:  # pragma: no cover - protocol
        """Mark the end of unit ``index`` on the compute stream."""


@dataclass
class _Carry:
    devs: list[torch.Tensor]
    event: Any


def _drop_carry(ref: weakref.ref[OffloadExecutor]) -> None:
    """Forget an executor's carried copies (their buffer is being replaced; its next step copies them again)."""
    ex = ref()
    if ex is not None:
        ex._carry = {}


@dataclass
class StepStats:
    """Counters of the executor (cumulative): steps run and, while measured, host waits."""

    steps: int = 0
    #: ns the host blocked on the host-lead limit (counted only while ``measure_host_waits`` is set).
    host_wait_ns: int = 0


class OffloadExecutor:
    """Callable that runs one split graph with streamed weights; ``set_plan`` installs a transfer plan."""

    def __init__(
        self,
        split: SplitGraph,
        backend: Backend,
        device: torch.device,
        unit_compiler: str = "eager",
        store: ResidentStore | None = None,
        direct_unit_calls: bool = True,
        transfer: WeightTransfer | str | None = None,
    ) -> None:
        self.split = split
        self.backend = backend
        self.device = device
        self.units = split.units
        self.n_units = len(split.units)
        self.program = build_program(split)
        weight_inputs = frozenset(w.input_index for u in split.units for w in u.weights) | frozenset(split.weights)
        self.weight_inputs = weight_inputs
        self.inputs = InputPreparer(device, self.program.n_inputs, sorted(weight_inputs))
        #: Every weight copy goes through this (the transfer seam, :mod:`.transfer`).
        if transfer is None or isinstance(transfer, str):
            transfer = make_transfer(transfer, backend, device)
        self.transfer: WeightTransfer = transfer
        dm = backend.device_module
        self._current_stream = dm.current_stream
        self._done = [dm.Event() for _ in range(self.n_units)]
        #: Recorded on the compute stream just before unit i's launch; the copy stream waits on it.
        self._launch = [dm.Event() for _ in range(self.n_units)]
        self._store = store if store is not None else RESIDENT
        #: Per unit: True once its Inductor code is called directly, False when wrapped, None before compiling.
        self.direct_units: list[bool | None] = [None] * len(split.units)
        #: Inductor code by unit structure: the units of identical blocks compile once.
        self.compiled_units = CompiledUnits()
        #: One boxed callable per unit (takes a fresh list of its arguments, which it may clear).
        self.fns: list[UnitFn] = [
            unit_callable(u.module, u.attr, unit_compiler, self._installer(u.index), direct_unit_calls,
                          self.compiled_units)
            for u in split.units
        ]
        template: list[Any] = [None] * self.program.n_slots
        for s, value in self.program.constants:
            template[s] = value
        self._template = template
        #: Resolved once: the executor runs outside compiled regions (Dynamo calls it with tracing disabled).
        self._ranges = backend.range_fns()
        self._range_names = tuple(f"magi.unit{u.index}:{getattr(u, 'label', '') or u.attr}" for u in split.units)
        self._carry: dict[int, _Carry] = {}
        self.stats = StepStats()
        #: Count the time the host blocks before issuing copies in ``stats.host_wait_ns`` (diagnostics).
        self.measure_host_waits = False
        self.plan: Plan | None = None
        self.actions: StepActions | None = None
        self.resident: ResidentSet | None = None
        #: Notice host weights that changed between calls (copies kept across calls): the carried weights' watch,
        #: asked at step start, and per unit one for the resident weights it uses first, asked just before its
        #: launch (the sampling reads host memory far apart: past the first unit it overlaps the device's work).
        self._carry_watch = WeightWatch(())
        #: Per unit: the positions in :attr:`resident` of the weights it uses first and their watch, or None.
        self._checks: tuple[tuple[range, WeightWatch] | None, ...] = ()
        self._sync_before: tuple[int, ...] = ()
        self._gate: tuple[bool, ...] = ()
        #: One step at a time: the copy stream, events, carried copies and the transfer's places are shared.
        self._lock = threading.Lock()
        #: Set by :meth:`close`: steps are refused from then on.
        self.closed = False
        self._suspended = False  # holds nothing until the next plan (suspend)

    def _installer(self, index: int) -> Callable[[UnitFn, bool], None]:
        def install(fn: UnitFn, direct: bool) -> None:
            self.fns[index] = fn
            self.direct_units[index] = direct

        return install

    # -- plan -----------------------------------------------------------------------------------------
    def join_model(self, lock: Any, shared: SharedBuffer) -> None:
        """Run steps under the model's step lock (one step of its runtimes at a time) and, where the transfer
        can, place copies in the model's shared buffer for this device (before this executor's first step)."""
        with lock:
            self._lock = lock
            share = getattr(self.transfer, "share", None)
            if share is not None and getattr(self.transfer, "shareable", False):
                me = weakref.ref(self)
                self.transfer.on_forget = lambda: _drop_carry(me)  # type: ignore[attr-defined]
                share(shared)

    def set_plan(self, plan: Plan) -> StepActions:
        """Install ``plan``: precompute its action lists and acquire its resident weights lazily."""
        with self._lock:  # not during a step of the model's runtimes (the shared buffer may grow)
            return self._set_plan(plan)

    def footprint(self, plan: Plan) -> tuple[StepActions, int]:
        """``plan``'s action lists and the bytes of the copy buffer the transfer would need for them (0 for one
        that allocates per copy), without installing anything."""
        actions = build_actions(self.units, plan, self.transfer.nbytes)
        need = getattr(self.transfer, "buffer_need", None)
        return actions, int(need(actions, self._batch_sizes(actions))) if need is not None else 0

    def weights_changed(self) -> None:
        """Copy every device copy kept across calls again at the next call (edits the checks cannot see)."""
        self._carry_watch.force()
        for check in self._checks:
            if check is not None:
                check[1].force()

    def _batch_sizes(self, actions: StepActions) -> list[list[int]]:
        nbytes = {w.input_index: w.nbytes for u in self.units for w in u.weights}
        return [[nbytes[w] for w in ws] for ws in actions.batches]

    def _set_plan(self, plan: Plan) -> StepActions:
        actions = build_actions(self.units, plan, self.transfer.nbytes)
        self._suspended = False
        self.transfer.set_actions(actions, self._batch_sizes(actions))
        old = self.resident
        first_use = actions.resident_at
        self.resident = ResidentSet(self._store, self.device, tuple(w for ws in first_use for w in ws))
        if old is not None:
            old.close(self.transfer, self._current_stream())
        self._carry = {}
        self.plan = plan
        self.actions = actions
        carried = [w for b in actions.carry for w in actions.batches[b]]
        self._carry_watch = WeightWatch(tuple(dict.fromkeys(carried)))
        checks: list[tuple[range, WeightWatch] | None] = []
        at = 0
        for ws in first_use:
            checks.append((range(at, at + len(ws)), WeightWatch(ws)) if ws else None)
            at += len(ws)
        self._checks = tuple(checks)
        event = self.backend.device_module.Event
        # one event per copy batch, re-recorded each step (a wait already enqueued is not affected)
        self._batch_events = [event() for _ in actions.batches]
        self._carry_events = {b: event() for b in actions.carry}
        n = self.n_units
        # positions that issue copies: gated on the compute stream; a transfer that allocates per fetch also
        # makes the host wait for the unit HOST_LEAD_UNITS before them
        self._gate = tuple(bool(actions.issue[u]) or (u == actions.carry_unit and bool(actions.carry))
                           for u in range(n))
        wait = self.transfer.allocates
        sync = [u - HOST_LEAD_UNITS if copies and wait else -1 for u, copies in enumerate(self._gate)]
        self._sync_before = tuple(sync)
        self._record_done = tuple(any(s == u for s in sync) for u in range(n))
        logger.debug(
            "magi offload plan %s: %d resident weights (%d B), %d B streamed per step in %d batches",
            plan.policy, len(actions.resident), actions.resident_bytes, actions.streamed_bytes, len(actions.batches),
        )
        return actions

    def suspend(self) -> bool:
        """Hold nothing on the device until the next :meth:`set_plan`: the plan's resident copies, carried copies and
        copy buffer go (after the work queued on them). False, and nothing changes, where the transfer cannot give
        its buffer up or must keep step with other ranks (the exchange)."""
        release = getattr(self.transfer, "release_buffer", None)
        if release is None or getattr(self.transfer, "collective", False):
            return False
        with self._lock:  # not during a step of the model's runtimes
            self._drop_held()
            release()
            self.resident = None
            self.plan = None
            self.actions = None
            self._suspended = True
        return True

    def _drop_held(self) -> None:
        """Hand the resident copies back (stream-ordered) and forget the carried ones and what the watch knew."""
        if self.resident is not None:
            self.resident.close(self.transfer, self._current_stream())
        self._carry = {}
        self._carry_watch = WeightWatch(())
        self._checks = ()

    def close(self) -> None:
        """Release resident weights and carried prefetches, after the step running now (if any); later steps are
        refused with a :class:`MagiError` saying the model was released."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        self.closed = True
        self._drop_held()
        self.transfer.close()

    def __del__(self) -> None:
        try:
            self._close()  # unreferenced: no step runs on it, and the model's step lock may be held by this thread
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- one step -------------------------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        """Run one step with the installed plan."""
        return self.run(args, None)

    def run(self, args: Sequence[Any], timer: UnitTimerLike | None) -> Any:
        """Run one step; ``timer`` (profiling calls only) brackets every unit on the compute stream."""
        with self._lock, torch.no_grad():
            if self.closed:
                raise MagiError(RELEASED)
            actions = self.actions
            resident = self.resident
            if actions is None or resident is None:
                if self._suspended:
                    raise ExecutorSuspended("this executor holds nothing on the device (suspend); set a plan first")
                raise RuntimeError("OffloadExecutor.run called before set_plan(); install a plan first")
            env = self._template.copy()
            self.inputs.fill(args, env)
            compute = self._current_stream()
            changed = self._carry_watch.changed(args)
            made_now = frozenset() if resident.complete else resident.acquire(args, self.transfer, compute)
            events: list[Any] = [None] * len(actions.batches)
            try:
                if self.transfer.begin_step(args):  # another runtime of the model wrote the shared buffer
                    self._carry = {}
                self._start(args, env, events, actions, changed)
                self._units(args, env, events, actions, compute, resident, made_now, timer)
            except BaseException:
                self._carry = {}
                self.transfer.abort()
                raise
            self.stats.steps += 1
            return self.program.build_output(env)

    def _start(
        self, args: Sequence[Any], env: list[Any], events: list[Any], actions: StepActions, changed: set[int]
    ) -> None:
        carry, self._carry = self._carry, {}
        batches = actions.batches
        for b in actions.start:
            c = carry.get(b)
            ws = batches[b]
            if c is not None and not changed.intersection(ws):  # the watch covers carried weights: same tensors
                for w, t in zip(ws, c.devs, strict=True):
                    env[w] = t
                events[b] = c.event
            else:
                self._issue(b, args, env, events, batches)

    def _issue(self, b: int, args: Sequence[Any], env: list[Any], events: list[Any], batches: Any) -> None:
        ws = batches[b]
        devs, ev = self.transfer.fetch([args[w] for w in ws], self._batch_events[b], b)
        for w, t in zip(ws, devs, strict=True):
            env[w] = t
        events[b] = ev

    def _issue_carry(self, args: Sequence[Any], actions: StepActions) -> None:
        for b in actions.carry:
            hosts = [args[w] for w in actions.batches[b]]
            devs, ev = self.transfer.fetch(hosts, self._carry_events[b], b)
            self._carry[b] = _Carry(devs, ev)

    def _units(
        self,
        args: Sequence[Any],
        env: list[Any],
        events: list[Any],
        actions: StepActions,
        compute: Any,
        resident: ResidentSet,
        made_now: frozenset[int],
        timer: UnitTimerLike | None,
    ) -> None:
        layouts = self.program.units
        checks, transfer = self._checks, self.transfer
        fns = self.fns
        done = self._done
        launch = self._launch
        gate = self._gate
        copy_wait = self.transfer.copy_stream.wait_event
        sync_before = self._sync_before
        record_done = self._record_done
        batches = actions.batches
        release = self.transfer.release
        range_push, range_pop = self._ranges
        names = self._range_names
        carry_unit, carry = actions.carry_unit, actions.carry
        timed_waits = self.measure_host_waits
        for u, lay in enumerate(layouts):
            issue = actions.issue[u]
            if sync_before[u] >= 0:
                if timed_waits:
                    t0 = time.perf_counter_ns()
                    done[sync_before[u]].synchronize()
                    self.stats.host_wait_ns += time.perf_counter_ns() - t0
                else:
                    done[sync_before[u]].synchronize()
            if gate[u]:  # these copies start on the device no earlier than unit u
                launch[u].record(compute)
                copy_wait(launch[u])
            for b in issue:
                self._issue(b, args, env, events, batches)
            if u == carry_unit and carry:
                self._issue_carry(args, actions)
            for b in actions.wait[u]:
                compute.wait_event(events[b])
            check = checks[u]
            if check is not None:  # the resident weights this unit uses first: edited on the host since last call?
                part, watch = check
                try:
                    resident.fill(args, env, transfer, compute, watch.changed(args), part, made_now)
                except BaseException:
                    watch.force()  # what it saw changed may not be copied: look at all of them again next call
                    raise
            range_push(names[u])
            if timer is not None:
                timer.start(u)
            result = fns[u]([env[s] for s in lay.arg_slots])
            if timer is not None:
                timer.stop(u)
            range_pop()
            if record_done[u]:
                done[u].record(compute)
            if lay.result_slot is not None:
                env[lay.result_slot] = result
            for idx, dst in lay.getitems:
                env[dst] = result[idx]
            for w in actions.free[u]:
                release(env[w], compute)
                env[w] = None
            for s in lay.drop_after:
                env[s] = None
