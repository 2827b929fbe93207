"""Benchmark the drafter's Triton block attention (`mg::draft_attend`) against its split count.

CUDA only. A drafter block of T query rows per sequence reads its sequence's context before the anchor,
then its own T keys. For each drafter shape, batch size and context length, times the kernel with every
split count in `--splits` and with the planner's (`plan_draft_splits`, from the static span = `--capacity`),
in both KV layouts: per-call GPU time of a CUDA-graph replay (the split-K combine kernel included), L2
flushed before each repeat, median of `--repeats`. Every split count's output is checked against the
unsplit kernel's (max |difference| in the JSON).

Shapes: `default` is the embedded default's drafter (6 query heads, 2 KV heads, head_dim 64, float32, its dots
in TF32 as the engine's drafter methods run them on CUDA), `default-ieee` the same in full precision, `medium`
the bench drafter (16 / 4 / 128, bf16), `mg-30b` MG-30B's (32 / 8 / 128, bf16); T = 16.

    python scripts/bench_draft_attention.py --out bench_draft_attention.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

import torch

from bench_attention import Timer, cells_from_columns
from mg.kernels import triton_attention as ta
from mg.kernels.precision import cuda_fp32_matmuls

SHAPES = {  # name: (query heads, KV heads, head_dim, dtype, float32 dots in TF32)
    "default": (6, 2, 64, torch.float32, True),
    "default-ieee": (6, 2, 64, torch.float32, False),
    "medium": (16, 4, 128, torch.bfloat16, False),
    "mg-30b": (32, 8, 128, torch.bfloat16, False),
}


@dataclass
class Row:
    shape: str
    batch: int
    context: int
    layout: str                  # "columns" | "cells"
    planned_splits: int
    times_us: dict               # split count -> us
    planned_us: float
    unsplit_us: float
    best_splits: int
    best_us: float
    max_abs_diff: float          # over split counts, against the unsplit kernel


def bench_point(timer: Timer, shape: str, batch: int, context: int, capacity: int, t: int,
                splits: list[int]) -> list[Row]:
    hq, hkv, d, dtype, tf32 = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*size):
        return torch.randn(*size, generator=g, device="cuda", dtype=torch.float32).to(dtype)

    q = rand(batch, t, hq, d)
    k_blk, v_blk = rand(batch, t, hkv, d), rand(batch, t, hkv, d)
    k_store, v_store = rand(batch + 1, capacity, hkv, d), rand(batch + 1, capacity, hkv, d)  # last slot: scratch
    positions = context + torch.arange(t, device="cuda")[None, :].repeat(batch, 1)  # anchors at `context`
    slots = torch.arange(batch, device="cuda")
    scale = 1.0 / math.sqrt(d)
    planned = ta.plan_draft_splits(batch, hkv, capacity, ta.device_sms(q.device))
    k_pool, v_pool, table = cells_from_columns(k_store, v_store, batch)
    calls = {
        "columns": lambda n: ta.draft_attend_columns_triton(q, k_blk, v_blk, k_store, v_store, positions, slots, 0,
                                                            scale, num_splits=n),
        "cells": lambda n: ta.draft_attend_cells_triton(q, k_blk, v_blk, k_pool, v_pool, table, positions, slots, 0,
                                                        scale, num_splits=n),
    }
    rows = []
    for layout, call in calls.items():
        with cuda_fp32_matmuls(tf32):  # the graphs capture the kernels chosen under this setting
            want = call(1).float()
            times, diff = {}, 0.0
            for n in sorted(set(splits) | {1, planned}):
                times[n] = timer(lambda: call(n))
                diff = max(diff, (call(n).float() - want).abs().max().item())
        best = min(times, key=times.get)
        rows.append(Row(shape, batch, context, layout, planned, times, times[planned], times[1], best, times[best],
                        diff))
    return rows


def markdown(rows: list[Row], device: str) -> str:
    lines = [f"Device: {device}. The drafter's block attention, us per call (T = 16 rows a block):", "",
             "| shape | B | context | layout | unsplit us | planned splits | planned us | x unsplit | best splits "
             "| best us | max diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.shape} | {r.batch} | {r.context} | {r.layout} | {r.unsplit_us:.1f} | {r.planned_splits} "
                     f"| {r.planned_us:.1f} | {r.unsplit_us / r.planned_us:.2f} | {r.best_splits} | {r.best_us:.1f} "
                     f"| {r.max_abs_diff:.1e} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON results")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--contexts", default="128,512,2048")
    parser.add_argument("--capacity", type=int, default=4096, help="the columns' rows: the static span the plan sees")
    parser.add_argument("--splits", default="2,4,8,16,32", help="split counts timed besides 1 and the planned one")
    parser.add_argument("--block", type=int, default=16, help="rows of a drafter block (T)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    bad = [s for s in shapes if s not in SHAPES]
    contexts = [int(x) for x in args.contexts.split(",")]
    if bad:
        print(f"bench_draft_attention: unknown shape {bad[0]!r}; allowed: {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    if max(contexts) + args.block > args.capacity:
        print(f"bench_draft_attention: --capacity {args.capacity} cannot hold a context of {max(contexts)} plus a "
              f"block of {args.block}; allowed: contexts <= capacity - block", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_draft_attention: needs a CUDA device", file=sys.stderr)
        return 2
    if not ta.available():
        print(f"bench_draft_attention: Triton attention unavailable: {ta.reason}", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    timer = Timer(args.warmup, args.repeats)
    splits = [int(x) for x in args.splits.split(",") if x]
    rows: list[Row] = []
    for shape in shapes:
        for batch in (int(x) for x in args.batches.split(",")):
            for context in contexts:
                rows += bench_point(timer, shape, batch, context, args.capacity, args.block, splits)
                torch.cuda.empty_cache()
                print(f"{shape} B={batch} L={context}: unsplit {rows[-2].unsplit_us:.1f} us, planned "
                      f"({rows[-2].planned_splits}) {rows[-2].planned_us:.1f} us", file=sys.stderr)
    print(markdown(rows, device))
    with open(args.out, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "config": vars(args),
                   "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
