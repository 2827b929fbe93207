"""What several benchmark scripts parse and prepare alike: an artifact argument (or the embedded default,
exported into a temporary folder) with its device and layout, the engines' overlap
(`--overlap`) and matrix products (`--row-invariant`, `--rows-kernel`), and comma-separated integer lists. Scripts
run as `python scripts/NAME.py` import it from their own folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_artifact_args(p: argparse.ArgumentParser) -> None:
    """`artifact` (optional: the embedded default), `--device` and `--layout` (the default's export)."""
    p.add_argument("artifact", nargs="?", type=Path, default=None, help="[default: export the embedded default]")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--layout", default="sequence", choices=["sequence", "cell"],
                   help="KV layout of the embedded default's export (ignored with an artifact)")


def add_overlap_arg(p: argparse.ArgumentParser) -> None:
    """`--overlap auto|on|off`: `RunConfig.overlap` of the script's engines (`auto_on_off`)."""
    p.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                   help="launch greedy plain steps before the step before is read back (RunConfig.overlap): "
                        "auto = with CUDA graphs [default: auto]")


def auto_on_off(choice: str) -> bool | None:
    """An auto | on | off choice (`--overlap`, or on | off of `--row-invariant` and `--rows-kernel`) as its
    `RunConfig` value: None | True | False."""
    return {"auto": None, "on": True, "off": False}[choice]


def add_matmul_args(p: argparse.ArgumentParser) -> None:
    """`--row-invariant on|off` and `--rows-kernel on|off`: what serves the float matrix products of the script's
    engines (`matmul_settings`)."""
    p.add_argument("--row-invariant", default="off", choices=["on", "off"],
                   help="float matrix products by the row-invariant Triton linear on CUDA (RunConfig.row_invariant) "
                        "[default: off]")
    p.add_argument("--rows-kernel", default="off", choices=["on", "off"],
                   help="float32 products of 1-16 rows by the Triton multiply-add kernel on CUDA "
                        "(RunConfig.rows_kernel) [default: off]")


def matmul_settings(args: argparse.Namespace) -> dict:
    """The `RunConfig` fields of `add_matmul_args`' options."""
    return {"row_invariant": auto_on_off(args.row_invariant), "rows_kernel": auto_on_off(args.rows_kernel)}


def matmul_name(config) -> str:
    """What serves a `RunConfig`'s float matrix products, for tables."""
    return "row-invariant" if config.row_invariant_mm else "rows kernel" if config.rows_mm else "torch"


def artifact_dir(artifact: Path | None, layout: str, tmp: Path) -> Path:
    """`artifact`, or the embedded default exported in `layout` under `tmp` (context 1024)."""
    if artifact is not None:
        return artifact
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import eval_dflash
    from mg.export.artifact import default_checkpoints

    target, draft = default_checkpoints()
    return eval_dflash._export(target, draft, layout, Path(tmp) / "default", 1024)


def int_list(p: argparse.ArgumentParser, option: str, text: str, empty: bool = False) -> list[int]:
    """`text` as comma-separated integers >= 1, or the parser's error (one line, exit 2) naming `option`.
    `empty`: '' is allowed too (none)."""
    if empty and text == "":
        return []
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        p.error(f"{option} is {text!r}; allowed: comma-separated integers >= 1" + (" or ''" if empty else ""))
    return values
