"""The weight-source contract: what a source of a model's tensors, by name, answers and does.

:class:`WeightSource` is what loading reads from (:mod:`.safetensors_source` reads files, :mod:`.sources` calls a
function); :class:`Staging` is the one reused buffer it reads and converts through.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Collection, Hashable
from dataclasses import dataclass
from typing import Union

import torch

from magi_core.host.arena import same_bytes

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of a tensor a source holds, known without reading it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class MissingTensor(KeyError):
    """The source has no tensor under this name (raised while reading; collected into one error)."""


class ShapeMismatch(ValueError):
    """The source's tensor has another shape than the model's (raised while reading; collected into one error)."""

    def __init__(self, name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
        super().__init__(f"{name}: source {list(got)}, model {list(want)}")
        self.name, self.got, self.want = name, got, want


class Staging:
    """The one reusable buffer of anonymous memory that loading reads and converts through (``nbytes`` at most)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(int(nbytes), 64)
        self._buf: torch.Tensor | None = None
        self.largest = 0  # the largest temporary a source needed beyond the buffer (a callable's tensor)

    def take(self, n: int) -> torch.Tensor:
        """The first ``n`` (<= ``nbytes``) bytes of the buffer, allocated once."""
        if n > self.nbytes:
            raise ValueError(f"staging request of {n} bytes exceeds the window of {self.nbytes}")
        if self._buf is None:
            self._buf = torch.empty(self.nbytes, dtype=torch.uint8)
        return self._buf[:n]

    def elements(self, dtype: torch.dtype) -> int:
        """How many elements of ``dtype`` fit in the buffer (at least one)."""
        return max(1, self.nbytes // dtype.itemsize)

    def release(self) -> None:
        """Free the buffer."""
        self._buf = None


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor (0-dim included) as a flat uint8 tensor."""
    return t.reshape(-1).view(torch.uint8)


class WeightSource(abc.ABC):
    """Where a model's tensors come from, by name (the state-dict names of the model being loaded).

    Implement :meth:`read_into`; :meth:`names`, :meth:`info` and :meth:`token` make loading check keys and shapes
    before reading, and let the ranks of a node read each tensor once.
    """

    #: :meth:`read_into` and :meth:`write_to` may run in several threads at once (different tensors).
    parallel_safe: bool = False

    def names(self) -> Collection[str] | None:
        """Every name the source holds, or None when it cannot list them (a callable is asked name by name)."""
        return None

    def info(self, name: str) -> TensorInfo | None:
        """Shape and dtype of ``name`` without reading it; None when not held, or unknown before reading."""
        return None

    def token(self, name: str, dtype: torch.dtype) -> Hashable | None:
        """Provenance of ``name`` read as ``dtype``: ranks of a node with equal tokens get the same bytes, so one
        of them reads it and the others map it without comparing. None: unknown (every rank produces its own
        values and identical ones are shared after a byte-for-byte comparison)."""
        return None

    @abc.abstractmethod
    def read_into(self, name: str, out: torch.Tensor, staging: Staging) -> int:
        """Write tensor ``name`` into ``out`` (its place in the arena: shape and dtype of the model's tensor),
        converting the dtype if needed; return the bytes read. Raise :class:`MissingTensor` when the source has no
        such tensor and :class:`ShapeMismatch` when its shape differs."""

    def write_to(self, name: str, out: torch.Tensor, fd: int, offset: int, staging: Staging) -> int | None:
        """Like :meth:`read_into`, but write the bytes into the file ``fd`` at ``offset`` (where ``out``, contiguous,
        is mapped), bypassing this process's mapping; None when this source cannot for this tensor (then
        :meth:`read_into` is called)."""
        return None

    def reads_in_place(self, name: str, dtype: torch.dtype) -> bool:
        """True when :meth:`read_into` writes ``name`` as ``dtype`` into a contiguous ``out`` by read system calls
        alone (no store through the mapping: where the shared-memory filesystem is full the call then fails with
        EFAULT instead of a SIGBUS, so its pages need not be allocated first)."""
        return False

    def matches(self, name: str, view: torch.Tensor, staging: Staging) -> bool:
        """True when ``view`` (another rank's copy) holds exactly what :meth:`read_into` would write."""
        tmp = torch.empty_like(view, memory_format=torch.contiguous_format)
        self.read_into(name, tmp, staging)
        return same_bytes(as_bytes(tmp), as_bytes(view.contiguous()))

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release open files (called once loading is over)."""

    def describe(self) -> str:
        """A short description for logs and errors."""
        return type(self).__name__
