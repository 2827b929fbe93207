"""Row-invariant matrix products (`mg::row_mm`, RunConfig.row_invariant): a row's logits do not depend on the
rows sharing its call.

CPU: a caller's op table serves the program's `aten::mm` (and only where it has an entry), and the compiled
methods' trace calls the served op; the setting makes the CPU attention row-invariant, so with every linear
quantized (torch's packed kernels, row-invariant themselves) a row's logits are the same bits alone and in a
verify, where the default attention gives them other last bits. CUDA (skipped without a device): for float32 and bfloat16 artifacts, with
the methods interpreted or compiled, under CUDA graphs, the target's logits of a sequence's next row are the
same bits in a 1-row step as the first row of a 16-row DFlash verify, with rows of another sequence before it,
and greedy DFlash equals target-only on the bfloat16 artifact.
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

from conftest import DFLASH_SEQ, _export

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _forward_inputs(tokens: list[int], positions: list[int], slots: list[int]) -> list:
    n = len(tokens)
    return [torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots), torch.arange(n)]


def test_a_callers_table_serves_aten_mm(tiny_seq_artifact):
    art = load_artifact(tiny_seq_artifact)
    runner = ModelRunner(art, RunConfig(), with_draft=False)
    assert MM not in runner.ops  # CPU: torch's mm
    calls = []

    def counting(a, b):
        calls.append(a.shape[0])
        return torch.mm(a, b)

    inputs = [x for x in _forward_inputs([5, 6, 7], [0, 1, 2], [0, 0, 0])]
    runner.cache.declare_step(inputs[1], inputs[2])
    plain = art.program.run(C.METHOD_FORWARD, inputs, ops=runner.ops)
    served = art.program.run(C.METHOD_FORWARD, inputs, ops={**runner.ops, MM: counting})
    n_layers = art.manifest.model.n_layers
    assert len(calls) >= 4 * n_layers + 1 and set(calls) == {3}  # every linear of every layer, and the head
    assert torch.equal(plain[0], served[0])
    assert RunConfig(device="cuda", row_invariant=True).row_invariant_mm and not RunConfig(device="cuda") \
        .row_invariant_mm and not RunConfig(row_invariant=True).row_invariant_mm


def test_compiled_methods_trace_the_served_product(tiny_seq_artifact, tmp_path):
    """The trace calls `mg::row_mm` where the table serves `aten::mm` with it (and `aten.mm` otherwise), and
    the compile cache keys the two apart."""
    art = load_artifact(tiny_seq_artifact)
    runner = ModelRunner(art, RunConfig(pad_steps=True), with_draft=False)
    compiler = MethodCompiler(art.program, "test", torch.device("cpu"), cache_dir=tmp_path)
    blank = runner.plans[C.METHOD_FORWARD].blank(2)
    codes = {}
    for served in (False, True):
        table = {**runner.ops, MM: linear.op()} if served else dict(runner.ops)
        gm, _ = compiler.trace(C.METHOD_FORWARD, "n", blank, table)
        codes[served] = gm.code
    assert "mg.row_mm" in codes[True] and "aten.mm" not in codes[True]
    assert "aten.mm" in codes[False] and "row_mm" not in codes[False]


def test_row_mm_is_torch_mm_off_cuda():
    a, b = torch.randn(5, 64), torch.randn(32, 64)
    assert not linear.serves(a, b.T)
    assert torch.equal(linear.op()(a, b.T), torch.mm(a, b.T))


@pytest.fixture(scope="module")
def int4_head_artifact(tmp_path_factory):
    """Every linear int4, the output head too: no float32 product left in the target's forward."""
    return _export(tmp_path_factory.mktemp("rowinv") / "int4", layout="sequence", max_seqs=3, max_context=96,
                   max_write=24, weights="int4", group_size=32, quantize_head=True)


