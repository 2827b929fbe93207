"""Claims about scripts/replay_speculation.py: the runtime's draft choice replayed against known acceptance
drafts where the text is predictable and not where it is not, commits exactly the tokens asked for, gives the
same numbers twice, reads recorded cost tables back, and bad input is refused in one line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from mg.runtime.artifact import load_artifact
from mg.runtime.config import RunConfig
from mg.runtime.engine import Engine
from mg.runtime.speculative import CostModel

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "replay_speculation.py"
MAX_NEW = 40
HOST = {"target_only": 30e-6, "plain": 38e-6, "drafting": 50e-6}


def _load_script():
    spec = importlib.util.spec_from_file_location("replay_speculation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


rs = _load_script()


def _fixed_spec(artifact, probes: str = "round"):
    """The speculator of an adaptive engine, priced by fixed tables (a 1 ms step, 0.1 ms per row, a 0.2 ms draft
    call): the same choices on every machine."""
    engine = Engine(load_artifact(artifact), RunConfig(speculation="adaptive", probes=probes))
    s = engine.spec
    s.runner.call_log = None
    sizes = (1, 2, 4, 8, 16, 24)
    s.costs = CostModel({n: 1e-3 + 1e-4 * n for n in sizes}, {b: 2e-4 for b in (1, 2, 3)}, {m: 2e-5 for m in sizes},
                        padded=False)
    rs.fresh_estimates(s, None, None, None)
    return s


@pytest.fixture()
def spec(tiny_dflash_seq_artifact):
    return _fixed_spec(tiny_dflash_seq_artifact)


def _oracle(accepts):
    """A prompt of 6 tokens and a continuation of MAX_NEW; `accepts(i, avail)` drafts accepted at position i."""
    text = list(range(10, 16 + MAX_NEW))
    last = len(text) - 1
    block = 7  # the tiny drafter's block 8, less the anchor
    accept = [accepts(i, min(block, last - p - 1)) for i, p in enumerate(range(6, last))]
    return {"text": text, "prompt_tokens": 6, "accept": accept}


def _commits(result) -> int:
    """Tokens the replay committed after the prefill's one: a plain step makes 1, a round 1 + its accepted."""
    rounds = result["rounds"]
    accepted = round(result["acceptance_length"] * rounds) - rounds if rounds else 0
    return sum(result["chosen_k_hist"]) + accepted


def test_replay_drafts_where_the_text_is_predictable_and_commits_exactly_the_budget(spec):
    every = _oracle(lambda i, avail: avail)
    good = rs.replay_batch(spec, [every], MAX_NEW, HOST)
    assert good["rounds"] > 0 and good["acceptance_length"] > 4 and good["speedup"] > 2
    assert _commits(good) == MAX_NEW - 1
    rs.fresh_estimates(spec, None, None, None)
    for _ in range(30):  # estimates that learnt the drafter is always wrong
        spec.acceptance.observe(1, 7, 0)
    none = _oracle(lambda i, avail: 0)
    bad = rs.replay_batch(spec, [none], MAX_NEW, HOST)
    assert bad["acceptance_length"] in (0.0, 1.0) and bad["rounds"] <= 4  # a few probes at most
    assert 0.8 < bad["speedup"] <= 1.0
    assert _commits(bad) == MAX_NEW - 1
    assert good["target_only_s"] == bad["target_only_s"] == pytest.approx((MAX_NEW - 1) * (1.1e-3 + 30e-6))


