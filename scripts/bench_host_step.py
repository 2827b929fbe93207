"""Host work of an engine's plain decode step, the device's time left out: what DFlash's bookkeeping adds.

On a GPU serving a small model (the embedded default) a decode step is host-bound: the host's Python and
torch calls take longer than the device's forward. This benchmark serves prompts with the target `forward`
method's execution replaced by outputs computed once, so each step costs its host work: scheduling, the
speculator's choice, packing, the model runner's call path (padding to a bucket, the cache's admission, the
inputs' copy to the device and, with CUDA graphs, the replay of a graph that holds no model kernels),
acceptance on the device tensors and bookkeeping. Three engines side by side:

    plain       target-only
    no-drafts   a DFlash engine whose choice is forced to k = 0 (its commits, observations, step accounting)
    adaptive    a DFlash engine choosing for itself, with the drafter priced out (zero acceptance, no
                probes): every step is a plain step chosen by the real choice (fused rounds on, as on CUDA)

Runs alternate between the engines (`--repeats` rounds, the fastest kept) and the table gives microseconds
per step and each DFlash engine's excess over target-only. What the call path adds around the method is kept:
the write of plain steps' hidden rows to the drafter's waiting buffer and the cell layout's placement
(inside the graph with CUDA graphs, eager ops on CPU).
Draft-context appends (one per several hundred rows) are skipped. `--padded` pads calls to their buckets on
the CPU too, as CUDA graphs do. `--overlap` (auto: with CUDA graphs) runs the engines' plain steps overlapped
(`RunConfig.overlap`): each step's host work then includes reading back the step before. Prints Markdown;
`--out` writes JSON.

    python scripts/bench_host_step.py --batches 1,8
    python3 scripts/bench_host_step.py --device cuda --out host_step_cuda.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from script_common import add_artifact_args, add_overlap_arg, artifact_dir, auto_on_off, int_list

MODES = ("plain", "no-drafts", "adaptive")


def _engine(artifact, mode: str, device: str, padded: bool, overlap: bool | None):
    import torch

    from mg.manifests import constants as C
    from mg.runtime.config import RunConfig
    from mg.runtime.engine import Engine
    from mg.runtime.speculative import AcceptanceModel, ProbeSchedule

    engine = Engine(artifact, RunConfig(device=device, dflash=mode != "plain", speculation="adaptive",
                                        fused_rounds=True, pad_steps=True if padded else None, overlap=overlap))
    runner, spec = engine.runner, engine.spec
    rows = runner.cache.max_write
    logits = torch.zeros(rows, artifact.manifest.model.vocab_size, device=device)
    logits[:, 7] = 1.0  # every step samples token 7: no EOS, the same work every step
    hidden = (torch.zeros(rows, runner.hidden_width, dtype=runner.hidden_dtype, device=device) if spec is not None
              else None)
    execute = runner._execute  # a method's own execution, under the call path (graphs capture what it does)

    def fixed_forward(method, inputs, padded_call):
        if method != C.METHOD_FORWARD:
            return execute(method, inputs, padded_call)
        return [logits[:inputs[3].shape[0]]] + ([hidden[:inputs[0].shape[0]]] if hidden is not None else [])

    runner._execute = fixed_forward
    if spec is not None:
        runner.draft_append = lambda *args: None
        runner.call_log = None  # calls are not timed, as on CUDA
        if mode == "no-drafts":
            spec.choose = lambda decode, rows_left, prefill=False: [0] * len(decode)
            spec.fuses = lambda batch: False
        else:
            k = spec.block - 1
            spec.acceptance = AcceptanceModel(runner.cache.n_slots, k, prior=0.0,
                                              global_counts=([0.0] * k, [50.0] * k))
            spec.probes = ProbeSchedule(runner.cache.n_slots, start=10 ** 9, cap=10 ** 9)
    return engine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_artifact_args(p)
    p.add_argument("--batches", default="1", help="comma-separated numbers of sequences decoding at once")
    p.add_argument("--steps", type=int, default=300, help="decode steps per run")
    p.add_argument("--repeats", type=int, default=5, help="runs per engine, alternated; the fastest is kept")
    p.add_argument("--padded", action="store_true",
                   help="pad calls to their buckets on the CPU too (as with CUDA graphs; always so on CUDA)")
    add_overlap_arg(p)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    batches = int_list(p, "--batches", args.batches)
    if args.steps < 1 or args.repeats < 1:
        p.error(f"--steps is {args.steps} and --repeats {args.repeats}; allowed: integers >= 1")

    from mg.kernels.quiet import quiet_dependencies
    from mg.runtime.artifact import load_artifact
    from mg.runtime.scheduler import Request

    quiet_dependencies()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        art_dir = artifact_dir(args.artifact, args.layout, tmp)
        artifact = load_artifact(art_dir, device=args.device)
        if not artifact.has_draft:
            p.error(f"{art_dir} has no drafter: nothing to compare target-only with")
        capacity = artifact.manifest.kv.capacity
        prompt = tuple(range(10, 40))
        steps = min(args.steps, capacity - len(prompt) - 1)
        overlap = auto_on_off(args.overlap)
        engines = {mode: _engine(artifact, mode, args.device, args.padded, overlap) for mode in MODES}
        for n in batches:
            runs = {mode: [] for mode in MODES}
            for rep in range(args.repeats):
                for mode, engine in engines.items():
                    reqs = [Request(f"{n}-{rep}-{i}", prompt, steps) for i in range(n)]
                    if args.device == "cuda":
                        import torch

                        torch.cuda.synchronize()
                    before, t0 = engine.stats.steps, time.perf_counter()
                    engine.run(reqs)
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    runs[mode].append((time.perf_counter() - t0) / (engine.stats.steps - before))
            best = {mode: min(r) for mode, r in runs.items()}
            for mode in MODES:
                rows.append({"sequences": n, "mode": mode, "us_per_step": 1e6 * best[mode],
                             "us_per_step_median": 1e6 * statistics.median(runs[mode]),
                             "over_plain_us": 1e6 * (best[mode] - best["plain"])})
                r = rows[-1]
                print(f"x{n} {mode}: {r['us_per_step']:.1f} us/step (+{r['over_plain_us']:.1f})", file=sys.stderr)
    lines = ["| sequences | engine | host us/step (fastest) | median | over target-only |", "|---|---|---|---|---|"]
    for r in rows:
        plain = r["us_per_step"] - r["over_plain_us"]
        lines.append(f"| {r['sequences']} | {r['mode']} | {r['us_per_step']:.1f} | {r['us_per_step_median']:.1f} | "
                     f"{r['over_plain_us']:+.1f} us ({r['over_plain_us'] / plain:+.0%}) |")
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text(json.dumps({"device": args.device, "artifact": str(art_dir), "steps": steps,
                                        "repeats": args.repeats, "padded": args.padded or args.device == "cuda",
                                        "overlap": args.overlap,
                                        "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
