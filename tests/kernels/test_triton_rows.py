"""The few-rows float linear (`mg.kernels.triton_rows`) matches torch and gives a row the same bits in every call.

Runs on CUDA, or on CPU through the Triton interpreter when MG_TRITON_INTERPRET=1 (small shapes there).
"""

import pytest
import torch

from triton_setup import DEVICE, ON_CUDA, module_marks  # first: sets TRITON_INTERPRET

pytest.importorskip("triton")

from mg.kernels import triton_rows as tr  # noqa: E402

pytestmark = module_marks(tr.available(), tr.reason)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    top = want.float().abs().max().item()
    rtol = 1e-5 if want.dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * top)


def _data(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("m,n,k", [(1, 96, 384), (3, 40, 130), (16, 24, 1152), (20, 9, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_torch(m, n, k, dtype):
    x, w = _data(m, n, k, dtype, seed=m + n)
    _close(tr.linear_rows_triton(x, w), (x.float() @ w.float().T).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_whatever_the_rows_beside_it(dtype):
    """A row's sums run in an order set by K's tiling alone: the same bits alone, among 2, 3, 8, 16 or 40 rows
    (every row tile, and three tiles of 16), with either tile shape `plan_rows` picks (and a K that is no
    multiple of the tile)."""
    for n, k in ((24, 640), (1200, 200)) if ON_CUDA else ((24, 200), (1200, 72)):
        x, w = _data(40, n, k, dtype, seed=5)
        full = tr.linear_rows_triton(x, w)
        for rows in (1, 2, 3, 8, 16):  # every row tile: 1, 2, 4, 8, 16
            assert torch.equal(tr.linear_rows_triton(x[:rows], w), full[:rows])
        for i in (0, 17, 39):
            assert torch.equal(tr.linear_rows_triton(x[i:i + 1], w)[0], full[i])


def test_leading_dimensions_and_a_weight_view():
    """x [..., K] keeps its leading dimensions; a weight whose rows are strided (the first K columns of a wider
    tensor) is read in place."""
    x, wide = _data(6, 24, 128, torch.float32, seed=7)
    x, w = x[:, :96].contiguous(), wide[:, :96]
    assert w.stride(0) == 128
    _close(tr.linear_rows_triton(x.view(2, 3, 96), w), (x @ w.T).view(2, 3, 24))


def test_plan_widens_programs_only_where_they_would_be_many():
    """4 columns by 128 of K a program, 8 by 64 where 4-column programs would outnumber WIDE_PROGRAMS per SM (the
    embedded default on a 132-SM GPU: its gate/up projection and head); the accumulator stays 512 a row."""
    narrow, wide = tr.plan_rows(1024, 384, 132), tr.plan_rows(2304, 384, 132)
    assert (narrow.block_n, narrow.block_k) == (4, 128) and (wide.block_n, wide.block_k) == (8, 64)
    assert tr.plan_rows(2304, 384, 300) == narrow


def test_bad_arguments_are_refused_in_one_line():
    x, w = _data(2, 8, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match="share a float dtype"):
        tr.linear_rows_triton(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"strides \(1, 8\)"):  # [8, 64] whose columns, not rows, are contiguous
        tr.linear_rows_triton(x, w.T.contiguous().T)
    with pytest.raises(ValueError, match=r"K = 64"):
        tr.linear_rows_triton(x, w[:, :32].contiguous())
    if ON_CUDA:
        with pytest.raises(ValueError, match="weight is on cpu"):
            tr.linear_rows_triton(x, w.cpu())
