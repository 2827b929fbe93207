"""Overlapped plain steps (a step's tokens read back during the next step) give the tokens of steps read back at
once: target-only and adaptive DFlash, both layouts, through queueing, EOS and cancels."""

from __future__ import annotations

import pytest
import torch

from mg.runtime.artifact import load_artifact
from mg.runtime.config import RunConfig
from mg.runtime.engine import Engine
from mg.runtime.scheduler import Batch, Request
from mg.runtime.speculative import CostModel, ProbeSchedule

LAYOUTS = ["tiny_dflash_seq_artifact", "tiny_dflash_cell_artifact"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MAX_NEW = [12, 5, 20, 9, 16, 7]  # six requests: more than the sequence layout's three slots


def _prompts(vocab):
    gen = torch.Generator().manual_seed(31)
    return [tuple(torch.randint(4, vocab, (n,), generator=gen).tolist()) for n in (1, 6, 13, 27, 40, 3)]


def _requests(prompts, max_new=MAX_NEW):
    return [Request(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, max_new))]


def _engine(art, dflash: bool, overlap: bool, eos=None, device="cpu", graphs=None) -> Engine:
    # Methods interpreted (compile=False) on CUDA too: what overlap changes is outside them, and compiling
    # each artifact's methods would cost a minute.
    engine = Engine(load_artifact(art, device=device),
                    RunConfig(device=device, cuda_graphs=graphs, compile=False, dflash=dflash, overlap=overlap))
    if dflash:  # a drafter rejected so far: adaptive speculation chooses plain steps
        _rejecting(engine)
    if eos is not None:
        engine.scheduler.eos_ids = frozenset(eos)
    return engine


def _rejecting(engine: Engine) -> None:
    """`engine`'s drafter rejected many times. Unfused (CPU): priced by fixed costs, no timed calls and no
    probes, so every choice is a plain step whatever host work this machine measures per step (up to ~50 ms),
    and, once the drafter is believed perfect (`_believe(engine, 7, 60)`), a round. The draft call costs 2 ms:
    with 0.1 ms, the host work learnt from the measured steps (their time beyond the fixed 1 ms forward, a few
    ms each on a 2-core CPU) made the rejected drafter's ~0.03 expected tokens look worth a round now and then.
    Fused rounds (CUDA graphs): the costs it measured, probes included."""
    spec = engine.spec
    _believe(engine, 0, 30)
    if not engine.config.fused:
        sizes = (1, 2, 4, 8, 16, 24)
        spec.costs = CostModel({n: 1e-3 + 1e-5 * n for n in sizes}, {b: 2e-3 for b in (1, 2, 3)},
                               {m: 0.0 for m in sizes}, padded=False)
        engine.runner.call_log = None
        spec.probes = ProbeSchedule(engine.cache.n_slots, start=10 ** 9, cap=10 ** 9)


def _tokens(engine, reqs):
    return [r.tokens for r in engine.run(reqs)]


def _believe(engine: Engine, accepted: int, times: int) -> None:
    """Every slot's drafts of 7 were accepted `accepted` at a time, `times` times."""
    for slot in range(engine.cache.n_slots):
        for _ in range(times):
            engine.spec.acceptance.observe(slot, 7, accepted)


def _into_flight(engine: Engine, reqs, overlapped: int) -> None:
    """Submit `reqs` and step until `overlapped` steps were launched on the tokens of a step in flight."""
    for r in reqs:
        engine.submit(r)
    while engine.stats.overlapped_steps < overlapped and not engine.scheduler.idle:
        engine.step()


def _to_the_end(engine: Engine) -> dict:
    """Step until nothing is left, the step in flight read back: {request id: tokens} of what finished."""
    done = {}
    while not engine.scheduler.idle:
        engine.step()
        done.update({r.id: r.tokens for r in engine.take_finished()})
    engine.drain()
    done.update({r.id: r.tokens for r in engine.take_finished()})
    return done


