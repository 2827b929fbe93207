"""Weight-only quantization: quantizers, references and CPU kernels, the export, the runtime, bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from mg.export.cli import main as export_main
from mg.export.config import PRESETS
from mg.export.model import MuseGlimmer, init_random
from mg.export.quantize import QuantizedWeights, quantize_linears
from mg.export.reference import ReferenceKV
from mg.export.weights import RandomWeights, materialize
from mg.kernels import ops, quant
from mg.manifests import ManifestError, constants as C, manifest_from_dict, read_manifest
from mg.runtime.artifact import CUSTOM_OPS, load_artifact
from mg.runtime.config import RunConfig
from mg.runtime.engine import Engine
from mg.runtime.program import Program
from mg.runtime.scheduler import Request

CFG = PRESETS["tiny"]
ATTEND = "mg::update_and_attend"


def _weight(n=48, k=128, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


# ------------------------------------------------------------------ quantizers, references, kernels


def test_int8_and_int4_round_trip_within_half_a_step():
    w = _weight()
    q, scale = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    err = (quant.dequantize_int8(q, scale, torch.float32) - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()
    packed, scale4, zero = quant.quantize_int4(w, 32)
    assert packed.shape == (48, 64) and packed.dtype == torch.uint8 and scale4.shape == zero.shape == (48, 4)
    # Each group's squared error is at most plain min-max's (codes on [min, max], step = range / 15), and
    # smaller overall: the range search and the least-squares fit only ever take a better fit.
    err = (quant.dequantize_int4(packed, scale4, zero, 32, torch.float32) - w).reshape(48, 4, 32).square().sum(2)
    groups = w.reshape(48, 4, 32)
    lo, hi = groups.amin(2, keepdim=True), groups.amax(2, keepdim=True)
    step = (hi - lo) / 15
    minmax = (torch.round((groups - lo) / step).clamp(0, 15) * step + lo - groups).square().sum(2)
    assert (err <= minmax * (1 + 1e-5) + 1e-9).all() and err.sum() < 0.95 * minmax.sum()
    # A constant group is exact.
    flat = torch.full((2, 32), 0.25)
    assert torch.allclose(quant.dequantize_int4(*quant.quantize_int4(flat, 32), 32, torch.float32), flat)
    values = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(quant.unpack_int4(quant.pack_int4(values)), values)


def test_int4_in_row_blocks_gives_the_bits_of_the_whole_weight(monkeypatch):
    """On the CPU `quantize_int4` goes through a weight in blocks of rows; rows are independent, so the codes,
    scales and zeros are the very ones of the whole weight at once (here blocks of 5 rows of 23)."""
    monkeypatch.setattr(quant, "INT4_CPU_BLOCK_BYTES", 4 * 256 * 5)
    w = torch.randn(23, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got, want = quant.quantize_int4(w, 32), quant._quantize_int4_rows(w, 32)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [t.shape for t in got] == [(23, 128), (23, 8), (23, 8)]

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_match_the_references(dtype):
    tol = 2e-2  # the kernels compute in bfloat16 whatever the activations' dtype
    w = _weight(n=96, k=256)
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    kernels = quant.kernels(torch.device("cpu"))
    q, scale = quant.quantize_int8(w)
    scale = scale.to(dtype)
    want = quant.linear_int8_ref(x, q, scale).float()
    got = kernels["mg::linear_int8"](x, q, scale).float()
    assert got.shape == (2, 5, 96) and (got - want).abs().max() <= tol * want.abs().max()
    for group in (32, 128):
        packed, s4, z4 = (t.to(dtype) if t.is_floating_point() else t for t in quant.quantize_int4(w, group))
        want = quant.linear_int4_ref(x, packed, s4, z4, group).float()
        got = kernels["mg::linear_int4"](x, packed, s4, z4, group).float()
        assert got.shape == (2, 5, 96) and (got - want).abs().max() <= tol * want.abs().max()


def test_ops_run_the_reference_unless_a_served_table_names_them():
    w, x = _weight(), torch.randn(3, 128)
    q, scale = quant.quantize_int8(w)
    assert torch.equal(torch.ops.mg.linear_int8(x, q, scale), quant.linear_int8_ref(x, q, scale))
    calls = []
    with ops.serving({"mg::linear_int8": lambda *a: calls.append(a) or torch.zeros(3, 48)}):
        assert torch.equal(torch.ops.mg.linear_int8(x, q, scale), torch.zeros(3, 48))
    assert len(calls) == 1


@pytest.mark.parametrize("scheme,group", [("int4", 32), ("int8", None)])
def test_gptq_rounds_where_the_outputs_on_its_inputs_change_least(scheme, group):
    """Against round-to-nearest (the same format): a smaller output error on correlated inputs whose E[x x^T]
    it was given; rows quantized in chunks are the rows of the whole; a column no input reaches gets 0."""
    w = _weight(48, 320)  # int8 blocks of 128 columns: the update across blocks is exercised too
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4096, 320, generator=gen) @ (torch.eye(320) + torch.randn(320, 320, generator=gen) / 8)
    x[:, 7] = 0
    factor = quant.gptq_factor(x.T @ x / x.shape[0])

    def dequantized(parts):
        if scheme == "int4":
            return quant.dequantize_int4(*parts, group, torch.float32)
        return quant.dequantize_int8(*parts, torch.float32)

    def out_err(parts):
        return ((x @ (w - dequantized(parts)).T) ** 2).mean().item()

    rtn = quant.quantize_int4(w, group) if scheme == "int4" else quant.quantize_int8(w)
    got = quant.gptq(w, factor, scheme, group)
    assert [(t.dtype, t.shape) for t in got] == [(t.dtype, t.shape) for t in rtn]
    assert out_err(got) < 0.8 * out_err(rtn)
    dead = dequantized(got)[:, 7]  # weight 0, as near as the format gets (int4's zero point is not exact)
    assert torch.all(dead == 0) if scheme == "int8" else torch.all(dead.abs() <= got[1][:, 0] / 2 + 1e-6)
    top, bottom = quant.gptq(w[:20], factor, scheme, group), quant.gptq(w[20:], factor, scheme, group)
    assert torch.equal(torch.cat([top[0], bottom[0]]), got[0])  # the codes; scales to the last bits
    for a, b, c in zip(top[1:], bottom[1:], got[1:]):
        torch.testing.assert_close(torch.cat([a, b]), c, rtol=1e-5, atol=1e-7)
    # against the paper's loop, unbatched and in float64: the codes, and int4 groups' scales taken from the
    # error-updated columns when the group's turn comes
    want = _gptq_reference(w, x.T @ x / x.shape[0], scheme, group)
    assert (got[0] == want[0]).float().mean() >= 0.995
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b.float(), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("scheme,group", [("int4", 64), ("int8", None)])
def test_gptq_runs_on_the_weights_device(scheme, group):
    """Every tensor GPTQ makes is on the weight's device (checked on the meta device, where mixing devices
    fails): what lets an export calibrated on CUDA round there. Its factor on another device is refused."""
    w, x = _weight(48, 320), torch.randn(1024, 320, generator=torch.Generator().manual_seed(3))
    factor = quant.gptq_factor(x.T @ x / x.shape[0])
    want = quant.gptq(w, factor, scheme, group)
    got = quant.gptq(w.to("meta"), tuple(t.to("meta") for t in factor), scheme, group)
    assert [(t.device.type, t.dtype, t.shape) for t in got] == [("meta", t.dtype, t.shape) for t in want]
    with pytest.raises(RuntimeError):
        quant.gptq(w.to("meta"), factor, scheme, group)


def test_gptq_on_the_whole_weight_gives_the_chunks_codes(monkeypatch):
    """With the factor on a CUDA device the export rounds the whole weight at once there; the codes are those
    of the row chunks it otherwise rounds one by one (exercised here on the CPU)."""
    from mg.export import quantize, weights

    monkeypatch.setattr(weights, "CHUNK_BYTES", 64 * 4 * 40)  # 40 rows a chunk of a [.., 64] weight
    model = init_random(MuseGlimmer(CFG), 0).eval()
    plan = quantize_linears(model, "int4", 32, frozenset({"output"}), device="cpu")
    names = [n for n in plan if plan[n].shape[0] > 40][:2]
    gen = torch.Generator().manual_seed(1)
    factors = {}
    for n in names:
        x = torch.randn(512, plan[n].shape[1], generator=gen)
        factors[n] = quant.gptq_factor(x.T @ x / 512)

    def parts(whole: bool) -> dict:
        monkeypatch.setattr(quantize, "_whole_weight", lambda factor: whole)
        src = QuantizedWeights(RandomWeights(0), plan, dict(factors))
        out = {}
        for n in names:
            shape = plan[n].shape
            for part in plan[n].spec.parts:
                size = {"weight_q": (shape[0], shape[1] // 2)}.get(part, (shape[0], shape[1] // 32))
                dtype = torch.uint8 if part == "weight_q" else torch.float32
                out[n, part] = torch.cat(list(src.chunks(f"{n}.{part}", size, dtype)))
        return out

    chunked, whole = parts(False), parts(True)
    for key, value in chunked.items():
        if key[1] == "weight_q":
            assert torch.equal(whole[key], value), key
        else:
            torch.testing.assert_close(whole[key], value, rtol=1e-5, atol=1e-7)


def _gptq_reference(w, h, scheme, group):
    """GPTQ column by column (no lazy blocks), float64 throughout."""
    w, h = w.double().clone(), h.double().clone()
    n, k = w.shape
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += 0.01 * torch.diagonal(h).mean() * torch.eye(k, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    codes = torch.zeros(n, k, dtype=torch.long)
    scales, zeros = [], []
    s8 = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    for i in range(k):
        if scheme == "int4" and i % group == 0:
            _, s, z = quant.quantize_int4(w[:, i:i + group].float(), group)
            s, z = s[:, 0].double(), z[:, 0].double()
            scales.append(s)
            zeros.append(z)
        if scheme == "int8":
            q = torch.round(w[:, i] / s8).clamp(-127, 127)
            deq = q * s8
        else:
            q = torch.round((w[:, i] - z) / s).clamp(0, 15)
            deq = q * s + z
        codes[:, i] = q.long()
        e = (w[:, i] - deq) / u[i, i]
        w[:, i:] -= e[:, None] * u[i, i:][None, :]
    if scheme == "int8":
        return codes.to(torch.int8), s8
    return quant.pack_int4(codes.to(torch.uint8)), torch.stack(scales, 1), torch.stack(zeros, 1)


# ------------------------------------------------------------------ export and runtime


def _export(out, *args):
    return CliRunner().invoke(export_main, ["--preset", "tiny", "--max-kv-seqs", "3", "--max-context", "96",
                                            "--max-write", "24", "-o", str(out), *args])


def _cli_export_call(out, *args):
    """What `mg-export` with these flags hands to `export_artifact`, (options, target, drafter); nothing exported."""
    from mg.export import artifact

    calls = []

    def record(opts, target, say, draft=None):
        calls.append((opts, target, draft))

    with pytest.MonkeyPatch.context() as m:  # the CLI imports export_artifact from the module when it runs
        m.setattr(artifact, "export_artifact", record)
        res = _export(out, *args)
    assert res.exit_code == 0 and len(calls) == 1, res.output
    return calls[0]


def _export_facts(opts, target, draft):
    """Everything an export depends on but its output folder (weight sources by their description)."""
    return (dataclasses.replace(opts, output_dir=None), dataclasses.replace(target, weights=None),
            target.weights.description, dataclasses.replace(draft, weights=None), draft.weights.description)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_dflash_seq_artifact):
    """The tiny preset with its drafter: float, int8, int4 (groups of 32) with the head quantized, a float target
    with an int4 drafter, and an int8 target with a float drafter. The float one is the session's
    `tiny_dflash_seq_artifact`, only read here: the export `_export(root / "float", "--draft-preset", "tiny")`
    would make again (checked below: the same options, target and drafter, so the same files)."""
    from conftest import DFLASH_SEQ, _export_call

    root = tmp_path_factory.mktemp("quant")
    assert _export_facts(*_cli_export_call(root / "float", "--draft-preset", "tiny")) == \
        _export_facts(*_export_call(root / "float", **DFLASH_SEQ))
    out = {"float": tiny_dflash_seq_artifact}
    for name, args in (("int8", ["--weights", "int8"]),
                       ("int4", ["--weights", "int4", "--group-size", "32", "--quantize-head"]),
                       ("draft-int4", ["--draft-weights", "int4", "--group-size", "32"]),
                       ("draft-float", ["--weights", "int8", "--draft-weights", "float"])):
        res = _export(root / name, "--draft-preset", "tiny", *args)
        assert res.exit_code == 0, res.output
        out[name] = root / name
    return out


def _eager(scheme, group_size, head):
    model = init_random(MuseGlimmer(CFG), 0).eval()
    plan = quantize_linears(model, scheme, group_size, frozenset() if head else frozenset({"output"}),
                            device="cpu")
    return materialize(QuantizedWeights(RandomWeights(0), plan), model)


def _prompt():
    tokens = torch.randint(0, CFG.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(12), torch.arange(8)])
    slots = torch.cat([torch.zeros(12, dtype=torch.long), torch.ones(8, dtype=torch.long)])
    return tokens, positions, slots, torch.tensor([11, 19])


@pytest.mark.parametrize("name,scheme,group_size,head", [("int8", "int8", None, False), ("int4", "int4", 32, True)])
def test_quantized_forward_matches_the_eager_quantized_model(artifacts, name, scheme, group_size, head):
    art = artifacts[name]
    references = {"mg::linear_int8": quant.linear_int8_ref, "mg::linear_int4": quant.linear_int4_ref}
    table = {**{op: None for op in CUSTOM_OPS}, ATTEND: ReferenceKV(CFG), **references}
    prog = Program.load(art / C.PROGRAM_FILE, data_path=art / C.WEIGHTS_FILE, custom_ops=table)
    ops_used = set(prog.info("forward").operators)
    assert f"mg::linear_{scheme}" in {o.split(".")[0] for o in ops_used}
    got = prog.run("forward", list(_prompt()))[0]
    want, _ = _eager(scheme, group_size, head)(*_prompt(), ReferenceKV(CFG))
    assert (got - want).abs().max() <= 1e-5  # the lowering is exact (the kernels: tested against the references)


@pytest.mark.parametrize("scheme,agreement,max_diff", [("int8", 0.97, 0.5), ("int4", 0.85, 4.0)])
def test_quantized_embedded_default_predicts_like_the_float_model(scheme, agreement, max_diff):
    """Next-token predictions over held-out text (the trained embedded default; a random model is too
    chaotic to say anything): the quantized target's argmax agrees with the float one's, logits stay close."""
    from mg.export.artifact import default_checkpoints
    from mg.export.checkpoint import load_config
    from mg.export.config import MuseGlimmerConfig
    from mg.export.weights import SafetensorsWeights
    from mg.runtime.tokenizer import TextCodec

    ckpt, _ = default_checkpoints()
    cfg = load_config(ckpt, MuseGlimmerConfig)

    def model(quantize):
        m = MuseGlimmer(cfg).eval()
        source = SafetensorsWeights(ckpt)
        if quantize:
            source = QuantizedWeights(source, quantize_linears(m, scheme, 128 if scheme == "int4" else None,
                                                               frozenset({"output"}), device="cpu"))
        materialize(source, m)
        source.close()
        return m

    codec = TextCodec(ckpt / C.TOKENIZER_FILE, cfg.bos_id)
    rows = [json.loads(line) for line in (Path(__file__).parents[1] / "data" / "heldout_prompts.jsonl")
            .read_text().splitlines()[:4]]
    base, quantized = model(False), model(True)
    agree = total = 0
    worst = 0.0
    with torch.no_grad():
        for row in rows:
            t = torch.tensor(codec.encode(row["prompt"]))
            args = (t, torch.arange(len(t)), torch.zeros(len(t), dtype=torch.long), torch.arange(len(t)))
            a, b = base(*args, ReferenceKV(cfg))[0], quantized(*args, ReferenceKV(cfg))[0]
            agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
            total += len(t)
            worst = max(worst, (a - b).abs().max().item())
    assert agree / total >= agreement and worst <= max_diff, (agree / total, worst)


def test_manifest_records_the_quantized_groups_and_weights_shrink(artifacts):
    float_m = read_manifest(artifacts["float"] / C.MANIFEST_FILE)
    assert float_m.weights == () and float_m.weight_scheme(C.GROUP_TARGET_LINEARS) == "float"
    assert "weights" not in json.loads((artifacts["float"] / C.MANIFEST_FILE).read_text())  # older readers
    int8 = read_manifest(artifacts["int8"] / C.MANIFEST_FILE)
    assert [(w.group, w.scheme, w.group_size) for w in int8.weights] == [
        (C.GROUP_TARGET_LINEARS, "int8", None), (C.GROUP_DRAFT_LINEARS, "int8", None)]
    assert int8.weights[0].tensors == 4 * CFG.n_layers  # qkvg, o, gate_up, down per layer
    int4 = read_manifest(artifacts["int4"] / C.MANIFEST_FILE)
    assert {w.group: (w.scheme, w.group_size) for w in int4.weights} == {
        C.GROUP_TARGET_LINEARS: ("int4", 32), C.GROUP_TARGET_HEAD: ("int4", 32), C.GROUP_DRAFT_LINEARS: ("int4", 32)}
    sizes = {n: (a / C.WEIGHTS_FILE).stat().st_size for n, a in artifacts.items()}
    assert sizes["int4"] < sizes["int8"] < 0.6 * sizes["float"]
    draft_only = read_manifest(artifacts["draft-int4"] / C.MANIFEST_FILE)  # --draft-weights apart from --weights
    assert [(w.group, w.scheme, w.group_size) for w in draft_only.weights] == [(C.GROUP_DRAFT_LINEARS, "int4", 32)]
    target_only = read_manifest(artifacts["draft-float"] / C.MANIFEST_FILE)
    assert [(w.group, w.scheme, w.group_size) for w in target_only.weights] == [
        (C.GROUP_TARGET_LINEARS, "int8", None)]
    assert sizes["int8"] < sizes["draft-float"] < sizes["float"] and sizes["draft-int4"] < sizes["float"]


def _assert_dflash_equals_target_only(art) -> None:
    """Three prompts x 16 tokens in one batch: greedy DFlash, fixed blocks and adaptive, equals target-only."""
    prompts = [tuple(range(5 + i, 17 + 2 * i)) for i in range(3)]

    def tokens(config):
        reqs = [Request(f"r{i}", p, 16, ignore_eos=True) for i, p in enumerate(prompts)]
        return [r.tokens for r in Engine(art, config).run(reqs)]

    plain = tokens(RunConfig(dflash=False))
    assert all(len(t) == 16 for t in plain)
    assert tokens(RunConfig(speculation="fixed")) == plain
    assert tokens(RunConfig()) == plain


def test_a_quantized_drafter_leaves_the_output_alone(artifacts):
    """A float target with an int4 drafter, on the CPU kernels: the drafter's methods call the quantized linear,
    the target's forward none, and greedy DFlash (fixed blocks and adaptive) equals target-only exactly."""
    art = load_artifact(artifacts["draft-int4"])
    ops = {m: {o.split(".")[0] for o in art.program.info(m).operators} for m in ("forward", "draft_block")}
    assert "mg::linear_int4" in ops["draft_block"] and not any(o.startswith("mg::linear_") for o in ops["forward"])
    _assert_dflash_equals_target_only(art)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_artifacts_generate_and_dflash_stays_lossless(artifacts, name, monkeypatch):
    """Served by the float32 references: the CPU kernels round to bfloat16, which can turn a near-tie between
    the two best tokens either way depending on the batch (BENCHMARKS.md, "Quantized weights"); the kernels'
    own generation is compared with compiled code below, on identical batches."""
    references = {"mg::linear_int8": quant.linear_int8_ref, "mg::linear_int4": quant.linear_int4_ref}
    monkeypatch.setattr(quant, "kernels", lambda device, int4_tensor_cores=False: references)
    art = load_artifact(artifacts[name])
    _assert_dflash_equals_target_only(art)


