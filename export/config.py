"""Model configurations: the MG target (`MuseGlimmerConfig`) and its presets.

Field names are the native checkpoint's `config.json` keys. Knows nothing
about ExecuTorch, caches or the runtime.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration file or value breaks its contract (one line, names the field)."""


@dataclass(frozen=True)
class MuseGlimmerConfig:
    dim: int = 6656
    n_layers: int = 52
    n_heads: int = 32
    n_kv_heads: int = 2
    head_dim: int = 128
    ffn_dim: int = 3 * 6656
    vocab_size: int = 202048
    norm_eps: float = 1e-5
    post_norm_eps: float = 1e-8
    rope_theta: float = 500000.0
    sliding_window: int = 2048
    every_n_layers_nope: int = 4
    output_soft_cap: float = 20.0
    output_multiplier: float = 0.19611613513
    qk_scale_numerator: float = 43.7840518911
    bos_id: int | None = 1
    eos_ids: tuple[int, ...] = (2,)
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        positive = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size",
                    "sliding_window", "every_n_layers_nope")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"config field '{name}' is {value!r}; allowed: an integer >= 1")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"config field 'n_heads' is {self.n_heads}; allowed: a multiple of "
                              f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"config field 'head_dim' is {self.head_dim}; allowed: an even integer (RoPE pairs)")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"config field 'dtype' is {self.dtype!r}; allowed: float32 | bfloat16")
        for tok in ([self.bos_id] if self.bos_id is not None else []) + list(self.eos_ids):
            if not 0 <= tok < self.vocab_size:
                raise ConfigError(f"config field 'bos_id/eos_ids' has {tok}; allowed: ids in [0, {self.vocab_size})")

    def is_global(self, layer_id: int) -> bool:
        """NoPE layers are the global (full attention) layers; the others slide and use RoPE."""
        return (self.n_layers - layer_id - 1) % self.every_n_layers_nope == 0

    def window(self, layer_id: int) -> int:
        """0 for a global layer, else the sliding window."""
        return 0 if self.is_global(layer_id) else self.sliding_window

    @property
    def attn_scale(self) -> float:
        return self.qk_scale_numerator / self.head_dim

    @property
    def qkvg_rows(self) -> int:
        return (2 * self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one layer: its four linears and four norms."""
        return (self.qkvg_rows * self.dim + self.dim * self.n_heads * self.head_dim
                + 3 * self.ffn_dim * self.dim + 4 * self.dim)

    def n_params(self) -> int:
        return self.n_layers * self.layer_params() + 2 * self.vocab_size * self.dim + self.dim

    def to_json_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_ids"] = list(self.eos_ids)
        return d


def config_from_dict(cls: type, data: Any, source: str) -> Any:
    """Build a config dataclass from a JSON object; unknown, missing or mistyped fields are refused."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object, found {type(data).__name__}")
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"{source}: unknown field '{unknown[0]}'; allowed fields: {', '.join(names)}")
    kwargs: dict[str, Any] = {}
    for name, f in names.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{source}: missing field '{name}'")
            continue
        value = data[name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, tuple):
            if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise ConfigError(f"{source}: field '{name}' is {value!r}; allowed: a list of integers")
            value = tuple(value)
        elif isinstance(default, bool):
            pass
        elif isinstance(default, float):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(f"{source}: field '{name}' is {value!r}; allowed: a number")
            value = float(value)
        elif isinstance(default, int):
            nullable = name == "bos_id" and value is None
            if not nullable and (not isinstance(value, int) or isinstance(value, bool)):
                raise ConfigError(f"{source}: field '{name}' is {value!r}; allowed: an integer")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def read_config(cls: type, path: Path) -> Any:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    return config_from_dict(cls, data, str(path))


TINY = MuseGlimmerConfig(
    dim=64, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=192, vocab_size=512,
    rope_theta=10000.0, sliding_window=8, bos_id=1, eos_ids=(2,), dtype="float32",
)

PRESETS: dict[str, MuseGlimmerConfig] = {
    "tiny": TINY,
    # About 1B parameters: the GPU benchmark configuration.
    "medium": MuseGlimmerConfig(dim=2048, n_layers=16, n_heads=16, n_kv_heads=2, head_dim=128, ffn_dim=6144,
                                vocab_size=32000, sliding_window=2048, dtype="bfloat16"),
    "mg-30b": MuseGlimmerConfig(),
}
