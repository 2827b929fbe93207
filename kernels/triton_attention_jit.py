"""Triton kernels (only the `@triton.jit` bodies) for attention over the two off-graph KV layouts.

Imports triton unconditionally: import it through `mg.kernels.triton_attention`, which
checks availability, plans the launch and validates arguments. Knows nothing about
caches, the runtime or the graph; reads positions and slots on the device only.

One attention kernel serves both layouts (`IS_CELL` picks how a key position becomes
an address) and both phases (`BLOCK_Q` = 1 for decode, > 1 for prefill chunks):

- A program owns `BLOCK_Q` consecutive queries x one KV head x one split. Its tile
  rows are `BLOCK_M = BLOCK_Q * GP` (query, group head) pairs; the `GROUP` query heads
  sharing the KV head sit in adjacent rows (padded to `GP`, a power of two, and to
  at least 16 rows in total so `tl.dot` can use tensor cores), so each K/V tile is
  loaded once for all of them.
- Queries of one program may belong to different sequences. The program makes one
  pass per distinct slot among its queries (first occurrence wins); in a pass only
  that slot's rows are live and the key range is the union of their spans. Decode
  (`BLOCK_Q` = 1) makes exactly one pass; a prefill chunk of one sequence, one pass
  per block.
- Split-K (flash-decoding): the pass's key range is cut into `NUM_SPLITS` chunks of
  whole `BLOCK_N` tiles, sized on the device from the actual span; with
  `NUM_SPLITS` > 1 each split writes a normalised partial output and its log2-sum-exp,
  and `_combine_splits_kernel` merges them.
- Cell layout: the cell ids of the next tile are loaded one iteration ahead, so the K/V
  gathers do not depend on a load of their own iteration and the software pipeliner
  multi-buffers them (checked by compiling for sm_90: same shared memory as columns).
- The drafter's block attention (`_draft_attend_kernel`) reuses the key loop: a block's T rows
  read its sequence's context before the anchor as one decode query at anchor - 1 would,
  then the block's own T keys as one more tile (non-causal). It splits the context the same
  way (whole tiles per split, sized on the device; the last split adds the block's keys) and
  merges the splits with the same combine kernel, the block's rows as its queries.
- Online softmax in fp32, exp2 domain; P is cast to the K/V dtype for the PV product
  (fp32 inputs use IEEE dots; the drafter's kernel uses TF32 where its caller's fp32
  products do). `UPCAST_DOT` is for the Triton interpreter
  only, whose `tl.dot` multiplies bf16 bit patterns as integers (triton 3.6): it feeds
  the dots the same bf16 values widened to fp32, which is what the MMA computes.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_queries", "span", "rows"])  # no recompiles as batches and columns change
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, pos_ptr, slot_ptr, table_ptr,
    n_queries, n_q_heads, span, rows, scale_log2,
    stride_qn, stride_qh, stride_on, stride_oh,
    stride_ks, stride_kr, stride_kh, stride_vs, stride_vr, stride_vh,
    stride_ts, stride_tc,
    GROUP: tl.constexpr, GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, IS_CELL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_Q), Hkv, NUM_SPLITS). Rows of the tile: (query, group head) pairs."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GP
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_local = offs_m // GP                       # [BLOCK_M] query index inside the block
    g = offs_m % GP                              # [BLOCK_M] query head inside the group
    q_idx = pid_q * BLOCK_Q + q_local            # [BLOCK_M] query index in the batch
    q_in = q_idx < n_queries
    row_ok = q_in & (g < GROUP)
    q_head = kv_head * GROUP + g
    q_row = q_idx.to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * stride_qn + q_head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    # Positions as int32 (masks are cheaper); addresses are formed in int64.
    row_pos = tl.load(pos_ptr + q_idx, mask=q_in, other=0).to(tl.int32)     # [BLOCK_M]
    row_slot = tl.load(slot_ptr + q_idx, mask=q_in, other=-1)               # [BLOCK_M] int64
    row_lo = tl.maximum(row_pos - span + 1, 0)                               # first visible key

    for j in range(0, BLOCK_Q):
        qn = pid_q * BLOCK_Q + j
        if qn < n_queries:
            slot = tl.load(slot_ptr + qn)
            if BLOCK_Q == 1:  # decode: one query, one pass
                first = qn >= 0
                live = row_ok
                hi = tl.load(pos_ptr + qn).to(tl.int32) + 1
                lo = tl.maximum(hi - span, 0)
            else:  # one pass per distinct slot (its first query in the block), over the union of spans
                first = tl.sum(((row_slot == slot) & (q_local < j) & q_in).to(tl.int32), axis=0) == 0
                live = row_ok & (row_slot == slot)
                lo = tl.min(tl.where(live, row_lo, 2147483647), axis=0)
                hi = tl.max(tl.where(live, row_pos + 1, 0), axis=0)
            if first:
                # Split-K: whole tiles of this pass's actual key range per split (some may be empty).
                per_split = ((hi - lo + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
                k_start = lo + split * per_split
                k_end = tl.minimum(hi, k_start + per_split)
                acc, m_i, l_i = _attend_keys(
                    q, k_ptr, v_ptr, table_ptr, slot, kv_head, live, row_lo, row_pos, k_start, k_end, rows,
                    scale_log2, stride_ks, stride_kr, stride_kh, stride_vs, stride_vr, stride_vh, stride_ts,
                    stride_tc, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, IS_CELL, DOT_PRECISION, UPCAST_DOT)
                _store_rows(acc, m_i, l_i, live, q_row, q_head, split, out_ptr, part_o_ptr, part_lse_ptr,
                            n_q_heads, stride_on, stride_oh, HEAD_DIM, BLOCK_D, NUM_SPLITS)


@triton.jit(do_not_specialize=["span", "rows"])
def _draft_attend_kernel(
    q_ptr, kb_ptr, vb_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, pos_ptr, slot_ptr, table_ptr,
    n_q_heads, span, rows, scale_log2,
    stride_qb, stride_qt, stride_qh, stride_kbb, stride_kbt, stride_kbh, stride_vbb, stride_vbt, stride_vbh,
    stride_ot, stride_oh, stride_pb,
    stride_ks, stride_kr, stride_kh, stride_vs, stride_vr, stride_vh, stride_ts, stride_tc,
    T: tl.constexpr, BLOCK_T: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, IS_CELL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """The drafter's block attention (`mg::draft_attend`). Grid (B, Hkv, NUM_SPLITS): a program owns one
    block's T query rows x the GROUP query heads of one KV head x one split. Every row reads the same keys:
    its sequence's cached context [anchor - span, anchor) (`_attend_keys`, as a decode query at position
    anchor - 1 would), cut into NUM_SPLITS chunks of whole tiles sized on the device from the actual
    context, then (last split) the block's own T keys as one more tile, non-causally. The output must be
    contiguous [B, T, Hq, D]: row b * T + t of [B * T, Hq, D] (`stride_ot`), as `_store_rows` and the
    combine kernel address it."""
    BLOCK_M: tl.constexpr = BLOCK_T * GP
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    t = offs_m // GP
    g = offs_m % GP
    live = (t < T) & (g < GROUP)
    q_head = kv_head * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
                mask=live[:, None] & d_ok[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    hi = tl.load(pos_ptr + b * stride_pb).to(tl.int32)  # the anchor: context keys are the positions before it
    lo = tl.maximum(hi - span, 0)
    slot = tl.load(slot_ptr + b)
    row_pos = tl.zeros([BLOCK_M], tl.int32) + (hi - 1)
    row_lo = tl.zeros([BLOCK_M], tl.int32) + lo
    per_split = ((hi - lo + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    k_start = lo + split * per_split
    k_end = tl.minimum(hi, k_start + per_split)
    acc, m_i, l_i = _attend_keys(
        q, k_ptr, v_ptr, table_ptr, slot, kv_head, live, row_lo, row_pos, k_start, k_end, rows, scale_log2,
        stride_ks, stride_kr, stride_kh, stride_vs, stride_vr, stride_vh, stride_ts, stride_tc,
        BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, IS_CELL, DOT_PRECISION, UPCAST_DOT)
    if split == NUM_SPLITS - 1:  # the block's own keys, visible to every row
        offs_t = tl.arange(0, BLOCK_T)
        t_ok = offs_t < T
        kv_mask = t_ok[:, None] & d_ok[None, :]
        kb = tl.load(kb_ptr + b * stride_kbb + offs_t[:, None] * stride_kbt + kv_head * stride_kbh
                     + offs_d[None, :], mask=kv_mask, other=0.0)
        vb = tl.load(vb_ptr + b * stride_vbb + offs_t[:, None] * stride_vbt + kv_head * stride_vbh
                     + offs_d[None, :], mask=kv_mask, other=0.0)
        acc, m_i, l_i = _softmax_tile(q, kb, vb, live[:, None] & t_ok[None, :], acc, m_i, l_i, scale_log2,
                                      DOT_PRECISION, UPCAST_DOT)
    q_row = b * T + t
    _store_rows(acc, m_i, l_i, live, q_row, q_head, split, out_ptr, part_o_ptr, part_lse_ptr, n_q_heads,
                stride_ot, stride_oh, HEAD_DIM, BLOCK_D, NUM_SPLITS)


@triton.jit
def _attend_keys(q, k_ptr, v_ptr, table_ptr, slot, kv_head, live, row_lo, row_pos, k_start, k_end, rows, scale_log2,
                 stride_ks, stride_kr, stride_kh, stride_vs, stride_vr, stride_vh, stride_ts, stride_tc,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 IS_CELL: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """Online softmax of the live rows over keys [k_start, k_end) of `slot` -> (acc, m, l), unnormalised, log2."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = table_ptr + slot * stride_ts
    next_cell = tl.zeros([BLOCK_N], tl.int64)
    if IS_CELL:  # cell ids run one tile ahead of the K/V loads that need them
        next_cell = tl.load(table_row + (k_start + offs_n).to(tl.int64) * stride_tc, mask=k_start + offs_n < k_end,
                            other=0).to(tl.int64)
    for start in range(k_start, k_end, BLOCK_N):
        k_pos = start + offs_n                                              # [BLOCK_N] int32
        k_ok = k_pos < k_end
        if IS_CELL:  # the sequence's cell list: position -> cell
            cell = next_cell
            nxt = k_pos + BLOCK_N
            next_cell = tl.load(table_row + nxt.to(tl.int64) * stride_tc, mask=nxt < k_end, other=0).to(tl.int64)
            k_off = cell * stride_kr
            v_off = cell * stride_vr
        else:  # the sequence's column: position p -> row p % rows
            row = (k_pos % rows).to(tl.int64)
            k_off = slot * stride_ks + row * stride_kr
            v_off = slot * stride_vs + row * stride_vr
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + k_off[:, None] + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        visible = (live[:, None] & k_ok[None, :] & (k_pos[None, :] >= row_lo[:, None])
                   & (k_pos[None, :] <= row_pos[:, None]))
        acc, m_i, l_i = _softmax_tile(q, k, v, visible, acc, m_i, l_i, scale_log2, DOT_PRECISION, UPCAST_DOT)
    return acc, m_i, l_i


