"""Weight-only quantized linears: the `mg::` op schemas, the quantizers, torch references and CPU kernels.

Schemes (docs/ARCHITECTURE.md, "Quantized weights"); W is the float weight [N, K] of `y = x W^T`:

- int8: per output channel, symmetric. `weight_q` int8 [N, K], `scale` [N] (the model's float dtype):
  W ~ weight_q * scale[:, None], with scale = max |W[n, :]| / 127.
- int4: per group of `group_size` consecutive input columns, asymmetric. `weight_q` uint8 [N, K / 2]
  (column 2j in the low nibble of byte j, column 2j + 1 in the high nibble), `scale` and `zero` [N, K / G]
  (float): W ~ q * scale + zero with q in [0, 15]; scale and zero fitted per group (`quantize_int4`).

`mg::linear_int8(x, weight_q, scale)` and `mg::linear_int4(x, weight_q, scale, zero, group_size)` compute
`x W~^T` for x [..., K]. Their registered implementation is the torch reference (dequantize, then a matmul
in x's dtype), unless the calling thread serves `mg::` ops with a table that names them (`ops.serving`):
the runtime binds the fast kernels that way. `kernels(cpu)` are torch's packed CPU kernels
(`_weight_int8pack_mm`, and `_weight_int4pack_mm_for_cpu` on a layout built once per weight at first use),
computing in bfloat16 (the only activation dtype they are fast with) and returning x's dtype; `kernels(cuda)`
are the Triton kernels of `triton_quant.py`, and on request (`int4_tensor_cores`) torch's tensor-core int4 kernel
(`_weight_int4pack_mm`, on a layout built once per weight at first use) for bfloat16 int4 calls of up to
`TINYGEMM_MAX_ROWS` rows (all equal to the references up to rounding).
Knows nothing about models, ExecuTorch or the runtime.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
import torch.nn.functional as F

from mg.manifests.constants import WEIGHTS_INT4 as SCHEME_INT4, WEIGHTS_INT8 as SCHEME_INT8

from . import ops
from .precision import cuda_fp32_matmuls

LINEAR_INT8 = "linear_int8"
LINEAR_INT4 = "linear_int4"

_INT8_ARGS = "Tensor x, Tensor weight_q, Tensor scale"
_INT4_ARGS = "Tensor x, Tensor weight_q, Tensor scale, Tensor zero, int group_size"
ops._lib.define(f"{LINEAR_INT8}({_INT8_ARGS}) -> Tensor")
ops._lib.define(f"{LINEAR_INT8}.out({_INT8_ARGS}, *, Tensor(a!) out) -> Tensor(a!)")
ops._lib.define(f"{LINEAR_INT4}({_INT4_ARGS}) -> Tensor")
ops._lib.define(f"{LINEAR_INT4}.out({_INT4_ARGS}, *, Tensor(a!) out) -> Tensor(a!)")


# ------------------------------------------------------------------ quantizers (export) and references


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a float weight [n, K] -> (int8 [n, K], scale [n] float32)."""
    w = w.float()
    scale = _int8_scale(w)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def _int8_scale(w: torch.Tensor) -> torch.Tensor:
    """Each row's symmetric int8 scale: max |w| / 127."""
    return w.abs().amax(dim=1).clamp(min=1e-12) / 127.0


# Shrink factors of a group's [min, max] tried by `quantize_int4` (1.0 first: plain min-max)
INT4_RANGES = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