def test_manifest_weight_groups_are_checked():
    base = json.loads(json.dumps({"group": "target.linears", "scheme": "int4", "group_size": 32, "tensors": 4}))
    from mg.manifests.schema import WeightGroup, _parse_dataclass

    assert _parse_dataclass(WeightGroup, base, "weights[0]").group_size == 32
    for key, value, allowed in (("scheme", "int3", "int8 | int4"), ("group_size", 48, "32 | 64 | 128 | 256"),
                                ("group", "embeddings", "target.linears")):
        with pytest.raises(ManifestError, match=allowed):
            _parse_dataclass(WeightGroup, {**base, key: value}, "weights[0]")
    with pytest.raises(ManifestError, match="null"):
        _parse_dataclass(WeightGroup, {**base, "scheme": "int8"}, "weights[0]")
    assert _parse_dataclass(WeightGroup, base, "weights[0]").fit == C.FIT_ROUND  # written before GPTQ existed
    gptq = _parse_dataclass(WeightGroup, {**base, "fit": "gptq", "calibration_tokens": 512}, "weights[0]")
    assert (gptq.fit, gptq.calibration_tokens) == (C.FIT_GPTQ, 512)
    for extra, allowed in (({"fit": "awq"}, "round | gptq"), ({"fit": "gptq"}, "an integer >= 1"),
                           ({"calibration_tokens": 512}, "0 \\(round-to-nearest")):
        with pytest.raises(ManifestError, match=allowed):
            _parse_dataclass(WeightGroup, {**base, **extra}, "weights[0]")