@pytest.fixture(scope="module")
def reference(tiny_dflash_seq_artifact, tiny_cfg):
    """Target-only tokens, each step read back at once."""
    return _tokens(_engine(tiny_dflash_seq_artifact, False, False), _requests(_prompts(tiny_cfg.vocab_size)))


@pytest.mark.parametrize("dflash", [False, True], ids=["target-only", "dflash"])
@pytest.mark.parametrize("which", LAYOUTS)
def test_overlapped_steps_give_the_tokens_of_steps_read_back_at_once(which, dflash, request, reference, tiny_cfg):
    engine = _engine(request.getfixturevalue(which), dflash, True)
    assert _tokens(engine, _requests(_prompts(tiny_cfg.vocab_size))) == reference
    assert engine.stats.overlapped_steps > 0
    assert engine.stats.generated_tokens == sum(map(len, reference))
    assert engine._inflight is None and all(n == 0 for n in engine.cache.metrics().lengths)


@pytest.mark.parametrize("dflash", [False, True], ids=["target-only", "dflash"])
@pytest.mark.parametrize("which", LAYOUTS)
def test_a_sequence_that_ends_on_eos_read_back_late_drops_the_row_after_it(which, dflash, request, reference,
                                                                          tiny_cfg):
    art = request.getfixturevalue(which)
    reqs = _requests(_prompts(tiny_cfg.vocab_size))
    # The longest request alone: after its prompt, each plain step chains on the one before, so its EOS (a
    # token it does emit, first at position 10) is read back after the step that follows it was launched.
    out = reference[2]
    at = next(i for i in range(10, len(out)) if out[i] not in out[:i])
    eos = {out[at]}
    expected = _tokens(_engine(art, False, False, eos), reqs[2:3])
    assert expected == [out[:at + 1]]
    engine = _engine(art, dflash, True, eos)
    assert _tokens(engine, reqs[2:3]) == expected
    assert engine.stats.overlapped_steps > 0 and engine.stats.overlap_wasted_rows == 1
    # And among the others, queued and ending at different steps.
    expected = _tokens(_engine(art, False, False, eos), reqs)
    engine = _engine(art, dflash, True, eos)
    assert _tokens(engine, reqs) == expected and engine.stats.overlapped_steps > 0
    assert all(n == 0 for n in engine.cache.metrics().lengths)


@pytest.mark.parametrize("which", LAYOUTS)
def test_a_round_chosen_with_a_step_in_flight_reads_it_back_first(which, request, reference, tiny_cfg):
    engine = _engine(request.getfixturevalue(which), True, True)
    reqs = _requests(_prompts(tiny_cfg.vocab_size))[:3]
    _into_flight(engine, reqs, 2)
    assert engine._inflight is not None and engine.spec_stats.rounds == 0
    _believe(engine, 7, 60)  # now it turns out perfect: the next choice, made in flight, drafts
    propose, drafted = engine.spec.propose, []

    def checked(decode, ks):  # a drafting step: read back first, and no sequence drafts past its last token
        if any(ks):
            for seq, k in zip(decode, ks):
                assert seq.in_flight == 0 and k <= seq.request.max_new_tokens - seq.n_generated - 1
                drafted.append(k)
        return propose(decode, ks)

    engine.spec.propose = checked
    done = _to_the_end(engine)
    assert engine.spec_stats.rounds > 0 and engine.spec_stats.drafted_tokens > 0 and any(drafted)
    assert [done[r.id] for r in reqs] == reference[:3]
    assert all(n == 0 for n in engine.cache.metrics().lengths)


def test_a_batch_scheduled_with_a_step_in_flight_loses_the_sequences_that_step_ended(tiny_dflash_seq_artifact):
    engine = _engine(tiny_dflash_seq_artifact, False, True)
    for i, prompt in enumerate([(5, 6, 7), (8, 9), (10, 11, 12, 13)]):
        engine.submit(Request(f"s{i}", prompt, 8))
    engine.step()
    a, b, c = engine.scheduler.running
    batch = Batch([a, b, c], [3, 0, 2], [])
    assert Engine._without_finished(batch) is batch  # none ended: the batch as it is
    b.finish_reason = "eos"
    assert Engine._without_finished(batch) == Batch([a, c], [3, 2], [])
    a.finish_reason = c.finish_reason = "eos"
    assert not Engine._without_finished(batch)


