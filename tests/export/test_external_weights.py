"""Weights outside the program: `model.ptd` in ExecuTorch's FlatTensor format, streamed from single-file or
sharded checkpoints, read in place, cross-checked against the program; bad inputs are one line, exit 2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from mg.export.checkpoint import CONFIG_FILE, save_checkpoint
from mg.export.cli import main as export_main
from mg.manifests import constants as C, read_manifest
from mg.runtime.cli import main as run_main


def _export(args):
    result = CliRunner().invoke(export_main, args)
    return result.exit_code, result.output


def _run(args):
    result = CliRunner().invoke(run_main, args)
    return result.exit_code, result.output


def _tokens(artifact, *extra):
    requests = artifact.parent / f"{artifact.name}-requests.jsonl"
    requests.write_text(json.dumps({"id": "r", "tokens": [1, 70, 80, 90, 100]}) + "\n")
    code, out = _run([str(artifact), "--input", str(requests), "--max-new-tokens", "6", *extra])
    assert code == 0, out
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))["tokens"]


def _shard(ckpt, out, n_shards=3):
    """Write `ckpt` (a single-file checkpoint) again as Hugging Face style shards + index."""
    from safetensors.torch import load_file

    out.mkdir()
    shutil.copyfile(ckpt / CONFIG_FILE, out / CONFIG_FILE)
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for k in range(n_shards):
        part = names[k::n_shards]
        file = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / file))
        weight_map.update({n: file for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_cfg, tiny_model):
    ckpt = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_checkpoint(ckpt, tiny_cfg, tiny_model)
    return ckpt


def test_ptd_is_read_by_executorch_own_flat_tensor_reader(tiny_seq_artifact):
    from executorch.exir._serialize._cord import Cord
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    from mg.runtime.data_file import DataFile

    path = tiny_seq_artifact / C.WEIGHTS_FILE
    theirs = FlatTensorSerializer().deserialize(Cord(path.read_bytes()))
    ours = DataFile(path)
    assert set(theirs.named_data) == set(ours.entries) and len(ours.entries) > 50
    for key, entry in theirs.named_data.items():
        mine = ours.entries[key]
        assert list(mine.sizes) == list(entry.tensor_layout.sizes)
        assert bytes(theirs.buffers[entry.buffer_index]) == bytes(ours.tensor(key, torch.device("cpu"))
                                                                   .contiguous().view(torch.uint8).reshape(-1).numpy())


def test_executorch_runtime_runs_a_lowered_program_with_our_ptd(tmp_path):
    """The lowering's external constants and our .ptd, loaded by ExecuTorch's own runtime."""
    pytest.importorskip("executorch.runtime")
    from executorch.runtime import Runtime

    from mg.export.lower import ProgramParts, export_lifted, to_program
    from mg.export.ptd import PtdTensor, write_ptd
    from mg.export.weights import ModuleWeights

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(3, 8)
    method = export_lifted(net, (x,), (None,))
    program, external = to_program(ProgramParts({"forward": method}, {}))
    source = ModuleWeights(net)
    tensors = [PtdTensor(k, d, s, lambda k=k, s=s, d=d: source.chunks(k, s, d)) for k, (d, s) in external.items()]
    (tmp_path / "m.pte").write_bytes(program)
    write_ptd(tmp_path / "m.ptd", tensors)
    loaded = Runtime.get().load_program(str(tmp_path / "m.pte"), data_path=str(tmp_path / "m.ptd"))
    got = loaded.load_method("forward").execute([x])[0]
    torch.testing.assert_close(got, net(x))


def test_loaded_weights_are_views_of_one_mapping_on_cpu(tiny_seq_artifact):
    from mg.runtime.artifact import load_artifact

    art = load_artifact(tiny_seq_artifact)
    data = art.program._data
    keys = sorted(data.entries)[:6]
    ptrs = {k: art.program._weights[k].data_ptr() for k in keys}
    for k in keys[1:]:
        assert ptrs[k] - ptrs[keys[0]] == data.entries[k].start - data.entries[keys[0]].start


def test_sharded_checkpoint_exports_the_same_weights_as_a_single_file(tmp_path, checkpoint):
    _shard(checkpoint, tmp_path / "sharded")
    for name, src in (("one", checkpoint), ("many", tmp_path / "sharded")):
        code, out = _export(["--checkpoint", str(src), "-o", str(tmp_path / name), "--max-context", "64",
                             "--max-write", "16"])
        assert code == 0, out
    one, many = (read_manifest(tmp_path / n / C.MANIFEST_FILE) for n in ("one", "many"))
    files = lambda m: {f.name: f.sha256 for f in m.files}  # noqa: E731
    assert files(one)[C.WEIGHTS_FILE] == files(many)[C.WEIGHTS_FILE]
    assert _tokens(tmp_path / "one") == _tokens(tmp_path / "many")


@pytest.mark.parametrize("damage, message", [
    ("missing_shard", "lists shard 'model-00002-of-00003.safetensors', which is missing"),
    ("misplaced", "(index and shards disagree)"),
    ("unlisted", "does not list (index and shards disagree)"),
    ("both", "holds both model.safetensors and model.safetensors.index.json"),
    ("truncated", "(truncated file?)"),
])
def test_bad_sharded_checkpoints_are_refused_in_one_line(tmp_path, checkpoint, damage, message):
    ckpt = tmp_path / "sharded"
    weight_map = _shard(checkpoint, ckpt)
    index = ckpt / "model.safetensors.index.json"
    if damage == "missing_shard":
        (ckpt / "model-00002-of-00003.safetensors").unlink()
    elif damage == "misplaced":
        name = next(n for n, f in weight_map.items() if f.startswith("model-00001"))
        weight_map[name] = "model-00002-of-00003.safetensors"
        index.write_text(json.dumps({"weight_map": weight_map}))
    elif damage == "unlisted":
        weight_map.pop(sorted(weight_map)[0])
        index.write_text(json.dumps({"weight_map": weight_map}))
    elif damage == "both":
        shutil.copyfile(checkpoint / "model.safetensors", ckpt / "model.safetensors")
    elif damage == "truncated":
        shard = ckpt / "model-00003-of-00003.safetensors"
        shard.write_bytes(shard.read_bytes()[:-100])
    code, out = _export(["--checkpoint", str(ckpt), "-o", str(tmp_path / "out")])
    errors = [line for line in out.splitlines() if line.startswith("mg-export: error:")]
    assert code == 2 and "Traceback" not in out and len(errors) == 1, out
    assert message in out and not (tmp_path / "out").exists()


def _copy(artifact, dst):
    shutil.copytree(artifact, dst)
    return dst


def test_truncated_ptd_is_refused_in_one_line(tmp_path, tiny_seq_artifact):
    art = _copy(tiny_seq_artifact, tmp_path / "a")
    ptd = art / C.WEIGHTS_FILE
    ptd.write_bytes(ptd.read_bytes()[:-4096])
    for extra in ((), ("--no-verify",)):
        code, out = _run([str(art), "--prompt", "x", *extra])
        assert code == 2 and "truncated file?" in out and "Traceback" not in out, out


def test_bit_flipped_ptd_is_refused_when_verified(tmp_path, tiny_seq_artifact):
    art = _copy(tiny_seq_artifact, tmp_path / "a")
    ptd = art / C.WEIGHTS_FILE
    data = bytearray(ptd.read_bytes())
    data[len(data) // 2] ^= 0x10
    ptd.write_bytes(bytes(data))
    code, out = _run([str(art), "--prompt", "x"])
    assert code == 2 and "model.ptd: sha256 is" in out and "Traceback" not in out, out
    code, out = _run([str(art), "--prompt", "x", "--no-verify"])  # documented: hashing skipped
    assert code == 0, out


def test_ptd_of_another_export_is_refused_naming_the_key(tmp_path, tiny_seq_artifact):
    code, out = _export(["--preset", "tiny", "--n-layers", "4", "-o", str(tmp_path / "short"), "--max-context", "96",
                         "--max-write", "24"])
    assert code == 0, out
    art = _copy(tiny_seq_artifact, tmp_path / "a")
    shutil.copyfile(tmp_path / "short" / C.WEIGHTS_FILE, art / C.WEIGHTS_FILE)
    manifest = json.loads((art / C.MANIFEST_FILE).read_text())
    foreign = {f["name"]: f for f in json.loads((tmp_path / "short" / C.MANIFEST_FILE).read_text())["files"]}
    manifest["files"] = [foreign[C.WEIGHTS_FILE] if f["name"] == C.WEIGHTS_FILE else f for f in manifest["files"]]
    (art / C.MANIFEST_FILE).write_text(json.dumps(manifest))
    code, out = _run([str(art), "--prompt", "x"])
    assert code == 2 and "Traceback" not in out, out
    assert "model.ptd: holds no tensor 'model.layers.4." in out and "a data file from another export?" in out


def test_stamp_skips_rehashing_an_unchanged_ptd_only(tmp_path, tiny_seq_artifact, monkeypatch):
    import mg.runtime.artifact as A

    monkeypatch.setenv("MG_CACHE_DIR", str(tmp_path / "cache"))
    art = _copy(tiny_seq_artifact, tmp_path / "a")  # a copy: a new inode, no stamp yet
    hashed = []
    real = A.sha256_file
    monkeypatch.setattr(A, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    A.load_artifact(art)
    A.load_artifact(art)
    assert hashed.count(C.WEIGHTS_FILE) == 1 and hashed.count(C.PROGRAM_FILE) == 2
    ptd = art / C.WEIGHTS_FILE
    ptd.write_bytes(ptd.read_bytes())  # rewritten: a new mtime, so hashed again
    A.load_artifact(art)
    assert hashed.count(C.WEIGHTS_FILE) == 2


def test_not_enough_disk_is_refused_naming_the_bytes():
    from mg.export.artifact import ExportError, check_disk

    check_disk(".", 10, free=100)
    with pytest.raises(ExportError, match=r"needs 0\.00 GB \(1000 bytes\); the disk holding it has 0\.00 GB free"):
        check_disk(".", 1000, free=10)


@pytest.mark.parametrize("args, message", [
    (["--preset", "tiny", "--n-layers", "0"], "--n-layers is 0; allowed: an integer in [1, 6]"),
    (["--preset", "tiny", "--n-layers", "7"], "--n-layers is 7; allowed: an integer in [1, 6]"),
    (["--n-layers", "2"], "--n-layers applies to --preset only"),
])
def test_bad_n_layers_is_refused_in_one_line(tmp_path, args, message):
    code, out = _export([*args, "-o", str(tmp_path / "out")])
    assert code == 2 and message in out and not (tmp_path / "out").exists(), out


def test_draft_preset_taps_are_spread_over_a_shortened_target():
    from mg.export.artifact import load_target
    from mg.export.draft_lower import load_draft

    target = load_target(None, "mg-30b", n_layers=16)
    draft = load_draft(None, "mg-30b", target.cfg)
    assert target.cfg.n_layers == 16 and target.cfg.dim == 6656
    assert draft.cfg.target_layers == (1, 4, 8, 12, 15) and draft.cfg.block_size == 16
