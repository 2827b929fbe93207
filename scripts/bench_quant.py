"""Kernel benchmark of the weight-only quantized linears on CUDA: one MG layer's projections at real width.

For each linear of one layer of `--preset` (default mg-30b: qkvg 6656 -> 8704, o 4096 -> 6656, gate/up
6656 -> 39936, down 19968 -> 6656; `--head` adds the 202048-row output head) and each row count of `--rows`
(decode batches, DFlash verify rows), times `y = x W^T` in bf16 (cuBLAS: the float artifact's path by default),
the bf16 weight through the row-invariant Triton linear (`bf16-rows`: `triton_quant.linear_float_triton`, the
float artifact's path with `--row-invariant`), against the Triton kernels of `mg.kernels.triton_quant` (int8 per
channel, int4 in groups of `--group-size`), against
torch's tensor-core int4 kernel on the runtime's layout (`int4-tc`: what the runtime serves bfloat16 int4
calls of up to `quant.TINYGEMM_MAX_ROWS` rows with) and against the torch references (dequantize, then matmul:
what CUDA ran before the kernels). Each measurement is
`--calls` back-to-back calls captured in one CUDA graph (as the runtime replays methods), replayed `--reps`
times between CUDA events; the median replay is kept. The floor of each scheme is the bytes it must read
(weights, scales, zeros) over the measured copy bandwidth. Also checks each kernel against its reference.
Prints Markdown; `--out` writes JSON.

    python3 scripts/bench_quant.py --out bench_quant.json
"""

from __future__ import annotations

import argparse
import json
import sys

from math import nan

import torch

from script_common import cuda_kernels_refusal, graph_time, int_list

SCHEMES = ("bf16", "bf16-rows", "int8", "int4", "int4-tc", "int8-ref", "int4-ref")
# Each kernel checked against its reference.
KERNELS = {"bf16-rows": "bf16", "int8": "int8-ref", "int4": "int4-ref", "int4-tc": "int4-ref"}


def _linears(preset: str, head: bool) -> list[tuple[str, int, int]]:
    """(name, out features, in features) of one layer of `preset` (and its output head)."""
    from mg.export.artifact import load_target, meta_target

    model = meta_target(load_target(None, preset, 1).cfg)
    out = [(name.split(".")[-1], m.out_features, m.in_features) for name, m in model.named_modules()
           if isinstance(m, torch.nn.Linear) and name.startswith("layers.0.")]
    if head:
        out.append(("output", model.output.out_features, model.output.in_features))
    return out


