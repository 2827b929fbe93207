"""Serving benchmark: concurrent streaming clients against `mg-serve` on 127.0.0.1, and a soak run.

Starts `mg-serve ARTIFACT` on a free loopback port (default artifact: the embedded default, exported into a
temporary folder), then for each concurrency level runs a bounded number of streaming completions
(`--requests-per-level`, at most `--level-seconds` each level) with the `openai` async client and reports
requests/s, output tokens/s, p50/p99 time to first token and p50/p99 inter-token latency (time between
streamed text per token, per request: first to last text chunk over the tokens between them, as DFlash
sends several tokens per chunk). Token counts come from the stream's usage chunk. The soak sends `--soak` mixed requests (streamed or not, greedy or sampled, some with stop
strings, some cancelled by the client) at concurrency 32, after a 100-request warm-up soak, and reports
failures and the server's RSS before and after. Prints Markdown; `--out` writes JSON. Everything stops by itself.

    python scripts/bench_serve.py --out docs/bench_serve_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from proc_status import status_gb

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(10):", "def parse(line):",
           "with open(path) as f:", "if __name__ == '__main__':", "return sorted("]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_gb(pid: int) -> float:
    return status_gb("VmRSS", pid)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one(client, max_tokens: int, stream: bool, rng: random.Random, cancel_after: int = 0,
              sampled: bool = False, stop: bool = False) -> dict:
    kw = dict(prompt=rng.choice(PROMPTS), max_tokens=max_tokens, temperature=0.8 if sampled else 0.0)
    if stop:
        kw["stop"] = ["\n\n"]
    t0 = time.perf_counter()
    if not stream:
        r = await client.completions.create(model=MODEL, **kw)
        return {"ok": True, "tokens": r.usage.completion_tokens, "ttft": None, "gaps": [], "s": time.perf_counter() - t0}
    times, tokens = [], 0
    chunks = await client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw)
    async for c in chunks:
        if c.usage is not None:
            tokens = c.usage.completion_tokens
        elif c.choices and c.choices[0].text:
            times.append(time.perf_counter())
            if cancel_after and len(times) >= cancel_after:
                await chunks.close()  # the client goes away mid-stream
                break
    # inter-token latency of the request: first to last streamed text over the tokens between them
    itl = [(times[-1] - times[0]) / (tokens - 1)] if len(times) > 1 and tokens > 1 else []
    return {"ok": True, "tokens": tokens, "ttft": times[0] - t0 if times else None, "gaps": itl,
            "s": time.perf_counter() - t0}


async def level(base: str, concurrency: int, n: int, seconds: float, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    rng = random.Random(concurrency)
    sem = asyncio.Semaphore(concurrency)
    deadline = time.perf_counter() + seconds
    results: list[dict] = []

    async def worker() -> None:
        async with sem:
            if time.perf_counter() > deadline:
                return
            try:
                results.append(await one(client, max_tokens, True, rng))
            except Exception as e:  # counted, not raised: the table reports failures
                results.append({"ok": False, "error": f"{type(e).__name__}: {e}"})

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(n)))
    wall = time.perf_counter() - t0
    await client.close()
    ok = [r for r in results if r["ok"]]
    gaps = [g for r in ok for g in r["gaps"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    return {"concurrency": concurrency, "requests": len(results), "failed": len(results) - len(ok), "wall_s": wall,
            "requests_per_s": len(ok) / wall, "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_p50_ms": 1e3 * pct(ttft, 0.5), "ttft_p99_ms": 1e3 * pct(ttft, 0.99),
            "itl_p50_ms": 1e3 * pct(gaps, 0.5), "itl_p99_ms": 1e3 * pct(gaps, 0.99)}


async def soak(base: str, n: int, concurrency: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    rng = random.Random(7)
    sem = asyncio.Semaphore(concurrency)
    failures: list[str] = []

    async def worker(i: int) -> None:
        async with sem:
            kind = i % 5
            try:
                await one(client, rng.choice([8, 16, 32, 64]), stream=kind != 0, rng=rng,
                          cancel_after=4 if kind == 4 else 0, sampled=kind in (1, 3), stop=kind == 2)
            except Exception as e:
                failures.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(n)))
    await client.close()
    return {"requests": n, "concurrency": concurrency, "failed": len(failures), "first_failures": failures[:3],
            "wall_s": time.perf_counter() - t0}


MODEL = None


def main() -> None:
    global MODEL
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", nargs="?", default=None, help="[default: export the embedded default]")
    p.add_argument("--levels", default="1,8,32")
    p.add_argument("--requests-per-level", type=int, default=64)
    p.add_argument("--level-seconds", type=float, default=120.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--soak", type=int, default=500, help="requests of the soak run (0 = none)")
    p.add_argument("--soak-rounds", type=int, default=1, help="soak runs in a row (RSS after each)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--server-args", default="", help="more mg-serve flags, e.g. '--threads 1'")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    artifact = args.artifact
    if artifact is None:
        artifact = str(work / "default")
        subprocess.run([sys.executable, "-m", "mg.export.cli", "-o", artifact], check=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "mg.runtime.serve_cli", artifact, "--port", str(port),
                               "--device", args.device, "--max-queue", "256", *shlex.split(args.server_args)])
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as r:
                    MODEL = json.load(r)["data"][0]["id"]
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    sys.exit("bench_serve: the server did not start")
                time.sleep(0.3)
        report = {"artifact": artifact, "model": MODEL, "device": args.device, "cpus": os.cpu_count(),
                  "server_args": args.server_args,
                  "max_tokens": args.max_tokens, "levels": []}
        asyncio.run(level(base, 2, 4, 30, 8))  # warm-up: first-use costs out of the numbers
        for c in (int(x) for x in args.levels.split(",") if x):
            r = asyncio.run(level(base, c, max(args.requests_per_level, c), args.level_seconds, args.max_tokens))
            report["levels"].append(r)
            print(f"  concurrency {c}: {r['requests_per_s']:.2f} req/s, {r['output_tokens_per_s']:.1f} tok/s, "
                  f"TTFT p50 {r['ttft_p50_ms']:.0f} ms", flush=True)
        if args.soak:
            start = rss_gb(server.pid)
            asyncio.run(soak(base, 100, 32))  # warm-up: every request kind once, allocator pools filled
            time.sleep(1.0)
            before = rss_gb(server.pid)
            rounds = []
            for _ in range(args.soak_rounds):
                rounds.append(asyncio.run(soak(base, args.soak, 32)))
                time.sleep(1.0)
                rounds[-1]["rss_after_gb"] = rss_gb(server.pid)
            s = dict(rounds[0], failed=sum(r["failed"] for r in rounds), rss_start_gb=start, rss_before_gb=before,
                     rss_after_gb=rounds[-1]["rss_after_gb"], rounds=rounds)
            report["soak"] = s
    finally:
        server.terminate()
        code = server.wait(60)
    report["server_exit_code"] = code
    print("\n| concurrency | requests | failed | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
          "| ITL p99 ms |\n|---|---|---|---|---|---|---|---|---|")
    for r in report["levels"]:
        print(f"| {r['concurrency']} | {r['requests']} | {r['failed']} | {r['requests_per_s']:.2f} | "
              f"{r['output_tokens_per_s']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
              f"{r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} |")
    if "soak" in report:
        s = report["soak"]
        after = ", ".join(f"{r['rss_after_gb']:.3f}" for r in s["rounds"])
        print(f"\nSoak: {len(s['rounds'])} x {s['requests']} mixed requests at concurrency {s['concurrency']}, "
              f"RSS after each: {after} GB")
        print(f"Soak: {s['requests']} mixed requests at concurrency {s['concurrency']} in {s['wall_s']:.0f}s, "
              f"{s['failed']} failed; server RSS {s['rss_before_gb']:.3f} GB before, {s['rss_after_gb']:.3f} GB "
              f"after ({100 * (s['rss_after_gb'] / s['rss_before_gb'] - 1):+.1f}%; {s['rss_start_gb']:.3f} GB before "
              f"a 100-request warm-up soak); server exit code {code}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
