"""A fused DFlash round (draft, verify, accept and draft context in one call) gives what unfused rounds give.

CPU tests run the fused round eagerly (`fused_rounds=True`); the CUDA tests (skipped without a device)
replay it from CUDA graphs. Drafts come from the artifact's (random) drafter, which agrees with the target
almost never, or from an oracle that knows the target's greedy output and spoils every ninth position, so
rounds accept whole blocks, parts of blocks and nothing.
"""

from __future__ import annotations

import pytest
import torch

from mg.runtime.artifact import load_artifact
from mg.runtime.config import RunConfig
from mg.runtime.engine import Engine
from mg.runtime.fused_round import FusedRound, Member
from mg.runtime.sampling import SamplingParams
from mg.runtime.scheduler import Request, Sequence
from mg.runtime.speculative import KEEP_NEAR_STEPS, KEEP_STEPS, PROBE_BUDGET, AcceptanceModel, CostModel, ProbeSchedule

LAYOUTS = ["tiny_dflash_seq_artifact", "tiny_dflash_cell_artifact"]
TARGET_ONLY = RunConfig(dflash=False)
FUSED = RunConfig(speculation="fixed", fused_rounds=True)
UNFUSED = RunConfig(speculation="fixed", fused_rounds=False)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _requests(vocab: int, max_new=(12, 5, 20, 9, 16), **kw) -> list[Request]:
    gen = torch.Generator().manual_seed(21)
    return [Request(f"r{i}", tuple(torch.randint(4, vocab, (n,), generator=gen).tolist()), m, **kw)
            for i, (n, m) in enumerate(zip((1, 6, 13, 27, 40), max_new))]


def _tokens(engine, reqs) -> list:
    return [r.tokens for r in engine.run(reqs)]


def _oracle_tokens(reference: dict, seq, width: int) -> list[int]:
    """What the target says next after `seq`'s pending token, spoiled at every ninth position (so the same
    draft at a position, whatever the width asked)."""
    ref = reference[seq.request.id]
    out = list(ref[seq.n_generated:seq.n_generated + width])
    out += [5] * (width - len(out))
    return [(t + 1) % 512 if (seq.n_cached + 1 + j) % 9 == 0 else t for j, t in enumerate(out)]


class OracleProposer:
    """Unfused rounds: the oracle as a proposer."""

    def __init__(self, reference: dict):
        self.reference = reference

    def propose(self, seqs, ks):
        return [_oracle_tokens(self.reference, s, k) for s, k in zip(seqs, ks)]


def _fused_oracle(engine, reference: dict) -> None:
    """The oracle in place of the drafter's block in fused rounds of every block (eager rounds only: it reads
    the host), and as the proposer of the engine's unfused rounds (steps with prefill chunks)."""
    engine.spec.proposer = OracleProposer(reference)
    width = engine.runner.block_size - 1

    def draft(pending, positions, slots):
        by_slot = {s.slot: s for s in engine.scheduler.running}
        rows = [_oracle_tokens(reference, by_slot[slot], width) if slot in by_slot else [0] * width
                for slot in slots.tolist()]
        return torch.tensor(rows, dtype=torch.long, device=pending.device)

    for fr in engine.spec.rounds:
        fr.draft = draft


def _count_rounds(engine, blocks: list = None) -> list:
    """Members' caps of every fused round the engine runs (of any block); `blocks` gets each round's block."""
    calls = []

    def counting(fr, run):
        def run_counted(members):
            calls.append([m.cap for m in members])
            if blocks is not None:
                blocks.append(fr.block)
            return run(members)
        return run_counted

    for fr in engine.spec.rounds:
        fr.run = counting(fr, fr.run)
    return calls


