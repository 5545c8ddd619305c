"""Weight sources: where a model built on the meta device gets its tensors, by name.

:class:`SafetensorsSource` reads safetensors files (one file, several, a directory, or a transformers /
diffusers sharded index ``*.safetensors.index.json``) by offset, in chunks, straight into the destination:
a tensor stored in the model's dtype is read into its place in the arena with no copy in between, another
dtype goes through one reused staging buffer (:class:`Staging`) and is converted chunk by chunk. Nothing
reads a whole file into memory. :class:`CallableSource` asks a function ``(name, meta) -> tensor``.
:func:`open_source` turns what a user passes into a source.
"""

from __future__ import annotations

import abc
import json
import logging
import os
import struct
import sys
import threading
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch

from magi_core.host.arena import same_bytes
from magi_core.host.errors import WeightSourceError

logger = logging.getLogger(__name__)

#: safetensors dtype names -> torch dtypes (those this torch build has).
ST_DTYPES: dict[str, torch.dtype] = {
    k: v for k, v in {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool, "C64": torch.complex64, "U16": getattr(torch, "uint16", None),
        "U32": getattr(torch, "uint32", None), "U64": getattr(torch, "uint64", None),
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
    }.items() if v is not None
}
_MAX_HEADER = 100 << 20  # the safetensors format's own limit on the JSON header
_MAX_READ = 256 << 20  # bytes per read call (progress stays fine-grained; pread takes at most 2 GiB anyway)
_SENDFILE = [hasattr(os, "sendfile")]  # cleared when the kernel refuses sendfile into the arena's file

PathLike = Union[str, "os.PathLike[str]"]
#: What :func:`magi_core.load` accepts as weights.
SourceSpec = Union["WeightSource", Callable[[str, torch.Tensor], "torch.Tensor | None"], PathLike, Sequence[PathLike]]


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