@pytest.mark.parametrize("args,message", [
    (["--weights", "int4"], "--group-size 128 does not divide the input width 64 of layers.0.attn.qkvg_proj"),
    (["--weights", "int3"], "--weights is 'int3'; allowed: float | int8 | int4"),
    (["--weights", "int8", "--group-size", "32"], "--group-size applies to int4 weights only (--weights is int8"),
    (["--draft-preset", "tiny", "--draft-weights", "int8", "--group-size", "32"],
     "--group-size applies to int4 weights only (--weights is float, --draft-weights int8)"),
    (["--draft-preset", "tiny", "--draft-weights", "int5"], "--draft-weights is 'int5'; allowed: float | int8 | int4"),
    (["--draft-weights", "int4"], "--draft-weights applies to an export with a drafter; this one has none"),
    (["--weights", "int4", "--group-size", "48"], "--group-size is 48; allowed: 32 | 64 | 128 | 256"),
    (["--quantize-head"], "--quantize-head needs --weights int8 or int4"),
])
def test_bad_quantization_options_are_refused_in_one_line_writing_nothing(tmp_path, args, message):
    res = _export(tmp_path / "out", *args)
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert lines[-1].startswith("mg-export: error: ") and message in lines[-1], res.output
    assert not (tmp_path / "out").exists() and not any(tmp_path.iterdir())


