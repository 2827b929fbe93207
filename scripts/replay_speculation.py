"""Adaptive speculation replayed without a clock: the runtime's own draft choice (`Speculator.choose`, its
acceptance estimates and probes) driven by the drafts each round would have accepted, with step times from
fixed cost tables. Two runs give the same numbers, so changes to the estimates or the probes can be compared on
a machine whose timed runs move by more than the change (the 2-core CPU's `eval_dflash.py` runs move by 10-40%).

For each prompt of `--prompts`: the target's greedy continuation (`--max-new-tokens`) and, at every position,
how many of the drafter's block - 1 drafts anchored there agree with it (the eager replay of
`scripts/train_tiny.py`, which `tests/test_embedded_default.py` checks against the engine's rounds). Then each
prompt alone, as `eval_dflash.py` serves it: the speculator of a real engine on an export of the checkpoints
(CPU, separate calls, no fused rounds) is asked `choose` every step, takes the drafts the text accepts, and is
told `observe` and `step_done` with the step's time from the engine's cost tables (measured when the engine
started, kept fixed: `forward` at the step's rows, `draft_block`, and `draft_append` of the rows committed
since the sequence last drafted) plus a fixed host time per kind of step. Target-only makes the same tokens in
plain steps at its own host time. The prompts run `--passes` times in one engine (the global estimates carry
over between prompts, as in `eval_dflash.py`'s repeated runs); the last pass is reported, for `--orders`
orders of the prompts (the first: the file's).

Left out: prompt processing (the same with or without DFlash), the engine's step work beyond the host times
given, and the waiting context rows in the choice (their append is timed; the choice here prices it at zero).
Estimator settings can be changed for an experiment (`--prior`, `--strength`, `--decay`, `--probe-budget`), and
how probes run (`--probes shadow|round`).
The tables are this machine's as measured when the engine starts, or (`--tables`) those an earlier run recorded:
a machine under other load measures other tables, and its numbers then move with them.

    python scripts/replay_speculation.py --out replay.json
    python scripts/replay_speculation.py --probe-budget 0.2 --orders 10 --out replay_budget.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
from pathlib import Path

from mg.runtime.config import PROBE_KINDS, PROBES_ROUND

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def accepted_per_position(target_dir: Path, draft_dir: Path, prompts: list[tuple[str, list[int]]],
                          max_new: int) -> dict[str, dict]:
    """{prompt id: {"text": prompt + greedy continuation, "prompt_tokens": n, "accept": [drafts the text accepts
    from a round anchored at each position n .. n + max_new - 2]}} (eager float32 references, CPU)."""
    import torch

    from mg.export.artifact import load_target
    from mg.export.draft_lower import load_draft
    from mg.export.draft_model import DFlashDraft
    from mg.export.model import MuseGlimmer
    from mg.export.weights import materialize

    import train_tiny as tt
    target_src = load_target(target_dir, None)
    draft_src = load_draft(draft_dir, None, target_src.cfg)
    target = materialize(target_src.weights, MuseGlimmer(target_src.cfg)).float().eval()
    draft = materialize(draft_src.weights, DFlashDraft(draft_src.cfg, target_src.cfg)).float().eval()
    out = {}
    with torch.no_grad():
        for i, (rel, ids) in enumerate(prompts):
            seq = tt.greedy_extend(target, torch.tensor([ids]), max_new)
            anchors = torch.arange(len(ids), seq.shape[1] - 1)[None]
            drafted = tt.draft_proposals(target, draft, seq, anchors)[0]
            text, last = seq[0], seq.shape[1] - 1
            accept = []
            for j, p in enumerate(range(len(ids), last)):
                avail = min(drafted.shape[1], last - p - 1)  # as the engine: no draft past the text's end
                accept.append(int((drafted[j, :avail] == text[p + 1:p + 1 + avail]).int().cumprod(0).sum()))
            out[rel] = {"text": text.tolist(), "prompt_tokens": len(ids), "accept": accept}
            print(f"  acceptance per position: {i + 1}/{len(prompts)} {rel}", file=sys.stderr)
    return out


def replay_batch(spec, prompts: list[dict], max_new: int, host: dict[str, float]) -> dict:
    """`prompts` ({"text", "prompt_tokens", "accept"} each) served together, one slot each from 0, all admitted at
    once (prompt processing left out; one prompt: served alone): every step the choice for all sequences still
    decoding, the drafts their texts accept, and the step's time from the tables (`forward` at its rows,
    `draft_block` at the drafting sequences and `draft_append` of their rows committed since they last drafted,
    plus the host time of its kind); a finished sequence leaves the batch. A shadow probe (`RunConfig.probes`)
    adds `draft_block` at the probing sequences and `draft_append` of their waiting rows to its step, and its
    drafts are the text's: as many right as a round anchored there accepts, then a wrong one. Target-only runs
    the same sequences in lockstep. -> both times, the speed-up, the rounds, their acceptance length, the
    chosen-k histogram and the shadow probes."""
    import torch

    from mg.runtime.scheduler import Request, Sequence

    c = spec.costs
    width = spec.block - 1

    def text_drafts(shadowing: list) -> "torch.Tensor":
        rows = []
        for s in shadowing:
            o, anchor = prompts[s.slot], len(s.tokens) - 1
            j = anchor - o["prompt_tokens"]
            right = o["accept"][j] if 0 <= j < len(o["accept"]) else 0
            ahead = o["text"][anchor + 1:anchor + 1 + width]
            rows.append([t if i < right else -1 for i, t in enumerate(ahead)] + [-1] * (width - len(ahead)))
        return torch.tensor(rows, dtype=torch.long)

    spec._shadow_drafts = text_drafts
    shadows_before = spec.stats.shadow_probes
    seqs, waiting = [], []
    for slot, o in enumerate(prompts):
        n = o["prompt_tokens"]
        seqs.append(Sequence(Request(f"replay-{slot}", tuple(o["text"][:n]), max_new), slot, list(o["text"][:n + 1]),
                             n_cached=n))  # the prefill made one token
        waiting.append(n)
        spec.release(slot)  # a fresh sequence in this slot: its estimates and probe clock start over
    seconds, rounds, accepted, hist = 0.0, 0, 0, []
    while True:
        decode = [i for i, s in enumerate(seqs) if s.n_generated < max_new]
        if not decode:
            break
        ks = spec.choose([seqs[i] for i in decode], spec.runner.cache.max_write)
        queued = {id(s) for s in spec.shadow_queue}
        shadowing = [i for i in decode if id(seqs[i]) in queued]
        drafting = [i for i, k in zip(decode, ks) if k]
        rows = len(decode) + sum(ks)
        calls = c.forward(rows) + (c.draft(len(drafting)) if drafting else 0.0)
        kind_host = host["drafting"] if drafting else host["plain"]
        seconds += calls + kind_host + (c.append(sum(waiting[i] for i in drafting)) if drafting else 0.0)
        for i, k in zip(decode, ks):
            s, o = seqs[i], prompts[i]
            a = min(k, o["accept"][s.n_cached - o["prompt_tokens"]])
            spec.observe(s, k, a)
            s.tokens.extend(o["text"][len(s.tokens):len(s.tokens) + 1 + a])
            s.n_cached += 1 + a
            waiting[i] = 1 + a if k else waiting[i] + 1
            rounds, accepted = rounds + bool(k), accepted + a
            hist.extend([0] * (k + 1 - len(hist)))
            hist[k] += 1
        if shadowing:  # launched at the step's end, after its rows wait: they are appended first
            seconds += c.draft(len(shadowing)) + c.append(sum(waiting[i] for i in shadowing))
            for i in shadowing:
                waiting[i] = 0
        spec.end_commits()  # shadow probes launch, and those whose tokens are known are judged
        spec.step_done(calls + kind_host, rows)  # the choice prices appends itself; timed apart above
        for i in decode:
            if seqs[i].n_generated >= max_new:
                spec.release(seqs[i].slot)
    target_only = (max_new - 1) * (c.forward(len(prompts)) + host["target_only"])
    return {"dflash_s": seconds, "target_only_s": target_only, "speedup": target_only / seconds, "rounds": rounds,
            "acceptance_length": (accepted + rounds) / rounds if rounds else 0.0, "chosen_k_hist": hist,
            "shadow_probes": spec.stats.shadow_probes - shadows_before}


def read_tables(p: argparse.ArgumentParser, path: Path) -> dict[str, dict[int, float]]:
    """The cost tables an earlier `--out` recorded (seconds at 1/2/4/8/16 rows or drafting sequences), or the
    parser's error in one line (exit 2) naming the file and what is wrong."""
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))["tables"]
        return {name: {int(n): float(t) for n, t in recorded[name].items()} for name in ("forward", "draft", "append")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        p.error(f"--tables {path}: no cost tables ({type(exc).__name__}: {exc}); allowed: the JSON of an earlier "
                f"--out")


def replay(spec, oracle: dict[str, dict], order: list[str], max_new: int, host: dict[str, float],
           passes: int) -> dict[str, dict]:
    """Every prompt of `order`, `passes` times in one speculator (slot 0, one at a time); -> the last pass's
    result per prompt."""
    out = {}
    for _ in range(passes):
        for rel in order:
            out[rel] = replay_batch(spec, [oracle[rel]], max_new, host)
    return out


def fresh_estimates(spec, prior: float | None, strength: float | None, decay: float | None) -> None:
    """New acceptance estimates (global ones of their own, not shared with other engines) and probe clocks."""
    from mg.runtime.speculative import AcceptanceModel, ProbeSchedule

    kwargs = {k: v for k, v in (("prior", prior), ("strength", strength), ("decay", decay)) if v is not None}
    n_slots = spec.runner.cache.n_slots
    spec.acceptance = AcceptanceModel(n_slots, spec.block - 1, **kwargs)
    spec.probes = ProbeSchedule(n_slots)
    spec._kept = None


def summary(results: dict[str, dict]) -> dict:
    s = [r["speedup"] for r in results.values()]
    return {"median": statistics.median(s), "min": min(s), "geomean": math.exp(statistics.mean(map(math.log, s))),
            "total": sum(r["target_only_s"] for r in results.values()) / sum(r["dflash_s"] for r in results.values()),
            "rounds": sum(r["rounds"] for r in results.values()),
            "shadow_probes": sum(r["shadow_probes"] for r in results.values())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None, help="target checkpoint [default: embedded default]")
    p.add_argument("--draft-checkpoint", type=Path, default=None)
    p.add_argument("--prompts", type=Path, default=ROOT / "tests" / "data" / "heldout_prompts.jsonl")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--passes", type=int, default=2, help="passes over the prompts per order; the last is reported")
    p.add_argument("--orders", type=int, default=1, help="orders of the prompts (the first: the file's)")
    p.add_argument("--batch", type=int, default=8,
                   help="also serve the prompts in batches of this many at once, in each order's order (at most the "
                        "export's 8 sequences; 0: single prompts only) [default: 8]")
    p.add_argument("--host-us", default="30,38,50",
                   help="host microseconds of a target-only step, a DFlash plain step and a step with drafts "
                        "(scripts/bench_host_step.py on a 2-core CPU: about 30, 38 and 41-50) [default: 30,38,50]")
    p.add_argument("--prior", type=float, default=None, help="AcceptanceModel prior [default: the runtime's]")
    p.add_argument("--strength", type=float, default=None, help="AcceptanceModel strength [default: the runtime's]")
    p.add_argument("--decay", type=float, default=None, help="AcceptanceModel decay [default: the runtime's]")
    p.add_argument("--probe-budget", type=float, default=None, help="PROBE_BUDGET [default: the runtime's]")
    p.add_argument("--probes", default=PROBES_ROUND, choices=PROBE_KINDS,
                   help=f"RunConfig.probes: how a sequence kept at plain steps probes [default: the runtime's, "
                        f"{PROBES_ROUND}]")
    p.add_argument("--oracle", type=Path, default=None,
                   help="read the acceptance per position from this JSON (written by an earlier --out) instead of "
                        "computing it")
    p.add_argument("--tables", type=Path, default=None,
                   help="read the cost tables from this JSON (written by an earlier --out) instead of measuring "
                        "this machine's: the same tables give the same numbers on any machine, under any load")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    try:
        host_us = [float(x) for x in args.host_us.split(",")]
    except ValueError:
        host_us = []
    if len(host_us) != 3 or min(host_us) < 0:
        p.error(f"--host-us is {args.host_us!r}; allowed: three numbers >= 0 (target-only, plain, drafting)")
    if args.max_new_tokens < 2 or args.passes < 1 or args.orders < 1:
        p.error(f"--max-new-tokens {args.max_new_tokens}, --passes {args.passes}, --orders {args.orders}; allowed: "
                f"--max-new-tokens >= 2, --passes >= 1, --orders >= 1")
    if not 0 <= args.batch <= 8:
        p.error(f"--batch is {args.batch}; allowed: an integer in [0, 8] (the sequences the export serves at once)")
    if args.probe_budget is not None and not args.probe_budget > 0:
        p.error(f"--probe-budget is {args.probe_budget}; allowed: a number > 0")
    host = dict(zip(("target_only", "plain", "drafting"), (h * 1e-6 for h in host_us)))
    given_tables = read_tables(p, args.tables) if args.tables is not None else None

    from mg.kernels.quiet import quiet_dependencies

    quiet_dependencies()
    import eval_dflash
    from mg.export.artifact import default_checkpoints
    from mg.runtime import speculative
    from mg.runtime.artifact import load_artifact
    from mg.runtime.config import RunConfig
    from mg.runtime.engine import Engine
    from mg.runtime.tokenizer import TextCodec

    if args.checkpoint is None:
        args.checkpoint, args.draft_checkpoint = default_checkpoints()
    if args.probe_budget is not None:
        speculative.PROBE_BUDGET = args.probe_budget  # read by the speculator at every choice
    rows = [json.loads(line) for line in args.prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
    tmp = tempfile.TemporaryDirectory()  # the export lives as long as the engine reading it
    artifact = load_artifact(eval_dflash._export(args.checkpoint, args.draft_checkpoint, "sequence",
                                                 Path(tmp.name) / "sequence", 1024))
    engine = Engine(artifact, RunConfig(speculation="adaptive", probes=args.probes))  # measures (or reads) the cost tables
    spec = engine.spec
    spec.runner.call_log = None  # no timed calls: the tables stay as measured
    if given_tables is not None:
        spec.costs = speculative.CostModel(given_tables["forward"], given_tables["draft"], given_tables["append"],
                                           padded=spec.costs.padded)
    c = spec.costs
    if args.oracle is not None:
        oracle = json.loads(args.oracle.read_text(encoding="utf-8"))["oracle"]
    else:
        codec = TextCodec(artifact.tokenizer_path, artifact.manifest.model.bos_id)
        prompts = [(r["id"], codec.encode(r["prompt"])) for r in rows]
        oracle = accepted_per_position(args.checkpoint, args.draft_checkpoint, prompts, args.max_new_tokens)
    order0 = [r["id"] for r in rows]
    runs = []
    for i in range(args.orders):
        order = list(order0)
        if i:
            random.Random(i).shuffle(order)
        fresh_estimates(spec, args.prior, args.strength, args.decay)
        results = replay(spec, oracle, order, args.max_new_tokens, host, args.passes)
        run = {"order": order, "summary": summary(results), "per_prompt": results}
        if args.batch:
            batches = [replay_batch(spec, [oracle[rel] for rel in order[j:j + args.batch]], args.max_new_tokens, host)
                       for j in range(0, len(order), args.batch)]
            run["batches"] = batches
            run["summary"]["batched"] = sum(b["target_only_s"] for b in batches) / sum(b["dflash_s"] for b in batches)
        runs.append(run)
    tables = {name: {n: c.forward(n) if name == "forward" else c.draft(n) if name == "draft" else c.append(n)
                     for n in (1, 2, 4, 8, 16)} for name in ("forward", "draft", "append")}
    first = runs[0]
    lines = ["| prompt | target-only ms | DFlash ms | speed-up | rounds | acceptance length |", "|---|---|---|---|---|---|"]
    for rel in order0:
        r = first["per_prompt"][rel]
        lines.append(f"| {rel} | {r['target_only_s'] * 1e3:.1f} | {r['dflash_s'] * 1e3:.1f} | {r['speedup']:.2f}x | "
                     f"{r['rounds']} | {r['acceptance_length']:.2f} |")
    agg = {k: [run["summary"][k] for run in runs] for k in ("median", "min", "geomean", "total", "batched")
           if k in runs[0]["summary"]}
    lines.append("")
    lines.append(f"single-prompt speed-up over {args.orders} order(s): median {statistics.mean(agg['median']):.3f}x, "
                 f"min {statistics.mean(agg['min']):.3f}x (worst order {min(agg['min']):.3f}x), geometric mean "
                 f"{statistics.mean(agg['geomean']):.3f}x, total time {statistics.mean(agg['total']):.3f}x")
    if "batched" in agg:
        lines.append(f"batches of {args.batch}: speed-up {statistics.mean(agg['batched']):.3f}x (worst "
                     f"order {min(agg['batched']):.3f}x)")
    lines.append("cost tables (ms, at 1/2/4/8/16): " + "; ".join(
        f"{name} " + "/".join(f"{t * 1e3:.2f}" for t in table.values()) for name, table in tables.items()))
    print("\n".join(lines))
    settings = {"prior": args.prior, "strength": args.strength, "decay": args.decay, "batch": args.batch,
                "probe_budget": speculative.PROBE_BUDGET, "host_us": host_us, "passes": args.passes,
                "max_new_tokens": args.max_new_tokens, "probes": args.probes}
    args.out.write_text(json.dumps({"settings": settings, "tables": tables, "aggregate": agg, "runs": runs,
                                    "oracle": oracle}) + "\n")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
