"""Writing `model.ptd`, ExecuTorch's FlatTensor named-data file, one tensor at a time.

Layout (as ExecuTorch's own FlatTensor serializer lays it out): the FlatTensor
flatbuffer with the `FH01` extended header inserted after its file identifier,
padded to the segment base (a multiple of `SEGMENT_ALIGNMENT`), then one
segment per tensor, each starting on a `SEGMENT_ALIGNMENT` boundary. Every
named-data entry carries its tensor layout (scalar type, sizes, dim order).
The flatbuffer is built first from shapes alone, so the tensors' bytes are
written straight from their source in chunks and never held together; the
sha256 of the whole file is computed on the way. Knows nothing about the runtime.
"""

from __future__ import annotations

import hashlib
import math
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from mg.kernels.executorch_env import ensure_flatc

SEGMENT_ALIGNMENT = 128  # FlatTensorConfig's default: segments can be memory-mapped in place
_HEADER_ALIGNMENT = 16
_QUEUED = 2  # chunks waiting for the writer thread (each at most CHUNK_BYTES)
Progress = Callable[[str], None]


@dataclass(frozen=True)
class PtdTensor:
    key: str  # the program's fully qualified name for it
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterator[torch.Tensor]]  # contiguous pieces, in order, of `dtype`

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


# torch dtype <-> ExecuTorch ScalarType name (executorch.exir.scalar_type), for the dtypes weights come in.
SCALAR_TYPE_NAMES = {torch.float32: "FLOAT", torch.bfloat16: "BFLOAT16", torch.float16: "HALF",
                     torch.float64: "DOUBLE", torch.int64: "LONG", torch.int32: "INT", torch.uint8: "BYTE",
                     torch.int8: "CHAR", torch.bool: "BOOL"}


def _scalar_type(dtype: torch.dtype):
    from executorch.exir.scalar_type import ScalarType

    return ScalarType[SCALAR_TYPE_NAMES[dtype]]


def _segments(tensors: list[PtdTensor]) -> tuple[list[int], int]:
    """Each tensor's offset from the segment base (SEGMENT_ALIGNMENT-aligned, in order), and the data size."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(_align(end, SEGMENT_ALIGNMENT))
        end = offsets[-1] + t.nbytes
    return offsets, end


def header_bytes(tensors: list[PtdTensor]) -> tuple[bytes, list[int]]:
    """The file's head (extended header + flatbuffer, padded to the segment base) and each tensor's offset
    from the segment base."""
    from executorch.exir._serialize._program import _insert_flatbuffer_header
    from executorch.exir.tensor_layout import TensorLayout
    from executorch.extension.flat_tensor.serialize.flat_tensor_schema import DataSegment, FlatTensor, NamedData
    from executorch.extension.flat_tensor.serialize.serialize import (
        _FLAT_TENSOR_VERSION, FlatTensorHeader, _serialize_to_flatbuffer)

    ensure_flatc()
    offsets, end = _segments(tensors)
    flat = FlatTensor(
        version=_FLAT_TENSOR_VERSION,
        segments=[DataSegment(offset=o, size=t.nbytes) for o, t in zip(offsets, tensors)],
        named_data=[NamedData(key=t.key, segment_index=i,
                              tensor_layout=TensorLayout(_scalar_type(t.dtype), list(t.shape),
                                                         list(range(len(t.shape)))))
                    for i, t in enumerate(tensors)])
    payload = bytes(_serialize_to_flatbuffer(flat))
    header_len = _align(FlatTensorHeader.EXPECTED_LENGTH, _HEADER_ALIGNMENT)
    base = _align(len(payload) + header_len, SEGMENT_ALIGNMENT)
    header = FlatTensorHeader(flatbuffer_offset=header_len, flatbuffer_size=len(payload), segment_base_offset=base,
                              segment_data_size=end).to_bytes()
    head = _insert_flatbuffer_header(payload, r"FT[0-9a-zA-Z][0-9a-zA-Z]", header.ljust(header_len, b"\0"))
    return head.ljust(base, b"\0"), offsets


def file_size(tensors: list[PtdTensor]) -> int:
    """Bytes `write_ptd` will write (header estimate included), for the disk-space check."""
    return _segments(tensors)[1] + 4096 + 256 * len(tensors)


def write_ptd(path: Path, tensors: list[PtdTensor], progress: Optional[Progress] = None) -> tuple[int, str]:
    """Write `tensors` to `path` as a FlatTensor file; -> (size in bytes, sha256 hex). Keys must be unique.
    Chunks are produced (read, converted) on this thread while a writer thread hashes and writes the previous
    ones; at most `_QUEUED` chunks wait between them."""
    keys = [t.key for t in tensors]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key in model.ptd: {sorted(k for k in keys if keys.count(k) > 1)[0]!r}")
    head, offsets = header_bytes(tensors)
    total = len(head) + (offsets[-1] + tensors[-1].nbytes if tensors else 0)
    digest = hashlib.sha256()
    say = progress or (lambda msg: None)
    pending: queue.Queue = queue.Queue(maxsize=_QUEUED)
    failure: list[BaseException] = []

    def writer(f) -> None:
        while True:
            data = pending.get()
            if data is None:
                return
            if not failure:
                try:
                    f.write(data)
                    digest.update(data)
                except BaseException as e:  # reported by the producer
                    failure.append(e)

    t0 = last = time.perf_counter()
    written = 0
    with open(path, "wb") as f:
        thread = threading.Thread(target=writer, args=(f,), daemon=True)
        thread.start()
        try:
            def put(data) -> None:
                nonlocal written
                if failure:
                    raise failure[0]
                pending.put(data)
                written += len(data)

            put(head)
            for t, offset in zip(tensors, offsets):
                put(b"\0" * (len(head) + offset - written))
                start = written
                for part in t.chunks():
                    if part.dtype != t.dtype or not part.is_contiguous():
                        raise ValueError(f"model.ptd: tensor {t.key!r} came as {part.dtype}; expected {t.dtype}")
                    put(memoryview(part.view(torch.uint8).numpy()) if part.numel() else b"")
                    now = time.perf_counter()
                    if now - last >= 5.0:
                        last = now
                        say(f"{path.name}: {written / 1e9:.1f} / {total / 1e9:.1f} GB "
                            f"({written / 1e9 / (now - t0):.2f} GB/s)")
                if written - start != t.nbytes:
                    raise ValueError(f"model.ptd: tensor {t.key!r} came as {written - start} bytes; expected "
                                     f"{t.nbytes}")
        finally:
            pending.put(None)
            thread.join()
        if failure:
            raise failure[0]
        f.flush()
        os.fsync(f.fileno())
    return written, digest.hexdigest()
