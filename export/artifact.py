"""Export driver: options -> program (traced on meta tensors) -> model.ptd (weights streamed from their source)
-> manifest -> artifact directory, written atomically.

The manifest is built from the same `KVSpec` that produced the constant
methods, so the two cannot drift. Host memory stays bounded whatever the model
size: no step holds more than one chunk of weights. Knows nothing about the runtime.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from mg.manifests import (
    FileEntry, KVLayer, KVSpec, Manifest, MethodSpec, ModelFacts, Provenance, TensorSpec, WeightGroup,
    constants as C, write_manifest,
)

from mg.manifests.values import file_entry, write_stamp

from .calibrate import (DEFAULT_TOKENS as DEFAULT_CALIBRATION_TOKENS, WINDOW as CALIBRATION_WINDOW, CalibrationError,
                        InputFactors, check_memory, read_calibration)
from .checkpoint import expected_shapes, load_config
from .config import PRESETS, ConfigError, MuseGlimmerConfig
from .draft_lower import DraftSource, draft_constants, draft_facts, draft_kv_spec, draft_methods, export_draft
from .draft_model import DFlashDraft
from .lower import ProgramParts, export_target, meta_parameters, target_constants, to_program
from .model import MuseGlimmer
from .ptd import PtdTensor, file_size, write_ptd
from .quantize import QuantizedWeights, QuantizeError, quantize_linears
from .tokenizer import N_IDS as BYTE_TOKENIZER_IDS, write_byte_tokenizer
from .weights import RandomWeights, SafetensorsWeights, WeightSource, WeightsError

Progress = Callable[[str], None]
PRESET_SEED = 0
DEFAULT_GROUP_SIZE = 128  # int4: input columns per scale
CHECKPOINTS_DIR = Path(__file__).resolve().parent / "checkpoints"


class ExportError(ValueError):
    """Bad export options or inputs; the message is one line naming the flag or file."""


@dataclass(frozen=True)
class ExportOptions:
    output_dir: Path
    layout: str = C.LAYOUT_SEQUENCE
    max_seqs: Optional[int] = None  # sequence layout
    max_cells: Optional[int] = None  # cell layout
    max_context: int = 2048
    max_write: int = 64
    dtype: Optional[str] = None  # None: the checkpoint's dtype
    force: bool = False
    weights: str = C.WEIGHTS_FLOAT  # linear layers: float (in `dtype`) | int8 | int4
    draft_weights: Optional[str] = None  # the drafter's linears: float | int8 | int4 [default: as `weights`]
    group_size: Optional[int] = None  # int4: input columns per scale [default: 128]
    quantize_head: bool = False  # the LM head too (it stays in `dtype` otherwise)
    calibration: Optional[Path] = None  # a UTF-8 text file: the target's quantized linears by GPTQ on it
    calibration_tokens: Optional[int] = None  # at most this many tokens of it [default: 65536]
    calibration_device: Optional[str] = None  # where the calibration pass runs: cpu | cuda [default: cpu]


@dataclass(frozen=True)
class TargetSource:
    name: str
    cfg: MuseGlimmerConfig
    weights: WeightSource  # by the target's parameter names
    tokenizer: Optional[Path]  # tokenizer.json to copy into the artifact
    byte_tokenizer: bool = False  # no tokenizer.json: write the byte-level one (presets)


def default_checkpoints() -> tuple[Path, Path]:
    """The embedded default: a small MG target trained on Python source and its DFlash drafter."""
    target, draft = CHECKPOINTS_DIR / "mg-tiny-code", CHECKPOINTS_DIR / "mg-tiny-code-draft"
    for d in (target, draft):
        if not (d / "model.safetensors").is_file():
            raise ExportError(f"the embedded default checkpoint is missing {d / 'model.safetensors'}; "
                              f"reinstall mg-toolchain or pass --checkpoint / --preset")
    return target, draft


def meta_target(cfg: MuseGlimmerConfig) -> MuseGlimmer:
    """The target with its parameters on the meta device: shapes and buffers, no weights."""
    with meta_parameters():
        return MuseGlimmer(cfg)


def load_target(checkpoint: Optional[Path], preset: Optional[str], n_layers: Optional[int] = None) -> TargetSource:
    """The target from a native checkpoint directory (weights read when the export writes them), or a
    random-weight preset; `n_layers` keeps a preset's first layers (real width, fewer layers)."""
    if checkpoint is not None:
        if n_layers is not None:
            raise ExportError("--n-layers applies to --preset only (a checkpoint's layers are what it holds)")
        cfg = load_config(checkpoint, MuseGlimmerConfig)
        weights = SafetensorsWeights(checkpoint)
        weights.check(expected_shapes(meta_target(cfg)))
        tok = Path(checkpoint) / C.TOKENIZER_FILE
        return TargetSource(Path(checkpoint).resolve().name, cfg, weights, tok if tok.is_file() else None)
    if preset not in PRESETS:
        raise ExportError(f"--preset is {preset!r}; allowed: {' | '.join(PRESETS)}")
    cfg, name = PRESETS[preset], f"preset-{preset}"
    if n_layers is not None:
        if not 1 <= n_layers <= cfg.n_layers:
            raise ExportError(f"--n-layers is {n_layers}; allowed: an integer in [1, {cfg.n_layers}] (the layers of "
                              f"--preset {preset})")
        cfg, name = dataclasses.replace(cfg, n_layers=n_layers), f"{name}-{n_layers}l"
    return TargetSource(name, cfg, RandomWeights(PRESET_SEED), None,
                        byte_tokenizer=cfg.vocab_size >= BYTE_TOKENIZER_IDS)


