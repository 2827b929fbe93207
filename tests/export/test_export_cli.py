"""`mg-export`: both layouts succeed and publish what the manifest says; bad input is one line, nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from mg.export.checkpoint import save_checkpoint
from mg.export.cli import main
from mg.manifests import constants as C, read_manifest


def _constant_methods(artifact) -> dict:
    """Constant methods as ExecuTorch's own runtime returns them."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(str(artifact / C.PROGRAM_FILE))
    out = {}
    for name in sorted(program.method_names):
        if name.startswith("get_"):
            value = program.load_method(name).execute([])
            out[name] = value[0] if len(value) == 1 and name not in (C.GET_KV_HEADS, C.GET_HEAD_DIMS,
                                                                      C.GET_WINDOWS, C.GET_EOS_IDS) else list(value)
    return out


def test_sequence_layout_publishes_max_seqs_and_not_max_cells(tiny_seq_artifact):
    m = read_manifest(tiny_seq_artifact / C.MANIFEST_FILE)
    consts = _constant_methods(tiny_seq_artifact)
    assert m.kv.layout == "sequence" and m.kv.max_seqs == 3
    assert consts[C.GET_OFFGRAPH_KV_MAX_SEQS] == 3 and C.GET_OFFGRAPH_KV_MAX_CELLS not in consts


def test_cell_layout_publishes_max_cells_and_not_max_seqs(tiny_cell_artifact):
    m = read_manifest(tiny_cell_artifact / C.MANIFEST_FILE)
    consts = _constant_methods(tiny_cell_artifact)
    assert m.kv.layout == "cell" and m.kv.max_cells == 256
    assert consts[C.GET_OFFGRAPH_KV_MAX_CELLS] == 256 and C.GET_OFFGRAPH_KV_MAX_SEQS not in consts


@pytest.mark.parametrize("which", ["tiny_seq_artifact", "tiny_cell_artifact"])
def test_manifest_and_constant_methods_agree(which, request):
    artifact = request.getfixturevalue(which)
    m = read_manifest(artifact / C.MANIFEST_FILE)
    consts = _constant_methods(artifact)
    assert consts[C.GET_MAX_CONTEXT_LEN] == m.kv.capacity == 96
    assert consts[C.GET_MAX_WRITE] == m.kv.max_write == 24
    assert consts[C.GET_VOCAB_SIZE] == m.model.vocab_size
    assert consts[C.GET_MAX_SEQ_LEN] == m.kv.capacity
    assert consts[C.GET_BOS_ID] == m.model.bos_id and consts[C.GET_EOS_IDS] == list(m.model.eos_ids)
    assert consts[C.GET_N_LAYERS] == m.model.n_layers == len(m.kv.layers)
    assert consts[C.GET_WINDOWS] == [layer.window for layer in m.kv.layers]
    assert consts[C.GET_KV_HEADS] == [layer.n_kv_heads for layer in m.kv.layers]
    assert consts[C.GET_HEAD_DIMS] == [layer.head_dim for layer in m.kv.layers]
    declared = {spec.name for spec in m.methods}
    assert declared == set(consts) | {C.METHOD_FORWARD}
    sizes = {f.name: f.size for f in m.files}
    assert sizes[C.PROGRAM_FILE] == (artifact / C.PROGRAM_FILE).stat().st_size


def _plans(artifact):
    from executorch.exir._serialize._program import deserialize_pte_binary

    pte = deserialize_pte_binary((artifact / C.PROGRAM_FILE).read_bytes())
    program = getattr(pte, "program", pte)
    return {plan.name: plan for plan in program.execution_plan}


def test_programs_differ_only_where_the_layout_requires(tiny_seq_artifact, tiny_cell_artifact):
    seq, cell = _plans(tiny_seq_artifact), _plans(tiny_cell_artifact)
    assert set(seq) ^ set(cell) == {C.GET_OFFGRAPH_KV_MAX_SEQS, C.GET_OFFGRAPH_KV_MAX_CELLS}
    for name in set(seq) & set(cell):
        assert seq[name] == cell[name], f"method {name} differs between layouts"


def test_forward_has_dynamic_token_count_and_no_kv_tensors(tiny_seq_artifact):
    plan = _plans(tiny_seq_artifact)[C.METHOD_FORWARD]
    ops = {f"{op.name}.{op.overload}" for op in plan.operators}
    assert "mg::update_and_attend.out" in ops
    assert not any("delegate" in type(ins.instr_args).__name__.lower() for ch in plan.chains for ins in ch.instructions)
    # No mutable buffers (a KV cache inside the graph would be one).
    m = read_manifest(tiny_seq_artifact / C.MANIFEST_FILE)
    assert m.method(C.METHOD_FORWARD).bounds == {"N": (1, 24), "R": (1, 24)}
    assert len(plan.inputs) == 4


def _run(args):
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


def _assert_refused(args, out_dir, needle):
    code, output = _run(args + ["-o", str(out_dir)])
    # Progress lines ("[mg-export  0.0s] ...") may precede the error; the error itself is one line.
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("[mg-export")]
    assert code != 0
    assert len(lines) == 1 and lines[0].startswith("mg-export: error:"), output
    assert needle in lines[0], lines[0]
    assert not out_dir.exists()
    assert not any(p.name.startswith(f".{out_dir.name}.") for p in out_dir.parent.iterdir())


