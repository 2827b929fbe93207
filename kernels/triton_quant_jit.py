"""Triton kernel (only the `@triton.jit` body) of the weight-only quantized linears `y = x W~^T` (and of float
weights, read as the int8 path reads its integers, without a scale: `triton_quant.linear_float_triton`).

Imports triton unconditionally: import it through `mg.kernels.triton_quant`, which checks availability,
plans the launch and validates arguments. Storage layouts: `mg.kernels.quant`.

A program owns a tile of `BLOCK_M` rows of x by `BLOCK_N` output columns and one of `SPLIT_K` equal slices
of the input dimension. Per `BLOCK_K` columns it loads the quantized weight tile (int8 [BLOCK_N, BLOCK_K],
or int4 as [BLOCK_N, BLOCK_K / 2] bytes whose two nibbles are adjacent columns) and accumulates in fp32 with
`tl.dot`. int8: the integers converted exactly to x's dtype, `x q^T` summed exactly in fp32, the channel's
scale applied once at the end (the reference rounds the dequantized weight to x's dtype first: results
differ by that rounding). int4: dequantized, then one dot (on the H200 that measured faster than exact
integer dots with per-tile scales, whose interleave of 16-bit values cost more than the multiplies it saved):
- on CUDA with bf16 or fp16 activations (`PACKED`), two elements per instruction by inline PTX
  (`DEQUANT_ASM`): a byte permute and a logic op put two nibbles into the low mantissa bits of a pair of
  16-bit floats whose exponent makes them 128 + q (bf16) or 1024 + q (fp16); two paired fused multiply-adds
  give q, then q * scale + zero rounded once to x's dtype. The reference rounds q * scale + zero to fp32
  first: the two differ in the last bit where that double rounding does. H100, one MG-30B layer at one row:
  226 -> 173 us (BENCHMARKS.md, "What bounds the int4 kernel");
- otherwise per element in fp32 as the reference does (q * scale + zero, rounded to x's dtype; with fp32
  scales a fused multiply-add may round once where the reference rounds twice).
Either way a row's result does not depend on the rows beside it. The quantized weight is read once per row
tile: at decode (one row tile) each weight byte crosses the memory bus once. With `SPLIT_K` > 1 each slice
writes an fp32 partial [SPLIT_K, M, N] and the launcher sums them (a deterministic order, no atomics).

int4 tiles never straddle a scale group: `BLOCK_K` divides the group size, so a tile reads one scale and
one zero per output column.
"""

import triton
import triton.language as tl

# Four packed bytes ($4: columns 2j, 2j+1 of four bytes j) -> their low nibbles ($0, $1) and high nibbles ($2,
# $3) as pairs of x's dtype, each q * scale + zero ($5, $6: the scales of bytes 0-1 and 2-3; $7, $8: the zeros).
# prmt orders the bytes 0, 2, 1, 3 so that one mask picks bytes 0 and 1 (shift 0 and 4: low and high nibbles)
# and, shifted by 8 and 12, bytes 2 and 3; lop3 (a & b) | c (0xEA) ORs in the exponent MAGIC.
_DEQUANT_TEMPLATE = """
{
.reg .b32 t, u, one, off, v0, v1, v2, v3;
mov.b32 one, ONE;
mov.b32 off, OFF;
prmt.b32 t, $4, $4, 0x3120;
lop3.b32 v0, t, 0x000F000F, MAGIC, 0xEA;
shr.u32 u, t, 4;
lop3.b32 v1, u, 0x000F000F, MAGIC, 0xEA;
shr.u32 u, t, 8;
lop3.b32 v2, u, 0x000F000F, MAGIC, 0xEA;
shr.u32 u, t, 12;
lop3.b32 v3, u, 0x000F000F, MAGIC, 0xEA;
fma.rn.TYPE v0, v0, one, off;
fma.rn.TYPE v1, v1, one, off;
fma.rn.TYPE v2, v2, one, off;
fma.rn.TYPE v3, v3, one, off;
fma.rn.TYPE $0, v0, $5, $7;
fma.rn.TYPE $1, v2, $6, $8;
fma.rn.TYPE $2, v1, $5, $7;
fma.rn.TYPE $3, v3, $6, $8;
}
"""
_CONSTANTS = {  # dtype -> (1.0 x2, -MAGIC's value x2, MAGIC x2, PTX type)
    "bfloat16": ("0x3F803F80", "0xC300C300", "0x43004300", "bf16x2"),  # 0x4300 = 128.0
    "float16": ("0x3C003C00", "0xE400E400", "0x64006400", "f16x2"),    # 0x6400 = 1024.0
}
DEQUANT_ASM = {dtype: _DEQUANT_TEMPLATE.replace("ONE", one).replace("OFF", off).replace("MAGIC", magic)
               .replace("TYPE", ty) for dtype, (one, off, magic, ty) in _CONSTANTS.items()}


@triton.jit(do_not_specialize=["M"])  # one compile per weight shape, whatever the batch's row count
def _linear_wq_kernel(
    x_ptr, wq_ptr, scale_ptr, zero_ptr, out_ptr,
    M, N, K, stride_wn, n_groups, stride_xm, stride_om, stride_os,
    K_PER_SPLIT: tl.constexpr, GROUP_SIZE: tl.constexpr, IS_INT4: tl.constexpr, SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr, PACKED: tl.constexpr, ASM: tl.constexpr,
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
        if IS_INT4:
            # A tile lies inside K or (the last slice's) wholly past it, so the masks are uniform along a row and
            # the loads vectorize; `stride_wn` = K / 2, an argument so that its divisibility is known.
            in_k = k0 < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & in_k,
                        other=0.0)
            offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            in_n = mask_n & in_k
            packed = tl.load(wq_ptr + rows_n[:, None] * stride_wn + offs_j[None, :], mask=in_n[:, None], other=0)
            group = k0 // GROUP_SIZE
            s = tl.load(scale_ptr + offs_n * n_groups + group, mask=in_n, other=0.0)
            z = tl.load(zero_ptr + offs_n * n_groups + group, mask=in_n, other=0.0)
            if PACKED:  # two elements per instruction (module docstring); column 2j low nibble, 2j + 1 high
                lo, hi = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r,r,r,r", [packed, s[:, None], z[:, None]],
                                                   dtype=(x_ptr.dtype.element_ty, x_ptr.dtype.element_ty),
                                                   is_pure=True, pack=4)
                w = tl.join(lo, hi).reshape(BLOCK_N, BLOCK_K)
            else:  # in fp32 per element as the reference does (q * scale + zero, rounded to x's dtype; the
                   # compiler may fuse the multiply-add: one rounding where the reference rounds twice)
                q = tl.join(packed & 0xF, packed >> 4).reshape(BLOCK_N, BLOCK_K)
                w = q.to(tl.float32) * s.to(tl.float32)[:, None] + z.to(tl.float32)[:, None]
                w = w.to(x_ptr.dtype.element_ty)
        else:
            mask_k = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            # int8: |q| <= 127 is exact in x's dtype: the dots sum x * q in fp32, the channel's scale applies at
            # the end (`SCALED`). A float weight (not `SCALED`) is x's dtype already.
            q = tl.load(wq_ptr + rows_n[:, None] * stride_wn + offs_k[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0)
            w = q.to(tl.float32) if UPCAST_DOT else q.to(x_ptr.dtype.element_ty)
        if UPCAST_DOT:  # interpreter only: its bf16 tl.dot is wrong; the same values widened to fp32
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    if SCALED:
        acc *= tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
