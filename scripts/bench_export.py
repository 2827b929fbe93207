"""Streaming-export benchmark: peak host RSS, time and GB/s of `mg-export` on a large sharded checkpoint.

Writes a random checkpoint at a preset's full width (default: the first 4 layers of mg-30b, ~9 GB of bf16
in Hugging Face shards + `model.safetensors.index.json`, one tensor in memory at a time), then runs
`mg-export --checkpoint` on it under `/usr/bin/time -v` and reports its "Maximum resident set size".
The checkpoint is written by a separate process: a child forked from a parent that had held shards would
start its peak RSS count with the parent's pages (the kernel carries the high-water mark across exec).
Then a second child loads the artifact on CPU and generates 2 tokens, reporting its RSS after load and
after generating against the weights' size (the weights are used in place from the memory map).
Prints a Markdown table; `--out` writes JSON. Needs about twice the checkpoint size of free disk.

    python scripts/bench_export.py --workdir /var/tmp/mg-bench --out docs/bench_export_cpu.json

Bench scripts may import mg.export (the runtime never does).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch


def write_checkpoint(directory: Path, preset: str, n_layers: int, shard_bytes: int) -> int:
    """A sharded random checkpoint of `preset` cut to `n_layers`; -> bytes of weights written."""
    import dataclasses

    from safetensors.torch import save_file

    from mg.export.artifact import meta_target
    from mg.export.config import PRESETS
    from mg.export.weights import RandomWeights

    cfg = dataclasses.replace(PRESETS[preset], n_layers=n_layers)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_json_dict(), indent=2) + "\n")
    shapes = {n: tuple(p.shape) for n, p in meta_target(cfg).named_parameters()}
    dtype, source = getattr(torch, cfg.dtype), RandomWeights(1)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():  # group tensors into shards of about shard_bytes
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: torch.cat(list(source.chunks(n, shapes[n], dtype))).view(shapes[n]) for n in names}
        save_file(tensors, str(directory / file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: file for n in names})
        del tensors
        print(f"  wrote {file} ({total / 1e9:.1f} GB so far)", flush=True)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                        "weight_map": weight_map}, indent=1))
    return total


LOAD_CHECK = """
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[2])
from proc_status import status_gb as rss
from mg.runtime.artifact import load_artifact
from mg.runtime.config import RunConfig
from mg.runtime.engine import Engine
from mg.runtime.scheduler import Request

art = load_artifact(Path(sys.argv[1]))
loaded, rss_loaded = time.perf_counter() - t0, rss()
out = Engine(art, RunConfig(device="cpu", dflash=False)).run([Request("r", (1, 70, 80, 90, 100), 2)])[0]
print(json.dumps({"load_s": loaded, "rss_after_load_gb": rss_loaded, "rss_after_generate_gb": rss(),
                  "peak_rss_gb": rss("VmHWM"),
                  "generate_s": time.perf_counter() - t0 - loaded, "tokens": list(out.tokens)}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="mg-30b")
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--shard-gb", type=float, default=2.0)
    p.add_argument("--workdir", default=None, help="where the checkpoint and the artifact go (deleted after)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-export-"))
    ckpt, art = work / "checkpoint", work / "artifact"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(art, ignore_errors=True)
    try:
        t0 = time.perf_counter()
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            weights = pool.submit(write_checkpoint, ckpt, args.preset, args.n_layers, int(args.shard_gb * 1e9)).result()
        print(f"checkpoint: {weights / 1e9:.2f} GB in {time.perf_counter() - t0:.0f}s", flush=True)
        cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "mg.export.cli", "--checkpoint", str(ckpt), "-o", str(art)]
        t0 = time.perf_counter()
        run = subprocess.run(cmd, check=True, stderr=subprocess.PIPE, text=True)
        seconds = time.perf_counter() - t0
        sys.stderr.write(run.stderr)
        peak = 1024 * int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1))
        ptd = (art / "model.ptd").stat().st_size
        report = {"preset": args.preset, "n_layers": args.n_layers, "checkpoint_gb": weights / 1e9,
                  "shards": len(list(ckpt.glob("*.safetensors"))), "export_s": seconds, "ptd_gb": ptd / 1e9,
                  "gb_per_s": ptd / 1e9 / seconds, "peak_rss_gb": peak / 1e9, "cpus": os.cpu_count()}
        shutil.rmtree(ckpt, ignore_errors=True)  # the page cache holds the artifact, not the checkpoint
        run = subprocess.run([sys.executable, "-c", LOAD_CHECK, str(art), str(Path(__file__).parent)], check=True,
                             capture_output=True, text=True)
        report["cpu_load"] = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(art, ignore_errors=True)
    print("\n| checkpoint | shards | export s | model.ptd GB | GB/s | peak RSS GB | CPUs |\n|---|---|---|---|---|---|---|")
    print(f"| {args.preset} first {args.n_layers} layers, {report['checkpoint_gb']:.2f} GB | {report['shards']} | "
          f"{seconds:.1f} | {report['ptd_gb']:.2f} | {report['gb_per_s']:.2f} | {report['peak_rss_gb']:.2f} | "
          f"{report['cpus']} |")
    load = report["cpu_load"]
    print(f"\nCPU load of the artifact: {load['load_s']:.1f}s; RSS {load['rss_after_load_gb']:.2f} GB after load, "
          f"{load['rss_after_generate_gb']:.2f} GB after generating 2 tokens (peak {load['peak_rss_gb']:.2f} GB) "
          f"for {report['ptd_gb']:.2f} GB of weights")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