def test_draft_weights_without_a_drafter_are_refused_by_the_export_api(tmp_path):
    from mg.export.artifact import ExportError, ExportOptions, export_artifact, load_target

    opts = ExportOptions(output_dir=tmp_path / "out", max_seqs=2, max_context=96, max_write=24, draft_weights="int8")
    with pytest.raises(ExportError, match="--draft-weights applies to an export with a drafter"):
        export_artifact(opts, load_target(None, "tiny"), lambda msg: None, None)
    assert list(tmp_path.iterdir()) == []


def _calibration_text(path: Path) -> Path:
    path.write_text("def scale(values, factor):\n    return [v * factor for v in values]\n\n" * 60, encoding="utf-8")
    return path


def test_a_calibrated_export_records_gptq_and_runs_its_eager_model(tmp_path):
    """`--calibration`: the target's linears by GPTQ on the text (the forward equals the eager model quantized
    with the same inputs' statistics, and differs from round-to-nearest), recorded in the manifest; the
    drafter stays rounded to nearest."""
    from mg.export.calibrate import input_hessians, read_calibration

    text = _calibration_text(tmp_path / "calibration.txt")
    res = _export(tmp_path / "out", "--draft-preset", "tiny", "--weights", "int4", "--group-size", "32",
                  "--calibration", str(text), "--calibration-tokens", "512")
    assert res.exit_code == 0, res.output
    assert "calibration: 2 windows, 512 tokens" in res.output
    m = read_manifest(tmp_path / "out" / C.MANIFEST_FILE)
    assert [(w.group, w.fit, w.calibration_tokens) for w in m.weights] == [
        (C.GROUP_TARGET_LINEARS, C.FIT_GPTQ, 512), (C.GROUP_DRAFT_LINEARS, C.FIT_ROUND, 0)]
    assert m.weights_label.startswith("int4-g32-gptq linears, int4-g32 drafter")

    windows = read_calibration(text, None, CFG.bos_id, CFG.vocab_size, 512)
    assert len(windows) == 2 and all(len(w) == 256 and w[0] == CFG.bos_id for w in windows)
    model = init_random(MuseGlimmer(CFG), 0).eval()
    plan = quantize_linears(model, "int4", 32, frozenset({"output"}), device="cpu")
    stats = input_hessians(CFG, RandomWeights(0), {n: p.shape[1] for n, p in plan.items()}, windows,
                           lambda msg: None)
    factors = {n: quant.gptq_factor(h) for n, h in stats.items()}
    materialize(QuantizedWeights(RandomWeights(0), plan, factors), model)
    table = {**{op: None for op in CUSTOM_OPS}, ATTEND: ReferenceKV(CFG), "mg::linear_int4": quant.linear_int4_ref}
    prog = Program.load(tmp_path / "out" / C.PROGRAM_FILE, data_path=tmp_path / "out" / C.WEIGHTS_FILE,
                        custom_ops=table)
    got = prog.run("forward", list(_prompt()))[0]
    want, _ = model(*_prompt(), ReferenceKV(CFG))
    assert (got - want).abs().max() <= 1e-5
    rounded, _ = _eager("int4", 32, False)(*_prompt(), ReferenceKV(CFG))
    assert (got - rounded).abs().max() > 1e-3


