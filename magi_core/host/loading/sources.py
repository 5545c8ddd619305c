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
import stat
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


#: Every dtype name of the safetensors format (those missing from :data:`ST_DTYPES` this torch cannot hold).
ST_FORMAT_DTYPES = frozenset({*ST_DTYPES, "BOOL", "F4", "F6_E2M3", "F6_E3M2", "F8_E4M3", "F8_E5M2", "F8_E8M0", "U8",
                              "I8", "U16", "I16", "F16", "BF16", "U32", "I32", "F32", "U64", "I64", "F64", "C64"})


def open_regular(path: str, what: str = "weight file") -> int:
    """A read-only fd of ``path``, which must be a regular file (a FIFO, device or directory is refused at once:
    opening a FIFO for reading would wait for a writer forever); WeightSourceError naming the path otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise WeightSourceError(f"cannot open the {what} {path}: {exc}") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else
                    "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                    else "not a regular file")
            raise WeightSourceError(f"the {what} {path} is {kind}, not a regular file; pass the checkpoint's own "
                                    "files (a pipe or device cannot be read by offset)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_exact(fd: int, n: int, offset: int) -> bytes:
    """Up to ``n`` bytes of ``fd`` from ``offset`` (fewer only at the end of the file)."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _no_duplicates(path: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                raise WeightSourceError(f"{path}: the header names {k!r} twice; the file is corrupt (the safetensors "
                                        "library refuses it too)")
            out[k] = v
        return out

    return pairs


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset where its data starts; WeightSourceError if malformed
    (not a regular file, truncated, not a JSON object, a name given twice)."""
    fd = open_regular(path)
    try:
        head = _read_exact(fd, 8, 0)
        if len(head) < 8:
            raise WeightSourceError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise WeightSourceError(f"{path}: not a safetensors file (header length {n} bytes)")
        raw = _read_exact(fd, n, 8)
    except OSError as exc:
        raise WeightSourceError(f"cannot read the weight file {path}: {exc}") from exc
    finally:
        os.close(fd)
    if len(raw) < n:
        raise WeightSourceError(f"{path}: its header says {n} bytes, the file holds {len(raw)} after the length; the "
                                "file is truncated or corrupt")
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightSourceError(f"{path}: not a safetensors file (its header is not JSON: {exc})") from exc
    if not isinstance(header, dict):
        raise WeightSourceError(f"{path}: not a safetensors file (its header is not a JSON object)")
    return header, 8 + n


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_entry(path: str, name: str, d: Any) -> tuple[TensorInfo, int, int]:
    """One tensor's header entry checked field by field, as the safetensors library does: ``dtype`` a known name,
    ``shape`` a list of non-negative ints, ``data_offsets`` a pair of ints with ``0 <= begin <= end`` and
    ``end - begin == numel * itemsize``. Returns (info, begin, end), offsets relative to the data section."""
    where = f"{path}: tensor {name!r}"
    corrupt = "; the file is corrupt (the safetensors library refuses it too)"
    if not isinstance(d, dict):
        raise WeightSourceError(f"{where}: its header entry is {d!r}, not an object with dtype, shape and "
                                f"data_offsets{corrupt}")
    absent = [k for k in ("dtype", "shape", "data_offsets") if k not in d]
    if absent:
        raise WeightSourceError(f"{where}: its header entry has no {', '.join(absent)}{corrupt}")
    kind, shape, offsets = d["dtype"], d["shape"], d["data_offsets"]
    if not isinstance(kind, str):
        raise WeightSourceError(f"{where}: dtype {kind!r} is not a dtype name such as 'F32'{corrupt}")
    dtype = ST_DTYPES.get(kind)
    if dtype is None:
        if kind in ST_FORMAT_DTYPES:
            raise WeightSourceError(f"{where} has dtype {kind}, which this torch ({torch.__version__}) cannot hold; "
                                    "convert the checkpoint or upgrade torch")
        raise WeightSourceError(f"{where}: unknown dtype {kind!r} (safetensors names: "
                                f"{', '.join(sorted(ST_FORMAT_DTYPES))}){corrupt}")
    if not isinstance(shape, list) or not all(_is_int(x) and x >= 0 for x in shape):
        raise WeightSourceError(f"{where}: shape {shape!r} is not a list of non-negative integers{corrupt}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(x) for x in offsets)):
        raise WeightSourceError(f"{where}: data_offsets {offsets!r} is not a pair of integers [begin, end]{corrupt}")
    begin, end = offsets
    numel = 1
    for x in shape:
        numel *= x
    if not 0 <= begin <= end or end - begin != numel * dtype.itemsize:
        raise WeightSourceError(f"{where} claims bytes [{begin}, {end}) for shape {shape} {kind} "
                                f"({numel * dtype.itemsize} bytes){corrupt}")
    return TensorInfo(tuple(shape), dtype), begin, end


def check_coverage(path: str, spans: list[tuple[int, int, str]], data_len: int) -> None:
    """The tensors' byte ranges (begin, end, name; relative to the data section of ``data_len`` bytes) must be
    disjoint and cover it exactly, as the safetensors library demands: no byte read for two tensors, none unused,
    none beyond the end."""
    pos = 0
    prev: tuple[int, int, str] | None = None
    for begin, end, name in sorted(spans):
        if begin < pos:
            assert prev is not None  # pos > 0: some tensor ended there
            raise WeightSourceError(f"{path}: tensors {prev[2]!r} [{prev[0]}, {prev[1]}) and {name!r} [{begin}, {end}) "
                                    "overlap: each byte of the data section belongs to one tensor; the file is "
                                    "corrupt (the safetensors library refuses it too)")
        if begin > pos:
            raise WeightSourceError(f"{path}: bytes [{pos}, {begin}) of the data section, before tensor {name!r}, "
                                    "belong to no tensor; the file is corrupt (the safetensors library refuses it "
                                    "too)")
        pos, prev = end, (begin, end, name)
    if pos != data_len:
        last = f" (the last, {prev[2]!r}, ends at {pos})" if prev else ""
        raise WeightSourceError(f"{path}: its tensors cover {pos} bytes{last} but its data section holds {data_len}; "
                                "the file is truncated or corrupt")


def _paths(files: Any, origin: str | None = None) -> list[str]:
    """``files`` as a non-empty list of path strings; WeightSourceError naming the entry that is not a path."""
    where = f" ({origin})" if origin else ""
    if isinstance(files, (str, os.PathLike)) or not isinstance(files, Sequence):
        raise WeightSourceError(f"weight files{where}: expected a list of paths, got {type(files).__name__}")
    out = []
    for i, f in enumerate(files):
        if not isinstance(f, (str, os.PathLike)):
            raise WeightSourceError(f"weight files{where}: entry {i} is {f!r} ({type(f).__name__}), not a path")
        text = os.fspath(f)
        if not isinstance(text, str) or not text:
            raise WeightSourceError(f"weight files{where}: entry {i} is {f!r}, not a path")
        out.append(text)
    if not out:
        raise WeightSourceError(f"no safetensors files given{where}: an empty list; pass at least one .safetensors "
                                "file, a directory or an index")
    return out


class SafetensorsSource(WeightSource):
    """Tensors of one or more safetensors files, read by offset (see the module docstring).

    ``weight_map`` (from a sharded index): name -> file; each named tensor must be in its file.
    """

    parallel_safe = True

    def __init__(self, files: Sequence[PathLike], *, weight_map: dict[str, str] | None = None,
                 origin: str | None = None) -> None:
        if sys.byteorder != "little":
            raise WeightSourceError("safetensors files are little-endian; this host is big-endian")
        self.files = _paths(files, origin)
        self.origin = origin or (self.files[0] if len(self.files) == 1 else f"{len(self.files)} safetensors files")
        self._entries: dict[str, _StEntry] = {}
        self._fds: dict[str, int] = {}
        self._ids: dict[str, tuple[int, int, int]] = {}  # path -> (device, inode, size) when its header was read
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
        meta = header.get("__metadata__")
        if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
            raise WeightSourceError(f"{path}: __metadata__ {meta!r} is not an object of strings; the file is corrupt "
                                    "(the safetensors library refuses it too)")
        found: dict[str, tuple[TensorInfo, int, int]] = {}
        for name, d in header.items():
            if name != "__metadata__":
                found[name] = parse_entry(path, name, d)
        check_coverage(path, [(b, e, n) for n, (_, b, e) in found.items()], int(st.st_size) - start)
        for name, (info, b, e) in found.items():
            if name in self._entries:
                raise WeightSourceError(f"{name!r} is in two weight files: {self._entries[name].path} and {path}; "
                                        "pass one checkpoint (or its index)")
            self._entries[name] = _StEntry(path, start + b, e - b, info, file_id)
        self._ids[path] = file_id[:3]

    def _check_map(self, weight_map: dict[str, str]) -> None:
        bad = [(n, f) for n, f in weight_map.items() if not isinstance(n, str) or not isinstance(f, str) or not f]
        if bad:
            n, f = bad[0]
            raise WeightSourceError(f"the index {self.origin}: weight_map[{n!r}] is {f!r}, not a file name; "
                                    f"{len(bad)} entr{'y' if len(bad) == 1 else 'ies'} of this kind")
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
            fd = open_regular(path)
            st = os.fstat(fd)
            if (int(st.st_dev), int(st.st_ino), int(st.st_size)) != self._ids.get(path):
                os.close(fd)
                raise WeightSourceError(f"the weight file {path} was replaced or changed size since its header was "
                                        "read; load again once the checkpoint is complete")
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
    fd = open_regular(str(path), "checkpoint index")
    try:
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightSourceError(f"cannot read the checkpoint index {path}: {exc}") from exc
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightSourceError(f"{path} has no 'weight_map' (name -> file): not a sharded safetensors index")
    bad = [(k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v or "\x00" in v]
    if bad:
        k, v = bad[0]
        raise WeightSourceError(f"the index {path}: weight_map[{k!r}] is {v!r} ({type(v).__name__}), not a file name "
                                f"such as 'model-00001-of-00002.safetensors' ({len(bad)} entr"
                                f"{'y' if len(bad) == 1 else 'ies'} of this kind); the index is corrupt")
    files = sorted({str(path.parent / f) for f in weight_map.values()})
    absent = [f for f in files if not os.path.exists(f)]
    if absent:
        raise WeightSourceError(f"the index {path} names {len(absent)} file(s) that do not exist, e.g. {absent[:3]}; "
                                "download the whole checkpoint")
    return SafetensorsSource(files, weight_map=dict(weight_map), origin=str(path))


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
    if isinstance(source, (list, tuple)):
        return SafetensorsSource(_paths(source))
    raise TypeError(f"weights must be a path, a list of safetensors files, a WeightSource or a function "
                    f"(name, meta_tensor) -> tensor; got {type(source).__name__}")
