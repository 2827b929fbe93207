"""`Engine.rehearse` (run by `warm_up` where CUDA graphs are on): throwaway requests through every kind of step,
leaving nothing learnt, counted or held."""

from __future__ import annotations

import copy

import pytest
import torch

from mg.runtime import speculative as spec_module
from mg.runtime.artifact import load_artifact
from mg.runtime.config import RunConfig
from mg.runtime.engine import Engine, EngineStats
from mg.runtime.scheduler import Request
from mg.runtime.speculative import SpecStats


def _prompts(tiny_cfg, n=3, length=9):
    return [Request(f"r{i}", tuple((7 + 13 * i + 5 * j) % tiny_cfg.vocab_size for j in range(length)), 14)
            for i in range(n)]


def _kinds(engine) -> list[str]:
    """Records each step's kind once `engine` runs: prompt / prompt+drafts / drafts / plain, "+sampled" when a
    sampled sequence decodes in it, "fused" for a fused round."""
    seen, box = [], {}
    schedule, fused_step = engine.scheduler.schedule, engine._fused_step

    def scheduled(*args, **kw):
        batch = schedule(*args, **kw)
        drafts = any(batch.n_drafts)
        kind = ("prompt" + ("+drafts" if drafts else "")) if batch.prefill else ("drafts" if drafts else "plain")
        if any(not s.request.sampling.greedy for s in batch.decode):
            kind += "+sampled"
        seen.append(kind)
        box["last"] = len(seen) - 1
        return batch

    def fused(batch):
        seen[box["last"]] = "fused"
        return fused_step(batch)

    engine.scheduler.schedule, engine._fused_step = scheduled, fused
    return seen


@pytest.mark.parametrize("which", ["tiny_dflash_seq_artifact", "tiny_dflash_cell_artifact"])
@pytest.mark.parametrize("fused", [False, True])
def test_rehearsal_runs_every_kind_of_step_and_leaves_nothing_learnt(which, fused, request, tiny_cfg):
    art = load_artifact(request.getfixturevalue(which))
    config = RunConfig(device="cpu", fused_rounds=fused)
    engine = Engine(art, config)
    spec = engine.spec
    key = (spec_module._program_key(engine.runner), spec.block)
    acceptance = copy.deepcopy(spec_module._GLOBAL_ACCEPTANCE[key])
    tables = copy.deepcopy(spec.costs.tables)
    windows = {k: w.values() for k, w in spec.costs._host.windows.items()}
    overrun = spec.costs._host.probe_overrun.values()
    kinds = _kinds(engine)
    engine.trace = spec.trace = []
    engine.warm_up(rehearse=True)

    expected = {"prompt", "prompt+drafts", "drafts+sampled", "plain", "plain+sampled"}
    expected.add("fused" if fused else "drafts")
    assert expected <= set(kinds), kinds
    # Nothing learnt, counted or held.
    assert spec_module._GLOBAL_ACCEPTANCE[key] == acceptance
    assert spec.costs.tables == tables and engine.runner.call_log == []
    assert {k: w.values() for k, w in spec.costs._host.windows.items()} == windows
    assert spec.costs._host.probe_overrun.values() == overrun
    assert engine.stats == EngineStats() and spec.stats == SpecStats() and spec.trace == []
    assert spec.adaptive and not spec._rehearsing_plain and spec._kept is None
    assert engine.scheduler.idle and engine.take_finished() == []
    assert all(engine.runner.draft_cache.length(slot) == 0 for slot in range(engine.cache.n_slots))
    assert all(count == 0 for count in spec._waiting.count) and not spec._appended

    # The same tokens as an engine that did not rehearse.
    reqs = _prompts(tiny_cfg)
    plain = Engine(art, config)
    assert [r.tokens for r in engine.run(reqs)] == [r.tokens for r in plain.run(reqs)]


def test_rehearsal_of_a_target_only_engine_runs_plain_steps_and_counts_nothing(tiny_seq_artifact, tiny_cfg):
    engine = Engine(load_artifact(tiny_seq_artifact), RunConfig(device="cpu"))
    kinds = _kinds(engine)
    engine.rehearse()
    assert {"prompt", "plain", "plain+sampled"} <= set(kinds) and not any("drafts" in k for k in kinds)
    assert engine.stats == EngineStats() and engine.scheduler.idle and engine.take_finished() == []


def test_rehearsal_waits_for_an_idle_engine_and_warm_up_rehearses_only_with_graphs(tiny_dflash_seq_artifact,
                                                                                    tiny_cfg):
    engine = Engine(load_artifact(tiny_dflash_seq_artifact), RunConfig(device="cpu"))
    kinds = _kinds(engine)
    engine.warm_up()  # no CUDA graphs: no rehearsal by default
    assert kinds == []
    req = _prompts(tiny_cfg, n=1)[0]
    engine.submit(req)
    engine.rehearse()  # a request of the caller's is pending: nothing runs
    assert kinds == [] and not engine.scheduler.idle
    while not engine.scheduler.idle:
        engine.step()
    engine.rehearse()  # its result is not taken yet: nothing runs, and the result stays
    assert len(kinds) == engine.stats.steps
    assert [r.id for r in engine.take_finished()] == [req.id]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("which", ["tiny_dflash_seq_artifact", "tiny_dflash_cell_artifact"])
def test_on_cuda_warm_up_rehearses_every_kind_of_step_and_the_first_requests_capture_nothing(which, request,
                                                                                          tiny_cfg):
    """Where the rehearsal is for: with CUDA graphs (and fused rounds, the default there) `warm_up` rehearses
    every kind of step, after which the first requests capture no graph, and their tokens are target-only's."""
    art = load_artifact(request.getfixturevalue(which), device="cuda")
    engine = Engine(art, RunConfig(device="cuda"))
    kinds = _kinds(engine)
    engine.warm_up()
    assert {"prompt", "prompt+drafts", "fused", "drafts+sampled", "plain", "plain+sampled"} <= set(kinds), kinds
    assert engine.stats == EngineStats() and engine.spec.stats == SpecStats()
    captures = engine.graph_counters.captures
    reqs = _prompts(tiny_cfg)
    got = [r.tokens for r in engine.run(reqs)]
    assert engine.graph_counters.captures == captures
    assert got == [r.tokens for r in Engine(art, RunConfig(device="cuda", dflash=False)).run(reqs)]
