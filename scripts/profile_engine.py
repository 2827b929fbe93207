"""Where an engine step's time goes: per-step time, graph captures and host synchronisations, per mode.

Runs the engine on held-out prompts (the first N at once for each N of `--batches`; with `--alone` also every
prompt alone, one after another on one engine) with DFlash off (`plain`), as a
DFlash engine that never drafts (`no-drafts`: DFlash's bookkeeping alone), with fixed blocks and with
adaptive speculation, on one artifact (default: the embedded default, exported into a
temporary folder); `--fused-rounds on` runs fused DFlash rounds on the CPU too, so that the choice takes the
path it takes on a GPU. A mode may carry how its methods run: `plain:compiled`, `adaptive:interpreted`, ...
(`RunConfig.compile`; without a suffix, the device's default: compiled on CUDA, interpreted on the CPU), so
that `--modes plain,plain:compiled,plain,plain:compiled` compares the two in turns in one process. For each
mode and batch it reports steps, milliseconds per step, tokens per second, CUDA
graph captures during the timed run (a capture mid-run means storage moved) and the chosen-k histogram;
`--appends` adds the host time of the timed runs' context appends (committed hidden rows into the draft cache)
and of their parts, median milliseconds per append; `--speculator` the host time of the speculator's calls in
the steps (the choice, reservations, commits, accounting), by part. `--by-kind` adds where the timed run's steps went: count, milliseconds and the longest step by kind (steps with
prompt chunks, without and with drafts; plain decode steps; steps that draft; steps that only read back a step in
flight), each step timed on the host around `Engine.step` (with overlapped steps a step's time includes the wait
for the step before it). On
CUDA it also counts the synchronising calls of one single-prompt run per mode by call site
(`torch.cuda.set_sync_debug_mode("warn")`). `--profile DIR` writes a cProfile listing per mode (single
prompt; by cumulative and by own time) and the raw statistics (`profile_<mode>.prof`, for `pstats`; a
mode's colon becomes a dash). Engines are built and warmed up (graphs captured, costs measured) before their clock starts, as in
`eval_dflash.py`. Prints Markdown; `--out` writes JSON.

    python3 scripts/profile_engine.py --device cuda --out profile.json --profile prof/
    python scripts/profile_engine.py out/default --modes plain,adaptive --batches 1,20
    python scripts/profile_engine.py --modes plain,plain:compiled,plain,plain:compiled --batches 8 --alone
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Optional

from script_common import add_artifact_args, artifact_dir, auto_on_off, int_list

ROOT = Path(__file__).resolve().parent.parent
MODES = ("plain", "no-drafts", "fixed", "adaptive")
EXECUTIONS = {"compiled": True, "interpreted": False}  # a mode's optional suffix: RunConfig.compile


def _parse_mode(mode: str) -> Optional[tuple[str, Optional[bool]]]:
    """"adaptive" -> ("adaptive", None); "plain:compiled" -> ("plain", True); None for a name it does not know."""
    name, colon, how = mode.partition(":")
    if name not in MODES or (colon and how not in EXECUTIONS):
        return None
    return name, EXECUTIONS[how] if colon else None



def _config(mode: str, device: str, fused: str = "auto"):
    from mg.runtime.config import RunConfig

    name, compile_methods = _parse_mode(mode)
    speculation = {"plain": "fixed", "no-drafts": "adaptive"}.get(name, name)
    return RunConfig(device=device, dflash=name != "plain", speculation=speculation,
                     fused_rounds=auto_on_off(fused), compile=compile_methods)


def _never_draft(engine) -> None:
    """`no-drafts`: an adaptive DFlash engine whose every step is plain (its speculator's choice forced to
    k = 0): what DFlash's bookkeeping costs a step on its own, against `plain` (target-only): commits of
    hidden rows to the draft context, context flushes, observations and step accounting, not the choice."""
    spec = engine.spec
    spec.choose = lambda decode, rows_left, prefill=False: [0] * len(decode)
    spec.fuses = lambda batch: False


KINDS = ("prompt", "prompt+drafts", "plain", "drafts", "read-back")


class _StepKinds:
    """Times every `Engine.step` of one engine and sorts it by what it scheduled: a step with prompt chunks and
    no drafts (`prompt`) or with drafts (`prompt+drafts`), decode rows only without drafts (`plain`), with drafts
    (`drafts`, fused or not), or no schedule at all (`read-back`: the step read back a step in flight that ended
    every sequence)."""

    def __init__(self, engine) -> None:
        self.count = dict.fromkeys(KINDS, 0)
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.longest = dict.fromkeys(KINDS, 0.0)
        self._batch = None
        schedule, step = engine.scheduler.schedule, engine.step

        def scheduled(*args, **kwargs):
            self._batch = schedule(*args, **kwargs)
            return self._batch

        def timed_step():
            self._batch = None
            t0 = time.perf_counter()
            step()
            dt = time.perf_counter() - t0
            b = self._batch
            drafts = b is not None and any(b.n_drafts)
            kind = ("read-back" if b is None else ("prompt+drafts" if drafts else "prompt") if b.prefill else
                    "drafts" if drafts else "plain")
            self.count[kind] += 1
            self.seconds[kind] += dt
            self.longest[kind] = max(self.longest[kind], dt)

        engine.scheduler.schedule = scheduled
        engine.step = timed_step

    def as_dict(self) -> dict:
        return {k: {"steps": self.count[k], "ms": 1e3 * self.seconds[k], "longest_ms": 1e3 * self.longest[k]}
                for k in KINDS}


APPEND_PARTS = ("append", "take", "admit", "calls")


class _AppendTimes:
    """Host time of every context append of one DFlash engine (`Speculator._append_rows`: committed hidden rows
    into the draft cache) and of its parts: the waiting rows taken (`WaitingRows.take`), their admission to
    the draft cache (`declare_step` / `declare_spans`) and the runner's `draft_append` calls (padding,
    admission, copies, graph replay or eager run), with the rows each append carried. Wall time on the host:
    on a GPU the calls' kernels run after it."""

    def __init__(self, engine) -> None:
        self.seconds = {part: [] for part in APPEND_PARTS}
        self.rows: list[int] = []
        spec, runner = engine.spec, engine.runner
        inside = [False]

        def timed(part, fn, only_inside=True):
            def run(*args, **kwargs):
                if only_inside and not inside[0]:
                    return fn(*args, **kwargs)
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds[part].append(time.perf_counter() - t0)
            return run

        append_rows = spec._append_rows

        def append(slots):
            rows = sum(spec._waiting.count[slot] for slot in slots)
            inside[0] = rows > 0
            try:
                return timed("append", append_rows)(slots) if rows else append_rows(slots)
            finally:
                if rows:
                    self.rows.append(rows)
                inside[0] = False

        spec._append_rows = append
        spec._waiting.take = timed("take", spec._waiting.take)
        cache = runner.draft_cache
        for name in ("declare_step", "declare_spans"):
            setattr(cache, name, timed("admit", getattr(cache, name)))
        runner.call = timed("calls", runner.call)

    def as_dict(self) -> dict:
        med = lambda v: 1e3 * statistics.median(v) if v else None  # noqa: E731
        out = {"appends": len(self.rows), "rows_median": statistics.median(self.rows) if self.rows else None}
        out.update({f"{part}_ms_median": med(v) for part, v in self.seconds.items()})
        out["calls_per_append"] = len(self.seconds["calls"]) / len(self.rows) if self.rows else None
        return out


