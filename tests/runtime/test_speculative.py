"""DFlash is lossless, batched, commits only what was accepted, and adapts its drafts (both layouts)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time

import pytest
import torch
from click.testing import CliRunner

from mg.manifests import constants as C
from mg.runtime.artifact import load_artifact
from mg.runtime.cli import main
from mg.runtime.config import RunConfig
from mg.runtime.engine import Engine
from mg.runtime.scheduler import Request
from mg.runtime import speculative as spec_module
from mg.runtime.speculative import (DRAFTING, FUSED, PLAIN, AcceptanceModel, CostModel, DFlashError, DraftModelProposer,
                                    ProbeSchedule)

LAYOUTS = ["tiny_dflash_seq_artifact", "tiny_dflash_cell_artifact"]
TARGET_ONLY = RunConfig(dflash=False)
FIXED = RunConfig(speculation="fixed")
ROUND_PROBES = RunConfig(probes="round")  # a sequence kept at plain steps probes by drafting in a round
SHADOW_PROBES = RunConfig(probes="shadow")  # ... by a draft call alone, compared with the tokens that follow


def _prompts(vocab):
    gen = torch.Generator().manual_seed(21)
    return [tuple(torch.randint(4, vocab, (n,), generator=gen).tolist()) for n in (1, 6, 13, 27, 40)]


def _requests(prompts, max_new, ignore_eos=False):
    news = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
    return [Request(f"r{i}", p, n, ignore_eos=ignore_eos) for i, (p, n) in enumerate(zip(prompts, news))]


def _engine(artifact_dir, config=RunConfig(), eos=None, proposer=None):
    engine = Engine(load_artifact(artifact_dir), config, proposer=proposer)
    if eos is not None:
        engine.scheduler.eos_ids = frozenset(eos)
    return engine


def _tokens(engine, reqs):
    return [r.tokens for r in engine.run(reqs)]


class Oracle:
    """A test-only drafter that proposes what the target will say (or, `wrong`, never agrees with it)."""

    def __init__(self, reference: dict, wrong: bool = False, vocab: int = 512):
        self.reference, self.wrong, self.vocab = reference, wrong, vocab

    def propose(self, seqs, ks):
        out = []
        for seq, k in zip(seqs, ks):
            ref = self.reference[seq.request.id]
            nxt = list(ref[seq.n_generated:seq.n_generated + k])
            nxt += [5] * (k - len(nxt))
            out.append([(t + 1) % self.vocab for t in nxt] if self.wrong else nxt)
        return out


class Recording:
    """The artifact's drafter, recording (request id, anchor position) -> drafts."""

    def __init__(self, engine):
        self.inner = DraftModelProposer(engine.runner)
        self.seen: dict[tuple[str, int], list[int]] = {}

    def propose(self, seqs, ks):
        out = self.inner.propose(seqs, ks)  # [B, T-1] on the device
        for seq, d, k in zip(seqs, out.tolist(), ks):
            self.seen[(seq.request.id, seq.n_cached)] = d[:k]
        return out


@pytest.mark.parametrize("config", [RunConfig(), FIXED], ids=["adaptive", "fixed"])
@pytest.mark.parametrize("which", LAYOUTS)
def test_greedy_dflash_matches_target_only(which, config, request, tiny_cfg):
    art = request.getfixturevalue(which)
    reqs = _requests(_prompts(tiny_cfg.vocab_size), [12, 5, 20, 9, 16])
    reference = _tokens(_engine(art, TARGET_ONLY), reqs)
    eos = {reference[2][6]}  # an EOS the model does emit: a token from the middle of one reference output
    engine = _engine(art, config)
    if engine.spec.adaptive:  # a drafter believed good and cheap, so that adaptive speculation drafts whatever
        _observe(engine.spec.acceptance, 0, 7, 7, 10)  # the cost tables this process measured say
        engine.spec.acceptance.reset(0)
        engine.spec.costs = _costs(forward_per_row=1e-5, draft=1e-4)
    assert _tokens(engine, reqs) == reference
    assert engine.spec_stats.rounds > 0 and engine.spec_stats.drafted_tokens > 0
    got_eos = _tokens(_engine(art, config, eos=eos), reqs)
    assert got_eos == _tokens(_engine(art, TARGET_ONLY, eos=eos), reqs)
    assert any(out and out[-1] in eos for out in got_eos)


@pytest.mark.parametrize("which", LAYOUTS)
def test_reserved_kv_never_moves_and_gives_the_same_tokens(which, request, tiny_cfg):
    """KV storage allocated whole at start (the CUDA-graph default) serves DFlash exactly like storage that
    grows, and neither the target's nor the drafter's storage moves during the run."""
    art = request.getfixturevalue(which)
    reqs = _requests(_prompts(tiny_cfg.vocab_size), [12, 5, 20, 40, 50], ignore_eos=True)  # contexts past 64
    growing = _engine(art, dataclasses.replace(FIXED, pad_steps=True))
    reference = _tokens(growing, reqs)
    assert growing.runner.draft_cache.storage_version() > 0  # this run does grow storage that is not reserved
    engine = _engine(art, dataclasses.replace(FIXED, reserve_kv=True, pad_steps=True))
    caches = (engine.runner.cache, engine.runner.draft_cache)
    versions = [c.storage_version() for c in caches]
    assert _tokens(engine, reqs) == reference
    assert [c.storage_version() for c in caches] == versions


def test_kv_that_cannot_be_reserved_is_said_once_and_grows_instead(tiny_dflash_seq_artifact, tiny_cfg, monkeypatch,
                                                                   caplog):
    from mg.runtime.cache_sequence import BatchedSequenceCache

    def no_memory(self):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(BatchedSequenceCache, "_reserve", no_memory)
    reqs = _requests(_prompts(tiny_cfg.vocab_size), [12, 5, 20, 40, 50], ignore_eos=True)
    with caplog.at_level("WARNING", logger="mg.runtime"):
        engine = _engine(tiny_dflash_seq_artifact, dataclasses.replace(FIXED, reserve_kv=True, pad_steps=True))
    said = [r.getMessage() for r in caplog.records if "memory to allocate" in r.getMessage()]
    assert len(said) == 2 and all("grows as contexts grow" in m for m in said)  # target cache, draft cache
    assert _tokens(engine, reqs) == _tokens(_engine(tiny_dflash_seq_artifact, FIXED), reqs)
    assert engine.runner.cache.storage_version() > 0  # it grew instead


def test_ignore_eos_generates_the_whole_budget(tiny_dflash_seq_artifact, tiny_cfg):
    prompts = _prompts(tiny_cfg.vocab_size)[:2]
    reference = _tokens(_engine(tiny_dflash_seq_artifact, TARGET_ONLY), _requests(prompts, 12))
    eos = {reference[0][3]}
    stopped = _tokens(_engine(tiny_dflash_seq_artifact, eos=eos), _requests(prompts, 12))
    assert stopped[0] == reference[0][:4]
    full = _tokens(_engine(tiny_dflash_seq_artifact, eos=eos), _requests(prompts, 12, ignore_eos=True))
    assert full == reference


@pytest.mark.parametrize("which", LAYOUTS)
def test_oracle_drafter_accepts_whole_blocks(which, request, tiny_cfg):
    art = request.getfixturevalue(which)
    block = load_artifact(art).manifest.draft.block_size
    max_new = 1 + 3 * block  # the first token comes from prefill, then three full rounds
    for prompts in (_prompts(tiny_cfg.vocab_size)[2:3], _prompts(tiny_cfg.vocab_size)[:3]):
        reqs = _requests(prompts, max_new, ignore_eos=True)
        reference = _tokens(_engine(art, TARGET_ONLY), reqs)
        engine = _engine(art, FIXED, proposer=Oracle({r.id: out for r, out in zip(reqs, reference)}))
        assert _tokens(engine, reqs) == reference
        assert engine.spec_stats.accepted_tokens == engine.spec_stats.drafted_tokens > 0
    # Alone, a sequence gets full rounds (in a batch, max_write is shared and some rounds are shorter).
    reqs = _requests(_prompts(tiny_cfg.vocab_size)[2:3], max_new, ignore_eos=True)
    reference = _tokens(_engine(art, TARGET_ONLY), reqs)
    engine = _engine(art, FIXED, proposer=Oracle({r.id: out for r, out in zip(reqs, reference)}))
    _tokens(engine, reqs)
    assert engine.spec_stats.mean_acceptance_length == block


def test_drafter_that_never_agrees_still_gives_identical_output(tiny_dflash_seq_artifact, tiny_cfg):
    reqs = _requests(_prompts(tiny_cfg.vocab_size), 10)
    reference = _tokens(_engine(tiny_dflash_seq_artifact, TARGET_ONLY), reqs)
    oracle = Oracle({r.id: out for r, out in zip(reqs, reference)}, wrong=True, vocab=tiny_cfg.vocab_size)
    engine = _engine(tiny_dflash_seq_artifact, FIXED, proposer=oracle)
    assert _tokens(engine, reqs) == reference
    assert engine.spec_stats.accepted_tokens == 0 and engine.spec_stats.mean_acceptance_length == 1.0


def test_draft_block_smaller_than_exported_is_lossless(tiny_dflash_seq_artifact, tiny_cfg):
    reqs = _requests(_prompts(tiny_cfg.vocab_size)[:3], 9)
    engine = _engine(tiny_dflash_seq_artifact, RunConfig(draft_block=3, speculation="fixed"))
    assert _tokens(engine, reqs) == _tokens(_engine(tiny_dflash_seq_artifact, TARGET_ONLY), reqs)
    assert engine.spec_stats.drafted_tokens <= 2 * engine.spec_stats.rounds
    assert len(engine.spec_stats.chosen_k_hist) == 3  # k in 0..2