def test_replayed_shadow_probes_observe_the_texts_acceptance_and_find_a_predictable_stretch(tiny_dflash_seq_artifact):
    """With shadow probes a sequence the estimates keep at plain steps probes by a draft call whose drafts are the
    text's (as many right as a round there accepts); each observes exactly that, and a text that turns
    predictable halfway is found: rounds follow, and the tokens committed are exactly the budget."""
    s = _fixed_spec(tiny_dflash_seq_artifact, probes="shadow")
    for _ in range(30):  # estimates that learnt the drafter is always wrong
        s.acceptance.observe(0, 7, 0)
    later = _oracle(lambda i, avail: 0 if i < MAX_NEW // 3 else avail)
    observed, observe = [], s.acceptance.observe
    s.acceptance.observe = lambda slot, k, a: (observed.append((k, a)), observe(slot, k, a))
    result = rs.replay_batch(s, [later], MAX_NEW, HOST)
    assert result["shadow_probes"] >= 1 and result["rounds"] > 0 and _commits(result) == MAX_NEW - 1
    shadows = observed[:result["shadow_probes"]]  # (the first observations: rounds come after a shadow's verdict)
    assert shadows[0] == (7, 0) and any(a > 0 for _, a in shadows)


def test_a_replayed_batch_drafts_where_the_texts_are_predictable(spec):
    every = [_oracle(lambda i, avail: avail) for _ in range(3)]
    good = rs.replay_batch(spec, every, MAX_NEW, HOST)
    assert good["rounds"] > 0 and good["speedup"] > 1.5
    for slot in range(3):  # estimates that learnt the drafter is always wrong
        for _ in range(30):
            spec.acceptance.observe(slot, 7, 0)
    never = [_oracle(lambda i, avail: 0) for _ in range(3)]
    bad = rs.replay_batch(spec, never, MAX_NEW, HOST)
    assert 0.8 < bad["speedup"] <= 1.0 and bad["rounds"] <= 3 * 4
    assert good["target_only_s"] == bad["target_only_s"] == pytest.approx((MAX_NEW - 1) * (1.3e-3 + 30e-6))


def test_replay_gives_the_same_numbers_twice(spec):
    oracle = {f"p{j}": _oracle(lambda i, avail, j=j: avail if (i + j) % 3 else 0) for j in range(3)}
    runs = []
    for _ in range(2):
        rs.fresh_estimates(spec, None, None, None)
        runs.append(rs.replay(spec, oracle, list(oracle), MAX_NEW, HOST, passes=2))
    assert runs[0] == runs[1]
    assert rs.summary(runs[0])["rounds"] > 0


@pytest.mark.parametrize("args,message", [
    (["--host-us", "30,40"], "--host-us is '30,40'; allowed: three numbers >= 0 (target-only, plain, drafting)"),
    (["--orders", "0"], "allowed: --max-new-tokens >= 2, --passes >= 1, --orders >= 1"),
    (["--batch", "9"], "--batch is 9; allowed: an integer in [0, 8] (the sequences the export serves at once)"),
    (["--probe-budget", "0"], "--probe-budget is 0.0; allowed: a number > 0"),
    (["--tables", "missing.json"], "--tables missing.json: no cost tables (FileNotFoundError"),
])
def test_replay_refuses_bad_input_in_one_line(tmp_path, args, message):
    run = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(tmp_path / "r.json")],
                         capture_output=True, text=True)
    assert run.returncode == 2 and message in run.stderr
    assert not (tmp_path / "r.json").exists()


def test_recorded_tables_are_read_back_as_written(tmp_path):
    """`--tables` reads what an `--out` recorded (seconds by row count, keys as JSON strings), so a replay can use
    another machine's or another run's tables; a file without them is refused."""
    import argparse
    import json

    recorded = {"forward": {"1": 0.02, "16": 0.03}, "draft": {"1": 0.01}, "append": {"1": 5e-4}}
    path = tmp_path / "replay.json"
    path.write_text(json.dumps({"tables": recorded}))
    p = argparse.ArgumentParser()
    assert rs.read_tables(p, path) == {"forward": {1: 0.02, 16: 0.03}, "draft": {1: 0.01}, "append": {1: 5e-4}}
    path.write_text(json.dumps({"tables": {"forward": {}}}))
    with pytest.raises(SystemExit):
        rs.read_tables(p, path)

