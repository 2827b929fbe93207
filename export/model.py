"""The MG (Muse Glimmer) target model, written for export.

Tokens of several sequences are packed on one axis: `forward(tokens[N],
positions[N], seq_slots[N], logits_rows[R])`. Attention is delegated to an
`attend` backend with the signature of `mg::update_and_attend`, so the module
holds no KV: for export the backend is the custom op, for eager tests it is a
cache's method. Parameter names are the native checkpoint's tensor names.
Knows nothing about ExecuTorch or the runtime.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import MuseGlimmerConfig

# (q [N,Hq,D], k [N,Hkv,D], v [N,Hkv,D], positions [N], seq_slots [N], layer_id, scale) -> [N,Hq,D]
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def rms_norm_noweight(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_noweight(x, self.eps) * self.weight


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [N, 1, D/2] (fp32) of positions * inv_freq: computed once per forward, shared by the RoPE layers."""
    ang = positions.float()[:, None] * inv_freq[None, :]
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                     tables: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) by positions * inv_freq[i], in fp32. x [N, H, D]; `tables` are
    `rope_tables(positions, inv_freq)` when the caller has them."""
    cos, sin = rope_tables(positions, inv_freq) if tables is None else tables
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: MuseGlimmerConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.eps = cfg.norm_eps
        self.scale = cfg.attn_scale
        self.use_rope = not cfg.is_global(layer_id)
        self.qkvg_proj = nn.Linear(cfg.dim, cfg.qkvg_rows, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def split_sizes(self) -> list[int]:
        hq, hkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return [hq, hkv, hkv, hq]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor, attend: AttendFn,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """`rope`: `rope_tables(positions, inv_freq)` shared by the layers (computed here when absent)."""
        hq, hkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        qk, v, gate = self.qkvg_proj(x).split([hq + hkv, hkv, hq], dim=-1)
        # q and k are adjacent in the fused projection: one per-head norm and one rotation serve both
        qk = rms_norm_noweight(qk.unflatten(-1, (self.n_heads + self.n_kv_heads, self.head_dim)), self.eps)
        if self.use_rope:
            qk = rope_interleaved(qk, positions, self.inv_freq, rope)
        q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
        v = v.unflatten(-1, (self.n_kv_heads, self.head_dim))
        out = attend(q, k, v, positions, seq_slots, self.layer_id, self.scale)
        return self.o_proj(out.flatten(-2) * torch.sigmoid(gate))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.ffn_dim = ffn_dim
        self.gate_up_proj = nn.Linear(dim, 2 * ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.ffn_dim, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm attention and MLP, each followed by a sandwich (post) norm before the residual add."""

    def __init__(self, cfg: MuseGlimmerConfig, layer_id: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer_id)
        self.post_attn_norm = RMSNorm(cfg.dim, cfg.post_norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg.dim, cfg.ffn_dim)
        self.post_ffn_norm = RMSNorm(cfg.dim, cfg.post_norm_eps)

    def forward(self, x, positions, seq_slots, attend: AttendFn, rope=None):
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), positions, seq_slots, attend, rope))
        return x + self.post_ffn_norm(self.ffn(self.ffn_norm(x)))


class MuseGlimmer(nn.Module):
    def __init__(self, cfg: MuseGlimmerConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return rms_norm_noweight(self.tok_embeddings(tokens), self.cfg.norm_eps)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Soft-capped fp32 logits of the final residual rows x [R, dim]."""
        cap = self.cfg.output_soft_cap
        return cap * torch.tanh(self.output(self.norm(x)).float() * self.cfg.output_multiplier / cap)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor,
                logits_rows: torch.Tensor, attend: AttendFn,
                taps: Sequence[int] = ()) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """-> logits [R, V] fp32 and, when `taps` is given, hidden [N, len(taps) * dim]:
        the residual stream entering each tapped layer, concatenated in `taps` order."""
        x = self.embed(tokens)
        rope_layers = [layer.attn for layer in self.layers if layer.attn.use_rope]
        rope = rope_tables(positions, rope_layers[0].inv_freq) if rope_layers else None
        tapped: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in taps:
                tapped[i] = x
            x = layer(x, positions, seq_slots, attend, rope)
        hidden = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        return self.logits(x.index_select(0, logits_rows)), hidden


def init_random(model: nn.Module, seed: int) -> nn.Module:
    """Deterministic random weights, each tensor from (seed, its name): norms ~ 1 + N(0, 0.1), linears
    ~ N(0, 1/fan_in), embeddings ~ N(0, 1). The same values a preset export streams into its `model.ptd`."""
    from .weights import RandomWeights, materialize

    return materialize(RandomWeights(seed), model)