def _u8(t: torch.Tensor) -> torch.Tensor:
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
        return same_bytes(_u8(tmp), _u8(view.contiguous()))

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release open files (called once loading is over)."""

    def describe(self) -> str:
        """A short description for logs and errors."""
        return type(self).__name__


# -- safetensors -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _StEntry:
    path: str
    begin: int  # absolute offset of the first byte in the file
    nbytes: int
    info: TensorInfo
    file_id: tuple[int, int, int, int]  # dev, inode, size, mtime_ns


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset where its data starts; WeightSourceError if malformed."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightSourceError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise WeightSourceError(f"{path}: not a safetensors file (header length {n} bytes)")
            raw = f.read(n)
    except OSError as exc:
        raise WeightSourceError(f"cannot read the weight file {path}: {exc}") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightSourceError(f"{path}: not a safetensors file (its header is not JSON: {exc})") from exc
    if not isinstance(header, dict):
        raise WeightSourceError(f"{path}: not a safetensors file (its header is not a JSON object)")
    return header, 8 + n


class SafetensorsSource(WeightSource):
    """Tensors of one or more safetensors files, read by offset (see the module docstring).

    ``weight_map`` (from a sharded index): name -> file; each named tensor must be in its file.
    """

    parallel_safe = True

    def __init__(self, files: Sequence[PathLike], *, weight_map: dict[str, str] | None = None,
                 origin: str | None = None) -> None:
        if sys.byteorder != "little":
            raise WeightSourceError("safetensors files are little-endian; this host is big-endian")
        self.files = [os.fspath(f) for f in files]
        if not self.files:
            raise WeightSourceError(f"no safetensors files given{f' ({origin})' if origin else ''}")
        self.origin = origin or (self.files[0] if len(self.files) == 1 else f"{len(self.files)} safetensors files")
        self._entries: dict[str, _StEntry] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        for path in self.files:
            self._scan(path)
        if weight_map is not None:
            self._check_map(weight_map)

    def _scan(self, path: str) -> None:
        header, start = read_header(path)
        try:
            st = os.stat(path)
        except OSError as exc:
            raise WeightSourceError(f"cannot stat the weight file {path}: {exc}") from exc
        file_id = (int(st.st_dev), int(st.st_ino), int(st.st_size), int(st.st_mtime_ns))
        for name, d in header.items():
            if name == "__metadata__":
                continue
            try:
                kind, shape, (b, e) = d["dtype"], tuple(int(x) for x in d["shape"]), d["data_offsets"]
            except (KeyError, TypeError, ValueError) as exc:
                raise WeightSourceError(f"{path}: malformed header entry for {name!r}: {d!r}") from exc
            dtype = ST_DTYPES.get(kind)
            if dtype is None:
                raise WeightSourceError(f"{path}: {name!r} has dtype {kind}, which this torch ({torch.__version__}) "
                                        "cannot hold; convert the checkpoint or upgrade torch")
            numel = 1
            for x in shape:
                numel *= x
            if e - b != numel * dtype.itemsize or b < 0 or start + e > st.st_size:
                raise WeightSourceError(f"{path}: {name!r} claims bytes [{b}, {e}) for shape {list(shape)} {kind} in a "
                                        f"file of {st.st_size} bytes; the file is truncated or corrupt")
            if name in self._entries:
                raise WeightSourceError(f"{name!r} is in two weight files: {self._entries[name].path} and {path}; "
                                        "pass one checkpoint (or its index)")
            self._entries[name] = _StEntry(path, start + b, e - b, TensorInfo(shape, dtype), file_id)

    def _check_map(self, weight_map: dict[str, str]) -> None:
        wrong = [n for n, f in weight_map.items()
                 if n not in self._entries or Path(self._entries[n].path).name != Path(f).name]
        if wrong:
            raise WeightSourceError(f"the index {self.origin} lists {len(wrong)} tensor(s) that are not in the file it "
                                    f"names, e.g. {wrong[:3]}; the checkpoint is incomplete or its index is stale")

    def names(self) -> Collection[str]:
        """Every tensor name in the files."""
        return self._entries.keys()

    def info(self, name: str) -> TensorInfo | None:
        """Shape and dtype from the header."""
        e = self._entries.get(name)
        return e.info if e is not None else None

    def reads_in_place(self, name: str, dtype: torch.dtype) -> bool:
        """Stored in ``dtype``: read straight into its place (``preadv``)."""
        e = self._entries.get(name)
        return e is not None and e.info.dtype == dtype

    def token(self, name: str, dtype: torch.dtype) -> Hashable | None:
        """The file (device, inode, size, mtime), the byte range, the stored and the requested dtype."""
        e = self._entries.get(name)
        if e is None:
            return None
        return ("safetensors", e.file_id, e.begin, e.nbytes, str(e.info.dtype), str(dtype))

    def _fd(self, path: str) -> int:
        with self._lock:
            return self._open(path)

    def _open(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise WeightSourceError(f"cannot open the weight file {path}: {exc}") from exc
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            self._fds[path] = fd
        return fd

    def _pread(self, e: _StEntry, dst: torch.Tensor, offset: int) -> None:
        """Fill the uint8 tensor ``dst`` with the file's bytes from ``offset`` (absolute)."""
        fd = self._fd(e.path)
        view: memoryview = dst.numpy().data.cast("B")
        done = 0
        while done < len(view):
            part = view[done: done + _MAX_READ]
            n = os.preadv(fd, [part], offset + done)
            if n <= 0:
                raise WeightSourceError(f"{e.path}: ended while reading at byte {offset + done}; the file is truncated "
                                        "(or was replaced while loading)")
            done += n

    def read_into(self, name: str, out: torch.Tensor, staging: Staging) -> int:
        """Read ``name`` into ``out``: straight in when the dtypes match, else chunk by chunk through ``staging``."""
        e = self._entries.get(name)
        if e is None:
            raise MissingTensor(name)
        if tuple(out.shape) != e.info.shape:
            raise ShapeMismatch(name, e.info.shape, tuple(out.shape))
        if out.numel() == 0:
            return 0
        src = e.info.dtype
        if not out.is_contiguous():  # a strided view of a shared storage: read whole, then copy (logged)
            logger.debug("%s: strided destination; read through a temporary of %d bytes", name, e.nbytes)
            tmp = torch.empty(e.nbytes, dtype=torch.uint8)
            self._pread(e, tmp, e.begin)
            out.copy_(tmp.view(src).view(e.info.shape))
            staging.largest = max(staging.largest, e.nbytes)
            return e.nbytes
        if src == out.dtype:
            self._pread(e, _u8(out), e.begin)
            return e.nbytes
        flat = out.view(-1)
        per = staging.elements(src)
        item = src.itemsize
        for lo in range(0, flat.numel(), per):
            k = min(per, flat.numel() - lo)
            raw = staging.take(k * item)
            self._pread(e, raw, e.begin + lo * item)
            flat[lo: lo + k].copy_(raw.view(src))
        return e.nbytes

    def write_to(self, name: str, out: torch.Tensor, fd: int, offset: int, staging: Staging) -> int | None:
        """A tensor stored in the model's dtype goes from the checkpoint's page cache into the arena's file in the
        kernel (``sendfile``: no copy through this process, no page faults on its mapping); else None."""
        e = self._entries.get(name)
        if e is None or e.info.dtype != out.dtype or tuple(out.shape) != e.info.shape or not _SENDFILE[0]:
            return None
        if out.numel() == 0:
            return 0
        src = self._fd(e.path)
        done = 0
        try:
            os.lseek(fd, offset, os.SEEK_SET)
            while done < e.nbytes:
                n = os.sendfile(fd, src, e.begin + done, min(e.nbytes - done, 1 << 30))
                if n <= 0:
                    raise WeightSourceError(f"{e.path}: ended while reading at byte {e.begin + done}; the file is "
                                            "truncated (or was replaced while loading)")
                done += n
        except OSError as exc:  # no sendfile between these files here: read through the mapping from now on
            if done:
                raise WeightSourceError(f"copying {name!r} from {e.path} failed after {done} bytes: {exc}") from exc
            logger.debug("sendfile into the arena is not available (%s); reading through the mapping", exc)
            _SENDFILE[0] = False
            return None
        return e.nbytes

    def close(self) -> None:
        """Close the files."""
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()

    def describe(self) -> str:
        """The file, index or directory it was opened from."""
        return self.origin


