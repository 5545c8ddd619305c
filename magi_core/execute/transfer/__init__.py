"""The transfer seam: how streamed and resident weights reach the device, and when they may be freed.

The executor never issues a copy itself. It asks a :class:`WeightTransfer` to bring a batch of host weights
to the device (:meth:`~WeightTransfer.fetch`: device tensors plus an event the compute stream waits on), and
hands each streamed weight back after its last user (:meth:`~WeightTransfer.release`). Planning asks the
same object what a group of weights costs to move (:meth:`~WeightTransfer.nbytes`), so a transfer that
moves weights differently (one contiguous buffer per unit, a share per rank) plans and runs consistently.

:class:`UnitTransfer` (the default on accelerators) copies each batch (a unit's streamed weights) with one
copy per host storage into a fixed place of one device buffer planned for the step, and hands out views made
once: host work per unit is one copy call and no allocation. :class:`PerTensorTransfer` (the default on the
host backend, where a "copy" is the host tensor itself, and ``OffloadConfig(transfer="per_tensor")``) makes
one non-blocking copy per weight on a dedicated copy stream, one event per batch; released weights are handed
back with ``record_stream(t, compute_stream)`` so the caching allocator reuses their memory only once the
compute stream is done with them.
"""

from magi_core.execute.transfer.base import PerTensorTransfer, WeightTransfer
from magi_core.execute.transfer.unit import BATCH_ALIGNMENT, WEIGHT_ALIGNMENT, UnitTransfer, plan_span

__all__ = ["BATCH_ALIGNMENT", "WEIGHT_ALIGNMENT", "PerTensorTransfer", "UnitTransfer", "WeightTransfer", "plan_span"]
