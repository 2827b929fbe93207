"""The artifact contract as frozen dataclasses, with strict JSON read/write.

Every key of `manifest.json` is spelled here and nowhere else. Reading is
strict: an unknown key, a missing key, a wrong type or a value out of range is
one `ManifestError` naming the file, the key path, the value and what is
allowed. This module knows nothing about torch, ExecuTorch or models.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from .constants import (
    DTYPES, FORMAT, INT4_GROUP_SIZES, LAYOUT_CELL, LAYOUT_SEQUENCE, LAYOUTS, POLICIES, POLICY_FLAT, POLICY_RING, VERSION,
    GROUP_DRAFT_LINEARS, GROUP_TARGET_HEAD, GROUP_TARGET_LINEARS, WEIGHT_GROUPS, WEIGHTS_FLOAT, WEIGHTS_INT4,
    WEIGHTS_INT8, FIT_GPTQ, FIT_ROUND, WEIGHT_FITS,
)
from .errors import ManifestError


def _fail(path: str, value: Any, allowed: str) -> None:
    raise ManifestError(f"key '{path}' has value {value!r}; allowed: {allowed}")


def _need(cond: bool, path: str, value: Any, allowed: str) -> None:
    if not cond:
        _fail(path, value, allowed)


@dataclass(frozen=True)
class KVLayer:
    """One attention layer's cache geometry."""

    layer_id: int
    policy: str  # "flat" (global attention) or "ring" (sliding window)
    window: int  # 0 for flat layers; the sliding window for ring layers
    n_kv_heads: int
    head_dim: int

    def check(self, path: str) -> None:
        _need(self.layer_id >= 0, f"{path}.layer_id", self.layer_id, "an integer >= 0")
        _need(self.policy in POLICIES, f"{path}.policy", self.policy, " | ".join(POLICIES))
        if self.policy == POLICY_FLAT:
            _need(self.window == 0, f"{path}.window", self.window, "0 for a flat layer")
        else:
            _need(self.window >= 1, f"{path}.window", self.window, "an integer >= 1 for a ring layer")
        _need(self.n_kv_heads >= 1, f"{path}.n_kv_heads", self.n_kv_heads, "an integer >= 1")
        _need(self.head_dim >= 1, f"{path}.head_dim", self.head_dim, "an integer >= 1")


@dataclass(frozen=True)
class KVSpec:
    """A cache the runtime owns for the program (target or draft)."""

    layout: str  # "sequence" (kBatchedSequence) or "cell" (kBatchedCell)
    max_seqs: Optional[int]  # sequence layout: sequences served at once
    max_cells: Optional[int]  # cell layout: cells in the pool (all sequences together)
    capacity: int  # per-sequence context length
    max_write: int  # tokens written per step (all sequences together)
    dtype: str
    layers: tuple[KVLayer, ...]

    def check(self, path: str) -> None:
        _need(self.layout in LAYOUTS, f"{path}.layout", self.layout, " | ".join(LAYOUTS))
        if self.layout == LAYOUT_SEQUENCE:
            _need(self.max_seqs is not None and self.max_seqs >= 1, f"{path}.max_seqs", self.max_seqs,
                  "an integer >= 1 for the sequence layout")
            _need(self.max_cells is None, f"{path}.max_cells", self.max_cells, "null for the sequence layout")
        else:
            _need(self.max_cells is not None and self.max_cells >= 1, f"{path}.max_cells", self.max_cells,
                  "an integer >= 1 for the cell layout")
            _need(self.max_seqs is None, f"{path}.max_seqs", self.max_seqs, "null for the cell layout")
        _need(self.capacity >= 1, f"{path}.capacity", self.capacity, "an integer >= 1")
        _need(1 <= self.max_write <= self.capacity, f"{path}.max_write", self.max_write,
              f"an integer in [1, capacity={self.capacity}]")
        _need(self.dtype in DTYPES, f"{path}.dtype", self.dtype, " | ".join(DTYPES))
        _need(len(self.layers) >= 1, f"{path}.layers", [], "at least one layer")
        for i, layer in enumerate(self.layers):
            _need(layer.layer_id == i, f"{path}.layers[{i}].layer_id", layer.layer_id, f"{i} (layers in order)")

    @property
    def max_active_seqs(self) -> int:
        """Sequences that can be active at once: `max_seqs` (sequence layout), or for the cell layout
        min(max_write, max_cells), since each active sequence writes a token per step and holds a cell."""
        if self.layout == LAYOUT_SEQUENCE:
            return self.max_seqs
        return min(self.max_write, self.max_cells)

    @property
    def windows(self) -> tuple[int, ...]:
        return tuple(layer.window for layer in self.layers)

    @property
    def ring_layers(self) -> tuple[int, ...]:
        return tuple(layer.layer_id for layer in self.layers if layer.policy == POLICY_RING)


