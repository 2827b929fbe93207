"""Claims about scripts/train_tiny.py: its training attention equals the reference attention, its batched
drafter training path equals the no-cache drafting reference, and the --smoke pipeline writes checkpoints
that load into the models, a tokenizer that round-trips code, falling losses and a reproducible run."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mg.export.checkpoint import load_config, load_state
from mg.export.config import TINY, MuseGlimmerConfig
from mg.export.draft_model import DRAFT_PRESETS, DFlashConfig, DFlashDraft
from mg.export.draft_reference import draft_block_ref
from mg.export.model import MuseGlimmer, init_random
from mg.export.reference import dense_attend, greedy_generate

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_tiny.py"
SNIPPET = 'def f(xs):\n\tfor i, x in enumerate(xs):  # é ✓\r\n        yield {"k": x ** 2}\n\n\nclass A:  pass\n'


def _load_script():
    spec = importlib.util.spec_from_file_location("train_tiny", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


tt = _load_script()


# ----------------------------------------------------------------------------- equivalences (fast)


@pytest.mark.parametrize("layer_id", [0, 1])  # TINY: layer 0 is a ring layer (window 8), layer 1 global
def test_training_attend_matches_dense_attend(layer_id):
    b, t, cfg = 3, 21, TINY
    gen = torch.Generator().manual_seed(layer_id)
    q = torch.randn(b * t, cfg.n_heads, cfg.head_dim, generator=gen)
    k, v = (torch.randn(b * t, cfg.n_kv_heads, cfg.head_dim, generator=gen) for _ in range(2))
    positions, slots = torch.arange(t).repeat(b), torch.arange(b).repeat_interleave(t)
    got = tt.SdpaAttend(cfg, t, "cpu")(q, k, v, positions, slots, layer_id, cfg.attn_scale)
    ref = dense_attend(cfg)
    for i in range(b):
        rows = slice(i * t, (i + 1) * t)
        want = ref(q[rows], k[rows], v[rows], torch.arange(t), slots[rows], layer_id, cfg.attn_scale)
        torch.testing.assert_close(got[rows], want, atol=1e-5, rtol=1e-5)


def test_packed_training_forward_matches_each_sequence_alone(tiny_model):
    tokens = torch.randint(4, TINY.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, _ = tt.packed_forward(tiny_model, tokens)
        for i in range(2):
            n = tokens.shape[1]
            want, _ = tiny_model(tokens[i], torch.arange(n), torch.zeros(n, dtype=torch.long), torch.arange(n),
                                 dense_attend(TINY))
            torch.testing.assert_close(got[i * n:(i + 1) * n], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [0, 5])
def test_drafter_training_path_matches_draft_block_ref(tiny_model, window):
    cfg = dataclasses.replace(DRAFT_PRESETS["tiny"], sliding_window=window)
    draft = init_random(DFlashDraft(cfg, TINY), 3).eval()
    tokens = torch.randint(4, TINY.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[1, 9, 17], [4, 12, 22]])  # block 8: the last block ends at position 29
    embed, head = tiny_model.tok_embeddings.weight, tiny_model.output.weight
    with torch.no_grad():
        _, hidden = tt.packed_forward(tiny_model, tokens, torch.tensor([0]), cfg.target_layers)
        hidden = hidden.view(2, 30, -1)
        blk_tok, blk_pos = tt.block_inputs(tokens, anchors, cfg)
        got = tt.draft_train_logits(draft, hidden, blk_tok, blk_pos, embed, head)
    assert got.shape == (2, 3, cfg.block_size - 1, TINY.vocab_size)
    for b in range(2):
        for j, a in enumerate(anchors[b].tolist()):
            want = draft_block_ref(draft, embed, head, hidden[b], torch.arange(30), int(tokens[b, a]), a)
            torch.testing.assert_close(got[b, j], want, atol=1e-4, rtol=1e-4)


def test_draft_loss_mixes_hard_labels_with_the_targets_next_token_distribution(tiny_model):
    """kd weighs the cross-entropy to the target's softmax at the row before each block position (the row that
    predicts it) against the cross-entropy to the text's token; checked against a full-sequence target forward."""
    cfg = DRAFT_PRESETS["tiny"]
    draft = init_random(DFlashDraft(cfg, TINY), 4).eval()
    tokens = torch.randint(4, TINY.vocab_size, (2, 30), generator=torch.Generator().manual_seed(5))
    anchors = torch.tensor([[2, 11, 20], [5, 13, 22]])
    embed, head = tiny_model.tok_embeddings.weight, tiny_model.output.weight
    with torch.no_grad():
        full, hidden = tt.packed_forward(tiny_model, tokens, None, cfg.target_layers)
        blk_tok, blk_pos = tt.block_inputs(tokens, anchors, cfg)
        logits = tt.draft_train_logits(draft, hidden.view(2, 30, -1), blk_tok, blk_pos, embed, head)
        labels = torch.stack([tokens[b, blk_pos[b, :, 1:]] for b in range(2)])
        hard = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
        teacher = torch.stack([full.view(2, 30, -1)[b, blk_pos[b, :, :-1]] for b in range(2)]).softmax(-1)
        soft = -(teacher * logits.log_softmax(-1)).sum(-1)
        w = tt.position_weights(cfg.block_size, "cpu")
        got = {kd: float(tt.draft_loss(draft, tiny_model, tokens, anchors, kd)) for kd in (0.0, 0.3, 1.0)}
    for kd, value in got.items():
        want = (((1 - kd) * hard + kd * soft) * w).sum(-1).mean() / w.sum()
        assert value == pytest.approx(float(want), rel=1e-5), kd
    assert abs(got[1.0] - got[0.0]) > 1e-3  # the two terms differ, so a kd that was ignored would show


