"""scripts/bench_decode.py refuses bad batch lists in one line (exit 2) before any export or benchmark work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_decode.py"


@pytest.mark.parametrize("option, value, allowed", [
    ("--batches", "1,x", "comma-separated integers >= 1"),
    ("--batches", "", "comma-separated integers >= 1"),
    ("--dflash-batches", "1,0", "comma-separated integers >= 1 or ''"),
    ("--e2e-batches", "two", "comma-separated integers >= 1 or ''"),
])
def test_bench_decode_refuses_bad_batch_lists(option, value, allowed, tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", option, value,
                          "--workdir", str(tmp_path / "work")], capture_output=True, text=True)
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert last == f"bench_decode.py: error: {option} is {value!r}; allowed: {allowed}"
    assert not (tmp_path / "work").exists()  # nothing exported
