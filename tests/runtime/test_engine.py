"""Batched serving equals single-prompt serving equals the eager model, in both layouts."""

from __future__ import annotations

import pytest
import torch

from mg.export.reference import greedy_generate
from mg.runtime.artifact import load_artifact
from mg.runtime.engine import Engine
from mg.runtime.sampling import SamplingParams
from mg.runtime.scheduler import Request

MAX_NEW = 8


def _prompts(vocab: int) -> list[tuple[int, ...]]:
    """Ragged prompts: 1 token up to several times the sliding window (8), so rings wrap."""
    gen = torch.Generator().manual_seed(11)
    lengths = [1, 5, 9, 17, 30, 41, 3]
    return [tuple(torch.randint(4, vocab, (n,), generator=gen).tolist()) for n in lengths]


def _serve(artifact_dir, prompts, max_new=MAX_NEW, sampling=SamplingParams()):
    engine = Engine(load_artifact(artifact_dir))
    reqs = [Request(f"r{i}", p, max_new, sampling) for i, p in enumerate(prompts)]
    return [r.tokens for r in engine.run(reqs)], engine


@pytest.fixture(scope="module")
def eager_outputs(tiny_model, tiny_cfg):
    # eos_ids=() so the reference runs the full length; the engine stops on EOS, compared by prefix below.
    return [tuple(greedy_generate(tiny_model, list(p), MAX_NEW, eos_ids=tiny_cfg.eos_ids))
            for p in _prompts(tiny_cfg.vocab_size)]


@pytest.mark.parametrize("which", ["tiny_seq_artifact", "tiny_cell_artifact"])
def test_batched_ragged_generation_equals_eager_model(which, request, eager_outputs, tiny_cfg):
    outputs, engine = _serve(request.getfixturevalue(which), _prompts(tiny_cfg.vocab_size))
    assert outputs == eager_outputs
    # 7 prompts on 3 slots (sequence layout): requests queued and all completed.
    assert engine.stats.generated_tokens == sum(len(o) for o in eager_outputs)


def test_each_prompt_alone_equals_the_batch(tiny_seq_artifact, eager_outputs, tiny_cfg):
    prompts = _prompts(tiny_cfg.vocab_size)
    alone = [_serve(tiny_seq_artifact, [p])[0][0] for p in prompts[:4]]
    assert alone == eager_outputs[:4]


def test_layouts_give_identical_sampled_tokens(tiny_seq_artifact, tiny_cell_artifact, tiny_cfg):
    prompts = _prompts(tiny_cfg.vocab_size)[:4]
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=5)
    seq, _ = _serve(tiny_seq_artifact, prompts, sampling=params)
    cell, _ = _serve(tiny_cell_artifact, prompts, sampling=params)
    assert seq == cell


def test_same_seed_same_tokens_whatever_the_batch(tiny_seq_artifact, tiny_cfg):
    prompts = _prompts(tiny_cfg.vocab_size)
    params = SamplingParams(temperature=1.0, seed=123)
    together, _ = _serve(tiny_seq_artifact, prompts[:3], sampling=params)
    alone, _ = _serve(tiny_seq_artifact, [prompts[1]], sampling=params)
    assert together[1] == alone[0]


def test_request_over_capacity_is_refused_alone(tiny_seq_artifact, tiny_cfg):
    engine = Engine(load_artifact(tiny_seq_artifact))
    cap = engine.artifact.manifest.kv.capacity
    reqs = [Request("ok", (5, 6, 7), 4), Request("long", tuple([5] * cap), 4), Request("ok2", (8,), 4)]
    res = engine.run(reqs)
    assert res[0].error is None and len(res[0].tokens) >= 1
    assert res[2].error is None and len(res[2].tokens) >= 1
    assert res[1].error is not None and "exceeds the artifact's context capacity" in res[1].error


@pytest.mark.parametrize("which", ["tiny_seq_artifact", "tiny_dflash_cell_artifact"])
def test_cancel_frees_a_running_sequence_and_drops_a_waiting_one_without_changing_the_others(which, request,
                                                                                           tiny_cfg):
    art = load_artifact(request.getfixturevalue(which))
    prompts = _prompts(tiny_cfg.vocab_size)
    alone = Engine(art).run([Request("keep", prompts[0], 12)])[0].tokens
    engine = Engine(art)
    n_slots = engine.cache.n_slots
    reqs = [Request("keep", prompts[0], 12)] + [Request(f"c{i}", prompts[1], 40) for i in range(n_slots)]
    for r in reqs:
        engine.submit(r)
    for _ in range(3):
        engine.step()
    running = {s.request.id for s in engine.scheduler.running}
    waiting = [r.id for r in engine.scheduler.waiting]
    assert "c0" in running and waiting  # one request could not get a slot
    assert engine.cancel("c0") and engine.cancel(waiting[0]) and not engine.cancel("never-submitted")
    assert "c0" not in {s.request.id for s in engine.scheduler.running}
    assert waiting[0] not in [r.id for r in engine.scheduler.waiting]
    done = {}
    while not engine.scheduler.idle:
        engine.step()
        done.update({r.id: r for r in engine.take_finished()})
    assert done["keep"].tokens == alone  # greedy: the others' tokens do not depend on the cancelled ones
    assert "c0" not in done and waiting[0] not in done
    assert all(n == 0 for n in engine.cache.metrics().lengths)


