"""Triton weight-only quantized linears match the torch references (int8 per channel, int4 in groups).

Runs on CUDA, or on CPU through the Triton interpreter when MG_TRITON_INTERPRET=1 (small shapes there).
Skips cleanly when triton is not importable.
"""

import pytest
import torch

from triton_setup import DEVICE, ON_CUDA, cuda_only, module_marks  # first: sets TRITON_INTERPRET

pytest.importorskip("triton")

from mg.kernels import quant  # noqa: E402
from mg.kernels import triton_quant as tq  # noqa: E402

pytestmark = module_marks(tq.available(), tq.reason)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within a rounding or two of the output dtype at the outputs' scale: the kernel sums the same products
    in another order (an output near zero after cancellation keeps the absolute error of the large ones)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    top = want.float().abs().max().item()
    rtol = 1e-5 if want.dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * top)


def _weights(n: int, k: int, group: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (1 + torch.rand(n, 1, generator=g))  # rows of different ranges
    q8, s8 = quant.quantize_int8(w)
    q4, s4, z4 = quant.quantize_int4(w, group)
    return ((q8.to(DEVICE), s8.to(dtype).to(DEVICE)),
            (q4.to(DEVICE), s4.to(dtype).to(DEVICE), z4.to(dtype).to(DEVICE), group))


SMALL = [(1, 96, 256, 32), (5, 64, 384, 128), (17, 40, 256, 64), (3, 200, 1024, 128), (64, 72, 512, 256),
         (4, 33, 512, 64), (2, 130, 768, 256)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,group", SMALL)
def test_quantized_linears_match_the_references(m, n, k, group, dtype):
    int8, int4 = _weights(n, k, group, dtype, seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    _close(tq.linear_int8_triton(x, *int8), quant.linear_int8_ref(x, *int8))
    _close(tq.linear_int4_triton(x, *int4), quant.linear_int4_ref(x, *int4))


def test_split_k_and_leading_dimensions():
    """A 3-D input keeps its leading dims; a plan that splits K gives the result of one that does not."""
    n, k = 64, 1024
    plan = tq.plan_linear(2, n, k, 128, 132)
    assert plan.split_k > 1 and plan.k_per_split % plan.block_k == 0
    int8, int4 = _weights(n, k, 128, torch.float32, seed=7)
    x = torch.randn(2, 3, k).to(DEVICE)
    got = tq.linear_int4_triton(x, *int4)
    assert got.shape == (2, 3, n)
    _close(got, quant.linear_int4_ref(x, *int4))
    _close(tq.linear_int8_triton(x, *int8), quant.linear_int8_ref(x, *int8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_dequantizes_every_element_as_documented(dtype, group):
    """One-hot rows of x read the dequantized weight back exactly (each output is one product with 1.0, summed
    with exact zeros). The packed bf16 / fp16 path on CUDA rounds q * scale + zero once to x's dtype; the fp32
    path computes it in fp32 as the reference does (q * scale rounded, then + zero rounded), which CUDA's compiler
    may fuse into one multiply-add (one rounding: with bf16 / fp16 scales the product is exact and both agree).
    Checks every nibble's place (low, high; bytes of a 32-bit word) and both groups' scales."""
    n, k = 72, 256
    _, (q4, s4, z4, _) = _weights(n, k, group, dtype, seed=11)
    eye = torch.eye(k, dtype=dtype, device=DEVICE)
    got = tq.linear_int4_triton(eye, q4, s4, z4, group).T  # [n, k]: the dequantized weight as the kernel made it
    q = quant.unpack_int4(q4).double().reshape(n, k // group, group)
    once = (q * s4.double()[..., None] + z4.double()[..., None]).reshape(n, k).to(dtype)  # rounded once
    ref = quant.dequantize_int4(q4, s4, z4, group, dtype)
    if tq._packed_dequant(eye, s4, z4):
        assert torch.equal(got, once)
    elif ON_CUDA or dtype == torch.float32:  # each element one of the two roundings
        assert bool(((got == ref) | (got == once)).all())
        assert dtype == torch.float32 or torch.equal(once, ref)
    else:  # the interpreter's float-to-bf16/fp16 conversion truncates: within one unit in the last place
        torch.testing.assert_close(got, ref, rtol=2.0 ** -(7 if dtype == torch.bfloat16 else 10), atol=0)


@pytest.mark.parametrize("x_dtype,scale_dtype", [(torch.bfloat16, torch.float16), (torch.bfloat16, torch.float32),
                                                  (torch.float16, torch.bfloat16)])
def test_int4_scales_of_another_dtype_than_x_dequantize_in_fp32(x_dtype, scale_dtype):
    """The packed path reads scales and zeros as pairs of x's dtype: with another dtype the kernel takes the
    fp32 path, and the result matches the reference."""
    _, (q4, s4, z4, group) = _weights(64, 256, 64, torch.float32, seed=4)
    s4, z4 = s4.to(scale_dtype), z4.to(scale_dtype)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)).to(x_dtype).to(DEVICE)
    assert tq._packed_dequant(x, s4, z4) == ""
    _close(tq.linear_int4_triton(x, q4, s4, z4, group), quant.linear_int4_ref(x, q4, s4, z4, group))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_row_gets_the_same_result_alone_and_in_a_batch(dtype):
    """The split and the order of a row's sums depend on the weight's shape only: up to 16 rows (one tile
    shape) a row's result is the same bits alone or batched (greedy tokens of one sequence should not depend
    on who shares its step; DFlash verifies 16 rows where a plain step runs one)."""
    int8, int4 = _weights(128, 512, 64, dtype, seed=3)
    x = torch.randn(16, 512).to(dtype).to(DEVICE)
    for fn, w in ((tq.linear_int8_triton, int8), (tq.linear_int4_triton, int4)):
        batch = fn(x, *w)
        for i in (0, 9, 15):
            assert torch.equal(fn(x[i:i + 1], *w)[0], batch[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 96, 256), (5, 64, 384), (17, 40, 200), (40, 130, 768)])
def test_float_linear_matches_torch(m, n, k, dtype):
    """Float weights through the same kernel: `x @ w^T` as torch computes it, up to the order of the sums; a
    transposed view of a wider weight (rows not adjacent) too."""
    g = torch.Generator().manual_seed(m * 100 + n)
    w = (torch.randn(n, k + 8, generator=g)[:, :k]).to(dtype).to(DEVICE)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    _close(tq.linear_float_triton(x, w), (x.float() @ w.float().T).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_linear_gives_a_row_the_same_bits_whatever_the_rows_beside_it(dtype):
    """One tile shape for every row count (`plan_float` reads N and K only), split K included: a row's result is
    the same bits alone, among 16 rows (a DFlash verify) or among 80 (several tiles of rows)."""
    n, k = 96, 1024
    assert tq.plan_float(n, k, 132).split_k > 1
    g = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=g).to(dtype).to(DEVICE)
    x = torch.randn(80, k, generator=g).to(dtype).to(DEVICE)
    batch = tq.linear_float_triton(x, w)
    for rows in (x[:16], x[16:19]):
        part = tq.linear_float_triton(rows, w)
        assert torch.equal(part, batch[:16] if rows.shape[0] == 16 else batch[16:19])
    for i in (0, 15, 16, 79):
        assert torch.equal(tq.linear_float_triton(x[i:i + 1], w)[0], batch[i])


def test_bad_arguments_are_refused_in_one_line():
    int8, int4 = _weights(64, 256, 64, torch.float32, seed=1)
    x = torch.randn(2, 256).to(DEVICE)
    with pytest.raises(ValueError, match="input columns"):
        tq.linear_int8_triton(x[:, :128], *int8)
    with pytest.raises(ValueError, match="group_size"):
        tq.linear_int4_triton(x, *int4[:3], 96)
    _, int4_16 = _weights(64, 256, 16, torch.float32, seed=1)  # below the tile the kernel's dot needs
    with pytest.raises(ValueError, match="group_size must be a power of two >= 32"):
        tq.linear_int4_triton(x, *int4_16)
    with pytest.raises(ValueError, match="weight_q must be"):
        tq.linear_int4_triton(x, int8[0], *int4[1:])
    w = torch.randn(64, 256).to(DEVICE)
    with pytest.raises(ValueError, match="contiguous rows"):
        tq.linear_float_triton(x, w.T.contiguous().T)
    with pytest.raises(ValueError, match="share a float dtype"):
        tq.linear_float_triton(x, w.bfloat16())


def test_the_cuda_kernel_table_serves_long_calls_with_the_reference():
    """`quant.kernels(cuda)` sends calls beyond MAX_ROWS rows to the reference; both agree."""
    table = quant.kernels(torch.device("cuda"))
    int8, int4 = _weights(64, 256, 64, torch.float32, seed=2)
    for rows in (3, tq.MAX_ROWS + 5):
        x = torch.randn(rows, 256).to(DEVICE)
        _close(table["mg::linear_int8"](x, *int8), quant.linear_int8_ref(x, *int8))
        _close(table["mg::linear_int4"](x, *int4), quant.linear_int4_ref(x, *int4))


@cuda_only
@pytest.mark.parametrize("m", [1, 8, 16, 100])
def test_real_width_shapes(m):
    """An MG-30B-wide projection (6656 -> 19968 is too large for a test; 6656 -> 2048 keeps the shape class)."""
    for dtype in (torch.bfloat16, torch.float16):
        int8, int4 = _weights(2048, 6656, 128, dtype, seed=m)
        x = torch.randn(m, 6656, device=DEVICE).to(dtype)
        _close(tq.linear_int8_triton(x, *int8), quant.linear_int8_ref(x, *int8))
        _close(tq.linear_int4_triton(x, *int4), quant.linear_int4_ref(x, *int4))
        if m <= 16:  # the decode row of a DFlash verify: the same bits alone as among 16 rows
            for fn, w in ((tq.linear_int8_triton, int8), (tq.linear_int4_triton, int4)):
                assert torch.equal(fn(x[:1], *w), fn(torch.cat([x[:1], x[:1].expand(15, -1)]), *w)[:1])


# ------------------------------------------------------------------ torch's tensor-core int4 kernel (CUDA)


@cuda_only
@pytest.mark.parametrize("m,n,k,group", [(1, 96, 256, 32), (5, 64, 384, 128), (16, 2048, 6656, 128),
                                         (32, 200, 1024, 256), (3, 136, 512, 64)])
def test_tensor_core_int4_matches_the_reference(m, n, k, group):
    _, int4 = _weights(n, k, group, torch.bfloat16, seed=m + n)
    x = torch.randn(m, k, device=DEVICE).bfloat16()
    assert quant._tinygemm_serves(x, int4[0], group) == (m <= quant.TINYGEMM_MAX_ROWS)
    _close(quant._int4_tinygemm(x, *int4), quant.linear_int4_ref(x, *int4))
    _close(quant._int4_tinygemm(x.reshape(1, m, k), *int4), quant.linear_int4_ref(x, *int4).reshape(1, m, n))


@cuda_only
def test_tensor_core_int4_gives_a_row_the_same_bits_alone_and_in_a_batch():
    _, int4 = _weights(256, 1024, 128, torch.bfloat16, seed=5)
    x = torch.randn(32, 1024, device=DEVICE).bfloat16()
    batch = quant._int4_tinygemm(x, *int4)
    for i in (0, quant.TINYGEMM_MAX_ROWS - 1, 16, 31):
        assert torch.equal(quant._int4_tinygemm(x[i:i + 1], *int4)[0], batch[i])


@cuda_only
def test_the_cuda_table_sends_short_bfloat16_int4_calls_to_tensor_cores_once_laid_out():
    """With int4_tensor_cores, bfloat16 calls of up to TINYGEMM_MAX_ROWS rows build the tensor-core layout once
    per weight; float32 calls, longer calls and N not a multiple of the kernel's 8-column tiles keep the Triton
    kernel (no layout built); a CUDA graph capture never builds one (the conversion would be replayed), but
    replays one built before. Without int4_tensor_cores the table never builds one."""
    _, int4 = _weights(64, 256, 64, torch.bfloat16, seed=9)
    x = torch.randn(2, 256, device=DEVICE).bfloat16()
    _close(quant.kernels(torch.device("cuda"))["mg::linear_int4"](x, *int4), quant.linear_int4_ref(x, *int4))
    assert not hasattr(int4[0], "_mg_int4_cuda")
    table = quant.kernels(torch.device("cuda"), int4_tensor_cores=True)["mg::linear_int4"]
    weight_q = int4[0]
    for x in (torch.randn(3, 256, device=DEVICE),  # float32
              torch.randn(quant.TINYGEMM_MAX_ROWS + 1, 256, device=DEVICE).bfloat16()):
        _close(table(x, *int4), quant.linear_int4_ref(x, *int4))
    assert not hasattr(weight_q, "_mg_int4_cuda")
    _, int4_60 = _weights(60, 256, 64, torch.bfloat16, seed=9)
    x = torch.randn(2, 256, device=DEVICE).bfloat16()
    _close(table(x, *int4_60), quant.linear_int4_ref(x, *int4_60))
    assert not hasattr(int4_60[0], "_mg_int4_cuda")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert not quant._tinygemm_serves(x, weight_q, 64)
        torch.zeros(1, device=DEVICE)  # a graph with no node draws a warning
    _close(table(x, *int4), quant.linear_int4_ref(x, *int4))
    layout = weight_q._mg_int4_cuda
    _close(table(x, *int4), quant.linear_int4_ref(x, *int4))
    assert weight_q._mg_int4_cuda is layout
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert quant._tinygemm_serves(x, weight_q, 64)
        y = table(x, *int4)
    graph.replay()
    _close(y, quant.linear_int4_ref(x, *int4))
