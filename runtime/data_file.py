"""Reading `model.ptd` (ExecuTorch's FlatTensor named-data file) without copying it into memory.

The head of the file is a small flatbuffer (the FlatTensor table, with the
`FH01` extended header after its file identifier); it is parsed here directly,
with bounds checks on every offset, into key -> (dtype, sizes, dim order,
absolute byte range). Tensors are then served from the file itself:

- on CPU, as zero-copy views of a read-only memory map (the weights are used in
  place; pages come in as they are first touched and stay shared with the page
  cache),
- on CUDA, tensor by tensor through one reusable pinned staging buffer, so host
  memory holds at most one chunk of weights at a time.

A file too short for what its head declares is refused with one line. Knows
nothing about MG models or the export code.
"""

from __future__ import annotations

import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

MAGIC = b"FT01"
HEADER_MAGIC = b"FH01"
STAGING_BYTES = 64 << 20
# ExecuTorch ScalarType codes (c10 numbering) -> torch (the program runner reads tensors with this map too),
# and the ones a weight file may hold.
SCALAR_TYPES = {0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
                6: torch.float32, 7: torch.float64, 9: torch.complex64, 10: torch.complex128, 11: torch.bool,
                15: torch.bfloat16, 23: torch.float8_e5m2, 24: torch.float8_e4m3fn, 27: torch.uint16,
                28: torch.uint32, 29: torch.uint64}
DTYPES = {code: SCALAR_TYPES[code] for code in (0, 1, 2, 3, 4, 5, 6, 7, 11, 15)}


class DataFileError(ValueError):
    """A `.ptd` that cannot be read as it is; one line naming the file (and the key)."""


@dataclass(frozen=True)
class Entry:
    key: str
    dtype: torch.dtype
    sizes: tuple[int, ...]
    dim_order: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


class _Reader:
    """Bounds-checked little-endian reads of flatbuffer tables over `buf`."""

    def __init__(self, buf: bytes, source: str):
        self.buf, self.source = buf, source

    def fail(self, what: str) -> DataFileError:
        return DataFileError(f"{self.source}: corrupt FlatTensor head ({what})")

    def u(self, fmt: str, at: int) -> int:
        size = struct.calcsize(fmt)
        if at < 0 or at + size > len(self.buf):
            raise self.fail(f"offset {at} out of range")
        return struct.unpack_from("<" + fmt, self.buf, at)[0]

    def field(self, table: int, index: int) -> Optional[int]:
        """Absolute position of field `index` of the table at `table`, or None when absent."""
        vtable = table - self.u("i", table)
        vsize = self.u("H", vtable)
        slot = 4 + 2 * index
        if slot + 2 > vsize:
            return None
        off = self.u("H", vtable + slot)
        return table + off if off else None

    def scalar(self, table: int, index: int, fmt: str, default: int = 0) -> int:
        at = self.field(table, index)
        return default if at is None else self.u(fmt, at)

    def ref(self, at: int) -> int:
        return at + self.u("I", at)

    def vector(self, table: int, index: int) -> tuple[int, int]:
        """(start of elements, length) of a vector field; (0, 0) when absent."""
        at = self.field(table, index)
        if at is None:
            return 0, 0
        vec = self.ref(at)
        n = self.u("I", vec)
        if vec + 4 + n > len(self.buf):
            raise self.fail("vector length out of range")
        return vec + 4, n

    def tables(self, table: int, index: int) -> list[int]:
        start, n = self.vector(table, index)
        return [self.ref(start + 4 * i) for i in range(n)]

    def string(self, table: int, index: int) -> str:
        at = self.field(table, index)
        if at is None:
            raise self.fail("a key is missing")
        s = self.ref(at)
        n = self.u("I", s)
        if s + 4 + n > len(self.buf):
            raise self.fail("string out of range")
        return self.buf[s + 4:s + 4 + n].decode("utf-8", errors="replace")

    def ints(self, table: int, index: int, fmt: str) -> tuple[int, ...]:
        start, n = self.vector(table, index)
        size = struct.calcsize(fmt)
        if start + n * size > len(self.buf):
            raise self.fail("vector out of range")
        return tuple(struct.unpack_from(f"<{n}{fmt}", self.buf, start)) if n else ()


