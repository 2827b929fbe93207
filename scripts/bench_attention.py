"""Benchmark the Triton decode attention (both KV layouts) against the copy roofline and SDPA.

CUDA only. For each batch size and context: one query per sequence, bf16, 16 query heads,
2 KV heads, head_dim 128 by default. Reports per-call GPU time (CUDA events around a
CUDA-graph replay of the call, L2 flushed before each repeat, median), the achieved KV
bandwidth (KV bytes the call must read / time), the device copy bandwidth measured in the
same run (bytes read + written / time of a large copy), and
`torch.nn.functional.scaled_dot_product_attention` over the padded dense batch
[B, H, L, D] (GQA via `enable_gqa`, else `repeat_interleave` done before timing).

Batches are "uniform" (every sequence holds L tokens) or "ragged" (lengths spread evenly
over 1..L; SDPA still reads the padded L per sequence, the only way a dense batch can
hold them; a padding mask would only add work). Cells are placed the way lowest-free
placement places sequences that grow in lockstep: position p of sequence s in cell p*B + s.

    python scripts/bench_attention.py --out bench_attention.json [--sweep]

With `--sweep`, each point also times a few tilings around the default plan (tile length,
pipeline depth, warps, split count) and reports the fastest, with every variant's time in
the JSON, to tune `plan_attention`'s defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from mg.kernels import triton_attention as ta

DEVICE = "cuda"


@dataclass
class Row:
    batch: int
    context: int
    lengths: str              # "uniform" | "ragged"
    layout: str               # "columns" | "cells"
    kv_bytes: int             # bytes of K and V the kernel must read
    time_us: float
    kv_gbps: float
    copy_fraction: float      # kv_gbps / measured copy bandwidth
    sdpa_time_us: float
    sdpa_gbps: float          # padded dense K/V bytes / SDPA time
    speedup_vs_sdpa: float
    max_abs_diff_vs_sdpa: float | None   # uniform batches only (same keys, no mask needed)
    plan: dict                # the LaunchPlan timed (the default one, or the sweep's best)
    sweep: list | None = None # with --sweep: [(plan overrides, us), ...]


class Timer:
    """Median GPU time of a CUDA-graph replay, L2 flushed before every repeat."""

    def __init__(self, warmup: int, repeats: int, flush_bytes: int = 512 << 20):
        self.warmup, self.repeats = warmup, repeats
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda")

    def __call__(self, fn) -> float:
        fn()  # compile / autotune outside the capture
        torch.cuda.synchronize()
        run = fn
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
        except RuntimeError as exc:  # time eagerly, say why once
            print(f"note: CUDA graph capture failed ({exc}); timing eager launches", file=sys.stderr)
        for _ in range(self.warmup):
            run()
        times = []
        for _ in range(self.repeats):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)


def copy_bandwidth_gbps(timer: Timer, n_bytes: int = 4 << 30) -> float:
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src))
    del src, dst
    return 2 * n_bytes / (us * 1e-6) / 1e9


def lengths_for(batch: int, context: int, kind: str) -> list[int]:
    if kind == "uniform" or batch == 1:
        return [context] * batch
    return [max(1, round(1 + i * (context - 1) / (batch - 1))) for i in range(batch)]


def sdpa_padded(timer: Timer, q: torch.Tensor, k_dense: torch.Tensor, v_dense: torch.Tensor,
                scale: float) -> tuple[float, torch.Tensor]:
    """SDPA over the padded dense batch: q [B, Hq, D], k/v [B, Hkv, L, D] -> (us, out [B, Hq, D])."""
    q4 = q[:, :, None, :]
    try:
        F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=scale, enable_gqa=True)
        def run():
            return F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=scale, enable_gqa=True)
    except (TypeError, RuntimeError) as exc:
        print(f"note: SDPA enable_gqa unavailable ({exc}); repeating KV heads before timing", file=sys.stderr)
        group = q.shape[1] // k_dense.shape[1]
        k_rep, v_rep = (t.repeat_interleave(group, dim=1) for t in (k_dense, v_dense))
        def run():
            return F.scaled_dot_product_attention(q4, k_rep, v_rep, scale=scale)
    return timer(run), run()[:, :, 0]


def cells_from_columns(k_store: torch.Tensor, v_store: torch.Tensor, batch: int):
    """Lockstep lowest-free placement: position p of sequence s in cell p * B + s; the last cell is scratch."""
    context = k_store.shape[1]
    pos = torch.arange(context, device=k_store.device)
    cell_table = torch.full((batch + 1, context), batch * context, device=k_store.device, dtype=torch.int64)
    cell_table[:batch] = pos[None, :] * batch + torch.arange(batch, device=k_store.device)[:, None]
    k_pool = k_store.new_empty(batch * context + 1, *k_store.shape[2:])
    v_pool = torch.empty_like(k_pool)
    k_pool[cell_table[:batch]] = k_store[:batch]
    v_pool[cell_table[:batch]] = v_store[:batch]
    return k_pool, v_pool, cell_table


def time_plans(timer: Timer, attend, default: ta.LaunchPlan, sweep: bool) -> tuple[float, ta.LaunchPlan, list | None]:
    """attend(plan) -> out. Times the default plan, or with `sweep` the best of a few variants."""
    us, best, tried = timer(lambda: attend(default)), default, None
    if sweep:
        tried = [({}, us)]
        for change in sweep_variants(default):
            variant = replace(default, **change)
            try:
                t = timer(lambda: attend(variant))
            except Exception as exc:  # noqa: BLE001  (a variant that fails to compile is reported, not fatal)
                print(f"note: plan {change} failed: {exc}", file=sys.stderr)
                continue
            tried.append((change, t))
            if t < us:
                us, best = t, variant
    return us, best, tried


def bench_one(timer: Timer, args, batch: int, context: int, kind: str, copy_gbps: float) -> list[Row]:
    hq, hkv, d, dtype, dev = args.q_heads, args.kv_heads, args.head_dim, torch.bfloat16, DEVICE
    scale = 1.0 / math.sqrt(d)
    lengths = lengths_for(batch, context, kind)
    q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
    positions = torch.tensor([n - 1 for n in lengths], device=dev)
    seq_slots = torch.arange(batch, device=dev)
    kv_bytes = 2 * sum(lengths) * hkv * d * q.element_size()

    k_dense = torch.randn(batch, hkv, context, d, device=dev, dtype=dtype)
    v_dense = torch.randn(batch, hkv, context, d, device=dev, dtype=dtype)
    sdpa_us, sdpa_out = sdpa_padded(timer, q, k_dense, v_dense, scale)
    sdpa_gbps = 2 * k_dense.numel() * k_dense.element_size() / (sdpa_us * 1e-6) / 1e9
    # Columns [B + 1, L, Hkv, D] (the last slot is scratch) hold the same keys as the dense batch.
    k_store = torch.empty(batch + 1, context, hkv, d, device=dev, dtype=dtype)
    v_store = torch.empty_like(k_store)
    k_store[:batch].copy_(k_dense.transpose(1, 2))
    v_store[:batch].copy_(v_dense.transpose(1, 2))
    del k_dense, v_dense
    default = ta.plan_attention(batch, batch + 1, hq, hkv, d, context, dtype, ta.device_sms(q.device))
    rows = []

    def record(layout: str, attend):
        us, plan, tried = time_plans(timer, attend, default, args.sweep)
        out = attend(plan)
        # Uniform lengths: same keys as the unmasked dense batch, so the outputs must agree.
        diff = (out.float() - sdpa_out.float()).abs().max().item() if kind == "uniform" else None
        gbps = kv_bytes / (us * 1e-6) / 1e9
        rows.append(Row(batch, context, kind, layout, kv_bytes, us, gbps, gbps / copy_gbps, sdpa_us, sdpa_gbps,
                        sdpa_us / us, diff, asdict(plan), tried))

    record("columns", lambda plan: ta.attend_columns_triton(q, k_store, v_store, positions, seq_slots, 0, scale,
                                                            plan=plan))
    k_pool, v_pool, cell_table = cells_from_columns(k_store, v_store, batch)
    del k_store, v_store
    record("cells", lambda plan: ta.attend_cells_triton(q, k_pool, v_pool, cell_table, positions, seq_slots, 0,
                                                        scale, plan=plan))
    return rows


def sweep_variants(plan: ta.LaunchPlan) -> list[dict]:
    """A few decode tilings around the default: tile length, pipeline depth, warps, split count."""
    out = [{"block_n": 32, "num_stages": 4}, {"block_n": 128, "num_stages": 2}, {"num_stages": 2},
           {"num_stages": 4}, {"num_warps": 8}]
    out += [{"num_splits": n} for n in {max(1, plan.num_splits // 2), min(ta.MAX_SPLITS, 2 * plan.num_splits)}
            if n != plan.num_splits]
    return out


def markdown(rows: list[Row], copy_gbps: float, device: str) -> str:
    lines = [f"Device: {device}; copy bandwidth {copy_gbps:.0f} GB/s (read + write)", "",
             "| B | L | lengths | layout | splits | us | KV GB/s | % copy | SDPA us | SDPA GB/s | x SDPA | max diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = "-" if r.max_abs_diff_vs_sdpa is None else f"{r.max_abs_diff_vs_sdpa:.1e}"
        lines.append(f"| {r.batch} | {r.context} | {r.lengths} | {r.layout} | {r.plan['num_splits']} | "
                     f"{r.time_us:.1f} | "
                     f"{r.kv_gbps:.0f} | {100 * r.copy_fraction:.0f}% | {r.sdpa_time_us:.1f} | "
                     f"{r.sdpa_gbps:.0f} | {r.speedup_vs_sdpa:.2f} | {diff} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON results")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--sweep", action="store_true", help="also time a few tilings per point; report the best")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA device", file=sys.stderr)
        return 2
    if not ta.available():
        print(f"bench_attention: Triton attention unavailable: {ta.reason}", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    timer = Timer(args.warmup, args.repeats)
    copy_gbps = copy_bandwidth_gbps(timer)
    rows: list[Row] = []
    for context in (int(x) for x in args.contexts.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            for kind in ("uniform", "ragged") if batch > 1 else ("uniform",):
                rows += bench_one(timer, args, batch, context, kind, copy_gbps)
                torch.cuda.empty_cache()
                r = rows[-2]
                print(f"B={batch} L={context} {kind}: columns {r.time_us:.1f} us ({r.kv_gbps:.0f} GB/s), "
                      f"cells {rows[-1].time_us:.1f} us, SDPA {r.sdpa_time_us:.1f} us", file=sys.stderr)
    print(markdown(rows, copy_gbps, device))
    with open(args.out, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "copy_gbps": copy_gbps, "config": vars(args),
                   "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
