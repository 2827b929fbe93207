"""Claims about scripts/bench_argmax.py that hold without a GPU: bad arguments and a machine without CUDA are
refused in one line, exit 2."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_argmax.py"


@pytest.mark.parametrize("args,line", [
    (["--dtypes", "int8"], "--dtypes is 'int8'; allowed: comma-separated float32, bfloat16, float16"),
    (["--rows", "0"], "--rows is '0'; allowed: comma-separated integers >= 1"),
    (["--calls", "0"], "--calls is 0 and --reps 10; allowed: integers >= 1"),
])
def test_bad_arguments_are_refused_in_one_line(args, line):
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1].endswith(line)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_says_so_in_one_line():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.strip() == (
        "bench_argmax: needs a CUDA device (the kernels it times are CUDA kernels); torch sees none")
