"""Padded steps and CUDA-graph replays change nothing: same outputs as eager, same tokens as CPU.

CPU tests force the padding path (`pad_steps=True`): padding rows on the scratch slot must
never change a live row. CUDA tests (skipped without a device) compare graph replays with
eager runs of the same padded steps for every bucket, across storage growth, and greedy
generation with graphs, without graphs and on CPU, both layouts, target-only and DFlash.
"""

from __future__ import annotations

import gc

import pytest
import torch

from mg.manifests import constants as C
from mg.runtime.artifact import load_artifact
from mg.runtime.config import RunConfig
from mg.runtime.cuda_graphs import bucket_for, buckets
from mg.runtime.engine import Engine
from mg.runtime.model_runner import StepBatch
from mg.runtime.scheduler import Request

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TARGETS = ["tiny_seq_artifact", "tiny_cell_artifact"]
DFLASH = ["tiny_dflash_seq_artifact", "tiny_dflash_cell_artifact"]


def _requests(vocab: int, lengths=(1, 6, 13, 27, 40, 61), max_new=(12, 5, 20, 9, 16, 30)) -> list[Request]:
    """Ragged prompts; the 61-token one runs past 64 positions, so sequence-layout flat columns grow."""
    gen = torch.Generator().manual_seed(31)
    return [Request(f"r{i}", tuple(torch.randint(4, vocab, (n,), generator=gen).tolist()), m)
            for i, (n, m) in enumerate(zip(lengths, max_new))]


def _tokens(engine, reqs) -> list[tuple[int, ...]]:
    return [r.tokens for r in engine.run(reqs)]


def _recording(engine) -> list:
    """Record (live N, outputs) of every target forward of `engine`."""
    seen = []
    real = engine.runner.forward

    def forward(step):
        out = real(step)
        seen.append((step.tokens.shape[0], [o.detach().clone().cpu() for o in out]))
        return out

    engine.runner.forward = forward
    return seen


def _engine(art, device="cpu", **config) -> Engine:
    return Engine(load_artifact(art, device=device), RunConfig(device=device, **config))


def test_buckets_are_powers_of_two_then_the_limit():
    assert buckets(24) == (1, 2, 4, 8, 16, 24)
    assert buckets(16) == (1, 2, 4, 8, 16)
    assert [bucket_for(n, 24) for n in (1, 3, 5, 16, 17, 24)] == [1, 4, 8, 16, 24, 24]
    assert bucket_for(25, 24) is None


def test_static_inputs_pad_a_calls_live_rows_with_blank_index_rows():
    """The copy into a graph's static inputs (host tensors stand in for the device's): index inputs are views of
    one buffer and go in one copy; a call of fewer rows than the bucket gets its index inputs' blank rows after
    its own, even after a call with more rows, and its payload's live rows (the rest kept)."""
    from mg.runtime.cuda_graphs import GraphRunner, _Captured, _static_inputs

    blank = [torch.zeros(4, 2), torch.full((4,), 7), torch.arange(8).view(4, 2) + 100]
    buffers, flat, joined = _static_inputs(blank)
    assert joined == (1, 2) and flat.numel() == 12 and buffers[2].data_ptr() == flat.data_ptr() + 4 * 8
    g = _Captured(None, buffers, [], 0, flat, joined, tuple(blank), {i: blank[i].clone() for i in joined})
    payload = torch.arange(8.0).view(4, 2) + 1
    GraphRunner._copy_in(g, [payload, torch.tensor([1, 2, 3, 4]), torch.arange(8).view(4, 2)], 4)
    assert torch.equal(buffers[0], payload) and buffers[1].tolist() == [1, 2, 3, 4]
    GraphRunner._copy_in(g, [-payload[:1], torch.tensor([5]), torch.tensor([[9, 9]])], 4)
    assert buffers[0].tolist() == [[-1.0, -2.0]] + payload[1:].tolist()
    assert buffers[1].tolist() == [5, 7, 7, 7]
    assert buffers[2].tolist() == [[9, 9], [102, 103], [104, 105], [106, 107]]
    assert torch.equal(blank[1], torch.full((4,), 7))  # the blank itself never written


def _drafts(engine) -> list:
    """Record the drafts (argmax of each block's logits) of every `draft_block` call `engine` makes from now on."""
    seen, real = [], engine.runner.draft_block

    def draft_block(tokens, positions, seq_slots):
        out = real(tokens, positions, seq_slots)
        seen.append(out.argmax(-1).tolist())
        return out

    engine.runner.draft_block = draft_block
    return seen


class _ReplayedEagerly:
    """A stand-in for a captured CUDA graph on the CPU: each replay runs the method again, on the static inputs,
    into the static outputs."""

    def __init__(self, call, inputs: list, outputs: list):
        self.call, self.inputs, self.outputs = call, inputs, outputs

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.call(self.inputs)):
            out.copy_(new)


