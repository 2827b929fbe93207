"""Evaluate DFlash on held-out prompts: losslessness, acceptance length, and speedup over target-only.

For each KV layout: export the checkpoint pair, then run the prompts of `--prompts` (JSONL, one
{"id", "prompt"} per line) greedily with target-only decoding and with DFlash (`--speculation`:
adaptive, fixed, or both), each prompt alone (per-prompt acceptance and time) and all together
(throughput), each measurement `--repeats` times (target-only and DFlash interleaved; the fastest run
is kept), every run of a setting on one engine built and warmed up before the first clock starts. Prints a Markdown table and writes JSON with the distribution per prompt and per block row,
the histogram of chosen draft lengths k (k = 0: a plain decode step), every run's time and every DFlash
run's stalls (plain steps left out of adaptive speculation's pricing, over twice their price), the last run's
round probes and how many paid (sequences kept at plain steps drafting to check on the drafter), the single
prompts' total target-only time over their total DFlash time, and how much target-only moved between its
runs (slowest over fastest): a speed-up within about that spread of 1.0 cannot be told from 1.0.

    python scripts/eval_dflash.py --out eval.json                      # the embedded default, on CPU
    python scripts/eval_dflash.py --device cuda --out eval_cuda.json
    python scripts/eval_dflash.py --device cuda --compare-overlap --out eval_cuda.json  # + target-only, no overlap
    python scripts/eval_dflash.py --draft-weights float,int4 --speculation adaptive --out eval_drafters.json

`--draft-weights` exports the pair once per drafter scheme (the target stays float, so target-only is the same
model) and runs every policy on each drafter in the same interleaved rounds.

Every engine runs with `--overlap` (auto: overlapped plain steps with CUDA graphs, `RunConfig.overlap`);
`--compare-overlap` also times target-only with every step read back at once, in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from script_common import add_matmul_args, add_overlap_arg, auto_on_off, matmul_name, matmul_settings  # noqa: E402

from mg.manifests.constants import DTYPES, WEIGHT_SCHEMES  # noqa: E402
from mg.runtime.config import PROBE_KINDS  # noqa: E402


def _export(checkpoint, draft_checkpoint, layout: str, out: Path, max_context: int, dtype: str | None = None,
            draft_weights: str | None = None) -> Path:
    from mg.export.artifact import PRESET_SEED, ExportOptions, export_artifact, load_target
    from mg.export.draft_lower import load_draft

    target = load_target(checkpoint, None if checkpoint else "tiny")
    draft = load_draft(draft_checkpoint, None if draft_checkpoint else "tiny", target.cfg, PRESET_SEED)
    opts = ExportOptions(output_dir=out, layout=layout, max_seqs=8 if layout == "sequence" else None,
                         max_cells=8 * max_context if layout == "cell" else None, max_context=max_context,
                         max_write=128, force=True, dtype=dtype, draft_weights=draft_weights)
    export_artifact(opts, target, lambda msg: print(f"  [export {layout}] {msg}", file=sys.stderr), draft)
    return out


_ARTIFACTS: dict = {}
_ENGINES: dict = {}


def _engine(artifact_dir: Path, speculation: str | None, device: str, warm_up: tuple, settings: tuple = ()):
    """The engine of `artifact_dir` for `speculation` (target-only when None) and `settings` (more `RunConfig`
    fields, as (name, value) pairs), built once per process: its
    CUDA graphs captured, its costs measured and one short untimed request (`warm_up`, a prompt) served
    before any clock starts.
    Every run of a layout goes through the same two or three engines, as a server's requests go through one:
    what a DFlash engine learns of a sequence is reset when the sequence ends, and what it learns of the
    drafter and the step costs is shared by the engines of a process anyway. Timing runs on long-lived
    engines also lets target-only and DFlash alternate run by run within milliseconds, where building an
    engine (graph captures) between runs spread them over seconds of a GPU host's drifting speed."""
    key = (str(artifact_dir), device, speculation, settings)
    engine = _ENGINES.get(key)
    if engine is not None:
        return engine
    from mg.runtime.artifact import load_artifact
    from mg.runtime.config import RunConfig
    from mg.runtime.engine import Engine
    from mg.runtime.scheduler import Request

    if (str(artifact_dir), device) not in _ARTIFACTS:
        _ARTIFACTS[(str(artifact_dir), device)] = load_artifact(artifact_dir, device=device)
    config = RunConfig(device=device, dflash=speculation is not None, speculation=speculation or "adaptive",
                       **dict(settings))
    engine = _ENGINES[key] = Engine(_ARTIFACTS[(str(artifact_dir), device)], config)
    engine.warm_up()  # CUDA graphs of every bucket captured before the clock starts, for every engine alike
    # One short untimed request first: the first steps of an engine after its graphs were captured ran slow
    # on the GPU host in some runs, target-only engines more than DFlash ones (whose cost measurement had
    # run the same calls), which inflated DFlash's single-prompt ratios.
    engine.run([Request("warm-up", warm_up, 4)])
    return engine


