"""Host time of admitting one sequence's rows to a KV cache: row by row (`declare_step`, the path of calls that
name their rows as tensors) against by span (`declare_spans`, the path of draft-context appends and fused
rounds), for each layout and a few row counts.

A draft-context append before a probe carries every row a sequence committed since it last drafted (tens to a
hundred rows), and its admission is host work inside the step. Each measurement admits the rows to slot 0 from
position 0 of a fresh draft cache and rewinds it (the rewind is not timed), `--reps` times; the median is
kept, and each (layout, rows) alternates the two paths `--rounds` times, keeping the fastest median of each.
Prints Markdown; `--out` writes JSON.

    python scripts/bench_admission.py
    python scripts/bench_admission.py --rows 16,128 --out admission.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from script_common import int_list


def _median_ms(cache, rows: int, how: str, reps: int) -> float:
    import torch

    positions, slots = torch.arange(rows), torch.zeros(rows, dtype=torch.long)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if how == "rows":
            cache.declare_step(positions, slots)
        else:
            cache.declare_spans([(0, 0, rows)])
        times.append(time.perf_counter() - t0)
        cache.rewind(0, 0)
    return 1e3 * statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8,48,96", help="comma-separated rows per admission (at most the max_write)")
    p.add_argument("--reps", type=int, default=500, help="admissions per measurement")
    p.add_argument("--rounds", type=int, default=3, help="measurements per path, alternated; the fastest is kept")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    counts = int_list(p, "--rows", args.rows)
    if args.reps < 1 or args.rounds < 1:
        p.error(f"--reps {args.reps} and --rounds {args.rounds}; allowed: integers >= 1")
    from mg.manifests import KVLayer, KVSpec
    from mg.runtime.cache_base import make_cache

    results = []
    for layout in ("sequence", "cell"):
        max_write = max(counts)
        spec = KVSpec(layout=layout, max_seqs=8, max_cells=8 * 1024 if layout == "cell" else None, capacity=1024,
                      max_write=max_write, dtype="float32",
                      layers=tuple(KVLayer(layer_id=i, policy="flat", window=0, n_kv_heads=2, head_dim=64) for i in range(3)))
        cache = make_cache(spec, "cpu", n_slots=8)
        for rows in counts:
            best = {"rows": float("inf"), "spans": float("inf")}
            for _ in range(args.rounds):
                for how in best:
                    best[how] = min(best[how], _median_ms(cache, rows, how, args.reps))
            results.append({"layout": layout, "rows": rows, "by_rows_ms": best["rows"], "by_span_ms": best["spans"]})
    print("| layout | rows | row by row (declare_step) ms | by span (declare_spans) ms | ratio |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['layout']} | {r['rows']} | {r['by_rows_ms']:.3f} | {r['by_span_ms']:.3f} | "
              f"{r['by_rows_ms'] / r['by_span_ms']:.2f}x |")
    if args.out is not None:
        args.out.write_text(json.dumps({"reps": args.reps, "rounds": args.rounds, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