def test_input_statistics_are_the_mean_outer_products_of_every_position(tmp_path):
    """`input_hessians`: per linear, E[x x^T] over every position of every window (the head's too)."""
    from mg.export.calibrate import input_hessians
    from mg.export.reference import dense_attend

    windows = [[1] + list(range(5, 40)), [1] + list(range(60, 95))]
    model = init_random(MuseGlimmer(CFG), 0).eval()
    names = {"layers.1.ffn.down_proj": CFG.ffn_dim, "output": CFG.dim}
    got = input_hessians(CFG, RandomWeights(0), names, windows, lambda msg: None)
    seen = {n: [] for n in names}
    modules = dict(model.named_modules())
    hooks = [modules[n].register_forward_hook(lambda m, i, o, n=n: seen[n].append(i[0].reshape(-1, i[0].shape[-1])))
             for n in names]
    with torch.no_grad():
        for ids in windows:
            n = len(ids)
            model(torch.tensor(ids), torch.arange(n), torch.zeros(n, dtype=torch.long), torch.arange(n),
                  dense_attend(CFG))
    for h in hooks:
        h.remove()
    for n in names:
        x = torch.cat(seen[n]).double()
        assert x.shape[0] == 72
        want = x.T @ x / 72
        torch.testing.assert_close(got[n], want, rtol=1e-4, atol=1e-6 * want.abs().max().item())