@dataclass(frozen=True)
class ModelFacts:
    name: str
    vocab_size: int
    dim: int
    n_layers: int
    bos_id: Optional[int]
    eos_ids: tuple[int, ...]
    dtype: str  # activation and weight dtype

    def check(self, path: str) -> None:
        _need(bool(self.name), f"{path}.name", self.name, "a non-empty string")
        _need(self.vocab_size >= 2, f"{path}.vocab_size", self.vocab_size, "an integer >= 2")
        _need(self.dim >= 1, f"{path}.dim", self.dim, "an integer >= 1")
        _need(self.n_layers >= 1, f"{path}.n_layers", self.n_layers, "an integer >= 1")
        ids = ([self.bos_id] if self.bos_id is not None else []) + list(self.eos_ids)
        for tok in ids:
            _need(0 <= tok < self.vocab_size, f"{path}.bos_id/eos_ids", tok, f"token ids in [0, {self.vocab_size})")
        _need(self.dtype in DTYPES, f"{path}.dtype", self.dtype, " | ".join(DTYPES))


@dataclass(frozen=True)
class DraftFacts:
    """The DFlash drafter stored beside the target."""

    block_size: int
    mask_token_id: int
    target_layers: tuple[int, ...]  # target layers whose *input* residual is tapped
    n_layers: int
    kv: KVSpec  # the draft context cache (same layout as the target's)

    def check(self, path: str) -> None:
        _need(self.block_size >= 2, f"{path}.block_size", self.block_size, "an integer >= 2")
        _need(self.mask_token_id >= 0, f"{path}.mask_token_id", self.mask_token_id, "a token id >= 0")
        _need(len(self.target_layers) >= 1, f"{path}.target_layers", list(self.target_layers), "a non-empty list")
        _need(self.n_layers == len(self.kv.layers), f"{path}.n_layers", self.n_layers,
              f"{len(self.kv.layers)} (the number of draft cache layers)")


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a method. Dims are ints or symbol names with bounds in the method."""

    name: str
    role: str
    dtype: str  # "int64" | "float32" | "bfloat16"
    shape: tuple[Union[int, str], ...]

    def check(self, path: str) -> None:
        allowed = ("int64", "float32", "bfloat16")
        _need(self.dtype in allowed, f"{path}.dtype", self.dtype, " | ".join(allowed))


@dataclass(frozen=True)
class MethodSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    bounds: dict[str, tuple[int, int]] = field(default_factory=dict)  # symbol -> [lo, hi]

    def check(self, path: str) -> None:
        for sym, (lo, hi) in self.bounds.items():
            _need(1 <= lo <= hi, f"{path}.bounds.{sym}", [lo, hi], "[lo, hi] with 1 <= lo <= hi")
        for kind, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            for i, spec in enumerate(specs):
                for dim in spec.shape:
                    if isinstance(dim, str):
                        _need(dim in self.bounds, f"{path}.{kind}[{i}].shape", list(spec.shape),
                              f"ints or symbols with bounds ({', '.join(self.bounds) or 'none declared'})")


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    sha256: str

    def check(self, path: str) -> None:
        _need("/" not in self.name and self.name not in ("", ".", ".."), f"{path}.name", self.name,
              "a plain file name inside the artifact directory")
        _need(self.size >= 0, f"{path}.size", self.size, "an integer >= 0")
        _need(len(self.sha256) == 64 and all(c in "0123456789abcdef" for c in self.sha256), f"{path}.sha256",
              self.sha256, "64 lowercase hex digits")


# Keys added to version 1 after its first release: optional when read (an older manifest lacks them), and
# written only when they differ from their default (an older reader then still reads a float artifact).
_ADDED = {"omit_default": True}


@dataclass(frozen=True)
class WeightGroup:
    """A group of tensors stored quantized (groups not listed are stored in `model.dtype`)."""

    group: str  # target.linears | target.head | draft.linears
    scheme: str  # int8 (per output channel) | int4 (per group of input columns, with zero points)
    group_size: Optional[int]  # int4: input columns per scale; int8: null
    tensors: int  # how many linears the group holds
    fit: str = field(default=FIT_ROUND, metadata=_ADDED)  # round (to nearest) | gptq (calibrated)
    calibration_tokens: int = field(default=0, metadata=_ADDED)  # gptq: tokens of calibration text

    def check(self, path: str) -> None:
        _need(self.group in WEIGHT_GROUPS, f"{path}.group", self.group, " | ".join(WEIGHT_GROUPS))
        _need(self.scheme in (WEIGHTS_INT8, WEIGHTS_INT4), f"{path}.scheme", self.scheme,
              f"{WEIGHTS_INT8} | {WEIGHTS_INT4}")
        if self.scheme == WEIGHTS_INT4:
            _need(self.group_size in INT4_GROUP_SIZES, f"{path}.group_size", self.group_size,
                  " | ".join(map(str, INT4_GROUP_SIZES)))
        else:
            _need(self.group_size is None, f"{path}.group_size", self.group_size, "null (int8 has no groups)")
        _need(self.tensors >= 1, f"{path}.tensors", self.tensors, "an integer >= 1")
        _need(self.fit in WEIGHT_FITS, f"{path}.fit", self.fit, " | ".join(WEIGHT_FITS))
        if self.fit == FIT_GPTQ:
            _need(self.calibration_tokens >= 1, f"{path}.calibration_tokens", self.calibration_tokens,
                  "an integer >= 1 (gptq is calibrated on text)")
        else:
            _need(self.calibration_tokens == 0, f"{path}.calibration_tokens", self.calibration_tokens,
                  "0 (round-to-nearest uses no calibration text)")


@dataclass(frozen=True)
class Provenance:
    tool_version: str
    torch_version: str
    executorch_version: str


@dataclass(frozen=True)
class Manifest:
    format: str
    version: int
    model: ModelFacts
    kv: KVSpec
    draft: Optional[DraftFacts]
    methods: tuple[MethodSpec, ...]
    files: tuple[FileEntry, ...]
    provenance: Provenance
    weights: tuple[WeightGroup, ...] = field(default=(), metadata=_ADDED)

    def check(self, path: str = "") -> None:
        _need(self.format == FORMAT, "format", self.format, repr(FORMAT))
        _need(self.version == VERSION, "version", self.version, str(VERSION))
        _need(len(self.kv.layers) == self.model.n_layers, "kv.layers", f"{len(self.kv.layers)} layers",
              f"{self.model.n_layers} (model.n_layers)")
        if self.draft is not None:
            _need(self.draft.kv.layout == self.kv.layout, "draft.kv.layout", self.draft.kv.layout,
                  f"{self.kv.layout!r} (the target's layout)")
            for t in self.draft.target_layers:
                _need(0 <= t < self.model.n_layers, "draft.target_layers", list(self.draft.target_layers),
                      f"layer ids in [0, {self.model.n_layers})")
        names = [m.name for m in self.methods]
        _need(len(set(names)) == len(names), "methods", names, "unique method names")
        fnames = [f.name for f in self.files]
        _need(len(set(fnames)) == len(fnames), "files", fnames, "unique file names")
        groups = [w.group for w in self.weights]
        _need(len(set(groups)) == len(groups), "weights", groups, "each group at most once")
        if self.draft is None:
            _need(GROUP_DRAFT_LINEARS not in groups, "weights", groups, "no draft group without a drafter")

    def weight_scheme(self, group: str) -> str:
        """How `group`'s tensors are stored: int8 | int4 | float."""
        return next((w.scheme for w in self.weights if w.group == group), WEIGHTS_FLOAT)

    @property
    def weights_label(self) -> str:
        """How the weights are stored, in a few words: "float32", "int4-g128 linears, bfloat16 head", ..."""
        if not self.weights:
            return self.model.dtype
        names = {GROUP_TARGET_LINEARS: "linears", GROUP_TARGET_HEAD: "head", GROUP_DRAFT_LINEARS: "drafter"}
        parts = [f"{w.scheme}{f'-g{w.group_size}' if w.group_size else ''}{'-gptq' if w.fit == FIT_GPTQ else ''} "
                 f"{names[w.group]}" for w in self.weights]
        if self.weight_scheme(GROUP_TARGET_HEAD) == WEIGHTS_FLOAT:
            parts.append(f"{self.model.dtype} head")
        return ", ".join(parts)

    def method(self, name: str) -> MethodSpec:
        for m in self.methods:
            if m.name == name:
                return m
        raise ManifestError(f"method '{name}' is not declared in the manifest; declared: "
                            f"{', '.join(m.name for m in self.methods)}")

    @property
    def has_draft(self) -> bool:
        return self.draft is not None


