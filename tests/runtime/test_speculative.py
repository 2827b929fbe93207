"""DFlash is lossless, batched, and commits only what was accepted (both layouts)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from mg.runtime.artifact import load_artifact
from mg.runtime.cli import main
from mg.runtime.engine import Engine
from mg.runtime.scheduler import Request
from mg.runtime.spec_decode import DFlashEngine, DFlashError

LAYOUTS = ["tiny_dflash_seq_artifact", "tiny_dflash_cell_artifact"]


def _prompts(vocab):
    gen = torch.Generator().manual_seed(21)
    return [tuple(torch.randint(4, vocab, (n,), generator=gen).tolist()) for n in (1, 6, 13, 27, 40)]


def _requests(prompts, max_new):
    news = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
    return [Request(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, news))]


def _target_only(artifact_dir, reqs, eos=None):
    engine = Engine(load_artifact(artifact_dir))
    if eos is not None:  # () = never stop on EOS
        engine.eos = frozenset(eos)
    return [r.tokens for r in engine.run(reqs)]


def _dflash(artifact_dir, reqs, eos=None, propose=None, block=None):
    engine = DFlashEngine(load_artifact(artifact_dir), draft_block=block)
    if eos is not None:
        engine.eos = frozenset(eos)
    if propose is not None:
        engine.propose = propose(engine)
    return [r.tokens for r in engine.run(reqs)], engine


def _oracle(reference: dict, wrong: bool = False, vocab: int = 512):
    """A test-only drafter that proposes what the target will say (or never agrees with it)."""
    def make(engine):
        def propose(seqs, n_drafts):
            out = []
            for seq, k in zip(seqs, n_drafts):
                ref = reference[seq.request.id]
                nxt = list(ref[seq.n_generated:seq.n_generated + k])
                nxt += [5] * (k - len(nxt))
                out.append([(t + 1) % vocab for t in nxt] if wrong else nxt)
            return out
        return propose
    return make


@pytest.mark.parametrize("which", LAYOUTS)
def test_greedy_dflash_matches_target_only(which, request, tiny_cfg):
    art = request.getfixturevalue(which)
    prompts = _prompts(tiny_cfg.vocab_size)
    reqs = _requests(prompts, [12, 5, 20, 9, 16])
    reference = _target_only(art, reqs)
    # An EOS the model does emit: a token from the middle of one reference output.
    eos = {reference[2][6]}
    got, engine = _dflash(art, reqs)
    assert got == reference
    assert engine.stats.rounds > 0 and engine.stats.drafted_tokens > 0
    ref_eos = _target_only(art, reqs, eos=eos)
    got_eos, _ = _dflash(art, reqs, eos=eos)
    assert got_eos == ref_eos
    assert any(out and out[-1] in eos for out in got_eos)


@pytest.mark.parametrize("which", LAYOUTS)
def test_oracle_drafter_accepts_whole_blocks(which, request, tiny_cfg):
    art = request.getfixturevalue(which)
    block = load_artifact(art).manifest.draft.block_size
    max_new = 1 + 3 * block  # the first token comes from prefill, then three full rounds
    for prompts in (_prompts(tiny_cfg.vocab_size)[2:3], _prompts(tiny_cfg.vocab_size)[:3]):
        reqs = _requests(prompts, max_new)
        reference = _target_only(art, reqs, eos=())
        got, engine = _dflash(art, reqs, eos=(), propose=_oracle({r.id: out for r, out in zip(reqs, reference)}))
        assert got == reference
        assert engine.stats.accepted_tokens == engine.stats.drafted_tokens > 0
    # Alone, a sequence gets full rounds (in a batch, max_write is shared and some rounds are shorter).
    assert len(prompts) == 3 and engine.stats.rounds > 0
    reqs = _requests(_prompts(tiny_cfg.vocab_size)[2:3], max_new)
    reference = _target_only(art, reqs, eos=())
    _, engine = _dflash(art, reqs, eos=(), propose=_oracle({r.id: out for r, out in zip(reqs, reference)}))
    assert engine.stats.mean_acceptance_length == block


def test_drafter_that_never_agrees_still_gives_identical_output(tiny_dflash_seq_artifact, tiny_cfg):
    reqs = _requests(_prompts(tiny_cfg.vocab_size), 10)
    reference = _target_only(tiny_dflash_seq_artifact, reqs)
    oracle = _oracle({r.id: out for r, out in zip(reqs, reference)}, wrong=True, vocab=tiny_cfg.vocab_size)
    got, engine = _dflash(tiny_dflash_seq_artifact, reqs, propose=oracle)
    assert got == reference
    assert engine.stats.accepted_tokens == 0 and engine.stats.mean_acceptance_length == 1.0


def test_draft_block_smaller_than_exported_is_lossless(tiny_dflash_seq_artifact, tiny_cfg):
    reqs = _requests(_prompts(tiny_cfg.vocab_size)[:3], 9)
    got, engine = _dflash(tiny_dflash_seq_artifact, reqs, block=3)
    assert got == _target_only(tiny_dflash_seq_artifact, reqs)
    assert engine.stats.drafted_tokens <= 2 * engine.stats.rounds


@pytest.mark.parametrize("which", LAYOUTS)
def test_rejected_rounds_leave_caches_holding_exactly_the_committed_tokens(which, request, tiny_cfg):
    art = request.getfixturevalue(which)
    prompt = _prompts(tiny_cfg.vocab_size)[3]
    spec = DFlashEngine(load_artifact(art))
    plain = Engine(load_artifact(art))
    for e in (spec, plain):
        e.eos = frozenset()
        e.scheduler.submit(Request("x", prompt, 40))
    for _ in range(4):
        spec.step()
        seq = spec.scheduler.running[0]
        n = seq.n_cached
        assert spec.cache.length(seq.slot) == n == spec.draft_cache.length(seq.slot)
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


def test_draft_context_only_receives_committed_rows(tiny_dflash_seq_artifact, tiny_cfg):
    """Poison every hidden row that is not committed; the draft cache must never see the poison."""
    reqs = _requests(_prompts(tiny_cfg.vocab_size), 10)
    engine = DFlashEngine(load_artifact(tiny_dflash_seq_artifact))
    real_commit = engine._commit
    appended = []

    def poisoned_commit(verify, accepted, prefill, inputs, hidden):
        committed = set()
        offset = 0
        for chunk, a in zip(verify, accepted):
            committed.update(range(offset, offset + a + 1))
            offset += chunk.length
        committed.update(range(offset, hidden.shape[0]))  # prefill rows are all committed
        for row in range(hidden.shape[0]):
            if row not in committed:
                hidden[row] = float("nan")
        return real_commit(verify, accepted, prefill, inputs, hidden)

    real_append = engine.append_context

    def record(hidden, rows, positions, slots):
        for slot in set(slots):  # each slot's rows continue its draft context exactly: no gaps, no repeats
            mine = [p for s, p in zip(slots, positions) if s == slot]
            start = engine.draft_cache.length(slot)
            assert mine == list(range(start, start + len(mine)))
        appended.extend(positions)
        assert not torch.isnan(hidden[rows]).any()
        return real_append(hidden, rows, positions, slots)

    engine._commit = poisoned_commit
    engine.append_context = record
    got = [r.tokens for r in engine.run(reqs)]
    assert got == _target_only(tiny_dflash_seq_artifact, reqs)
    assert engine.stats.drafted_tokens > engine.stats.accepted_tokens  # rows were really rejected
    for layer_id in range(len(engine.draft_cache.spec.layers)):
        k, v = engine.draft_cache.storage(layer_id)
        assert not torch.isnan(k).any() and not torch.isnan(v).any()
    assert appended


@pytest.mark.parametrize("block", [0, 1, 99])
def test_draft_block_outside_the_exported_range_is_refused(tiny_dflash_seq_artifact, block):
    with pytest.raises(DFlashError, match="--draft-block is"):
        DFlashEngine(load_artifact(tiny_dflash_seq_artifact), draft_block=block)
    result = CliRunner().invoke(main, [str(tiny_dflash_seq_artifact), "--prompt", "x", "--draft-block", str(block)])
    assert result.exit_code == 2 and "--draft-block is" in result.stderr


def test_draft_section_disagreeing_with_constant_methods_is_refused(tmp_path, tiny_dflash_seq_artifact):
    art = tmp_path / "art"
    shutil.copytree(tiny_dflash_seq_artifact, art)
    m = json.loads((art / "manifest.json").read_text())
    m["draft"]["block_size"] = 4
    (art / "manifest.json").write_text(json.dumps(m))
    result = CliRunner().invoke(main, [str(art), "--prompt", "x"])
    assert result.exit_code == 2
    assert "get_block_size" in result.stderr and "returns 8" in result.stderr and "says 4" in result.stderr


def test_mg_run_reports_dflash_statistics(tmp_path, tiny_dflash_cell_artifact):
    stats = tmp_path / "stats.json"
    result = CliRunner().invoke(main, [str(tiny_dflash_cell_artifact), "--prompt", "def f(x):", "--prompt", "a",
                                       "--max-new-tokens", "6", "--stats-json", str(stats)])
    assert result.exit_code == 0, result.stderr
    assert "DFlash" in result.stderr and "mean acceptance length" in result.stderr
    data = json.loads(stats.read_text())
    assert data["dflash"] and data["rounds"] > 0 and data["mean_acceptance_length"] >= 1.0
