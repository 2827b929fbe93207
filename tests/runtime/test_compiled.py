"""Compiled methods (runtime/compiled.py) == the interpreter, and their disk cache is never trusted blindly.

CPU tests compile with Inductor's C++ backend: each method's compiled variants against the interpreter on
the same padded inputs, greedy DFlash generation compiled == interpreted (both layouts), the cache reused
by a second compiler, a corrupt or stale cache entry compiled again with one line said, a failing compile
falling back to the interpreter with one line naming the method. CUDA tests (skipped without a device):
compiled + CUDA graphs == the interpreter + CUDA graphs, token for token, target-only and DFlash.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from mg.manifests import constants as C
from mg.runtime import compiled as compiled_mod
from mg.runtime.artifact import load_artifact
from mg.runtime.compiled import MethodCompiler
from mg.runtime.config import ConfigError, RunConfig
from mg.runtime.engine import Engine
from mg.runtime.model_runner import ModelRunner
from mg.runtime.scheduler import Request

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Inductor's CPU backend builds C++ with the system compiler.
needs_cxx = pytest.mark.skipif(not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "clang++")),
                               reason="needs a C++ compiler (Inductor's CPU backend)")
DFLASH = ["tiny_dflash_seq_artifact", "tiny_dflash_cell_artifact"]


def _requests(vocab: int) -> list[Request]:
    gen = torch.Generator().manual_seed(7)
    return [Request(f"r{i}", tuple(torch.randint(4, vocab, (n,), generator=gen).tolist()), m)
            for i, (n, m) in enumerate(zip((3, 17, 30), (14, 9, 20)))]


def _filled(runner: ModelRunner, method: str, size: int) -> list:
    """Inputs of `size` rows with live-looking values (not only padding), valid for the method."""
    gen = torch.Generator().manual_seed(size)
    blank = [x.clone() for x in runner._plans[method].blank(size)]
    if method == C.METHOD_FORWARD:
        blank[0] = torch.randint(4, 200, (size,), generator=gen)
        blank[1] = torch.arange(size)
        blank[3] = torch.arange(size)
    elif method == C.METHOD_DRAFT_BLOCK:
        blank[0][:, 0] = torch.randint(4, 200, (size,), generator=gen)
    else:
        blank[0] = torch.randn(blank[0].shape, generator=gen).to(blank[0].dtype)
        blank[1] = torch.arange(size)
    return blank


@pytest.fixture(scope="module")
def compiled_runner(tiny_dflash_seq_artifact):
    """A compiling runner on the sequence-layout DFlash artifact, and an interpreting one on its own load."""
    art = load_artifact(tiny_dflash_seq_artifact)
    compiled = ModelRunner(art, RunConfig(compile=True), with_draft=True)
    interpreted = ModelRunner(load_artifact(tiny_dflash_seq_artifact), RunConfig(pad_steps=True), with_draft=True)
    return compiled, interpreted


@needs_cxx
@pytest.mark.slow
def test_every_method_compiles_and_matches_the_interpreter(compiled_runner):
    compiled, interpreted = compiled_runner
    assert set(compiled.compiled_methods) == {C.METHOD_FORWARD, C.METHOD_DRAFT_BLOCK, C.METHOD_DRAFT_APPEND}
    assert interpreted.compiled_methods == ()
    for method in compiled.compiled_methods:
        for size in (1, 2, 3):  # 3: the symbolic variant at a size it was not traced at, unpadded sizes included
            inputs = _filled(compiled, method, size)
            got = compiled._run(method, list(inputs), True)
            want = interpreted._run(method, list(inputs), True)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert g.shape == w.shape and g.dtype == w.dtype, (method, size)
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"{method} at {size} rows")
    events = compiled.compile_stats.events
    assert {(m, v) for m, v, what, _ in events if what in ("compiled", "loaded")} == {
        (m, v) for m in compiled.compiled_methods for v in ("1", "n")}


@needs_cxx
@pytest.mark.slow
def test_without_the_one_row_variant_every_size_runs_the_symbolic_one(compiled_runner, tmp_path):
    # Row-invariant serving compiles no static one-row variant (a row then meets the same kernels, launched
    # alike, in a 1-row step and in a verify): the symbolic variant takes 1-row calls too, and equals the
    # interpreter there.
    runner = compiled_runner[1]
    compiler = MethodCompiler(runner.program, "e" * 64, runner.device, cache_dir=tmp_path)
    plan = runner._plans[C.METHOD_FORWARD]
    method = compiler.compile(C.METHOD_FORWARD, plan.blank, plan.limit, runner.ops, one_row=False)
    assert method is not None and method.variants == ("n",)
    assert [(v, what) for _, v, what, _ in compiler.stats.events] == [("n", "compiled")]
    for size in (1, 2, 5):
        inputs = _filled(runner, C.METHOD_FORWARD, size)
        got = method(list(inputs), runner.ops)
        want = runner.program.run(C.METHOD_FORWARD, list(inputs), ops=runner.ops)
        for g, w in zip(got, want):
            assert g.shape == w.shape, size
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"forward at {size} rows")
    both = MethodCompiler(runner.program, "e" * 64, runner.device, cache_dir=tmp_path).compile(
        C.METHOD_FORWARD, plan.blank, plan.limit, runner.ops)
    assert both.variants == ("1", "n")


@needs_cxx
@pytest.mark.slow
@pytest.mark.parametrize("fixture", DFLASH)
def test_greedy_dflash_compiled_equals_interpreted(fixture, request):
    art_dir = request.getfixturevalue(fixture)
    vocab = load_artifact(art_dir).manifest.model.vocab_size
    runs = {}
    for compile_ in (False, True):
        engine = Engine(load_artifact(art_dir), RunConfig(compile=compile_, pad_steps=True))
        runs[compile_] = [r.tokens for r in engine.run(_requests(vocab))]
        if compile_:
            assert engine.runner.compiled_methods
    assert runs[True] == runs[False]


def _said(caplog) -> list[str]:
    """Warnings the runtime said (torch logs its own records too; progress notes are INFO)."""
    return [r.getMessage() for r in caplog.records if r.name == "mg.runtime" and r.levelno >= logging.WARNING]


def _compile_draft_append(runner: ModelRunner, cache_dir) -> MethodCompiler:
    compiler = MethodCompiler(runner.program, "f" * 64, runner.device, cache_dir=cache_dir)
    plan = runner._plans[C.METHOD_DRAFT_APPEND]
    method = compiler.compile(C.METHOD_DRAFT_APPEND, plan.blank, plan.limit, runner.ops)
    assert method is not None
    inputs = _filled(runner, C.METHOD_DRAFT_APPEND, 2)
    got = method(list(inputs), runner.ops)
    want = runner.program.run(C.METHOD_DRAFT_APPEND, list(inputs), ops=runner.ops)
    torch.testing.assert_close(got[0], want[0])
    return compiler


@needs_cxx
@pytest.mark.slow
def test_cache_is_reused_and_a_corrupt_or_stale_entry_is_compiled_again(compiled_runner, tiny_dflash_seq_artifact,
                                                                        tmp_path, caplog, monkeypatch):
    runner = compiled_runner[1]
    first = _compile_draft_append(runner, tmp_path)
    assert [w for _, _, w, _ in first.stats.events] == ["compiled", "compiled"]
    entry = tmp_path / ("f" * 32) / f"{C.METHOD_DRAFT_APPEND}-n.bin"
    assert entry.is_file() and entry.with_suffix(".json").is_file()

    caplog.set_level(logging.WARNING, logger="mg.runtime")
    second = _compile_draft_append(runner, tmp_path)
    assert [w for _, _, w, _ in second.stats.events] == ["loaded", "loaded"]
    assert _said(caplog) == []

    def no_tracing(*args, **kwargs):
        raise AssertionError("a cached method was traced again")

    with monkeypatch.context() as m:  # a later start finds the constants without tracing, also on a new load
        m.setattr(MethodCompiler, "trace", no_tracing)
        reloaded = ModelRunner(load_artifact(tiny_dflash_seq_artifact), RunConfig(pad_steps=True), with_draft=True)
        assert [w for _, _, w, _ in _compile_draft_append(reloaded, tmp_path).stats.events] == ["loaded", "loaded"]

    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    third = _compile_draft_append(runner, tmp_path)
    assert [w for _, _, w, _ in third.stats.events] == ["loaded", "compiled"]
    said = _said(caplog)
    assert len(said) == 1 and "does not match its recorded sha256 (corrupt); compiling again" in said[0], said
    caplog.clear()

    meta_path = entry.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    meta["key"]["torch"] = "0.0.0"
    meta_path.write_text(json.dumps(meta))
    fourth = _compile_draft_append(runner, tmp_path)
    assert [w for _, _, w, _ in fourth.stats.events] == ["loaded", "compiled"]
    said = _said(caplog)
    assert len(said) == 1 and "was built for another torch (0.0.0 != " in said[0], said
    assert [w for _, _, w, _ in _compile_draft_append(runner, tmp_path).stats.events] == ["loaded", "loaded"]


def test_a_failing_compile_leaves_the_method_interpreted(tiny_dflash_seq_artifact, tmp_path, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here\nsecond line")

    monkeypatch.setattr(torch._inductor, "standalone_compile", broken)
    monkeypatch.setattr(compiled_mod, "cache_root", lambda: tmp_path)
    caplog.set_level(logging.WARNING, logger="mg.runtime")
    art = load_artifact(tiny_dflash_seq_artifact)
    engine = Engine(art, RunConfig(compile=True))
    assert engine.runner.compiled_methods == ()
    assert _said(caplog) == [f"mg-run: compiling method {m!r} failed (RuntimeError: no compiler here); it runs interpreted"
                    for m in (C.METHOD_FORWARD, C.METHOD_DRAFT_BLOCK, C.METHOD_DRAFT_APPEND)]
    reference = Engine(load_artifact(tiny_dflash_seq_artifact), RunConfig(pad_steps=True))
    vocab = art.manifest.model.vocab_size
    assert [r.tokens for r in engine.run(_requests(vocab))] == [r.tokens for r in reference.run(_requests(vocab))]


def test_compile_needs_padded_calls():
    with pytest.raises(ConfigError, match="compile=True needs padded calls"):
        RunConfig(compile=True, pad_steps=False)
    assert RunConfig(compile=True).padded and not RunConfig().compiled and RunConfig(device="cuda").compiled


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fixture", DFLASH)
@pytest.mark.parametrize("dflash", [False, True])
def test_cuda_compiled_graphs_equal_interpreted_graphs(fixture, dflash, request):
    art_dir = request.getfixturevalue(fixture)
    vocab = load_artifact(art_dir).manifest.model.vocab_size
    runs = {}
    for compile_ in (False, True):
        engine = Engine(load_artifact(art_dir, device="cuda"), RunConfig(device="cuda", compile=compile_,
                                                                         dflash=dflash))
        runs[compile_] = [r.tokens for r in engine.run(_requests(vocab))]
        assert bool(engine.runner.compiled_methods) == compile_
    assert runs[True] == runs[False]
