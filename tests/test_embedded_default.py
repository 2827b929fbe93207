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