SPECULATIONS = ("adaptive", "fixed", *(f"adaptive:{k}" for k in PROBE_KINDS))  # --speculation's policies
READ_BACK = "target-only-no-overlap"  # the extra target-only engine of --compare-overlap


def _run(artifact_dir: Path, reqs, speculation: str | None, device: str, trace: list | None = None,
         settings: tuple = ()):
    """`reqs` served to the end by the layout's engine for `speculation` (`_engine`; READ_BACK: target-only
    with every step read back at once), timed; returns (results, the run's DFlash statistics, seconds).
    `trace`: a list that gets adaptive speculation's choice of every step (`Speculator.trace`)."""
    if speculation == READ_BACK:
        speculation, settings = None, tuple(sorted({**dict(settings), "overlap": False}.items()))
    elif speculation is not None and ":" in speculation:  # adaptive:shadow | adaptive:round (RunConfig.probes)
        speculation, probes = speculation.split(":")
        settings = tuple(sorted({**dict(settings), "probes": probes}.items()))
    engine = _engine(artifact_dir, speculation, device, reqs[0].prompt[:8], settings)
    if engine.spec is not None:
        engine.spec.stats = type(engine.spec.stats)()  # the statistics are the run's
        engine.spec.trace = trace
    cuda = device == "cuda"
    if cuda:
        import torch

        torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = engine.run(reqs)
    if cuda:
        torch.cuda.synchronize()
    return results, engine.spec_stats, time.perf_counter() - t0


def _requests(path: Path, artifact_dir: Path, max_new: int):
    from mg.runtime.artifact import load_artifact
    from mg.runtime.scheduler import Request
    from mg.runtime.tokenizer import TextCodec

    art = load_artifact(artifact_dir)
    if art.tokenizer_path is None:
        raise SystemExit(f"{artifact_dir} has no tokenizer.json; the held-out prompts are text")
    codec = TextCodec(art.tokenizer_path, art.manifest.model.bos_id)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Request(r["id"], tuple(codec.encode(r["prompt"])), max_new) for r in rows]


def _row_acceptance(hist: list[int], block: int) -> list[float]:
    """P(draft row i accepted) for i = 1..block-1, from the histogram of accepted drafts per round."""
    rounds = sum(hist)
    return [sum(hist[i:]) / rounds if rounds else 0.0 for i in range(1, block)]  # hist may be shorter


