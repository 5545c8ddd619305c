"""Safetensors files as a weight source: one file, several, a directory, or a transformers / diffusers sharded
index ``*.safetensors.index.json``, read by offset, in chunks, straight into the destination.

A tensor stored in the model's dtype is read into its place in the arena with no copy in between, another dtype
goes through one reused staging buffer (:class:`~.base.Staging`) and is converted chunk by chunk. Nothing reads a
whole file into memory. Headers are checked before anything is read (dtypes, shapes, byte ranges that overlap or
leave gaps, duplicate names).
"""

from __future__ import annotations

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
from typing import Any

import torch

from magi_core.host.errors import WeightSourceError
from magi_core.host.loading.base import (
    MissingTensor,
    PathLike,
    ShapeMismatch,
    Staging,
    TensorInfo,
    WeightSource,
    as_bytes,
)

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
    except RecursionError as exc:  # JSON nested deeper than Python's parser goes: no safetensors header is
        raise WeightSourceError(f"{path}: not a safetensors file (its header nests JSON too deeply to read)") from exc
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


def file_paths(files: Any, origin: str | None = None) -> list[str]:
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
        self.files = file_paths(files, origin)
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
            self._pread(e, as_bytes(out), e.begin)
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
