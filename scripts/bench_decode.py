"""Decode benchmarks of `mg-run`'s engine on CUDA: step time per execution mode (`eager`: the interpreter op
by op; `graphs`: the interpreter under CUDA graphs; `compiled`: compiled fused methods under CUDA graphs, the
default on CUDA), the weight-bandwidth floor, the DFlash cost ratio (separate draft and verify calls, and a
whole round as one fused call), end-to-end tokens/s, and the two KV layouts. DFlash and end-to-end runs use the last of `--modes`.

A random-weight MG target (default: dim 2048, 8 layers, 16 heads, 2 KV heads, head_dim 128,
ffn 6144, vocab 32000, bf16, ~0.54B parameters; `--layers` changes the depth) with a random
DFlash drafter (DRAFT_PRESETS['medium'], taps moved inside the target) is exported once per
layout (in parallel processes), then served by `mg.runtime` engines. Prints Markdown tables;
`--out` writes the numbers as JSON. `--tiny` runs the tiny presets (a smoke test; works on CPU).

`--preset mg-30b --n-layers 16` benchmarks the first 16 layers of MG-30B at full width (~21 GB of
bf16 weights) with the mg-30b drafter preset: each layout is exported (streaming, in a child process
whose peak RSS is reported), benchmarked, and deleted before the next, so one artifact is on disk
at a time. The report adds export time, GB/s and peak RSS, load time, host RSS and device memory
after load, and the DFlash speed-up projected from the measured round cost at acceptance lengths
3.2 and 6.5 (speed-up = acceptance length / (round time / step time), the faster of the two rounds).

    python scripts/bench_decode.py --out bench_decode.json
    python scripts/bench_decode.py --preset mg-30b --n-layers 16 --out bench_real.json

Bench scripts may import mg.export (the runtime never does).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch

from proc_status import status_gb
from script_common import int_list

PROMPT = 64  # prompt tokens per request
BLOCK = 16  # DFlash block (the medium drafter's)
# Execution modes: RunConfig settings. `compiled` uses CUDA graphs where there is CUDA.
MODES = {"eager": dict(cuda_graphs=False, compile=False), "graphs": dict(cuda_graphs=True, compile=False),
         "compiled": dict(compile=True),
         # graphs, with bfloat16 int4 calls of 1-4 rows on torch's tensor-core kernel (RunConfig.int4_tensor_cores)
         "graphs-tc": dict(cuda_graphs=True, compile=False, int4_tensor_cores=True)}


def bench_config(layers: int, tiny: bool, preset: str | None = None):
    from mg.export.config import PRESETS, MuseGlimmerConfig
    from mg.export.draft_model import DRAFT_PRESETS

    if preset is not None:
        from mg.export.artifact import load_target
        from mg.export.draft_lower import load_draft

        target = load_target(None, preset, layers)
        return target.cfg, load_draft(None, preset, target.cfg).cfg
    if tiny:
        return PRESETS["tiny"], DRAFT_PRESETS["tiny"]
    cfg = MuseGlimmerConfig(dim=2048, n_layers=layers, n_heads=16, n_kv_heads=2, head_dim=128, ffn_dim=6144,
                            vocab_size=32000, sliding_window=512, dtype="bfloat16")
    taps = tuple(sorted({min(layers - 1, 1 + round(i * (layers - 2) / 4)) for i in range(5)}))
    return cfg, dataclasses.replace(DRAFT_PRESETS["medium"], target_layers=taps)


def export_one(out: str, layout: str, layers: int, tiny: bool, max_write: int, max_seqs: int,
               max_context: int, preset: str | None = None, threads: int = 0,
               weights: str = "float", group_size: int | None = None,
               quantize_head: bool = False) -> tuple[str, float, float]:
    """Export one layout (runs in its own process); -> (directory, seconds, peak RSS of the process in GB)."""
    import mg.kernels  # noqa: F401
    from mg.kernels.quiet import quiet_dependencies

    quiet_dependencies()
    from mg.export.artifact import PRESET_SEED, ExportOptions, TargetSource, export_artifact
    from mg.export.draft_lower import DraftSource
    from mg.export.weights import RandomWeights

    torch.set_num_threads(threads or max(1, torch.get_num_threads() // 2))
    t0 = time.perf_counter()
    cfg, dcfg = bench_config(layers, tiny, preset)
    target = TargetSource("bench", cfg, RandomWeights(PRESET_SEED), None)
    draft = DraftSource("bench-draft", dcfg, RandomWeights(PRESET_SEED))
    sizes = {"max_seqs": max_seqs} if layout == "sequence" else {"max_cells": max_seqs * max_context}
    opts = ExportOptions(output_dir=Path(out), layout=layout, max_context=max_context, max_write=max_write, force=True,
                         weights=weights, group_size=group_size, quantize_head=quantize_head, **sizes)
    export_artifact(opts, target, lambda msg: print(f"  [{layout}] {msg}", flush=True), draft)
    return out, time.perf_counter() - t0, rss_gb("VmHWM")


def step_weight_bytes(ptd: Path) -> int:
    """Bytes of the target's weights one decode step reads, as stored in `ptd` (quantized or not): every target
    tensor but the embedding table (a step gathers a few of its rows)."""
    from mg.runtime.data_file import DataFile

    f = DataFile(ptd)
    try:
        return sum(e.nbytes for k, e in f.entries.items()
                   if k.startswith("model.") and k != "model.tok_embeddings.weight")
    finally:
        f.close()


def rss_gb(field: str = "VmRSS") -> float:
    """This process's resident set now (VmRSS) or its peak since exec (VmHWM), in GB."""
    return status_gb(field)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * 10 / (time.perf_counter() - t0)