@pytest.mark.parametrize("which", LAYOUTS)
def test_fused_rounds_give_target_only_tokens_and_the_unfused_acceptance(which, request, tiny_cfg):
    art = load_artifact(request.getfixturevalue(which))
    reqs = _requests(tiny_cfg.vocab_size, max_new=(30, 14, 24, 18, 22), ignore_eos=True)
    reference = _tokens(Engine(art, TARGET_ONLY), reqs)
    by_id = {r.id: out for r, out in zip(reqs, reference)}
    unfused = Engine(art, UNFUSED, proposer=OracleProposer(by_id))
    assert _tokens(unfused, reqs) == reference
    fused = Engine(art, FUSED)
    _fused_oracle(fused, by_id)
    rounds = _count_rounds(fused)
    assert _tokens(fused, reqs) == reference
    hist = fused.spec_stats.accepted_hist
    assert rounds and hist == unfused.spec_stats.accepted_hist
    assert hist[0] > 0 and sum(hist[1:-1]) > 0 and len(hist) == fused.spec.block  # none, some, whole blocks
    assert fused.spec_stats.chosen_k_hist == unfused.spec_stats.chosen_k_hist
    assert any(len(caps) > 1 for caps in rounds)  # several sequences per round; near the end, caps from room:
    assert any(min(caps) < fused.spec.block - 1 for caps in rounds)


@pytest.mark.parametrize("which", LAYOUTS)
def test_fused_rounds_leave_the_draft_context_the_unfused_rounds_leave(which, request, tiny_cfg):
    """Step by step, the drafter's cache holds the same K/V at every committed position it holds in both
    engines (the fused round appends every verified row, then goes back to the committed ones), and a
    fused round's drafting sequences hold exactly their committed positions."""
    art = load_artifact(request.getfixturevalue(which))
    reqs = _requests(tiny_cfg.vocab_size, max_new=(30, 14, 24, 18, 22), ignore_eos=True)
    by_id = {r.id: out for r, out in zip(reqs, _tokens(Engine(art, TARGET_ONLY), reqs))}
    unfused, fused = Engine(art, UNFUSED, proposer=OracleProposer(by_id)), Engine(art, FUSED)
    _fused_oracle(fused, by_id)
    rounds = _count_rounds(fused)
    for engine in (unfused, fused):
        for r in reqs:
            engine.submit(r)
    compared = 0
    while not fused.scheduler.idle:
        n_rounds = len(rounds)
        unfused.step()
        fused.step()
        seqs = {s.request.id: s for s in unfused.scheduler.running}
        for s in fused.scheduler.running:
            u = seqs[s.request.id]
            assert s.n_cached == u.n_cached
            held = min(unfused.spec._appended.get(u.slot, 0), fused.spec._appended.get(s.slot, 0))
            if len(rounds) > n_rounds and s.n_generated > 1:
                assert fused.spec.runner.draft_cache.length(s.slot) == fused.spec._appended[s.slot] == s.n_cached
            if held == 0:
                continue
            pos = torch.arange(held)[None, :]
            for layer in range(len(fused.spec.runner.draft_cache.spec.layers)):
                got = fused.spec.runner.draft_cache.gather(layer, pos, torch.tensor([s.slot]))
                want = unfused.spec.runner.draft_cache.gather(layer, pos, torch.tensor([u.slot]))
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
            compared += 1
    assert unfused.scheduler.idle and compared > 10 and rounds


@pytest.mark.parametrize("which", LAYOUTS)
def test_sequences_that_do_not_draft_ride_a_fused_round_as_plain_steps(which, request, tiny_cfg):
    """Rounds where some sequences draft and others do not (adaptive speculation's choice per sequence):
    the others commit their one row, their draft context stays whole for when they draft again, and the
    output stays the target-only output."""
    art = load_artifact(request.getfixturevalue(which))
    reqs = _requests(tiny_cfg.vocab_size, max_new=(20, 14, 24, 18, 22), ignore_eos=True)
    reference = _tokens(Engine(art, TARGET_ONLY), reqs)
    engine = Engine(art, FUSED)
    rounds = _count_rounds(engine)
    choose, steps = engine.spec.choose, [0]

    def alternate(decode, rows_left, **kw):  # every other sequence, by step, plain
        steps[0] += 1
        return [0 if (i + steps[0]) % 2 else k for i, k in enumerate(choose(decode, rows_left, **kw))]

    engine.spec.choose = alternate
    assert _tokens(engine, reqs) == reference
    assert any(0 in caps and any(caps) for caps in rounds)
    assert engine.spec_stats.chosen_k_hist[0] > 0