class DataFile:
    """An open `.ptd`: `entries` by key, `tensor(key, device)` to get one."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        source = str(self.path)
        try:
            self._file = open(self.path, "rb")
        except OSError as e:
            raise DataFileError(f"{source}: cannot read ({e.strerror or e})") from None
        try:
            self.size = os.fstat(self._file.fileno()).st_size
            self.entries = self._parse(source)
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
        except BaseException:
            self._file.close()
            raise
        self._staging: Optional[torch.Tensor] = None

    def _parse(self, source: str) -> dict[str, Entry]:
        head = self._file.read(64)
        if len(head) < 48 or head[4:8] != MAGIC or head[8:12] != HEADER_MAGIC:
            raise DataFileError(f"{source}: not an ExecuTorch data file (no '{MAGIC.decode()}' / "
                                f"'{HEADER_MAGIC.decode()}' identifiers)")
        _, fb_offset, fb_size, base, data_size = struct.unpack_from("<IQQQQ", head, 12)
        if base + data_size > self.size or fb_offset + fb_size > base:
            raise DataFileError(f"{source}: is {self.size} bytes; its header declares {base + data_size} "
                                f"(truncated file?)")
        self._file.seek(0)
        r = _Reader(self._file.read(base), source)
        root = r.ref(0)
        version = r.scalar(root, 0, "I")
        if version != 0:
            raise DataFileError(f"{source}: FlatTensor version {version}; this runner reads version 0")
        segments = [(r.scalar(t, 0, "Q"), r.scalar(t, 1, "Q")) for t in r.tables(root, 1)]
        entries: dict[str, Entry] = {}
        for t in r.tables(root, 2):
            key = r.string(t, 0)
            seg = r.scalar(t, 1, "I")
            layout = r.field(t, 2)
            if seg >= len(segments) or layout is None:
                raise DataFileError(f"{source}: entry {key!r} names segment {seg} of {len(segments)} or has no "
                                    f"tensor layout")
            layout = r.ref(layout)
            code = r.scalar(layout, 0, "b")
            if code not in DTYPES:
                raise DataFileError(f"{source}: entry {key!r} has scalar type {code}, which this runner does not read")
            offset, nbytes = segments[seg]
            if offset + nbytes > data_size:
                raise DataFileError(f"{source}: entry {key!r} spans bytes beyond the file's data (truncated file?)")
            entries[key] = Entry(key, DTYPES[code], r.ints(layout, 1, "i"), r.ints(layout, 2, "B"), base + offset,
                                 nbytes)
        return entries

    def tensor(self, key: str, device: torch.device) -> torch.Tensor:
        """The tensor under `key` in its logical shape: a view of the mapping on CPU, a device copy elsewhere."""
        e = self.entries[key]
        order = list(e.dim_order) or list(range(len(e.sizes)))
        physical = [e.sizes[d] for d in order]
        if device.type == "cpu":
            if e.nbytes == 0:
                flat = torch.empty(0, dtype=e.dtype)
            else:
                with warnings.catch_warnings():  # read-only mapping: torch warns that writes would fail
                    warnings.simplefilter("ignore", UserWarning)
                    flat = torch.frombuffer(self._map, dtype=e.dtype, count=e.nbytes // e.dtype.itemsize,
                                            offset=e.start)
        else:
            flat = self._to_device(e, device)
        return flat.view(physical).permute(sorted(range(len(order)), key=order.__getitem__))

    def _to_device(self, e: Entry, device: torch.device) -> torch.Tensor:
        out = torch.empty(e.nbytes, dtype=torch.uint8, device=device)
        if self._staging is None:
            self._staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
        staging = self._staging.numpy()
        done = 0
        while done < e.nbytes:
            n = min(STAGING_BYTES, e.nbytes - done)
            got = os.preadv(self._file.fileno(), [memoryview(staging)[:n]], e.start + done)
            if got != n:
                raise DataFileError(f"{self.path}: short read of {e.key!r} (the file changed while loading?)")
            out[done:done + n].copy_(self._staging[:n])  # synchronous: the staging buffer is reused next
            done += n
        return out.view(e.dtype)

    def release_staging(self) -> None:
        self._staging = None

    def close(self) -> None:
        """Unmap and close. CPU tensors from `tensor` keep the mapping alive until they are gone."""
        self._staging = None
        self._file.close()
