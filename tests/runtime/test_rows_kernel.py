"""Few-row float32 products on CUDA cores (`mg::rows_mm`, RunConfig.rows_kernel).

CPU: the setting (opt-in, CUDA only, row_invariant first), `rows_mm` = `torch.mm` off CUDA, the compiled trace
calls the served op. CUDA (skipped without a device): the runner's table serves `aten::mm` with it; on the
tiny preset's float32 artifact, a 16-row verify's logits match cuBLAS's within float32 rounding, and greedy
DFlash (fixed and adaptive) equals target-only, with methods interpreted and compiled.
"""

from __future__ import annotations

import pytest
import torch

from mg.kernels import linear
from mg.manifests import constants as C
from mg.runtime.artifact import load_artifact
from mg.runtime.compiled import MethodCompiler
from mg.runtime.config import RunConfig
from mg.runtime.engine import Engine
from mg.runtime.model_runner import ModelRunner
from mg.runtime.program_ops import MM
from mg.runtime.scheduler import Request


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_setting_is_opt_in_on_cuda_and_gives_way_to_row_invariant():
    assert RunConfig(device="cuda", rows_kernel=True).rows_mm and not RunConfig(device="cuda").rows_mm
    assert not RunConfig(device="cuda", rows_kernel=True, row_invariant=True).rows_mm  # row_mm serves every call
    assert not RunConfig(rows_kernel=True).rows_mm  # nothing changes on CPU


def test_rows_mm_is_torch_mm_off_cuda():
    a, b = torch.randn(5, 64), torch.randn(32, 64)
    assert not linear.serves_rows(a, b.T)
    assert torch.equal(linear.rows_op()(a, b.T), torch.mm(a, b.T))


def test_compiled_methods_trace_the_rows_op(tiny_seq_artifact, tmp_path):
    art = load_artifact(tiny_seq_artifact)
    runner = ModelRunner(art, RunConfig(pad_steps=True), with_draft=False)
    compiler = MethodCompiler(art.program, "test", torch.device("cpu"), cache_dir=tmp_path)
    gm, _ = compiler.trace(C.METHOD_FORWARD, "n", runner.plans[C.METHOD_FORWARD].blank(2),
                           {**runner.ops, MM: linear.rows_op()})
    assert "mg.rows_mm" in gm.code and "aten.mm" not in gm.code


# ------------------------------------------------------------------ CUDA

@pytest.fixture(scope="module")
def fp32_artifact(tiny_dflash_seq_artifact):
    """The tiny preset (float32) with its drafter, sequence layout: the session's export of it (only read here)."""
    return tiny_dflash_seq_artifact


def _forward_inputs(tokens, positions, slots):
    return [torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots), torch.arange(len(tokens))]


@needs_cuda
@pytest.mark.cuda
def test_a_verify_with_the_rows_kernel_matches_cublas(fp32_artifact):
    logits = {}
    for rows_kernel in (True, False):
        art = load_artifact(fp32_artifact, device="cuda")
        runner = ModelRunner(art, RunConfig(device="cuda", compile=False, rows_kernel=rows_kernel), with_draft=False)
        assert (runner.ops.get(MM) is linear.rows_op()) == rows_kernel
        tokens = [5 + (7 * i) % 200 for i in range(16)]
        out = runner.call(C.METHOD_FORWARD, _forward_inputs(tokens, list(range(16)), [0] * 16), [16, 16])
        logits[rows_kernel] = out[0][:16].float().clone()
    top = logits[False].abs().max().item()
    # float32 sums in other orders through 6 layers: within 1e-4 of the largest logit (an H100: 1.1e-5)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4 * top)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("compile_", [False, True])
def test_greedy_dflash_with_the_rows_kernel_equals_target_only(fp32_artifact, compile_):
    vocab = load_artifact(fp32_artifact).manifest.model.vocab_size
    gen = torch.Generator().manual_seed(5)
    requests = [Request(f"r{i}", tuple(torch.randint(4, vocab, (n,), generator=gen).tolist()), 40)
                for i, n in enumerate((3, 17, 30))]
    runs = {}
    for name, cfg in (("target-only", dict(dflash=False)),
                      ("fixed", dict(speculation="fixed", rows_kernel=True)),
                      ("adaptive", dict(speculation="adaptive", rows_kernel=True))):
        engine = Engine(load_artifact(fp32_artifact, device="cuda"), RunConfig(device="cuda", compile=compile_, **cfg))
        runs[name] = [r.tokens for r in engine.run(requests)]
    assert runs["fixed"] == runs["target-only"] and runs["adaptive"] == runs["target-only"]
