"""Eager references for the DFlash drafter (tests and export checks).

`draft_block_ref` drafts one block for ONE sequence from its target hidden
rows with no cache at all: every layer recomputes the context K/V from the
hidden rows and attends densely over concat(context, block). It is written
out layer by layer from the model's weights so that it checks the cached
path rather than repeating it.

`ReferenceDraftKV` is the simplest draft context store: a dict of committed
rows per (layer, sequence, position) with `append` and `attend` methods of
the `mg::draft_append` / `mg::draft_attend` signatures. Neither is fast; both
are small enough to read and trust. Knows nothing about ExecuTorch or the runtime.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mg.kernels.attention_ref import attend_dense_ref
from mg.kernels.draft_attention_ref import draft_attend_ref, draft_context_span

from .draft_model import DFlashConfig, DFlashDraft, DraftLayer, rope_neox


def context_rows(positions: torch.Tensor, anchor_pos: int, window: int) -> torch.Tensor:
    """positions [L] of committed rows -> bool [L]: the rows a block anchored at `anchor_pos` reads."""
    keep = positions < anchor_pos
    if window > 0:
        keep &= positions >= anchor_pos - window
    return keep


def _layer_ref(layer: DraftLayer, x, ctx, blk_pos, ctx_pos) -> torch.Tensor:
    """One draft layer, no cache: x [T, dim] block rows, ctx [S, dim] context features."""
    a = layer.attn
    h = layer.attn_norm(x)
    q = a.q_norm(a.q_proj(h).unflatten(-1, (a.n_heads, a.head_dim)))
    kv_in = torch.cat([ctx, h])  # context rows skip attn_norm; block rows do not
    k = a.k_norm(a.k_proj(kv_in).unflatten(-1, (a.n_kv_heads, a.head_dim)))
    v = a.v_proj(kv_in).unflatten(-1, (a.n_kv_heads, a.head_dim))
    k_pos = torch.cat([ctx_pos, blk_pos])
    q, k = rope_neox(q, blk_pos, a.inv_freq), rope_neox(k, k_pos, a.inv_freq)
    out = attend_dense_ref(q, k, v, blk_pos, k_pos, 0, a.scale, causal=False)
    x = x + a.o_proj(out.flatten(-2))
    return x + layer.ffn(layer.ffn_norm(x))


@torch.no_grad()
def draft_block_ref(draft: DFlashDraft, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                    hidden: torch.Tensor, positions: torch.Tensor, anchor: int, anchor_pos: int) -> torch.Tensor:
    """One sequence's proposal logits [T - 1, V] fp32 for positions anchor_pos + 1 .. anchor_pos + T - 1.

    hidden [L, taps * dim] target rows at `positions` [L]; rows at positions >= anchor_pos (or outside the
    window) are ignored. The block is [anchor, MASK, ..., MASK].
    """
    cfg = draft.cfg
    keep = context_rows(positions, anchor_pos, cfg.sliding_window)
    ctx, ctx_pos = draft.context(hidden[keep]), positions[keep]
    tokens = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long)
    tokens[0] = anchor
    blk_pos = anchor_pos + torch.arange(cfg.block_size)
    x = F.embedding(tokens, embed_weight)
    for layer in draft.layers:
        x = _layer_ref(layer, x, ctx, blk_pos, ctx_pos)
    return F.linear(draft.norm(x)[1:], head_weight).float()


def greedy_proposals(logits: torch.Tensor) -> list[int]:
    """[T - 1, V] proposal logits -> the argmax draft tokens d1 .. d(T-1)."""
    return logits.argmax(-1).tolist()


class ReferenceDraftKV:
    """Committed context K/V per (layer, seq_slot): {position: (k [Hkv, D], v [Hkv, D])}; rewriting a
    position replaces it. `attend` reads positions < the block's anchor inside the window."""

    def __init__(self, cfg: DFlashConfig):
        self.window = cfg.sliding_window
        self.rows: dict[tuple[int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def append(self, k, v, positions, seq_slots, layer_id: int) -> torch.Tensor:
        for i in range(k.shape[0]):
            self.rows.setdefault((layer_id, int(seq_slots[i])), {})[int(positions[i])] = (k[i], v[i])
        return k

    def gather(self, anchor_pos: torch.Tensor, seq_slots: torch.Tensor, layer_id: int, like: torch.Tensor):
        """-> ctx_k, ctx_v [B, S, Hkv, D], ctx_valid [B, S] for blocks anchored at anchor_pos [B]."""
        span = int(anchor_pos.max())
        if self.window > 0:
            span = min(span, self.window)
        key_pos, valid = draft_context_span(anchor_pos, self.window, span)
        b, hkv, d = anchor_pos.shape[0], like.shape[-2], like.shape[-1]
        ctx_k = like.new_zeros(b, span, hkv, d)
        ctx_v = like.new_zeros(b, span, hkv, d)
        for i in range(b):
            store = self.rows.get((layer_id, int(seq_slots[i])), {})
            for s in range(span):
                if valid[i, s]:
                    ctx_k[i, s], ctx_v[i, s] = self._row(store, int(key_pos[i, s]), int(seq_slots[i]))
        return ctx_k, ctx_v, valid

    @staticmethod
    def _row(store, pos: int, slot: int):
        if pos not in store:
            raise KeyError(f"reference draft KV: slot {slot} has no context row at position {pos}")
        return store[pos]

    def attend(self, q, k, v, positions, seq_slots, layer_id: int, scale: float) -> torch.Tensor:
        ctx_k, ctx_v, valid = self.gather(positions[:, 0], seq_slots, layer_id, k)
        return draft_attend_ref(q, k, v, ctx_k, ctx_v, valid, scale)
