"""CPU attention for the two off-graph KV layouts: the same contract as `attention_ref`, per sequence.

The references gather every query's own key span ([N, S, Hkv, D], S the whole column or window) and attend
query by query. Here the step's rows are grouped by sequence on the host (on CPU reading the slots costs
nothing; these functions are never captured in a CUDA graph), in one of two ways:

- By default, fast: a sequence with several rows (a verify block, a prompt chunk) gathers its keys once, from
  the first position any of its queries reads to the last, and attends with one `scaled_dot_product_attention`
  call whose mask gives each query exactly the keys the reference gives it (positions
  `[max(0, p - window + 1), p]`); rows alone in their sequence (decode) go together in one call, each over its
  own span, as long as the longest of them needs. A row's last bits then depend on the call: SDPA splits its
  work by the call's shapes and threads.
- `row_invariant`: a row's output has the same bits whatever else the call holds (alone in a 1-row step, among
  other sequences' decode rows, inside a verify block or a prompt chunk). Each row attends over its own keys
  newest first (`[p, p - 1, ..., p - span + 1]`, span = min(p + 1, window)), padded with masked keys to a
  multiple of `SPAN_BUCKET`, by one batched product per (row, KV head) entry (its group of query heads as the
  entry's rows), a softmax over the padded span and one batched product with the values: the same shapes for
  that row in every call. torch's CPU products and reductions give a row the same bits for the same shapes
  whatever the batch around it, but not across shapes (a product's kernel by its row count, a reduction's
  vector lanes by its length): hence shapes fixed per row rather than per call. Consecutive rows of one
  sequence gather their keys once, newest first, and each row reads its span as an overlapping strided view of
  them; other rows gather their own spans. With the packed int8/int4 linears (row-invariant, but rounding their
  inputs to bfloat16, which turns a last-bit difference into a visible one) this makes greedy DFlash equal
  target-only and a batch equal its prompts alone; it costs time (BENCHMARKS.md).

Math in fp32, output in q's dtype, as the references. `draft_attend_cpu` is the drafter's block attention
(`draft_attend_ref`'s contract) as one `scaled_dot_product_attention` call instead of the reference's einsums
(drafts never reach the output). Tests compare them with the references and a row's bits across calls. Knows
torch only.
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


SPAN_BUCKET = 64  # a row-invariant row's keys are padded (masked) to a multiple of this many


def _spans(positions: torch.Tensor, window: int) -> torch.Tensor:
    """Keys each row at `positions` attends to: min(p + 1, window) (all p + 1 without a window)."""
    return (positions + 1).clamp_max(window) if window > 0 else positions + 1


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D]; k/v [n * Hkv, S, D] (entry r * Hkv + h: row r's keys newest first for KV head h; any
    strides, unit last); span [n] (keys after the first span[r] of row r are padding) -> [n, Hq, D] fp32."""
    n, hq, d = q.shape
    e, s = k.shape[0], k.shape[1]
    group = hq * n // e
    padding = torch.zeros(n, 1, 1, s).masked_fill_(torch.arange(s) >= span[:, None, None, None], float("-inf"))
    padding = padding.expand(n, e // n, group, s).reshape(e, group, s)
    scores = torch.baddbmm(padding, q.float().reshape(e, group, d), k.transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(scores, dim=-1), v).view(n, hq, d)


def _by_bucket(spans: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
    """(padded span, row indices or None for all rows) per bucket of `SPAN_BUCKET` keys, in ascending order."""
    buckets = (spans + SPAN_BUCKET - 1) // SPAN_BUCKET * SPAN_BUCKET
    sizes = buckets.unique().tolist()
    if len(sizes) == 1:
        return [(sizes[0], None)]
    return [(s, (buckets == s).nonzero().flatten()) for s in sizes]


def _attend_singles_sdpa(q: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor, window: int, scale: float,
                         key_rows) -> torch.Tensor:
    """Rows alone in their sequence, not row-invariant: one SDPA call, each row over its own key span, newest
    first, as long as the longest span of these rows needs. -> [G, Hq, D] (fp32)."""
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


def _attend_singles(q: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor, window: int, scale: float,
                    key_rows) -> torch.Tensor:
    """Rows each over their own span, gathered per row (decode steps, or rows of a sequence not at
    consecutive positions); row-invariant. -> [G, Hq, D] (fp32)."""
    spans = _spans(positions, window)
    out = None
    for s, idx in _by_bucket(spans):
        rows = slice(None) if idx is None else idx
        key_pos = (positions[rows, None] - torch.arange(s, device=positions.device)[None, :]).clamp_min(0)
        k, v = key_rows(seq_slots[rows], key_pos)  # [m, S, Hkv, D]
        m, hkv = k.shape[0], k.shape[2]
        k = k.float().transpose(1, 2).reshape(m * hkv, s, -1)
        v = v.float().transpose(1, 2).reshape(m * hkv, s, -1)
        o = _attend_rows(q[rows], k, v, spans[rows], scale)
        if idx is None:
            return o
        if out is None:
            out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        out[idx] = o
    return out


def _attend_block(q: torch.Tensor, positions: torch.Tensor, slot: int, window: int, scale: float,
                  keys) -> torch.Tensor:
    """Rows of one sequence at consecutive ascending positions (a verify block or a prompt chunk), row-invariant
    like `_attend_singles`: the block's keys gathered once newest first, row i (newest first) reading its span as a
    strided view that starts i keys after the newest row's. -> [T, Hq, D] (fp32)."""
    n = q.shape[0]
    hi = int(positions[-1])
    spans = _spans(positions, window).flip(0)  # newest row first
    buckets = _by_bucket(spans)
    longest = buckets[-1][0]
    key_pos = (hi - torch.arange(n - 1 + longest, device=positions.device)).clamp_min(0)
    k, v = keys(slot, key_pos)  # [L, Hkv, D], newest first
    k, v = k.float().contiguous(), v.float().contiguous()
    hkv, d = k.shape[1], k.shape[2]
    q = q.flip(0)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for s, idx in buckets:
        first, m = (0, n) if idx is None else (int(idx[0]), len(idx))  # buckets are runs (spans only fall)
        view = (m * hkv, s, d), (d, hkv * d, 1)  # entry r * Hkv + h starts r keys further, at head h
        out[first:first + m] = _attend_rows(q[first:first + m], k[first:].as_strided(*view),
                                            v[first:].as_strided(*view), spans[first:first + m], scale)
    return out.flip(0)


def _attend(q, positions, seq_slots, window: int, scale: float, keys, key_rows, row_invariant: bool) -> torch.Tensor:
    """`keys(slot, key_pos [L])` -> (k, v) [L, Hkv, D] of one sequence; `key_rows(slots [G], key_pos [G, S])`
    -> (k, v) [G, S, Hkv, D], each row its own sequence's keys. Not `row_invariant`: every group of rows by one
    SDPA call, the single rows together by another."""
    out = torch.empty_like(q)
    singles = []
    for slot, idx in _groups(seq_slots):
        q_pos = positions[idx]
        n = len(idx)
        if n == 1:
            singles.append(idx)
        elif not row_invariant:  # one SDPA call for the sequence's rows
            hi = int(q_pos.max())
            lo = max(0, int(q_pos.min()) - window + 1) if window > 0 else 0
            key_pos = torch.arange(lo, hi + 1, device=positions.device)
            k, v = keys(slot, key_pos)
            out[idx] = _attend_group(q[idx], k, v, q_pos, key_pos, window, scale).to(q.dtype)
        elif bool((q_pos[1:] - q_pos[:-1] == 1).all()):
            out[idx] = _attend_block(q[idx], q_pos, slot, window, scale, keys).to(q.dtype)
        else:
            singles.append(idx)
    if singles:
        idx = torch.cat(singles)
        attend = _attend_singles if row_invariant else _attend_singles_sdpa
        out[idx] = attend(q[idx], positions[idx], seq_slots[idx], window, scale, key_rows).to(q.dtype)
    return out


def attend_columns_cpu(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, positions: torch.Tensor,
                       seq_slots: torch.Tensor, window: int, scale: float, row_invariant: bool = False) -> torch.Tensor:
    """kBatchedSequence read side (contract of `attend_columns_ref`): position p of slot s at row p % rows.
    `row_invariant` False: decode rows and verify blocks by SDPA too (faster, a row's bits depend on the call)."""
    rows = k_store.shape[1]

    def keys(slot: int, key_pos: torch.Tensor):
        r = key_pos % rows
        return k_store[slot, r], v_store[slot, r]

    def key_rows(slots: torch.Tensor, key_pos: torch.Tensor):
        r, s = key_pos % rows, slots[:, None].expand_as(key_pos)
        return k_store[s, r], v_store[s, r]

    return _attend(q, positions, seq_slots, window, scale, keys, key_rows, row_invariant)


def attend_cells_cpu(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cell_table: torch.Tensor,
                     positions: torch.Tensor, seq_slots: torch.Tensor, window: int, scale: float,
                     row_invariant: bool = False) -> torch.Tensor:
    """kBatchedCell read side (contract of `attend_cells_ref`): cell_table[slot, p] holds position p's cell.
    `row_invariant` as in `attend_columns_cpu`."""

    def keys(slot: int, key_pos: torch.Tensor):
        cells = cell_table[slot, key_pos]
        return k_pool[cells], v_pool[cells]

    def key_rows(slots: torch.Tensor, key_pos: torch.Tensor):
        cells = cell_table[slots[:, None].expand_as(key_pos), key_pos]
        return k_pool[cells], v_pool[cells]

    return _attend(q, positions, seq_slots, window, scale, keys, key_rows, row_invariant)


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
