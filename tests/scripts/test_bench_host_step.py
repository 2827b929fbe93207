"""Claims about scripts/bench_host_step.py: it times target-only and both DFlash engines' host work on an
artifact, every engine serving every step (the adaptive one choosing plain steps), and refuses bad input in
one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_host_step.py"


@pytest.mark.parametrize("padded", [False, True])
def test_host_step_benchmark_times_every_engine_per_batch(tiny_dflash_seq_artifact, tmp_path, padded):
    out = tmp_path / "host.json"
    run = subprocess.run([sys.executable, str(SCRIPT), str(tiny_dflash_seq_artifact), "--batches", "1,3",
                          "--steps", "12", "--repeats", "2", "--out", str(out), *(["--padded"] if padded else [])],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert data["padded"] is padded
    rows = data["rows"]
    assert [(r["sequences"], r["mode"]) for r in rows] == [(n, m) for n in (1, 3)
                                                            for m in ("plain", "no-drafts", "adaptive")]
    assert all(r["us_per_step"] > 0 and r["us_per_step_median"] >= r["us_per_step"] for r in rows)
    for r in rows:
        plain = next(p for p in rows if p["sequences"] == r["sequences"] and p["mode"] == "plain")
        assert abs(r["over_plain_us"] - (r["us_per_step"] - plain["us_per_step"])) < 1e-6
    assert "| 3 | adaptive |" in run.stdout


def test_host_step_benchmark_refuses_bad_batches(tiny_dflash_seq_artifact):
    run = subprocess.run([sys.executable, str(SCRIPT), str(tiny_dflash_seq_artifact), "--batches", "0"],
                         capture_output=True, text=True)
    assert run.returncode == 2
    assert "--batches is '0'; allowed: comma-separated integers >= 1" in run.stderr