def _existing(path: Path) -> Path:
    """`path` or its nearest existing ancestor (the folder whose disk an output will land on)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(directory: Path, need: int, free: Optional[int] = None) -> None:
    """Refuse up front an export whose files do not fit the free space of the disk holding `directory`."""
    if free is None:
        try:
            free = shutil.disk_usage(directory).free
        except OSError:
            return
    if need > free:
        raise ExportError(f"--output-dir {directory}: the artifact needs {need / 1e9:.2f} GB ({need} bytes); the "
                          f"disk holding it has {free / 1e9:.2f} GB free")


def check_options(opts: ExportOptions) -> None:
    """Refuse bad options before any work is done."""
    if opts.layout not in C.LAYOUTS:
        raise ExportError(f"--kv-layout is {opts.layout!r}; allowed: {' | '.join(C.LAYOUTS)}")
    if opts.layout == C.LAYOUT_SEQUENCE:
        if opts.max_cells is not None:
            raise ExportError("--max-cells applies to --kv-layout cell only; use --max-kv-seqs for sequence")
        if opts.max_seqs is None or opts.max_seqs < 1:
            raise ExportError(f"--max-kv-seqs is {opts.max_seqs}; allowed: an integer >= 1")
    else:
        if opts.max_seqs is not None:
            raise ExportError("--max-kv-seqs applies to --kv-layout sequence only; use --max-cells for cell")
        if opts.max_cells is None or opts.max_cells < 1:
            raise ExportError(f"--max-cells is {opts.max_cells}; allowed: an integer >= 1")
    if opts.max_context < 2:
        raise ExportError(f"--max-context is {opts.max_context}; allowed: an integer >= 2")
    if not 2 <= opts.max_write <= opts.max_context:
        raise ExportError(f"--max-write is {opts.max_write}; allowed: an integer in [2, --max-context="
                          f"{opts.max_context}]")
    if opts.dtype not in (None, *C.DTYPES):
        raise ExportError(f"--dtype is {opts.dtype!r}; allowed: {' | '.join(C.DTYPES)}")
    if opts.weights not in C.WEIGHT_SCHEMES:
        raise ExportError(f"--weights is {opts.weights!r}; allowed: {' | '.join(C.WEIGHT_SCHEMES)}")
    if opts.draft_weights not in (None, *C.WEIGHT_SCHEMES):
        raise ExportError(f"--draft-weights is {opts.draft_weights!r}; allowed: {' | '.join(C.WEIGHT_SCHEMES)}")
    if opts.group_size is not None:
        if C.WEIGHTS_INT4 not in (opts.weights, draft_scheme(opts)):
            drafter = f", --draft-weights {opts.draft_weights}" if opts.draft_weights else ""
            raise ExportError(f"--group-size applies to int4 weights only (--weights is {opts.weights}{drafter})")
        if opts.group_size not in C.INT4_GROUP_SIZES:
            raise ExportError(f"--group-size is {opts.group_size}; allowed: "
                              f"{' | '.join(map(str, C.INT4_GROUP_SIZES))}")
    if opts.quantize_head and opts.weights == C.WEIGHTS_FLOAT:
        raise ExportError("--quantize-head needs --weights int8 or int4")
    if opts.calibration is not None and opts.weights == C.WEIGHTS_FLOAT:
        raise ExportError("--calibration needs --weights int8 or int4 (it chooses how their weights are rounded)")
    if opts.calibration_device is not None:
        if opts.calibration is None:
            raise ExportError("--calibration-device applies with --calibration only")
        if opts.calibration_device not in ("cpu", "cuda"):
            raise ExportError(f"--calibration-device is {opts.calibration_device!r}; allowed: cpu | cuda")
        if opts.calibration_device == "cuda" and not torch.cuda.is_available():
            raise ExportError("--calibration-device cuda, but torch sees no CUDA device here; allowed: cpu")
    if opts.calibration_tokens is not None:
        if opts.calibration is None:
            raise ExportError("--calibration-tokens applies with --calibration only")
        if opts.calibration_tokens < CALIBRATION_WINDOW:
            raise ExportError(f"--calibration-tokens is {opts.calibration_tokens}; allowed: an integer >= "
                              f"{CALIBRATION_WINDOW} (one window)")
    out = Path(opts.output_dir)
    here = Path.cwd().resolve()
    if out.resolve() == here or out.resolve() in here.parents:
        raise ExportError(f"--output-dir {out} is the current directory or one above it; give a new directory "
                          f"or an existing artifact directory")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--output-dir {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not opts.force:
            raise ExportError(f"--output-dir {out} exists and is not empty; pass --force to replace it")
        if not (out / C.MANIFEST_FILE).is_file():
            raise ExportError(f"--output-dir {out} is not empty and holds no {C.MANIFEST_FILE}: --force replaces "
                              f"only an artifact directory (or an empty one); choose another directory")


def draft_scheme(opts: ExportOptions) -> str:
    """How the drafter's linears are stored: --draft-weights, else as the target's (--weights)."""
    return opts.draft_weights or opts.weights


def target_kv(cfg: MuseGlimmerConfig, opts: ExportOptions, dtype: str) -> KVSpec:
    layers = tuple(
        KVLayer(layer_id=i, policy=C.POLICY_FLAT if cfg.is_global(i) else C.POLICY_RING, window=cfg.window(i),
                n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim)
        for i in range(cfg.n_layers))
    return KVSpec(layout=opts.layout, max_seqs=opts.max_seqs, max_cells=opts.max_cells, capacity=opts.max_context,
                  max_write=opts.max_write, dtype=dtype, layers=layers)


def forward_method(cfg: MuseGlimmerConfig, kv: KVSpec, taps: tuple[int, ...]) -> MethodSpec:
    outputs = [TensorSpec("logits", "logits of the selected rows", "float32", ("R", cfg.vocab_size))]
    if taps:
        outputs.append(TensorSpec("hidden", "residual entering each tapped layer", kv.dtype,
                                  ("N", len(taps) * cfg.dim)))
    return MethodSpec(
        name=C.METHOD_FORWARD,
        inputs=(TensorSpec("tokens", "token ids, sequences packed", "int64", ("N",)),
                TensorSpec("positions", "position of each token in its sequence", "int64", ("N",)),
                TensorSpec("seq_slots", "sequence slot of each token (max_seqs = scratch)", "int64", ("N",)),
                TensorSpec("logits_rows", "rows that go through the LM head (R <= N)", "int64", ("R",))),
        outputs=tuple(outputs),
        bounds={"N": (1, kv.max_write), "R": (1, kv.max_write)},
    )


def constant_method_specs(constants: dict) -> tuple[MethodSpec, ...]:
    specs = []
    for name, value in sorted(constants.items()):
        shape = (len(value),) if isinstance(value, list) else ()
        specs.append(MethodSpec(name=name, inputs=(), outputs=(TensorSpec("value", "constant", "int64", shape),)))
    return tuple(specs)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _ptd_tensors(external: dict[str, tuple], sources: dict[str, WeightSource],
                 buffers: dict[str, torch.Tensor]) -> list[PtdTensor]:
    """What model.ptd holds, in the program's first-use order: parameters stream from their source (by the
    key's prefix: `model.` the target, `draft.` the drafter), buffers (RoPE frequencies) from the meta model."""
    tensors = []
    for key, (dtype, shape) in external.items():
        prefix, name = key.split(".", 1)
        if key in buffers:
            value = buffers[key]
            chunks = (lambda v=value, d=dtype: iter([v.detach().to(d).contiguous().reshape(-1)]))
        else:
            chunks = (lambda src=sources[prefix], n=name, s=shape, d=dtype: src.chunks(n, s, d))
        tensors.append(PtdTensor(key, dtype, shape, chunks))
    return tensors


