"""What a forked child sees of its parent's host weights, on the active backend (CUDA: pinned with cudaHostRegister).

One process materialises a small model (pinned through the backend), then forks; the child reads a weight, adds
100 to a bias in place and reports over a pipe; the parent checks that its own weights did not change. With
``--no-remap`` the child keeps the parent's mappings as they are (what happened before forked children mapped
them copy-on-write). Prints one JSON line: the arena's VmFlags in the parent (``dc``: the driver asked the kernel
not to copy the range into children, MADV_DONTFORK), how the child ended, what it saw, and what the parent holds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile

import torch
from torch import nn

from magi_core import get_backend
from magi_core.host import HostOptions, materialize, shm


def vm_flags(ptr: int) -> str:
    """The VmFlags line of this process's mapping holding ``ptr``."""
    hit = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                hit = lo <= ptr < hi
            elif hit and line.startswith("VmFlags:"):
                return line.split(":", 1)[1].strip()
    return ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-remap", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)  # a child forked after OpenMP ran parallel regions may wait on its threads forever
    shm_dir = tempfile.mkdtemp(prefix="magi-fork-probe-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    torch.manual_seed(0)
    model = nn.Linear(1024, 1024)
    hw = materialize(model, options=HostOptions(progress=False, shm_dir=shm_dir))
    before = model.bias.detach().clone()
    weight_sum = float(model.weight.detach().sum())
    rec: dict[str, object] = {"backend": get_backend().name, "pinned_bytes": hw.pinned_bytes,
                              "vm_flags": vm_flags(model.bias.data_ptr()), "remap": not args.no_remap}
    if args.no_remap:
        shm._tracked.clear()  # the child keeps the parent's mappings
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        seen = {"weight_sum_ok": abs(float(model.weight.detach().sum()) - weight_sum) < 1e-3}
        with torch.no_grad():
            model.bias.add_(100)
        seen["bias_delta"] = float((model.bias - before).min())
        os.write(w, json.dumps(seen).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    rec["child"] = ("signal " + signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status)
                    else f"exit {os.WEXITSTATUS(status)}")
    rec["child_saw"] = json.loads(data) if data else None
    rec["parent_bias_delta"] = float((model.bias - before).abs().max())
    hw.release()
    os.rmdir(shm_dir)
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