def test_on_the_cpu_the_setting_makes_a_rows_logits_the_same_bits_alone_and_in_a_verify(int4_head_artifact):
    """Rows at positions 56-71 (across the attention's 64-key padding edge), alone, as the first row of 16, 8 and
    2, with rows of another sequence before them; the default attention's logits within bfloat16 rounding of them."""
    art = load_artifact(int4_head_artifact)
    context = [5 + (7 * i) % 200 for i in range(56)]
    logits = {}
    for invariant in (False, True):
        runner = ModelRunner(art, RunConfig(row_invariant=invariant), with_draft=False)
        assert runner.cache.row_invariant is invariant and MM not in runner.ops  # products stay torch's
        for lo, hi in ((0, 20), (20, 40), (40, 56)):
            runner.call(C.METHOD_FORWARD, _forward_inputs(context[lo:hi], list(range(lo, hi)), [0] * (hi - lo)),
                        [hi - lo, hi - lo])
        runner.call(C.METHOD_FORWARD, _forward_inputs(context[:4], list(range(4)), [1] * 4), [4, 4])
        logits[invariant] = [_next_row_logits(runner, context, 42, rows, other)
                             for rows, other in ((1, 0), (16, 0), (8, 3), (2, 1))]
    alone, *others = logits[True]
    for got in others:
        assert torch.equal(got, alone), (got - alone).abs().max().item()
    for got in logits[False]:  # the same function; its last bits, rounded to bfloat16 by the next linear, differ
        torch.testing.assert_close(got, alone, rtol=0, atol=0.05)


# ------------------------------------------------------------------ CUDA


@pytest.fixture(scope="module")
def bf16_dflash_artifact(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("rowinv") / "bfloat16", **DFLASH_SEQ, dtype="bfloat16")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dflash_artifact(request):
    """float32 is the tiny preset's own dtype: that export is the session's `tiny_dflash_seq_artifact` (only read
    here); bfloat16 the same export in bfloat16."""
    return request.getfixturevalue("tiny_dflash_seq_artifact" if request.param == "float32" else
                                   "bf16_dflash_artifact")


def _next_row_logits(runner: ModelRunner, context: list[int], token: int, rows: int, other: int) -> torch.Tensor:
    """Logits of `token` at position len(context) on slot 0, called with `other` rows of slot 1 before it and
    `rows - 1` made-up drafts after it."""
    p = len(context)
    cache = runner.cache
    tokens = [9] * other + [token] + [11 + i for i in range(rows - 1)]
    positions = list(range(other)) + list(range(p, p + rows))
    slots = [1] * other + [0] * rows
    cache.rewind(0, p)
    cache.rewind(1, 0)
    out = runner.call(C.METHOD_FORWARD, _forward_inputs(tokens, positions, slots), [len(tokens), len(tokens)])
    return out[0][other].clone()


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("compile_", [False, True])
def test_a_rows_logits_are_the_same_bits_alone_and_in_a_verify(dflash_artifact, compile_):
    art = load_artifact(dflash_artifact, device="cuda")
    runner = ModelRunner(art, RunConfig(device="cuda", compile=compile_, row_invariant=True), with_draft=False)
    assert runner.ops.get(MM) is linear.op()
    if compile_:  # one symbolic variant for every size: no one-row code of its own (docs/ARCHITECTURE.md 6.4)
        assert {v for _, v, what, _ in runner.compile_stats.events if what != "failed"} == {"n"}
    context = [5 + (7 * i) % 200 for i in range(20)]
    runner.call(C.METHOD_FORWARD, _forward_inputs(context, list(range(20)), [0] * 20), [20, 20])
    runner.call(C.METHOD_FORWARD, _forward_inputs(context[:4], list(range(4)), [1] * 4), [4, 4])
    alone = _next_row_logits(runner, context, 42, rows=1, other=0)
    for rows, other in ((16, 0), (8, 3), (2, 1)):
        got = _next_row_logits(runner, context, 42, rows=rows, other=other)
        assert torch.equal(got, alone), (rows, other, (got.float() - alone.float()).abs().max().item())


@needs_cuda
@pytest.mark.cuda
def test_greedy_dflash_equals_target_only_in_bfloat16(bf16_dflash_artifact):
    art_dir = bf16_dflash_artifact
    vocab = load_artifact(art_dir).manifest.model.vocab_size
    gen = torch.Generator().manual_seed(3)
    requests = [Request(f"r{i}", tuple(torch.randint(4, vocab, (n,), generator=gen).tolist()), 40)
                for i, n in enumerate((3, 17, 30))]
    runs = {}
    for dflash in (False, True):
        engine = Engine(load_artifact(art_dir, device="cuda"),
                        RunConfig(device="cuda", dflash=dflash, speculation="fixed", row_invariant=True))
        runs[dflash] = [r.tokens for r in engine.run(requests)]
    assert runs[True] == runs[False]
