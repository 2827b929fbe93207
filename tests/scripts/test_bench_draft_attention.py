"""Claims about scripts/bench_draft_attention.py that hold without a GPU: its table shows each point's unsplit,
planned and best split counts with the planned one's speed-up, and it refuses bad input or a machine without CUDA
in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_draft_attention as bda  # noqa: E402


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / "bench_draft_attention.py"), "--out", "unused.json", *args],
                          capture_output=True, text=True)


def test_the_table_shows_the_planned_split_count_against_the_unsplit_kernel():
    row = bda.Row("default", 1, 512, "columns", 8, {1: 30.0, 8: 10.0, 4: 12.0}, 10.0, 30.0, 8, 10.0, 1e-6)
    assert "| default | 1 | 512 | columns | 30.0 | 8 | 10.0 | 3.00 | 8 | 10.0 | 1.0e-06 |" in bda.markdown([row], "X")


def test_an_unknown_shape_is_refused_in_one_line():
    run = _run("--shapes", "default,huge")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "bench_draft_attention: unknown shape 'huge'; allowed: default, default-ieee, medium, mg-30b"]


def test_a_context_the_capacity_cannot_hold_is_refused_in_one_line():
    run = _run("--contexts", "128,4090", "--capacity", "4096")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].endswith("allowed: contexts <= capacity - block")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_says_so_in_one_line():
    run = _run()
    assert run.returncode == 2 and run.stderr.strip().splitlines() == ["bench_draft_attention: needs a CUDA device"]
