"""Kernel benchmark of the few-rows float32 linear (`mg.kernels.triton_rows`, what `--rows-kernel` serves) against
`torch.mm` on cuBLAS and on cuBLASLt (the runtime's library on CUDA, `RunConfig.cublaslt`), at the weight shapes
of a target and its drafter (default: the embedded default) and float32 rows of `--rows`.

For each distinct weight shape (the first layer's linears and the head of the target; the first layer's
linears and `fc` of the drafter) and row count, times `x @ W^T` as the program computes it (`mm(x, W.T)`):
`cublas` and `cublaslt` (torch's preferred BLAS library set before the capture), `cublaslt-tf32` for the
drafter (its products run in TF32 by default, `RunConfig.draft_tf32`) and `rows` (the kernel at the launch
`plan_rows` picks). Each is `--calls` calls captured in one CUDA graph, replayed `--reps` times; the median is
kept (the same weight every call: L2-warm). Each result is checked against float64 (IEEE ones within 1e-5 of
the largest output). Then per model and row count, the sum over all its linears (each shape times its count
in the model): what one forward's or draft call's products would take. Prints Markdown; `--out` writes JSON.

    python3 scripts/bench_rows.py --out bench_rows.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from script_common import cuda_kernels_refusal, graph_time, int_list

LIBRARIES = ("cublas", "cublaslt")


def _shapes(checkpoint: Path | None, draft_checkpoint: Path | None) -> list[dict]:
    """[{model, name, n, k, count}] of every distinct linear shape of the target and its drafter."""
    from mg.export.artifact import default_checkpoints, load_target, meta_target
    from mg.export.draft_lower import load_draft
    from mg.export.draft_model import DFlashDraft
    from mg.export.lower import meta_parameters

    if checkpoint is None:
        checkpoint, draft_checkpoint = default_checkpoints()
    cfg = load_target(checkpoint, None).cfg
    with meta_parameters():
        models = {"target": meta_target(cfg),
                  "drafter": DFlashDraft(load_draft(draft_checkpoint, None, cfg).cfg, cfg)}
    out: dict[tuple, dict] = {}
    for model_name, model in models.items():
        layers = len(model.layers)
        for name, m in model.named_modules():
            if not isinstance(m, torch.nn.Linear):
                continue
            if name.startswith("layers.") and not name.startswith("layers.0."):
                continue
            count = layers if name.startswith("layers.0.") else 1
            key = (model_name, m.out_features, m.in_features)
            entry = out.setdefault(key, {"model": model_name, "names": [], "n": m.out_features, "k": m.in_features,
                                         "count": 0})
            entry["names"].append(name.split(".")[-1])
            entry["count"] += count
    return list(out.values())


def bench(shapes: list[dict], rows: list[int], calls: int, reps: int) -> list[dict]:
    from mg.kernels import triton_rows
    from mg.kernels.precision import cuda_fp32_matmuls

    library_before = torch.backends.cuda.preferred_blas_library()
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in shapes:
        n, k = shape["n"], shape["k"]
        w = torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5
        plan = triton_rows.plan_rows(n, k, torch.cuda.get_device_properties(0).multi_processor_count)
        for m in rows:
            x = torch.randn(m, k, device="cuda", generator=gen)
            ref = x.double() @ w.double().T
            top = ref.abs().max().item()
            row = {**shape, "rows": m, "plan": [plan.block_n, plan.block_k], "us": {}, "error": {}}
            runs = [(lib, lib, False) for lib in LIBRARIES] + [("rows", None, False)]
            if shape["model"] == "drafter":
                runs.insert(2, ("cublaslt-tf32", "cublaslt", True))
            for label, library, tf32 in runs:
                if library is not None:
                    torch.backends.cuda.preferred_blas_library(library)
                    fn = (lambda: torch.mm(x, w.T))
                else:
                    fn = (lambda: triton_rows.linear_rows_triton(x, w, plan))
                with cuda_fp32_matmuls(tf32):  # captured so: the graph keeps the kernels chosen now
                    row["error"][label] = (fn().double() - ref).abs().max().item() / top
                    row["us"][label] = graph_time(fn, calls, reps) * 1e6
            bad = {label: e for label, e in row["error"].items() if not label.endswith("tf32") and e > 1e-5}
            if bad:
                raise RuntimeError(f"{shape['model']} {n} x {k}, {m} rows: error over 1e-5 of the largest output: "
                                   f"{bad}")
            results.append(row)
    torch.backends.cuda.preferred_blas_library(library_before)
    return results


def sums(results: list[dict]) -> list[dict]:
    """Per model and row count: every label's time summed over the model's linears (shape time x count)."""
    out: dict[tuple, dict] = {}
    for r in results:
        entry = out.setdefault((r["model"], r["rows"]), {"model": r["model"], "rows": r["rows"], "us": {}})
        for label, us in r["us"].items():
            entry["us"][label] = entry["us"].get(label, 0.0) + us * r["count"]
    return list(out.values())


def tables(results: list[dict], totals: list[dict]) -> str:
    labels = ["cublas", "cublaslt", "cublaslt-tf32", "rows"]
    lines = ["| model | weight (N x K) | linears | rows | " + " | ".join(f"{lb} us" for lb in labels)
             + " | rows / cublaslt |", "|---|---|---|---|" + "---|" * (len(labels) + 1)]
    for r in results:
        cells = [f"{r['us'][lb]:.2f}" if lb in r["us"] else "-" for lb in labels]
        lines.append(f"| {r['model']} | {r['n']} x {r['k']} | {', '.join(r['names'])} x{r['count']} | {r['rows']} | "
                     + " | ".join(cells) + f" | {r['us']['rows'] / r['us']['cublaslt']:.2f} |")
    lines += ["", "Summed over each model's linears (shape time x count):", "",
              "| model | rows | " + " | ".join(f"{lb} us" for lb in labels) + " | rows / cublaslt |",
              "|---|---|" + "---|" * (len(labels) + 1)]
    for t in totals:
        cells = [f"{t['us'][lb]:.1f}" if lb in t["us"] else "-" for lb in labels]
        lines.append(f"| {t['model']} | {t['rows']} | " + " | ".join(cells)
                     + f" | {t['us']['rows'] / t['us']['cublaslt']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None, help="target checkpoint [default: embedded default]")
    p.add_argument("--draft-checkpoint", type=Path, default=None)
    p.add_argument("--rows", default="1,2,4,8,16", help="rows per call, comma-separated (1-16: the kernel's range)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    rows = int_list(p, "--rows", args.rows)
    if not all(1 <= m <= 16 for m in rows) or args.calls < 1 or args.reps < 1:
        p.error(f"--rows {args.rows}, --calls {args.calls}, --reps {args.reps}; allowed: rows 1-16, calls and reps "
                f">= 1")
    if (args.checkpoint is None) != (args.draft_checkpoint is None):
        p.error("--checkpoint and --draft-checkpoint go together (or neither: the embedded default)")
    from mg.kernels import triton_rows
    from mg.kernels.quiet import quiet_dependencies

    refusal = cuda_kernels_refusal("bench_rows", triton_rows)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    quiet_dependencies()
    results = bench(_shapes(args.checkpoint, args.draft_checkpoint), rows, args.calls, args.reps)
    totals = sums(results)
    print(f"float32; {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print(tables(results, totals))
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "results": results, "sums": totals}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