@pytest.mark.parametrize("which", LAYOUTS)
def test_rejected_rounds_leave_caches_holding_exactly_the_committed_tokens(which, request, tiny_cfg):
    art = request.getfixturevalue(which)
    prompt = _prompts(tiny_cfg.vocab_size)[3]
    spec, plain = _engine(art, FIXED), _engine(art, TARGET_ONLY)
    for e in (spec, plain):
        e.submit(Request("x", prompt, 40, ignore_eos=True))
    for _ in range(4):
        spec.step()
        seq = spec.scheduler.running[0]
        n = seq.n_cached
        assert spec.cache.length(seq.slot) == n == spec.spec.context_length(seq.slot)
        assert spec.runner.draft_cache.length(seq.slot) <= n  # the rest waits for the next draft
        while not plain.scheduler.running or plain.scheduler.running[0].n_cached < n:
            plain.step()
        pseq = plain.scheduler.running[0]
        assert pseq.tokens[:n + 1] == seq.tokens[:n + 1]
        assert plain.cache.length(pseq.slot) == n
        for layer in spec.cache.spec.layers:
            lo = max(0, n - layer.window) if layer.window else 0
            pos = torch.arange(lo, n)[None, :]
            a = spec.cache.gather(layer.layer_id, pos, torch.tensor([seq.slot]))
            b = plain.cache.gather(layer.layer_id, pos, torch.tensor([pseq.slot]))
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)  # batched vs one-token matmuls


def _hidden_by_position(engine, reqs) -> dict[tuple[str, int], torch.Tensor]:
    """(request id, position) -> the target's hidden row there, from every forward of a run."""
    seen, real = {}, engine.runner.forward

    def forward(step):
        out = real(step)
        owner = {s.slot: s.request.id for s in engine.scheduler.running}
        for row, (slot, pos) in enumerate(zip(step.seq_slots.tolist(), step.positions.tolist())):
            seen.setdefault((owner[slot], pos), []).append(out[1][row].clone())
        return out

    engine.runner.forward = forward
    engine.run(reqs)
    return seen


