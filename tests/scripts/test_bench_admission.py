"""scripts/bench_admission.py measures both admission paths of both layouts on the rows asked for, and leaves
the cache as it found it after each measurement."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_admission_bench_times_both_paths_of_both_layouts(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_admission

    out = tmp_path / "admission.json"
    monkeypatch.setattr(sys, "argv", ["bench_admission.py", "--rows", "4,9", "--reps", "3", "--rounds", "2",
                                      "--out", str(out)])
    assert bench_admission.main() == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["layout"], r["rows"]) for r in results] == [("sequence", 4), ("sequence", 9), ("cell", 4), ("cell", 9)]
    assert all(r["by_rows_ms"] > 0 and r["by_span_ms"] > 0 for r in results)
    assert capsys.readouterr().out.count("| cell |") == 2


@pytest.mark.parametrize("layout", ["sequence", "cell"])
def test_each_measurement_rewinds_what_it_admitted(monkeypatch, layout):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_admission
    from mg.manifests import KVLayer, KVSpec
    from mg.runtime.cache_base import make_cache

    spec = KVSpec(layout=layout, max_seqs=2, max_cells=64 if layout == "cell" else None, capacity=32, max_write=16,
                  dtype="float32", layers=(KVLayer(layer_id=0, policy="flat", window=0, n_kv_heads=1, head_dim=8),))
    cache = make_cache(spec, "cpu", n_slots=2)
    for how in ("rows", "spans"):
        bench_admission._median_ms(cache, 16, how, reps=2)
        assert cache.length(0) == 0
        if layout == "cell":
            assert cache.metrics().cells_free == 64
