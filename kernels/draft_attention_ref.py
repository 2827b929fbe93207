"""Torch reference of the drafter's attention (`mg::draft_attend`).

A DFlash block of T query rows attends, non-causally, over its sequence's
cached context rows (positions < the anchor's, inside the draft window) plus
the block's own K/V. The caller gathers the context from its draft cache and
says which gathered rows are valid; these functions never allocate or own a
cache and read only shapes from the host, so they can run inside a CUDA graph.
Fast kernels are checked against `draft_attend_ref`. Knows nothing about
models, checkpoints or export.
"""

from __future__ import annotations

import torch

from .attention_ref import key_span


def draft_context_span(anchor_pos: torch.Tensor, window: int, max_span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Context positions a block anchored at `anchor_pos` reads, newest first.

    anchor_pos [B] int64 -> key_pos [B, S] int64 (clamped to >= 0), valid [B, S] bool, S = max_span.
    Valid positions are `[max(0, anchor - window), anchor - 1]` (window 0 = all of `[0, anchor - 1]`):
    the last `window` committed positions before the anchor. The block's own rows are not included.
    """
    return key_span(anchor_pos - 1, window, max_span)


def draft_attend_ref(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, ctx_k: torch.Tensor,
                     ctx_v: torch.Tensor, ctx_valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Non-causal block attention over gathered context + block, grouped-query, math in fp32.

    q [B, T, Hq, D]; k_blk/v_blk [B, T, Hkv, D]; ctx_k/ctx_v [B, S, Hkv, D] (S may be 0);
    ctx_valid [B, S] bool -> [B, T, Hq, D] in q's dtype. Query head h reads KV head h // (Hq // Hkv).
    Every block row sees every block row and every valid context row.
    """
    b, t, hq, d = q.shape
    hkv = k_blk.shape[2]
    keys = torch.cat([ctx_k, k_blk], dim=1).float()  # [B, S + T, Hkv, D]
    values = torch.cat([ctx_v, v_blk], dim=1).float()
    blk_valid = torch.ones(b, t, dtype=torch.bool, device=q.device)
    valid = torch.cat([ctx_valid, blk_valid], dim=1)  # [B, S + T]
    qg = q.float().view(b, t, hkv, hq // hkv, d)
    scores = torch.einsum("bthgd,bshd->bthgs", qg, keys) * scale
    scores = scores.masked_fill(~valid[:, None, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bthgs,bshd->bthgd", probs, values)
    return out.reshape(b, t, hq, d).to(q.dtype)
