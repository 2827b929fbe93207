"""Triton kernel (only the `@triton.jit` body) of `triton_argmax.argmax_rows_triton`: each row's index of its largest
value, as `torch.argmax(x, dim=-1)` gives it (the first of equal maxima; the first NaN where a row has one).

Imports triton unconditionally: import it through `mg.kernels.triton_argmax`, which checks availability and
arguments.

One program per row reads the row in `CHUNKS` tiles of `BLOCK` columns (one tile for vocabularies up to
`BLOCK`), each reduced to its maximum and the first column holding it; a later tile replaces the best so far only
when strictly larger, so ties go to the first column.
"""

import triton
import triton.language as tl


@triton.jit
def _argmax_rows_kernel(x_ptr, out_ptr, n_cols, stride_row, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    best_v = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int32)
    nan_i = tl.full((), 2147483647, tl.int32)  # the first NaN's column (none: int32 max)
    for c in tl.static_range(CHUNKS):
        cols = c * BLOCK + offs
        inside = cols < n_cols
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
        nan_i = tl.minimum(nan_i, tl.min(tl.where((x != x) & inside, cols, 2147483647), axis=0))
        v, i = tl.max(tl.where(x != x, float("-inf"), x), axis=0, return_indices=True,
                      return_indices_tie_break_left=True)
        better = v > best_v
        best_i = tl.where(better, c * BLOCK + i, best_i)
        best_v = tl.where(better, v, best_v)
    tl.store(out_ptr + row, tl.where(nan_i < 2147483647, nan_i, best_i).to(tl.int64))
