"""scripts/eval_quant.py: scheme names (the -gptq and -head suffixes) and bad lists refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_scheme_names_split_into_weights_gptq_and_head(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import eval_quant

    assert eval_quant._parts("int8") == ("int8", False, False)
    assert eval_quant._parts("int4-head") == ("int4", False, True)
    assert eval_quant._parts("int4-gptq") == ("int4", True, False)
    assert eval_quant._parts("int8-gptq-head") == ("int8", True, True)


@pytest.mark.parametrize("value", ["int8,float", "float,int4-head-gptq", "float,int8,int8", "float,head"])
def test_bad_schemes_are_refused_in_one_line(value, tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPTS / "eval_quant.py"), "--schemes", value,
                          "--out", str(tmp_path / "out.json")], capture_output=True, text=True)
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"eval_quant.py: error: --schemes is {value!r}; allowed: float first, then distinct ones of")
    assert "int4-gptq-head" in last
    assert not (tmp_path / "out.json").exists()