def test_an_export_calibrates_one_layer_at_a_time_in_order(tmp_path, monkeypatch):
    """The export asks for the factors in the program's order: each layer's pass runs once, in order, and no
    more than one layer's factors are held at a time (what lets a real-scale target calibrate in the memory of
    one layer)."""
    from mg.export import calibrate

    ran, held = [], []
    layer, getitem = calibrate.InputStatistics.layer, calibrate.InputFactors.__getitem__

    def record_layer(self, i):
        ran.append(i)
        return layer(self, i)

    def record_get(self, name):
        out = getitem(self, name)
        held.append(len(self._ready))
        return out

    monkeypatch.setattr(calibrate.InputStatistics, "layer", record_layer)
    monkeypatch.setattr(calibrate.InputFactors, "__getitem__", record_get)
    res = _export(tmp_path / "out", "--weights", "int8", "--quantize-head", "--calibration",
                  str(_calibration_text(tmp_path / "calibration.txt")), "--calibration-tokens", "512")
    assert res.exit_code == 0, res.output
    assert ran == list(range(CFG.n_layers + 1))  # every layer, then the head's inputs
    assert f"calibration: layer 1/{CFG.n_layers} over 2 windows" in res.output and "min to the last calibrated layer" \
        in res.output
    assert held and max(held) <= 4  # a layer's four linears
    assert "running the pass again" not in res.output


def test_factors_asked_out_of_order_are_the_same(tmp_path):
    """Asking for an earlier layer's factor after a later one runs the pass again and gives the same factor."""
    from mg.export.calibrate import InputFactors

    windows = [[1] + list(range(5, 40)), [1] + list(range(60, 95))]
    names = {"layers.0.attn.qkvg_proj": CFG.dim, "layers.1.ffn.down_proj": CFG.ffn_dim, "output": CFG.dim}
    said = []
    in_order = InputFactors(CFG, RandomWeights(0), names, windows, lambda msg: None)
    want = {n: in_order[n] for n in names}
    out_of_order = InputFactors(CFG, RandomWeights(0), names, windows, said.append)
    for n in ("output", "layers.1.ffn.down_proj", "layers.0.attn.qkvg_proj"):
        got = out_of_order[n]
        assert torch.equal(got[0], want[n][0]) and torch.equal(got[1], want[n][1]), n
    assert sum("running the pass again" in m for m in said) == 2