@triton.jit
def _softmax_tile(q, k, v, visible, acc, m_i, l_i, scale_log2, DOT_PRECISION: tl.constexpr,
                  UPCAST_DOT: tl.constexpr):
    """One K/V tile into the online softmax: (acc, m, l) updated with the `visible` [rows, keys] scores, log2."""
    if UPCAST_DOT:  # bf16 operands, exact products, fp32 sums: what the MMA does
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                    # rows with nothing visible yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p_mma = p.to(v.dtype)
    if UPCAST_DOT:
        p_mma = p_mma.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_mma, v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _store_rows(acc, m_i, l_i, live, q_row, q_head, split, out_ptr, part_o_ptr, part_lse_ptr, n_q_heads,
                stride_on, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Normalise the live rows; write the output, or with splits the partial output and its log2-sum-exp (rows
    that saw no key in this split: the log2-sum-exp alone, -inf)."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (offs_d < HEAD_DIM)[None, :]
    has_keys = l_i > 0.0                                          # rows that saw no key: lse = -inf
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + q_row[:, None] * stride_on + q_head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = (q_row * n_q_heads + q_head) * NUM_SPLITS + split            # [BLOCK_M] int64
        # Rows without keys in this split write only lse = -inf; the combine reads no output of theirs.
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask & has_keys[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=live)


@triton.jit
def _combine_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, n_q_heads, stride_on, stride_oh,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           BLOCK_S: tl.constexpr):
    """One program per (query, query head): merge NUM_SPLITS normalised partials by their log2-sum-exp."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    part = (n * n_q_heads + h) * NUM_SPLITS + offs_s                          # [BLOCK_S] int64
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))                    # empty splits weigh 0
    o = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],        # empty splits wrote none
                mask=(s_ok & (lse > float("-inf")))[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + n * stride_on + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_dst_ptr, v_dst_ptr, pos_ptr, slot_ptr, table_ptr, rows,
                     stride_kn, stride_kh, stride_vn, stride_vh,
                     stride_ks, stride_kr, stride_kdh, stride_vs, stride_vr, stride_vdh, stride_ts, stride_tc,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CELL: tl.constexpr):
    """One program per (token, KV head): store the step's K/V row where its (slot, position) lives."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    pos = tl.load(pos_ptr + n)
    slot = tl.load(slot_ptr + n)
    if IS_CELL:
        cell = tl.load(table_ptr + slot * stride_ts + pos * stride_tc)
        k_dst = cell * stride_kr
        v_dst = cell * stride_vr
    else:
        k_dst = slot * stride_ks + (pos % rows) * stride_kr
        v_dst = slot * stride_vs + (pos % rows) * stride_vr
    k = tl.load(k_ptr + n * stride_kn + h * stride_kh + offs_d, mask=d_ok)
    v = tl.load(v_ptr + n * stride_vn + h * stride_vh + offs_d, mask=d_ok)
    tl.store(k_dst_ptr + k_dst + h * stride_kdh + offs_d, k, mask=d_ok)
    tl.store(v_dst_ptr + v_dst + h * stride_vdh + offs_d, v, mask=d_ok)