def timed(runner, name: str, device: str, log: list):
    """Wrap runner.<name> (a model-runner method) so each call is timed (synchronized) into `log`."""
    real = getattr(runner, name)

    def wrapper(*a, **kw):
        sync(device)
        t0 = time.perf_counter()
        out = real(*a, **kw)
        sync(device)
        log.append(time.perf_counter() - t0)
        return out

    setattr(runner, name, wrapper)


def requests(n: int, max_new: int, vocab: int, seed: int):
    from mg.runtime.scheduler import Request

    gen = torch.Generator().manual_seed(seed)
    return [Request(f"b{seed}-{i}", tuple(torch.randint(4, vocab, (PROMPT,), generator=gen).tolist()), max_new,
                    ignore_eos=True) for i in range(n)]


def steady_steps(engine, batch: int, warm: int, steps: int, device: str, vocab: int) -> dict:
    """Prefill `batch` sequences, run `warm` decode steps (captures), then time `steps` steps."""
    for r in requests(batch, warm + steps + 4 + BLOCK * (warm + steps + 4), vocab, batch):
        engine.submit(r)
    while any(s.in_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(warm):
        engine.step()
    fwd, draft = [], []
    timed(engine.runner, "forward", device, fwd)
    if engine.spec is not None:
        timed(engine.runner, "draft_block", device, draft)
    spec = engine.spec_stats
    rounds0, acc0, gen0 = spec.rounds, spec.accepted_tokens, engine.stats.generated_tokens
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    wall = time.perf_counter() - t0
    out = {"step_ms": 1e3 * wall / steps, "forward_ms": 1e3 * statistics.median(fwd) if fwd else None,
           "tokens_per_step": (engine.stats.generated_tokens - gen0) / steps}  # fused rounds call no `forward`
    if engine.spec is not None:
        rounds = spec.rounds - rounds0
        out.update(draft_ms=1e3 * statistics.median(draft) if draft else None,
                   acceptance_length=(spec.accepted_tokens - acc0 + rounds) / max(rounds, 1))
    return out


def end_to_end(make, batch: int, max_new: int, vocab: int) -> dict:
    """tokens/s of a whole run (prefill included) after a warm-up run that captured the graphs."""
    engine = make()
    engine.run(requests(batch, max_new, vocab, 1000 + batch))
    spec = engine.spec_stats
    gen0, wall0, r0, a0 = engine.stats.generated_tokens, engine.stats.wall_s, spec.rounds, spec.accepted_tokens
    k0 = list(spec.chosen_k_hist)
    engine.run(requests(batch, max_new, vocab, 2000 + batch))
    gen, wall = engine.stats.generated_tokens - gen0, engine.stats.wall_s - wall0
    rounds = spec.rounds - r0
    k_hist = [n - (k0[i] if i < len(k0) else 0) for i, n in enumerate(spec.chosen_k_hist)]
    return {"tokens_per_s": gen / wall, "generated": gen, "chosen_k_hist": k_hist,
            "acceptance_length": (spec.accepted_tokens - a0 + rounds) / rounds if rounds else None}


def bench_layout(path: str, layout: str, args, cfg, weight_bytes: int, bw: float, res: dict, save) -> dict:
    """Fills `res` measurement by measurement, calling `save()` after each (a run cut short keeps what it measured)."""
    from mg.runtime.artifact import load_artifact
    from mg.runtime.config import RunConfig
    from mg.runtime.engine import Engine

    dev = args.device
    rss0 = rss_gb()
    t0 = time.perf_counter()
    art = load_artifact(Path(path), device=dev)
    res.update(load_s=time.perf_counter() - t0, rss_before_load_gb=rss0, rss_after_load_gb=rss_gb(),
               peak_rss_gb=rss_gb("VmHWM"),
               device_gb=torch.cuda.memory_allocated() / 1e9 if dev == "cuda" else None,
               decode={}, dflash={}, e2e={},
               steps_per_call={m: art.program.info(m).n_steps for m in art.program.method_names
                               if art.program.info(m).n_inputs})  # ops the interpreter runs per call
    def fresh(mode: str, **kw):
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
        return Engine(art, RunConfig(device=dev, **MODES[mode], **kw))

    t0 = time.perf_counter()
    for mode in args.modes:  # compile (or load compiled code) once, outside every timing
        fresh(mode, dflash=True)
        res.setdefault("setup_s", {})[mode] = time.perf_counter() - t0
        t0 = time.perf_counter()
    for b in args.batches:
        for mode in args.modes:
            steps = args.steps if mode != "eager" else max(3, args.steps // 4)
            r = steady_steps(fresh(mode, dflash=False), b, 3, steps, dev, cfg.vocab_size)
            res["decode"][f"{b}/{mode}"] = r
            save()
            print(f"  [{layout}] decode batch {b} {mode:8s}: {r['step_ms']:.2f} ms/step "
                  f"(forward {r['forward_ms']:.2f} ms; floor {1e3 * weight_bytes / bw:.2f} ms)", flush=True)
    mode = args.modes[-1]
    for b in args.dflash_batches:  # separate calls (c from their forward times), then fused rounds
        r = steady_steps(fresh(mode, speculation="fixed", fused_rounds=False), b, 3, args.steps, dev, cfg.vocab_size)
        decode = res["decode"].get(f"{b}/{mode}") or steady_steps(
            fresh(mode, dflash=False), b, 3, args.steps, dev, cfg.vocab_size)
        res["decode"][f"{b}/{mode}"] = decode
        r["c"] = (r["draft_ms"] + r["forward_ms"]) / decode["forward_ms"]
        r["c_step"] = r["step_ms"] / decode["step_ms"]
        engine = fresh(mode, speculation="fixed", fused_rounds=True)  # graph replays on CUDA, eager elsewhere
        if engine.spec.fused is not None and b <= engine.spec.fused.limit:
            fused = steady_steps(engine, b, 3, args.steps, dev, cfg.vocab_size)
            r.update(fused_round_ms=fused["step_ms"], c_fused=fused["step_ms"] / decode["step_ms"])
        best = min(r["c_step"], r.get("c_fused", float("inf")))
        r["projected_speedup"] = {str(tau): tau / best for tau in (3.2, 6.5)}
        res["dflash"][str(b)] = r
        save()
        fused_note = (f"; fused round {r['fused_round_ms']:.2f} ms = {r['c_fused']:.2f} steps" if "c_fused" in r
                      else "; no fused round holds this batch")
        print(f"  [{layout}] DFlash batch {b}: draft {r['draft_ms']:.2f} ms + verify {r['forward_ms']:.2f} ms vs "
              f"decode {decode['forward_ms']:.2f} ms -> c = {r['c']:.2f} (whole round / whole step "
              f"{r['c_step']:.2f}{fused_note}); acceptance length {r['acceptance_length']:.2f}", flush=True)
    for b in args.e2e_batches:
        ar = end_to_end(lambda: fresh(mode, dflash=False), b, args.max_new, cfg.vocab_size)
        df = end_to_end(lambda: fresh(mode, speculation="fixed"), b, args.max_new, cfg.vocab_size)
        ad = end_to_end(lambda: fresh(mode), b, args.max_new, cfg.vocab_size)
        res["e2e"][str(b)] = {"ar": ar, "dflash": df, "adaptive": ad}
        save()
        print(f"  [{layout}] end-to-end batch {b}: AR {ar['tokens_per_s']:.1f} tok/s, DFlash fixed "
              f"{df['tokens_per_s']:.1f} tok/s (acceptance length {df['acceptance_length']:.2f}), adaptive "
              f"{ad['tokens_per_s']:.1f} tok/s (chosen k {ad['chosen_k_hist']})", flush=True)
    del art
    return res


def tables(report: dict) -> str:
    lines = [f"Target: {report['config']}, {report.get('weights', 'float')} weights; {report['params'] / 1e9:.3f}B "
             f"parameters ({report['weight_gb']:.2f} GB read per step); drafter: {report['draft_config']}. Copy bandwidth {report['copy_gbps']:.0f} GB/s "
             f"-> weight-bandwidth floor {report['floor_ms']:.2f} ms/step. Device: {report['device']}.", ""]
    if report.get("ptd_gb"):
        lines += ["| layout | export s | export GB/s (model.ptd) | export peak RSS GB | load s | host RSS after load GB "
                  "| peak RSS GB | device GB after load |", "|---|---|---|---|---|---|---|---|"]
        for layout, res in report["layouts"].items():
            sec = report["export_s"].get(layout, float("nan"))
            lines.append(f"| {layout} | {sec:.0f} | {report['ptd_gb'] / sec:.2f} | "
                         f"{report['export_peak_rss_gb'].get(layout, float('nan')):.2f} | {res['load_s']:.1f} | "
                         f"{res['rss_after_load_gb']:.2f} | {res['peak_rss_gb']:.2f} | {res['device_gb'] or 0:.2f} |")
        lines.append("")
    modes, best = report["modes"], report["modes"][-1]
    lines += [f"Setup per mode (engine start; compiling or loading compiled code for `compiled`): " + "; ".join(
        f"{layout}: " + ", ".join(f"{m} {s:.1f} s" for m, s in res.get("setup_s", {}).items())
        for layout, res in report["layouts"].items()), "",
        "| layout | batch | " + " | ".join(f"{m} ms/step" for m in modes) + f" | {best} forward ms | {best} / floor "
        "| floor ms |", "|---|---|" + "---|" * (len(modes) + 3)]
    for layout, res in report["layouts"].items():
        for b in report["batches"]:
            cells = [res["decode"].get(f"{b}/{m}") for m in modes]
            steps = " | ".join(f"{c['step_ms']:.2f}" if c else "-" for c in cells)
            fwd = cells[-1]["forward_ms"] if cells[-1] else float("nan")
            lines.append(f"| {layout} | {b} | {steps} | {fwd:.2f} | {fwd / report['floor_ms']:.2f}x | "
                         f"{report['floor_ms']:.2f} |")
    lines += ["", f"DFlash (block {report['draft_config']['block_size']}, random drafter): c = (t_draft + t_verify) / t_decode, forward times",
              "", "| layout | batch | t_draft ms | t_verify ms | t_decode ms | c | round/step | fused round/step "
              "| acceptance length | projected speed-up at 3.2 / 6.5 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for layout, res in report["layouts"].items():
        for b, r in res["dflash"].items():
            d = res["decode"].get(f"{b}/{best}", {}).get("forward_ms", float("nan"))
            proj = r.get("projected_speedup", {})
            lines.append(f"| {layout} | {b} | {r['draft_ms']:.2f} | {r['forward_ms']:.2f} | {d:.2f} | {r['c']:.2f} | "
                         f"{r['c_step']:.2f} | {r.get('c_fused', float('nan')):.2f} | {r['acceptance_length']:.2f} | "
                         f"{proj.get('3.2', float('nan')):.2f}x / {proj.get('6.5', float('nan')):.2f}x |")
    lines += ["", f"End to end ({PROMPT}-token prompts, {report['max_new']} new tokens each, after a warm-up run)",
              "", "| layout | batch | AR tok/s | DFlash fixed tok/s | fixed acceptance length | DFlash adaptive tok/s "
              "| adaptive chosen k |", "|---|---|---|---|---|---|---|"]
    for layout, res in report["layouts"].items():
        for b, r in res["e2e"].items():
            ad = r.get("adaptive")
            lines.append(f"| {layout} | {b} | {r['ar']['tokens_per_s']:.1f} | {r['dflash']['tokens_per_s']:.1f} | "
                         f"{r['dflash']['acceptance_length']:.2f} | "
                         f"{ad['tokens_per_s'] if ad else float('nan'):.1f} | {ad['chosen_k_hist'] if ad else '-'} |")
    lines += ["", "Interpreter steps (op calls) per method call: " + "; ".join(
        f"{layout}: " + ", ".join(f"{m} {n}" for m, n in res.get("steps_per_call", {}).items())
        for layout, res in report["layouts"].items())]
    seq, cell = report["layouts"].get("sequence"), report["layouts"].get("cell")
    for mode in modes:
        if seq and cell and f"8/{mode}" in seq["decode"] and f"8/{mode}" in cell["decode"]:
            a, b = seq["decode"][f"8/{mode}"]["step_ms"], cell["decode"][f"8/{mode}"]["step_ms"]
            lines += ["", f"kBatchedCell vs kBatchedSequence at batch 8 ({mode}): {b:.2f} vs {a:.2f} ms/step "
                          f"({b / a:.2f}x)"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", "--n-layers", type=int, default=8, help="target depth (with --preset: its first N layers)")
    p.add_argument("--preset", default=None, help="an mg-export preset at its own width (e.g. mg-30b)")
    p.add_argument("--tiny", action="store_true", help="tiny presets (smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--layouts", default="sequence,cell")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--dflash-batches", default="1,8")
    p.add_argument("--e2e-batches", default=None, help="end-to-end runs [default: --dflash-batches; '' = none]")
    p.add_argument("--modes", default=None,
                   help=f"execution modes, comma-separated, from {', '.join(MODES)} [default: all on cuda; eager on cpu]")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--weights", default="float", choices=["float", "int8", "int4"],
                   help="the target's and drafter's linear layers, as `mg-export --weights`")
    p.add_argument("--group-size", type=int, default=None, help="--weights int4: as `mg-export --group-size`")
    p.add_argument("--quantize-head", action="store_true", help="the LM head too, as `mg-export --quantize-head`")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from mg.kernels.quiet import quiet_dependencies

    quiet_dependencies()  # the exporter's dependencies log import-time noise
    args.batches = int_list(p, "--batches", args.batches)
    args.dflash_batches = int_list(p, "--dflash-batches", args.dflash_batches, empty=True)
    args.e2e_batches = (args.dflash_batches if args.e2e_batches is None
                        else int_list(p, "--e2e-batches", args.e2e_batches, empty=True))
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_decode: --device cuda, but torch sees no CUDA device")
    if args.quantize_head and args.weights == "float":
        sys.exit("bench_decode: --quantize-head needs --weights int8 or int4")
    args.modes = (args.modes or ("eager,graphs,compiled" if args.device == "cuda" else "eager")).split(",")
    bad = [m for m in args.modes if m not in MODES or (m.startswith("graphs") and args.device != "cuda")]
    if bad:
        sys.exit(f"bench_decode: --modes has {bad[0]!r}; allowed: {', '.join(MODES)} (graphs, graphs-tc: cuda only)")
    cfg, dcfg = bench_config(args.layers, args.tiny, args.preset)
    max_seqs = max(args.batches + args.dflash_batches + args.e2e_batches)
    max_write = max(max_seqs, BLOCK * max(args.dflash_batches + args.e2e_batches, default=1), 2) if not args.tiny else 24
    layouts = args.layouts.split(",")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-decode-"))
    t0 = time.perf_counter()

    def export(lays: list[str]) -> dict:
        """Export `lays` in parallel child processes -> {layout: (directory, seconds, peak RSS GB)}."""
        threads = 0 if len(lays) > 1 else (os.cpu_count() or 1)
        with ProcessPoolExecutor(len(lays), mp_context=get_context("spawn")) as pool:
            futures = {lay: pool.submit(export_one, str(work / lay), lay, args.layers, args.tiny, max_write, max_seqs,
                                        args.max_context, args.preset, threads, args.weights,
                                        args.group_size, args.quantize_head) for lay in lays}
            done = {lay: f.result() for lay, f in futures.items()}
        print(f"exported {', '.join(f'{k} in {v[1]:.0f}s (peak RSS {v[2]:.2f} GB)' for k, v in done.items())} "
              f"(wall {time.perf_counter() - t0:.0f}s)", flush=True)
        return done

    one_at_a_time = args.preset is not None  # real-width artifacts: one on disk at a time
    exported = {} if one_at_a_time else export(layouts)
    params = cfg.n_params()
    weight_bytes = (params - cfg.vocab_size * cfg.dim) * torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    bw = copy_bandwidth(args.device, 1 << 30 if args.device == "cuda" else 1 << 26)
    report = {"config": {k: v for k, v in dataclasses.asdict(cfg).items() if k in (
                  "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "sliding_window",
                  "dtype")},
              "draft_config": {k: v for k, v in dataclasses.asdict(dcfg).items() if k in (
                  "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "block_size", "target_layers")},
              "params": params, "weight_gb": weight_bytes / 1e9, "copy_gbps": bw / 1e9,
              "floor_ms": 1e3 * weight_bytes / bw, "max_write": max_write, "max_new": args.max_new,
              "batches": args.batches, "modes": args.modes, "weights": args.weights,
              "quantize_head": args.quantize_head,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "export_s": {}, "export_peak_rss_gb": {}, "ptd_gb": None, "layouts": {}}
    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    for lay in layouts:
        if one_at_a_time:
            exported.update(export([lay]))
        path, seconds, peak = exported[lay]
        report["export_s"][lay], report["export_peak_rss_gb"][lay] = seconds, peak
        report["ptd_gb"] = (Path(path) / "model.ptd").stat().st_size / 1e9
        if args.weights != "float":  # the floor of what is stored, scales and zeros included
            weight_bytes = step_weight_bytes(Path(path) / "model.ptd")
            report.update(weight_gb=weight_bytes / 1e9, floor_ms=1e3 * weight_bytes / bw)
        report["layouts"][lay] = {}
        bench_layout(path, lay, args, cfg, weight_bytes, bw, report["layouts"][lay], save)
        res = report["layouts"][lay]
        print(f"  [{lay}] load {res['load_s']:.1f}s; host RSS {res['rss_before_load_gb']:.2f} -> "
              f"{res['rss_after_load_gb']:.2f} GB (peak {res['peak_rss_gb']:.2f} GB); device "
              f"{res['device_gb'] or 0:.2f} GB", flush=True)
        if one_at_a_time:
            gc.collect()
            shutil.rmtree(path, ignore_errors=True)
    report["total_s"] = time.perf_counter() - t0
    print()
    print(tables(report))
    print(f"\n(total {report['total_s']:.0f}s)")
    save()


if __name__ == "__main__":
    main()
