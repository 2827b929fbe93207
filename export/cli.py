"""`mg-export`: parse flags into `ExportOptions`, call `export_artifact`, turn errors into one line."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from mg.manifests import ManifestError, constants as C

from .checkpoint import CheckpointError
from .config import PRESETS, ConfigError
from .draft_model import DRAFT_PRESETS


def _progress():
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        click.echo(f"[mg-export {time.perf_counter() - t0:6.1f}s] {msg}", err=True)

    return say


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mg-toolchain", prog_name="mg-export")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="Native checkpoint directory (config.json + model.safetensors) "
                   "[default: the embedded mg-tiny-code model and its drafter].")
@click.option("--preset", type=str, default=None,
              help=f"Random-weight configuration instead of a checkpoint: {' | '.join(PRESETS)}.")
@click.option("--n-layers", type=int, default=None,
              help="Keep only the first N layers of --preset (real width, less depth) [default: all].")
@click.option("--draft-checkpoint", type=click.Path(path_type=Path), default=None,
              help="DFlash drafter checkpoint directory (config.json + model.safetensors).")
@click.option("--draft-preset", type=str, default=None,
              help=f"Random-weight drafter instead of a checkpoint: {' | '.join(DRAFT_PRESETS)}.")
@click.option("--kv-layout", "layout", type=str, default=C.LAYOUT_SEQUENCE, show_default=True, metavar="sequence|cell",
              help="KV cache layout, fixed at export: sequence (kBatchedSequence) | cell (kBatchedCell).")
@click.option("--max-kv-seqs", "max_seqs", type=int, default=None,
              help="Sequence layout: sequences served at once [default: 8].")
@click.option("--max-cells", type=int, default=None, help="Cell layout: KV cells in the pool [default: 4096].")
@click.option("--max-context", type=int, default=2048, show_default=True, help="Context length per sequence.")
@click.option("--max-write", type=int, default=64, show_default=True,
              help="Tokens written per step, all sequences together.")
@click.option("--dtype", type=str, default=None, metavar="float32|bfloat16", help="[default: the checkpoint's]")
@click.option("--weights", type=str, default=C.WEIGHTS_FLOAT, show_default=True, metavar="float|int8|int4",
              help="Linear layers (target, and drafter unless --draft-weights): float (stored in --dtype) | int8 "
                   "(per output channel) | int4 (groups of --group-size input columns, with zero points). "
                   "Embeddings stay float.")
@click.option("--draft-weights", type=str, default=None, metavar="float|int8|int4",
              help="The drafter's linear layers, apart from the target's: its drafts are only proposals the target "
                   "verifies, so this moves acceptance and speed, never the output. [default: as --weights]")
@click.option("--group-size", type=int, default=None,
              help=f"int4 (--weights or --draft-weights): input columns per scale, one of "
                   f"{' | '.join(map(str, C.INT4_GROUP_SIZES))} [default: 128].")
@click.option("--quantize-head", is_flag=True, help="Quantize the LM head too (it stays float otherwise).")
@click.option("--calibration", type=click.Path(path_type=Path), default=None, metavar="TEXT_FILE",
              help="With --weights int8|int4: round the target's quantized linears by GPTQ, so that their outputs "
                   "on text like this UTF-8 file change least (the float target runs over it layer by layer, one "
                   "layer's weights in memory; the drafter keeps round-to-nearest). [default: round-to-nearest]")
@click.option("--calibration-tokens", type=int, default=None,
              help="--calibration: at most this many tokens of the file, in windows of 256 [default: 65536].")
@click.option("--calibration-device", type=str, default=None, metavar="cpu|cuda",
              help="--calibration: where the calibration pass runs (cuda: far faster at real scale) [default: cpu].")
@click.option("-o", "--output-dir", type=click.Path(path_type=Path), required=True, help="Artifact directory.")
@click.option("--force", is_flag=True, help="Replace an existing artifact directory (one holding manifest.json).")
def main(checkpoint, preset, n_layers, draft_checkpoint, draft_preset, layout, max_seqs, max_cells, max_context, max_write,
         dtype, weights, draft_weights, group_size, quantize_head, calibration, calibration_tokens, calibration_device,
         output_dir, force):
    """Export an MG model to an ExecuTorch program (model.pte), its weights (model.ptd) and manifest.json."""
    from mg.kernels.quiet import quiet_dependencies

    quiet_dependencies()
    from .artifact import (PRESET_SEED, ExportError, ExportOptions, check_options, default_checkpoints,
                           export_artifact, load_target)
    from .draft_lower import load_draft

    if checkpoint is not None and preset is not None:
        _die("--checkpoint and --preset are exclusive; give one")
    embedded = checkpoint is None and preset is None
    if draft_checkpoint is not None and draft_preset is not None:
        _die("--draft-checkpoint and --draft-preset are exclusive; give one")
    if draft_preset is not None and draft_preset not in DRAFT_PRESETS:
        _die(f"--draft-preset is {draft_preset!r}; allowed: {' | '.join(DRAFT_PRESETS)}")
    if preset is not None and preset not in PRESETS:
        _die(f"--preset is {preset!r}; allowed: {' | '.join(PRESETS)}")
    if embedded and draft_preset is not None:
        _die(f"--draft-preset {draft_preset} without --checkpoint or --preset would pair the trained embedded "
             f"target with a random-weight drafter; give --preset NAME (random target too) or --draft-checkpoint "
             f"DIR")
    if layout == C.LAYOUT_SEQUENCE and max_seqs is None and max_cells is None:
        max_seqs = 8
    if layout == C.LAYOUT_CELL and max_cells is None and max_seqs is None:
        max_cells = 4096
    opts = ExportOptions(output_dir=output_dir, layout=layout, max_seqs=max_seqs, max_cells=max_cells,
                         max_context=max_context, max_write=max_write, dtype=dtype, force=force, weights=weights,
                         draft_weights=draft_weights, group_size=group_size, quantize_head=quantize_head,
                         calibration=calibration, calibration_tokens=calibration_tokens,
                         calibration_device=calibration_device)
    say = _progress()
    try:
        check_options(opts)
        if embedded:  # the embedded default: trained target + drafter, unless a drafter was named
            checkpoint, default_draft = default_checkpoints()
            if draft_checkpoint is None and draft_preset is None:
                draft_checkpoint = default_draft
        say(f"loading {'checkpoint ' + str(checkpoint) if checkpoint else 'preset ' + preset}")
        target = load_target(checkpoint, preset, n_layers)
        draft = None
        if draft_checkpoint is not None or draft_preset is not None:
            say(f"loading drafter {'checkpoint ' + str(draft_checkpoint) if draft_checkpoint else 'preset ' + draft_preset}")
            draft = load_draft(draft_checkpoint, draft_preset, target.cfg, PRESET_SEED)
        export_artifact(opts, target, say, draft)
    except (ExportError, CheckpointError, ConfigError, ManifestError) as e:
        _die(str(e))


def _die(msg: str) -> None:
    click.echo(f"mg-export: error: {msg}", err=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