def test_the_pass_refuses_token_ids_outside_the_vocabulary():
    """An id past the vocabulary has no embedding row: refused in one line (it used to leave that token's stream
    uninitialised memory, and the statistics changed from run to run)."""
    from mg.export.calibrate import CalibrationError, InputStatistics, input_hessians

    for bad in (CFG.vocab_size, -1):
        with pytest.raises(CalibrationError, match=rf"allowed: 0\.\.{CFG.vocab_size - 1} \(the model's vocabulary\)"):
            InputStatistics(CFG, RandomWeights(0), {"output": CFG.dim}, [[1, 2, bad]], lambda msg: None)
    windows = [[1] + list(range(5, 40)), [1] + list(range(CFG.vocab_size - 35, CFG.vocab_size))]
    names = {"layers.1.ffn.down_proj": CFG.ffn_dim}
    runs = [input_hessians(CFG, RandomWeights(0), names, windows, lambda msg: None) for _ in range(2)]
    assert torch.equal(runs[0]["layers.1.ffn.down_proj"], runs[1]["layers.1.ffn.down_proj"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_calibration_on_cuda_matches_the_cpu_pass(tmp_path):
    """`--calibration-device cuda`: the same statistics as the CPU pass up to rounding (full-precision float32
    products, no TF32), GPTQ's codes on the device nearly all the CPU's, and an export (rounding the whole weights
    on the device) that records GPTQ."""
    from mg.export.calibrate import input_hessians

    windows = [[1] + list(range(5, 260)), [1] + list(range(250, 505))]  # ids inside the tiny vocabulary (512)
    names = {"layers.0.attn.qkvg_proj": CFG.dim, "layers.1.ffn.down_proj": CFG.ffn_dim, "output": CFG.dim}
    got = input_hessians(CFG, RandomWeights(0), names, windows, lambda msg: None, device="cuda")
    want = input_hessians(CFG, RandomWeights(0), names, windows, lambda msg: None)
    for n in names:  # float32 rounding differs between the devices: the whole matrix within 1e-4 of its norm
        assert got[n].device.type == "cpu" and got[n].shape == want[n].shape
        assert torch.linalg.norm(got[n] - want[n]) <= 1e-4 * torch.linalg.norm(want[n]), n
    w, h = _weight(48, CFG.ffn_dim), want["layers.1.ffn.down_proj"]  # GPTQ itself on the device, as the export
    cpu = quant.gptq(w, quant.gptq_factor(h), "int4", 32)  # rounds there
    dev = quant.gptq(w.cuda(), tuple(t.cuda() for t in quant.gptq_factor(h.cuda())), "int4", 32)
    assert (quant.unpack_int4(dev[0].cpu()) == quant.unpack_int4(cpu[0])).float().mean() >= 0.99
    res = _export(tmp_path / "out", "--weights", "int4", "--group-size", "32", "--calibration",
                  str(_calibration_text(tmp_path / "calibration.txt")), "--calibration-tokens", "512",
                  "--calibration-device", "cuda")
    assert res.exit_code == 0, res.output
    assert "layer by layer on the CUDA" in res.output
    m = read_manifest(tmp_path / "out" / C.MANIFEST_FILE)
    assert m.weights[0].fit == C.FIT_GPTQ


def test_the_calibration_pass_runs_its_products_in_full_precision(monkeypatch):
    """Inside the pass CUDA's fp32 products are full precision (no TF32) whatever the process set; after it, as
    the process had them (the flag is global, so this is checked on any machine)."""
    from mg.export import model as model_module
    from mg.export.calibrate import input_hessians

    seen = []
    forward = model_module.Block.forward

    def record(self, *args, **kwargs):
        seen.append(torch.backends.cuda.matmul.allow_tf32)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(model_module.Block, "forward", record)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        input_hessians(CFG, RandomWeights(0), {"layers.1.ffn.down_proj": CFG.ffn_dim}, [[1] + list(range(5, 40))],
                       lambda msg: None)
        assert seen and not any(seen)
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_statistics_that_are_not_finite_are_refused_in_one_line(monkeypatch, bad):
    """Non-finite statistics (activations the float model cannot carry on the text) are refused, not factored:
    CUDA's Cholesky would give NaN factors, and NaN weights, where the CPU's raises."""
    from mg.export import calibrate

    def layer(self, i):
        return {n: torch.full((k, k), bad, dtype=torch.float64) for n, k in self.names.items()}

    monkeypatch.setattr(calibrate.InputStatistics, "layer", layer)
    factors = calibrate.InputFactors(CFG, RandomWeights(0), {"layers.0.attn.o_proj": 64}, [[1] * 256],
                                     lambda msg: None)
    with pytest.raises(calibrate.CalibrationError, match="layers.0.attn.o_proj are not finite or not positive "
                                                           "definite"):
        factors["layers.0.attn.o_proj"]


def test_gptq_leaves_its_input_alone():
    """A one-row chunk's transpose is the same storage: GPTQ must still work on a copy."""
    x = torch.randn(512, 128, generator=torch.Generator().manual_seed(2))
    factor = quant.gptq_factor(x.T @ x / 512)
    for rows in (1, 5):
        w = _weight(rows, 128)
        before = w.clone()
        quant.gptq(w, factor, "int4", 32)
        quant.gptq(w, factor, "int8")
        assert torch.equal(w, before)


def test_bad_calibration_is_refused_in_one_line_writing_nothing(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n", encoding="utf-8")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café = 1\n".encode("latin-1") * 100)
    text = _calibration_text(tmp_path / "calibration.txt")
    cases = [
        (["--calibration", str(text)], "--calibration needs --weights int8 or int4"),
        (["--weights", "int8", "--calibration", str(tmp_path / "missing.txt")], "missing.txt: file not found"),
        (["--weights", "int8", "--calibration", str(tmp_path)], "is a directory"),
        (["--weights", "int8", "--calibration", str(latin)], "latin.txt: not UTF-8"),
        (["--weights", "int8", "--calibration", str(short)], "allowed: a text of at least 255 tokens"),
        (["--weights", "int8", "--calibration", str(text), "--calibration-tokens", "100"],
         "--calibration-tokens is 100; allowed: an integer >= 256"),
        (["--weights", "int8", "--calibration-tokens", "1024"], "--calibration-tokens applies with --calibration only"),
        (["--weights", "int8", "--calibration-device", "cuda"], "--calibration-device applies with --calibration only"),
        (["--weights", "int8", "--calibration", str(text), "--calibration-device", "gpu"],
         "--calibration-device is 'gpu'; allowed: cpu | cuda"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--weights", "int8", "--calibration", str(text), "--calibration-device", "cuda"],
                      "--calibration-device cuda, but torch sees no CUDA device here; allowed: cpu"))
    for args, message in cases:
        res = _export(tmp_path / "out", *args)
        assert res.exit_code == 2, (args, res.output)
        last = res.output.strip().splitlines()[-1]
        assert last.startswith("mg-export: error: ") and message in last, (args, res.output)
        assert not (tmp_path / "out").exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration.txt", "latin.txt", "short.txt"]


def test_calibration_needs_the_checkpoints_tokenizer(tmp_path, tiny_cfg, tiny_model):
    from mg.export.checkpoint import save_checkpoint

    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, tiny_cfg, tiny_model)
    assert not (ckpt / "tokenizer.json").exists()
    res = CliRunner().invoke(export_main, ["--checkpoint", str(ckpt), "--weights", "int8", "--calibration",
                                           str(_calibration_text(tmp_path / "c.txt")), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and not (tmp_path / "o").exists()
    assert res.output.strip().splitlines()[-1].startswith(
        "mg-export: error: --calibration needs the checkpoint's tokenizer.json"), res.output


def test_calibration_that_would_not_fit_in_memory_is_refused_in_one_line(tmp_path, monkeypatch):
    from mg.export import calibrate

    monkeypatch.setattr(calibrate, "_available_bytes", lambda: 1000)
    res = _export(tmp_path / "out", "--weights", "int8", "--calibration",
                  str(_calibration_text(tmp_path / "calibration.txt")))
    assert res.exit_code == 2
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("mg-export: error: --calibration needs the residual stream of its tokens, one float "
                           "layer and that layer's input statistics in host memory: ") and \
        "GB, 0.0 GB available; allowed: fewer --calibration-tokens" in last, res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.skipif(not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "clang++")),
                    reason="needs a C++ compiler (Inductor's CPU backend)")
def test_compiled_quantized_forward_matches_the_interpreter(artifacts):
    """The quantized linears stay opaque calls in compiled code, served by the same CPU kernels."""
    from mg.runtime.model_runner import ModelRunner

    compiled = ModelRunner(load_artifact(artifacts["int4"]), RunConfig(compile=True), with_draft=False)
    interpreted = ModelRunner(load_artifact(artifacts["int4"]), RunConfig(pad_steps=True), with_draft=False)
    assert compiled.compiled_methods == (C.METHOD_FORWARD,)
    for size in (1, 3):
        gen = torch.Generator().manual_seed(size)
        inputs = [torch.randint(4, CFG.vocab_size, (size,), generator=gen), torch.arange(size),
                  torch.zeros(size, dtype=torch.long), torch.arange(size)]
        got = compiled._run(C.METHOD_FORWARD, list(inputs), True)[0]
        want = interpreted._run(C.METHOD_FORWARD, list(inputs), True)[0]
        # the kernels round to bfloat16: fused float32 code upstream may round a few inputs the other way
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())


