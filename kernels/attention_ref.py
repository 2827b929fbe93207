"""Torch reference attention for the two off-graph KV layouts.

Each query (slot s, position p) attends over its own sequence's keys at
positions `[max(0, p - window + 1), p]` (window 0 = no limit). The storage is
passed explicitly; these functions never allocate or own a cache, and they
read only shapes from the host, never data, so they can run inside a CUDA
graph. The fast kernels (Triton) are checked against these.
"""

from __future__ import annotations

from typing import Optional

import torch


def key_span(positions: torch.Tensor, window: int, max_span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key positions each query reads, newest first.

    positions [N] int64 -> key_pos [N, S] int64 (clamped to >= 0), valid [N, S] bool,
    with S = max_span (window for ring layers, the column rows for flat ones).
    """
    offs = torch.arange(max_span, device=positions.device)
    key_pos = positions[:, None] - offs[None, :]
    valid = key_pos >= 0
    if window > 0:
        valid &= offs[None, :] < window
    return key_pos.clamp_min(0), valid


def attend_gathered_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """q [N, Hq, D]; k/v [N, S, Hkv, D]; valid [N, S] -> [N, Hq, D] in q's dtype (math in fp32).

    Query head h reads KV head h // (Hq // Hkv) (grouped-query attention).
    """
    n, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.float().view(n, hkv, hq // hkv, d)
    scores = torch.einsum("nhgd,nshd->nhgs", qg, k.float()) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("nhgs,nshd->nhgd", probs, v.float())
    return out.reshape(n, hq, d).to(q.dtype)


def attend_columns_ref(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, positions: torch.Tensor,
                       seq_slots: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """kBatchedSequence read side.

    k_store/v_store [slots, rows, Hkv, D]: position p of slot s lives at row p % rows
    (flat layers have rows > every position, so p % rows == p). Every position a
    query reads must already be written.
    """
    rows = k_store.shape[1]
    span = min(window, rows) if window > 0 else rows
    key_pos, valid = key_span(positions, window, span)
    ridx = key_pos % rows
    slots = seq_slots[:, None].expand_as(ridx)
    return attend_gathered_ref(q, k_store[slots, ridx], v_store[slots, ridx], valid, scale)


def attend_cells_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cell_table: torch.Tensor,
                     positions: torch.Tensor, seq_slots: torch.Tensor, window: int, scale: float,
                     max_span: Optional[int] = None) -> torch.Tensor:
    """kBatchedCell read side.

    k_pool/v_pool [cells, Hkv, D]; cell_table [slots, capacity] int64 maps a
    sequence's position to its cell (the ordered cell list of that sequence), so
    a query gathers only its own sequence's cells. `max_span` (default: the
    capacity) bounds the keys gathered per query; it must exceed every query position.
    """
    limit = cell_table.shape[1] if max_span is None else min(max_span, cell_table.shape[1])
    span = min(window, limit) if window > 0 else limit
    key_pos, valid = key_span(positions, window, span)
    cells = cell_table[seq_slots[:, None].expand_as(key_pos), key_pos]
    return attend_gathered_ref(q, k_pool[cells], v_pool[cells], valid, scale)


def attend_dense_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                     window: int, scale: float, causal: bool = True) -> torch.Tensor:
    """One sequence, no cache: q [T, Hq, D], k/v [L, Hkv, D], q_pos [T], k_pos [L] -> [T, Hq, D].

    The mask follows from positions; `causal=False` lets every query see every key
    (the drafter's block attention).
    """
    t = q.shape[0]
    if causal:
        diff = q_pos[:, None] - k_pos[None, :]
        valid = diff >= 0
        if window > 0:
            valid &= diff < window
    else:
        valid = torch.ones(t, k.shape[0], dtype=torch.bool, device=q.device)
    kk = k[None].expand(t, *k.shape)
    vv = v[None].expand(t, *v.shape)
    return attend_gathered_ref(q, kk, vv, valid, scale)