def _weight_groups(plans: dict[str, dict], opts: ExportOptions, group_size: int,
                   calibration_tokens: int = 0) -> tuple[WeightGroup, ...]:
    """The manifest's record of what was quantized: the target's layer linears and its head (--weights), the
    drafter's (--draft-weights); with `calibration_tokens`, the target's groups by GPTQ on that many tokens (the
    drafter's always rounded). `group_size`: int4's, for every int4 group."""
    counts = {C.GROUP_TARGET_LINEARS: sum(1 for n in plans.get("model", {}) if n != "output"),
              C.GROUP_TARGET_HEAD: sum(1 for n in plans.get("model", {}) if n == "output"),
              C.GROUP_DRAFT_LINEARS: len(plans.get("draft", {}))}

    def fit(group: str) -> dict:
        if calibration_tokens and group != C.GROUP_DRAFT_LINEARS:
            return {"fit": C.FIT_GPTQ, "calibration_tokens": calibration_tokens}
        return {}

    def scheme(group: str) -> str:
        return draft_scheme(opts) if group == C.GROUP_DRAFT_LINEARS else opts.weights

    return tuple(WeightGroup(group, scheme(group), _group(scheme(group), group_size), n, **fit(group))
                 for group, n in counts.items() if n)


def _calibrate(opts: ExportOptions, target: TargetSource, plans: dict[str, dict],
               progress: Progress) -> tuple[Union[InputFactors, dict], int]:
    """With --calibration: GPTQ's factor of each of the target's quantized linears from its inputs' statistics
    on the text -> (`InputFactors`, tokens used), else ({}, 0). The text is read and the memory checked now;
    the factors are made a layer at a time while model.ptd is written (the float target runs layer by layer
    over the text, one layer's weights in memory)."""
    if opts.calibration is None:
        return {}, 0
    if target.tokenizer is None and not target.byte_tokenizer:
        raise ExportError(f"--calibration needs the checkpoint's tokenizer.json to read the text; {target.name} "
                          f"has none")
    names = {n: p.shape[1] for n, p in plans["model"].items()}
    try:
        windows = read_calibration(opts.calibration, target.tokenizer, target.cfg.bos_id, target.cfg.vocab_size,
                                   opts.calibration_tokens or DEFAULT_CALIBRATION_TOKENS)
        tokens = sum(map(len, windows))
        device = opts.calibration_device or "cpu"
        check_memory(target.cfg, {n: p.shape for n, p in plans["model"].items()}, tokens, device)
        progress(f"calibration: {len(windows)} windows, {tokens} tokens of {opts.calibration}; the float target "
                 f"runs over them layer by layer on the {device.upper()} while the weights are written, "
                 f"collecting its {len(names)} quantized linears' inputs for GPTQ")
        return InputFactors(target.cfg, target.weights, names, windows, progress, device), tokens
    except CalibrationError as e:
        raise ExportError(str(e)) from None