# On the CPU, quantize_int4 works through a weight in blocks of rows of about this many bytes (float32): its
# ~50 element-wise passes then run in the caches, not memory (3-9x faster on a 2-core CPU at widths 384-19968,
# the same bits; BENCHMARKS.md).
INT4_CPU_BLOCK_BYTES = 2 << 20


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of a float weight [n, K] (K a multiple of `group_size`, which is even) -> (packed uint8 [n, K/2],
    scale [n, K/G] float32, zero [n, K/G] float32).

    Per group: for each range [min, max] * r (r in `INT4_RANGES`) the codes q = round((w - lo) / scale),
    then the scale and zero that fit `q * scale + zero` to w best for those codes (least squares); the r with
    the smallest squared error wins. Never worse than plain min-max (r = 1 refitted): on the embedded default
    (groups of 128) the mean |logit difference| to float fell from 0.145 to 0.136 (BENCHMARKS.md). Rows are
    independent: on the CPU they go in blocks of `INT4_CPU_BLOCK_BYTES`, elsewhere all at once."""
    n, k = w.shape
    rows = max(1, INT4_CPU_BLOCK_BYTES // (4 * k)) if w.device.type == "cpu" else n
    if n <= rows:
        return _quantize_int4_rows(w, group_size)
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(n, k // group_size, dtype=torch.float32, device=w.device)
    zero = torch.empty_like(scale)
    for lo in range(0, n, rows):
        packed[lo:lo + rows], scale[lo:lo + rows], zero[lo:lo + rows] = _quantize_int4_rows(w[lo:lo + rows],
                                                                                           group_size)
    return packed, scale, zero


def _quantize_int4_rows(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_int4` of all rows of `w` at once."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    lo0, hi0 = groups.amin(dim=2), groups.amax(dim=2)
    total = groups.sum(dim=2)
    spread = groups.square().sum(dim=2) - total * total / group_size  # sum of (w - mean)^2
    best_err = best_r = None
    for r in INT4_RANGES:
        q = _int4_codes(groups, lo0 * r, hi0 * r)
        # The least-squares fit of w by q * scale + zero leaves spread - cov^2 / var (sums over the group).
        _, var, cov = _fit_sums(q, groups, total)
        err = spread - cov * cov / var.clamp(min=1e-12)
        if best_err is None:
            best_err, best_r = err, torch.full_like(err, r)
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_r = torch.where(better, r, best_r)
    q = _int4_codes(groups, lo0 * best_r, hi0 * best_r)
    q_sum, var, cov = _fit_sums(q, groups, total)
    # A group whose codes are all equal (a constant group) keeps its min-max step; zero then fits the mean.
    scale = torch.where(var > 1e-6, cov / var.clamp(min=1e-12), ((hi0 - lo0) / 15.0).clamp(min=1e-12))
    zero = (total - scale * q_sum) / group_size
    return pack_int4(q.to(torch.uint8).reshape(n, k)), scale, zero


def _int4_codes(groups: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 15] (float) of `groups` [n, G', G] on the ranges [lo, hi] [n, G']."""
    step = ((hi - lo) / 15.0).clamp(min=1e-12)
    return torch.round((groups - lo[..., None]) / step[..., None]).clamp_(0, 15)