def _copy_bandwidth(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / graph_time(lambda: dst.copy_(src), 5, 5)


def bench(linears, rows: list[int], group: int, calls: int, reps: int, bw: float) -> list[dict]:
    from mg.kernels import quant, triton_quant as tq

    results = []
    for name, n, k in linears:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
        q8, s8 = quant.quantize_int8(w)
        q4, s4, z4 = quant.quantize_int4(w, group)
        s8, s4, z4 = s8.bfloat16(), s4.bfloat16(), z4.bfloat16()
        stored = {"bf16": w.numel() * 2, "int8": q8.numel() + s8.numel() * 2,
                  "int4": q4.numel() + (s4.numel() + z4.numel()) * 2}
        tc = quant._tensor_cores(torch.cuda.current_device()) and n % 8 == 0  # else int4-tc is NaN
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            fns = {"bf16": lambda: torch.nn.functional.linear(x, w),
                   "bf16-rows": lambda: tq.linear_float_triton(x, w),
                   "int8": lambda: tq.linear_int8_triton(x, q8, s8),
                   "int4": lambda: tq.linear_int4_triton(x, q4, s4, z4, group),
                   "int4-tc": lambda: quant._int4_tinygemm(x, q4, s4, z4, group),
                   "int8-ref": lambda: quant.linear_int8_ref(x, q8, s8),
                   "int4-ref": lambda: quant.linear_int4_ref(x, q4, s4, z4, group)}
            row = {"linear": name, "n": n, "k": k, "rows": m, "us": {}, "floor_us": {}, "max_err_vs_ref": {}}
            if not tc:  # the tensor-core kernel cannot run here (pre-Ampere, or N not a multiple of 8)
                del fns["int4-tc"]
                row["us"]["int4-tc"] = row["max_err_vs_ref"]["int4-tc"] = nan
            for scheme, fn in fns.items():
                row["us"][scheme] = 1e6 * graph_time(fn, calls, reps)
            for scheme, nbytes in stored.items():
                row["floor_us"][scheme] = 1e6 * nbytes / bw
            for scheme, ref in KERNELS.items():
                if scheme not in fns:
                    continue
                want = fns[ref]().float()
                err = (fns[scheme]().float() - want).abs().max().item()
                row["max_err_vs_ref"][scheme] = err / want.abs().max().item()
            results.append(row)
            print(f"  {name} {n}x{k} rows {m}: " + ", ".join(f"{s} {t:.1f} us" for s, t in row["us"].items()),
                  file=sys.stderr, flush=True)
        del w, q8, s8, q4, s4, z4
        torch.cuda.empty_cache()
    return results


def tables(results: list[dict], rows: list[int]) -> str:
    lines = ["| linear | N x K | rows | bf16 us | bf16-rows us | int8 us | int4 us | int4-tc us | int8 ref us | "
             "int4 ref us | bf16-rows / bf16 | int8 / bf16 | int4 / bf16 | int4-tc / bf16 | int8 / its floor | "
             "int4 / its floor | int4-tc / its floor | max err / max |y| (bf16-rows, int8, int4, int4-tc) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        u, f, e = r["us"], r["floor_us"], r["max_err_vs_ref"]
        lines.append(f"| {r['linear']} | {r['n']} x {r['k']} | {r['rows']} | {u['bf16']:.1f} | {u['bf16-rows']:.1f} | "
                     f"{u['int8']:.1f} | {u['int4']:.1f} | {u['int4-tc']:.1f} | {u['int8-ref']:.1f} | "
                     f"{u['int4-ref']:.1f} | {u['bf16-rows'] / u['bf16']:.2f} | "
                     f"{u['int8'] / u['bf16']:.2f} | {u['int4'] / u['bf16']:.2f} | {u['int4-tc'] / u['bf16']:.2f} | "
                     f"{u['int8'] / f['int8']:.2f} | {u['int4'] / f['int4']:.2f} | {u['int4-tc'] / f['int4']:.2f} | "
                     f"{e['bf16-rows']:.1e}, {e['int8']:.1e}, {e['int4']:.1e}, {e['int4-tc']:.1e} |")
    lines += ["", "One layer (the sum of its linears, the head excluded):", "",
              "| rows | bf16 us | bf16-rows us | int8 us | int4 us | int4-tc us | bf16-rows / bf16 | int8 / bf16 | "
              "int4 / bf16 | int4-tc / bf16 | int8 / floor | int4 / floor | int4-tc / floor |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in rows:
        layer = [r for r in results if r["rows"] == m and r["linear"] != "output"]
        t = {s: sum(r["us"][s] for r in layer) for s in SCHEMES}
        f = {s: sum(r["floor_us"][s] for r in layer) for s in ("bf16", "int8", "int4")}
        lines.append(f"| {m} | {t['bf16']:.1f} | {t['bf16-rows']:.1f} | {t['int8']:.1f} | {t['int4']:.1f} | "
                     f"{t['int4-tc']:.1f} | {t['bf16-rows'] / t['bf16']:.2f} | {t['int8'] / t['bf16']:.2f} | "
                     f"{t['int4'] / t['bf16']:.2f} | {t['int4-tc'] / t['bf16']:.2f} | "
                     f"{t['int8'] / f['int8']:.2f} | {t['int4'] / f['int4']:.2f} | {t['int4-tc'] / f['int4']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mg-30b")
    p.add_argument("--rows", default="1,8,16,32,64", help="rows per call (batch x verify rows), comma-separated")
    p.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128, 256])
    p.add_argument("--head", action="store_true", help="also the output head (202048 x 6656 at mg-30b)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = int_list(p, "--rows", args.rows)
    from mg.kernels import triton_quant
    from mg.kernels.quiet import quiet_dependencies

    refusal = cuda_kernels_refusal("bench_quant", triton_quant)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2

    quiet_dependencies()
    bw = _copy_bandwidth()
    results = bench(_linears(args.preset, args.head), rows, args.group_size, args.calls, args.reps, bw)
    print(f"{args.preset}, bf16 activations, int4 groups of {args.group_size}; {torch.cuda.get_device_name()}, "
          f"copy bandwidth {bw / 1e9:.0f} GB/s, torch {torch.__version__}\n")
    print(tables(results, rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "group_size": args.group_size, "copy_gbps": bw / 1e9,
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
