"""What several benchmark scripts parse and prepare alike: an artifact argument (or the embedded default,
exported into a temporary folder) with its device and layout, the engines' overlap
(`--overlap`), and comma-separated integer lists. Scripts
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
    """`--overlap auto|on|off`: `RunConfig.overlap` of the script's engines (`overlap_value`)."""
    p.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                   help="launch greedy plain steps before the step before is read back (RunConfig.overlap): "
                        "auto = with CUDA graphs [default: auto]")


def overlap_value(choice: str) -> bool | None:
    """`--overlap`'s choice as `RunConfig.overlap`."""
    return {"auto": None, "on": True, "off": False}[choice]


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