SPEC_PARTS = ("choose", "choose (prompt step)", "reserve_known", "reserve_known (prompt step)", "commit",
              "end_commits", "step_done", "step_done (prompt step)")


class _SpecTimes:
    """Host time of the speculator's calls in the engine's steps, by part (`--speculator`): the choice of drafts,
    the reservation of the rows the forward writes, the commits after acceptance, the end of a step's commits
    and the step's accounting; a call in a step with prompt chunks counts apart."""

    def __init__(self, engine) -> None:
        self.seconds = {part: [] for part in SPEC_PARTS}
        spec = engine.spec
        prefill = lambda a, k: k.get("prefill", a[2] if len(a) > 2 else False)  # noqa: E731  (choose, step_done)
        prompt_step = {"choose": prefill, "reserve_known": lambda a, k: bool(a[2]), "step_done": prefill}

        def timed(name):
            fn, prompt = getattr(spec, name), prompt_step.get(name)

            def run(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    part = f"{name} (prompt step)" if prompt is not None and prompt(args, kwargs) else name
                    self.seconds[part].append(time.perf_counter() - t0)
            return run

        for name in ("choose", "reserve_known", "commit", "end_commits", "step_done"):
            setattr(spec, name, timed(name))

    def as_dict(self) -> dict:
        return {part: {"calls": len(v), "total_ms": 1e3 * sum(v),
                       "median_us": 1e6 * statistics.median(v) if v else None} for part, v in self.seconds.items()}


def _timed(engine, reqs) -> float:
    import torch

    cuda = engine.runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.run(reqs)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _runs(reqs: list, n) -> list[list]:
    """The timed runs of a row: the first n requests at once, or (n = "alone") each request alone in turn."""
    return [[r] for r in reqs] if n == "alone" else [reqs[:n]]


def _engine(artifact, mode: str, device: str, fused: str = "auto"):
    from mg.runtime.engine import Engine

    engine = Engine(artifact, _config(mode, device, fused))
    if _parse_mode(mode)[0] == "no-drafts":
        _never_draft(engine)
    engine.warm_up()
    return engine


def _sync_sites(artifact, mode: str, device: str, reqs, fused: str = "auto") -> dict[str, int]:
    """Synchronising calls of one run by the last three frames of this project's code that made them."""
    import torch

    engine, sites = _engine(artifact, mode, device, fused), collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/mg/" in f.filename or "/runtime/" in f.filename]
        sites[" < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-3:]) or filename] += 1

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.run(reqs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
    return dict(sites.most_common())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_artifact_args(p)
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, run in order: {', '.join(MODES)}, each optionally with :compiled or "
                        ":interpreted (a mode named twice runs a second engine of it in the same process, after the "
                        "others before it)")
    p.add_argument("--batches", default="1,8,20", help="prompts served at once (the first N held-out prompts)")
    p.add_argument("--alone", action="store_true",
                   help="also serve every prompt alone, one after another on one engine per mode (as eval_dflash.py's "
                        "single prompts); its row's prompts column says 'alone'")
    p.add_argument("--fused-rounds", choices=("auto", "on", "off"), default="auto",
                   help="fused DFlash rounds: auto (on where CUDA graphs are: the GPU), on (also on the CPU, to see "
                        "the GPU's choice path there) or off")
    p.add_argument("--prompts", type=Path, default=ROOT / "tests" / "data" / "heldout_prompts.jsonl")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--profile", type=Path, default=None, help="folder for a cProfile listing per mode")
    p.add_argument("--by-kind", action="store_true",
                   help="also time every step of the timed runs and report steps and milliseconds by kind")
    p.add_argument("--appends", action="store_true",
                   help="also time every context append of the timed DFlash runs on the host, and its parts: rows "
                        "taken, admission, the draft_append calls (median milliseconds per append)")
    p.add_argument("--speculator", action="store_true",
                   help="also time the speculator's calls in the timed DFlash runs' steps on the host, by part: "
                        "calls, total milliseconds and median microseconds")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    modes = args.modes.split(",")
    if any(_parse_mode(m) is None for m in modes):
        p.error(f"--modes is {args.modes!r}; allowed: comma-separated names among {', '.join(MODES)}, each "
                f"optionally with :{' or :'.join(EXECUTIONS)}")
    batches = int_list(p, "--batches", args.batches)

    sys.path.insert(0, str(ROOT / "scripts"))
    import eval_dflash

    from mg.kernels.quiet import quiet_dependencies

    quiet_dependencies()
    with tempfile.TemporaryDirectory() as tmp:
        art_dir = artifact_dir(args.artifact, args.layout, tmp)
        from mg.runtime.artifact import load_artifact

        reqs = eval_dflash._requests(args.prompts, art_dir, args.max_new_tokens)
        if max(batches) > len(reqs):
            p.error(f"--batches asks for {max(batches)} prompts; {args.prompts} holds {len(reqs)}")
        artifact = load_artifact(art_dir, device=args.device)
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
        rows, sites = [], {}
        for mode in modes:
            for n in batches + (["alone"] if args.alone else []):
                engine = _engine(artifact, mode, args.device, args.fused_rounds)
                kinds = _StepKinds(engine) if args.by_kind else None
                appends = _AppendTimes(engine) if args.appends and engine.spec is not None else None
                spec_times = _SpecTimes(engine) if args.speculator and engine.spec is not None else None
                captures = engine.graph_counters.captures
                seconds = sum(_timed(engine, run) for run in _runs(reqs, n))
                tokens, stats = engine.stats.generated_tokens, engine.spec_stats
                rows.append({"mode": mode, "prompts": n, "steps": engine.stats.steps, "tokens": tokens,
                             "ms_per_step": 1e3 * seconds / engine.stats.steps, "tokens_per_s": tokens / seconds,
                             "captures_during_run": engine.graph_counters.captures - captures,
                             "chosen_k_hist": list(stats.chosen_k_hist),
                             "wall_ms": 1e3 * seconds})
                if kinds is not None:
                    rows[-1]["by_kind"] = kinds.as_dict()
                if appends is not None:
                    rows[-1]["appends"] = appends.as_dict()
                if spec_times is not None:
                    rows[-1]["speculator"] = spec_times.as_dict()
                r = rows[-1]
                print(f"{mode} x{n}: {r['ms_per_step']:.3f} ms/step, {r['tokens_per_s']:.1f} tok/s, "
                      f"{r['captures_during_run']} captures", file=sys.stderr)
            if args.profile is not None:
                engine, prof = _engine(artifact, mode, args.device, args.fused_rounds), cProfile.Profile()
                prof.enable()
                _timed(engine, reqs[:1])
                prof.disable()
                text = io.StringIO()
                listing = pstats.Stats(prof, stream=text)
                listing.sort_stats("cumulative").print_stats(50)
                listing.sort_stats("tottime").print_stats(40)
                stem = f"profile_{mode.replace(':', '-')}"
                (args.profile / f"{stem}.txt").write_text(text.getvalue())
                prof.dump_stats(args.profile / f"{stem}.prof")
            if args.device == "cuda":
                sites[mode] = _sync_sites(artifact, mode, args.device, reqs[:1], args.fused_rounds)

    lines = ["| mode | prompts | steps | ms/step | tok/s | graph captures in the run | chosen k: k = 0 / k > 0 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        h = r["chosen_k_hist"]
        ks = f"{h[0]} / {sum(h[1:])}" if h else "-"
        lines.append(f"| {r['mode']} | {r['prompts']} | {r['steps']} | {r['ms_per_step']:.3f} | "
                     f"{r['tokens_per_s']:.1f} | {r['captures_during_run']} | {ks} |")
    print("\n".join(lines))
    if args.by_kind:
        print("\n| mode | prompts | wall ms | " + " | ".join(f"{k}: steps, ms (longest)" for k in KINDS) + " |")
        print("|---|---|---|" + "---|" * len(KINDS))
        for r in rows:
            cells = [f"{v['steps']}, {v['ms']:.2f} ({v['longest_ms']:.2f})" for v in map(r["by_kind"].get, KINDS)]
            print(f"| {r['mode']} | {r['prompts']} | {r['wall_ms']:.2f} | " + " | ".join(cells) + " |")
    if args.appends:
        print("\n| mode | prompts | appends | rows (median) | append ms | take ms | admission ms | calls ms | calls per append |")
        print("|---|---|---|---|---|---|---|---|---|")
        fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        for r in rows:
            a = r.get("appends")
            if a:
                print(f"| {r['mode']} | {r['prompts']} | {a['appends']} | {fmt(a['rows_median'])} | "
                      + " | ".join(fmt(a[f"{part}_ms_median"]) for part in APPEND_PARTS)
                      + f" | {fmt(a['calls_per_append'])} |")
    if args.speculator:
        print("\n| mode | prompts | " + " | ".join(f"{part}: calls, ms, median us" for part in SPEC_PARTS) + " |")
        print("|---|---|" + "---|" * len(SPEC_PARTS))
        for r in rows:
            t = r.get("speculator")
            if t:
                cells = [f"{v['calls']}, {v['total_ms']:.2f}, " + ("-" if v["median_us"] is None else f"{v['median_us']:.1f}")
                         for v in map(t.get, SPEC_PARTS)]
                print(f"| {r['mode']} | {r['prompts']} | " + " | ".join(cells) + " |")
    for mode, found in sites.items():
        print(f"\nsynchronising calls, {mode}, one prompt: {sum(found.values())}")
        for where, count in found.items():
            print(f"  {count:5d}  {where}")
    if args.out is not None:
        args.out.write_text(json.dumps({"device": args.device, "artifact": str(art_dir), "runs": rows,
                                        "sync_sites": sites}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
