"""Triton kernel (only the `@triton.jit` body) of the weight-only quantized linears `y = x W~^T`.

Imports triton unconditionally: import it through `mg.kernels.triton_quant`, which checks availability,
plans the launch and validates arguments. Storage layouts: `mg.kernels.quant`.

A program owns a tile of `BLOCK_M` rows of x by `BLOCK_N` output columns and one of `SPLIT_K` equal slices
of the input dimension. Per `BLOCK_K` columns it loads the quantized weight tile (int8 [BLOCK_N, BLOCK_K],
or int4 as [BLOCK_N, BLOCK_K / 2] bytes whose two nibbles are adjacent columns) and accumulates in fp32 with
`tl.dot`. int8: the integers converted exactly to x's dtype, `x q^T` summed exactly in fp32, the channel's
scale applied once at the end (the reference rounds the dequantized weight to x's dtype first: results
differ by that rounding). int4: dequantized per element in fp32 exactly as the reference does (q * scale +
zero, rounded to x's dtype), then one dot: on the H200 that measured faster than exact integer dots with
per-tile scales, whose interleave of 16-bit values cost more than the multiplies it saved. The quantized weight is read once per row tile: at decode
(one row tile) each weight byte crosses the memory bus once. With `SPLIT_K` > 1 each slice writes an fp32
partial [SPLIT_K, M, N] and the launcher sums them (a deterministic order, no atomics).

int4 tiles never straddle a scale group: `BLOCK_K` divides the group size, so a tile reads one scale and
one zero per output column.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])  # one compile per weight shape, whatever the batch's row count
def _linear_wq_kernel(
    x_ptr, wq_ptr, scale_ptr, zero_ptr, out_ptr,
    M, N, K, n_groups, stride_xm, stride_om, stride_os,
    K_PER_SPLIT: tl.constexpr, GROUP_SIZE: tl.constexpr, IS_INT4: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = offs_n.to(tl.int64)  # weight row offsets: N * K may pass 2**31 (a quantized 202048 x 6656 head)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if IS_INT4:
            # Dequantized in fp32 per element as the reference does (q * scale + zero, rounded to x's dtype),
            # then one dot: on the H200 this ran at 0.90x the bf16 time where exact integer dots with scales
            # per tile (the int8 way) ran at 1.36x, their 16-bit interleave costing more than the multiplies.
            offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(wq_ptr + rows_n[:, None] * (K // 2) + offs_j[None, :],
                             mask=mask_n[:, None] & (offs_j[None, :] < K // 2), other=0)
            q = tl.join(packed & 0xF, packed >> 4).reshape(BLOCK_N, BLOCK_K)  # column 2j low, 2j + 1 high
            group = k0 // GROUP_SIZE
            in_k = mask_n & (k0 < K)  # the last slice may run past K
            s = tl.load(scale_ptr + offs_n * n_groups + group, mask=in_k, other=0.0).to(tl.float32)
            z = tl.load(zero_ptr + offs_n * n_groups + group, mask=in_k, other=0.0).to(tl.float32)
            w = (q.to(tl.float32) * s[:, None] + z[:, None]).to(x_ptr.dtype.element_ty)
        else:
            # |q| <= 127 is exact in x's dtype: the dots sum x * q in fp32, the channel's scale applies at the end
            q = tl.load(wq_ptr + rows_n[:, None] * K + offs_k[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0)
            w = q.to(tl.float32) if UPCAST_DOT else q.to(x_ptr.dtype.element_ty)
        if UPCAST_DOT:  # interpreter only: its bf16 tl.dot is wrong; the same values widened to fp32
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    if not IS_INT4:
        acc *= tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
