"""Float matrix products the runtime may serve for the program's `aten::mm`: `mg::row_mm(a, b)` (row-invariant)
and `mg::rows_mm(a, b)` (few float32 rows on CUDA cores). Both have `aten::mm`'s schema and its result up to
rounding; elsewhere than described they are `torch.mm`. A program computes each linear layer as
`aten::mm(x, permute(W))`: `b` is a weight's transpose (`b.T` has contiguous rows).

`row_mm` (`RunConfig.row_invariant`): cuBLAS picks its kernel by the shapes, so a row of x gets other summation
orders, and in the last bits other results, in a 1-row decode step than in a 16-row DFlash verify or a batch of
sequences. On CUDA, for a float `b` that is a weight's transpose and at most `triton_quant.MAX_ROWS` rows,
`row_mm` runs the Triton linear of `triton_quant.linear_float_triton`, whose launch depends on the weight's
shape only, so each row's bits are the same whatever rows share the call. Float32 products follow torch's TF32
setting at the call.

`rows_mm` (`RunConfig.rows_kernel`): on CUDA, for float32 operands, a weight's transpose and 1 to `FEW_ROWS`
rows, `triton_rows.linear_rows_triton`: multiply-adds in IEEE float32 (whatever torch's TF32 setting); longer
calls and other dtypes go to `torch.mm`. On an H100 it beat cuBLASLt per product with the weights in L2 but made
the embedded default's 1-row decode step 23% longer in place (BENCHMARKS.md), hence opt-in.

The runtime serves `aten::mm` with one of them through its op table (compiled methods trace the op as an opaque
call). Knows nothing about models or the runtime.
"""

from __future__ import annotations

import torch

from . import ops
from .precision import cuda_fp32_matmuls_tf32

ROW_MM = "row_mm"
ROWS_MM = "rows_mm"
FEW_ROWS = 16  # rows_mm: float32 calls of 1..FEW_ROWS rows run the rows kernel

for _name in (ROW_MM, ROWS_MM):
    ops._lib.define(f"{_name}(Tensor a, Tensor b) -> Tensor")


def _weight_product(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a @ b` on CUDA of one float dtype, `b` a weight's transpose."""
    return (a.is_cuda and a.dim() == 2 and b.dim() == 2 and a.dtype == b.dtype
            and a.dtype in (torch.float32, torch.bfloat16, torch.float16) and b.stride(0) == 1)


def serves_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `rows_mm` runs `a @ b` on the rows kernel (module docstring)."""
    from . import triton_rows

    return (_weight_product(a, b) and a.dtype == torch.float32 and 1 <= a.shape[0] <= FEW_ROWS
            and triton_rows.available())


def serves(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `row_mm` runs `a @ b` on the Triton kernel (module docstring)."""
    from . import triton_quant

    return _weight_product(a, b) and a.shape[0] <= triton_quant.MAX_ROWS and triton_quant.available()


def rows_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if serves_rows(a, b):
        from . import triton_rows

        return triton_rows.linear_rows_triton(a, b.T)
    return torch.mm(a, b)


def row_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if serves(a, b):
        from . import triton_quant

        tf32 = a.dtype == torch.float32 and cuda_fp32_matmuls_tf32()
        return triton_quant.linear_float_triton(a, b.T, tf32=tf32)
    return torch.mm(a, b)


ops._lib.impl(ROW_MM, row_mm, "CompositeExplicitAutograd")
ops._lib.impl(ROWS_MM, rows_mm, "CompositeExplicitAutograd")


def _mm_fake(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


for _name in (ROW_MM, ROWS_MM):
    torch.library.register_fake(f"{ops.NAMESPACE}::{_name}")(_mm_fake)


def op() -> "torch._ops.OpOverload":
    """`mg::row_mm`, for a runtime's table (what serves `aten::mm` with `RunConfig.row_invariant`)."""
    return torch.ops.mg.row_mm.default


def rows_op() -> "torch._ops.OpOverload":
    """`mg::rows_mm`, for a runtime's table (what serves `aten::mm` with `RunConfig.rows_kernel`)."""
    return torch.ops.mg.rows_mm.default
