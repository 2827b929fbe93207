"""Kernel benchmark of greedy tokens on CUDA: `torch.argmax(x, dim=-1)` against the Triton kernel the runtime takes
for it (`mg.kernels.triton_argmax`), over logits rows of a vocabulary (default: the embedded default's 4096, and
MG-30B's 202048, which stays on torch) at the row counts of decode steps and DFlash rounds.

Each is `--calls` calls captured in one CUDA graph, replayed `--reps` times; the median is kept. Every kernel
result is checked against torch's. Prints Markdown; `--out` writes JSON.

    python3 scripts/bench_argmax.py --out bench_argmax.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from script_common import cuda_kernels_refusal, graph_time, int_list


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", default="4096,202048", help="comma-separated vocabulary sizes (columns)")
    p.add_argument("--rows", default="1,8,16,64", help="comma-separated row counts")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16, float16")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    vocabs, rows_list = int_list(p, "--vocab", args.vocab), int_list(p, "--rows", args.rows)
    names = args.dtypes.split(",")
    if any(n not in ("float32", "bfloat16", "float16") for n in names):
        p.error(f"--dtypes is {args.dtypes!r}; allowed: comma-separated float32, bfloat16, float16")
    if args.calls < 1 or args.reps < 1:
        p.error(f"--calls is {args.calls} and --reps {args.reps}; allowed: integers >= 1")
    from mg.kernels import triton_argmax as ta

    refusal = cuda_kernels_refusal("bench_argmax", ta)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    results = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in names:
        dtype = getattr(torch, name)
        for n in vocabs:
            for rows in rows_list:
                x = (torch.randn(rows, n, device="cuda", generator=g) * 4).to(dtype)
                kernel = n <= ta.MAX_COLS
                if kernel and not torch.equal(ta.argmax_rows_triton(x), x.argmax(dim=-1)):
                    print(f"bench_argmax: the kernel disagrees with torch at [{rows}, {n}] {name}", file=sys.stderr)
                    return 1
                torch_s = graph_time(lambda: x.argmax(dim=-1), args.calls, args.reps)
                kernel_s = graph_time(lambda: ta.argmax_rows_triton(x), args.calls, args.reps) if kernel else None
                results.append({"dtype": name, "vocab": n, "rows": rows, "torch_us": 1e6 * torch_s,
                                "kernel_us": None if kernel_s is None else 1e6 * kernel_s})
    lines = [f"argmax over logits rows, {torch.cuda.get_device_name()}, us per call ({args.calls} calls per CUDA "
             f"graph, median of {args.reps} replays)", "",
             "| dtype | vocabulary | rows | torch.argmax | Triton kernel | torch / kernel |", "|---|---|---|---|---|---|"]
    for r in results:
        k = r["kernel_us"]
        lines.append(f"| {r['dtype']} | {r['vocab']} | {r['rows']} | {r['torch_us']:.2f} | "
                     + (f"{k:.2f} | {r['torch_us'] / k:.2f}x |" if k is not None else "- (torch: wider than MAX_COLS) | - |"))
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "calls": args.calls, "reps": args.reps,
                                        "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
