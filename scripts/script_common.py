"""What several benchmark scripts parse and prepare alike: an artifact argument (or the embedded default,
exported into a temporary folder) with its device and layout, the engines' overlap (`--overlap`) and matrix
products (`--row-invariant`, `--rows-kernel`), comma-separated integer lists, and a kernel's time in a CUDA
graph (`graph_time`). Scripts run as `python scripts/NAME.py` import it from their own folder."""

from __future__ import annotations

import argparse
import statistics
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
                   help="RunConfig.row_invariant: float matrix products by the row-invariant Triton linear on CUDA; "
                        "row-invariant attention on the CPU [default: off]")
    p.add_argument("--rows-kernel", default="off", choices=["on", "off"],
                   help="float32 products of 1-16 rows by the Triton multiply-add kernel on CUDA "
                        "(RunConfig.rows_kernel) [default: off]")


def matmul_settings(args: argparse.Namespace) -> dict:
    """The `RunConfig` fields of `add_matmul_args`' options."""
    return {"row_invariant": auto_on_off(args.row_invariant), "rows_kernel": auto_on_off(args.rows_kernel)}


def matmul_name(config) -> str:
    """What serves a `RunConfig`'s float matrix products (on the CPU: its attention), for tables."""
    if config.row_invariant_attention:
        return "row-invariant attention"
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


def graph_time(fn, calls: int, reps: int) -> float:
    """Seconds per call of `fn()`: `calls` calls captured in one CUDA graph, median of `reps` replays."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # compiles the kernels, warms the caches, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def cuda_kernels_refusal(script: str, kernels) -> str:
    """"" when this machine can run the CUDA kernels of `kernels` (an `mg.kernels` Triton module); otherwise the
    kernel benchmark `script`'s one-line refusal."""
    import torch

    if not torch.cuda.is_available():
        return f"{script}: needs a CUDA device (the kernels it times are CUDA kernels); torch sees none"
    if not kernels.available():
        return f"{script}: Triton unavailable ({kernels.reason})"
    return ""
