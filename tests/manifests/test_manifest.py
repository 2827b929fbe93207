"""The manifest contract: round trip, and strict one-line errors naming key, value, allowed values and file."""

from __future__ import annotations

import copy
import json

import pytest

from mg.manifests import (
    FileEntry, KVLayer, KVSpec, Manifest, ManifestError, MethodSpec, ModelFacts, Provenance, TensorSpec,
    manifest_from_dict, manifest_to_dict, read_manifest, write_manifest,
)


def _manifest(layout="sequence") -> Manifest:
    layers = (KVLayer(0, "ring", 8, 2, 16), KVLayer(1, "flat", 0, 2, 16))
    kv = KVSpec(layout=layout, max_seqs=3 if layout == "sequence" else None,
                max_cells=None if layout == "sequence" else 256, capacity=128, max_write=16, dtype="float32",
                layers=layers)
    fwd = MethodSpec("forward", (TensorSpec("tokens", "ids", "int64", ("N",)),),
                     (TensorSpec("logits", "logits", "float32", ("R", 512)),), {"N": (1, 16), "R": (1, 16)})
    return Manifest(format="mg-artifact", version=1,
                    model=ModelFacts("m", 512, 64, 2, 1, (2,), "float32"), kv=kv, draft=None, methods=(fwd,),
                    files=(FileEntry("model.pte", 10, "0" * 64),), provenance=Provenance("0.1.0", "2.13", "1.5"))


@pytest.mark.parametrize("layout", ["sequence", "cell"])
def test_round_trip_is_identity(tmp_path, layout):
    m = _manifest(layout)
    write_manifest(m, tmp_path / "manifest.json")
    assert read_manifest(tmp_path / "manifest.json") == m


def _error(data) -> str:
    with pytest.raises(ManifestError) as e:
        manifest_from_dict(data, "art/manifest.json")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("art/manifest.json: ")
    return msg


def test_unknown_key_is_refused_naming_it():
    d = manifest_to_dict(_manifest())
    d["kv"]["pages"] = 4
    msg = _error(d)
    assert "kv.pages" in msg and "layout" in msg


def test_layout_other_than_sequence_or_cell_is_refused():
    d = manifest_to_dict(_manifest())
    d["kv"]["layout"] = "paged"
    msg = _error(d)
    assert "kv.layout" in msg and "'paged'" in msg and "sequence | cell" in msg


@pytest.mark.parametrize("path,value,needle", [
    (("kv", "max_seqs"), 0, "kv.max_seqs"),
    (("kv", "max_write"), 1000, "kv.max_write"),
    (("kv", "capacity"), "128", "kv.capacity"),
    (("model", "vocab_size"), 1.5, "model.vocab_size"),
    (("model", "eos_ids"), [9999], "eos_ids"),
    (("kv", "dtype"), "float16", "kv.dtype"),
    (("version",), 2, "version"),
])
def test_wrong_type_or_range_names_key_value_and_allowed(path, value, needle):
    d = manifest_to_dict(_manifest())
    node = d
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    msg = _error(d)
    assert needle in msg and repr(value).strip("[]") in msg and "allowed" in msg


def test_layer_policy_and_window_must_agree():
    d = manifest_to_dict(_manifest())
    d["kv"]["layers"][1]["window"] = 4
    assert "kv.layers[1].window" in _error(d)


def test_cell_layout_must_not_declare_max_seqs():
    d = manifest_to_dict(_manifest("cell"))
    d["kv"]["max_seqs"] = 3
    assert "kv.max_seqs" in _error(d)


def test_missing_key_is_refused():
    d = manifest_to_dict(_manifest())
    del d["files"]
    assert "missing key 'files'" in _error(d)


def test_corrupt_json_names_the_file(tmp_path):
    p = tmp_path / "manifest.json"
    p.write_text("{not json")
    with pytest.raises(ManifestError, match="manifest.json: not valid JSON"):
        read_manifest(p)


def test_method_bounds_must_cover_symbolic_dims():
    d = manifest_to_dict(_manifest())
    d2 = copy.deepcopy(d)
    del d2["methods"][0]["bounds"]["R"]
    assert "methods[0].outputs[0].shape" in _error(d2)
    json.dumps(d)  # the dict form is plain JSON