def evaluate_layout(artifact_dir: Path, prompts: Path, max_new: int, device: str, policies: list[str],
                    repeats: int = 1, traces: dict | None = None, settings: tuple = (),
                    compare_overlap: bool = False, drafters: dict[str, Path] | None = None) -> dict:
    """Target-only vs each speculation policy: each prompt alone, then all prompts in one batch. Each
    measurement runs `repeats` times, target-only and the policies interleaved, and keeps the fastest: one
    timing of a short run on a shared machine swings by more than the differences sought, and the noise
    only ever adds time. `traces`: gets {run: adaptive speculation's choices per step} of each prompt's and
    the batch's last adaptive run. `settings`: every engine's other `RunConfig` fields ((name, value) pairs:
    overlap, compile, row_invariant, rows_kernel); `compare_overlap`: one more target-only engine, its steps read back at
    once, timed in the same rounds. `drafters`: {label: artifact} of the same target with other drafter weights
    (`--draft-weights`): each policy also runs on each, as "<policy> (<label> drafter)", in the same rounds."""
    reqs = _requests(prompts, artifact_dir, max_new)
    runs_on = {p: (p, artifact_dir) for p in policies}  # result name -> (speculation policy, artifact)
    for label, art in (drafters or {}).items():
        runs_on.update({f"{p} ({label} drafter)": (p, art) for p in policies})
    policies = list(runs_on)
    from mg.manifests import read_manifest

    block = read_manifest(artifact_dir / "manifest.json").draft.block_size
    per_prompt = {p: [] for p in policies}
    lossless = True

    def timed(batch, name):
        """({policy or None: every run's seconds}, {policy or None: (results, stats) of the last run}); every
        run's stalls (`SpecStats.stalls`) go to `stalls` {name: {policy: [...]}}."""
        times, last = {}, {}
        for repeat in range(repeats):
            for policy in [None] + ([READ_BACK] if compare_overlap else []) + policies:
                speculation, art = runs_on.get(policy, (policy, artifact_dir))
                trace = [] if traces is not None and (speculation or "").startswith("adaptive") else None
                res, stats, s = _run(art, batch, speculation, device, trace, settings)
                if trace is not None:
                    run = name if policy == "adaptive" else f"{name} | {policy}"
                    traces[run if not repeat else f"{run} #{repeat + 1}"] = trace
                times.setdefault(policy, []).append(s)
                last[policy] = (res, stats)
                if policy in policies:
                    stalls.setdefault(name, {}).setdefault(policy, []).append(stats.stalls)
        return times, last

    stalls: dict = {}
    target_spreads = []  # each prompt's target-only runs: slowest over fastest - 1
    overlap_single = []  # each prompt's target-only time read back at once over overlapped (compare_overlap)
    for req in reqs:
        runs_s, runs = timed([req], req.id)
        t = {p: min(r) for p, r in runs_s.items()}
        target_spreads.append(_spread(runs_s[None]))
        ar = runs[None][0]
        if compare_overlap:
            lossless &= runs[READ_BACK][0][0].tokens == ar[0].tokens
            overlap_single.append(t[READ_BACK] / t[None])
        for policy in policies:
            sd, sd_stats = runs[policy]
            lossless &= ar[0].tokens == sd[0].tokens
            per_prompt[policy].append({
                "id": req.id, "prompt_tokens": len(req.prompt), "generated": len(sd[0].tokens),
                "lossless": ar[0].tokens == sd[0].tokens, "acceptance_length": sd_stats.mean_acceptance_length,
                "chosen_k_hist": list(sd_stats.chosen_k_hist), "shadow_probes": sd_stats.shadow_probes,
                "probes": sd_stats.probes, "probes_paid": sd_stats.probes_paid,
                "target_only_s": t[None], "dflash_s": t[policy],
                "speedup": t[None] / t[policy], "target_only_runs_s": runs_s[None], "dflash_runs_s": runs_s[policy],
                "dflash_runs_stalls": stalls[req.id][policy]})
    runs_s, runs = timed(reqs, "batched")
    t = {p: min(r) for p, r in runs_s.items()}
    ar = runs[None][0]
    generated = sum(len(r.tokens) for r in ar)
    out = {"repeats": repeats, "target_only_tokens_per_s": generated / t[None],
           # How much the same target-only measurement moved between its runs (the fastest is kept): a
           # speed-up within about this of 1.0 cannot be told from 1.0 by this run.
           "target_only_spread": {"single_median": statistics.median(target_spreads),
                                  "single_max": max(target_spreads), "batched": _spread(runs_s[None])},
           "policies": {}}
    if compare_overlap:
        lossless &= all(a.tokens == b.tokens for a, b in zip(ar, runs[READ_BACK][0]))
        # Target-only, overlapped (as every engine here) against read back at once: > 1 when overlap helps.
        out["overlap"] = {"target_only_no_overlap_tokens_per_s": generated / t[READ_BACK],
                          "batched_speedup": t[READ_BACK] / t[None],
                          "single_speedup_median": statistics.median(overlap_single),
                          "single_speedup_min": min(overlap_single)}
    for policy in policies:
        sd, sd_stats = runs[policy]
        lossless &= all(a.tokens == b.tokens for a, b in zip(ar, sd))
        speedups = [p["speedup"] for p in per_prompt[policy]]
        out["policies"][policy] = {
            "batched": {"dflash_tokens_per_s": sum(len(r.tokens) for r in sd) / t[policy],
                        "speedup": t[None] / t[policy],
                        "mean_acceptance_length": sd_stats.mean_acceptance_length, "rounds": sd_stats.rounds,
                        "chosen_k_hist": list(sd_stats.chosen_k_hist), "shadow_probes": sd_stats.shadow_probes,
                        "probes": sd_stats.probes, "probes_paid": sd_stats.probes_paid,
                        "dflash_runs_s": runs_s[policy],
                        "target_only_runs_s": runs_s[None], "dflash_runs_stalls": stalls["batched"][policy]},
            "single_speedup_median": statistics.median(speedups), "single_speedup_min": min(speedups),
            # The prompts one after another: all target-only time over all DFlash time (a ratio of sums moves
            # less with one prompt's noisy target-only run than the median and minimum of ratios do).
            "single_speedup_total": (sum(p["target_only_s"] for p in per_prompt[policy])
                                     / sum(p["dflash_s"] for p in per_prompt[policy])),
            "acceptance_hist": list(sd_stats.accepted_hist),
            "row_acceptance": _row_acceptance(list(sd_stats.accepted_hist), block),
            "per_prompt": per_prompt[policy],
        }
    out["lossless_all"] = lossless
    layout_arts = {str(a) for _, a in runs_on.values()} | {str(artifact_dir)}
    for key in [k for k in _ENGINES if k[0] in layout_arts]:  # the next layout's engines replace them
        del _ENGINES[key]
    return out