@pytest.mark.parametrize("which", LAYOUTS)
def test_adaptive_prices_a_step_as_fused_only_when_it_runs_fused(which, request, tiny_cfg):
    """Adaptive speculation with fused rounds (oracle drafts, so it drafts): a step priced as one fused round
    never runs as separate calls (prompt chunks joining it), every step that drafts without prompt chunks
    runs fused, and the output is the target-only output."""
    art = load_artifact(request.getfixturevalue(which))
    reqs = _requests(tiny_cfg.vocab_size, max_new=(30, 14, 24, 18, 22), ignore_eos=True)
    reference = _tokens(Engine(art, TARGET_ONLY), reqs)
    engine = Engine(art, RunConfig(fused_rounds=True))
    engine.spec.costs = _round_costs(engine, 1e-3, {8: 2e-3, 4: 2e-3})  # set costs: the choices do not hang on
    _fused_oracle(engine, {r.id: out for r, out in zip(reqs, reference)})  # this machine's timings
    rounds, spec, seen = _count_rounds(engine), engine.spec, []
    schedule = engine.scheduler.schedule

    def recording(choose):
        batch = schedule(choose)
        seen.append((spec._round_now is not None, any(batch.n_drafts), bool(batch.prefill), len(rounds)))
        return batch

    engine.scheduler.schedule = recording
    assert _tokens(engine, reqs) == reference
    fused_steps = 0
    for (priced_fused, drafts, prefill, before), (_, _, _, after) in zip(seen, seen[1:] + [(0, 0, 0, len(rounds))]):
        ran_fused = after > before
        assert not (priced_fused and drafts and prefill)
        assert ran_fused == (drafts and not prefill)
        fused_steps += ran_fused
    assert fused_steps > 3 and any(prefill for _, _, prefill, _ in seen)


def test_sampled_requests_take_the_unfused_round(tiny_dflash_seq_artifact, tiny_cfg):
    art = load_artifact(tiny_dflash_seq_artifact)
    reqs = _requests(tiny_cfg.vocab_size, sampling=SamplingParams(temperature=0.8, seed=7))
    engine = Engine(art, FUSED)
    rounds = _count_rounds(engine)
    assert _tokens(engine, reqs) == _tokens(Engine(art, UNFUSED), reqs)
    assert rounds == [] and engine.spec_stats.rounds > 0


def test_a_rounds_packed_inputs_put_padding_on_the_scratch_slots(tiny_dflash_seq_artifact):
    engine = Engine(load_artifact(tiny_dflash_seq_artifact), FUSED)
    fused, runner = engine.spec.fused, engine.runner
    k, t = fused.block, fused.t
    ts, ds = runner.cache.scratch_slot, runner.draft_cache.scratch_slot
    packed, verify, append = fused._pack([Member(11, 20, 1, 3), Member(12, 7, 0, 0), Member(13, 2, 2, k - 1)], 4)
    pending, blk_pos, blk_slot, ver_pos, ver_slot, cap, app_pos, app_slot = fused._split(packed, 4)
    rows = lambda spans: sorted((slot, p) for slot, first, m in spans for p in range(first, first + m))  # noqa: E731
    live = lambda pos, slot, scratch: sorted((s, p) for p, s in zip(pos.tolist(), slot.tolist()) if s != scratch)  # noqa: E731
    assert rows(verify) == live(ver_pos, ver_slot, ts) and rows(append) == live(app_pos, app_slot, ds)
    assert pending.tolist() == [11, 12, 13, 0] and cap.tolist() == [3, 0, k - 1, 0]
    assert blk_pos.view(4, t)[0].tolist() == list(range(20, 20 + t))
    assert blk_pos.view(4, t)[2].tolist() == list(range(2, 2 + t))
    assert blk_pos.view(4, t)[1::2].tolist() == [list(range(t))] * 2 and blk_slot.tolist() == [1, ds, 2, ds]
    ver_pos, ver_slot = ver_pos.view(4, k).tolist(), ver_slot.view(4, k).tolist()
    assert ver_pos[0] == [20, 21, 22, 23] + [0] * (k - 4) and ver_slot[0] == [1] * 4 + [ts] * (k - 4)
    assert ver_pos[1] == [7] + [0] * (k - 1) and ver_slot[1] == [0] + [ts] * (k - 1)
    assert ver_pos[2] == list(range(2, 2 + k)) and ver_slot[2] == [2] * k  # every row verified
    assert ver_pos[3] == [0] * k and ver_slot[3] == [ts] * k
    app_pos, app_slot = app_pos.view(4, k).tolist(), app_slot.view(4, k).tolist()
    assert app_pos[0] == ver_pos[0] and app_slot[0] == [1] * 4 + [ds] * (k - 4)
    assert app_pos[2] == ver_pos[2] and app_slot[2] == [2] * k
    assert app_pos[1::2] == [[0] * k] * 2 and app_slot[1::2] == [[ds] * k] * 2


