"""Where an export's weights come from, read tensor by tensor and chunk by chunk.

An export never holds a whole model: the program is traced on meta tensors and
the weights stream from a source straight into `model.ptd`. Sources:

- `SafetensorsWeights`: a checkpoint directory's `model.safetensors`, or the
  Hugging Face sharded form (`model-0000k-of-0000n.safetensors` listed by
  `model.safetensors.index.json`), read chunk by chunk at known offsets; headers are read and checked
  up front (index and shards must agree, every tensor present, shaped and
  floating point) before anything is written.
- `RandomWeights`: deterministic random weights for presets, each tensor drawn
  from a generator seeded by (seed, tensor name), chunk by chunk, so any tensor
  can be produced alone, in any order, in bounded memory.
- `ModuleWeights`: the parameters of an in-memory module (tests, scripts).

Chunks are at most `CHUNK_BYTES` of output. Knows nothing about ExecuTorch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Iterator, Mapping, Protocol

import torch

from .checkpoint import CheckpointError

CHUNK_BYTES = 64 << 20
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


class WeightsError(CheckpointError):
    """A weight source that disagrees with itself or with the model; one line naming the file and tensor."""


class WeightSource(Protocol):
    description: str

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Refuse (WeightsError) a missing, unexpected, misshapen or non-float tensor."""

    def chunks(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """The tensor `name` converted to `dtype`, as contiguous row chunks (flattened) in order."""


def _element_ranges(shape: tuple[int, ...], itemsize: int) -> Iterator[tuple[int, int]]:
    """[start, stop) element ranges of the flattened tensor, whole rows at a time, at most CHUNK_BYTES each
    (one row at least). A 0-dim tensor is one row of one element."""
    width = math.prod(shape[1:])
    rows = shape[0] if shape else 1
    step = max(1, CHUNK_BYTES // max(width * itemsize, 1))
    for start in range(0, rows, step):
        yield start * width, min(rows, start + step) * width


def _check_names(source: str, found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]],
                 where: Mapping[str, str]) -> None:
    missing = sorted(set(expected) - set(found))
    if missing:
        raise WeightsError(f"{source}: missing tensor '{missing[0]}' with shape {list(expected[missing[0]])}"
                           f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    extra = sorted(set(found) - set(expected))
    if extra:
        raise WeightsError(f"{where.get(extra[0], source)}: unexpected tensor '{extra[0]}'; this configuration "
                           f"has {len(expected)} tensors (see the checkpoint format in README.md)")
    for name, shape in expected.items():
        if tuple(found[name]) != tuple(shape):
            raise WeightsError(f"{where.get(name, source)}: tensor '{name}' has shape {list(found[name])}; "
                               f"expected {list(shape)}")


# -- safetensors --------------------------------------------------------------------------------------


class _Shard:
    """One safetensors file: its header, and reads of any tensor's element range."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise WeightsError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
                (n,) = struct.unpack("<Q", head)
                self.size = path.stat().st_size
                if n > min(self.size - 8, 100 << 20):
                    raise WeightsError(f"{path}: not a safetensors file (header length {n} does not fit the file)")
                header = json.loads(f.read(n))
        except OSError as e:
            raise WeightsError(f"{path}: cannot read ({e.strerror or e})") from None
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise WeightsError(f"{path}: not a safetensors file (its header is not JSON)") from None
        if not isinstance(header, dict):
            raise WeightsError(f"{path}: not a safetensors file (its header is not a JSON object)")
        self.base = 8 + n
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (a, b) = _ST_DTYPES[info["dtype"]], tuple(info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise WeightsError(f"{path}: tensor '{name}' has an unreadable header entry {info!r}") from None
            if b - a != math.prod(shape) * dtype.itemsize or self.base + b > self.size:
                raise WeightsError(f"{path}: tensor '{name}' spans bytes [{a}, {b}) which do not match its shape "
                                   f"{list(shape)} {dtype} or lie beyond the file's {self.size} bytes "
                                   f"(truncated file?)")
            self.tensors[name] = (dtype, shape, self.base + a, self.base + b)
        self._file = None

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the stored tensor (flat), read into a fresh buffer. Plain reads, not a
        memory map: pages of a map stay in the process's RSS, and an export must stay bounded whatever the
        checkpoint's size."""
        if self._file is None:
            self._file = open(self.path, "rb")
        dtype, _, a, _ = self.tensors[name]
        n = (stop - start) * dtype.itemsize
        buf = bytearray(n)
        if n and os.preadv(self._file.fileno(), [buf], a + start * dtype.itemsize) != n:
            raise WeightsError(f"{self.path}: short read of tensor '{name}' (the file changed while exporting?)")
        return torch.frombuffer(buf, dtype=dtype) if n else torch.empty(0, dtype=dtype)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class SafetensorsWeights:
    """A checkpoint directory's weights: `model.safetensors`, or shards listed by `model.safetensors.index.json`."""

    def __init__(self, directory: Path):
        directory = Path(directory)
        single, index = directory / SINGLE_FILE, directory / INDEX_FILE
        if single.is_file() and index.is_file():
            raise WeightsError(f"{directory}: holds both {SINGLE_FILE} and {INDEX_FILE}; keep one of them")
        self._shard_of: dict[str, _Shard] = {}
        if single.is_file():
            shard = _Shard(single)
            self._shard_of = {name: shard for name in shard.tensors}
            self.description = str(single)
        elif index.is_file():
            self._read_index(index)
            self.description = str(index)
        else:
            raise WeightsError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (a checkpoint directory holds "
                               f"config.json and its weights)")
        self.where: dict[str, str] = {name: str(s.path) for name, s in self._shard_of.items()}

    def _read_index(self, index: Path) -> None:
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise WeightsError(f"{index}: not a safetensors index (a JSON object with a 'weight_map' of tensor "
                               f"name -> shard file)") from None
        shards: dict[str, _Shard] = {}
        for file in sorted(set(weight_map.values())):
            if "/" in file or file in ("", ".", ".."):
                raise WeightsError(f"{index}: shard '{file}' is not a file name in {index.parent}")
            path = index.parent / file
            if not path.is_file():
                raise WeightsError(f"{index}: lists shard '{file}', which is missing from {index.parent}")
            shards[file] = _Shard(path)
        for name, file in weight_map.items():
            if name not in shards[file].tensors:
                raise WeightsError(f"{shards[file].path}: has no tensor '{name}', which {index.name} places in it "
                                   f"(index and shards disagree)")
            self._shard_of[name] = shards[file]
        for file, shard in shards.items():
            for name in shard.tensors:
                if weight_map.get(name) != file:
                    raise WeightsError(f"{shard.path}: holds tensor '{name}', which {index.name} "
                                       f"{'places in ' + repr(weight_map[name]) if name in weight_map else 'does not list'}"
                                       f" (index and shards disagree)")

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        found = {name: shard.tensors[name][1] for name, shard in self._shard_of.items()}
        _check_names(self.description, found, expected, self.where)
        for name in expected:
            dtype = self._shard_of[name].tensors[name][0]
            if not dtype.is_floating_point:
                raise WeightsError(f"{self.where[name]}: tensor '{name}' has dtype {dtype}; expected a float dtype "
                                   f"(a quantized checkpoint is not read: export the float one with --weights "
                                   f"int8|int4)")

    def chunks(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Iterator[torch.Tensor]:
        shard = self._shard_of[name]
        stored = shard.tensors[name][0]
        for a, b in _element_ranges(shape, max(dtype.itemsize, stored.itemsize)):
            part = shard.read(name, a, b)
            yield part if part.dtype == dtype else part.to(dtype)

    def close(self) -> None:
        for shard in {id(s): s for s in self._shard_of.values()}.values():
            shard.close()


# -- random weights -----------------------------------------------------------------------------------


def tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def random_chunks(seed: int, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """Deterministic random values of tensor `name`: norms ~ 1 + N(0, 0.1); matrices other than embeddings
    ~ N(0, 1/fan_in); the rest ~ N(0, 1). Drawn in float32, row chunk by row chunk, from one generator."""
    gen = torch.Generator().manual_seed(tensor_seed(seed, name))
    for a, b in _element_ranges(shape, 4):
        x = torch.randn(b - a, generator=gen)
        if name.endswith("norm.weight"):
            x = 1.0 + 0.1 * x
        elif len(shape) == 2 and "embeddings" not in name:
            x /= shape[1] ** 0.5
        yield x.to(dtype)


class RandomWeights:
    def __init__(self, seed: int):
        self.seed = seed
        self.description = f"random weights (seed {seed})"

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        pass

    def chunks(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Iterator[torch.Tensor]:
        return random_chunks(self.seed, name, shape, dtype)


class ModuleWeights:
    """The parameters of a module in memory (by its parameter names)."""

    def __init__(self, module: torch.nn.Module, description: str = "module in memory"):
        self.params = dict(module.named_parameters())
        self.description = description

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        _check_names(self.description, {n: tuple(p.shape) for n, p in self.params.items()}, expected, {})

    def chunks(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Iterator[torch.Tensor]:
        flat = self.params[name].detach().reshape(-1)
        for a, b in _element_ranges(shape, dtype.itemsize):
            yield flat[a:b].to(dtype)


def materialize(source: WeightSource, module: torch.nn.Module) -> torch.nn.Module:
    """Fill `module`'s parameters from `source` (eager references and tests)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            flat = p.view(-1)
            at = 0
            for part in source.chunks(name, tuple(p.shape), p.dtype):
                flat[at:at + part.numel()].copy_(part)
                at += part.numel()
    return module
