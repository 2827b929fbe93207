"""Shared fixtures: the tiny preset model and exported tiny artifacts (exported once per session)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_cfg():
    from mg.export.config import PRESETS

    return PRESETS["tiny"]


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg):
    from mg.export.model import MuseGlimmer, init_random

    return init_random(MuseGlimmer(tiny_cfg), 0).eval()


# The export of `tiny_dflash_seq_artifact`. Module fixtures that need the very same export take that session
# fixture instead of exporting it again (an export with a drafter costs about 30 s on CPU).
DFLASH_SEQ = dict(layout="sequence", max_seqs=3, max_context=96, max_write=24, draft="tiny")


def _export_call(out, draft=None, **kw):
    """What `_export` hands to `export_artifact`: (options, target, drafter or None)."""
    from mg.export.artifact import PRESET_SEED, ExportOptions, load_target
    from mg.export.draft_lower import load_draft

    opts = ExportOptions(output_dir=out, **kw)
    target = load_target(None, "tiny")
    drafter = load_draft(None, draft, target.cfg, PRESET_SEED) if draft else None
    return opts, target, drafter


def _export(out, draft=None, **kw):
    from mg.export.artifact import export_artifact

    opts, target, drafter = _export_call(out, draft, **kw)
    export_artifact(opts, target, lambda msg: None, drafter)
    return out


@pytest.fixture(scope="session")
def tiny_seq_artifact(tmp_path_factory):
    """Tiny preset, sequence layout, 3 sequences, context 96, 24 tokens per step."""
    return _export(tmp_path_factory.mktemp("art") / "seq", layout="sequence", max_seqs=3, max_context=96,
                   max_write=24)


@pytest.fixture(scope="session")
def tiny_cell_artifact(tmp_path_factory):
    """Tiny preset, cell layout, 256 cells, context 96, 24 tokens per step."""
    return _export(tmp_path_factory.mktemp("art") / "cell", layout="cell", max_cells=256, max_context=96,
                   max_write=24)


@pytest.fixture(scope="session")
def tiny_dflash_seq_artifact(tmp_path_factory):
    """Tiny target + tiny drafter (block 8), sequence layout, 3 sequences."""
    return _export(tmp_path_factory.mktemp("art") / "dseq", **DFLASH_SEQ)


@pytest.fixture(scope="session")
def tiny_dflash_cell_artifact(tmp_path_factory):
    """Tiny target + tiny drafter (block 8), cell layout, 256 cells."""
    return _export(tmp_path_factory.mktemp("art") / "dcell", layout="cell", max_cells=256, max_context=96,
                   max_write=24, draft="tiny")


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Tests never read or leave verified stamps or cost tables in the user's cache folder."""
    import os

    old = os.environ.get("MG_CACHE_DIR")
    os.environ["MG_CACHE_DIR"] = str(tmp_path_factory.mktemp("mg-cache"))
    yield
    if old is None:
        os.environ.pop("MG_CACHE_DIR", None)
    else:
        os.environ["MG_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def _fresh_speculation_knowledge():
    """Each test's engines start from the prior: what earlier engines of the process learnt (the drafter's
    global acceptance, host work per step, the probe overrun kept in the cache folder) is shared by design, which
    would make tests depend on their order."""
    from mg.manifests.values import cache_root
    from mg.runtime import speculative

    speculative._GLOBAL_ACCEPTANCE.clear()
    speculative._HOST_WORK.clear()
    for kept in (cache_root() / "cost-tables").glob("*-probe-overrun-*.json"):  # (the probe overrun persists)
        kept.unlink()
    yield