@pytest.mark.parametrize("args,needle", [
    (["--kv-layout", "paged"], "--kv-layout is 'paged'; allowed: sequence | cell"),
    (["--max-kv-seqs", "0"], "--max-kv-seqs is 0"),
    (["--max-write", "512", "--max-context", "256"], "--max-write is 512; allowed: an integer in [2, --max-context=256]"),
    (["--kv-layout", "cell", "--max-cells", "0"], "--max-cells is 0"),
    (["--kv-layout", "cell", "--max-kv-seqs", "4"], "--max-kv-seqs applies to --kv-layout sequence only"),
    (["--dtype", "float16"], "--dtype is 'float16'"),
    (["--preset", "huge"], "--preset is 'huge'"),
])
def test_bad_flags_are_refused_in_one_line_and_write_nothing(tmp_path, args, needle):
    _assert_refused(args, tmp_path / "out", needle)


@pytest.fixture()
def tiny_checkpoint(tmp_path, tiny_cfg, tiny_model):
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, tiny_cfg, tiny_model)
    return ckpt


def test_checkpoint_with_missing_tensor_is_refused(tmp_path, tiny_checkpoint):
    from safetensors.torch import load_file, save_file

    path = tiny_checkpoint / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["layers.2.ffn.down_proj.weight"]
    save_file(tensors, str(path))
    _assert_refused(["--checkpoint", str(tiny_checkpoint)], tmp_path / "out",
                    "missing tensor 'layers.2.ffn.down_proj.weight'")


def test_checkpoint_with_misshapen_tensor_is_refused(tmp_path, tiny_checkpoint):
    from safetensors.torch import load_file, save_file

    path = tiny_checkpoint / "model.safetensors"
    tensors = load_file(str(path))
    tensors["layers.0.attn.qkvg_proj.weight"] = torch.zeros(10, 64)
    save_file(tensors, str(path))
    _assert_refused(["--checkpoint", str(tiny_checkpoint)], tmp_path / "out",
                    "tensor 'layers.0.attn.qkvg_proj.weight' has shape [10, 64]; expected [192, 64]")


def test_config_with_unknown_field_is_refused(tmp_path, tiny_checkpoint):
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    cfg["rope_scaling"] = 2.0
    (tiny_checkpoint / "config.json").write_text(json.dumps(cfg))
    _assert_refused(["--checkpoint", str(tiny_checkpoint)], tmp_path / "out", "unknown field 'rope_scaling'")


def test_non_empty_output_dir_is_refused_without_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code, output = _run(["-o", str(out)])
    assert code != 0 and "pass --force" in output
    assert (out / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("target", ["other", ".", ".."])
def test_force_replaces_only_artifact_directories(tmp_path, monkeypatch, target):
    """--force on a folder that is not an artifact (or on the working directory or a parent) is refused
    before any work, and nothing in it is touched."""
    work = tmp_path / "work"
    (work / "other").mkdir(parents=True)
    (work / "other" / "keep.txt").write_text("precious")
    monkeypatch.chdir(work)
    code, output = _run(["-o", target, "--force", "--max-context", "64", "--max-write", "8"])
    assert code == 2 and "Traceback" not in output
    assert ("holds no manifest.json" if target == "other" else "current directory or one above") in output
    assert (work / "other" / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in work.iterdir()) == ["other"]


def test_artifact_directory_follows_the_umask(tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        code, output = _run(["--preset", "tiny", "-o", str(tmp_path / "art"), "--max-context", "64", "--max-write", "8"])
    finally:
        os.umask(old)
    assert code == 0, output
    assert stat.S_IMODE((tmp_path / "art").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "art" / C.MANIFEST_FILE).stat().st_mode) == 0o644


def test_failed_export_leaves_no_partial_artifact(tmp_path, monkeypatch):
    import mg.export.artifact as artifact

    def boom(*a, **k):
        raise RuntimeError("lowering failed")

    monkeypatch.setattr(artifact, "to_program", boom)
    out = tmp_path / "out"
    code, _ = _run(["-o", str(out), "--max-context", "64", "--max-write", "8"])
    assert code != 0
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_export_copies_tokenizer_and_keeps_weights(tmp_path, tiny_checkpoint, tiny_model):
    (tiny_checkpoint / "tokenizer.json").write_text('{"version": "1.0"}')
    out = tmp_path / "art"
    code, output = _run(["--checkpoint", str(tiny_checkpoint), "--max-kv-seqs", "2", "--max-context", "64",
                         "--max-write", "8", "-o", str(out)])
    assert code == 0, output
    m = read_manifest(out / C.MANIFEST_FILE)
    assert {f.name for f in m.files} == {C.PROGRAM_FILE, C.WEIGHTS_FILE, C.TOKENIZER_FILE}
    assert (out / C.TOKENIZER_FILE).read_text() == '{"version": "1.0"}'
    assert m.model.name == "ckpt" and m.kv.max_seqs == 2
    from mg.runtime.data_file import DataFile

    data = DataFile(out / C.WEIGHTS_FILE)
    for name, p in tiny_model.named_parameters():
        assert torch.equal(data.tensor(f"model.{name}", torch.device("cpu")), p.detach()), name


def test_random_drafter_with_the_trained_default_target_is_refused(tmp_path):
    code, output = _run(["--draft-preset", "tiny", "-o", str(tmp_path / "out")])
    assert code == 2 and "would pair the trained embedded target with a random-weight drafter" in output
    assert not (tmp_path / "out").exists()


def test_a_model_too_large_for_the_disk_is_refused_before_any_lowering(tmp_path, monkeypatch):
    from collections import namedtuple

    import mg.export.artifact as A

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(A.shutil, "disk_usage", lambda path: usage(1 << 40, 0, 10 << 30))
    code, output = _run(["--preset", "mg-30b", "-o", str(tmp_path / "out")])
    assert code == 2 and "Traceback" not in output, output
    assert "the artifact needs 55." in output and "the disk holding it has 10.74 GB free" in output
    assert "torch.export" not in output and not (tmp_path / "out").exists()
