"""Triton kernel (only the `@triton.jit` body) of `triton_rows.linear_rows_triton`: `y = x W^T` for a float
weight and few rows of x, on CUDA cores by multiply-adds instead of a matrix-multiply instruction.

Imports triton unconditionally: import it through `mg.kernels.triton_rows`, which checks availability, plans
the launch and validates arguments.

A program owns `BLOCK_N` output columns and a tile of `BLOCK_M` rows. Per `BLOCK_K` columns of the input
dimension it loads the weight tile [BLOCK_N, BLOCK_K] once and the rows' tile [BLOCK_M, BLOCK_K], and adds
their products element by element into an fp32 accumulator [BLOCK_M, BLOCK_N, BLOCK_K]; at the end it sums
the accumulator over its last axis. A row's sum runs in an order set by K's tiling (`BLOCK_K`, from the
weight's shape), not by the rows beside it.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])  # one compile per weight shape and row tile, whatever the call's rows
def _linear_rows_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = offs_m.to(tl.int64)  # row offsets in int64: rows x N (and N x K) may pass 2**31 (an output head)
    rows_n = offs_n.to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    out = tl.sum(acc, axis=2)
    tl.store(out_ptr + rows_m[:, None] * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])
