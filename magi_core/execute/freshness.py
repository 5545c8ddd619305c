"""Which host weights changed between two calls: the check behind every device copy kept across calls.

Device copies that outlive a call (resident weights, and the next call's first weights prefetched during
the last unit) must be redone when the host weight changed in between. A weight counts as changed when

- the tensor passed in is another object, or its data moved (``module.weight = nn.Parameter(...)``,
  ``param.data = ...``, ``register_buffer`` again);
- its version counter moved: any in-place op on the tensor itself (``mul_``, ``copy_``, ``add_``,
  ``load_state_dict``);
- a sample of its bytes differs: in-place edits through ``param.data`` (which has its own version
  counter, e.g. peft's unsafe LoRA merge ``weight.data += delta``). The sample is ``SAMPLES`` whole
  elements spread evenly over the tensor's span (first and last included), gathered for all weights of
  one host storage (one arena) with one ``take``: dense edits are always seen; a partial edit through
  ``.data`` (rows, pruning, clipping) usually falls between samples, and is seen only after
  ``magi_core.handle(model).weights_changed()`` (the user guide, "Changing weights after offload", says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: Elements sampled per weight for the content check.
SAMPLES = 8


class WeightWatch:
    """Remembers identity, data pointer, version and sampled bytes of some weight inputs between calls."""

    def __init__(self, indices: Sequence[int], samples: int = SAMPLES) -> None:
        self.indices = tuple(indices)
        self._samples = samples
        self._ids: list[int] = [0] * len(self.indices)
        self._ptrs: list[int] = [0] * len(self.indices)
        self._versions: list[int] = [-1] * len(self.indices)
        #: Per host storage: (its bytes as uint8, sample positions, the watched slots in order, last sample).
        self._groups: list[tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor]] = []
        self._forced = True

    def force(self) -> None:
        """Treat every watched weight as changed at the next :meth:`changed` call."""
        self._forced = True

    def changed(self, args: Sequence[Any]) -> set[int]:
        """The watched input indices whose host tensor changed since the previous call (all on the first)."""
        out: set[int] = set()
        ids, ptrs, versions = self._ids, self._ptrs, self._versions
        moved = False
        for k, i in enumerate(self.indices):
            t = args[i]
            ptr = t.data_ptr()
            if id(t) != ids[k] or ptr != ptrs[k]:
                ids[k], ptrs[k] = id(t), ptr
                moved = True
                out.add(i)
            v = t._version
            if v != versions[k]:
                versions[k] = v
                out.add(i)
        if moved or self._forced:
            self._regroup(args)
            if self._forced:
                out.update(self.indices)
                self._forced = False
            return out
        for n, (buf, pos, slots, last) in enumerate(self._groups):
            now = torch.take(buf, pos)
            if not torch.equal(now, last):
                diff = (now != last).view(len(slots), -1).any(dim=1).tolist()
                out.update(self.indices[k] for k, d in zip(slots, diff, strict=True) if d)
                self._groups[n] = (buf, pos, slots, now)
        return out

    def _regroup(self, args: Sequence[Any]) -> None:
        by_storage: dict[int, tuple[torch.Tensor, list[int], list[list[int]]]] = {}
        for k, i in enumerate(self.indices):
            t = args[i]
            if t.device.type != "cpu" or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in by_storage:
                buf = torch.empty(0, dtype=torch.uint8).set_(storage)
                by_storage[key] = (buf, [], [])
            item = t.element_size()
            span = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1  # in elements
            n = self._samples
            elems = [t.storage_offset() + (span - 1) * j // max(n - 1, 1) for j in range(n)]
            by_storage[key][1].append(k)
            by_storage[key][2].append([e * item + b for e in elems for b in range(item)])  # whole elements
        groups = []
        for buf, slots, positions in by_storage.values():
            pos = torch.tensor(positions, dtype=torch.int64).reshape(-1)
            groups.append((buf, pos, slots, torch.take(buf, pos)))
        self._groups = groups