def test_a_round_of_no_sequences_or_too_many_is_refused(tiny_dflash_seq_artifact):
    fused = Engine(load_artifact(tiny_dflash_seq_artifact), FUSED).spec.fused
    with pytest.raises(ValueError, match=r"a fused round of 0 sequences; allowed: 1\.\.3"):
        fused.run([])
    with pytest.raises(ValueError, match=r"of 4 sequences"):
        fused.run([Member(5, 0, i, 1) for i in range(4)])


def test_fused_rounds_are_off_without_graphs_by_default_and_with_a_test_proposer(tiny_dflash_seq_artifact):
    art = load_artifact(tiny_dflash_seq_artifact)
    assert Engine(art, RunConfig()).spec.fused is None  # CPU: no graphs
    assert isinstance(Engine(art, FUSED).spec.fused, FusedRound)
    assert Engine(art, FUSED, proposer=OracleProposer({})).spec.fused is None
    assert RunConfig(device="cuda").fused and not RunConfig(device="cuda", cuda_graphs=False).fused


def test_cublaslt_is_preferred_on_cuda_only_unless_turned_off():
    assert RunConfig(device="cuda").prefer_cublaslt and not RunConfig(device="cuda", cublaslt=False).prefer_cublaslt
    assert not RunConfig().prefer_cublaslt and not RunConfig(cublaslt=True).prefer_cublaslt


def test_mg_run_fused_rounds_flag_gives_the_same_output(tiny_dflash_cell_artifact):
    from click.testing import CliRunner

    from mg.runtime.cli import main

    args = [str(tiny_dflash_cell_artifact), "--prompt", "ab", "--prompt", "hello there", "--max-new-tokens", "9",
            "--speculation", "fixed"]
    fused, unfused = (CliRunner().invoke(main, args + [flag]) for flag in ("--fused-rounds", "--no-fused-rounds"))
    assert fused.exit_code == 0 and unfused.exit_code == 0, fused.stderr + unfused.stderr
    assert fused.stdout == unfused.stdout and fused.stdout.count("\n") == 2


