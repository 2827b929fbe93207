"""The DFlash drafter: `DFlashConfig`, its presets, and the model, written for export.

The drafter owns no embedding and no LM head: the caller passes the target's
raw `tok_embeddings.weight` and `output.weight`. Its hidden size is the
target's `dim`. Context K/V come from the target's tapped residuals through
`fc` + `hidden_norm` and each layer's `k_proj`/`v_proj`; they are handed to an
`append` backend (the `mg::draft_append` op, or an eager store in tests), and
block attention goes to an `attend` backend with the signature of
`mg::draft_attend`, so the module holds no KV. Parameter names are the native
checkpoint's tensor names. Knows nothing about ExecuTorch, caches or the runtime.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError, MuseGlimmerConfig
from .model import RMSNorm, rope_inv_freq

# (k [M,Hkv,D], v [M,Hkv,D], positions [M], seq_slots [M], layer_id) -> [M,Hkv,D]
AppendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
# (q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D], positions [B,T], seq_slots [B], layer_id, scale) -> [B,T,Hq,D]
DraftAttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float],
                         torch.Tensor]


@dataclass(frozen=True)
class DFlashConfig:
    """Defaults are the real 30B drafter where docs/ARCHITECTURE.md states them; ffn_dim and mask_token_id are
    placeholders until the real checkpoint's config.json is seen (a checkpoint always states them)."""

    n_layers: int = 5
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    ffn_dim: int = 3 * 6656
    block_size: int = 16
    mask_token_id: int = 202047
    target_layers: tuple[int, ...] = (2, 14, 26, 38, 50)
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    sliding_window: int = 0  # 0: the context is every committed position before the anchor

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            _check(getattr(self, name), lambda v: isinstance(v, int) and v >= 1, name, "an integer >= 1")
        _check(self.block_size, lambda v: isinstance(v, int) and v >= 2, "block_size", "an integer >= 2")
        _check(self.mask_token_id, lambda v: isinstance(v, int) and v >= 0, "mask_token_id", "a token id >= 0")
        _check(self.sliding_window, lambda v: isinstance(v, int) and v >= 0, "sliding_window",
               "an integer >= 0 (0 = no window)")
        _check(self.n_heads, lambda v: v % self.n_kv_heads == 0, "n_heads",
               f"a multiple of n_kv_heads={self.n_kv_heads}")
        _check(self.head_dim, lambda v: v % 2 == 0, "head_dim", "an even integer (RoPE halves)")
        _check(list(self.target_layers), _increasing, "target_layers", "a non-empty, strictly increasing list of "
               "layer ids >= 0")
        for name in ("rope_theta", "norm_eps"):
            _check(getattr(self, name), lambda v: v > 0, name, "a number > 0")

    def check_target(self, target: MuseGlimmerConfig) -> None:
        """Refuse a drafter that does not fit `target` (tapped layers, mask token)."""
        _check(list(self.target_layers), lambda v: v[-1] < target.n_layers, "target_layers",
               f"layer ids in [0, {target.n_layers}) (the target's n_layers)")
        _check(self.mask_token_id, lambda v: v < target.vocab_size, "mask_token_id",
               f"a token id in [0, {target.vocab_size}) (the target's vocab_size)")

    @property
    def attn_scale(self) -> float:
        return self.head_dim ** -0.5

    def n_params(self, dim: int) -> int:
        attn = 2 * dim * (self.n_heads + self.n_kv_heads) * self.head_dim + 2 * self.head_dim
        per_layer = attn + 3 * self.ffn_dim * dim + 2 * dim
        return self.n_layers * per_layer + len(self.target_layers) * dim * dim + 2 * dim

    def to_json_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_layers"] = list(self.target_layers)
        return d


def _check(value: Any, ok: Callable[[Any], bool], name: str, allowed: str) -> None:
    if not ok(value):
        raise ConfigError(f"config field '{name}' is {value!r}; allowed: {allowed}")


def _increasing(ids: list) -> bool:
    return bool(ids) and all(isinstance(i, int) and i >= 0 for i in ids) and all(a < b for a, b in zip(ids, ids[1:]))


DRAFT_PRESETS: dict[str, DFlashConfig] = {
    # Both presets use mask id 3: <mask> of the byte tokenizer written for presets (export/tokenizer.py).
    # For the tiny target (dim 64, 6 layers, vocab 512): taps at 1, 3, 5 cover global layers (1, 5) and a
    # sliding one (3).
    "tiny": DFlashConfig(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, block_size=8,
                         mask_token_id=3, target_layers=(1, 3, 5), rope_theta=10000.0),
    # For the ~1B "medium" target (dim 2048, 16 layers, vocab 32000): 3 layers, 5 taps spread like the real
    # drafter's (2, 14, ..., 50 of 52), block 16 as the real one.
    "medium": DFlashConfig(n_layers=3, n_heads=16, n_kv_heads=4, head_dim=128, ffn_dim=6144, block_size=16,
                           mask_token_id=3, target_layers=(1, 4, 7, 10, 13)),
    # For mg-30b (dim 6656, 52 layers): the real drafter's shape as docs/ARCHITECTURE.md states it (5 layers,
    # 32 query / 8 KV heads, taps 2, 14, 26, 38, 50, block 16). With --n-layers the taps are spread over the
    # kept layers in the same proportions.
    "mg-30b": DFlashConfig(),
}