def _eager_graph_runner():
    from mg.runtime.cuda_graphs import GraphRunner

    class EagerGraphRunner(GraphRunner):
        def _record(self, inputs):
            outputs = [o.clone() for o in self.call(inputs)]
            return _ReplayedEagerly(self.call, inputs, outputs), outputs

    return EagerGraphRunner


@pytest.mark.slow
@pytest.mark.parametrize("which", DFLASH)
def test_the_graph_input_path_replayed_eagerly_gives_the_tokens_of_padded_calls(which, request, tiny_cfg, monkeypatch):
    """The call path into graphs' static buffers as on CUDA (calls of live rows padded by the buffers, the cell
    layout's placement as an input), each replay run eagerly on the CPU: the tokens and the drafts (so the
    drafter's context) of padded calls without graphs, and calls of fewer live rows than their bucket did happen
    (context appends)."""
    from mg.runtime.cuda_graphs import GraphRunner

    art = request.getfixturevalue(which)
    reqs = _requests(tiny_cfg.vocab_size, lengths=(6, 27, 13), max_new=(12, 16, 9))
    reference = _engine(art, pad_steps=True, speculation="fixed")
    want_drafts = _drafts(reference)
    want = _tokens(reference, reqs)
    engine = _engine(art, pad_steps=True, speculation="fixed")
    runner = engine.runner
    runner._graphs = {name: _eager_graph_runner()(
        runner._eager_call(name), runner._device_blank(plan),
        runner._forward_version if name == C.METHOD_FORWARD else runner.draft_cache.storage_version, runner.counters)
        for name, plan in runner.plans.items()}
    short = []
    copy_in = GraphRunner._copy_in

    def counting(g, inputs, bucket):
        if any(x.shape[0] < bucket for x in inputs):  # (a context append's first input: its hidden rows)
            short.append(("draft_append" if inputs[0].is_floating_point() else "other", len(g.inputs)))
        copy_in(g, inputs, bucket)

    monkeypatch.setattr(GraphRunner, "_copy_in", staticmethod(counting))
    drafts = _drafts(engine)
    assert _tokens(engine, reqs) == want
    # Tokens are lossless whatever the drafter's context holds; its drafts show that context intact.
    assert drafts == want_drafts and len(drafts) > 10 and runner.counters.replays > 0
    # A short append's inputs: hidden rows, positions, slots (and the placement, on the cell layout).
    assert ("draft_append", 4 if which == "tiny_dflash_cell_artifact" else 3) in short


@pytest.mark.parametrize("which", TARGETS)
def test_padding_rows_on_the_scratch_slot_never_change_live_outputs(which, request, tiny_cfg):
    art = request.getfixturevalue(which)
    reqs = _requests(tiny_cfg.vocab_size)
    plain, padded = _engine(art), _engine(art, pad_steps=True)
    seen_plain, seen_padded = _recording(plain), _recording(padded)
    assert _tokens(padded, reqs) == _tokens(plain, reqs)
    assert len(seen_plain) == len(seen_padded)
    assert any(bucket_for(n, padded.cache.max_write) != n for n, _ in seen_padded)  # padding really happened
    for (n, a), (m, b) in zip(seen_plain, seen_padded):
        assert n == m and [x.shape for x in a] == [x.shape for x in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, atol=5e-5, rtol=1e-5)  # other matmul shapes: fp32 rounding only
    assert padded.cache.length(padded.cache.scratch_slot) == 0  # padding never commits anything


@pytest.mark.parametrize("which", DFLASH)
def test_padded_dflash_rounds_equal_unpadded_rounds(which, request, tiny_cfg):
    art = request.getfixturevalue(which)
    reqs = _requests(tiny_cfg.vocab_size)
    plain, padded = _engine(art, speculation="fixed"), _engine(art, speculation="fixed", pad_steps=True)
    assert _tokens(padded, reqs) == _tokens(plain, reqs) == _tokens(_engine(art, dflash=False), reqs)
    a, b = plain.spec_stats, padded.spec_stats
    assert (b.rounds, b.accepted_tokens, b.accepted_hist) == (a.rounds, a.accepted_tokens, a.accepted_hist)
    draft_cache = padded.runner.draft_cache
    assert draft_cache.length(draft_cache.scratch_slot) == 0


def test_mg_run_accepts_no_cuda_graphs(tiny_seq_artifact):
    from click.testing import CliRunner

    from mg.runtime.cli import main

    result = CliRunner().invoke(main, [str(tiny_seq_artifact), "--prompt", "ab", "--max-new-tokens", "3",
                                       "--no-cuda-graphs"])
    assert result.exit_code == 0, result.stderr
    assert "CUDA graphs" not in result.stderr  # off on CPU: no graph counters in the summary


# ------------------------------------------------------------------ CUDA


