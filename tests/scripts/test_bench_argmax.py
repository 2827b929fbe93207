"""Claims about scripts/bench_argmax.py that hold without a GPU: bad arguments and a machine without CUDA are
refused in one line, exit 2."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_argmax  # noqa: E402


def _run(monkeypatch, capsys, *args) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["bench_argmax.py", *args])
    try:
        code = bench_argmax.main()
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("args,line", [
    (["--dtypes", "int8"], "--dtypes is 'int8'; allowed: comma-separated float32, bfloat16, float16"),
    (["--rows", "0"], "--rows is '0'; allowed: comma-separated integers >= 1"),
    (["--calls", "0"], "--calls is 0 and --reps 10; allowed: integers >= 1"),
])
def test_bad_arguments_are_refused_in_one_line(monkeypatch, capsys, args, line):
    code, err = _run(monkeypatch, capsys, *args)
    assert code == 2 and err.splitlines()[-1].endswith(line)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_says_so_in_one_line(monkeypatch, capsys):
    assert _run(monkeypatch, capsys) == (
        2, "bench_argmax: needs a CUDA device (the kernels it times are CUDA kernels); torch sees none")
