"""Float linears for few rows on CUDA: `linear_rows_triton(x, weight)` = `x @ weight^T` by multiply-adds on CUDA
cores in fp32 (kernel: `triton_rows_jit.py`), availability and launch plan.

What it is for: a decode step, a DFlash verify or draft block, or a small batch multiplies a handful of rows by
each weight. At the embedded default's sizes every such product is bound by latency, not arithmetic; in an H100
sweep (BENCHMARKS.md, `docs/bench_rows_kernel_h100_sweep.json`) `torch.mm` on cuBLAS took 1.5-3.6x its 1-row
time for 16 float32 rows of the target's weights, and this kernel, which reads each weight tile once for a tile
of up to `BLOCK_M` rows, was faster than that at 1 and at 16 rows on most of those shapes. Against cuBLASLt (the
runtime's choice on CUDA) it was faster per product with the weights in L2 (`scripts/bench_rows.py`), but in the
model, weights read from memory, a 1-row forward took 23% more kernel time (BENCHMARKS.md).

The launch's tiles (`plan_rows`) come from the weight's shape and the device's SM count; the row tile (1-16
rows, by the call) changes how many rows a program holds, not the order of a row's sums, which K's tiling
sets. So a row gets the same bits in a call of 1 row, of 16 or of 200 (row tiles of 16, each reading the weight
again: long calls are better served by a matrix-multiply kernel). That rests on the compiler: Triton 3.6,
compiling for sm_90, gives every row tile of 1-16 rows the same layout along K and the same reduction across
warps (read from its generated code); `tests/kernels/test_triton_rows.py` checks the bits on CUDA (the
interpreter cannot show them). Launches depend only on shapes, so CUDA graphs capture and replay them. Knows
nothing about models or the runtime; callers check `available()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import triton_attention
from .triton_quant import check_float_linear, rows_and_output

reason: str = triton_attention.reason  # "" when Triton kernels can run here
available = triton_attention.available
if not reason:
    from . import triton_rows_jit as _jit

BLOCK_M = 16           # rows per tile; more rows re-read the weight once per tile
NUM_WARPS = 4
WIDE_PROGRAMS = 2      # more than this many 4-column programs per SM: 8 columns a program (plan_rows)


@dataclass(frozen=True)
class RowsPlan:
    block_n: int
    block_k: int
    num_warps: int = NUM_WARPS


def plan_rows(n: int, k: int, sms: int) -> RowsPlan:
    """The launch for a weight [N, K], from its shape and the device only (so a row's sums never depend on the
    call's rows). A program's accumulator holds 16 x 512 products at a full row tile: 4 columns by 128 of K, or,
    where 4-column programs would outnumber `WIDE_PROGRAMS` per SM (each program loads the rows' tile again),
    8 columns by 64 (an H100 sweep over tile shapes, split K and warps; BENCHMARKS.md)."""
    del k  # the tiles suit every K measured; kept in the signature: a plan is a function of the weight's shape
    if -(-n // 4) <= WIDE_PROGRAMS * sms:
        return RowsPlan(block_n=4, block_k=128)
    return RowsPlan(block_n=8, block_k=64)


def linear_rows_triton(x: torch.Tensor, weight: torch.Tensor, plan: RowsPlan | None = None) -> torch.Tensor:
    """`x @ weight^T` for x [..., K] and a weight [N, K] of x's float dtype with contiguous rows; fp32 sums, the
    result in x's dtype. `plan` overrides the launch (benchmarks)."""
    check_float_linear(x, weight)
    n, k = weight.shape
    rows, out = rows_and_output(x, n)
    m = rows.shape[0]
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    if plan is None:
        plan = plan_rows(n, k, triton_attention.device_sms(x.device))
    block_m = min(BLOCK_M, 1 << (m - 1).bit_length())  # the next power of two
    grid = (-(-n // plan.block_n), -(-m // block_m))
    _jit._linear_rows_kernel[grid](rows, weight, out, m, n, k, rows.stride(0), weight.stride(0), n,
                                   BLOCK_M=block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
                                   num_warps=plan.num_warps)
    return out.reshape(*x.shape[:-1], n)