@pytest.mark.parametrize("dflash", [False, True], ids=["target-only", "dflash"])
@pytest.mark.parametrize("which", LAYOUTS)
def test_a_one_token_prompt_admitted_with_a_step_in_flight_is_not_chained_on_it(which, dflash, request, tiny_cfg):
    # A one-token prompt is a decode sequence as soon as it is admitted: its token is on the host, not in the
    # step in flight, so that step is read back first. Once alone beside one running sequence (a row count
    # the step in flight does not have), once in the place of a cancelled one (the same count).
    art = request.getfixturevalue(which)
    prompts = _prompts(tiny_cfg.vocab_size)
    late = Request("late", (42,), 10)
    alone = {r.id: _tokens(_engine(art, False, False), [r])[0]
             for r in [Request("a", prompts[3], 20), Request("b", prompts[1], 20), Request("c", prompts[2], 20),
                       late]}
    engine = _engine(art, dflash, True)
    _into_flight(engine, [Request("a", prompts[3], 20)], 1)
    assert engine._inflight is not None
    engine.submit(late)
    assert _to_the_end(engine) == {"a": alone["a"], "late": alone["late"]}
    engine = _engine(art, dflash, True)
    _into_flight(engine, [Request("a", prompts[3], 20), Request("b", prompts[1], 20), Request("c", prompts[2], 20)], 1)
    assert engine._inflight is not None and engine.cancel("b")
    engine.submit(late)
    assert _to_the_end(engine) == {k: alone[k] for k in ("a", "c", "late")}
    assert all(n == 0 for n in engine.cache.metrics().lengths)


@pytest.mark.parametrize("dflash", [False, True], ids=["target-only", "dflash"])
@pytest.mark.parametrize("which", LAYOUTS)
def test_requests_that_fill_the_context_end_without_a_wasted_row(which, dflash, request, reference, tiny_cfg):
    # prompt + max_new_tokens = the context, no EOS: a step chained on a sequence's last token would compute a
    # row for a sequence that ends when that token is read back (and keep its slot from a waiting request).
    art = request.getfixturevalue(which)
    capacity = load_artifact(art).manifest.kv.capacity
    prompts = _prompts(tiny_cfg.vocab_size)
    reqs = [Request(f"f{i}", p, capacity - len(p), ignore_eos=True) for i, p in enumerate(prompts[2:5])]
    expected = _tokens(_engine(art, False, False), reqs)
    engine = _engine(art, dflash, True)
    if dflash:  # a drafter as good as can be, from the start: rounds up to the end of each context
        _believe(engine, 7, 60)
    assert _tokens(engine, reqs) == expected and engine.stats.overlapped_steps > 0
    assert engine.stats.overlap_wasted_rows == 0  # no EOS: no step ran on a sequence that had ended
    if dflash:
        assert engine.spec_stats.rounds > 0
    assert all(n == 0 for n in engine.cache.metrics().lengths)


@pytest.mark.parametrize("which", LAYOUTS)
def test_cancel_with_a_step_in_flight_leaves_the_others_tokens_alone(which, request, reference, tiny_cfg):
    engine = _engine(request.getfixturevalue(which), False, True)
    _into_flight(engine, _requests(_prompts(tiny_cfg.vocab_size))[:3], 2)
    assert engine._inflight is not None and "r1" in {s.request.id for s in engine._inflight.seqs}
    assert engine.cancel("r1")
    done = _to_the_end(engine)
    assert sorted(done) == ["r0", "r2"]
    assert done["r0"] == reference[0] and done["r2"] == reference[2]
    assert engine.stats.overlap_wasted_rows >= 1  # r1's token of the step in flight
    assert all(n == 0 for n in engine.cache.metrics().lengths)