def test_draft_context_only_receives_committed_rows(tiny_dflash_seq_artifact, tiny_cfg):
    """Every row appended to the draft cache is the hidden row of the committed token at its position
    (what target-only decoding computes there), never that of a rejected draft."""
    reqs = _requests(_prompts(tiny_cfg.vocab_size), 10)
    reference = _hidden_by_position(_engine(tiny_dflash_seq_artifact, RunConfig(speculation="fixed", dflash=True)),
                                    reqs)
    engine = _engine(tiny_dflash_seq_artifact, FIXED)
    appended, real = [], engine.runner.draft_append

    def draft_append(hidden, positions, seq_slots, spans=None):
        owner = {s.slot: s.request.id for s in engine.scheduler.running}
        named = [(slot, first + j) for slot, first, m in spans for j in range(m)]  # the rows, as spans
        assert named == list(zip(seq_slots.tolist(), positions.tolist()))
        for slot in set(seq_slots.tolist()):  # each slot's rows continue its draft context: no gaps, no repeats
            mine = [p for s, p in zip(seq_slots.tolist(), positions.tolist()) if s == slot]
            start = engine.runner.draft_cache.length(slot)
            assert mine == list(range(start, start + len(mine)))
        for row, (slot, pos) in enumerate(zip(seq_slots.tolist(), positions.tolist())):
            appended.append((owner[slot], pos, hidden[row].clone()))
        return real(hidden, positions, seq_slots, spans)

    engine.runner.draft_append = draft_append
    plain = _engine(tiny_dflash_seq_artifact, TARGET_ONLY)
    truth = _hidden_by_position(plain, reqs)  # one row per position: target-only never rejects
    assert _tokens(engine, reqs) == _tokens(_engine(tiny_dflash_seq_artifact, TARGET_ONLY), reqs)
    assert engine.spec_stats.drafted_tokens > engine.spec_stats.accepted_tokens  # rows were really rejected
    assert appended
    far = lambda a, b: (a - b).abs().max().item() > 0.1  # noqa: E731  (batched matmuls differ by ~1e-4)
    # Some positions saw rejected drafts, whose hidden rows are far from the committed token's:
    assert any(far(row, truth[key][0]) for key, rows in reference.items() if len(rows) > 1 for row in rows)
    for rid, pos, row in appended:
        assert not far(row, truth[(rid, pos)][0])
        torch.testing.assert_close(row, truth[(rid, pos)][0], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("which", LAYOUTS)
def test_acceptance_after_a_plain_stretch_equals_a_run_that_never_paused(which, request, tiny_cfg):
    """Drafter context stays current through k = 0 rounds: after the stretch, drafts at each anchor (and so
    acceptance) are the same as in a run that drafted every round."""
    art = request.getfixturevalue(which)
    reqs = _requests(_prompts(tiny_cfg.vocab_size)[1:4], 30, ignore_eos=True)
    always = _engine(art, FIXED)
    rec_always = Recording(always)
    always.spec.proposer = rec_always
    out_always = _tokens(always, reqs)

    paused = _engine(art, FIXED)
    rec_paused = Recording(paused)
    paused.spec.proposer = rec_paused
    choose, steps = paused.spec.choose, []

    def choose_after_a_stretch(decode, rows_left, **kw):
        steps.append(1)
        return [0] * len(decode) if len(steps) <= 8 else choose(decode, rows_left, **kw)

    paused.spec.choose = choose_after_a_stretch
    assert _tokens(paused, reqs) == out_always
    assert paused.spec_stats.chosen_k_hist[0] >= 8  # the stretch happened
    assert len(steps) > 8 and rec_paused.seen  # and drafting resumed after it
    for key, drafts in rec_paused.seen.items():
        if key in rec_always.seen:
            assert drafts == rec_always.seen[key], f"drafts at {key} differ after the k = 0 stretch"
    assert sum(key in rec_always.seen for key in rec_paused.seen) >= len(rec_paused.seen) // 2


def test_rows_that_do_not_wait_for_acceptance_are_written_by_the_steps_forward(tiny_dflash_seq_artifact, tiny_cfg):
    """A sequence that did not draft commits its one row, and a prompt chunk all of its rows, through the
    step's forward: their rows of the waiting buffer are named before the forward and hold its hidden rows
    after it, with no commit call of their own; a drafting sequence commits what it accepted after the step's
    host copy. The output stays target-only's, and every draft finds its context complete (checked before
    each draft)."""
    from mg.runtime.speculative import WaitingRows

    reqs = _requests(_prompts(tiny_cfg.vocab_size)[1:3], 8, ignore_eos=True)  # prompts of 6 and 13 tokens
    reference = _tokens(_engine(tiny_dflash_seq_artifact, TARGET_ONLY), reqs)
    engine = _engine(tiny_dflash_seq_artifact)
    spec, events, slots = engine.spec, [], {}

    def choose(decode, rows_left, prefill=False):  # r0 drafts 3 rows every step, r1 never drafts
        slots.update({s.request.id: s.slot for s in decode})
        return [min(3, rows_left) if s.request.id == "r0" else 0 for s in decode]

    def forward(step):
        out = run(step)
        dst = step.hidden_dst.tolist()
        written = [i for i, row in enumerate(dst) if row != WaitingRows.SCRATCH]
        events.append(("forward", len(written), len(dst)))
        buffer = spec._waiting.buffer
        for i in written:  # the forward wrote each named row's hidden state there
            torch.testing.assert_close(buffer[dst[i]], out[1][i], rtol=0, atol=0)
        return out

    commit, accept, run = spec.commit, engine._accept, engine.runner.forward
    spec.choose, engine.runner.forward = choose, forward
    spec.commit = lambda hidden, rows, owners: (owners and events.append(tuple(owners)), commit(hidden, rows, owners))
    engine._accept = lambda *args: (events.append("copy"), accept(*args))[1]
    assert _tokens(engine, reqs) == reference
    assert events[:2] == [("forward", 19, 19), "copy"]  # both prompts in one step: all their rows, no commit call
    plain_first, copy, drafted_after = events[2:5]
    assert plain_first == ("forward", 1, 5) and copy == "copy"  # r1's one row; r0's pending token and 3 drafts wait
    assert len(drafted_after) == 1 and drafted_after[0][0] == slots["r0"] and 1 <= drafted_after[0][1] <= 4


# ------------------------------------------------------------------ the adaptive choice


def _seq(slot, n_cached=10, generated=1, max_new=100):
    req = Request(f"s{slot}", tuple(range(4, 4 + n_cached)), max_new)
    from mg.runtime.scheduler import Sequence

    return Sequence(req, slot, list(req.prompt) + [7] * generated, n_cached=n_cached + generated - 1)


def _costs(forward_per_row: float, draft: float, fixed: float = 1e-3) -> CostModel:
    sizes = (1, 2, 4, 8, 16, 24)
    return CostModel({n: fixed + forward_per_row * n for n in sizes}, {b: draft for b in (1, 2, 3)},
                     {m: 0.0 for m in sizes}, padded=False)


def _observe(model: AcceptanceModel, slot: int, k: int, accepted: int, times: int) -> None:
    for _ in range(times):
        model.observe(slot, k, accepted)


def test_adaptive_choice_drafts_where_it_pays_per_sequence(tiny_dflash_seq_artifact):
    engine = _engine(tiny_dflash_seq_artifact)
    spec = engine.spec
    seqs = [_seq(0), _seq(1)]
    spec.costs = _costs(forward_per_row=1e-4, draft=2e-4)  # a verify row costs a tenth of a step
    _observe(spec.acceptance, 0, 7, 7, 20)  # slot 0: the drafter is always right
    _observe(spec.acceptance, 1, 7, 0, 20)  # slot 1: always wrong
    assert spec.choose(seqs, 24) == [7, 0]
    assert spec.choose(seqs[::-1], 24) == [0, 7]
    spec.costs = _costs(forward_per_row=1e-3, draft=5e-3)  # rows and drafts cost a whole step: never pays
    assert spec.choose(seqs, 24) == [0, 0]
    spec.costs = _costs(forward_per_row=1e-4, draft=2e-4)
    assert spec.choose(seqs, 3) == [3, 0]  # the step's rows left bound the drafts
    assert spec.choose([_seq(0, generated=99)], 24) == [0]  # nothing left to generate after the next token


def _best_prefix_reference(spec, decode, limits, rows_left):
    """Draft rows one at a time in order of expected gain, keeping the prefix with the most tokens per second:
    the search `_best_drafts` makes, without its early bound."""
    c, n = spec.costs, len(decode)
    rows = sorted(((-p, i, j) for i, s in enumerate(decode)
                   for j, p in enumerate(spec.acceptance.survival(s.slot, limits[i]))))[:max(rows_left, 0)]
    best, best_at, ks, tokens = n / (c.forward(n) + c.residual(PLAIN, n)), 0, [0] * n, 0.0
    for taken, (neg_p, i, _) in enumerate(rows, 1):
        ks[i] += 1
        tokens -= neg_p
        drafting = [j for j, k in enumerate(ks) if k]
        waiting = sum(spec.waiting_rows(decode[j].slot) for j in drafting)
        t = c.forward(n + taken) + c.draft(len(drafting)) + c.append(waiting) + c.residual(DRAFTING, n)
        if (n + tokens) / t > best:
            best, best_at = (n + tokens) / t, taken
    out = [0] * n
    for _, i, _ in rows[:best_at]:
        out[i] += 1
    return out


def test_best_drafts_bound_never_changes_the_choice(tiny_dflash_seq_artifact):
    engine = _engine(tiny_dflash_seq_artifact)
    spec, rng = engine.spec, torch.Generator().manual_seed(5)
    seqs = [_seq(i) for i in range(3)]
    drafted = 0
    for trial in range(60):
        spec.costs = _costs(forward_per_row=float(torch.rand(1, generator=rng)) * 1e-3,
                            draft=float(torch.rand(1, generator=rng)) * 4e-3)
        spec.costs.record(DRAFTING, 0.0, float(torch.rand(1, generator=rng)) * 2e-3, n=3)
        spec.acceptance = AcceptanceModel(3, spec.block - 1)
        for slot in range(3):
            _observe(spec.acceptance, slot, 7, int(torch.randint(0, 8, (1,), generator=rng)), 5)
        limits, rows_left = [7, 7, 5], int(torch.randint(0, 24, (1,), generator=rng))
        got = spec._best_drafts(seqs, limits, rows_left)
        assert got == _best_prefix_reference(spec, seqs, limits, rows_left), f"trial {trial}"
        drafted += any(got)
    assert 10 < drafted < 50  # both outcomes occur: the bound is exercised on each side


def test_acceptance_estimates_shrink_towards_the_global_one():
    model = AcceptanceModel(n_slots=3, k_max=4)
    assert model.survival(2, 2) == pytest.approx([0.6, 0.36])  # nothing seen yet: the prior
    _observe(model, 0, 4, 0, 10)
    _observe(model, 1, 4, 4, 30)
    low, high, fresh = model.survival(0, 4)[0], model.survival(1, 4)[0], model.survival(2, 4)[0]
    assert low < 0.35 < fresh < 0.85 < high  # a new sequence starts from what all sequences showed
    model.reset(1)
    assert model.survival(1, 4) == model.survival(2, 4)


def test_acceptance_estimates_for_every_k_come_from_one_pass_per_observation():
    """`expected(slot, k)` is the sum of `survival(slot, k)`, and survival(k) is the first k of survival(k_max),
    for every k: the choice reads several k of each sequence per step from one pass over its rows."""
    model = AcceptanceModel(n_slots=2, k_max=6)
    for accepted in (6, 0, 3, 2):
        model.observe(0, 6, accepted)
    for _ in range(2):  # before and after another observation (every estimate computed again)
        full = model.survival(0, 6)
        for k in range(7):
            assert model.survival(0, k) == full[:k]
            assert model.expected(0, k) == sum(full[:k])
        assert model.expected(1, 6) == sum(model.survival(1, 6)) > 0.0
        model.observe(1, 6, 1)
    assert model.survival(0, 6) != full  # the global rates moved with slot 1's observation


def test_steps_until_due_counts_the_plain_steps_before_a_probe_is_due():
    """What a kept plain step relies on: after exactly `steps_until_due` plain steps `due` holds, not before,
    whatever the wait, the step's floor or the floor a costly probe left."""
    probes = ProbeSchedule(n_slots=1, start=3, cap=16)
    for paid, probe_floor, floor in ((True, 0.0, 0.0), (False, 0.0, 5.5), (False, 9.25, 2.0), (False, 0.0, 0.0)):
        probes.drafted(0)
        probes.probed(0, paid=paid, floor=probe_floor)
        for _ in range(2):
            left = probes.steps_until_due(0, floor)
            for _ in range(max(left, 0)):
                assert not probes.due(0, 1.0, floor=floor)
                probes.plain(0)
            assert probes.due(0, 1.0, floor=floor) and probes.steps_until_due(0, floor) <= 0


def test_probes_back_off_while_drafting_does_not_pay():
    probes = ProbeSchedule(n_slots=1, start=2, cap=8)
    waits = []
    for outcome in (False, False, False, False, True):
        n = 0
        while not probes.due(0):
            probes.plain(0)
            n += 1
        waits.append(n)
        probes.drafted(0)
        probes.probed(0, paid=outcome)
    assert waits == [2, 4, 8, 8, 8]
    n = 0
    while not probes.due(0):
        probes.plain(0)
        n += 1
    assert n == 2  # a probe that paid: back to the start
    probes.drafted(0)
    probes.probed(0, paid=False, floor=20.5)  # a costly probe: its floor outlasts the doubled wait
    n = 0
    while not probes.due(0):
        probes.plain(0)
        n += 1
    assert n == 21  # the floor's 20.5 steps, not the doubled wait's 4


def _plain_steps_then_probe(spec, seq, steps: int, probe_s=None) -> list[int]:
    """`steps` rounds of choose -> observe (every probe rejected) -> step_done, each step timed as the cost
    model predicts it (a probe's step as `probe_s` when given); the k chosen each round."""
    c, chosen = spec.costs, []
    for _ in range(steps):
        k = spec.choose([seq], 24)[0]
        chosen.append(k)
        spec.observe(seq, k, 0)
        predicted = c.forward(1 + k) + (c.draft(1) if k else 0.0)
        spec.step_done(probe_s if k and probe_s is not None else predicted, 1 + k)
    return chosen


def _rejecting(tiny_dflash_seq_artifact, costs, config=ROUND_PROBES):
    """A speculator whose drafts were rejected many times (drafting never pays by the estimates), timed by
    `costs` alone (no timed calls)."""
    engine = _engine(tiny_dflash_seq_artifact, config)
    spec, seq = engine.spec, _seq(0)
    engine.runner.call_log = None
    spec.costs = costs
    for _ in range(30):
        spec.acceptance.observe(seq.slot, 4, 0)
    return spec, seq


def test_adaptive_probes_a_sequence_kept_at_plain_steps(tiny_dflash_seq_artifact):
    spec, seq = _rejecting(tiny_dflash_seq_artifact, _costs(forward_per_row=5e-5, draft=1e-4))
    chosen = _plain_steps_then_probe(spec, seq, 30)
    assert chosen == [0] * 8 + [4] + [0] * 16 + [4] + [0] * 4  # a cheap probe after 8 plain steps, then 16
    assert (spec.stats.probes, spec.stats.probes_paid) == (2, 0)  # both counted, neither accepted a draft


def test_a_probe_that_accepts_enough_counts_as_paid(tiny_dflash_seq_artifact):
    """`SpecStats.probes` counts every round probe, `probes_paid` those whose accepted drafts paid for their
    step's extra time; a round of a sequence the estimates let draft is no probe."""
    spec, seq = _rejecting(tiny_dflash_seq_artifact, _costs(forward_per_row=5e-5, draft=1e-4))
    c = spec.costs
    for accepted in (0, 4):  # a probe that accepts nothing, then (8 plain steps on) one that accepts all four
        k = 0
        while not k:
            k = spec.choose([seq], 24)[0]
            if not k:
                spec.observe(seq, 0, 0)
                spec.step_done(c.forward(1), 1)
        spec.observe(seq, k, accepted)
        spec.step_done(c.forward(1 + k) + c.draft(1), 1 + k)
    assert (spec.stats.probes, spec.stats.probes_paid, spec.stats.rounds) == (2, 1, 2)
    # The paid probe reset the wait and raised the estimates: once a sequence drafts by them, no probe is counted.
    spec.acceptance.reset(seq.slot)
    for _ in range(30):
        spec.acceptance.observe(seq.slot, 4, 4)
    k = spec.choose([seq], 24)[0]
    assert k > 0 and seq.slot not in spec._probing
    spec.observe(seq, k, k)
    spec.step_done(c.forward(1 + k) + c.draft(1), 1 + k)
    assert (spec.stats.probes, spec.stats.rounds) == (2, 3)


def test_probes_stay_within_their_budget_of_plain_decoding(tiny_dflash_seq_artifact):
    # A probe costs 4.5 plain-step tokens here (4 verify rows and a draft call at 1 + 4 + 5 ms, plain steps
    # at 2 ms): the first waits 4.5 / PROBE_BUDGET = 90 steps, not 8.
    spec, seq = _rejecting(tiny_dflash_seq_artifact, _costs(forward_per_row=1e-3, draft=5e-3))
    assert spec_module.PROBE_BUDGET == 0.05
    chosen = _plain_steps_then_probe(spec, seq, 100)
    assert 90 <= chosen.index(4) <= 91 and chosen.count(4) == 1  # 90 plain steps (91 with float rounding)
    # A cheap probe by the estimates whose step measured 20 ms more than a plain one: the next waits for that.
    spec, seq = _rejecting(tiny_dflash_seq_artifact, _costs(forward_per_row=5e-5, draft=1e-4))
    chosen = _plain_steps_then_probe(spec, seq, 200, probe_s=0.021)
    assert chosen.index(4) == 8 and chosen.count(4) == 1  # by the prediction alone the next came 16 later


def test_a_first_probe_is_priced_by_how_far_earlier_probes_overran_their_prediction(tiny_dflash_seq_artifact):
    """A probe whose step took far longer than predicted (its context append, the wait for the step in flight:
    what blank-call tables miss) makes the next sequence's first probe wait accordingly (at most
    PROBE_OVERRUN_MAX times its predicted floor), not only its own next one."""
    costs = _costs(forward_per_row=5e-5, draft=1e-4)
    assert costs.probe_overrun() == 1.0
    spec, seq = _rejecting(tiny_dflash_seq_artifact, costs)
    chosen = _plain_steps_then_probe(spec, seq, 9)
    assert chosen.index(4) == 8  # its floor, 5.7 steps (1.05 ms plain steps, 0.3 ms over one), under the wait's 8
    assert costs.probe_overrun() == pytest.approx(1.0)  # a probe timed as predicted
    spec, first = _rejecting(tiny_dflash_seq_artifact, costs)
    spec.trace = []
    _plain_steps_then_probe(spec, first, 9, probe_s=0.021)  # 20 ms over a plain step, where 0.3 ms was predicted
    # One such probe among two judged is not enough: read with a third as predicted, the median is 1.
    assert costs.probe_overrun() == pytest.approx(1.0)
    judged = [e for e in spec.trace if "probe_overrun" in e]  # the trace says what the probe cost and did
    assert len(judged) == 1 and judged[0]["probe_overrun"] == pytest.approx(1.0)
    over, predicted = judged[0]["probe_extra"]
    assert over == pytest.approx(0.021 - 1.05e-3, rel=0.05) and predicted == pytest.approx(3e-4, rel=0.05)
    spec.trace = None
    spec, second = _rejecting(tiny_dflash_seq_artifact, costs)
    second = _seq(2)
    for _ in range(30):
        spec.acceptance.observe(second.slot, 4, 0)
    _plain_steps_then_probe(spec, second, 9, probe_s=0.021)  # a second one: the median of 1, 66.5, 66.5
    assert costs.probe_overrun() == spec_module.PROBE_OVERRUN_MAX  # at most 4
    spec, other = _rejecting(tiny_dflash_seq_artifact, costs)
    other = _seq(1)
    for _ in range(30):
        spec.acceptance.observe(other.slot, 4, 0)
    chosen = _plain_steps_then_probe(spec, other, 40)
    assert 22 <= chosen.index(4) <= 24  # 4 x 5.7 steps
    fresh = _costs(forward_per_row=5e-5, draft=1e-4)
    fresh.record_probe(1e-3, 1e-5, 1e-3)  # predicted at 1% of a plain step: its ratio would be noise, no sample
    assert fresh.probe_overrun() == 1.0
    fresh.record_probe(0.5e-4, 1e-3, 1e-3)  # probes faster than predicted never make probing more frequent
    assert fresh.probe_overrun() == 1.0


def test_the_probe_overrun_persists_for_the_next_process_and_a_bad_file_is_not_trusted(tiny_dflash_seq_artifact):
    """What probes really cost is kept next to the cost tables: an engine of a later process (here: the
    process-wide knowledge cleared) on the same program and settings starts from it; a damaged file is read as
    none and written whole again after the next judged probe. The file is written at the process's exit
    (`HostWork.save_overrun`, registered with atexit), not during steps."""
    costs = _engine(tiny_dflash_seq_artifact, ROUND_PROBES).spec.costs
    path = costs._host.overrun_file
    assert path is not None and not path.exists() and costs.probe_overrun() == 1.0
    for ratio in (3.0, 2.5, 3.5):
        assert costs.record_probe(ratio * 1e-3, 1e-3, 1e-3)
    assert costs.probe_overrun() == pytest.approx(3.0)
    assert not path.exists()  # no file I/O while steps run
    costs._host.save_overrun()  # what the process's exit runs
    assert json.loads(path.read_text()) == pytest.approx([3.0, 2.5, 3.5])
    assert not costs.record_probe(1e-3, 1e-5, 1e-3)  # no sample, nothing to write
    path.write_text("[3.0,2.5,3.5]")  # (json.dumps would space it)
    costs._host.save_overrun()
    assert path.read_text() == "[3.0,2.5,3.5]"  # nothing judged since it was written: not written again
    spec_module._HOST_WORK.clear()  # a new process
    later = _engine(tiny_dflash_seq_artifact, ROUND_PROBES).spec.costs
    assert later.probe_overrun() == pytest.approx(3.0)  # from its first probe on
    assert _engine(tiny_dflash_seq_artifact, RunConfig(probes="shadow")).spec.costs._host.overrun_file != path
    for damaged in ("[3.0, 2.5", '{"a": 1}', '[3.0, "x"]', "[3.0, -1.0]", "[NaN]", "[true]"):
        path.write_text(damaged)
        spec_module._HOST_WORK.clear()
        fresh = _engine(tiny_dflash_seq_artifact, ROUND_PROBES).spec.costs
        assert fresh.probe_overrun() == 1.0, damaged
    fresh.record_probe(2e-3, 1e-3, 1e-3)
    fresh._host.save_overrun()
    assert json.loads(path.read_text()) == pytest.approx([2.0])


def _plain_until_probe_due(spec, seq, most: int = 1000) -> None:
    """Plain steps of `seq` (each chosen so) until its probe is due; fails after `most`."""
    for _ in range(most):
        if spec.probes.due(seq.slot, 1.0):
            return
        assert spec.choose([seq], 24) == [0]
        spec.observe(seq, 0, 0)
        spec.step_done(1e-3, 1)
    raise AssertionError(f"no probe due after {most} plain steps")


def test_a_probe_waits_for_a_step_without_prompt_chunks_where_rounds_fuse(tiny_dflash_seq_artifact):
    """A probe that falls due in a step with prompt chunks runs in the next step without them, as a fused round
    (the prompt step would run it as separate calls); without fused rounds it rides the prompt step as before."""
    for fused in (True, False):
        engine = _engine(tiny_dflash_seq_artifact, RunConfig(fused_rounds=fused, probes="round"))
        spec, seq = engine.spec, _seq(0)
        engine.runner.call_log = None
        costs = _costs(forward_per_row=5e-5, draft=1e-4)
        spec.costs = CostModel(costs.tables["forward"], costs.tables["draft"], costs.tables["append"],
                               padded=False, rounds={fr.name: {1: 1e-3 + 1e-4 + 5e-5 * fr.block}
                                                     for fr in spec.rounds})
        assert bool(spec.rounds) is fused
        for _ in range(30):
            spec.acceptance.observe(seq.slot, 4, 0)
        _plain_until_probe_due(spec, seq)
        if fused:
            priced = spec._best_drafts
            spec._best_drafts = None  # a step whose prompt chunks leave no row prices nothing
            assert spec.choose([seq], 0, prefill=True) == [0] and spec._prediction == (0, 0)
            spec.step_done(2e-3, 5, prefill=True)
            spec._best_drafts = priced
            assert spec.choose([seq], 20, prefill=True) == [0]  # prompt chunks may join: the probe waits
            spec.observe(seq, 0, 0)
            spec.step_done(2e-3, 5, prefill=True)
            ks = spec.choose([seq], 24)
            assert ks[0] > 0 and spec._round_now is not None and spec._probing == {seq.slot}  # fused probe
            spec.observe(seq, ks[0], 0)
            spec.step_done(5e-3, 1 + ks[0])
            # Prompts admitted back to back: the next due probe waits PROBE_WAIT steps with prompt chunks, no more.
            _plain_until_probe_due(spec, seq)
            for waited in range(spec_module.PROBE_WAIT + 2):  # (bounded: a probe that never rides fails, not hangs)
                ks = spec.choose([seq], 20, prefill=True)
                if ks[0]:
                    break
                spec.observe(seq, 0, 0)
                spec.step_done(2e-3, 5, prefill=True)
            assert ks[0] > 0 and waited == spec_module.PROBE_WAIT and spec._probing == {seq.slot} and spec._round_now is None
        else:
            ks = spec.choose([seq], 20, prefill=True)
            assert ks[0] > 0 and spec._probing == {seq.slot}  # no fused round to wait for: it rides the step


def _shadows_everywhere(engine, monkeypatch) -> list:
    """Make `engine` keep every sequence at plain steps and probe in the shadow whenever it may (every step once
    the last probe is judged); -> a list that gets, per shadow launched, (request id, anchor position, the
    sequence's n_cached then, its drafts)."""
    spec = engine.spec
    monkeypatch.setattr(spec_module, "PROBE_BUDGET", 1e9)
    spec.probes = ProbeSchedule(engine.cache.n_slots, start=1, cap=1)
    spec._best_drafts = lambda decode, limits, rows_left: [0] * len(decode)
    launched, drafts_of = [], spec._shadow_drafts

    def recorded(seqs):
        out = drafts_of(seqs)
        for seq, row in zip(seqs, out.tolist()):
            launched.append((seq.request.id, len(seq.tokens) - 1, seq.n_cached, row))
        return out

    spec._shadow_drafts = recorded
    return launched


@pytest.mark.parametrize("which", LAYOUTS)
def test_shadow_probes_observe_what_a_round_there_would_accept(which, request, tiny_cfg, monkeypatch):
    """A shadow probe observes what greedy acceptance of its drafts would take: the longest prefix equal to the
    tokens that followed its anchor (fewer compared where the sequence ended first). A drafter that knows the
    output proposes (anchor mod 4) right tokens, then wrong ones; the output stays target-only's."""
    art = request.getfixturevalue(which)
    reqs = _requests(_prompts(tiny_cfg.vocab_size)[1:4], 30, ignore_eos=True)
    reference = _tokens(_engine(art, TARGET_ONLY), reqs)
    text = {r.id: list(r.prompt) + list(o) for r, o in zip(reqs, reference)}
    engine = _engine(art, SHADOW_PROBES)
    spec, observed = engine.spec, []
    width, vocab = spec.block - 1, tiny_cfg.vocab_size

    def knowing(seqs, anchors):
        rows = []
        for seq, anchor in zip(seqs, anchors):
            ahead = text[seq.request.id][anchor + 1:anchor + 1 + width]
            right = anchor % 4
            rows.append([t if j < right else (t + 1) % vocab for j, t in enumerate(ahead)] + [0] * (width - len(ahead)))
        return torch.tensor(rows)

    spec.proposer.block_at = knowing
    launched = _shadows_everywhere(engine, monkeypatch)
    observe = spec.acceptance.observe
    spec.acceptance.observe = lambda slot, k, accepted: (observed.append((k, accepted)), observe(slot, k, accepted))
    assert _tokens(engine, reqs) == reference
    assert engine.spec_stats.rounds == 0 and engine.spec_stats.shadow_probes == len(launched) >= 6
    want = []
    for rid, anchor, n_cached, _ in launched:
        assert anchor == n_cached  # nothing in flight without overlap: anchored at the pending token
        compared = len(text[rid][anchor + 1:anchor + 1 + width])
        want.append((compared, min(anchor % 4, compared)))
    assert sorted(observed) == sorted(want) and any(a for _, a in want) and any(k < width for k, _ in want)
    assert engine.spec_stats.shadow_accepted == sum(a for _, a in want)


@pytest.mark.parametrize("which", LAYOUTS)
def test_shadow_probe_drafts_ignore_context_rows_past_their_anchor(which, request, tiny_cfg):
    """A shadow probe launched while a step is in flight appends that step's rows too (the drafter's context
    then runs past its anchor): the drafts depend only on the rows before the anchor."""
    art = request.getfixturevalue(which)
    engine = _engine(art)
    spec = engine.spec
    spec.choose = lambda decode, rows_left, prefill=False: [0] * len(decode)
    engine.submit(_requests(_prompts(tiny_cfg.vocab_size)[2:3], 20, ignore_eos=True)[0])
    for _ in range(4):
        engine.step()
    seq = engine.scheduler.running[0]
    spec._append_rows([seq.slot])
    anchor = seq.n_cached
    before = spec.proposer.block_at([seq], [anchor]).tolist()
    engine.step()  # one more committed row, at the anchor's position, appended below
    spec._append_rows([seq.slot])
    assert spec.context_length(seq.slot) == anchor + 1
    then = type("Then", (), {"tokens": seq.tokens[:anchor + 1], "slot": seq.slot})()
    assert spec.proposer.block_at([then], [anchor]).tolist() == before


@pytest.mark.parametrize("which", LAYOUTS)
def test_shadow_probes_with_steps_in_flight_keep_greedy_output(which, request, tiny_cfg, monkeypatch):
    """Overlapped plain steps (on the CPU too when asked): shadow probes launch with a step in flight, anchored
    at the last token the host has; their drafts are those of a block anchored there in an engine with nothing
    in flight, each probe is judged, and the output is target-only's."""
    art = request.getfixturevalue(which)
    reqs = _requests(_prompts(tiny_cfg.vocab_size)[1:4], 30, ignore_eos=True)
    engine = _engine(art, RunConfig(overlap=True, probes="shadow"))
    launched = _shadows_everywhere(engine, monkeypatch)
    assert _tokens(engine, reqs) == _tokens(_engine(art, TARGET_ONLY), reqs)
    assert engine.stats.overlapped_steps > 0 and engine.spec_stats.rounds == 0
    assert any(anchor < n_cached for _, anchor, n_cached, _ in launched)  # a step was in flight
    assert engine.spec_stats.shadow_probes == len(launched) and not engine.spec._shadows  # all judged
    # The reference: plain steps read back at once; after each, the block anchored at each sequence's last token.
    ref_engine = _engine(art, RunConfig(overlap=False))
    spec, wanted, reference = ref_engine.spec, {(rid, anchor) for rid, anchor, _, _ in launched}, {}
    spec.choose = lambda decode, rows_left, prefill=False: [0] * len(decode)
    end_commits = spec.end_commits

    def drafting_where_wanted():
        end_commits()
        for seq in ref_engine.scheduler.running:
            key = (seq.request.id, len(seq.tokens) - 1)
            if key in wanted:
                spec._append_rows([seq.slot])
                reference[key] = spec.proposer.block_at([seq], [key[1]]).tolist()[0]

    spec.end_commits = drafting_where_wanted
    _tokens(ref_engine, reqs)
    compared = [(drafts, reference[(rid, anchor)]) for rid, anchor, _, drafts in launched if (rid, anchor) in reference]
    assert len(compared) >= len(launched) - len(reqs) and all(got == want for got, want in compared)


def test_probes_setting_is_checked_and_round_probes_are_the_default():
    with pytest.raises(ValueError, match="probes is 'sometimes'; allowed: shadow | round"):
        RunConfig(probes="sometimes")
    assert not RunConfig().shadow_probes and not RunConfig(device="cuda").shadow_probes
    assert RunConfig(probes="shadow").shadow_probes and RunConfig(device="cuda", probes="shadow").shadow_probes


def test_cost_model_interpolates_and_corrects_online():
    costs = CostModel({1: 1.0, 2: 2.0, 4: 3.0}, {1: 0.5}, {1: 0.1}, padded=False)
    assert costs.forward(3) == 2.5 and costs.forward(8) == 6.0 and costs.forward(0) == 0.0
    assert CostModel({1: 1.0, 2: 2.0, 4: 3.0}, {1: 0.5}, {1: 0.1}, padded=True).forward(3) == 3.0
    for _ in range(50):  # calls of 3 rows really take 5.0 (2x blank): the 4-row entry moves so that forward(3) = 5
        costs.observe("forward", 3, 5.0)
    assert costs.forward(3) == pytest.approx(5.0, rel=1e-3)
    assert costs.forward(1) == pytest.approx(2.0, rel=1e-3)  # never timed: blank time x the measured ratio



def test_a_stalled_first_call_of_a_bucket_does_not_set_its_price():
    """A bucket's first timed call sets its entry outright, unless it took more than STALL_RATIO times its
    price: that call is left out (the ratio for untimed buckets too), and the bucket's next call sets the
    entry whatever it takes, so a cost that lasts is learnt one call later."""
    costs = CostModel({1: 1.0, 2: 2.0, 4: 3.0}, {1: 0.5}, {1: 0.1}, padded=True)
    costs.observe("forward", 4, 30.0)  # a stall: 10x
    assert (costs.forward(4), costs.forward(1)) == (3.0, 1.0)
    costs.observe("forward", 4, 3.3)
    assert costs.forward(4) == pytest.approx(3.3) and costs.forward(1) == pytest.approx(1.02)
    costs.observe("forward", 4, 30.0)  # a seen bucket: one call moves it a step (smoothing), as before
    assert costs.forward(4) == pytest.approx(3.3 + 0.2 * 26.7)
    slow = CostModel({1: 1.0, 2: 2.0, 4: 3.0}, {1: 0.5}, {1: 0.1}, padded=True)
    slow.observe("forward", 4, 9.0)  # really 3x its blank time: left out once, then learnt
    slow.observe("forward", 4, 9.0)
    assert slow.forward(4) == pytest.approx(9.0)


def test_host_work_is_the_median_of_recent_steps_per_kind_and_batch():
    costs = CostModel({1: 1.0}, {1: 0.5}, {1: 0.1}, padded=False, window=5, min_samples=3)
    assert costs.residual(PLAIN) == costs.residual(DRAFTING) == costs.residual(FUSED) == 0.0  # unseen: priced low
    costs.record(PLAIN, predicted=1.0, measured=1.9)  # a kind's first steps (lazy work) price it no higher
    costs.record(PLAIN, predicted=1.0, measured=1.5)
    assert costs.residual(PLAIN) == 0.0
    costs.record(PLAIN, predicted=1.0, measured=1.5)
    assert costs.residual(PLAIN) == costs.residual(DRAFTING) == costs.residual(FUSED) == 0.5  # unseen: plain's
    for _ in range(3):
        costs.record(DRAFTING, predicted=1.0, measured=3.0)
    assert costs.residual(DRAFTING) == 2.0
    for _ in range(2):  # fewer than min_samples: no more than the unseen price (a plain step's)
        costs.record(FUSED, predicted=1.0, measured=2.0)
    assert costs.residual(FUSED) == 0.5
    for _ in range(3):  # a fused round's own host work stands, below a plain step's
        costs.record(FUSED, predicted=1.0, measured=1.1)
    assert costs.residual(FUSED) == pytest.approx(0.1) and costs.residual(PLAIN) == 0.5
    for _ in range(3):
        costs.record(DRAFTING, predicted=1.0, measured=1.0)
    assert costs.residual(DRAFTING) == 0.5  # median 0.0, never below the plain step's
    for measured in (1.2, 1.2, 9.0, 1.2):  # one slow step among them moves nothing
        costs.record(FUSED, predicted=1.0, measured=measured)
    assert costs.residual(FUSED) == pytest.approx(0.2)
    for _ in range(5):  # the window forgets: fused rounds got slower
        costs.record(FUSED, predicted=1.0, measured=2.0)
    assert costs.residual(FUSED) == pytest.approx(1.0)
    # Steps of 20 sequences do more host work; they teach steps of 17-32 sequences, not of one.
    for _ in range(3):
        costs.record(PLAIN, predicted=1.0, measured=4.0, n=20)
    assert costs.residual(PLAIN, 20) == costs.residual(PLAIN, 32) == 3.0 and costs.residual(PLAIN, 16) == 0.0
    assert costs.residual(PLAIN, 1) == 0.5 and costs.residual(FUSED, 20) == 3.0


def test_host_work_window_median_equals_the_median_of_its_values():
    """`_Window` keeps its median as values come and go (a sorted copy): the same number as the median of the
    last `size` values taken after the reading asked for, with readings that never decrease."""
    import random
    import statistics

    rng = random.Random(7)
    for size in (1, 2, 5, 33):
        window, values, after = spec_module._Window(size), [], 0
        for reading in range(1, 400):
            value = rng.choice([rng.uniform(-1.0, 1.0), 0.25, -0.5])  # repeats too: removal must find one
            window.append(value, reading)
            values = (values + [(reading, value)])[-size:]
            if rng.random() < 0.3:
                after = max(after, reading - rng.randint(0, 2 * size))
            counted = [v for r, v in values if r > after]
            assert window.median(after) == (len(counted), statistics.median(counted) if counted else 0.0)
            assert len(window) == len([1 for r, _ in values if r > after])


def test_a_stall_of_plain_steps_prices_nothing():
    """A plain step timed at more than STALL_RATIO times a plain step's price (prediction + the window's median)
    is no sample: the machine stalled, and rounds, not timed meanwhile, would keep their price while plain
    steps looked slow. The timed steps still count on the bucket's clock. A change under the ratio that lasts
    is followed; a fresh window takes its first samples whatever they are (a plain step's host work may be as
    long as its forward); slow rounds are kept."""
    costs = CostModel({1: 1.0}, {1: 0.5}, {1: 0.1}, padded=False, window=5, min_samples=3, plain_window=5)
    assert all(costs.record(PLAIN, predicted=1.0, measured=1.2) for _ in range(5))
    assert costs.residual(PLAIN) == pytest.approx(0.2)
    kept = [costs.record(PLAIN, predicted=1.0, measured=m) for m in (13.0, 5.0, 3.0, 2.5, 2.1, 2.05)]
    assert kept == [False, False, False, False, True, True]  # above 2 x 1.2 s: a stall; 4 of the 11 steps
    assert costs.residual(PLAIN) == pytest.approx(0.2) and costs._host.clock[1] == 11
    for _ in range(3):  # plain steps that stay slower (under the ratio): followed
        assert costs.record(PLAIN, predicted=1.0, measured=2.0)
    assert costs.residual(PLAIN) == pytest.approx(1.0)
    assert all(costs.record(PLAIN, predicted=1.0, measured=2.3, n=3) for _ in range(3))  # a fresh window: kept
    assert costs.residual(PLAIN, 3) == pytest.approx(1.3)
    for _ in range(3):
        assert costs.record(FUSED, predicted=1.0, measured=5.0)  # a slow round is kept
    assert costs.residual(FUSED) == pytest.approx(4.0)


def test_plain_steps_priced_by_old_samples_are_measured_again():
    """A plain step priced high by old samples (an engine's first steps) would never be chosen again while
    rounds win by that price, and never corrected: its samples older than `plain_age` timed steps at the
    bucket stop counting, so it is priced as unseen (no host work), chosen and measured again. Rounds' samples
    do not age."""
    costs = CostModel({1: 1.0}, {1: 0.5}, {1: 0.1}, padded=False, window=9, min_samples=3, plain_age=10)
    for _ in range(3):
        costs.record(PLAIN, predicted=1.0, measured=2.0)  # clock 1-3
    for _ in range(7):
        costs.record(FUSED, predicted=1.0, measured=1.5)  # clock 4-10: rounds only
    assert costs.residual(PLAIN) == 1.0 and costs.residual(FUSED) == 0.5
    costs.record(FUSED, predicted=1.0, measured=1.5)  # clock 11: the first plain sample is too old
    assert costs.residual(PLAIN) == 0.0  # two samples left, fewer than min_samples: the unseen price
    for _ in range(3):
        costs.record(PLAIN, predicted=1.0, measured=1.4)  # measured again: cheaper than the old samples said
    assert costs.residual(PLAIN) == pytest.approx(0.4)  # median of 1.0, 1.0, 0.4, 0.4, 0.4
    for _ in range(40):
        costs.record(PLAIN, predicted=1.0, measured=1.4)
    assert costs.residual(FUSED) == 0.5  # 40 steps later: rounds keep theirs
    assert costs.residual(PLAIN, 2) == 0.0  # other buckets have clocks of their own


def test_cost_model_never_predicts_a_larger_call_cheaper():
    costs = CostModel({1: 1.0, 2: 2.0, 4: 3.0, 8: 4.0}, {1: 0.5}, {1: 0.1}, padded=False)
    costs.observe("forward", 4, 1.5)  # one quick call at 4 rows: the 4-row entry drops below the 2-row one
    table = costs.tables["forward"]
    assert table[4] == 1.5 < table[2] == pytest.approx(1.8)  # untimed entries follow the measured/blank ratio 0.9
    sizes = range(1, 12)
    assert all(costs.forward(a) <= costs.forward(b) for a, b in zip(sizes, sizes[1:]))
    assert costs.forward(4) == table[2]  # the dip is cut at the 2-row time, then rises to the 8-row one
    assert costs.forward(6) == pytest.approx((table[2] + table[8]) / 2)


def test_adaptive_stops_drafting_a_drafter_that_never_agrees(tiny_dflash_seq_artifact, tiny_cfg):
    reqs = _requests(_prompts(tiny_cfg.vocab_size)[:3], 40, ignore_eos=True)
    reference = _tokens(_engine(tiny_dflash_seq_artifact, TARGET_ONLY), reqs)
    engine = _engine(tiny_dflash_seq_artifact,
                     proposer=Oracle({r.id: out for r, out in zip(reqs, reference)}, wrong=True,
                                     vocab=tiny_cfg.vocab_size))
    assert _tokens(engine, reqs) == reference
    hist = engine.spec_stats.chosen_k_hist
    assert hist[0] > 0.8 * sum(hist)  # after a few rejected rounds, mostly plain decode steps


# ------------------------------------------------------------------ engines, config and CLI


def test_two_engines_on_one_program_keep_their_own_caches(tiny_dflash_seq_artifact, tiny_cfg):
    art = load_artifact(tiny_dflash_seq_artifact)
    prompts = _prompts(tiny_cfg.vocab_size)
    a, b = Engine(art, FIXED), Engine(art, TARGET_ONLY)
    a.submit(Request("a", prompts[2], 12, ignore_eos=True))
    b.submit(Request("b", prompts[4], 12, ignore_eos=True))
    while not (a.scheduler.idle and b.scheduler.idle):  # interleaved steps on one loaded program
        for e in (a, b):
            if not e.scheduler.idle:
                e.step()
    alone_a = _tokens(_engine(tiny_dflash_seq_artifact, FIXED), [Request("a", prompts[2], 12, ignore_eos=True)])
    alone_b = _tokens(_engine(tiny_dflash_seq_artifact, TARGET_ONLY), [Request("b", prompts[4], 12, ignore_eos=True)])
    assert [r.tokens for r in a.take_finished()] == alone_a and [r.tokens for r in b.take_finished()] == alone_b


@pytest.mark.parametrize("block", [0, 1, 99])
def test_draft_block_outside_the_exported_range_is_refused(tiny_dflash_seq_artifact, block):
    with pytest.raises(DFlashError, match="--draft-block is"):
        Engine(load_artifact(tiny_dflash_seq_artifact), RunConfig(draft_block=block))
    result = CliRunner().invoke(main, [str(tiny_dflash_seq_artifact), "--prompt", "x", "--draft-block", str(block)])
    assert result.exit_code == 2 and "--draft-block is" in result.stderr


def test_unknown_speculation_policy_is_refused(tiny_dflash_seq_artifact):
    result = CliRunner().invoke(main, [str(tiny_dflash_seq_artifact), "--prompt", "x", "--speculation", "always"])
    assert result.exit_code == 2 and "'always' is not one of 'adaptive', 'fixed'" in result.stderr


def test_draft_section_disagreeing_with_constant_methods_is_refused(tmp_path, tiny_dflash_seq_artifact):
    art = tmp_path / "art"
    shutil.copytree(tiny_dflash_seq_artifact, art)
    m = json.loads((art / C.MANIFEST_FILE).read_text())
    m["draft"]["block_size"] = 4
    (art / C.MANIFEST_FILE).write_text(json.dumps(m))
    result = CliRunner().invoke(main, [str(art), "--prompt", "x"])
    assert result.exit_code == 2
    assert "get_block_size" in result.stderr and "returns 8" in result.stderr and "says 4" in result.stderr


@pytest.mark.parametrize("policy", ["adaptive", "fixed"])
def test_mg_run_reports_dflash_statistics(tmp_path, tiny_dflash_cell_artifact, policy):
    stats = tmp_path / "stats.json"
    result = CliRunner().invoke(main, [str(tiny_dflash_cell_artifact), "--prompt", "def f(x):", "--prompt", "a",
                                       "--max-new-tokens", "6", "--speculation", policy, "--stats-json", str(stats)])
    assert result.exit_code == 0, result.stderr
    assert f"DFlash ({policy})" in result.stderr and "mean acceptance length" in result.stderr
    data = json.loads(stats.read_text())
    assert data["dflash"] and data["speculation"] == policy
    assert sum(data["chosen_k_hist"]) > 0 and len(data["chosen_k_hist"]) <= 8
    assert 0 <= data["probes_paid"] <= data["probes"] <= data["rounds"]
    assert (f"{data['probes']} probes ({data['probes_paid']} paid)" in result.stderr) == (data["probes"] > 0)
    if policy == "fixed":
        assert data["rounds"] > 0 and data["mean_acceptance_length"] >= 1.0 and data["probes"] == 0


def test_the_run_summary_names_round_probes_when_there_were_some():
    from mg.runtime.serve import Summary

    base = dict(layout="cell", device="cpu", requests=1, failed=0, prompt_tokens=3, generated_tokens=9, steps=5,
                wall_s=0.1, tokens_per_s=90.0, dflash=True, speculation="adaptive", rounds=3, drafted_tokens=9,
                accepted_tokens=4, mean_acceptance_length=2.33, chosen_k_hist=(2, 0, 0, 3))
    assert "probes" not in Summary(**base).line()
    line = Summary(**base, probes=2, probes_paid=1).line()
    assert line.endswith("2 plain decode steps, 2 probes (1 paid)")


def test_cost_tables_are_kept_for_the_next_process_and_remeasured_when_unreadable(tiny_dflash_seq_artifact,
                                                                                    tmp_path, monkeypatch):
    import mg.runtime.speculative as S
    from mg.runtime.artifact import load_artifact
    from mg.runtime.engine import Engine
    from mg.runtime.model_runner import ModelRunner

    monkeypatch.setenv("MG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(S, "_COST_TABLES", {})  # as in a new process
    measured = []
    real = ModelRunner.measure
    monkeypatch.setattr(ModelRunner, "measure", lambda self, m, *a: measured.append(m) or real(self, m, *a))
    art = load_artifact(tiny_dflash_seq_artifact)
    first = Engine(art).spec.costs
    (saved,) = (tmp_path / "cost-tables").iterdir()
    assert len(measured) == 3
    S._COST_TABLES.clear()
    second = Engine(art).spec.costs
    assert len(measured) == 3 and second.tables == first.tables
    saved.write_text("{not json")
    S._COST_TABLES.clear()
    Engine(art)
    assert len(measured) == 6


def test_cost_tables_are_measured_again_by_newer_code(monkeypatch):
    key, cpu = ("digest", "cpu", False, False, False, None), torch.device("cpu")
    before = spec_module._tables_path(key, cpu)
    assert spec_module._tables_path(key, cpu) == before
    monkeypatch.setattr(spec_module, "_code_digest", lambda: "another version of the runtime")
    assert spec_module._tables_path(key, cpu) != before


def test_cost_tables_are_keyed_by_every_setting_that_changes_a_calls_kernels():
    """Tables measured with one setting are never read by an engine with another (an engine with row-invariant
    products had priced fused rounds at 1.55 plain steps where cuBLAS ones take 3.35)."""
    cuda = torch.device("cuda")
    base = RunConfig(device="cuda")
    settings = [dict(row_invariant=True), dict(rows_kernel=True), dict(int4_tensor_cores=True), dict(draft_tf32=False),
                dict(cublaslt=False), dict(compile=False), dict(cuda_graphs=False)]
    keys = {spec_module.cost_key("p", cuda, base, True, (16,))}
    for changed in settings:
        keys.add(spec_module.cost_key("p", cuda, RunConfig(**{"device": "cuda", **changed}), True, (16,)))
    keys |= {spec_module.cost_key("p", cuda, base, False, (16,)), spec_module.cost_key("p", cuda, base, True, (8,))}
    assert len(keys) == len(settings) + 3
    cpu = torch.device("cpu")  # on the CPU the setting changes the attention, not the products
    assert spec_module.cost_key("p", cpu, RunConfig(), None, (16,)) != spec_module.cost_key(
        "p", cpu, RunConfig(row_invariant=True), None, (16,))


def test_waiting_rows_one_row_commits_land_in_the_buffer_after_it_grows():
    """A lone sequence's plain steps commit one row each, the step's whole output, through one-row views of the
    buffer that are kept: rows committed before the buffer grows and after (when the kept views would point
    into the old buffer) all come back, in order."""
    from mg.runtime.speculative import WaitingRows

    wr = WaitingRows(12, 6, 2, torch.float32, torch.device("cpu"))
    row = lambda v: torch.tensor([[float(v), -float(v)]])  # noqa: E731
    for v in range(3):
        wr.put(row(v), [0], [(0, 1)])
    assert wr.take([0]).tolist() == [[0.0, -0.0], [1.0, -1.0], [2.0, -2.0]]
    for v in (3, 4):  # the same rows of slot 0's region again: through the kept views
        wr.put(row(v), [0], [(0, 1)])
    regions = wr.regions
    for slot in range(1, regions + 1):  # one slot more than the buffer has regions: it grows
        wr.put(row(100 + slot), [0], [(slot, 1)])
    assert wr.regions > regions
    for v in (5, 6):
        wr.put(row(v), [0], [(0, 1)])
    assert wr.take([0]).tolist() == [[float(v), -float(v)] for v in (3, 4, 5, 6)]
    assert wr.take([regions]).tolist() == [[100.0 + regions, -100.0 - regions]]


def test_waiting_rows_grown_to_all_slots_before_capture_never_move_again():
    """`grow_to_all_slots` (before graphs that write the buffer are captured): the waiting rows already there
    stay, the buffer moves once (one version), and every slot then takes a region without another move."""
    from mg.runtime.speculative import WaitingRows

    n_slots = 3 * WaitingRows.START_REGIONS
    wr = WaitingRows(n_slots, 4, 2, torch.float32, torch.device("cpu"))
    wr.put(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), [0, 1], [(5, 2)])
    version = wr.version
    wr.grow_to_all_slots()
    assert wr.regions == n_slots and wr.version == version + 1
    wr.grow_to_all_slots()
    assert wr.version == version + 1
    wr.reserve_one_each(list(range(n_slots)))
    assert wr.version == version + 1
    assert wr.take([5]).tolist()[:2] == [[1.0, 2.0], [3.0, 4.0]]


def test_waiting_rows_reserve_one_each_is_reserve_of_one_row_each():
    """A plain step's reservation (`reserve_one_each`, region bases kept per slot) names the rows `reserve` names
    for one row of each slot, through the buffer's growth and releases that free regions for other slots; a slot
    with a full share raises naming it and leaves every count as it was."""
    from mg.runtime.speculative import WaitingRows

    n_slots, rows = 20, 5
    fast = WaitingRows(n_slots, rows, 2, torch.float32, torch.device("cpu"))
    ref = WaitingRows(n_slots, rows, 2, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    for step in range(120):
        slots = torch.randperm(n_slots, generator=g)[:int(torch.randint(1, n_slots + 1, (1,), generator=g))].tolist()
        slots = [s for s in slots if ref.count[s] < rows]
        assert fast.reserve_one_each(slots) == ref.reserve([(s, 1) for s in slots])
        assert fast.count == ref.count
        if step % 4 == 0:
            for s in torch.randperm(n_slots, generator=g)[:3].tolist():
                fast.drop(s)
                ref.drop(s)
    assert fast.regions == ref.regions > WaitingRows.START_REGIONS
    while fast.count[0] < rows:  # slot 0's share full; slot 1 empty
        fast.reserve_one_each([0])
    fast.drop(1)
    full, other = 0, 1
    before = list(fast.count)
    with pytest.raises(RuntimeError, match=f"slot {full} has {rows} context rows waiting"):
        fast.reserve_one_each([other, full])
    assert fast.count == before


def test_waiting_rows_keep_each_slots_rows_in_order_through_growth_and_release():
    """The device buffer of waiting context rows against a plain per-slot list: random commits of one to all
    slots per step, their rows consecutive or apart in the step's output, appends of one, two or more slots
    (views or a gather), releases; the buffer grows past its first regions and reuses freed
    ones, and never holds more regions than slots."""
    from mg.runtime.speculative import WaitingRows

    n_slots, rows, width = 20, 12, 3
    wr = WaitingRows(n_slots, rows, width, torch.float32, torch.device("cpu"))
    assert wr.regions == WaitingRows.START_REGIONS
    want: dict[int, list] = {s: [] for s in range(n_slots)}
    g = torch.Generator().manual_seed(0)
    counter = 0
    for step in range(200):
        slots = torch.randperm(n_slots, generator=g)[:int(torch.randint(1, n_slots + 1, (1,), generator=g))].tolist()
        owners, src, hidden_rows = [], [], []
        for slot in slots:
            m = min(int(torch.randint(1, 4, (1,), generator=g)), rows - len(want[slot]))
            if m <= 0:
                continue
            owners.append((slot, m))
            for _ in range(m):
                if step % 2:  # rows apart in the step's output (a gather); else consecutive (copies or one scatter)
                    hidden_rows.append([-2, -2, -2])
                src.append(len(hidden_rows))
                hidden_rows.append([counter, slot, step])
                want[slot].append([counter, slot, step])
                counter += 1
        hidden = torch.tensor(hidden_rows + [[-1, -1, -1]] * 3, dtype=torch.float32)  # rows past src: ignored
        wr.put(hidden, src, owners)
        assert wr.count == [len(want[s]) for s in range(n_slots)]
        full = wr.at_least(rows // 2)
        if step % 5 == 1:  # one to four slots in any order, empty ones too (views of regions, or a gather)
            full = torch.randperm(n_slots, generator=g)[:1 + step % 4].tolist()
        if full and step % 3 != 2:
            got = wr.take(full)
            assert got.tolist() == [r for s in full for r in want[s]]
            for s in full:
                want[s] = []
        if step % 7 == 0:
            gone = int(torch.randint(0, n_slots, (1,), generator=g))
            wr.drop(gone)
            want[gone] = []
        assert wr.regions <= n_slots
    assert wr.regions > WaitingRows.START_REGIONS
    with pytest.raises(RuntimeError, match="buffer holds"):
        slot = max(range(n_slots), key=lambda s: len(want[s]))
        wr.put(torch.zeros(rows + 1, width), list(range(rows + 1)), [(slot, rows + 1)])


def test_engines_on_one_program_share_what_the_drafter_achieves(tiny_dflash_seq_artifact):
    """The drafter's global acceptance and the host work per kind of step are the program's, not one
    engine's: a new engine on the same program starts from them (a smaller draft block keeps its own)."""
    art = load_artifact(tiny_dflash_seq_artifact)
    first = Engine(art, RunConfig())
    _observe(first.spec.acceptance, 0, 7, 7, 10)
    for _ in range(3):
        first.spec.costs.record(PLAIN, predicted=1e-3, measured=3e-3)
    second = Engine(art, RunConfig())
    assert second.spec.acceptance.global_rates() == first.spec.acceptance.global_rates()
    assert min(second.spec.acceptance.global_rates()) > 0.6  # above the prior
    assert second.spec.costs.residual(PLAIN) == pytest.approx(2e-3)
    other = Engine(art, RunConfig(draft_block=4))
    assert other.spec.acceptance.global_rates() == pytest.approx([0.6] * 3)


def test_adaptive_choices_can_be_traced(tiny_dflash_seq_artifact, tiny_cfg):
    engine = _engine(tiny_dflash_seq_artifact, RunConfig(fused_rounds=True))
    engine.spec.trace = trace = []
    engine.run([Request("a", (5, 6, 7), 12, ignore_eos=True)])
    assert trace and all("n" in step for step in trace)
    timed = [step for step in trace if "measured" in step]
    assert timed and all(step["kind"] in (PLAIN, FUSED, DRAFTING) and step["measured"] > 0 for step in timed)
    assert any(len(step.get("rounds", ())) == len(engine.spec.rounds) == 2 for step in trace)  # blocks 8 and 4


def test_a_lasting_slowdown_of_plain_steps_is_learnt_once_the_window_ages():
    """Plain steps that stay above STALL_RATIO times their price are stalls only while the window still holds
    min_samples samples younger than plain_age timed steps: then the new time is learnt. A step at exactly the
    ratio is a sample."""
    costs = CostModel({1: 1.0}, {1: 0.5}, {1: 0.1}, padded=False, window=5, min_samples=3, plain_window=5,
                      plain_age=10)
    assert all(costs.record(PLAIN, predicted=1.0, measured=1.2) for _ in range(5))  # clock 1-5
    kept = [costs.record(PLAIN, predicted=1.0, measured=3.0) for _ in range(11)]  # clock 6-16
    assert kept == [False] * 7 + [True] * 4  # from clock 13 two of the five samples are young: too few
    assert costs.residual(PLAIN) == pytest.approx(2.0)
    for _ in range(3):
        costs.record(PLAIN, predicted=1.0, measured=1.5, n=2)
    assert costs.record(PLAIN, predicted=1.0, measured=3.0, n=2)  # 2 x (1.0 + 0.5): at the ratio, a sample
    for _ in range(3):  # steps measured below their prediction (calls predicted that the measurement leaves out)
        costs.record(PLAIN, predicted=1.0, measured=0.5, n=4)
    assert costs.residual(PLAIN, 4) == pytest.approx(-0.5)
    assert costs.record(PLAIN, predicted=1.0, measured=1.2, n=4)  # a normal step: priced at least as predicted
    assert not costs.record(PLAIN, predicted=1.0, measured=2.1, n=4)


def test_a_stalled_plain_step_is_counted_and_traced(tiny_dflash_seq_artifact):
    """The speculator's step accounting: a plain step timed at more than STALL_RATIO times a plain step's price
    is left out of the host-work window, counted in the engine's statistics and marked in the trace."""
    from mg.runtime.speculative import STALL_RATIO

    engine = _engine(tiny_dflash_seq_artifact, RunConfig())
    spec = engine.spec
    spec.costs._host = type(spec.costs._host)()  # a window of its own (engines of one program share theirs)
    spec.trace = []
    forward_s = 1e-3

    def plain_step(measured_s):
        spec.trace.append({"n": 1, "chose": 0})
        spec._prediction, spec._n = (0, 0), 1
        spec.runner.call_log[:] = [("forward", 1, forward_s)]
        spec.step_done(measured_s, rows=1)

    for _ in range(5):
        plain_step(1.1 * forward_s)
    assert spec.stats.stalls == 0 and not any("stall" in step for step in spec.trace)
    plain_step(3 * STALL_RATIO * forward_s)
    assert spec.stats.stalls == 1 and spec.trace[-1]["stall"] is True and spec.trace[-1]["kind"] == PLAIN
    assert spec.costs.residual(PLAIN) == pytest.approx(0.1 * forward_s, rel=0.05)
    plain_step(1.2 * forward_s)
    assert spec.stats.stalls == 1 and "stall" not in spec.trace[-1]


def test_prompt_rows_come_before_draft_rows_in_a_step():
    """A step's rows go to decoding sequences' pending tokens, then to prompt chunks, then to drafts: drafts
    never keep an admitted prompt waiting."""
    from mg.runtime.scheduler import Scheduler

    sched = Scheduler(max_write=24, n_slots=4, capacity=96, vocab_size=64)
    sched.submit(Request("a", (5, 6), 10))
    sched.schedule()  # a's prompt (the engine advances n_cached)
    sched.running[0].n_cached = 2
    sched.append(sched.running[0], [7])
    sched.submit(Request("b", tuple(range(4, 18)), 10))  # 14 prompt tokens
    asked = []

    def draft_rows(decode, rows_left, prompts):
        assert prompts  # b's prompt (then c's) is in prefill
        asked.append(rows_left)
        return [rows_left] + [0] * (len(decode) - 1)

    batch = sched.schedule(draft_rows)
    assert asked == [24 - 1 - 14] and batch.n_drafts == [9]  # b's whole prompt is in this step
    assert [c.length for c in batch.prefill] == [14] and len(batch.decode) + 9 + 14 == 24
    sched.submit(Request("c", tuple(range(4, 40)), 10))  # 36 prompt tokens: more than the step holds
    sched.running[1].n_cached = 14
    sched.append(sched.running[1], [7])
    batch = sched.schedule(draft_rows)
    assert asked[-1] == 0 and batch.n_drafts == [0, 0] and batch.prefill[0].length == 22


def test_context_rows_wait_for_the_next_draft_within_a_memory_bound(tiny_dflash_seq_artifact):
    """A sequence that stops drafting appends no context until flush_rows rows wait (then all of them):
    between one draft_append call's worth and four, as WAITING_BYTES allows for every slot."""
    assert spec_module.flush_rows(128, 8, 4608) == 512  # 4 calls' worth fits
    assert spec_module.flush_rows(128, 128, 4608) == spec_module.WAITING_BYTES // (128 * 4608)
    assert spec_module.flush_rows(128, 128, 51200) == 128  # never below one call's worth
    engine = _engine(tiny_dflash_seq_artifact)
    spec, runner = engine.spec, engine.runner
    assert spec._flush_rows == 4 * runner.draft_cache.max_write
    spec.choose = lambda decode, rows_left, **kw: [0] * len(decode)  # never drafts
    appended, append = [], runner.draft_append
    runner.draft_append = lambda hidden, pos, slots, spans=None: (appended.append(hidden.shape[0]),
                                                               append(hidden, pos, slots, spans))
    engine.run([Request("short", tuple(range(4, 14)), 30, ignore_eos=True)])  # 40 rows: under the bound
    assert appended == []
    spec._flush_rows = 16  # a tighter bound: every 16 committed rows go in one append
    engine.run([Request("long", tuple(range(4, 14)), 30, ignore_eos=True)])
    assert appended == [16, 16]  # 39 rows committed: 16 + 16 appended, 7 left waiting when it ended


def test_host_work_leaves_out_context_appends_and_finishing_steps(tiny_dflash_seq_artifact, tiny_cfg, monkeypatch):
    """A step's host work, as the cost model learns it, is what its choice decides: the host time of appending
    context rows committed earlier (here made 50 ms slow) is not in it, and a step in which a sequence
    finishes (its release) teaches nothing."""
    reqs = _requests(_prompts(tiny_cfg.vocab_size)[3:4], 16, ignore_eos=True)
    reference = _tokens(_engine(tiny_dflash_seq_artifact, TARGET_ONLY), reqs)
    engine = _engine(tiny_dflash_seq_artifact, proposer=Oracle({r.id: out for r, out in zip(reqs, reference)},
                                                                vocab=tiny_cfg.vocab_size))
    spec = engine.spec
    append_rows = spec._append_rows

    def slow_append(slots):
        time.sleep(0.05)
        return append_rows(slots)

    monkeypatch.setattr(spec, "_append_rows", slow_append)
    recorded, record = [], spec.costs.record
    monkeypatch.setattr(spec.costs, "record", lambda kind, predicted, measured, n=1: (
        recorded.append(measured - predicted), record(kind, predicted, measured, n)))
    for _ in range(30):  # the oracle's acceptance, known from the start: the rounds do not wait on the machine's load
        spec.acceptance.observe(0, spec.block - 1, spec.block - 1)
    spec.trace = trace = []
    assert _tokens(engine, reqs) == reference
    assert engine.spec_stats.rounds >= 2  # the prompt's context was appended before the first draft, timed
    assert recorded and max(recorded) < 0.05
    assert "measured" not in trace[-1]  # the last step finished the request


def test_drafter_methods_run_with_tf32_matmuls_and_the_target_in_fp32(tiny_dflash_seq_artifact, tiny_cfg, monkeypatch):
    """RunConfig.draft_tf32 (on by default on CUDA): the drafter's methods, and only they, run with CUDA fp32
    matrix products in TF32 (the setting is process state, so this holds on CPU too); the setting is as before
    after each call, and the output is the target's."""
    assert RunConfig(device="cuda").drafter_tf32 and not RunConfig(device="cuda", draft_tf32=False).drafter_tf32
    assert not RunConfig().drafter_tf32  # CPU: nothing to do
    reqs = _requests(_prompts(tiny_cfg.vocab_size)[2:4], 12, ignore_eos=True)
    reference = _tokens(_engine(tiny_dflash_seq_artifact, TARGET_ONLY), reqs)
    for fused in (False, True):
        engine = _engine(tiny_dflash_seq_artifact, RunConfig(speculation="fixed", fused_rounds=fused))
        runner = engine.runner
        runner._tf32_methods = {C.METHOD_DRAFT_BLOCK, C.METHOD_DRAFT_APPEND}  # what draft_tf32 sets on CUDA
        seen, run = {}, runner.program.run

        def recording(method, inputs, ops=None):
            seen.setdefault(method, set()).add(torch.backends.cuda.matmul.fp32_precision)
            return run(method, inputs, ops=ops)

        monkeypatch.setattr(runner.program, "run", recording)
        assert _tokens(engine, reqs) == reference
        assert seen[C.METHOD_DRAFT_BLOCK] == seen[C.METHOD_DRAFT_APPEND] == {"tf32"}
        assert "tf32" not in seen[C.METHOD_FORWARD]
        assert torch.backends.cuda.matmul.fp32_precision != "tf32" and not torch.backends.cuda.matmul.allow_tf32
        monkeypatch.undo()


def test_an_appends_spans_are_cut_at_each_calls_rows():
    """`draft_append` admits each call's rows by span: the spans cut at the call's row bounds name exactly
    its rows, in order."""
    from mg.runtime.model_runner import _cut_spans

    spans = [(3, 10, 5), (0, 0, 1), (7, 40, 6)]  # 12 rows: slot 3 at 10..14, slot 0 at 0, slot 7 at 40..45
    rows = [(slot, first + j) for slot, first, m in spans for j in range(m)]
    for limit in (1, 2, 4, 5, 12, 13):
        for lo in range(0, len(rows), limit):
            cut = _cut_spans(spans, lo, lo + limit)
            assert [(slot, first + j) for slot, first, m in cut for j in range(m)] == rows[lo:lo + limit]
            assert all(m > 0 for _, _, m in cut)