def test_cached_greedy_generation_matches_the_reference_generator(tiny_model):
    """Batched KV-cached rollouts (ring layers wrap: TINY's window is 8) equal one-sequence reference generation."""
    prefix = torch.randint(4, TINY.vocab_size, (3, 7), generator=torch.Generator().manual_seed(2))
    got = tt.greedy_extend(tiny_model, prefix, 12)
    assert got.shape == (3, 19) and torch.equal(got[:, :7], prefix)
    for i in range(3):
        assert got[i, 7:].tolist() == greedy_generate(tiny_model, prefix[i].tolist(), 12)


def test_anchors_lie_in_each_rows_continuation_with_a_whole_block_after_them():
    low = torch.tensor([1, 20, 33, 40])
    got = tt.sample_anchors(low, 5, 64, 16, torch.Generator().manual_seed(0))
    assert got.shape == (4, 5)
    for row, lo in zip(got.tolist(), low.tolist()):
        assert row == sorted(set(row)) and lo <= row[0] and row[-1] <= 64 - 16


def test_rounds_replay_accepts_the_agreeing_prefix_and_stops_one_short_of_the_end():
    seq = torch.arange(10)  # prompt 0..1; the continuation 2..9 (anchor of the first round: position 2)
    drafted = torch.full((7, 3), -1)  # the round anchored at position p proposes drafted[p - 2]
    drafted[0] = torch.tensor([3, 4, 0])  # from 2: accepts 3, 4; the target gives 5
    drafted[3] = torch.tensor([6, 7, 8])  # from 5: accepts 6, 7, 8 (3 drafts); the target gives 9, the end
    assert tt.simulate_rounds(drafted, seq, 2) == [2, 3]
    drafted[3] = torch.tensor([6, 0, 8])  # from 5: accepts 6; from 7 no draft agrees; from 8 nothing is drafted
    assert tt.simulate_rounds(drafted, seq, 2) == [2, 1, 0, 0]


def test_heldout_prompts_end_with_the_first_def_after_line_30():
    text = "\n".join([f"x{i} = {i}" for i in range(32)] + ["def f(a):", "    return a", "def g():"]) + "\n"
    assert tt.prompt_of(text) == "\n".join([f"x{i} = {i}" for i in range(25, 32)] + ["def f(a):"]) + "\n"
    assert tt.prompt_of("def f():\n    pass\n") is None


def test_heldout_split_is_a_stable_hash_of_the_path():
    names = [f"pkg/mod_{i}.py" for i in range(2000)]
    held = [n for n in names if tt.is_heldout(n, 0.05)]
    assert held == [n for n in names if tt.is_heldout(n, 0.05)]
    assert 50 <= len(held) <= 150


# ----------------------------------------------------------------------------- the smoke pipeline


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_tiny")
    report = tt.main(["--out", str(out), "--smoke", "--device", "cpu", "--target-steps", "60", "--draft-steps", "40",
                      "--check-repro"])
    return out, report


@pytest.mark.slow
def test_smoke_checkpoints_load_into_target_and_drafter(smoke_run):
    out, report = smoke_run
    tcfg = load_config(out / "target", MuseGlimmerConfig)
    target = MuseGlimmer(tcfg)
    load_state(out / "target", target)
    dcfg = load_config(out / "draft", DFlashConfig)
    load_state(out / "draft", DFlashDraft(dcfg, tcfg))
    assert tcfg.dtype == "bfloat16" and dcfg.mask_token_id == 3 and dcfg.block_size == 16
    windows = [tcfg.window(i) for i in range(tcfg.n_layers)]
    assert windows.count(0) >= 1 and sum(w > 0 for w in windows) >= 2
    assert json.loads((out / "train_report.json").read_text())["target"]["params"] == tcfg.n_params()
    assert (out / "train_report.md").read_text().startswith("# train_tiny report")


@pytest.mark.slow
def test_smoke_tokenizer_round_trips_code_and_fixes_special_ids(smoke_run):
    from tokenizers import Tokenizer

    out, _ = smoke_run
    tok = Tokenizer.from_file(str(out / "target" / "tokenizer.json"))
    assert [tok.token_to_id(s) for s in ("<pad>", "<bos>", "<eos>", "<mask>")] == [0, 1, 2, 3]
    assert tok.decode(tok.encode(SNIPPET, add_special_tokens=False).ids) == SNIPPET
    assert tok.get_vocab_size() == load_config(out / "target", MuseGlimmerConfig).vocab_size


@pytest.mark.slow
def test_smoke_losses_decrease_and_run_is_reproducible(smoke_run):
    _, report = smoke_run
    for name in ("target", "draft"):
        curve = report[name]["train"]["loss_curve"]
        assert curve[-1][1] < curve[0][1], f"{name} loss did not decrease: {curve}"
    held = report["target"]["train"]["heldout_curve"]
    assert held[-1][1] < held[0][1]
    assert report["repro"]["reproducible"], report["repro"]
    assert 1.0 <= report["draft"]["eval"]["acceptance_length_mean"] <= 16.0
