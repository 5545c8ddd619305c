"""Per-unit action lists precomputed from a :class:`~magi_core.plan.contract.Plan` (pure, no device).

The executor's hot loop only walks these tuples: which copy batches to issue before a unit, which copy
events the compute stream waits on, and which streamed weights to free after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from magi_core.passes.units import OffloadUnit
from magi_core.plan.contract import Plan, UnitProfile

#: What moving weights of these sizes together costs in bytes (``WeightTransfer.nbytes``).
BytesFn = Callable[[Sequence[int]], int]


@dataclass(frozen=True)
class StepActions:
    """Everything the executor does with weights in one step, by unit index."""

    resident: tuple[int, ...]
    """Weight input indices copied once and kept on the device."""
    batches: tuple[tuple[int, ...], ...]
    """Copy batches: streamed weight input indices copied together, one event each."""
    batch_unit: tuple[int, ...]
    """The unit each batch was issued for (its prefetch target)."""
    start: tuple[int, ...]
    """Batch ids issued at step start unless the previous step already carried them."""
    carry: tuple[int, ...]
    """Batch ids issued before unit :attr:`carry_at` for the next step (a prefix of ``start``)."""
    issue: tuple[tuple[int, ...], ...]
    """Per unit: batch ids issued on the copy stream just before launching it."""
    wait: tuple[tuple[int, ...], ...]
    """Per unit: batch ids whose copy event the compute stream waits on before it."""
    free: tuple[tuple[int, ...], ...]
    """Per unit: streamed weight input indices freed after it."""
    streamed_bytes: int
    """Bytes copied per step (steady state)."""
    resident_bytes: int
    """Bytes kept on the device."""
    carry_at: int = -1
    """The unit before whose launch the next step's batches (:attr:`carry`) are issued (-1: the last)."""
    resident_at: tuple[tuple[int, ...], ...] = ()
    """Per unit: the resident weight input indices it uses first (checked for host edits just before it)."""

    @property
    def carry_unit(self) -> int:
        """:attr:`carry_at` as a unit index."""
        return len(self.issue) - 1 if self.carry_at == -1 else self.carry_at

    def copy_order(self) -> list[int]:
        """Streamed weight input indices in the order one steady-state step copies them (carry last)."""
        carried = set(self.carry)
        order: list[int] = []
        for b in self.start:
            if b not in carried:
                order.extend(self.batches[b])
        for u, ids in enumerate(self.issue):
            for b in ids:
                order.extend(self.batches[b])
            if u == self.carry_unit:
                for b in self.carry:
                    order.extend(self.batches[b])
        return order


def build_actions(units: list[OffloadUnit], plan: Plan, transfer_bytes: BytesFn = sum) -> StepActions:
    """Turn ``plan`` into per-unit action lists; units the plan never prefetches are copied on demand.

    ``transfer_bytes`` (the transfer's ``nbytes``) says what each copy batch moves.
    """
    n = len(units)
    owner = weight_owners(units)
    resident_w: dict[int, int] = {}
    for unit in units:
        for slot in unit.weights:
            if owner[slot.input_index] in plan.resident:
                resident_w[slot.input_index] = slot.nbytes
    streamed: list[list[int]] = [[w.input_index for w in u.weights if w.input_index not in resident_w] for u in units]
    nbytes = {w.input_index: w.nbytes for u in units for w in u.weights}
    last_user: dict[int, int] = {}
    for unit in units:
        for w in streamed[unit.index]:
            last_user[w] = unit.index

    batches: list[tuple[int, ...]] = []
    batch_unit: list[int] = []
    batch_of: dict[int, int] = {}

    def add(unit: int, before: int | None = None) -> list[int]:
        """New batches for ``unit``'s weights not yet batched (only those last used before unit ``before``):
        one per last user, so a weight later units still use keeps only itself alive, not the whole unit."""
        if not 0 <= unit < n:
            return []
        groups: dict[int, list[int]] = {}
        for w in dict.fromkeys(streamed[unit]):
            if w not in batch_of and (before is None or last_user[w] < before):
                groups.setdefault(last_user[w], []).append(w)
        out = []
        for last in sorted(groups):
            b = len(batches)
            batches.append(tuple(groups[last]))
            batch_unit.append(unit)
            for w in groups[last]:
                batch_of[w] = b
            out.append(b)
        return out

    # the next step's copies are issued before unit ``carry_at`` of this one: weights this step still uses there
    # (a small table every unit reads, kept out of the unit's profile by unit_profiles) wait for the step start
    carry_at = plan.carry_position(n)
    carry: list[int] = []
    for v in plan.next_step:
        carry += add(v, before=carry_at)
    start = list(carry)
    for v in plan.next_step:
        start += add(v)
    for v in plan.prefetch_at.get(-1, ()):
        start += add(v)
    issue: list[tuple[int, ...]] = []
    wait: list[tuple[int, ...]] = []
    waited: set[int] = set()
    for u in range(n):
        ids: list[int] = []
        for v in plan.prefetch_at.get(u, ()):
            if v >= u:
                ids += add(v)
        ids += add(u)  # on demand: whatever of u's weights nobody prefetched
        issue.append(tuple(ids))
        need = [b for b in dict.fromkeys(batch_of[w] for w in streamed[u]) if b not in waited]
        waited.update(need)
        wait.append(tuple(need))
    free: list[list[int]] = [[] for _ in range(n)]
    for w, u in last_user.items():
        free[u].append(w)
    return StepActions(
        resident=tuple(sorted(resident_w)),
        batches=tuple(batches),
        batch_unit=tuple(batch_unit),
        start=tuple(start),
        carry=tuple(carry),
        issue=tuple(issue),
        wait=tuple(wait),
        free=tuple(tuple(sorted(f)) for f in free),
        streamed_bytes=sum(transfer_bytes([nbytes[w] for w in ws]) for ws in batches),
        resident_bytes=sum(resident_w.values()),
        carry_at=plan.carry_position(n) if carry else -1,
        resident_at=tuple(tuple(w for w in dict.fromkeys(x.input_index for x in u.weights)
                                if w in resident_w and owner[w] == u.index) for u in units),
    )