def _spread(runs: list[float]) -> float:
    """Slowest run over fastest, minus 1 (0 for one run)."""
    return max(runs) / min(runs) - 1.0


def _table(results: dict) -> str:
    lines = ["| layout | speculation | lossless | batched acceptance length | AR tok/s | DFlash tok/s | batched "
             "speedup | single-prompt speedup median (min) | single prompts, total time | target-only spread, "
             "single median (max) / batched | chosen k histogram (batched) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for layout, r in results["layouts"].items():
        noise = r["target_only_spread"]
        for policy, p in r["policies"].items():
            b = p["batched"]
            lines.append(f"| {layout} | {policy} | {r['lossless_all']} | {b['mean_acceptance_length']:.2f} | "
                         f"{r['target_only_tokens_per_s']:.1f} | {b['dflash_tokens_per_s']:.1f} | "
                         f"{b['speedup']:.2f}x | {p['single_speedup_median']:.2f}x ({p['single_speedup_min']:.2f}x) "
                         f"| {p['single_speedup_total']:.2f}x | {noise['single_median']:.0%} "
                         f"({noise['single_max']:.0%}) / {noise['batched']:.0%} | {b['chosen_k_hist']} |")
    for layout, r in results["layouts"].items():
        o = r.get("overlap")
        if o is not None:
            lines.append(f"\n{layout}: target-only overlapped vs read back at once: batched "
                         f"{r['target_only_tokens_per_s']:.1f} vs {o['target_only_no_overlap_tokens_per_s']:.1f} "
                         f"tok/s ({o['batched_speedup']:.2f}x), single prompts median {o['single_speedup_median']:.2f}x "
                         f"(min {o['single_speedup_min']:.2f}x)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None, help="target checkpoint [default: embedded default]")
    p.add_argument("--draft-checkpoint", type=Path, default=None)
    p.add_argument("--prompts", type=Path, default=ROOT / "tests" / "data" / "heldout_prompts.jsonl")
    p.add_argument("--layouts", default="sequence,cell")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="the export's float dtype (mg-export --dtype) [default: the checkpoint's]")
    p.add_argument("--draft-weights", default="float",
                   help="comma-separated: the drafter's linears (mg-export --draft-weights; int4 in groups of 128), "
                        "each its own export of the pair with the target float; the first is the drafter of the "
                        "policies' plain names, each other one runs every policy too, in the same rounds, as "
                        "\"<policy> (<scheme> drafter)\" [default: float]")
    p.add_argument("--speculation", default="adaptive,fixed",
                   help="comma-separated: adaptive, fixed, adaptive:shadow, adaptive:round (adaptive with that kind "
                        "of probes, RunConfig.probes; plain adaptive: the default, round probes) [default: adaptive,fixed]")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per measurement, target-only and DFlash interleaved; the fastest is kept")
    add_overlap_arg(p)
    add_matmul_args(p)
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="methods as compiled fused code (RunConfig.compile): auto = on CUDA, interpreted on the CPU "
                        "[default: auto]")
    p.add_argument("--compare-overlap", action="store_true",
                   help="also time target-only with every step read back at once (no overlap), in the same rounds")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--trace", type=Path, default=None,
                   help="also write adaptive speculation's choice of every step (JSON: layout -> run -> steps; "
                        "a run's later repeats as 'run #2', 'run #3', ...)")
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats is {args.repeats}; allowed: an integer >= 1")
    policies = args.speculation.split(",")
    if not policies or any(q not in SPECULATIONS or policies.count(q) > 1 for q in policies):
        p.error(f"--speculation is {args.speculation!r}; allowed: distinct comma-separated {' | '.join(SPECULATIONS)}")
    schemes = args.draft_weights.split(",")
    for scheme in schemes:
        if scheme not in WEIGHT_SCHEMES or schemes.count(scheme) > 1:
            p.error(f"--draft-weights is {args.draft_weights!r}; allowed: distinct comma-separated "
                    f"{' | '.join(WEIGHT_SCHEMES)}")
    from mg.kernels.quiet import quiet_dependencies

    quiet_dependencies()  # the exporter's dependencies log import-time noise
    if args.checkpoint is None:
        from mg.export.artifact import default_checkpoints

        args.checkpoint, args.draft_checkpoint = default_checkpoints()
    from mg.runtime.config import RunConfig

    results = {"device": args.device, "dtype": args.dtype or "checkpoint's",
               "draft_weights": schemes, "prompts": str(args.prompts),
               "max_new_tokens": args.max_new_tokens,
               "speculation": args.speculation.split(","), "overlap": args.overlap, "compile": args.compile,
               "row_invariant": args.row_invariant, "rows_kernel": args.rows_kernel,
               "matmul": matmul_name(RunConfig(device=args.device, **matmul_settings(args))), "layouts": {}}
    traces = {}
    settings = tuple(sorted({"overlap": auto_on_off(args.overlap), "compile": auto_on_off(args.compile),
                             **matmul_settings(args)}.items()))
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts.split(","):
            arts = {scheme: _export(args.checkpoint, args.draft_checkpoint, layout, Path(tmp) / f"{layout}-{scheme}",
                                    args.max_context, args.dtype, scheme) for scheme in schemes}
            traces[layout] = {} if args.trace is not None else None
            results["layouts"][layout] = evaluate_layout(arts[schemes[0]], args.prompts, args.max_new_tokens,
                                                         args.device, args.speculation.split(","), args.repeats,
                                                         traces[layout], settings, args.compare_overlap,
                                                         {s: arts[s] for s in schemes[1:]})
    if args.trace is not None:
        args.trace.write_text(json.dumps(traces) + "\n")
    table = _table(results)
    print(table)
    for layout, r in results["layouts"].items():
        for policy, p in r["policies"].items():
            print(f"{layout} {policy}: P(row i accepted) = " + ", ".join(f"{x:.2f}" for x in p["row_acceptance"]))
            single = sum(sum(q["dflash_runs_stalls"]) for q in p["per_prompt"])
            batched = sum(p["batched"]["dflash_runs_stalls"])
            if single or batched:  # said only when some were (speculative.STALL_RATIO)
                print(f"{layout} {policy}: stalls (plain steps over twice their price, left out of the pricing) "
                      f"in all runs: {single} single-prompt, {batched} batched")
            probes = [(sum(q["probes"] for q in p["per_prompt"]), sum(q["probes_paid"] for q in p["per_prompt"])),
                      (p["batched"]["probes"], p["batched"]["probes_paid"])]
            if any(n for n, _ in probes):  # round probes of sequences kept at plain steps (SpecStats.probes)
                print(f"{layout} {policy}: round probes in the last runs: {probes[0][0]} ({probes[0][1]} paid) over "
                      f"the single prompts, {probes[1][0]} ({probes[1][1]} paid) batched")
    results["table"] = table
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["lossless_all"] for r in results["layouts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