def _chunk(n: int, slot: int, start: int, gen: torch.Generator) -> StepBatch:
    toks = torch.randint(4, 500, (n,), generator=gen)
    return StepBatch(toks, torch.arange(start, start + n), torch.full((n,), slot), torch.arange(n))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("which", TARGETS)
@pytest.mark.parametrize("use_triton", [None, False])
def test_graph_replay_equals_eager_for_every_bucket(which, use_triton, request):
    art = request.getfixturevalue(which)
    eager = _engine(art, "cuda", cuda_graphs=False, pad_steps=True, use_triton=use_triton)
    graphed = _engine(art, "cuda", use_triton=use_triton)
    limit = graphed.cache.max_write
    gen = torch.Generator().manual_seed(5)


    def same(step: StepBatch) -> None:
        for x, y in zip(eager.runner.forward(step), graphed.runner.forward(step)):
            torch.testing.assert_close(y, x, atol=1e-6, rtol=1e-6)

    sizes = buckets(limit)
    for prev, b in zip((0, *sizes), sizes):  # a full bucket and a padded one, each a fresh prefill of slot 0
        for n in sorted({b, prev + 1}):
            eager.cache.release(0), graphed.cache.release(0)
            same(_chunk(n, 0, 0, gen))
    eager.cache.release(0), graphed.cache.release(0)
    for slot in range(3):
        same(_chunk(5 + slot, slot, 0, gen))
    same(StepBatch(torch.tensor([7, 8, 9]), torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]), torch.arange(3)))
    assert graphed.runner.captured(C.METHOD_FORWARD) == buckets(limit)
    assert graphed.graph_counters.replays > graphed.graph_counters.captures > 0


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("which", TARGETS + DFLASH)
def test_greedy_generation_with_graphs_equals_eager_and_cpu(which, request, tiny_cfg):
    art = request.getfixturevalue(which)
    reqs = _requests(tiny_cfg.vocab_size)
    cpu = _tokens(_engine(art, dflash=False), reqs)
    for speculation in ("fixed", "adaptive"):
        eager = _tokens(_engine(art, "cuda", cuda_graphs=False, speculation=speculation), reqs)
        engine = _engine(art, "cuda", speculation=speculation)
        assert _tokens(engine, reqs) == eager == cpu
        assert engine.graph_counters.replays > 0
        warm = _engine(art, "cuda", speculation=speculation)
        warm.warm_up()
        assert warm.runner.captured(C.METHOD_FORWARD) == buckets(warm.cache.max_write)
        before = (warm.graph_counters.captures, warm.graph_counters.recaptures)
        assert _tokens(warm, reqs) == cpu
        # after a warm-up every capture is a recapture (cache growth), never a bucket's first
        assert warm.graph_counters.captures - before[0] == warm.graph_counters.recaptures - before[1]
        if "dflash" in which:
            # adaptive speculation may find no round worth its time on these prompts; fixed blocks always draft
            assert engine.spec_stats.rounds > 0 or speculation == "adaptive"
            if engine.spec_stats.rounds:
                # the drafter ran from graphs: its methods' own, or inside fused rounds' (all a step's drafts can be)
                assert engine.runner.captured(C.METHOD_DRAFT_APPEND)
                assert engine.runner.captured(C.METHOD_DRAFT_BLOCK) or any(fr.captured for fr in engine.spec.rounds)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("which,fused", [("tiny_seq_artifact", None), ("tiny_dflash_seq_artifact", False),
                                         ("tiny_dflash_seq_artifact", True)])
def test_storage_growth_recaptures_and_outputs_still_equal(which, fused, request, tiny_cfg):
    """Graphs captured at warm-up, then storage grows mid-run: every graph reading it (per method, or the
    fused DFlash round's) is captured again before its next replay, and the tokens do not change."""
    art = request.getfixturevalue(which)
    reqs = _requests(tiny_cfg.vocab_size, lengths=(61, 3), max_new=(33, 40))  # flat columns grow 64 -> 96 rows
    engine = _engine(art, "cuda", speculation="fixed", reserve_kv=False, fused_rounds=fused)  # storage that grows
    engine.warm_up()
    got = _tokens(engine, reqs)
    assert engine.cache.metrics().growth_count > 0 and engine.graph_counters.recaptures > 0
    assert got == _tokens(_engine(art, dflash=False), reqs)
    reserved = _engine(art, "cuda", speculation="fixed")  # the default with graphs: storage whole from the start
    version = reserved.cache.storage_version()
    assert _tokens(reserved, reqs) == got
    assert reserved.cache.storage_version() == version and reserved.graph_counters.recaptures == 0



