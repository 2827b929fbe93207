"""Claims about scripts/profile_engine.py's step kinds: every step of a run is timed once and sorted by what it
scheduled (prompt chunks, plain decode rows, drafts), and the times add up to no more than the run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.parametrize("speculation", [None, "fixed"])
def test_step_kinds_count_every_step_of_a_run_with_admissions(tiny_dflash_seq_artifact, monkeypatch, speculation):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import profile_engine
    from mg.runtime.artifact import load_artifact
    from mg.runtime.config import RunConfig
    from mg.runtime.engine import Engine
    from mg.runtime.scheduler import Request

    art = load_artifact(tiny_dflash_seq_artifact)
    engine = Engine(art, RunConfig(dflash=speculation is not None, speculation=speculation or "fixed"))
    prompt_steps = []  # the forwards that wrote prompt rows, seen from the runner
    pack = engine.runner.pack
    engine.runner.pack = lambda decode, ks, prefill, *a, **k: (prompt_steps.append(bool(prefill)),
                                                               pack(decode, ks, prefill, *a, **k))[1]
    kinds = profile_engine._StepKinds(engine)
    reqs = [Request(f"r{i}", tuple(range(5 + i, 5 + i + 9 + 4 * i)), 10) for i in range(5)]  # 5 prompts, 3 slots
    t0 = time.perf_counter()
    engine.run(reqs)
    wall = time.perf_counter() - t0
    got = kinds.as_dict()
    assert sum(v["steps"] for k, v in got.items() if k != "read-back") == engine.stats.steps
    # Prompt chunks never fuse: every step that has them packs its forward. Admissions come in two waves here.
    assert got["prompt"]["steps"] + got["prompt+drafts"]["steps"] == sum(prompt_steps) >= 2
    assert (got["drafts"]["steps"] > 0) == (speculation is not None)
    assert (got["prompt+drafts"]["steps"] > 0) == (speculation is not None)  # fixed drafts beside prompt chunks too
    for v in got.values():
        assert v["longest_ms"] <= v["ms"] and (v["longest_ms"] > 0) == (v["steps"] > 0)
    assert got["plain"]["steps"] > 0
    assert all(v["ms"] >= 0 for v in got.values())
    assert 0 < sum(v["ms"] for v in got.values()) <= 1e3 * wall


def test_append_times_count_every_context_append_and_its_rows(tiny_dflash_seq_artifact, monkeypatch):
    """Every append of committed context is timed once with the rows it carried (together, every row appended
    to the finished requests' draft contexts), with one admission per draft_append call, and its parts take no
    longer than it."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import profile_engine
    from mg.runtime.artifact import load_artifact
    from mg.runtime.config import RunConfig
    from mg.runtime.engine import Engine
    from mg.runtime.scheduler import Request

    engine = Engine(load_artifact(tiny_dflash_seq_artifact), RunConfig(dflash=True, speculation="fixed"))
    times = profile_engine._AppendTimes(engine)
    held = []  # the rows appended to each request's draft context, when it finishes (unfused rounds on the CPU)
    release = engine.spec.release
    engine.spec.release = lambda slot: (held.append(engine.spec._appended.get(slot, 0)), release(slot))[1]
    engine.run([Request(f"r{i}", tuple(range(5 + i, 14 + 2 * i)), 12, ignore_eos=True) for i in range(3)])
    got = times.as_dict()
    assert got["appends"] == len(times.seconds["append"]) == len(times.seconds["take"]) > 0
    assert sum(times.rows) == sum(held) > 0
    assert len(times.seconds["admit"]) == len(times.seconds["calls"]) >= got["appends"]
    assert sum(times.seconds["take"]) + sum(times.seconds["calls"]) <= sum(times.seconds["append"])


def test_speculator_times_count_every_call_once_by_kind_of_step(tiny_dflash_seq_artifact, monkeypatch):
    """`--speculator`: each step's choice, reservation and accounting is timed once, apart for steps with prompt
    chunks (counted from the runner's forwards), and the times add up to no more than the run."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import profile_engine
    from mg.runtime.artifact import load_artifact
    from mg.runtime.config import RunConfig
    from mg.runtime.engine import Engine
    from mg.runtime.scheduler import Request

    engine = Engine(load_artifact(tiny_dflash_seq_artifact), RunConfig(dflash=True, speculation="fixed"))
    prompt_steps = []
    pack = engine.runner.pack
    engine.runner.pack = lambda decode, ks, prefill, *a, **k: (prompt_steps.append(bool(prefill)),
                                                               pack(decode, ks, prefill, *a, **k))[1]
    times = profile_engine._SpecTimes(engine)
    reqs = [Request(f"r{i}", tuple(range(5 + i, 5 + i + 9 + 4 * i)), 10) for i in range(5)]
    t0 = time.perf_counter()
    engine.run(reqs)
    wall = time.perf_counter() - t0
    got = times.as_dict()
    for part in ("reserve_known", "step_done"):  # one call per step
        assert got[f"{part} (prompt step)"]["calls"] == sum(prompt_steps) >= 2
    # A choice in each step with decoding sequences (not the first, of prompt chunks only).
    assert 1 <= got["choose (prompt step)"]["calls"] < sum(prompt_steps)
    assert got["choose"]["calls"] == engine.stats.steps - sum(prompt_steps)
    assert got["step_done"]["calls"] + got["step_done (prompt step)"]["calls"] == engine.stats.steps
    assert got["reserve_known"]["calls"] + got["reserve_known (prompt step)"]["calls"] == engine.stats.steps
    assert got["commit"]["calls"] > 0 and got["end_commits"]["calls"] > 0
    assert all(v["median_us"] is None or v["median_us"] * 1e-3 <= v["total_ms"] for v in got.values())
    assert 0 < sum(v["total_ms"] for v in got.values()) <= 1e3 * wall


def test_alone_serves_every_prompt_in_turn_on_one_engine_with_fused_rounds_asked_for(tiny_dflash_seq_artifact,
                                                                                    monkeypatch):
    """`--alone` times each request alone on one engine (the speculator's calls of all of them counted), and
    `--fused-rounds on` gives the CPU engine fused rounds, `off` none."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import profile_engine
    from mg.runtime.artifact import load_artifact
    from mg.runtime.scheduler import Request

    reqs = [Request(f"r{i}", tuple(range(5 + i, 12 + 2 * i)), 6) for i in range(3)]
    assert profile_engine._runs(reqs, 2) == [reqs[:2]] and profile_engine._runs(reqs, "alone") == [[r] for r in reqs]
    art = load_artifact(tiny_dflash_seq_artifact)
    assert not profile_engine._engine(art, "adaptive", "cpu", "off").spec.rounds
    engine = profile_engine._engine(art, "adaptive", "cpu", "on")
    assert engine.spec.rounds
    times = profile_engine._SpecTimes(engine)
    seconds = sum(profile_engine._timed(engine, run) for run in profile_engine._runs(reqs, "alone"))
    assert seconds > 0 and engine.stats.generated_tokens == 18
    spec = times.as_dict()
    assert spec["step_done"]["calls"] + spec["step_done (prompt step)"]["calls"] == engine.stats.steps
    assert spec["step_done (prompt step)"]["calls"] >= 3  # one prompt step per request at least


def test_a_mode_suffix_sets_how_the_methods_run_and_an_unknown_one_is_refused(tiny_dflash_seq_artifact,
                                                                              monkeypatch):
    """`plain:compiled` / `adaptive:interpreted` set `RunConfig.compile` (no suffix: the device's default), and
    `--modes` with a name or suffix it does not know is one line, exit 2."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import profile_engine

    plain = profile_engine._config("plain:compiled", "cpu")
    assert plain.compile is True and plain.compiled and not plain.dflash
    adaptive = profile_engine._config("adaptive:interpreted", "cpu")
    assert adaptive.compile is False and adaptive.dflash and adaptive.speculation == "adaptive"
    assert profile_engine._config("no-drafts", "cpu").compile is None
    assert profile_engine._parse_mode("fixed:compiled") == ("fixed", True)
    for bad in ("plain:fast", "greedy", "plain:"):
        assert profile_engine._parse_mode(bad) is None
        run = subprocess.run([sys.executable, str(SCRIPTS / "profile_engine.py"), str(tiny_dflash_seq_artifact),
                              "--modes", f"plain,{bad}"], capture_output=True, text=True)
        assert run.returncode == 2
        assert run.stderr.strip().splitlines()[-1].endswith(
            f"--modes is 'plain,{bad}'; allowed: comma-separated names among plain, no-drafts, fixed, adaptive, "
            "each optionally with :compiled or :interpreted")
