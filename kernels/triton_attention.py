"""Triton attention for the two off-graph KV layouts: availability, launch plan, launchers.

`attend_columns_triton` (kBatchedSequence) and `attend_cells_triton` (kBatchedCell) have
the signatures and semantics of `attend_columns_ref` / `attend_cells_ref` in
`attention_ref.py`; `write_columns_triton` / `write_cells_triton` scatter a step's K/V
into the storage (torch references `write_columns_ref` / `write_cells_ref` below).
`draft_attend_columns_triton` / `draft_attend_cells_triton` are the drafter's block attention
(`mg::draft_attend`, reference `draft_attend_ref` over the context `draft_context_span` selects).
The kernels themselves live in `triton_attention_jit.py`.

Launchers read only shapes, strides and static arguments on the host; positions,
slots and cell tables are read on the device, and the grid depends only on shapes,
so a CUDA graph can capture and replay them. Knows nothing about caches' bookkeeping
or the runtime; callers check `available()` and fall back to the torch reference,
saying `reason` once.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from .precision import cuda_fp32_matmuls_tf32


def _why_unavailable() -> str:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        return ""
    return "no CUDA device (set TRITON_INTERPRET=1 before importing triton to run the kernels on CPU)"


def _patch_interpreter_for_numpy_2_4() -> None:
    """triton 3.6's interpreter does `int(array_of_one)`, which numpy >= 2.4 refuses, so a
    loop with tensor bounds fails (triton-lang/triton#9171, fixed upstream by #9172).
    Apply the upstream one-line fix, interpreter mode only."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "mg_numpy_2_4_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.mg_numpy_2_4_fix = True
    interpreter._patch_lang_tensor = patched


_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
reason: str = _why_unavailable()  # "" when the Triton kernels can run here
if not reason:
    from . import triton_attention_jit as _jit

    if _INTERPRETING:
        _patch_interpreter_for_numpy_2_4()


def available() -> bool:
    """Triton importable and either a CUDA device or the Triton interpreter (TRITON_INTERPRET=1)."""
    return not reason


LOG2E = 1.4426950408889634
MIN_KEYS_PER_SPLIT = 256   # split-K never cuts the static span below this many keys per split
MAX_SPLITS = 64
TARGET_WAVES = 4           # split-K aims at this many programs per SM (decode is latency- and memory-bound)
MIN_DRAFT_KEYS_PER_SPLIT = 64   # the drafter's block attention: keys of the static span per split, at least
DRAFT_TARGET_WAVES = 1     # its programs per SM (each carries a block's T rows x its group: a 64-row tile)
PREFILL_ROWS = 64          # tile rows (queries x group heads) of a prefill program
_INTERPRETER_SMS = 132     # H200's count, so the interpreter exercises the same split policy


@dataclass(frozen=True)
class LaunchPlan:
    """Static tiling of one attention launch; depends only on shapes and static arguments."""

    block_q: int      # queries per program: 1 = decode tiling, a power of two
    gp: int           # tile rows per query (group heads padded to a power of two; block_q * gp >= 16)
    block_n: int      # keys per tile
    block_d: int      # head_dim padded to a power of two >= 16
    num_splits: int   # split-K programs per (query block, KV head); > 1 adds the combine kernel
    num_warps: int
    num_stages: int


def plan_attention(n_queries: int, n_slots: int, n_q_heads: int, n_kv_heads: int, head_dim: int, span: int,
                   dtype: torch.dtype, sms: int, block_q: int | None = None,
                   num_splits: int | None = None) -> LaunchPlan:
    """Pick tiles and the split count from shapes only (never from positions).

    Decode tiling (the default when n_queries <= n_slots, i.e. at most one query per
    sequence is possible) puts one query per program, its group heads padded to 16 tile
    rows for `tl.dot`. Prefill tiling packs `PREFILL_ROWS // group` consecutive queries
    per program so one K/V tile serves all queries of a sequence in the block. Callers
    that know better (a decode step padded to a graph bucket with scratch rows) pass
    `block_q=1`. Split-K aims at `TARGET_WAVES` programs per SM, with at least
    `MIN_KEYS_PER_SPLIT` keys of the static span per split and at most `MAX_SPLITS`.
    """
    group = n_q_heads // n_kv_heads
    gp_pow = _next_pow2(group)
    if block_q is None:  # fp32 dots run on FMA units: keep its prefill tiles at 16 rows (no spills)
        rows = 16 if dtype == torch.float32 else PREFILL_ROWS
        block_q = 1 if n_queries <= n_slots else max(1, rows // gp_pow)
    _require(block_q >= 1 and block_q & (block_q - 1) == 0, f"block_q must be a power of two, got {block_q}")
    gp = max(gp_pow, _next_pow2(_cdiv(16, block_q)))
    block_d = max(16, _next_pow2(head_dim))
    block_n = 32 if dtype == torch.float32 or block_d > 128 else 64
    if num_splits is None:
        programs = _cdiv(n_queries, block_q) * n_kv_heads
        by_span = max(1, _cdiv(span, MIN_KEYS_PER_SPLIT))
        num_splits = max(1, min(_cdiv(TARGET_WAVES * sms, programs), by_span, MAX_SPLITS))
    _require(1 <= num_splits, f"num_splits must be >= 1, got {num_splits}")
    # sm_90 compile (ptxas) of these defaults: decode bf16 D=128 ~100 registers, 70 KB smem, K/V
    # loads pipelined (cp.async, 3 stages) for both layouts; prefill (wgmma, 64 rows) needs 8 warps
    # to stay off the 255-register cap; fp32 (FMA dots) spills with 4 warps.
    wide = dtype == torch.float32 or block_q > 1
    return LaunchPlan(block_q=block_q, gp=gp, block_n=block_n, block_d=block_d, num_splits=num_splits,
                      num_warps=8 if wide else 4, num_stages=3 if block_q == 1 else 2)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (the H200's 132 for the interpreter on CPU)."""
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_query_side(q: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor, kv: torch.Tensor,
                      kv_name: str) -> None:
    _require(available(), f"Triton attention is unavailable: {reason}")
    _require(q.dim() == 3, f"q must be [N, Hq, D], got shape {tuple(q.shape)}")
    _require(q.dtype in (torch.float32, torch.bfloat16), f"q dtype must be float32 or bfloat16, got {q.dtype}")
    _require(kv.dtype == q.dtype, f"{kv_name} dtype {kv.dtype} must equal q dtype {q.dtype}")
    _require(kv.shape[-1] == q.shape[-1], f"{kv_name} head_dim {kv.shape[-1]} != q head_dim {q.shape[-1]}")
    _require(q.shape[1] % kv.shape[-2] == 0,
             f"q heads ({q.shape[1]}) must be a multiple of {kv_name} KV heads ({kv.shape[-2]})")
    _require(q.stride(-1) == 1 and kv.stride(-1) == 1, f"q and {kv_name} need a contiguous last dim (stride 1)")
    n = q.shape[0]
    for name, t in (("positions", positions), ("seq_slots", seq_slots)):
        _require(t.dtype == torch.int64, f"{name} must be int64, got {t.dtype}")
        _require(t.shape == (n,), f"{name} must be [N] = [{n}], got {tuple(t.shape)}")
        _require(t.is_contiguous(), f"{name} must be contiguous")
        _require(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
    _require(kv.device == q.device, f"{kv_name} is on {kv.device}, q on {q.device}")


def _span(window: int, rows: int) -> int:
    _require(window >= 0, f"window must be >= 0 (0 = no limit), got {window}")
    return min(window, rows) if window > 0 else rows


def _launch_attention(q, k, v, positions, seq_slots, table, rows: int, span: int, n_slots: int, scale: float,
                      k_strides: tuple[int, int, int], v_strides: tuple[int, int, int],
                      table_strides: tuple[int, int], is_cell: bool, block_q: int | None,
                      num_splits: int | None, plan: LaunchPlan | None) -> torch.Tensor:
    n, hq, d = q.shape
    hkv = k.shape[-2]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if n == 0:
        return out
    if plan is None:
        plan = plan_attention(n, n_slots, hq, hkv, d, span, q.dtype, device_sms(q.device), block_q, num_splits)
    _require(plan.block_q * plan.gp >= 16 and plan.gp >= hq // hkv and plan.block_d >= max(16, d)
             and plan.block_n >= 16, f"plan {plan} does not fit group {hq // hkv}, head_dim {d}")
    part_o, part_lse = _partials(out, n, plan.num_splits)
    grid = (_cdiv(n, plan.block_q), hkv, plan.num_splits)
    _jit._attend_kernel[grid](
        q, k, v, out, part_o, part_lse, positions, seq_slots, table,
        n, hq, span, rows, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_strides, *v_strides, *table_strides,
        **attend_meta(plan, hq // hkv, d, q.dtype, is_cell, _INTERPRETING),
    )
    if plan.num_splits > 1:
        _combine(part_o, part_lse, out, plan.num_splits)
    return out


def attend_meta(plan: LaunchPlan, group: int, head_dim: int, dtype: torch.dtype, is_cell: bool,
                interpreting: bool = False) -> dict:
    """`_attend_kernel`'s compile-time arguments and launch options for `plan` (shapes only, no device)."""
    upcast = interpreting and dtype != torch.float32
    return dict(GROUP=group, GP=plan.gp, BLOCK_Q=plan.block_q, BLOCK_N=plan.block_n, HEAD_DIM=head_dim,
                BLOCK_D=plan.block_d, NUM_SPLITS=plan.num_splits, IS_CELL=is_cell,
                DOT_PRECISION="ieee" if dtype == torch.float32 or upcast else "tf32", UPCAST_DOT=upcast,
                num_warps=plan.num_warps, num_stages=plan.num_stages)


def combine_meta(head_dim: int, num_splits: int) -> dict:
    """`_combine_splits_kernel`'s compile-time arguments and launch options."""
    block_d, block_s = max(16, _next_pow2(head_dim)), _next_pow2(num_splits)
    return dict(HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits, BLOCK_S=block_s,
                num_warps=4 if block_s * block_d <= 4096 else 8)


def _partials(out: torch.Tensor, rows: int, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partial outputs [rows, Hq, splits, D] and log2-sum-exps [rows, Hq, splits] (fp32) for `out`'s
    rows x query heads; with one split the kernel writes `out` directly and these are `out`, unused."""
    if num_splits == 1:
        return out, out
    hq, d = out.shape[-2:]
    return (torch.empty((rows, hq, num_splits, d), dtype=torch.float32, device=out.device),
            torch.empty((rows, hq, num_splits), dtype=torch.float32, device=out.device))


def _combine(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    """Merge split-K partials (`_store_rows`' layout) into out [N, Hq, D]: one program per (row, query head)."""
    n, hq, d = out.shape
    _jit._combine_splits_kernel[(n, hq)](part_o, part_lse, out, hq, out.stride(0), out.stride(1),
                                         **combine_meta(d, num_splits))


def attend_columns_triton(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, positions: torch.Tensor,
                          seq_slots: torch.Tensor, window: int, scale: float, *, block_q: int | None = None,
                          num_splits: int | None = None, plan: LaunchPlan | None = None) -> torch.Tensor:
    """kBatchedSequence read side; same contract as `attend_columns_ref`.

    q [N, Hq, D]; k_store/v_store [slots, rows, Hkv, D] (position p at row p % rows);
    positions/seq_slots [N] int64 -> [N, Hq, D] in q's dtype. `block_q` / `num_splits`
    override parts of the default `plan_attention`; `plan` replaces it (tuning).
    """
    _check_query_side(q, positions, seq_slots, k_store, "k_store")
    _require(k_store.dim() == 4 and k_store.shape == v_store.shape,
             f"k_store/v_store must both be [slots, rows, Hkv, D], got {tuple(k_store.shape)} and "
             f"{tuple(v_store.shape)}")
    _require(v_store.dtype == q.dtype and v_store.stride(-1) == 1 and v_store.device == q.device,
             "v_store must match q's dtype and device and have a contiguous last dim")
    rows = k_store.shape[1]
    span = _span(window, rows)
    return _launch_attention(
        q, k_store, v_store, positions, seq_slots, positions, rows, span, k_store.shape[0], scale,
        (k_store.stride(0), k_store.stride(1), k_store.stride(2)),
        (v_store.stride(0), v_store.stride(1), v_store.stride(2)), (0, 0), False, block_q, num_splits, plan)


def attend_cells_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cell_table: torch.Tensor,
                        positions: torch.Tensor, seq_slots: torch.Tensor, window: int, scale: float, *,
                        block_q: int | None = None, num_splits: int | None = None,
                        plan: LaunchPlan | None = None) -> torch.Tensor:
    """kBatchedCell read side; same contract as `attend_cells_ref`.

    q [N, Hq, D]; k_pool/v_pool [cells, Hkv, D]; cell_table [slots, capacity] int64
    (cell of each position of each sequence); positions/seq_slots [N] int64 -> [N, Hq, D].
    """
    _check_query_side(q, positions, seq_slots, k_pool, "k_pool")
    _require(k_pool.dim() == 3 and k_pool.shape == v_pool.shape,
             f"k_pool/v_pool must both be [cells, Hkv, D], got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    _require(v_pool.dtype == q.dtype and v_pool.stride(-1) == 1 and v_pool.device == q.device,
             "v_pool must match q's dtype and device and have a contiguous last dim")
    _require(cell_table.dim() == 2 and cell_table.dtype == torch.int64 and cell_table.device == q.device,
             f"cell_table must be [slots, capacity] int64 on {q.device}, got {tuple(cell_table.shape)} "
             f"{cell_table.dtype} on {cell_table.device}")
    capacity = cell_table.shape[1]
    span = _span(window, capacity)
    return _launch_attention(
        q, k_pool, v_pool, positions, seq_slots, cell_table, capacity, span, cell_table.shape[0], scale,
        (0, k_pool.stride(0), k_pool.stride(1)), (0, v_pool.stride(0), v_pool.stride(1)),
        (cell_table.stride(0), cell_table.stride(1)), True, block_q, num_splits, plan)


def _check_draft_side(q, k_blk, v_blk, positions, seq_slots, kv, kv_name: str) -> None:
    _require(available(), f"Triton attention is unavailable: {reason}")
    _require(q.dim() == 4, f"q must be [B, T, Hq, D], got shape {tuple(q.shape)}")
    b, t, hq, d = q.shape
    _require(k_blk.dim() == 4 and k_blk.shape == v_blk.shape and k_blk.shape[:2] == (b, t)
             and k_blk.shape[3] == d and hq % k_blk.shape[2] == 0,
             f"k/v must both be [B, T, Hkv, D] = [{b}, {t}, Hkv, {d}] with Hkv dividing {hq}, got "
             f"{tuple(k_blk.shape)} and {tuple(v_blk.shape)}")
    _require(kv.shape[-2:] == k_blk.shape[2:], f"{kv_name} [..., Hkv, D] {tuple(kv.shape)} does not match k "
             f"{tuple(k_blk.shape)}")
    _require(q.dtype in (torch.float32, torch.bfloat16) and q.dtype == k_blk.dtype == v_blk.dtype == kv.dtype,
             f"q, k, v and {kv_name} must share one dtype, float32 or bfloat16; got {q.dtype}, {k_blk.dtype}, "
             f"{v_blk.dtype}, {kv.dtype}")
    _require(all(x.stride(-1) == 1 for x in (q, k_blk, v_blk, kv)), f"q, k, v and {kv_name} need a contiguous last dim")
    _require(positions.dtype == torch.int64 and positions.dim() == 2 and positions.shape[0] == b,
             f"positions must be [B, T] int64 with B = {b}, got {tuple(positions.shape)} {positions.dtype}")
    _require(seq_slots.dtype == torch.int64 and seq_slots.shape == (b,) and seq_slots.is_contiguous(),
             f"seq_slots must be a contiguous [B] = [{b}] int64 tensor, got {tuple(seq_slots.shape)} {seq_slots.dtype}")
    for x in (k_blk, v_blk, positions, seq_slots, kv):
        _require(x.device == q.device, f"every input must be on {q.device}; one is on {x.device}")


def plan_draft_splits(batch: int, n_kv_heads: int, span: int, sms: int) -> int:
    """Split count of the drafter's block attention, from shapes only: as many as keep the programs over
    (block, KV head, split) within `DRAFT_TARGET_WAVES` per SM (a split that starts a further wave costs more
    than its keys save: at MG-30B's drafter shape, 8 blocks on an H100, 3 splits took 38.8 us at 1024 keys and
    23.8 at 128 against 32.7 and 15.7 for 2; BENCHMARKS.md), at least `MIN_DRAFT_KEYS_PER_SPLIT` keys of the
    static span per split, at most `MAX_SPLITS`. On the device each split gets whole tiles of the actual
    context, so a short context leaves the trailing splits empty rather than tiny (an empty split reads no key
    and writes only its rows' log2-sum-exp)."""
    by_span = max(1, _cdiv(span, MIN_DRAFT_KEYS_PER_SPLIT))
    return max(1, min(DRAFT_TARGET_WAVES * sms // max(1, batch * n_kv_heads), by_span, MAX_SPLITS))


def draft_meta(t: int, group: int, head_dim: int, dtype: torch.dtype, num_splits: int, is_cell: bool, tf32: bool,
               interpreting: bool = False) -> dict:
    """`_draft_attend_kernel`'s compile-time arguments and launch options (shapes only, no device). `tf32`: float32
    dots in TF32 (the caller's fp32 products run so)."""
    upcast = interpreting and dtype != torch.float32
    fp32 = dtype == torch.float32
    block_t, block_d, gp = max(16, _next_pow2(t)), max(16, _next_pow2(head_dim)), _next_pow2(group)
    # Keys per tile: float32 with head_dim > 128 takes 16 (sm_90 compile: a TF32 tile of 128 rows x 256 with 32
    # keys needs 256 KB of shared memory, over the 227 KB limit), other float32 or head_dim > 128 32, else 64.
    block_n = 16 if fp32 and block_d > 128 else 32 if fp32 or block_d > 128 else 64
    return dict(T=t, BLOCK_T=block_t, GROUP=group, GP=gp, BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=block_d,
                NUM_SPLITS=num_splits, IS_CELL=is_cell,
                DOT_PRECISION="ieee" if upcast or (fp32 and not tf32) else "tf32", UPCAST_DOT=upcast,
                num_warps=8 if fp32 or block_t * gp > 64 else 4, num_stages=2)


def _launch_draft(q, k_blk, v_blk, k, v, positions, seq_slots, table, rows: int, span: int, scale: float,
                  k_strides: tuple[int, int, int], v_strides: tuple[int, int, int], table_strides: tuple[int, int],
                  is_cell: bool, num_splits: int | None) -> torch.Tensor:
    b, t, hq, d = q.shape
    hkv = k_blk.shape[2]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if b == 0 or t == 0:
        return out
    if num_splits is None:
        num_splits = plan_draft_splits(b, hkv, span, device_sms(q.device))
    _require(isinstance(num_splits, int) and 1 <= num_splits <= MAX_SPLITS,
             f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    part_o, part_lse = _partials(out, b * t, num_splits)
    tf32 = q.dtype == torch.float32 and cuda_fp32_matmuls_tf32()  # the caller's fp32 products run in TF32
    meta = draft_meta(t, hq // hkv, d, q.dtype, num_splits, is_cell, tf32, _INTERPRETING)
    _jit._draft_attend_kernel[(b, hkv, num_splits)](
        q, k_blk, v_blk, k, v, out, part_o, part_lse, positions, seq_slots, table, hq, span, rows, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k_blk.stride(0), k_blk.stride(1), k_blk.stride(2),
        v_blk.stride(0), v_blk.stride(1), v_blk.stride(2), out.stride(1), out.stride(2),
        positions.stride(0), *k_strides, *v_strides, *table_strides, **meta,
    )
    if num_splits > 1:
        _combine(part_o, part_lse, out.view(b * t, hq, d), num_splits)
    return out


def draft_attend_columns_triton(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_store: torch.Tensor,
                                v_store: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor, window: int,
                                scale: float, *, num_splits: int | None = None) -> torch.Tensor:
    """The drafter's block attention (`mg::draft_attend`) over kBatchedSequence storage, in one kernel: what
    `draft_attend_ref` computes over the context `draft_context_span` selects, gathered from the columns.

    q [B, T, Hq, D]; k_blk/v_blk [B, T, Hkv, D] (the block's own keys, all visible to every row);
    k_store/v_store [slots, rows, Hkv, D]; positions [B, T] int64 (column 0, the anchor, is read: the
    context is positions [anchor - span, anchor), span = min(window, rows), or rows for window 0);
    seq_slots [B] int64 -> [B, T, Hq, D] in q's dtype. `num_splits` overrides `plan_draft_splits` (tuning).
    """
    _check_draft_side(q, k_blk, v_blk, positions, seq_slots, k_store, "k_store")
    _require(k_store.dim() == 4 and k_store.shape == v_store.shape and v_store.stride(-1) == 1
             and v_store.dtype == k_store.dtype and v_store.device == k_store.device,
             f"k_store/v_store must both be [slots, rows, Hkv, D] of one dtype, got {tuple(k_store.shape)} and "
             f"{tuple(v_store.shape)}")
    rows = k_store.shape[1]
    return _launch_draft(q, k_blk, v_blk, k_store, v_store, positions, seq_slots, seq_slots, rows,
                         _span(window, rows), scale, k_store.stride()[:3], v_store.stride()[:3], (0, 0), False,
                         num_splits)


def draft_attend_cells_triton(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_pool: torch.Tensor,
                              v_pool: torch.Tensor, cell_table: torch.Tensor, positions: torch.Tensor,
                              seq_slots: torch.Tensor, window: int, scale: float, *,
                              num_splits: int | None = None) -> torch.Tensor:
    """`draft_attend_columns_triton` over kBatchedCell storage: k_pool/v_pool [cells, Hkv, D], cell_table
    [slots, capacity] int64; the context span is min(window, capacity), or capacity for window 0."""
    _check_draft_side(q, k_blk, v_blk, positions, seq_slots, k_pool, "k_pool")
    _require(k_pool.dim() == 3 and k_pool.shape == v_pool.shape and v_pool.stride(-1) == 1
             and v_pool.dtype == k_pool.dtype and v_pool.device == k_pool.device,
             f"k_pool/v_pool must both be [cells, Hkv, D] of one dtype, got {tuple(k_pool.shape)} and "
             f"{tuple(v_pool.shape)}")
    _require(cell_table.dim() == 2 and cell_table.dtype == torch.int64 and cell_table.device == q.device,
             f"cell_table must be [slots, capacity] int64 on {q.device}, got {tuple(cell_table.shape)} "
             f"{cell_table.dtype} on {cell_table.device}")
    capacity = cell_table.shape[1]
    return _launch_draft(q, k_blk, v_blk, k_pool, v_pool, positions, seq_slots, cell_table, capacity,
                         _span(window, capacity), scale, (0, k_pool.stride(0), k_pool.stride(1)),
                         (0, v_pool.stride(0), v_pool.stride(1)), (cell_table.stride(0), cell_table.stride(1)), True,
                         num_splits)


def write_columns_ref(k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                      positions: torch.Tensor, seq_slots: torch.Tensor) -> None:
    """k/v [N, Hkv, D] -> k_store/v_store[seq_slots, positions % rows] (in place)."""
    rows = k_store.shape[1]
    k_store[seq_slots, positions % rows] = k
    v_store[seq_slots, positions % rows] = v


def write_cells_ref(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    cell_table: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor) -> None:
    """k/v [N, Hkv, D] -> k_pool/v_pool[cell_table[seq_slots, positions]] (in place)."""
    cells = cell_table[seq_slots, positions]
    k_pool[cells] = k
    v_pool[cells] = v


def _check_write(k, v, dst_k, dst_v, positions, seq_slots) -> None:
    _require(available(), f"Triton attention is unavailable: {reason}")
    _require(k.dim() == 3 and k.shape == v.shape, f"k/v must both be [N, Hkv, D], got {tuple(k.shape)}, "
             f"{tuple(v.shape)}")
    _require(k.dtype == v.dtype == dst_k.dtype == dst_v.dtype, "k, v and the storage must share one dtype")
    _require(dst_k.shape[-2:] == k.shape[-2:] and dst_v.shape == dst_k.shape,
             f"storage [..., Hkv, D] {tuple(dst_k.shape)} does not match k {tuple(k.shape)}")
    _require(all(t.stride(-1) == 1 for t in (k, v, dst_k, dst_v)), "k, v and the storage need a contiguous last dim")
    for name, t in (("positions", positions), ("seq_slots", seq_slots)):
        _require(t.dtype == torch.int64 and t.shape == (k.shape[0],) and t.is_contiguous(),
                 f"{name} must be a contiguous [N] int64 tensor")


def write_columns_triton(k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                         positions: torch.Tensor, seq_slots: torch.Tensor) -> None:
    """Fused scatter of a step's K/V into per-sequence columns; same effect as `write_columns_ref`."""
    _check_write(k, v, k_store, v_store, positions, seq_slots)
    _require(k_store.dim() == 4, f"k_store must be [slots, rows, Hkv, D], got {tuple(k_store.shape)}")
    _launch_write(k, v, k_store, v_store, positions, seq_slots, positions, k_store.shape[1],
                  k_store.stride()[:3], v_store.stride()[:3], (0, 0), False)


def write_cells_triton(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                       cell_table: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor) -> None:
    """Fused scatter of a step's K/V into the cell pool; same effect as `write_cells_ref`."""
    _check_write(k, v, k_pool, v_pool, positions, seq_slots)
    _require(k_pool.dim() == 3, f"k_pool must be [cells, Hkv, D], got {tuple(k_pool.shape)}")
    _require(cell_table.dim() == 2 and cell_table.dtype == torch.int64, "cell_table must be [slots, capacity] int64")
    _launch_write(k, v, k_pool, v_pool, positions, seq_slots, cell_table, cell_table.shape[1],
                  (0, *k_pool.stride()[:2]), (0, *v_pool.stride()[:2]),
                  (cell_table.stride(0), cell_table.stride(1)), True)


def _launch_write(k, v, dst_k, dst_v, positions, seq_slots, table, rows, k_strides, v_strides, table_strides,
                  is_cell: bool) -> None:
    n, hkv, d = k.shape
    if n == 0:
        return
    _jit._write_kv_kernel[(n, hkv)](
        k, v, dst_k, dst_v, positions, seq_slots, table, rows,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_strides, *v_strides, *table_strides,
        HEAD_DIM=d, BLOCK_D=_next_pow2(d), IS_CELL=is_cell, num_warps=1,
    )