@pytest.mark.cuda
@needs_cuda
def test_dflash_warm_up_leaves_no_capture_for_more_sequences_than_the_first_regions(tiny_dflash_cell_artifact,
                                                                                   tiny_cfg):
    """A DFlash engine's forward writes its waiting context rows from inside its graphs; warm-up gives that buffer
    its full size before capturing, so a batch of more sequences than the buffer's first regions captures no
    graph mid-run (each capture costs milliseconds of the first batch), and the tokens are the CPU's."""
    from mg.runtime.speculative import WaitingRows

    n = WaitingRows.START_REGIONS + 4
    reqs = _requests(tiny_cfg.vocab_size, lengths=tuple(2 + i % 7 for i in range(n)), max_new=(6,) * n)
    engine = _engine(tiny_dflash_cell_artifact, "cuda", speculation="adaptive")
    assert engine.cache.n_slots >= n
    engine.warm_up()
    before = (engine.graph_counters.captures, engine.spec._waiting.version)
    assert _tokens(engine, reqs) == _tokens(_engine(tiny_dflash_cell_artifact, dflash=False), reqs)
    assert (engine.graph_counters.captures, engine.spec._waiting.version) == before


class _DoubleProgram:
    """A stand-in program: out = 2 * x + the 'cache storage' (a tensor that growth replaces)."""

    def __init__(self):
        self.storage = torch.ones(4, device="cuda")

    def run(self, method, inputs):
        return [inputs[0] * 2 + self.storage[: inputs[0].shape[0]]]


@pytest.mark.cuda
@needs_cuda
def test_runner_recaptures_after_its_only_graph_went_stale():
    """Growth drops every graph of a runner (their pool dies with them); the next capture must still work."""
    from mg.runtime.cuda_graphs import GraphCounters, GraphRunner

    program, version, counters = _DoubleProgram(), [0], GraphCounters()
    runner = GraphRunner(lambda inputs: program.run("m", inputs), lambda b: [torch.zeros(b, device="cuda")],
                         lambda: version[0], counters)
    x = torch.arange(2.0)
    assert runner.run(2, [x])[0].tolist() == [1.0, 3.0]
    program.storage, version[0] = torch.full((4,), 10.0, device="cuda"), 1  # storage moved
    assert runner.run(2, [x])[0].tolist() == [10.0, 12.0]
    assert (counters.captures, counters.recaptures, counters.replays) == (2, 1, 2)


@pytest.mark.cuda
@needs_cuda
def test_capture_survives_garbage_collection_of_a_dropped_engine(tiny_dflash_seq_artifact, tiny_cfg):
    """Engines hold reference cycles, so a dropped one (and its CUDA graphs) goes at a cyclic collection; one
    that ran during another engine's capture used to invalidate that capture."""
    art = load_artifact(tiny_dflash_seq_artifact, device="cuda")  # one program shared by every engine
    reqs = _requests(tiny_cfg.vocab_size)[:3]
    want = _tokens(_engine(tiny_dflash_seq_artifact, dflash=False), reqs)
    threshold = gc.get_threshold()
    try:
        for config in (RunConfig(device="cuda", speculation="fixed"), RunConfig(device="cuda", dflash=False),
                       RunConfig(device="cuda")):
            engine = Engine(art, config)
            assert _tokens(engine, reqs) == want
            del engine  # garbage with live CUDA graphs
            gc.set_threshold(1, 1, 1)  # from now on nearly every allocation runs a full collection
    finally:
        gc.set_threshold(*threshold)


@pytest.mark.cuda
@needs_cuda
def test_a_call_of_live_rows_pads_index_inputs_with_blank_rows():
    """A call may pass only its live rows: an index input's padding rows are its blank rows again after a
    call with more live rows (else a padding row would name a live sequence's slot and position), whether the
    index inputs come from the host in one copy or from the device; a payload input's live rows are copied."""
    from mg.runtime.cuda_graphs import GraphCounters, GraphRunner

    def blank(b):
        return [torch.zeros(b, 2, device="cuda"), torch.full((b,), 7, device="cuda"),
                torch.full((b,), 9, device="cuda")]

    counters = GraphCounters()
    runner = GraphRunner(lambda inputs: [x * 1 for x in inputs], blank, lambda: 0, counters)
    payload = torch.arange(8.0, device="cuda").view(4, 2) + 1
    out = runner.run(4, [payload, torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8])])
    assert out[1].tolist() == [1, 2, 3, 4] and out[2].tolist() == [5, 6, 7, 8]
    for index_device in ("cpu", "cuda"):  # one joined host copy; a device input's own copy
        out = runner.run(4, [-payload[:2], torch.tensor([11, 12]), torch.tensor([13, 14], device=index_device)])
        assert out[0][:2].tolist() == (-payload[:2]).tolist()
        assert out[1].tolist() == [11, 12, 7, 7] and out[2].tolist() == [13, 14, 9, 9]
        runner.run(4, [payload, torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8])])
    assert counters.captures == 1