# --------------------------------------------------------------------------- JSON


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "an object"
    if dataclasses.is_dataclass(tp):
        return "an object"
    return {int: "an integer", str: "a string", type(None): "null", bool: "a boolean"}.get(tp, str(tp))


def _parse(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _parse(arg, value, path)
            except ManifestError:
                continue
        _fail(path, value, _type_name(tp))
    if tp is type(None):
        _need(value is None, path, value, "null")
        return None
    if tp is int:
        _need(isinstance(value, int) and not isinstance(value, bool), path, value, "an integer")
        return value
    if tp is str:
        _need(isinstance(value, str), path, value, "a string")
        return value
    if origin is tuple:
        _need(isinstance(value, list), path, value, _type_name(tp))
        (item,) = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return tuple(_parse(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        _need(isinstance(value, dict), path, value, "an object")
        _, vt = typing.get_args(tp)
        out = {}
        for k, v in value.items():
            _need(isinstance(v, list) and len(v) == 2, f"{path}.{k}", v, "[lo, hi]")
            out[k] = tuple(_parse(int, x, f"{path}.{k}") for x in v)
        return out
    if dataclasses.is_dataclass(tp):
        return _parse_dataclass(tp, value, path)
    raise AssertionError(f"unsupported manifest type {tp}")


def _parse_dataclass(cls: type, value: Any, path: str) -> Any:
    where = path or "<root>"
    _need(isinstance(value, dict), where, type(value).__name__, "an object")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in value:
        if key not in names:
            raise ManifestError(f"unknown key '{path + '.' if path else ''}{key}'; allowed keys here: "
                                f"{', '.join(names)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        sub = f"{path}.{f.name}" if path else f.name
        if f.name not in value:
            if f.metadata.get("omit_default"):
                continue  # a key added later: its default
            raise ManifestError(f"missing key '{sub}' ({_type_name(hints[f.name])})")
        kwargs[f.name] = _parse(hints[f.name], value[f.name], sub)
    obj = cls(**kwargs)
    if hasattr(obj, "check"):
        obj.check(path)
    return obj


def _to_json(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.metadata.get("omit_default") and getattr(obj, f.name) == f.default)}
    if isinstance(obj, (tuple, list)):
        return [_to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_json(v) for k, v in obj.items()}
    return obj


def manifest_from_dict(data: Any, source: str = "manifest.json") -> Manifest:
    """Parse and validate; errors are prefixed with `source`."""
    try:
        return _parse_dataclass(Manifest, data, "")
    except ManifestError as e:
        raise ManifestError(f"{source}: {e}") from None


def manifest_to_dict(manifest: Manifest) -> dict:
    manifest.check()
    return _to_json(manifest)


def read_manifest(path: Union[str, os.PathLike]) -> Manifest:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(f"{path}: file not found (an artifact directory holds manifest.json)") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot read ({e.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    return manifest_from_dict(data, str(path))


def write_manifest(manifest: Manifest, path: Union[str, os.PathLike]) -> None:
    Path(path).write_text(json.dumps(manifest_to_dict(manifest), indent=2) + "\n", encoding="utf-8")
