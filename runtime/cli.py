"""`mg-run`: parse flags, load the artifact, serve the requests, write JSONL; errors are one line."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import click

from .config import SPECULATION_ADAPTIVE, SPECULATION_POLICIES, RunConfig
from .sampling import SamplingParams


def _die(msg: str, code: int = 2) -> None:
    click.echo(f"mg-run: error: {msg}", err=True)
    sys.exit(code)


def _write_output(records: list[dict], output: Path | None) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", dir=output.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, output)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompt", "prompts", multiple=True, help="Text prompt (repeatable; needs tokenizer.json).")
@click.option("--input", "input_path", type=click.Path(path_type=Path), default=None,
              help='JSONL requests: {"id", "prompt"|"tokens", optional max_new_tokens, temperature, top_k, top_p, '
                   'seed}.')
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Per-request seed unless a request sets one.")
@click.option("--device", type=str, default="cpu", show_default=True, help="cpu | cuda")
@click.option("--kv-layout", type=str, default=None, help="Must match the artifact (fixed at export).")
@click.option("--no-dflash", is_flag=True, help="Target-only decoding even when the artifact has a drafter.")
@click.option("--draft-block", type=int, default=None,
              help="The most rows verified per DFlash round: the pending token + drafts (2 .. the exported block "
                   "size) [default: the exported one].")
@click.option("--speculation", type=click.Choice(SPECULATION_POLICIES), default=SPECULATION_ADAPTIVE,
              show_default=True,
              help="adaptive: each round, each sequence drafts only as many tokens as pay for themselves (from "
                   "measured step costs and its acceptance so far; 0 = a plain decode step); fixed: always "
                   "draft-block - 1 drafts.")
@click.option("--no-cuda-graphs", is_flag=True,
              help="With --device cuda: run every step eagerly instead of replaying CUDA graphs (for comparison).")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="Output JSONL [default: stdout].")
@click.option("--stats-json", type=click.Path(path_type=Path), default=None, help="Write the summary as JSON.")
def main(artifact, prompts, input_path, max_new_tokens, temperature, top_k, top_p, seed, device, kv_layout,
         no_dflash, draft_block, speculation, no_cuda_graphs, output, stats_json):
    """Serve the prompts of ARTIFACT (an mg-export directory) and write one JSON line per request."""
    if not prompts and input_path is None:
        click.echo(click.get_current_context().get_help(), err=True)
        _die("nothing to do: give --prompt TEXT or --input FILE.jsonl")
    if device not in ("cpu", "cuda"):
        _die(f"--device is {device!r}; allowed: cpu | cuda")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    try:
        params.validate()
    except ValueError as e:
        _die(_flag_message(str(e)))
    if max_new_tokens < 1:
        _die(f"--max-new-tokens is {max_new_tokens}; allowed: an integer >= 1")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            _die("--device cuda was asked for, but torch sees no CUDA device")
    from .serve import ServeError, serve

    try:
        config = RunConfig(device=device, cuda_graphs=False if no_cuda_graphs else None, dflash=not no_dflash,
                           draft_block=draft_block, speculation=speculation)
        records, summary = serve(artifact, prompts, input_path, max_new_tokens, params, config, kv_layout)
    except ServeError as e:
        _die(str(e))
    _write_output(records, output)
    click.echo(summary.line(), err=True)
    if stats_json is not None:
        stats_json.write_text(json.dumps(summary.as_dict(), indent=2) + "\n", encoding="utf-8")
    if any("error" in r for r in records):
        sys.exit(1)


def _flag_message(msg: str) -> str:
    """SamplingParams names fields; the user typed flags."""
    for field in ("temperature", "top_k", "top_p", "seed"):
        msg = msg.replace(f"{field}", f"--{field.replace('_', '-')}", 1) if msg.startswith(field) else msg
    return msg


if __name__ == "__main__":
    main()