# -- a function --------------------------------------------------------------------------------------------
class CallableSource(WeightSource):
    """Tensors from ``fn(name, meta)``, where ``meta`` is a meta tensor with the model's shape and dtype; ``fn``
    returns a tensor of that shape (any dtype or device: converted), or None when it has no such tensor.

    ``identical_across_ranks`` (True, or a predicate on the name): ``fn`` returns the same values for that name on
    every rank of a node, so one rank calls it and the others map its copy without comparing (e.g. weights
    seeded by name). False (default): every rank calls ``fn``; tensors that come out byte-identical are shared
    after a full comparison, the others get a copy per rank.

    ``thread_safe``: ``fn`` may be called from several threads at once (``HostOptions.load_threads`` of them,
    default the cores shared by the node's ranks, at most 8), each holding one returned tensor at a time; False
    (default): one thread calls it.
    """

    def __init__(self, fn: Callable[[str, torch.Tensor], torch.Tensor | None], *,
                 identical_across_ranks: bool | Callable[[str], bool] = False, thread_safe: bool = False) -> None:
        if not callable(fn):
            raise TypeError(f"CallableSource takes a function (name, meta_tensor) -> tensor, got {type(fn).__name__}")
        self.fn = fn
        self.identical = identical_across_ranks
        self.parallel_safe = bool(thread_safe)

    def token(self, name: str, dtype: torch.Tensor | torch.dtype) -> Hashable | None:
        """``("callable", name, dtype)`` where declared identical across ranks, else None."""
        same = self.identical(name) if callable(self.identical) else bool(self.identical)
        return ("callable", name, str(dtype)) if same else None

    def _produce(self, name: str, like: torch.Tensor, staging: Staging) -> torch.Tensor:
        meta = torch.empty(like.shape, dtype=like.dtype, device="meta")
        t = self.fn(name, meta)
        if t is None:
            raise MissingTensor(name)
        if not isinstance(t, torch.Tensor):
            raise WeightSourceError(f"the weight function returned a {type(t).__name__} for {name!r}; return a tensor "
                                    "(or None when it has none)")
        if tuple(t.shape) != tuple(like.shape):
            raise ShapeMismatch(name, tuple(t.shape), tuple(like.shape))
        staging.largest = max(staging.largest, t.numel() * t.element_size())
        return t

    def read_into(self, name: str, out: torch.Tensor, staging: Staging) -> int:
        """Call ``fn`` and copy (converting) its tensor into ``out``."""
        t = self._produce(name, out, staging)
        with torch.no_grad():
            out.copy_(t)
        return t.numel() * t.element_size()

    def write_to(self, name: str, out: torch.Tensor, fd: int, offset: int, staging: Staging) -> int | None:
        """Call ``fn``; a host tensor of the model's dtype is written into the file ``fd`` at ``offset`` (no page
        faults on this process's mapping), anything else is copied (converting) into ``out``."""
        t = self._produce(name, out, staging)
        if t.dtype != out.dtype or t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            with torch.no_grad():
                out.copy_(t)
            return t.numel() * t.element_size()
        view: memoryview = _u8(t.detach()).numpy().data.cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done: done + (1 << 30)], offset + done)
        return done

    def matches(self, name: str, view: torch.Tensor, staging: Staging) -> bool:
        """Call ``fn`` and compare its values, converted chunk by chunk through ``staging``, with ``view``."""
        t = self._produce(name, view, staging)
        if t.dtype == view.dtype and t.device.type == "cpu" and t.is_contiguous() and view.is_contiguous():
            return same_bytes(_u8(t), _u8(view))
        src = t.reshape(-1)
        dst = view.contiguous().reshape(-1)
        per = staging.elements(view.dtype)
        for lo in range(0, dst.numel(), per):
            k = min(per, dst.numel() - lo)
            conv = staging.take(k * view.dtype.itemsize).view(view.dtype)
            conv.copy_(src[lo: lo + k])
            if not same_bytes(_u8(conv), _u8(dst[lo: lo + k])):
                return False
        return True

    def describe(self) -> str:
        """The function's name."""
        return f"function {getattr(self.fn, '__qualname__', type(self.fn).__name__)}"


