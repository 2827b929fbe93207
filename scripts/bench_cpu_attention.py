"""CPU attention: the per-sequence kernels (`mg.kernels.cpu_attention`) against the torch references.

Both KV layouts, fp32, the embedded default's heads (6 query heads, 2 KV heads, head_dim 64) by default; each
kernel by default (SDPA per sequence) and row-invariant (`row_invariant=True`: each row over its own keys in
shapes fixed per row).
Cases: decode steps (one row per sequence), DFlash verify blocks (16 rows per sequence), a prefill chunk
mix; sequences of `--length` tokens in columns of `--rows` rows (cells: read span `--rows`). Per case the
median of `--repeats` calls after a warm-up. Prints Markdown; `--out` writes JSON.

    python scripts/bench_cpu_attention.py --out bench_cpu_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mg.kernels.attention_ref import attend_cells_ref, attend_columns_ref
from mg.kernels.cpu_attention import attend_cells_cpu, attend_columns_cpu

CASES = [  # (name, sequences, rows per sequence)
    ("decode, 1 sequence", 1, 1),
    ("decode, 8 sequences", 8, 1),
    ("decode, 20 sequences", 20, 1),
    ("verify, 1 sequence x 16 rows", 1, 16),
    ("verify, 8 sequences x 16 rows", 8, 16),
    ("prefill, 4 sequences x 32 rows", 4, 32),
]


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--q-heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--length", type=int, default=150, help="tokens each sequence holds after the step")
    p.add_argument("--rows", type=int, default=256, help="column rows (sequence) / read span (cell)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    hq, hkv, d, length, rows = args.q_heads, args.kv_heads, args.head_dim, args.length, args.rows
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, n_seqs, n_rows in CASES:
        slots = n_seqs + 1
        k_store = torch.randn(slots, rows, hkv, d, generator=gen)
        v_store = torch.randn(slots, rows, hkv, d, generator=gen)
        n_cells = slots * rows + 1
        table = torch.randperm(n_cells - 1, generator=gen)[:slots * rows].view(slots, rows)
        k_pool, v_pool = torch.randn(n_cells, hkv, d, generator=gen), torch.randn(n_cells, hkv, d, generator=gen)
        positions = torch.cat([torch.arange(length - n_rows, length) for _ in range(n_seqs)])
        seq_slots = torch.arange(n_seqs).repeat_interleave(n_rows)
        q = torch.randn(len(positions), hq, d, generator=gen)
        row = {"case": name, "queries": len(positions)}
        row["sequence_ref_ms"] = median_ms(lambda: attend_columns_ref(q, k_store, v_store, positions, seq_slots, 0,
                                                                      0.1), args.repeats)
        row["sequence_cpu_ms"] = median_ms(lambda: attend_columns_cpu(q, k_store, v_store, positions, seq_slots, 0,
                                                                      0.1), args.repeats)
        row["sequence_row_invariant_ms"] = median_ms(lambda: attend_columns_cpu(
            q, k_store, v_store, positions, seq_slots, 0, 0.1, row_invariant=True), args.repeats)
        row["cell_ref_ms"] = median_ms(lambda: attend_cells_ref(q, k_pool, v_pool, table, positions, seq_slots, 0,
                                                                0.1, rows), args.repeats)
        row["cell_cpu_ms"] = median_ms(lambda: attend_cells_cpu(q, k_pool, v_pool, table, positions, seq_slots, 0,
                                                                0.1), args.repeats)
        row["cell_row_invariant_ms"] = median_ms(lambda: attend_cells_cpu(
            q, k_pool, v_pool, table, positions, seq_slots, 0, 0.1, row_invariant=True), args.repeats)
        results.append(row)
        print(f"  {name}: sequence {row['sequence_ref_ms']:.2f} -> {row['sequence_cpu_ms']:.2f} ms (row-invariant "
              f"{row['sequence_row_invariant_ms']:.2f}), cell {row['cell_ref_ms']:.2f} -> {row['cell_cpu_ms']:.2f} ms "
              f"(row-invariant {row['cell_row_invariant_ms']:.2f})", flush=True)
    print(f"\n{hq} query heads, {hkv} KV heads, head_dim {d}; sequences of {length} tokens, {rows} column rows / "
          f"read span; torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| case | queries | sequence: reference ms | sequence: per-sequence ms | speed-up | sequence: row-invariant "
          "ms | cell: reference ms | cell: per-sequence ms | speed-up | cell: row-invariant ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['case']} | {r['queries']} | {r['sequence_ref_ms']:.2f} | {r['sequence_cpu_ms']:.2f} | "
              f"{r['sequence_ref_ms'] / r['sequence_cpu_ms']:.1f}x | {r['sequence_row_invariant_ms']:.2f} | "
              f"{r['cell_ref_ms']:.2f} | {r['cell_cpu_ms']:.2f} | {r['cell_ref_ms'] / r['cell_cpu_ms']:.1f}x | "
              f"{r['cell_row_invariant_ms']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
