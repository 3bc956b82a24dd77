"""Tensor files in the safetensors format, written as a stream and read without trusting them.

The format (huggingface/safetensors ``docs``): an 8-byte little-endian header length, a JSON
header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
then the raw little-endian bytes of every tensor, offsets relative to the end of the header. Any
safetensors reader opens these files; DCP writes and reads them itself for two reasons:

- **Writing as a stream with digests.** ``TensorFileWriter`` copies one tensor at a time to the
  file (the header first: every tensor's size is known before its bytes are), hashing each
  tensor's bytes (sha256) as it writes them, so a rank's save needs no second pass over its files
  and holds at most one tensor's bytes beyond what it saves.
- **Reading a file someone else may have written.** ``TensorFile`` checks the header before it
  maps anything: a bounded header, known dtypes, non-negative shapes whose byte size matches
  their offsets, offsets inside the file, no two tensors sharing bytes. Tensors are views of a
  read-only memory map (no copy until the caller takes one), and ``read`` verifies a tensor's
  digest when the caller has one. ``release`` drops a tensor's pages from the process (they stay
  in the page cache and map again on the next access), so a load that verifies, then copies,
  tensor after tensor, holds about one tensor's pages at a time, not its whole share.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 64 << 20
"""A header lists every tensor of a file: a few hundred bytes each, 64 MiB is ample."""
_ALIGN = 8


class TensorFileError(ValueError):
    """A tensor file is malformed or does not hold what its index says: ``"<file>: <what>"``."""


def _nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count * torch.empty((), dtype=dtype).element_size()


class TensorFileWriter:
    """Writes ``tensors`` (name → CPU tensor) to ``path`` with ``metadata``; ``digests`` maps
    each name to the sha256 of its bytes, ``size`` the file's bytes, after ``write``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        tensors: Mapping[str, torch.Tensor],
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.tensors = dict(tensors)
        self.metadata = dict(metadata or {})
        self.digests: dict[str, str] = {}
        self.size = 0

    def _header(self) -> bytes:
        header: dict = {"__metadata__": self.metadata} if self.metadata else {}
        offset = 0
        for name, tensor in self.tensors.items():
            if tensor.dtype not in NAMES:
                raise ValueError(f"{self.path}: {name} has dtype {tensor.dtype}, not storable")
            size = tensor.numel() * tensor.element_size()
            header[name] = {
                "dtype": NAMES[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        return text + b" " * (-len(text) % _ALIGN)  # the data section starts 8-byte aligned

    def write(self) -> None:
        """Write and fsync the file (``OSError`` naming it when the disk refuses)."""
        header = self._header()
        try:
            with open(self.path, "wb") as f:
                f.write(struct.pack("<Q", len(header)))
                f.write(header)
                for name, tensor in self.tensors.items():
                    data = _bytes_of(tensor)
                    self.digests[name] = hashlib.sha256(data).hexdigest()
                    f.write(data)
                f.flush()
                os.fsync(f.fileno())
                self.size = f.tell()
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in memory order (a view, no copy, for a contiguous CPU tensor)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        raise ValueError("tensor files are written from host memory")
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes, as ``TensorFileWriter`` records it."""
    return hashlib.sha256(_bytes_of(tensor)).hexdigest()


class TensorFile:
    """A tensor file opened for reading; raises ``TensorFileError`` if its header is not what a
    tensor file's must be (module docstring). ``entries`` maps names to (dtype, shape, begin,
    end) with absolute byte offsets."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                raw = f.read(8)
                if len(raw) < 8:
                    raise self._error("shorter than a header length")
                (header_len,) = struct.unpack("<Q", raw)
                if header_len > min(MAX_HEADER_BYTES, size - 8):
                    raise self._error(f"declares a {header_len}-byte header in a {size}-byte file")
                header_text = f.read(header_len)
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except OSError as exc:
            raise TensorFileError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        try:
            header = json.loads(header_text)
        except (ValueError, RecursionError) as exc:
            raise self._error(f"header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self._error("header is not a JSON object")
        meta = header.pop("__metadata__", {})
        if not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
        ):
            raise self._error("__metadata__ is not a map of strings")
        self.metadata: dict[str, str] = meta
        data_start = 8 + header_len
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        spans = []
        for name, entry in header.items():
            dtype, shape, begin, end = self._entry(name, entry)
            if not data_start <= data_start + begin <= data_start + end <= size:
                raise self._error(f"{name}: bytes [{begin}, {end}) lie outside the data")
            spans.append((begin, end, name))
            self.entries[name] = (dtype, shape, data_start + begin, data_start + end)
        spans.sort()
        for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:], strict=False):
            if begin_b < end_a:
                raise self._error(f"tensors {a} and {b} share bytes")

    def _error(self, what: str) -> TensorFileError:
        return TensorFileError(f"{self.path}: {what}")

    def _entry(self, name: str, entry) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        if not isinstance(entry, dict):
            raise self._error(f"{name}: entry is not an object")
        name_of_dtype = entry.get("dtype")
        dtype = DTYPES.get(name_of_dtype) if isinstance(name_of_dtype, str) else None
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if dtype is None:
            raise self._error(f"{name}: unknown dtype {entry.get('dtype')!r}")
        if not isinstance(shape, list) or not all(_is_count(s) for s in shape) or len(shape) > 8:
            raise self._error(f"{name}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
            raise self._error(f"{name}: data_offsets {offsets!r} are not two byte offsets")
        begin, end = offsets
        if end - begin != _nbytes(shape, dtype):
            raise self._error(
                f"{name}: shape {shape} of {entry['dtype']} needs "
                f"{_nbytes(shape, dtype)} bytes, the offsets give {end - begin}"
            )
        return dtype, tuple(shape), begin, end

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def read(self, name: str, *, sha256: str | None = None) -> torch.Tensor:
        """Tensor ``name`` as a read-only view of the file (copy it to keep or change it); with
        ``sha256``, its bytes are checked first (``TensorFileError`` when they differ)."""
        if name not in self.entries:
            raise self._error(f"holds no tensor {name!r}")
        dtype, shape, begin, end = self.entries[name]
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        view = memoryview(self._map)[begin:end]
        if sha256 is not None:
            digest_ok = hashlib.sha256(view).hexdigest() == sha256
            self.release(name)  # the hash mapped every page; the caller maps what it copies
            if not digest_ok:
                raise self._error(f"{name}: bytes differ from the checkpoint's index (corrupt)")
        with warnings.catch_warnings():  # read-only on purpose: callers copy what they keep
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(view, dtype=dtype).view(shape)

    def release(self, name: str) -> None:
        """Unmap tensor ``name``'s pages from this process (``madvise(MADV_DONTNEED)`` on a
        read-only file mapping: the views stay valid and the bytes stay in the page cache)."""
        _, _, begin, end = self.entries[name]
        if self._map is None or begin == end or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = begin - begin % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
