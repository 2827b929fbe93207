"""Claims about scripts/profile_round.py: it times every method call and fused round of a DFlash artifact
against a plain step, with either drafter attention, and refuses bad input in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_round.py"


def test_round_profile_prices_every_call_against_a_plain_step(tiny_dflash_seq_artifact, tmp_path):
    out = tmp_path / "round.json"
    run = subprocess.run([sys.executable, str(SCRIPT), str(tiny_dflash_seq_artifact), "--calls", "2",
                          "--draft-attention", "reference", "--out", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["draft_attention"] == "reference"
    names = [r["call"] for r in data["rows"]]
    assert names[:3] == ["forward, 1 row", f"forward, {names[1].split()[1]} rows", "draft_block, 1 sequence"]
    assert any(n.startswith("fused round, block") for n in names)
    first = data["rows"][0]["wall_us"]
    for row in data["rows"]:
        assert row["wall_us"] > 0 and row["kernel_us"] is None  # no kernel times without CUDA
        assert abs(row["plain_steps"] - row["wall_us"] / first) < 1e-9
    assert "| draft_block, 1 sequence |" in run.stdout


def test_round_profile_refuses_a_bad_call_count(tiny_dflash_seq_artifact):
    run = subprocess.run([sys.executable, str(SCRIPT), str(tiny_dflash_seq_artifact), "--calls", "0"],
                         capture_output=True, text=True)
    assert run.returncode == 2
    assert "--calls is 0 and --top 8; allowed: --calls >= 1, --top >= 0" in run.stderr