def _quantize(opts: ExportOptions, model: MuseGlimmer, draft_model: Optional[DFlashDraft], group_size: int,
              dtype: str, progress: Progress) -> dict[str, dict]:
    """The (meta) models' linears replaced in place where --weights (target) and --draft-weights (drafter) ask
    for int8 | int4, before any lowering (a width the groups do not divide is refused at once); -> {source
    prefix: plan} of the parts quantized."""
    draft_weights = draft_scheme(opts) if draft_model is not None else C.WEIGHTS_FLOAT
    plans, said = {}, []
    try:
        if opts.weights != C.WEIGHTS_FLOAT:
            plans["model"] = quantize_linears(model, opts.weights, _group(opts.weights, group_size),
                                              frozenset() if opts.quantize_head else frozenset({"output"}))
            head = " and its head" if opts.quantize_head else ""
            said.append(f"target{head} {_scheme_words(opts.weights, group_size)}")
        if draft_weights != C.WEIGHTS_FLOAT:
            plans["draft"] = quantize_linears(draft_model, draft_weights, _group(draft_weights, group_size),
                                              where="draft.")
            said.append(f"drafter {_scheme_words(draft_weights, group_size)}")
    except QuantizeError as e:
        raise ExportError(str(e)) from None
    if plans:
        progress(f"weights: {sum(map(len, plans.values()))} linears quantized ({', '.join(said)}); "
                 f"embeddings{'' if opts.quantize_head else ' and head'} stay {dtype}")
    return plans


