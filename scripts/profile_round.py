"""Where a DFlash round's time goes: each method call and each fused round, timed and profiled kernel by kernel.

On the device the engine runs on (CUDA: compiled methods replayed from CUDA graphs, as `mg-run` does), for one
sequence: the target `forward` of 1 row (a plain decode step) and of `block` rows (a round's verify),
`draft_block`, `draft_append` of `block` rows, and each fused round (`fused_round.py`) of one member, on blank
inputs (scratch slot, position 0). Per call: wall time (calls back to back between two synchronisations) and,
on CUDA, the summed kernel time from the torch profiler with the kernels that take most of it. Every round is
priced against the 1-row forward: the tokens a round must commit to pay for itself.

`--draft-attention reference` binds the drafter's attention (`mg::draft_attend`) to the torch reference
instead of the Triton kernel, to compare the two in one process (run it twice). Prints Markdown; `--out` writes
JSON.

    python3 scripts/profile_round.py --device cuda --out round_cuda.json
    python3 scripts/profile_round.py --device cuda --draft-attention reference --out round_cuda_ref.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from script_common import add_artifact_args, add_matmul_args, artifact_dir, matmul_name, matmul_settings


def _kernel_time(prof, calls: int, top: int) -> tuple[float, list]:
    """Summed device time of the profiled kernels per call (us), and the `top` kernels by time."""
    from torch.autograd import DeviceType

    rows, total = [], 0.0
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0.0)
        if getattr(e, "device_type", None) == DeviceType.CUDA and t > 0:
            total += t
            rows.append({"kernel": e.key[:100], "us_per_call": t / calls, "launches_per_call": e.count / calls})
    rows.sort(key=lambda r: -r["us_per_call"])
    return total / calls, rows[:top]


def profile(name: str, fn, device, calls: int, top: int) -> dict:
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up: lazy inits and graph captures stay out of the timing
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    row = {"call": name, "wall_us": (time.perf_counter() - t0) / calls * 1e6, "kernel_us": None, "top": []}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            sync()
        row["kernel_us"], row["top"] = _kernel_time(prof, calls, top)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_artifact_args(p)
    p.add_argument("--draft-attention", default="kernel", choices=["kernel", "reference"],
                   help="the drafter's attention: the cache's Triton kernel (where it has one) or the torch reference")
    add_matmul_args(p)
    p.add_argument("--calls", type=int, default=20, help="calls per measurement")
    p.add_argument("--top", type=int, default=8, help="kernels listed per call (CUDA)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.calls < 1 or args.top < 0:
        p.error(f"--calls is {args.calls} and --top {args.top}; allowed: --calls >= 1, --top >= 0")

    import torch

    from mg.kernels.quiet import quiet_dependencies
    from mg.manifests import constants as C
    from mg.runtime.artifact import load_artifact
    from mg.runtime.config import RunConfig
    from mg.runtime.draft_ops import DraftOps
    from mg.runtime.engine import Engine

    quiet_dependencies()
    DraftOps.kernel = args.draft_attention == "kernel"
    with tempfile.TemporaryDirectory() as tmp:
        art = load_artifact(artifact_dir(args.artifact, args.layout, Path(tmp)), device=args.device)
        if art.manifest.draft is None:
            sys.exit(f"profile_round: {args.artifact} has no drafter; allowed: an artifact exported with one")
        t0 = time.perf_counter()
        engine = Engine(art, RunConfig(device=args.device, dflash=True, fused_rounds=True, **matmul_settings(args)))
        engine.warm_up()
        start_s = time.perf_counter() - t0
        r = engine.runner
        block = engine.spec.block
        print(f"engine start (compiling or loading compiled code, cost tables, graph captures): {start_s:.1f} s",
              file=sys.stderr)

        def method(name: str, size: int):
            inputs = r._blank(r.plans[name], size)
            return lambda: r.call(name, inputs, [size, size])

        calls = [(f"forward, 1 row", method(C.METHOD_FORWARD, 1)),
                 (f"forward, {block} rows", method(C.METHOD_FORWARD, block)),
                 ("draft_block, 1 sequence", method(C.METHOD_DRAFT_BLOCK, 1)),
                 (f"draft_append, {block} rows", method(C.METHOD_DRAFT_APPEND, block))]
        calls += [(f"fused round, block {fr.block}, 1 member", lambda fr=fr: fr._run_blank(1))
                  for fr in engine.spec.rounds]
        rows = [profile(name, fn, r.device, args.calls, args.top) for name, fn in calls]
    key = "kernel_us" if r.device.type == "cuda" else "wall_us"
    step = rows[0][key]
    for row in rows:
        row["plain_steps"] = row[key] / step
    print(f"Per call, {args.device}, drafter attention: {args.draft_attention}, matrix products: "
          f"{matmul_name(r.config)}; one plain step = forward, 1 row\n")
    print("| call | wall us | kernel us | plain steps |")
    print("|---|---|---|---|")
    for row in rows:
        kernel = f"{row['kernel_us']:.1f}" if row["kernel_us"] is not None else "n/a"
        print(f"| {row['call']} | {row['wall_us']:.1f} | {kernel} | {row['plain_steps']:.2f} |")
    for row in rows:
        if row["top"]:
            print(f"\n{row['call']}: " + "; ".join(f"{k['kernel'][:60]} {k['us_per_call']:.1f} us "
                                                   f"({k['launches_per_call']:.0f}x)" for k in row["top"]))
    if args.out is not None:
        args.out.write_text(json.dumps({"device": args.device, "draft_attention": args.draft_attention,
                                        "row_invariant": r.config.row_invariant_mm, "rows_kernel": r.config.rows_mm,
                                        "torch": torch.__version__, "engine_start_s": start_s, "rows": rows},
                                       indent=1))


if __name__ == "__main__":
    main()