def test_greedy_plain_step_acceptance_equals_the_general_acceptance(tiny_seq_artifact, tiny_cfg, monkeypatch):
    """A greedy step without drafts takes the argmax shortcut in `Engine._accept`; it must give what the
    device acceptance (`spec_accept.accept`, no drafts) gives, ties included (the first maximum wins)."""
    from types import SimpleNamespace

    import mg.runtime.engine as engine_module
    from mg.runtime.sampling import SamplingBatch
    from mg.runtime.spec_accept import accept
    from mg.runtime.speculative import StepDrafts

    engine = Engine(load_artifact(tiny_seq_artifact))
    b, vocab = 5, tiny_cfg.vocab_size
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(b + 2, vocab, generator=gen)  # two rows past the groups (padding): not read
    logits[1, [7, vocab - 1]] = logits[1].max() + 1.0  # a tie: token 7 must win
    seqs = [SimpleNamespace(request=SimpleNamespace(sampling=SamplingParams()), n_generated=i) for i in range(b)]
    groups = [(s, i, 1, i) for i, s in enumerate(seqs)]
    with monkeypatch.context() as m:  # the shortcut is taken: the general acceptance is not called
        m.setattr(engine_module, "accept", lambda *a: pytest.fail("greedy plain step ran the general acceptance"))
        accepted, tokens = engine._accept(groups, StepDrafts.none(b), logits)
    ref = accept(torch.zeros(b, 0, dtype=torch.long), None, logits[:b, None, :], torch.zeros(b, dtype=torch.long),
                 SamplingBatch.from_params([SamplingParams()] * b), torch.arange(b))
    assert accepted == ref.n_accepted.tolist() == [0] * b
    assert tokens == ref.tokens.tolist()
    assert tokens[1] == [7]


@pytest.mark.parametrize("pad_steps", [False, True])
def test_packed_step_inputs_are_the_live_rows_padded_with_the_blank_inputs(tiny_dflash_seq_artifact, pad_steps):
    """`ModelRunner.pack` makes the forward's inputs at once (one host tensor). They must be what the call
    path makes from the step's live rows: each padded with the forward's blank inputs to the step's bucket
    when calls are padded (logits rows too, even when the rows fill the bucket), as they are otherwise; the
    admitted rows are the positions and slots among them."""
    from mg.manifests import constants as C
    from mg.runtime.config import RunConfig
    from mg.runtime.scheduler import Chunk, Sequence

    engine = Engine(load_artifact(tiny_dflash_seq_artifact), RunConfig(pad_steps=pad_steps))
    runner = engine.runner
    plan = runner.plans[C.METHOD_FORWARD]
    seqs = [Sequence(Request(f"s{i}", tuple(range(4, 10 + i)), 8), slot=i, tokens=list(range(4, 10 + i)),
                     n_cached=5 + i) for i in range(3)]
    prompt = Sequence(Request("p", tuple(range(20, 33)), 8), slot=3, tokens=list(range(20, 33)))
    cases = [([seqs[0]], [0], []), (seqs, [0, 0, 0], []),  # plain steps: 1 row, 3 rows (bucket 4)
             (seqs[:2], [0, 0], [Chunk(prompt, 0, 6, False)]),  # 8 rows, no logits row for the chunk (bucket full)
             (seqs[:1], [0], [Chunk(prompt, 6, 7, True)])]  # 8 rows, 2 logits rows
    for decode, ks, prefill in cases:
        dst = list(range(100, 100 + len(decode) + sum(c.length for c in prefill)))
        step = runner.pack(decode, ks, prefill, None, dst)
        live = [step.tokens, step.positions, step.seq_slots, step.logits_rows, step.hidden_dst]
        assert [x.shape[0] for x in live] == [step.n] * 3 + [step.r, step.n]
        assert step.hidden_dst.tolist() == dst
        assert step.positions.tolist()[:len(decode)] == [s.n_cached for s in decode]
        inputs = step.packed.inputs()
        size = step.packed.size
        if not pad_steps:
            assert size is None
            want = live
        else:
            assert size == 1 << (step.n - 1).bit_length()
            blank = runner._call_blank(plan, size)
            want = [torch.cat([x, b[x.shape[0]:]]) for x, b in zip(live, blank)]
        assert len(inputs) == len(want) == 5
        for got, expect in zip(inputs, want):
            assert torch.equal(got, expect)
        assert step.packed.positions == inputs[1].tolist() and step.packed.slots == inputs[2].tolist()