def test_overlap_is_on_with_cuda_graphs_unless_told(tiny_seq_artifact):
    assert not RunConfig().overlapped and RunConfig(overlap=True).overlapped
    assert not RunConfig(device="cuda", overlap=False).overlapped
    assert RunConfig(device="cuda").overlapped == RunConfig(device="cuda").graphs


def test_pack_refuses_device_tokens_that_are_not_one_per_plain_sequence(tiny_dflash_seq_artifact, tiny_cfg):
    engine = _engine(tiny_dflash_seq_artifact, False, True)
    engine.submit(Request("a", (5, 6, 7), 8))
    engine.submit(Request("b", (8, 9), 8))
    while len(engine.scheduler.running) < 2 or any(s.n_cached < len(s.request.prompt) for s in engine.scheduler.running):
        engine.step()
    engine.drain()
    decode = list(engine.scheduler.running)
    head = torch.tensor([5])
    with pytest.raises(ValueError, match="head_tokens has 1 tokens for 2 decode sequences"):
        engine.runner.pack(decode, [0, 0], [], head_tokens=head)
    drafts = torch.full((2, 7), 5, dtype=torch.long)
    with pytest.raises(ValueError, match="one per sequence, no drafts"):
        engine.runner.pack(decode, [1, 0], [], drafts, head_tokens=torch.tensor([5, 6]))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("which", LAYOUTS)
def test_overlapped_steps_on_cuda_give_the_cpu_tokens(which, graphs, request, reference, tiny_cfg):
    # On CUDA the tokens go to the host through a pinned buffer, the next step's inputs take them on the device
    # (into the graph's input buffer with graphs), and the host reads a step back after launching the next.
    art = request.getfixturevalue(which)
    reqs = _requests(_prompts(tiny_cfg.vocab_size))
    out = reference[2]
    eos = {out[next(i for i in range(10, len(out)) if out[i] not in out[:i])]}
    expected_eos = _tokens(_engine(art, False, False, eos), reqs)
    for dflash in (False, True):
        engine = _engine(art, dflash, True, device="cuda", graphs=graphs)
        assert _tokens(engine, reqs) == reference
        assert engine.stats.overlapped_steps > 0 and engine.stats.generated_tokens == sum(map(len, reference))
        engine = _engine(art, dflash, True, eos, device="cuda", graphs=graphs)
        assert _tokens(engine, reqs) == expected_eos and engine.stats.overlapped_steps > 0
        assert all(n == 0 for n in engine.cache.metrics().lengths)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("which", LAYOUTS)
def test_shadow_probes_on_cuda_with_steps_in_flight_give_the_cpu_tokens(which, request, reference, tiny_cfg,
                                                                       monkeypatch):
    """Shadow probes (`RunConfig.probes`), one launched after every judged one: their draft calls and
    the copies of their drafts to the host ride the stream behind steps in flight; the tokens are the CPU's,
    the chain of overlapped steps goes on, and every probe is judged."""
    from mg.runtime import speculative as spec_module

    art = request.getfixturevalue(which)
    reqs = _requests(_prompts(tiny_cfg.vocab_size))
    engine = _engine(art, True, True, device="cuda")
    spec = engine.spec
    spec.shadow = True  # (`_engine` builds every engine with the default config: round probes)
    monkeypatch.setattr(spec_module, "PROBE_BUDGET", 1e9)
    spec.probes = ProbeSchedule(engine.cache.n_slots, start=1, cap=1)
    observed, observe = [], spec.acceptance.observe
    spec.acceptance.observe = lambda slot, k, a: (observed.append((k, a)), observe(slot, k, a))
    assert _tokens(engine, reqs) == reference
    assert engine.spec_stats.shadow_probes == len(observed) > 0 and engine.spec_stats.rounds == 0
    assert engine.stats.overlapped_steps > 0 and not spec._shadows
    assert all(0 <= a <= k < spec.block for k, a in observed)
    assert engine.spec_stats.shadow_accepted == sum(a for _, a in observed)
