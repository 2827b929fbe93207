"""CPU attention for the two off-graph KV layouts: the same contract as `attention_ref`, per sequence.

The references gather every query's own key span ([N, S, Hkv, D], S the whole column or window) and
attend query by query: a verify block of 16 rows of one sequence gathers that sequence's keys 16 times.
Here the step's rows are grouped by sequence on the host (on CPU reading the slots costs nothing; these
functions are never captured in a CUDA graph). A sequence with several rows (a verify block, a prefill
chunk) gathers its keys once, from the first position any of its queries reads to the last, and attends
with one `scaled_dot_product_attention` call whose mask gives each query exactly the keys the reference
gives it (positions `[max(0, p - window + 1), p]`). Rows alone in their sequence (decode) go together in
one call, each over its own span, as long as the longest of them needs rather than the whole column.
Math in fp32, output in q's dtype, as the references. `draft_attend_cpu` is the drafter's block attention
(`draft_attend_ref`'s contract) as one `scaled_dot_product_attention` call instead of the reference's einsums.
Tests compare them with the references. Knows torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _groups(seq_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, row indices) per distinct slot, in first-appearance order."""
    slots = seq_slots.tolist()
    rows: dict[int, list[int]] = {}
    for i, s in enumerate(slots):
        rows.setdefault(s, []).append(i)
    return [(s, torch.tensor(r, dtype=torch.long)) for s, r in rows.items()]


def _attend_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, key_pos: torch.Tensor,
                  window: int, scale: float) -> torch.Tensor:
    """q [T, Hq, D]; k/v [L, Hkv, D] at key_pos [L]; q_pos [T] -> [T, Hq, D] (fp32)."""
    diff = q_pos[:, None] - key_pos[None, :]
    mask = diff >= 0
    if window > 0:
        mask &= diff < window
    hq, hkv = q.shape[1], k.shape[1]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None],
        attn_mask=mask[None, None], scale=scale, enable_gqa=hq != hkv)
    return out[0].transpose(0, 1)


def _attend_singles(q: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor, window: int, scale: float,
                    key_rows) -> torch.Tensor:
    """Rows alone in their sequence (decode steps): one batched call, each row over its own key span, newest
    first, as long as the longest span of these rows needs (not the whole column). -> [G, Hq, D] (fp32)."""
    hi = int(positions.max()) + 1
    span = min(window, hi) if window > 0 else hi
    key_pos = positions[:, None] - torch.arange(span, device=positions.device)[None, :]
    valid = key_pos >= 0
    k, v = key_rows(seq_slots, key_pos.clamp_min(0))  # [G, S, Hkv, D]
    hq, hkv = q.shape[1], k.shape[2]
    out = F.scaled_dot_product_attention(
        q.float()[:, :, None], k.float().transpose(1, 2), v.float().transpose(1, 2),
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=hq != hkv)
    return out[:, :, 0]


def _attend(q, positions, seq_slots, window: int, scale: float, keys, key_rows) -> torch.Tensor:
    """`keys(slot, key_pos [L])` -> (k, v) [L, Hkv, D] of one sequence; `key_rows(slots [G], key_pos [G, S])`
    -> (k, v) [G, S, Hkv, D], each row its own sequence's keys."""
    out = torch.empty_like(q)
    groups = _groups(seq_slots)
    singles = [idx for _, idx in groups if len(idx) == 1]
    if singles:
        idx = torch.cat(singles)
        out[idx] = _attend_singles(q[idx], positions[idx], seq_slots[idx], window, scale, key_rows).to(q.dtype)
    for slot, idx in groups:
        if len(idx) == 1:
            continue
        q_pos = positions[idx]
        hi = int(q_pos.max())
        lo = max(0, int(q_pos.min()) - window + 1) if window > 0 else 0
        key_pos = torch.arange(lo, hi + 1, device=positions.device)
        k, v = keys(slot, key_pos)
        out[idx] = _attend_group(q[idx], k, v, q_pos, key_pos, window, scale).to(q.dtype)
    return out


def attend_columns_cpu(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, positions: torch.Tensor,
                       seq_slots: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """kBatchedSequence read side (contract of `attend_columns_ref`): position p of slot s at row p % rows."""
    rows = k_store.shape[1]

    def keys(slot: int, key_pos: torch.Tensor):
        r = key_pos % rows
        return k_store[slot, r], v_store[slot, r]

    def key_rows(slots: torch.Tensor, key_pos: torch.Tensor):
        r, s = key_pos % rows, slots[:, None].expand_as(key_pos)
        return k_store[s, r], v_store[s, r]

    return _attend(q, positions, seq_slots, window, scale, keys, key_rows)


def attend_cells_cpu(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cell_table: torch.Tensor,
                     positions: torch.Tensor, seq_slots: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """kBatchedCell read side (contract of `attend_cells_ref`): cell_table[slot, p] holds position p's cell."""

    def keys(slot: int, key_pos: torch.Tensor):
        cells = cell_table[slot, key_pos]
        return k_pool[cells], v_pool[cells]

    def key_rows(slots: torch.Tensor, key_pos: torch.Tensor):
        cells = cell_table[slots[:, None].expand_as(key_pos), key_pos]
        return k_pool[cells], v_pool[cells]

    return _attend(q, positions, seq_slots, window, scale, keys, key_rows)


def draft_attend_cpu(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, ctx_k: torch.Tensor,
                     ctx_v: torch.Tensor, ctx_valid: torch.Tensor, scale: float) -> torch.Tensor:
    """`draft_attend_ref` in one SDPA call: q [B, T, Hq, D], k_blk/v_blk [B, T, Hkv, D], ctx_k/ctx_v [B, S, Hkv, D],
    ctx_valid [B, S] -> [B, T, Hq, D] in q's dtype. Every row sees the block's own keys, so no row is fully masked."""
    b, t, hq, _ = q.shape
    keys = torch.cat([ctx_k, k_blk], dim=1).float().transpose(1, 2)  # [B, Hkv, S + T, D]
    values = torch.cat([ctx_v, v_blk], dim=1).float().transpose(1, 2)
    valid = torch.cat([ctx_valid, ctx_valid.new_ones(b, t)], dim=1)[:, None, None, :]
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), keys, values, attn_mask=valid, scale=scale,
                                         enable_gqa=hq != k_blk.shape[2])
    return out.transpose(1, 2).to(q.dtype)