# -- what users pass -----------------------------------------------------------------------------------------
_INDEX_SUFFIX = ".safetensors.index.json"


def _from_index(path: Path) -> SafetensorsSource:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightSourceError(f"cannot read the checkpoint index {path}: {exc}") from exc
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightSourceError(f"{path} has no 'weight_map' (name -> file): not a sharded safetensors index")
    files = sorted({str(path.parent / f) for f in weight_map.values()})
    absent = [f for f in files if not os.path.isfile(f)]
    if absent:
        raise WeightSourceError(f"the index {path} names {len(absent)} file(s) that do not exist, e.g. {absent[:3]}; "
                                "download the whole checkpoint")
    return SafetensorsSource(files, weight_map={k: str(v) for k, v in weight_map.items()}, origin=str(path))


def _from_dir(path: Path) -> SafetensorsSource:
    indexes = sorted(path.glob(f"*{_INDEX_SUFFIX}"))
    if len(indexes) == 1:
        return _from_index(indexes[0])
    if len(indexes) > 1:
        raise WeightSourceError(f"{path} holds several checkpoint indexes ({', '.join(p.name for p in indexes)}); "
                                "pass the one to load")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))[:3]
        hint = (f" (it has {', '.join(other)}: convert them to safetensors, e.g. with safetensors.torch.save_file)"
                if other else "; for a diffusers pipeline pass the component's folder (e.g. .../transformer or "
                ".../unet)")
        raise WeightSourceError(f"no *.safetensors file or *{_INDEX_SUFFIX} in {path}{hint}")
    return SafetensorsSource(files, origin=str(path))


def open_source(source: SourceSpec) -> WeightSource:
    """A :class:`WeightSource` for ``source``: a source as is, a callable, a safetensors file, a sharded index
    (``*.safetensors.index.json``), a directory holding either, or a list of safetensors files."""
    if isinstance(source, WeightSource):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            return _from_dir(path)
        if not path.exists():
            raise WeightSourceError(f"weight source {path} does not exist")
        if path.name.endswith(".json"):
            return _from_index(path)
        if path.suffix == ".safetensors":
            return SafetensorsSource([path])
        raise WeightSourceError(f"{path}: only safetensors checkpoints are read (a .safetensors file, a "
                                f"*{_INDEX_SUFFIX} or a directory of them); convert it, e.g. with "
                                "safetensors.torch.save_file")
    if callable(source):
        return CallableSource(source)
    if isinstance(source, (list, tuple)) and source and all(isinstance(p, (str, os.PathLike)) for p in source):
        return SafetensorsSource(list(source))
    raise TypeError(f"weights must be a path, a list of safetensors files, a WeightSource or a function "
                    f"(name, meta_tensor) -> tensor; got {type(source).__name__}")