def rope_neox_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., 1, D/2] (fp32) of positions [...] * inv_freq: computed once per call of a drafter method
    and shared by its layers, for q and k alike."""
    ang = positions.float()[..., None] * inv_freq  # [..., D/2]
    return ang.cos()[..., None, :], ang.sin()[..., None, :]


def rope_neox(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
              tables: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Half-split rotation: (x[i], x[i + D/2]) by positions * inv_freq[i], in fp32. x [..., H, D], positions [...];
    `tables` are `rope_neox_tables(positions, inv_freq)` when the caller has them."""
    cos, sin = rope_neox_tables(positions, inv_freq) if tables is None else tables
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, dim: int, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale = cfg.attn_scale
        self.q_proj = nn.Linear(dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def project_q(self, x: torch.Tensor, positions: torch.Tensor, rope=None) -> torch.Tensor:
        """x [..., dim] (normed) -> q [..., Hq, D], normed and rotated (`rope`: the method's shared tables)."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim)))
        return rope_neox(q, positions, self.inv_freq, rope)

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor, rope=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., dim] -> k (normed, rotated), v [..., Hkv, D]. Used for block rows and context rows alike."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.n_kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.n_kv_heads, self.head_dim))
        return rope_neox(k, positions, self.inv_freq, rope), v

    def forward(self, x, positions, seq_slots, attend: DraftAttendFn, rope=None) -> torch.Tensor:
        rope = rope_neox_tables(positions, self.inv_freq) if rope is None else rope
        q = self.project_q(x, positions, rope)
        k, v = self.project_kv(x, positions, rope)
        out = attend(q, k, v, positions, seq_slots, self.layer_id, self.scale)
        return self.o_proj(out.flatten(-2))


class DraftFeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Plain pre-norm residuals (no sandwich norms)."""

    def __init__(self, cfg: DFlashConfig, dim: int, layer_id: int):
        super().__init__()
        self.attn_norm = RMSNorm(dim, cfg.norm_eps)
        self.attn = DraftAttention(cfg, dim, layer_id)
        self.ffn_norm = RMSNorm(dim, cfg.norm_eps)
        self.ffn = DraftFeedForward(dim, cfg.ffn_dim)

    def forward(self, x, positions, seq_slots, attend: DraftAttendFn, rope=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, seq_slots, attend, rope)
        return x + self.ffn(self.ffn_norm(x))


class DFlashDraft(nn.Module):
    def __init__(self, cfg: DFlashConfig, target: MuseGlimmerConfig):
        super().__init__()
        cfg.check_target(target)
        self.cfg = cfg
        dim = target.dim
        self.fc = nn.Linear(len(cfg.target_layers) * dim, dim, bias=False)
        self.hidden_norm = RMSNorm(dim, cfg.norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, dim, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(dim, cfg.norm_eps)

    def context(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, taps * dim] (target residuals entering the tapped layers) -> context features [M, dim]."""
        return self.hidden_norm(self.fc(hidden))

    def append(self, hidden: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor,
               append: AppendFn) -> torch.Tensor:
        """Hand every layer's context K/V of committed rows to `append`; -> ack [M] fp32 that depends on every
        layer's call (so export keeps them all)."""
        ctx = self.context(hidden)
        ack = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        rope = rope_neox_tables(positions, self.layers[0].attn.inv_freq)
        for layer in self.layers:
            k, v = layer.attn.project_kv(ctx, positions, rope)
            ack = ack + append(k, v, positions, seq_slots, layer.attn.layer_id)[:, 0, 0].float()
        return ack

    def forward(self, x: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor,
                attend: DraftAttendFn) -> torch.Tensor:
        """x [B, T, dim] embedded block rows, positions [B, T], seq_slots [B] -> final-normed rows [B, T, dim]."""
        rope = rope_neox_tables(positions, self.layers[0].attn.inv_freq)
        for layer in self.layers:
            x = layer(x, positions, seq_slots, attend, rope)
        return self.norm(x)

    def block_logits(self, tokens: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor,
                     embed_weight: torch.Tensor, head_weight: torch.Tensor, attend: DraftAttendFn) -> torch.Tensor:
        """tokens [B, T] = [anchor, MASK, ...] -> proposal logits [B, T - 1, V] fp32 for positions anchor + 1 ...

        `embed_weight`/`head_weight` are the target's raw table and LM head (no embedding norm, no soft cap)."""
        return F.linear(self.block_rows(tokens, positions, seq_slots, embed_weight, attend), head_weight).float()

    def block_rows(self, tokens: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor,
                   embed_weight: torch.Tensor, attend: DraftAttendFn) -> torch.Tensor:
        """The final-normed rows [B, T - 1, dim] that `block_logits` puts through the target's LM head."""
        return self.forward(F.embedding(tokens, embed_weight), positions, seq_slots, attend)[:, 1:]
