"""Row-invariant float matrix products: `mg::row_mm(a, b)`, the program's `aten::mm` where the runtime asks.

A program computes each linear layer as `aten::mm(x, permute(W))`. cuBLAS picks its kernel by the shapes, so
a row of x gets other summation orders, and in the last bits other results, in a 1-row decode step than in a
16-row DFlash verify or a batch of sequences. `mg::row_mm` has `aten::mm`'s schema and result up to that
rounding; on CUDA, for a float `b` that is a weight's transpose (`b.T` has contiguous rows) and at most
`triton_quant.MAX_ROWS` rows, it runs the Triton linear of `triton_quant.linear_float_triton`, whose launch
depends on the weight's shape only, so each row's bits are the same whatever rows share the call. Float32
products follow torch's TF32 setting at the call. Elsewhere (CPU, other operands, longer calls) it is
`torch.mm`.

The runtime serves `aten::mm` with it when `RunConfig.row_invariant` holds (the interpreter through its op
table, compiled methods by tracing it as an opaque op). Knows nothing about models or the runtime.
"""

from __future__ import annotations

import torch

from . import ops
from .precision import cuda_fp32_matmuls_tf32

ROW_MM = "row_mm"
QUALIFIED = f"{ops.NAMESPACE}::{ROW_MM}"

ops._lib.define(f"{ROW_MM}(Tensor a, Tensor b) -> Tensor")


def serves(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the Triton kernel takes `a @ b` (module docstring)."""
    from . import triton_quant

    return (a.is_cuda and a.dim() == 2 and b.dim() == 2 and a.dtype == b.dtype
            and a.dtype in (torch.float32, torch.bfloat16, torch.float16) and b.stride(0) == 1
            and a.shape[0] <= triton_quant.MAX_ROWS and triton_quant.available())


def row_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if serves(a, b):
        from . import triton_quant

        tf32 = a.dtype == torch.float32 and cuda_fp32_matmuls_tf32()
        return triton_quant.linear_float_triton(a, b.T, tf32=tf32)
    return torch.mm(a, b)


ops._lib.impl(ROW_MM, row_mm, "CompositeExplicitAutograd")


@torch.library.register_fake(QUALIFIED)
def _row_mm_fake(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


def op() -> "torch._ops.OpOverload":
    """The registered op (what a runtime puts in its table for `aten::mm`)."""
    return torch.ops.mg.row_mm.default
