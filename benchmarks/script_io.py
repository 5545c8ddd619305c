"""What the benchmark scripts share: starting their ranks under torchrun, and printing / writing the result."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from magi_core import get_backend
from magi_core.host.memstat import anonymous_bytes
from magi_core.plugin.facade import Backend


def start_ranks() -> tuple[Backend, torch.device, int, int]:
    """Under torchrun: this rank's device (its ``LOCAL_RANK``-th on an accelerator, with the default process
    group on it; gloo on the cpu backend); returns (backend, device, rank, world size)."""
    be = get_backend()
    if be.is_accelerator:
        be.device_module.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = be.device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(device_id=device)
    else:
        device = be.device()
        dist.init_process_group("gloo")
    return be, device, dist.get_rank(), dist.get_world_size()


def emit_json(doc: Any, path: str | None) -> None:
    """Print ``doc`` as indented JSON and also write it to ``path`` when given."""
    text = json.dumps(doc, indent=2)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    print(text)


class AnonPeak:
    """The largest anonymous memory of this process above its level at start, sampled every 10 ms in a thread
    while the ``with`` block runs (``extra`` afterwards). Not every millisecond: each sample takes the GIL from
    what is measured (Dynamo's tracing is Python), and buffers that matter live far longer than 10 ms."""

    def __init__(self) -> None:
        self.base = anonymous_bytes()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, anonymous_bytes())
            time.sleep(0.01)

    def __enter__(self) -> AnonPeak:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, anonymous_bytes())

    @property
    def extra(self) -> int:
        """Bytes above the level at start."""
        return self.peak - self.base