def _fit_sums(q: torch.Tensor, groups: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per group of codes `q` for `groups` (`total`: the groups' sums): sum q, sum (q - mean q)^2 and
    sum (q - mean q) w, what the least-squares scale (cov / var) and its error need."""
    g = groups.shape[2]
    q_sum = q.sum(dim=2)
    var = q.square().sum(dim=2) - q_sum * q_sum / g
    cov = (q * groups).sum(dim=2) - q_sum * total / g
    return q_sum, var, cov


def gptq_factor(hessian: torch.Tensor, damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """What `gptq` needs of E[x x^T] [K, K] of a linear's inputs, computed once per linear: the upper Cholesky
    factor of its inverse (row i: how column i's rounding error moves the columns after it), after `damp`
    times the mean diagonal is added to the diagonal, and the columns no input reaches (their weights are
    taken as 0: int8 stores 0, int4 the code nearest to it)."""
    h = hessian.to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(damp * torch.diagonal(h).mean())
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    return hinv.float(), dead


GPTQ_SUB_BLOCK = 32  # columns whose errors are applied one by one; the rest of their block gets them as a product


def gptq(w: torch.Tensor, factor: tuple[torch.Tensor, torch.Tensor], scheme: str,
         group_size: int | None = None) -> tuple[torch.Tensor, ...]:
    """Rows of a float weight [n, K] quantized to `scheme`'s format (as `quantize_int8` / `quantize_int4`
    return it) by GPTQ: columns are rounded in order, and each column's rounding error is spread over the
    columns not yet rounded through `factor` (`gptq_factor` of E[x x^T] of the linear's inputs on calibration
    text), so that the layer's output error on such inputs, not the weights' own, is what gets small. Rows are
    independent: a row chunk gives the codes of the whole, up to rounding (the updates' matrix products may
    round differently with another number of rows, which can move a code at a near-tie and a scale's last bits). int4 groups take their scale and zero (the
    least-squares fit of `quantize_int4`) from their columns' error-updated weights when the group's turn
    comes; int8 keeps each row's symmetric scale of the original weights.

    Runs on w's device (`factor` there too). The weight is worked on transposed (a column is a contiguous row)
    and the errors travel in three steps:
    column by column within a sub-block of `GPTQ_SUB_BLOCK` columns, as one product to the rest of the block
    (a scale group for int4, 128 columns for int8), as one product to the columns after the block. The same
    sums as the column-by-column loop, in another order."""
    with cuda_fp32_matmuls(False):  # on CUDA its products in full precision, whatever the process set
        return _gptq(w, factor, scheme, group_size)


def _gptq(w: torch.Tensor, factor: tuple[torch.Tensor, torch.Tensor], scheme: str,
          group_size: int | None) -> tuple[torch.Tensor, ...]:
    hinv, dead = factor
    n, k = w.shape
    wt = torch.empty((k, n), dtype=torch.float32, device=w.device).copy_(w.t())  # [K, n], never w's storage
    wt.masked_fill_(dead[:, None], 0.0)
    block = group_size if scheme == SCHEME_INT4 else 128
    codes = torch.empty((k, n), dtype=torch.int8 if scheme == SCHEME_INT8 else torch.uint8, device=w.device)
    if scheme == SCHEME_INT8:
        s, z = _int8_scale(wt.t()), None
    else:
        scale4 = torch.empty((n, k // group_size), dtype=torch.float32, device=w.device)
        zero4 = torch.empty_like(scale4)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb, hb = wt[b0:b1], hinv[b0:b1, b0:b1]  # wb: a view, updated in place
        err = torch.empty_like(wb)
        if scheme == SCHEME_INT4:
            _, s_g, z_g = quantize_int4(wb.t(), group_size)
            s, z = s_g[:, 0].contiguous(), z_g[:, 0].contiguous()
            scale4[:, b0 // group_size], zero4[:, b0 // group_size] = s, z
        for s0 in range(0, b1 - b0, GPTQ_SUB_BLOCK):
            s1 = min(s0 + GPTQ_SUB_BLOCK, b1 - b0)
            for i in range(s0, s1):
                col = wb[i]
                if z is None:
                    q = torch.round(col / s).clamp_(-127, 127)
                    deq = q * s
                else:
                    q = torch.round((col - z) / s).clamp_(0, 15)
                    deq = q * s + z
                codes[b0 + i] = q.to(codes.dtype)
                e = (col - deq) / hb[i, i]
                if i + 1 < s1:
                    wb[i + 1:s1] -= hb[i, i + 1:s1][:, None] * e[None, :]
                err[i] = e
            if s1 < b1 - b0:
                wb[s1:] -= hb[s0:s1, s1:].t() @ err[s0:s1]
        if b1 < k:
            wt[b1:] -= hinv[b0:b1, b1:].t() @ err
    if scheme == SCHEME_INT8:
        return codes.t().contiguous(), s
    return pack_int4(codes.t().contiguous()), scale4, zero4


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values in [0, 15] [n, K] -> [n, K/2]: column 2j low nibble, 2j + 1 high."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[n, K/2] uint8 -> [n, K] uint8 values in [0, 15]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def dequantize_int8(weight_q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight_q.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


def dequantize_int4(weight_q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    q = unpack_int4(weight_q).to(torch.float32)
    n, k = q.shape
    w = q.reshape(n, k // group_size, group_size) * scale.float()[..., None] + zero.float()[..., None]
    return w.reshape(n, k).to(dtype)


def linear_int8_ref(x: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequantize_int8(weight_q, scale, x.dtype))


def linear_int4_ref(x: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    return F.linear(x, dequantize_int4(weight_q, scale, zero, group_size, x.dtype))


# ------------------------------------------------------------------ registration


for _name, _ref in ((LINEAR_INT8, linear_int8_ref), (LINEAR_INT4, linear_int4_ref)):
    ops._lib.impl(_name, ops._dispatch(_name, False, _ref), "CompositeExplicitAutograd")
    ops._lib.impl(f"{_name}.out", ops._dispatch(_name, True, _ref), "CompositeExplicitAutograd")


def _linear_shape(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake(f"{ops.NAMESPACE}::{LINEAR_INT8}")
def _linear_int8_fake(x, weight_q, scale):
    return _linear_shape(x, weight_q.shape[0])


@torch.library.register_fake(f"{ops.NAMESPACE}::{LINEAR_INT8}.out")
def _linear_int8_out_fake(x, weight_q, scale, *, out):
    return out


@torch.library.register_fake(f"{ops.NAMESPACE}::{LINEAR_INT4}")
def _linear_int4_fake(x, weight_q, scale, zero, group_size):
    return _linear_shape(x, weight_q.shape[0])


@torch.library.register_fake(f"{ops.NAMESPACE}::{LINEAR_INT4}.out")
def _linear_int4_out_fake(x, weight_q, scale, zero, group_size, *, out):
    return out


def op_names() -> tuple[str, ...]:
    return tuple(f"{ops.NAMESPACE}::{n}" for n in (LINEAR_INT8, LINEAR_INT4))


# ------------------------------------------------------------------ CPU kernels


# torch's packed CPU kernels are fast with bfloat16 activations only (with float32 ones they take a slow path,
# 5-40x slower than a float32 matmul at these sizes, measured): they compute in bfloat16, whatever x is.
_CPU_COMPUTE = torch.bfloat16


def _int8_cpu(x: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).to(_CPU_COMPUTE)
    y = torch.ops.aten._weight_int8pack_mm(rows, weight_q, _cpu_scale(scale))
    return y.to(x.dtype).reshape(*x.shape[:-1], weight_q.shape[0])


def _cpu_scale(scale: torch.Tensor) -> torch.Tensor:
    """`scale` in the compute dtype, converted once per tensor (kept on it)."""
    cached = getattr(scale, "_mg_cpu", None)
    if cached is None:
        cached = scale.to(_CPU_COMPUTE)
        scale._mg_cpu = cached
    return cached


def _int4pack_scales_and_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """`scale` and `zero` [N, K/G] as torch's int4pack kernels (CPU and CUDA) take them: bfloat16 [K/G, N, 2].
    They dequantize as (q - 8) * s + z, so z = zero + 8 * scale."""
    sz = torch.stack((scale.float().t(), (zero.float() + 8 * scale.float()).t()), dim=-1)
    return sz.to(torch.bfloat16).contiguous()


def _int4_cpu_layout(weight_q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """The packed layout and scales/zeros of `_weight_int4pack_mm_for_cpu`, built once per weight and kept on
    the weight tensor."""
    cached = getattr(weight_q, "_mg_int4_cpu", None)
    if cached is None:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(weight_q).to(torch.int32), 1)
        cached = (packed, _int4pack_scales_and_zeros(scale, zero).to(_CPU_COMPUTE))
        weight_q._mg_int4_cpu = cached
    return cached


def _int4_cpu(x: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              group_size: int) -> torch.Tensor:
    packed, sz = _int4_cpu_layout(weight_q, scale, zero)
    rows = x.reshape(-1, x.shape[-1]).to(_CPU_COMPUTE)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group_size, sz)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight_q.shape[0])


# ------------------------------------------------------------------ CUDA kernels


# With `int4_tensor_cores`, bfloat16 int4 calls of at most this many rows go to torch's tensor-core int4 kernel
# (`_weight_int4pack_mm`, "tinygemm"). On the H200 (one MG-30B layer's linears, scripts/bench_quant.py) it
# takes 0.54x the bf16 time at one row where the Triton kernel takes 0.89x, still wins at 4 rows, and loses
# from 8 (its time grows with the rows); longer calls go to the Triton kernel (up to `triton_quant.MAX_ROWS`)
# or the reference.
TINYGEMM_MAX_ROWS = 4
TINYGEMM_GROUPS = (32, 64, 128, 256)


@functools.cache
def _tensor_cores(index: int) -> bool:
    """The tensor-core int4 kernel needs compute capability 8.0 (Ampere) or newer."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _tinygemm_serves(x: torch.Tensor, weight_q: torch.Tensor, group_size: int) -> bool:
    """Whether `_int4_tinygemm` takes this call: bfloat16 activations (the kernel's only dtype; float32 and
    float16 callers keep the Triton kernel's numerics), a group size it knows, N a multiple of its 8-column
    tiles, at most `TINYGEMM_MAX_ROWS` rows, and a layout already built or buildable (not while a CUDA graph
    captures: the conversion would be captured and rerun at every replay; the runtime's warm-up runs first)."""
    return (x.dtype == torch.bfloat16 and group_size in TINYGEMM_GROUPS and weight_q.shape[0] % 8 == 0
            and x.numel() // x.shape[-1] <= TINYGEMM_MAX_ROWS and _tensor_cores(x.device.index or 0)
            and (hasattr(weight_q, "_mg_int4_cuda") or not torch.cuda.is_current_stream_capturing()))


def _int4_cuda_layout(weight_q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """The tensor-core layout of `_weight_int4pack_mm` and its scales/zeros, built once per weight on its device
    and kept on the weight tensor (as many bytes again as `weight_q`, plus the scales). That kernel reads
    column 2j from the high nibble (the stored layout has it in the low one)."""
    cached = getattr(weight_q, "_mg_int4_cuda", None)
    if cached is None:
        k = 2 * weight_q.shape[1]
        inner_k_tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
        swapped = ((weight_q & 0xF) << 4) | (weight_q >> 4)
        packed = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), inner_k_tiles)
        cached = (packed, _int4pack_scales_and_zeros(scale, zero))
        weight_q._mg_int4_cuda = cached
    return cached


def _int4_tinygemm(x: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """`linear_int4_ref` for bfloat16 x by torch's tensor-core int4 kernel. Each output sums its row's products
    in an order fixed by K alone, so a row's result does not depend on the rows batched with it."""
    packed, sz = _int4_cuda_layout(weight_q, scale, zero)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.aten._weight_int4pack_mm(rows, packed, group_size, sz)
    return y.reshape(*x.shape[:-1], weight_q.shape[0])


def _cuda(triton_fn: Callable, ref: Callable) -> Callable:
    """The Triton kernel for calls of at most `triton_quant.MAX_ROWS` rows (decode, verify, short chunks: the
    weight is read once, quantized); longer prefill chunks dequantize once and run one matmul, whose cost the
    rows share."""
    from . import triton_quant

    def run(x: torch.Tensor, *args):
        if x.numel() // x.shape[-1] <= triton_quant.MAX_ROWS:
            return triton_fn(x, *args)
        return ref(x, *args)

    return run


def _int4_cuda(triton_int4: Callable) -> Callable:
    """int4 on CUDA: the tensor-core kernel where `_tinygemm_serves`, the Triton path otherwise."""

    def run(x: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int):
        if _tinygemm_serves(x, weight_q, group_size):
            return _int4_tinygemm(x, weight_q, scale, zero, group_size)
        return triton_int4(x, weight_q, scale, zero, group_size)

    return run


def kernels(device: torch.device, int4_tensor_cores: bool = False) -> dict[str, Callable]:
    """The quantized linears' implementations for `device`, by qualified name: torch's packed kernels on CPU;
    on CUDA the Triton kernels of `triton_quant` (the references where Triton cannot run, said once in the
    log), and with `int4_tensor_cores` torch's tensor-core int4 kernel for short bfloat16 int4 calls
    (`_tinygemm_serves`; `RunConfig.int4_tensor_cores` says what that costs in exactness); elsewhere the
    references."""
    names = op_names()
    if device.type == "cpu":
        return dict(zip(names, (_int8_cpu, _int4_cpu)))
    if device.type == "cuda":
        from . import triton_quant

        if triton_quant.available():
            int8, int4 = (_cuda(triton_quant.linear_int8_triton, linear_int8_ref),
                          _cuda(triton_quant.linear_int4_triton, linear_int4_ref))
        else:
            _say_no_triton(triton_quant.reason)
            int8, int4 = linear_int8_ref, linear_int4_ref
        return dict(zip(names, (int8, _int4_cuda(int4) if int4_tensor_cores else int4)))
    return dict(zip(names, (linear_int8_ref, linear_int4_ref)))


@functools.cache
def _say_no_triton(reason: str) -> None:
    """Once per process: CUDA serves the quantized linears with the references."""
    logging.getLogger("mg.runtime").warning(f"mg-run: Triton quantized linears unavailable ({reason}); quantized "
                                            f"linears on CUDA dequantize each weight per call (the references)")
