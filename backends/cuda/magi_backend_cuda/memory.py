"""Device memory of this process on CUDA, and a cap on it through the caching allocator's memory fraction.

``torch.cuda.set_per_process_memory_fraction(nbytes / total, device)`` makes the caching allocator refuse, with
``torch.OutOfMemoryError``, any allocation that would take its reserved bytes past ``nbytes``: the process runs
as on a card of that size. The cap is remembered so that ``magi_device_memory`` reports it (``torch.cuda.
mem_get_info`` reports the whole device). Nothing here initialises CUDA before a hook is called.
"""

from __future__ import annotations

from types import ModuleType

import torch

from magi_core.plugin import FractionCap


def _cuda() -> ModuleType:
    """``torch.cuda``, looked up at each call (tests replace its functions)."""
    return torch.cuda


#: The cap bookkeeping of this process (device index -> bytes).
CAP = FractionCap("cuda", _cuda)
