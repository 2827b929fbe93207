"""Greedy tokens on CUDA: `argmax_last(x)` = `torch.argmax(x, dim=-1)`, by a Triton kernel where it serves the
shape (kernel: `triton_argmax_jit.py`), torch's reduction elsewhere.

What it is for: each greedy decode step takes the argmax of its logits rows, and a fused DFlash round two (the
drafts' and the target's), over a vocabulary of a few thousand columns for a handful of rows. torch's CUDA
reduction runs such a call as a multi-pass reduction: on an H100, 3.5 / 8.9 / 14.8 us for 1 / 8 / 16 rows of
4096 float32 logits, where a prototype of this kernel took 1.9-2.1 us (BENCHMARKS.md; `scripts/bench_argmax.py`
times both). The result is the same
index: the first of equal maxima, the first NaN of a row that has one (an argmax is exact, so which of the two
computes it never changes a token). Rows wider than `MAX_COLS` (a real vocabulary of 200k columns would be read
by one program per row) and everything off CUDA go to torch. Launches depend only on shapes, so CUDA graphs
capture them. Knows nothing about models or the runtime.
"""

from __future__ import annotations

import torch

from . import triton_attention

reason: str = triton_attention.reason  # "" when Triton kernels can run here
available = triton_attention.available
if not reason:
    from . import triton_argmax_jit as _jit

BLOCK = 4096        # columns a program reduces at once
MAX_COLS = 32768    # wider rows: torch's reduction (several programs per row)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def argmax_rows_triton(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of x [rows, n] (float32, bfloat16 or float16, contiguous along n, n <= MAX_COLS) as
    int64 [rows], on x's device."""
    if not available():
        raise RuntimeError(f"Triton argmax is unavailable: {reason}")
    if x.dim() != 2 or not _fits(x):
        raise ValueError(f"x must be [rows, n] float32/bfloat16/float16 with a contiguous last dim and "
                         f"1 <= n <= {MAX_COLS}; got {tuple(x.shape)} {x.dtype} strides {tuple(x.stride())}")
    return _launch(x)


def _fits(x: torch.Tensor) -> bool:
    """Rows the kernel takes (x at least 1-D): a float dtype it reads, the last dim contiguous, 1..MAX_COLS wide."""
    return x.dtype in _DTYPES and x.stride(-1) == 1 and 0 < x.shape[-1] <= MAX_COLS


def _launch(x: torch.Tensor) -> torch.Tensor:
    """The kernel on rows `argmax_rows_triton` (or `argmax_last`, on its hot path) has already checked."""
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows:
        _jit._argmax_rows_kernel[(rows,)](x, out, n, x.stride(0), **argmax_meta(n))
    return out


def argmax_meta(n: int) -> dict:
    """`_argmax_rows_kernel`'s compile-time arguments and launch options for rows of n columns."""
    block = min(BLOCK, 1 << (n - 1).bit_length())  # the next power of two, at most BLOCK
    return dict(BLOCK=block, CHUNKS=-(-n // block), num_warps=4 if block <= 2048 else 8)


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(x, dim=-1)`: by `argmax_rows_triton` for CUDA float tensors whose rows it takes (the last dim
    contiguous and at most MAX_COLS wide, the leading dims flattening to rows without a copy), else by torch."""
    if x.is_cuda and not reason and x.dim() and _fits(x):
        n = x.shape[-1]
        try:
            rows = x.view(-1, n)
        except RuntimeError:  # leading dims not viewable as rows
            return x.argmax(dim=-1)
        return _launch(rows).view(x.shape[:-1])
    return x.argmax(dim=-1)
