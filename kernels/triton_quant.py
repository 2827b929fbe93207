"""Triton weight-only quantized linears on CUDA, and float weights through the same kernel: availability,
launch plan, launchers.

`linear_int8_triton(x, weight_q, scale)` and `linear_int4_triton(x, weight_q, scale, zero, group_size)` have
the signatures of `linear_int8_ref` / `linear_int4_ref` in `quant.py` and their results up to rounding (int8
applies its scales to exact fp32 sums of x * q where the reference rounds the dequantized weight to x's dtype
first; int4 dequantizes as the reference does, or on CUDA with bf16 / fp16 activations two elements per
instruction with q * scale + zero rounded once, where the reference rounds it to fp32 first) but never
materialise the float weight: each
quantized byte is read once per tile of up to `MAX_BLOCK_M` rows, which at decode means the weight crosses
the memory bus once, in its stored size. The kernel lives in `triton_quant_jit.py`.

`linear_float_triton(x, weight)` runs a float weight of x's dtype through the same kernel with one tile shape
for every row count (`plan_float`), the row-invariant products of `mg.kernels.linear`.

The launch depends only on shapes (grid, tiles, split-K), so CUDA graphs capture and replay it. Knows nothing
about models or the runtime; callers check `available()` (shared with the Triton attention: triton importable,
and CUDA or the interpreter) and use the references otherwise.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from . import triton_attention

_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
reason: str = triton_attention.reason  # "" when Triton kernels can run here
if not reason:
    from . import triton_quant_jit as _jit

MAX_BLOCK_M = 64        # rows per tile; more rows re-read the weight once per tile
MAX_ROWS = 256          # callers use the reference (dequantize, one matmul) beyond this many rows
BLOCK_N = 64            # output columns per program
TARGET_PROGRAMS = 4     # split-K aims at this many programs per SM (decode is memory-bound)
MIN_K_TILES = 4         # ... with at least this many BLOCK_K tiles per slice
MAX_SPLIT = 16


def available() -> bool:
    return not reason


@dataclass(frozen=True)
class QuantPlan:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int  # a multiple of block_k
    num_warps: int
    num_stages: int


def plan_linear(m: int, n: int, k: int, group_size: int | None, sms: int) -> QuantPlan:
    """Tiles and split-K from shapes only. int4 tiles (`group_size` given) fit inside one scale group. Split-K
    aims at `TARGET_PROGRAMS` programs per SM with at least `MIN_K_TILES` tiles per slice."""
    block_m = min(MAX_BLOCK_M, max(16, _next_pow2(m)))
    block_k = 128 if group_size is None else min(128, group_size)
    tiles_k = -(-k // block_k)
    # From the output columns only: every row count splits a row's sums the same way. Bit-equal results for
    # a row alone or batched hold within one tile shape (up to 16 rows); the tile (17, 33 rows) and calls
    # beyond MAX_ROWS (the reference) may change the last bits.
    columns = -(-n // BLOCK_N)
    split = max(1, min(MAX_SPLIT, -(-TARGET_PROGRAMS * sms // columns), tiles_k // MIN_K_TILES))
    per_split = -(-tiles_k // split) * block_k
    split = -(-k // per_split)  # no empty slice
    return QuantPlan(block_m, BLOCK_N, block_k, split, per_split, num_warps=4 if block_m <= 32 else 8,
                     num_stages=3)


# Float weights (`linear_float_triton`): one tile shape whatever the row count, so that a row's bits never depend
# on the rows beside it (a 1-row decode step and the same row in a 16-row DFlash verify agree exactly).
FLOAT_BLOCK_M = 16
FLOAT_BLOCK_N = 32
FLOAT_BLOCK_K = 64


def plan_float(n: int, k: int, sms: int, block_n: int = FLOAT_BLOCK_N, block_k: int = FLOAT_BLOCK_K,
               split_k: int | None = None, num_warps: int = 4, num_stages: int = 3) -> QuantPlan:
    """The launch of a float-weight linear, from N and K only (row-invariant: module constants). Split-K as
    `plan_linear` aims it unless `split_k` is given."""
    tiles_k = -(-k // block_k)
    if split_k is None:
        columns = -(-n // block_n)
        split_k = max(1, min(MAX_SPLIT, -(-TARGET_PROGRAMS * sms // columns), tiles_k // MIN_K_TILES))
    per_split = -(-tiles_k // split_k) * block_k
    split_k = -(-k // per_split)
    return QuantPlan(FLOAT_BLOCK_M, block_n, block_k, split_k, per_split, num_warps, num_stages)


def linear_float_triton(x: torch.Tensor, weight: torch.Tensor, tf32: bool = False,
                        plan: QuantPlan | None = None) -> torch.Tensor:
    """`x @ weight^T` for a float weight [N, K] of x's dtype (rows contiguous), fp32 sums (`tf32`: float32 inputs
    multiplied in TF32); a row's result does not depend on the other rows of the call (`plan_float`). `plan`
    overrides the launch (benchmarks)."""
    check_float_linear(x, weight)
    if plan is None:
        plan = plan_float(weight.shape[0], weight.shape[1], triton_attention.device_sms(x.device))
    return _launch(x, weight, None, None, None, plan, tf32=tf32)


def check_float_linear(x: torch.Tensor, weight: torch.Tensor) -> None:
    """The arguments of a float-weight Triton linear (here and `triton_rows`): ValueError in one line."""
    _require(available(), f"Triton linears are unavailable: {reason}")
    _require(x.dtype in (torch.float32, torch.bfloat16, torch.float16) and weight.dtype == x.dtype,
             f"x and weight must share a float dtype, got {x.dtype} and {weight.dtype}")
    _require(weight.dim() == 2 and weight.stride(1) == 1 and x.shape[-1] == weight.shape[1],
             f"weight must be [N, K = {x.shape[-1]}] with contiguous rows, got {tuple(weight.shape)} "
             f"strides {weight.stride()}")
    _require(weight.device == x.device, f"weight is on {weight.device}, x on {x.device}")


def rows_and_output(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] as contiguous rows [M, K] (a view where it is one) and an empty output [M, n] of x's dtype."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) != k):
        rows = rows.contiguous()
    return rows, torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)


def linear_int8_triton(x: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _check(x, weight_q, scale, None, torch.int8, weight_q.shape[1])
    _require(scale.shape == (weight_q.shape[0],), f"scale must be [N] = [{weight_q.shape[0]}], got {tuple(scale.shape)}")
    return _launch(x, weight_q, scale, scale, None)


def linear_int4_triton(x: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                       group_size: int) -> torch.Tensor:
    _check(x, weight_q, scale, zero, torch.uint8, 2 * weight_q.shape[1])
    k = x.shape[-1]
    # A group of 16 makes 16-column tiles, whose bfloat16 dots came out wrong on the H200: 32 is the least.
    _require(group_size >= 32 and group_size & (group_size - 1) == 0 and k % group_size == 0,
             f"group_size must be a power of two >= 32 dividing K = {k}, got {group_size}")
    _require(scale.shape == (weight_q.shape[0], k // group_size) and zero.shape == scale.shape,
             f"scale and zero must be [N, K / group_size] = [{weight_q.shape[0]}, {k // group_size}], got "
             f"{tuple(scale.shape)} and {tuple(zero.shape)}")
    return _launch(x, weight_q, scale, zero, group_size)


def _launch(x, weight_q, scale, zero, group_size, plan: QuantPlan | None = None, tf32: bool = False):
    k, n = x.shape[-1], weight_q.shape[0]
    rows, out = rows_and_output(x, n)
    m = rows.shape[0]
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    if plan is None:
        plan = plan_linear(m, n, k, group_size, triton_attention.device_sms(x.device))
    part = out if plan.split_k == 1 else torch.empty((plan.split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (-(-m // plan.block_m), -(-n // plan.block_n), plan.split_k)
    upcast = _INTERPRETING and x.dtype != torch.float32
    asm = _packed_dequant(x, scale, zero) if group_size is not None else ""
    _jit._linear_wq_kernel[grid](
        rows, weight_q, weight_q if scale is None else scale, weight_q if zero is None else zero, part, m, n, k,
        weight_q.stride(0), scale.shape[-1] if group_size else 1,
        rows.stride(0), n, m * n, K_PER_SPLIT=plan.k_per_split, GROUP_SIZE=group_size or 1,
        IS_INT4=group_size is not None, SCALED=scale is not None and group_size is None,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        DOT_PRECISION="ieee" if (x.dtype == torch.float32 and not tf32) or upcast else "tf32", UPCAST_DOT=upcast,
        PACKED=bool(asm), ASM=asm, num_warps=plan.num_warps, num_stages=plan.num_stages)
    if plan.split_k > 1:
        out.copy_(part.sum(dim=0))
    return out.reshape(*x.shape[:-1], n)


def _packed_dequant(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> str:
    """The inline PTX that dequantizes int4 two elements per instruction for x's dtype (`triton_quant_jit`), or ""
    where the kernel dequantizes in fp32 instead: fp32 activations, scales or zeros of another dtype than x's
    (the PTX reads them as pairs of x's dtype), the interpreter, a GPU before sm_80 (no paired bf16
    multiply-add)."""
    if _INTERPRETING or x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16):
        return ""
    if scale.dtype != x.dtype or zero.dtype != x.dtype:
        return ""
    if _capability(x.device.index if x.device.index is not None else torch.cuda.current_device()) < (8, 0):
        return ""
    return _jit.DEQUANT_ASM[str(x.dtype).removeprefix("torch.")]


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _check(x, weight_q, scale, zero, qdtype, k):
    _require(available(), f"Triton quantized linears are unavailable: {reason}")
    _require(x.dtype in (torch.float32, torch.bfloat16, torch.float16),
             f"x dtype must be float32, bfloat16 or float16, got {x.dtype}")
    _require(weight_q.dtype == qdtype and weight_q.dim() == 2 and weight_q.is_contiguous(),
             f"weight_q must be a contiguous 2-D {qdtype} tensor, got {weight_q.dtype} {tuple(weight_q.shape)}")
    _require(x.shape[-1] == k, f"x has {x.shape[-1]} input columns; the weight holds {k}")
    for name, t in (("scale", scale), ("zero", zero)):
        if t is not None:
            _require(t.is_contiguous() and t.device == x.device, f"{name} must be contiguous on {x.device}")
    _require(weight_q.device == x.device, f"weight_q is on {weight_q.device}, x on {x.device}")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