def weight_owners(units: list[OffloadUnit]) -> dict[int, int]:
    """Map each weight input index to its first user: the unit that copies it and counts its bytes."""
    owner: dict[int, int] = {}
    for u in units:
        for w in u.weights:
            owner.setdefault(w.input_index, u.index)
    return owner


def unit_profiles(
    units: list[OffloadUnit], compute_ms: list[float] | None = None, transfer_bytes: BytesFn = sum
) -> list[UnitProfile]:
    """Scheduler profiles: bytes attributed to each weight's first user, alive until its last user.

    ``transfer_bytes`` (the transfer's ``nbytes``) says what moving a unit's weights together costs.
    """
    owner = weight_owners(units)
    sizes: list[list[int]] = [[] for _ in units]
    nbytes: dict[int, int] = {}
    last_user: dict[int, int] = {}
    for u in units:
        for w in u.weights:
            o = owner[w.input_index]
            if o == u.index and w.input_index not in nbytes:
                sizes[o].append(w.nbytes)
                nbytes[w.input_index] = w.nbytes
            last_user[w.input_index] = u.index
    by_last: list[dict[int, int]] = [{} for _ in units]  # per owner: bytes of its weights by their last user
    for idx, b in nbytes.items():
        o, lu = owner[idx], last_user[idx]
        by_last[o][lu] = by_last[o].get(lu, 0) + b
    last = [_lifetime(u.index, by_last[u.index]) for u in units]
    return [
        UnitProfile(
            index=i,
            weight_bytes=transfer_bytes(sizes[i]) if sizes[i] else 0,
            compute_ms=float(compute_ms[i]) if compute_ms is not None else 0.0,
            last_use=last[i] if last[i] != i else None,
        )
        for i in range(len(units))
    ]


#: Weights of a unit that later units still use, up to this share of the unit's bytes, do not keep the unit alive
#: in its profile: :func:`build_actions` copies them as batches of their own, freed after their own last user and
#: never carried into the next step while in use (a rotary table every block reads, owned by the first block).
MINOR_SHARE = 1 / 16


def _lifetime(unit: int, by_last: dict[int, int]) -> int:
    """The last unit a unit's profile keeps its weights for: the last user of its weights, leaving out the
    longest-lived ones while together they are at most :data:`MINOR_SHARE` of the unit's bytes."""
    total = sum(by_last.values())
    dropped = 0
    for last in sorted(by_last, reverse=True):
        if last <= unit or dropped + by_last[last] > MINOR_SHARE * total:
            return max(last, unit)
        dropped += by_last[last]
    return unit


def batch_lifetimes(actions: StepActions) -> list[tuple[tuple[int, int], ...]]:
    """Per copy batch, when its device copy is alive within a step (time ``2u`` is the moment unit ``u``'s
    copies are issued, ``2u + 1`` unit ``u`` itself); a carried batch is also alive from the last unit on.

    Batches issued at step start begin at time 0; every batch ends with the last unit using one of its weights.
    """
    n = len(actions.issue)
    last: dict[int, int] = {}
    for u, ws in enumerate(actions.free):
        for w in ws:
            last[w] = u
    issued = dict.fromkeys(actions.start, 0)
    for u, ids in enumerate(actions.issue):
        for b in ids:
            issued[b] = u
    carried = set(actions.carry)
    out: list[tuple[tuple[int, int], ...]] = []
    for b, ws in enumerate(actions.batches):
        end = 2 * max((last.get(w, actions.batch_unit[b]) for w in ws), default=actions.batch_unit[b]) + 1
        first = 2 * issued.get(b, actions.batch_unit[b])
        if b in carried:
            out.append(((0, end), (2 * actions.carry_unit, 2 * n - 1)))
        else:
            out.append(((first, end),))
    return out