def _group(scheme: str, group_size: Optional[int]) -> Optional[int]:
    return group_size if scheme == C.WEIGHTS_INT4 else None


def _scheme_words(scheme: str, group_size: Optional[int]) -> str:
    return f"{scheme} in groups of {group_size}" if scheme == C.WEIGHTS_INT4 else f"{scheme} per output channel"


def export_artifact(opts: ExportOptions, target: TargetSource, progress: Progress,
                    draft: Optional[DraftSource] = None) -> Manifest:
    """Export `target` (and its DFlash `draft`) under `opts` into `opts.output_dir`; nothing is left
    behind on failure."""
    check_options(opts)
    if opts.draft_weights is not None and draft is None:
        raise ExportError("--draft-weights applies to an export with a drafter; this one has none (give "
                          "--draft-checkpoint or --draft-preset)")
    t0 = time.perf_counter()
    cfg = target.cfg
    dtype = opts.dtype or cfg.dtype
    tdtype = getattr(torch, dtype)
    model = meta_target(cfg).to(tdtype).eval()
    draft_model = None
    if draft is not None:
        with meta_parameters():
            draft_model = DFlashDraft(draft.cfg, cfg).to(tdtype).eval()
    kv = target_kv(cfg, opts, dtype)
    progress(f"model {target.name}: {cfg.n_layers} layers ({len(kv.ring_layers)} ring, "
             f"{cfg.n_layers - len(kv.ring_layers)} flat), dim {cfg.dim}, vocab {cfg.vocab_size}, "
             f"{cfg.n_params() / 1e9:.3f}B parameters, {dtype}, weights from {target.weights.description}")
    group_size = opts.group_size or DEFAULT_GROUP_SIZE  # int4's: `_group` gives it to int4 parts only
    plans = _quantize(opts, model, draft_model, group_size, dtype, progress)
    stored = sum(p.numel() * p.element_size() for m in (model, draft_model) if m is not None for p in m.parameters())
    check_disk(_existing(Path(opts.output_dir).parent), stored)  # up front, before calibration and lowering
    factors, calibration_tokens = _calibrate(opts, target, plans, progress)
    taps = tuple(draft.cfg.target_layers) if draft is not None else ()
    progress(f"torch.export forward (tokens per step 1..{opts.max_write}{', hidden taps ' + str(list(taps)) if taps else ''})")
    methods = {C.METHOD_FORWARD: export_target(model, opts.max_write, taps)}
    constants = target_constants(cfg, kv)
    specs = (forward_method(cfg, kv, taps),)
    sources: dict[str, WeightSource] = {"model": target.weights}
    buffers = {f"model.{n}": b for n, b in model.named_buffers()}
    draft_kv = None
    if draft is not None:
        draft_kv = draft_kv_spec(draft.cfg, kv)
        progress(f"torch.export drafter {draft.name}: {draft.cfg.n_layers} layers, block {draft.cfg.block_size}, "
                 f"mask token {draft.cfg.mask_token_id}, weights from {draft.weights.description}")
        methods.update(export_draft(draft_model, model, draft_kv))
        constants.update(draft_constants(draft.cfg, draft_kv))
        specs += draft_methods(draft.cfg, cfg, draft_kv)
        sources["draft"] = draft.weights
        buffers.update({f"draft.{n}": b for n, b in draft_model.named_buffers()})
    for prefix, plan in plans.items():
        sources[prefix] = QuantizedWeights(sources[prefix], plan, factors if prefix == "model" else None)
    program, external = to_program(ProgramParts(methods, constants), progress)
    tensors = _ptd_tensors(external, sources, buffers)

    out = Path(opts.output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_disk(out.parent, file_size(tensors) + len(program))
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; the artifact gets the user's usual permissions
    try:
        (tmp / C.PROGRAM_FILE).write_bytes(program)
        entries = [file_entry(tmp / C.PROGRAM_FILE)]
        total = sum(t.nbytes for t in tensors)
        progress(f"writing {C.WEIGHTS_FILE}: {len(tensors)} tensors, {total / 1e9:.2f} GB")
        t_write = time.perf_counter()
        try:
            size, sha = write_ptd(tmp / C.WEIGHTS_FILE, tensors, progress)
        except CalibrationError as e:  # a layer's statistics, made while its weights are written
            raise ExportError(str(e)) from None
        seconds = time.perf_counter() - t_write
        progress(f"wrote {C.WEIGHTS_FILE}: {size / 1e9:.2f} GB in {seconds:.1f}s "
                 f"({size / 1e9 / max(seconds, 1e-9):.2f} GB/s)")
        entries.append(FileEntry(C.WEIGHTS_FILE, size, sha))
        if target.tokenizer is not None:
            shutil.copyfile(target.tokenizer, tmp / C.TOKENIZER_FILE)
            entries.append(file_entry(tmp / C.TOKENIZER_FILE))
        elif target.byte_tokenizer:
            write_byte_tokenizer(tmp / C.TOKENIZER_FILE)
            entries.append(file_entry(tmp / C.TOKENIZER_FILE))
        manifest = Manifest(
            format=C.FORMAT, version=C.VERSION,
            model=ModelFacts(name=target.name, vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers,
                             bos_id=cfg.bos_id, eos_ids=tuple(cfg.eos_ids), dtype=dtype),
            kv=kv, draft=draft_facts(draft.cfg, draft_kv) if draft is not None else None,
            methods=specs + constant_method_specs(constants),
            files=tuple(entries),
            provenance=Provenance(tool_version=_version("mg-toolchain"), torch_version=torch.__version__,
                                  executorch_version=_version("executorch")),
            weights=_weight_groups(plans, opts, group_size, calibration_tokens),
        )
        write_manifest(manifest, tmp / C.MANIFEST_FILE)
        _replace_dir(tmp, out)
        write_stamp(out / C.WEIGHTS_FILE, sha)  # hashed while written: the first load need not hash it again
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for source in sources.values():
            getattr(source, "close", lambda: None)()
    progress(f"wrote {out} ({len(program) / 1e6:.2f} MB program, {size / 1e9:.2f} GB weights) in "
             f"{time.perf_counter() - t0:.1f}s")
    return manifest


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished `src` into place at `dst`; an old `dst` is removed only after the move."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{time.time_ns()}")
        dst.rename(old)
    src.rename(dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