def test_a_quantized_checkpoint_is_refused_in_one_line(tmp_path, tiny_cfg, tiny_model):
    from safetensors.torch import save_file

    from mg.export.checkpoint import WEIGHTS_FILE, save_checkpoint

    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, tiny_cfg, tiny_model)
    state = {k: v.detach().contiguous() for k, v in tiny_model.named_parameters()}
    state["layers.0.attn.o_proj.weight"] = quant.quantize_int8(state["layers.0.attn.o_proj.weight"])[0]
    save_file(state, str(ckpt / WEIGHTS_FILE))
    res = CliRunner().invoke(export_main, ["--checkpoint", str(ckpt), "--weights", "int8", "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and not (tmp_path / "o").exists()
    assert "tensor 'layers.0.attn.o_proj.weight' has dtype torch.int8; expected a float dtype" in res.output
    assert res.output.strip().splitlines()[-1].startswith("mg-export: error: ")


@pytest.fixture(scope="module")
def bf16_int4_artifact(tmp_path_factory):
    """The tiny preset in bfloat16 with int4 weights (groups of 32): the activations torch's tensor-core int4
    kernel takes (`RunConfig.int4_tensor_cores`)."""
    out = tmp_path_factory.mktemp("quant-bf16") / "int4-bf16"
    res = _export(out, "--draft-preset", "tiny", "--dtype", "bfloat16", "--weights", "int4", "--group-size", "32")
    assert res.exit_code == 0, res.output
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["int8", "int4", "int4-bf16"])
def test_quantized_artifacts_on_cuda_graphs_equal_eager_and_dflash_is_lossless(request, artifacts, name,
                                                                               monkeypatch):
    path = request.getfixturevalue("bf16_int4_artifact") if name == "int4-bf16" else artifacts[name]
    art = load_artifact(path, device="cuda")
    prompts = [tuple(range(5 + i, 17 + 2 * i)) for i in range(3)]
    tensor_core_calls = []
    tinygemm = quant._int4_tinygemm
    monkeypatch.setattr(quant, "_int4_tinygemm", lambda *a: tensor_core_calls.append(1) or tinygemm(*a))

    def tokens(**kw):
        reqs = [Request(f"r{i}", p, 16, ignore_eos=True) for i, p in enumerate(prompts)]
        return [r.tokens for r in Engine(art, RunConfig(device="cuda", compile=False, **kw)).run(reqs)]

    eager = tokens(dflash=False, cuda_graphs=False)
    assert tokens(dflash=False) == eager
    assert tokens(speculation="fixed") == eager
    assert not tensor_core_calls  # only on request
    if name == "int4-bf16":  # on request: graphs == eager stays exact (the same rows per call); DFlash need not
        fast = tokens(dflash=False, cuda_graphs=False, int4_tensor_cores=True)
        assert tensor_core_calls
        tensor_core_calls.clear()
        assert tokens(dflash=False, int4_tensor_cores=True) == fast
        assert tensor_core_calls  # the graphs' warm-up and capture took the tensor-core kernel too
