"""scripts/eval_dflash.py: drafters with other weights run every policy in the same rounds; bad lists refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
PROMPTS = Path(__file__).resolve().parents[1] / "data" / "heldout_prompts.jsonl"


@pytest.mark.parametrize("value", ["float,int9", "int4,int4", ""])
def test_bad_draft_weights_are_refused_in_one_line(value, tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPTS / "eval_dflash.py"), "--draft-weights", value,
                          "--out", str(tmp_path / "out.json")], capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        f"eval_dflash.py: error: --draft-weights is {value!r}; allowed: distinct comma-separated float | int8 | int4")
    assert not (tmp_path / "out.json").exists()


@pytest.mark.slow
def test_each_policy_runs_on_each_drafter_and_stays_lossless(tmp_path, monkeypatch):
    """The embedded default with a float and an int4 drafter, two prompts: both drafters' results under their own
    names, every generation equal to target-only, and the int4 drafter still drafts tokens the target accepts."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import eval_dflash
    from mg.export.artifact import default_checkpoints

    ckpt, draft = default_checkpoints()
    arts = {s: eval_dflash._export(ckpt, draft, "sequence", tmp_path / s, 128, None, s) for s in ("float", "int4")}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(PROMPTS.read_text().splitlines(keepends=True)[:2]))
    out = eval_dflash.evaluate_layout(arts["float"], prompts, 12, "cpu", ["fixed"], repeats=1,
                                      drafters={"int4": arts["int4"]})
    assert list(out["policies"]) == ["fixed", "fixed (int4 drafter)"]
    assert out["lossless_all"]
    for result in out["policies"].values():
        assert [p["lossless"] for p in result["per_prompt"]] == [True, True]
        assert result["batched"]["mean_acceptance_length"] > 1.0
    json.dumps(out)  # what the script writes
