"""Run in a fresh interpreter: probe and select a backend, then check the device was not initialised.

``python -m magi_core.testing.probe_check NAME`` prints one JSON object: the probe result, whether
the device module reports itself initialised after discovery and selection (None when it cannot
say, or for device type "cpu": the host), and, for an accelerator that can allocate tensors, whether a
forked child could then use the device (``fork``: ``"ok"``, ``"failed: ..."``, ``"no-alloc: ..."`` for a
device without kernels, or None when not tried). Exit status 0 unless the script itself broke.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

FORK_OK, FORK_NO_ALLOC, FORK_FAILED = 0, 3, 1


def _fork_child_uses_device(device_type: str) -> str:
    """Fork; the child allocates and computes on the device. Returns "ok", "no-alloc: ..." or "failed: ..."."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        os.close(read_fd)
        status, message = FORK_FAILED, ""
        try:
            import torch

            try:
                x = torch.ones(8, device=device_type)
            except NotImplementedError as exc:
                status, message = FORK_NO_ALLOC, str(exc).splitlines()[0]
            else:
                total = float((x * 2).sum().item())
                status, message = (FORK_OK, "") if total == 16.0 else (FORK_FAILED, f"wrong result {total}")
        except BaseException as exc:  # report anything to the parent
            message = f"{type(exc).__name__}: {exc}"
        os.write(write_fd, message.encode()[:4000])
        os.close(write_fd)
        os._exit(status)
    os.close(write_fd)
    chunks = []
    while chunk := os.read(read_fd, 4096):
        chunks.append(chunk)
    os.close(read_fd)
    _, wait_status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(wait_status)
    message = b"".join(chunks).decode(errors="replace")
    if code == FORK_OK:
        return "ok"
    if code == FORK_NO_ALLOC:
        return f"no-alloc: {message}"
    return f"failed (exit {code}): {message}"


def check(name: str | None) -> dict[str, Any]:
    """Discover, probe and select ``name`` (automatic when None); report initialisation and fork health."""
    from magi_core.plugin.manager import REGISTRY, get_backend, use_backend

    records = REGISTRY.records()
    backend = use_backend(name) if name is not None else get_backend()
    assert backend is not None
    rec = records[backend.name]
    module = backend.device_module
    is_init = getattr(module, "is_initialized", None)
    # the host (device type "cpu") needs no initialisation: torch.cpu.is_initialized() always answers True
    initialised = bool(is_init()) if callable(is_init) and backend.device_type != "cpu" else None
    result: dict[str, Any] = {
        "name": backend.name,
        "available": rec.available,
        "probe_error": repr(rec.probe_error) if rec.probe_error is not None else None,
        "device_type": backend.device_type,
        "initialised_after_probe": initialised,
        "fork": None,
    }
    if backend.is_accelerator and hasattr(os, "fork"):
        result["fork"] = _fork_child_uses_device(backend.device_type)
    return result


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print the JSON report for the backend named in argv (or the automatic choice)."""
    args = sys.argv[1:] if argv is None else argv
    report = check(args[0] if args else None)
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