@pytest.mark.parametrize("block", [2, 5])
def test_fused_rounds_with_a_draft_block_below_the_exported_one(tiny_dflash_seq_artifact, tiny_cfg, block):
    art = load_artifact(tiny_dflash_seq_artifact)
    reqs = _requests(tiny_cfg.vocab_size, ignore_eos=True)
    engine = Engine(art, RunConfig(speculation="fixed", fused_rounds=True, draft_block=block))
    rounds = _count_rounds(engine)
    assert engine.spec.fused.limit == min(3, 24 // block)
    assert _tokens(engine, reqs) == _tokens(Engine(art, TARGET_ONLY), reqs)
    assert rounds and max(max(caps) for caps in rounds) == block - 1


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("which", LAYOUTS)
def test_fused_rounds_from_cuda_graphs_match_target_only_and_eager_rounds(which, policy, request, tiny_cfg):
    art = load_artifact(request.getfixturevalue(which), device="cuda")
    reqs = _requests(tiny_cfg.vocab_size, ignore_eos=True)
    reference = _tokens(Engine(art, RunConfig(device="cuda", dflash=False)), reqs)
    graphs = Engine(art, RunConfig(device="cuda", speculation=policy))
    graphs.warm_up()
    assert graphs.spec.fused is not None
    assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
    rounds, captures = _count_rounds(graphs), graphs.graph_counters.captures
    assert _tokens(graphs, reqs) == reference
    assert graphs.graph_counters.captures == captures  # every bucket captured at warm-up
    eager = Engine(art, RunConfig(device="cuda", speculation=policy, cuda_graphs=False, fused_rounds=True))
    assert _tokens(eager, reqs) == reference
    if policy == "fixed":
        assert rounds and graphs.spec_stats.accepted_hist == eager.spec_stats.accepted_hist


def _seq(slot: int, n_cached: int = 10) -> Sequence:
    """A greedy decoding sequence in `slot` with n_cached positions written and one token pending."""
    req = Request(f"s{slot}", tuple(range(4, 4 + n_cached)), 100)
    return Sequence(req, slot, list(req.prompt) + [7], n_cached=n_cached)


def _round_costs(engine, forward_s: float, round_s: dict) -> CostModel:
    """Cost tables where a plain step of any size takes `forward_s` and a fused round of block b `round_s[b]`,
    whatever the members; context appends are free."""
    sizes = (1, 2, 4, 8, 16, 24)
    flat = {n: forward_s for n in sizes}
    rounds = {fr.name: {n: round_s[fr.block] for n in (1, 2, 4, 8)} for fr in engine.spec.rounds}
    return CostModel(flat, {1: forward_s}, {n: 0.0 for n in sizes}, padded=True, rounds=rounds)


def _never_right(spec, slots: int) -> None:
    """Slots 0 .. slots-1 have drafted 20 rounds of 7 drafts and had none accepted."""
    for slot in range(slots):
        for _ in range(20):
            spec.acceptance.observe(slot, 7, 0)


def _no_draft_accepted_nor_probe_due(engine) -> None:
    """The engine's drafter is known never to be right (global counts of 50 rounds, none accepted; no prior),
    and no probe ever falls due."""
    spec, k = engine.spec, engine.spec.block - 1
    spec.probes = ProbeSchedule(engine.cache.n_slots, start=10 ** 9, cap=10 ** 9)
    spec.acceptance = AcceptanceModel(engine.cache.n_slots, k, prior=0.0, global_counts=([0.0] * k, [50.0] * k))


def test_adaptive_chooses_the_round_block_with_the_most_tokens_per_second(tiny_dflash_cell_artifact):
    """Fused rounds hold every member's whole block, so adaptive speculation chooses per step: a plain step or
    a round of one block, all members drafting what they may. The cell artifact fits 3 members in a round of
    its block 8 (24 rows per call) and 6 in a round of block 4. (Probes by rounds here; in the shadow: below.)"""
    engine = Engine(load_artifact(tiny_dflash_cell_artifact), RunConfig(fused_rounds=True))
    spec = engine.spec
    assert [(fr.block, fr.limit) for fr in spec.rounds] == [(8, 3), (4, 6)]
    seqs = [_seq(i) for i in range(3)]
    for slot in range(6):  # every draft accepted so far: a block of 8 commits ~8 tokens, one of 4 ~4
        for _ in range(20):
            spec.acceptance.observe(slot, 7, 7)
    spec.costs = _round_costs(engine, 1e-3, {8: 2e-3, 4: 1.5e-3})
    assert spec.choose(seqs, 21) == [7, 7, 7] and spec._round_now.block == 8
    spec.costs = _round_costs(engine, 1e-3, {8: 5e-3, 4: 1.5e-3})  # the full block's rounds cost too much
    assert spec.choose(seqs, 21) == [3, 3, 3] and spec._round_now.block == 4
    spec.costs = _round_costs(engine, 1e-3, {8: 9e-3, 4: 5e-3})  # no round pays: a plain step
    assert spec.choose(seqs, 21) == [0, 0, 0] and spec._round_now is None
    five = [_seq(i) for i in range(5)]  # more than a round of block 8 holds: block 4 takes them
    spec.costs = _round_costs(engine, 1e-3, {8: 2e-3, 4: 2e-3})
    assert spec.choose(five, 19) == [3] * 5 and spec._round_now.block == 4
    spec.choose(seqs, 21, prefill=True)
    assert spec._round_now is None  # prompt chunks may join the step: priced and run as separate calls
    spec.acceptance = type(spec.acceptance)(spec.runner.cache.n_slots, spec.block - 1)
    _never_right(spec, 6)  # plain steps (until a probe is due)
    assert spec.choose(seqs, 21) == [0, 0, 0]
    # A probe is due once its share of the best round (block 8 here: 2 ms, 1 ms over a plain step, for 3
    # members) fits PROBE_BUDGET of plain decoding: 3000 tok/s x 0.33 ms / 0.05 = 20 plain steps.
    steps = 0
    while spec.choose(seqs, 21) == [0, 0, 0]:
        for s in seqs:
            spec.observe(s, 0, 0)
        steps += 1
    assert 19 <= steps <= 21 and spec._round_now.block == 8 and spec._probing == {0, 1, 2}


def test_a_due_probe_in_a_step_that_could_fuse_goes_in_the_shadow_without_a_round(tiny_dflash_cell_artifact):
    """With shadow probes (`RunConfig.probes`) a probe due in a step that could fuse runs no round: the step stays
    plain for every member, and the due sequences are queued for a draft call, due once that call's cost (1 ms
    here, against plain steps of 3000 tok/s) fits PROBE_BUDGET of plain decoding: 3000 x 1 ms / 0.05 = 60 steps."""
    engine = Engine(load_artifact(tiny_dflash_cell_artifact), RunConfig(fused_rounds=True, probes="shadow"))
    spec = engine.spec
    assert spec.shadow
    seqs = [_seq(i) for i in range(3)]
    _never_right(spec, 3)
    spec.costs = _round_costs(engine, 1e-3, {8: 2e-3, 4: 1.5e-3})
    for steps in range(200):
        assert spec.choose(seqs, 21) == [0, 0, 0] and spec._round_now is None and not spec._probing
        if spec.shadow_queue:
            break
        for s in seqs:
            spec.observe(s, 0, 0)
    assert 59 <= steps <= 61 and [s.slot for s in spec.shadow_queue] == [0, 1, 2]
    assert spec.choose(seqs, 21) == [0, 0, 0] and len(spec.shadow_queue) == 3  # not due again meanwhile


def _kept_until_the_sequences_or_estimates_change(spec, seqs, priced: list, per_step: int) -> None:
    """Three sequences whose drafts do not pay by a margin: the first step and the one after KEEP_STEPS kept ones
    are priced (`priced` grows by `per_step` each), an observation or other sequences price the next step."""
    assert all(spec.choose(seqs, 21) == [0, 0, 0] for _ in range(KEEP_STEPS + 2))
    assert len(priced) == 2 * per_step
    priced.clear()
    assert spec.choose(seqs, 21) == [0, 0, 0] and not priced  # kept
    spec.acceptance.observe(0, 7, 0)
    assert spec.choose(seqs, 21) == [0, 0, 0] and priced  # an observation: priced again
    priced.clear()
    assert spec.choose(seqs[:2], 21) == [0, 0] and priced  # other sequences: priced again


def _kept_until_a_probe_could_fall_due(spec, seqs, priced: list, steps_until_due) -> None:
    """After an observation, with `steps_until_due` standing in for the probe schedule's (slot 1's probe due in 4
    plain steps): the step is priced, kept 3 steps only, then priced again."""
    spec.acceptance.observe(0, 7, 0)
    schedule = spec.probes.steps_until_due
    spec.probes.steps_until_due = steps_until_due
    choices = []
    for _ in range(5):
        priced.clear()
        spec.choose(seqs[:2], 21)
        choices.append(bool(priced))
    spec.probes.steps_until_due = schedule
    assert choices == [True, False, False, False, True]


def test_a_plain_step_chosen_with_a_margin_is_kept_for_a_few_steps(tiny_dflash_cell_artifact):
    """Pricing every round again each step costs host time: a plain step chosen with every round 10% worse or
    more is kept for KEEP_STEPS more steps, unless the sequences, the estimates or the cost model change or a
    probe falls due."""
    engine = Engine(load_artifact(tiny_dflash_cell_artifact), RunConfig(fused_rounds=True))
    spec = engine.spec
    seqs = [_seq(i) for i in range(3)]
    _never_right(spec, 3)
    spec.costs = _round_costs(engine, 1e-3, {8: 9e-3, 4: 5e-3})
    priced, round_cost = [], spec.costs.round
    spec.costs.round = lambda name, n: (priced.append(name), round_cost(name, n))[1]
    _kept_until_the_sequences_or_estimates_change(spec, seqs, priced, len(spec.rounds))
    priced.clear()
    assert spec.choose(seqs[:2], 21) == [0, 0] and not priced  # kept
    due_in = spec.probes.steps_until_due
    _kept_until_a_probe_could_fall_due(spec, seqs, priced, lambda slot, floor: 4 if slot == 1 else due_in(slot, floor))
    separate, best_drafts = [], spec._best_drafts
    spec._best_drafts = lambda *a: (separate.append(a), best_drafts(*a))[1]
    assert spec.choose(seqs[:2], 21, prefill=True) == [0, 0] and separate  # prompt chunks may join: not kept,
    assert spec._round_now is None                                         # priced as separate calls
    costs = spec.costs = _round_costs(engine, 1e-3, {8: 9e-3, 4: 5e-3})  # another cost model: priced again
    spec.costs.round = lambda name, n: (priced.append(name), costs.__class__.round(costs, name, n))[1]
    priced.clear()
    assert spec.choose(seqs[:2], 21) == [0, 0] and priced
    spec.costs = _round_costs(engine, 1e-3, {8: 2e-3, 4: 1.5e-3})  # rounds got cheap
    spec.acceptance = type(spec.acceptance)(spec.runner.cache.n_slots, spec.block - 1)  # and the prior: 0.6
    assert spec.choose(seqs[:2], 21) in ([7, 7], [3, 3]) and spec._round_now is not None


def test_a_plain_step_chosen_over_a_round_that_nearly_pays_is_kept_for_fewer_steps(tiny_dflash_cell_artifact):
    """A round within KEEP_MARGIN of a plain step's rate that does not pay: the plain step is kept for
    KEEP_NEAR_STEPS steps, then the rounds are priced again; a round 10% worse or more keeps it for KEEP_STEPS."""
    engine = Engine(load_artifact(tiny_dflash_cell_artifact), RunConfig(fused_rounds=True))
    spec = engine.spec
    _no_draft_accepted_nor_probe_due(engine)
    seqs = [_seq(i) for i in range(3)]
    # No draft accepted: a round commits 3 tokens (one per member) as a plain step does. A plain step of 1 ms,
    # rounds of 1.05 ms: 0.95 of the plain step's rate, within the margin.
    spec.costs = _round_costs(engine, 1e-3, {8: 1.05e-3, 4: 1.05e-3})
    priced, round_cost = [], spec.costs.round
    spec.costs.round = lambda name, n: (priced.append(name), round_cost(name, n))[1]
    per_step = len(spec.rounds)
    for steps in range(1, 2 * (KEEP_NEAR_STEPS + 1) + 1):
        assert spec.choose(seqs, 21) == [0, 0, 0] and spec._round_now is None
        assert len(priced) == per_step * (1 + (steps - 1) // (KEEP_NEAR_STEPS + 1))
    # Rounds 10% worse or more: kept for KEEP_STEPS (the step after the last near one is priced, then kept).
    spec.costs = _round_costs(engine, 1e-3, {8: 1.2e-3, 4: 1.2e-3})
    far = spec.costs.round
    spec.costs.round = lambda name, n: (priced.append(name), far(name, n))[1]
    priced.clear()
    assert all(spec.choose(seqs, 21) == [0, 0, 0] for _ in range(KEEP_STEPS + 1)) and len(priced) == per_step


def test_adaptive_fused_rounds_of_smaller_blocks_serve_more_sequences(tiny_dflash_cell_artifact, tiny_cfg):
    """Five sequences decode at once on the cell artifact: more than its block-8 rounds hold, so they go in
    rounds of block 4 (by the costs the test sets), and the output is the target-only output."""
    art = load_artifact(tiny_dflash_cell_artifact)
    reqs = _requests(tiny_cfg.vocab_size, max_new=(50, 50, 50, 50, 50), ignore_eos=True)
    reference = _tokens(Engine(art, TARGET_ONLY), reqs)
    engine = Engine(art, RunConfig(fused_rounds=True))
    engine.spec.costs = _round_costs(engine, 1e-3, {8: 2e-3, 4: 2e-3})
    _fused_oracle(engine, {r.id: out for r, out in zip(reqs, reference)})
    blocks = []
    rounds = _count_rounds(engine, blocks)
    assert _tokens(engine, reqs) == reference
    assert any(len(caps) > 3 and b == 4 for caps, b in zip(rounds, blocks))
    assert all(len(caps) <= 3 for caps, b in zip(rounds, blocks) if b == 8) and 8 in blocks
    assert engine.spec_stats.chosen_k_hist[3] > 0 and engine.spec_stats.chosen_k_hist[7] > 0


def test_a_round_is_never_priced_below_a_plain_step(tiny_dflash_cell_artifact):
    """A round verifies every member's block, a plain step's rows and more: with tables that price a round under
    a plain step (blank calls timed on a busy machine) and a drafter known never to be right, the step stays
    plain (no probe is due here: one that costs nothing more than a plain step would run)."""
    engine = Engine(load_artifact(tiny_dflash_cell_artifact), RunConfig(fused_rounds=True))
    spec = engine.spec
    _no_draft_accepted_nor_probe_due(engine)
    seqs = [_seq(i) for i in range(3)]
    spec.costs = _round_costs(engine, 1e-3, {8: 0.5e-3, 4: 0.4e-3})
    assert spec.choose(seqs, 21) == [0, 0, 0] and spec._round_now is None


def _separate_costs(draft: float) -> CostModel:
    """Separate calls only: a forward of n rows takes 1 + n ms, a draft call `draft` seconds, appends are free."""
    sizes = (1, 2, 4, 8, 16, 24)
    return CostModel({n: 1e-3 + 1e-3 * n for n in sizes}, {b: draft for b in (1, 2, 3)}, {m: 0.0 for m in sizes},
                     padded=False)


def test_a_plain_step_priced_as_separate_calls_is_kept_while_no_draft_comes_near_paying(tiny_dflash_seq_artifact):
    """Without fused rounds (the CPU), a plain step whose drafts could not come within KEEP_MARGIN of a plain
    step's rate even if every one were accepted is kept as over fused rounds (above), without pricing the drafts
    again; it ends before the cheapest probe could fall due. Drafts that come within the margin without paying
    keep it for KEEP_NEAR_STEPS steps only."""
    engine = Engine(load_artifact(tiny_dflash_seq_artifact), RunConfig())
    spec = engine.spec
    assert not spec.rounds
    engine.runner.call_log = None
    seqs = [_seq(i) for i in range(3)]
    _never_right(spec, 3)
    spec.costs = _separate_costs(5e-3)
    priced, best_drafts = [], spec._best_drafts
    spec._best_drafts = lambda *a: (priced.append(1), best_drafts(*a))[1]
    _kept_until_the_sequences_or_estimates_change(spec, seqs, priced, 1)
    # Until a probe could fall due: the cheapest probe's floor, from the step's own costs, bounds the keeping.
    floors = []
    _kept_until_a_probe_could_fall_due(spec, seqs, priced,
                                       lambda slot, floor: (floors.append(floor), 4 if slot == 1 else 100)[1])
    rate = 2 / spec.costs.forward(2)
    cheapest = spec.costs.forward(3) + spec.costs.draft(1) - spec.costs.forward(2)
    assert floors and floors[0] == pytest.approx(rate * cheapest / PROBE_BUDGET)
    # Drafts within the margin of paying by the bound, and not paying: kept for KEEP_NEAR_STEPS steps.
    spec = Engine(load_artifact(tiny_dflash_seq_artifact), RunConfig()).spec
    spec.runner.call_log = None
    for slot in range(2):
        for _ in range(20):
            spec.acceptance.observe(slot, 7, 2)
    spec.costs = _separate_costs(5e-3)
    priced, best_drafts = [], spec._best_drafts
    spec._best_drafts = lambda *a: (priced.append(1), best_drafts(*a))[1]
    for _ in range(2 * (KEEP_NEAR_STEPS + 1)):
        assert spec.choose(seqs[:2], 21) == [0, 0]
    assert len(priced) == 2 and not spec._clear_plain
