"""The greedy-token kernel (`mg.kernels.triton_argmax`) gives torch.argmax's index: the first of equal maxima, the
first NaN, over one tile or several, in every float dtype; `argmax_last` keeps torch's shapes and falls back to it.

Runs on CUDA, or on CPU through the Triton interpreter when MG_TRITON_INTERPRET=1.
"""

import pytest
import torch

from triton_setup import DEVICE, ON_CUDA, module_marks  # first: sets TRITON_INTERPRET

pytest.importorskip("triton")

from mg.kernels import triton_argmax as ta  # noqa: E402

pytestmark = module_marks(ta.available(), ta.reason)


def _logits(rows: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, n, generator=g) * 4).to(dtype).to(DEVICE)


@pytest.mark.parametrize("n", [4096, 1000, 7, 9000])  # one tile, a masked tile, a tiny row, three tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_torch_argmax(n, dtype):
    x = _logits(16, n, dtype, seed=n)
    assert torch.equal(ta.argmax_rows_triton(x), x.argmax(dim=-1))


def test_ties_nan_and_infinities_go_where_torch_puts_them():
    """Equal maxima within a tile and across tiles: the first column; a row with NaN: its first NaN; a row of
    -inf: column 0; +inf beats every finite value."""
    n = 9000  # three tiles of 4096
    x = torch.full((7, n), -1.0)
    x[0, [5, 17, 4000]] = 3.0                 # ties in one tile
    x[1, [4100, 8200]] = 3.0                  # ties in later tiles: the earlier tile wins
    x[1, 4099] = 2.0
    x[2, 8999] = 5.0                          # the last column (a masked tile's last live column)
    x[3, [10, 5000]] = float("nan")           # NaN wins, the first one
    x[3, 20] = float("inf")
    x[4] = float("-inf")                      # all -inf: column 0
    x[5, 6000] = float("inf")
    x[6, 4096] = 1.0                          # the first column of the second tile
    x = x.to(DEVICE)
    want = x.argmax(dim=-1)
    assert want.tolist() == [5, 4100, 8999, 10, 0, 6000, 4096]  # torch's rules, stated
    assert torch.equal(ta.argmax_rows_triton(x), want)
    assert torch.equal(ta.argmax_rows_triton(x.bfloat16()), x.bfloat16().argmax(dim=-1))


def test_strided_rows_and_refusals():
    """Rows of a wider tensor (the first rows of a padded logits buffer, or a column slice) are read in place;
    a non-contiguous last dim, an integer dtype or a row over MAX_COLS is refused in one line."""
    wide = _logits(6, 300, torch.float32, seed=1)
    assert torch.equal(ta.argmax_rows_triton(wide[:4, :200]), wide[:4, :200].argmax(dim=-1))
    assert ta.argmax_rows_triton(wide[:0]).shape == (0,)
    for bad in (wide.t(), wide.long(), torch.zeros(1, ta.MAX_COLS + 1, device=DEVICE)):
        with pytest.raises(ValueError, match="must be"):
            ta.argmax_rows_triton(bad)


@pytest.mark.skipif(not ON_CUDA, reason="argmax_last takes the kernel for CUDA tensors only")
def test_argmax_last_keeps_torch_shapes_on_cuda():
    x = _logits(24, 4096, torch.float32, seed=3)
    for t in (x, x[:5], x.view(2, 12, 4096), x[0], x.view(4, 6, 4096)[:, :3]):
        assert torch.equal(ta.argmax_last(t), t.argmax(dim=-1))
    wide = torch.randn(2, ta.MAX_COLS + 7, device=DEVICE)  # torch's reduction
    assert torch.equal(ta.argmax_last(wide), wide.argmax(dim=-1))


def test_argmax_last_is_torch_off_cuda(monkeypatch):
    """A CPU tensor never reaches the kernel (the interpreter would run it, slowly): torch's argmax serves it."""
    def launched(rows):
        raise AssertionError("the kernel was launched for a CPU tensor")

    monkeypatch.setattr(ta, "_launch", launched)
    x = torch.randn(3, 50)
    assert torch.equal(ta.argmax_last(x), x.argmax(dim=-1))
