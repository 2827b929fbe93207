"""The embedded default pair, exported and served: DFlash is lossless on held-out prompts, and the acceptance
that scripts/train_tiny.py reports (the DFlash loop replayed on the target's greedy text) is exactly what the
engine measures on the same prompts."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from mg.export.artifact import ExportOptions, default_checkpoints, export_artifact, load_target
from mg.export.draft_lower import load_draft
from mg.runtime.artifact import load_artifact
from mg.runtime.config import RunConfig
from mg.runtime.engine import Engine
from mg.runtime.scheduler import Request
from mg.runtime.tokenizer import TextCodec

ROOT = Path(__file__).resolve().parent.parent
MAX_NEW = 32


def _train_tiny():
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "scripts" / "train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    target_dir, draft_dir = default_checkpoints()
    target = load_target(target_dir, None)
    draft = load_draft(draft_dir, None, target.cfg)
    out = tmp_path_factory.mktemp("embedded") / "seq"
    export_artifact(ExportOptions(output_dir=out, layout="sequence", max_seqs=2, max_context=256, max_write=32),
                    target, lambda msg: None, draft)
    return out, target, draft


def _prompts(artifact) -> list[tuple[str, list[int]]]:
    codec = TextCodec(artifact.tokenizer_path, artifact.manifest.model.bos_id)
    rows = [json.loads(line) for line in (ROOT / "tests/data/heldout_prompts.jsonl").read_text().splitlines()]
    return [(r["id"], codec.encode(r["prompt"])) for r in rows[:4]]


@pytest.mark.slow
def test_dflash_is_lossless_and_accepts_what_the_training_report_predicts(embedded):
    out, target, draft = embedded
    art = load_artifact(out)
    prompts = _prompts(art)
    hist: list[int] = []
    for rel, ids in prompts:
        req = Request(rel, tuple(ids), MAX_NEW)
        want = Engine(art, RunConfig(dflash=False)).run([req])[0].tokens
        engine = Engine(art, RunConfig(speculation="fixed"))  # full blocks every round, as the replay drafts
        assert engine.run([req])[0].tokens == want, f"{rel}: DFlash output differs from target-only output"
        assert len(want) == MAX_NEW  # no early EOS: every prompt exercises the whole budget
        hist = [a + b for a, b in zip(hist + [0] * 16, list(engine.spec_stats.accepted_hist) + [0] * 16)]
        adaptive = Engine(art)
        assert adaptive.run([req])[0].tokens == want, f"{rel}: adaptive DFlash output differs"
    tt = _train_tiny()
    settings = tt.Settings(out="unused", eval_new_tokens=MAX_NEW)
    from mg.export.draft_model import DFlashDraft
    from mg.export.model import MuseGlimmer
    from mg.export.weights import materialize

    target_model = materialize(target.weights, MuseGlimmer(target.cfg)).float().eval()
    draft_model = materialize(draft.weights, DFlashDraft(draft.cfg, target.cfg)).float().eval()
    with torch.no_grad():
        sim = tt.eval_prompts(target_model, draft_model, prompts, settings)
    n = len(sim["accepted_hist"])
    assert hist[:n] == sim["accepted_hist"] and not any(hist[n:])
    assert sim["acceptance_length_mean"] > 1.5  # a trained pair: drafts are accepted, not noise


@pytest.mark.slow
def test_row_invariant_cpu_serving_makes_int8_dflash_and_batches_exact(tmp_path):
    """`RunConfig.row_invariant` on the CPU: with int8 weights (torch's packed kernels round their inputs to
    bfloat16, so any last-bit difference of a row becomes visible), greedy DFlash with full blocks equals
    target-only and a batch equals its prompts alone, on held-out prompts where per-call attention made them
    differ (email/contentmanager.py and multiprocessing/connection.py with fixed blocks, importlib/_abc.py
    batched; docs BENCHMARKS.md, "row-invariant CPU attention")."""
    target_dir, draft_dir = default_checkpoints()
    target = load_target(target_dir, None)
    draft = load_draft(draft_dir, None, target.cfg)
    out = tmp_path / "int8"
    export_artifact(ExportOptions(output_dir=out, layout="sequence", max_seqs=8, max_context=1024, max_write=128,
                                  weights="int8"), target, lambda msg: None, draft)
    art = load_artifact(out)
    codec = TextCodec(art.tokenizer_path, art.manifest.model.bos_id)
    rows = [json.loads(line) for line in (ROOT / "tests/data/heldout_prompts.jsonl").read_text().splitlines()]
    wanted = ("email/contentmanager.py", "multiprocessing/connection.py", "importlib/_abc.py", "copyreg.py")
    reqs = [Request(r["id"], tuple(codec.encode(r["prompt"])), 64) for r in rows if r["id"] in wanted]
    assert len(reqs) == len(wanted)
    plain, fixed = RunConfig(dflash=False, row_invariant=True), RunConfig(speculation="fixed", row_invariant=True)
    alone = {r.id: Engine(art, plain).run([r])[0].tokens for r in reqs}
    for r in reqs:
        assert Engine(art, fixed).run([r])[0].tokens == alone[r.id], f"{r.id}: DFlash differs from target-only"
    for config in (plain, fixed):
        batched = {x.id: x.tokens for x in Engine(art, config).run(reqs)}
        assert batched == alone, f"batched differs from alone ({'DFlash' if config.dflash else 'target-only'})"
