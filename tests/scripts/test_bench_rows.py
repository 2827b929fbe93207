"""Claims about scripts/bench_rows.py that hold without a GPU: it finds every linear shape of the embedded default
(counted as often as the models run them), sums a model's products by those counts, and refuses bad input or a
machine without CUDA in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_rows  # noqa: E402


def test_shapes_of_the_embedded_default_with_their_counts():
    shapes = {(s["model"], s["n"], s["k"]): s for s in bench_rows._shapes(None, None)}
    target = [s for s in shapes.values() if s["model"] == "target"]
    drafter = [s for s in shapes.values() if s["model"] == "drafter"]
    assert sum(s["count"] for s in target) == 6 * 4 + 1  # six layers' four linears and the head
    assert sum(s["count"] for s in drafter) == 3 * 7 + 1  # three layers' seven linears and fc
    assert shapes[("drafter", 128, 384)]["names"] == ["k_proj", "v_proj"]
    assert shapes[("target", 4096, 384)]["names"] == ["output"]


def test_sums_weigh_each_shape_by_its_count_and_the_table_shows_them():
    results = [{"model": "target", "names": ["a"], "n": 8, "k": 4, "count": 6, "rows": 1,
                "us": {"cublas": 2.0, "cublaslt": 3.0, "rows": 1.5}},
               {"model": "target", "names": ["head"], "n": 16, "k": 4, "count": 1, "rows": 1,
                "us": {"cublas": 4.0, "cublaslt": 5.0, "rows": 6.0}}]
    totals = bench_rows.sums(results)
    assert totals == [{"model": "target", "rows": 1, "us": {"cublas": 16.0, "cublaslt": 23.0, "rows": 15.0}}]
    text = bench_rows.tables(results, totals)
    assert "| target | 8 x 4 | a x6 | 1 | 2.00 | 3.00 | - | 1.50 | 0.50 |" in text
    assert "| target | 1 | 16.0 | 23.0 | - | 15.0 | 0.65 |" in text


def test_bad_rows_are_refused_in_one_line():
    run = subprocess.run([sys.executable, str(SCRIPTS / "bench_rows.py"), "--rows", "4,17"], capture_output=True,
                         text=True)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].endswith("allowed: rows 1-16, calls and reps >= 1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_says_so_in_one_line():
    run = subprocess.run([sys.executable, str(SCRIPTS / "bench_rows.py")], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.strip() == (
        "bench_rows: needs a CUDA device (the kernels it times are CUDA kernels); torch sees none")
