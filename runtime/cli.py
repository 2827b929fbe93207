"""`mg-run`: parse flags, load the artifact, serve the requests, write JSONL; errors are one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import click

from mg.manifests import constants as C

from .config import SPECULATION_ADAPTIVE, SPECULATION_POLICIES, RunConfig


def _die(msg: str, code: int = 2) -> None:
    click.echo(f"mg-run: error: {msg}", err=True)
    sys.exit(code)


class _Output:
    """Result lines, one per request as it finishes, flushed: to stdout, or to a file opened at the first
    line (a run that cannot start leaves an existing file as it was)."""

    def __init__(self, path: Optional[Path]):
        self.path, self._file = path, None

    def __call__(self, record: dict) -> None:
        if self._file is None:
            self._file = sys.stdout if self.path is None else open(self.path, "w", encoding="utf-8")
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self, finished: bool) -> None:
        if finished and self._file is None and self.path is not None:
            self._file = open(self.path, "w", encoding="utf-8")  # a run with no result lines: an empty file
        if self._file is not None and self._file is not sys.stdout:
            self._file.close()


def _check_output_path(flag: str, path: Optional[Path]) -> None:
    """Refuse a path mg-run must not write: a folder, a missing folder, or a file inside an artifact."""
    if path is None:
        return
    parent = path.parent
    if path.is_dir():
        _die(f"{flag} {path} is a directory; give a file path")
    if not parent.is_dir():
        _die(f"{flag} {path}: the folder {parent} does not exist; create it first")
    if (parent / C.MANIFEST_FILE).is_file():
        _die(f"{flag} {path} is inside the artifact directory {parent}; write results elsewhere")


_ENGINE_OPTIONS = [
    click.option("--device", type=str, default="cpu", show_default=True, metavar="cpu|cuda"),
    click.option("--threads", type=int, default=None,
                 help="CPU threads for torch [default: torch's, one per core]. When other busy processes share the "
                      "CPU, fewer threads (even 1) avoid a large slowdown."),
    click.option("--kv-layout", type=str, default=None, metavar="sequence|cell",
                 help="Must match the artifact (fixed at export)."),
    click.option("--no-dflash", is_flag=True, help="Target-only decoding even when the artifact has a drafter."),
    click.option("--draft-block", type=int, default=None,
                 help="The most rows verified per DFlash round: the pending token + drafts (2 .. the exported block "
                      "size) [default: the exported one]."),
    click.option("--speculation", type=click.Choice(SPECULATION_POLICIES), default=SPECULATION_ADAPTIVE,
                 show_default=True,
                 help="adaptive: each round, each sequence drafts only as many tokens as pay for themselves (from "
                      "measured step costs and its acceptance so far; 0 = a plain decode step); fixed: always "
                      "draft-block - 1 drafts."),
    click.option("--compile/--no-compile", "compile_methods", default=None,
                 help="Run the methods as fused code compiled by torch Inductor (Triton on CUDA, C++ on CPU), cached "
                      "on disk per program, device and torch version (the first run compiles: ~1 min) "
                      "[default: on for cuda, off for cpu]."),
    click.option("--no-cuda-graphs", is_flag=True,
                 help="With --device cuda: run every step eagerly instead of replaying CUDA graphs (for comparison)."),
    click.option("--fused-rounds/--no-fused-rounds", default=None,
                 help="Run a greedy DFlash round (draft, verify, acceptance, draft context) as one call: one CUDA "
                      "graph per round [default: on with CUDA graphs; --fused-rounds runs it eagerly elsewhere]."),
    click.option("--overlap/--no-overlap", default=None,
                 help="Launch each greedy plain decode step before the tokens of the step before are on the host, "
                      "which the step then takes on the device: the host's work of a step runs while the device "
                      "computes the one before. Same tokens either way [default: on with CUDA graphs; --overlap "
                      "elsewhere only reorders the work]."),
    click.option("--int4-tensor-cores", is_flag=True,
                 help="With --device cuda and a bfloat16 int4 artifact: calls of 1-4 rows (decode steps of 1-4 "
                      "sequences) run the quantized linears on torch's tensor-core int4 kernel: faster, a second "
                      "copy of each int4 weight on the device, and greedy DFlash then equals target-only, and "
                      "batched equals alone, only up to rounding (a row's kernel depends on its call's rows). "
                      "Changes nothing elsewhere."),
    click.option("--row-invariant", is_flag=True,
                 help="With --device cuda: float matrix products by a Triton linear whose launch depends on the "
                      "weight's shape only, so a row's products are the same bits whatever rows share its step "
                      "(with cuBLAS, greedy DFlash of a bfloat16 artifact equals target-only only up to "
                      "rounding). Slower: a float32 decode step of the embedded default takes 2.8x as long on "
                      "an H100, bfloat16 at MG-30B width 1.03x at one row. On the CPU: attention whose bits for "
                      "a row do not depend on the step's other rows, so with --weights int8/int4 artifacts "
                      "greedy DFlash equals target-only and batched equals alone (without it a few prompts in 20 "
                      "differ); 10-35% slower steps on the embedded default."),
    click.option("--rows-kernel", is_flag=True,
                 help="With --device cuda: float32 matrix products of 1-16 rows (decode steps, DFlash verifies and "
                      "drafts) by a Triton multiply-add kernel instead of cuBLAS (on an H100: rounds and batches "
                      "a few percent faster, single-sequence decoding about 20% slower). Longer calls and other "
                      "dtypes stay on cuBLAS; --row-invariant takes precedence."),
    click.option("--no-verify", is_flag=True,
                 help="Skip hashing model.ptd against manifest.json (sizes, keys and shapes are still checked). "
                      "Without it the weights are hashed unless this unchanged file was hashed before.")
]


def engine_options(command):
    """The flags of how an engine runs, shared by mg-run and mg-serve (`engine_setup` checks them)."""
    for option in reversed(_ENGINE_OPTIONS):
        command = option(command)
    return command


def engine_config(device: str, no_dflash: bool, draft_block, speculation: str, compile_methods,
                  no_cuda_graphs: bool, fused_rounds, overlap, int4_tensor_cores: bool, row_invariant: bool,
                  rows_kernel: bool) -> RunConfig:
    """The `RunConfig` of `engine_options`' flags (mg-run and mg-serve alike)."""
    return RunConfig(device=device, cuda_graphs=False if no_cuda_graphs else None, compile=compile_methods,
                     dflash=not no_dflash, draft_block=draft_block, speculation=speculation,
                     fused_rounds=fused_rounds, overlap=overlap, int4_tensor_cores=int4_tensor_cores,
                     row_invariant=row_invariant, rows_kernel=rows_kernel)


def check_device(device: str, die=None) -> None:
    """Refuse a --device other than cpu | cuda (one line, exit 2 through `die`), before torch is imported."""
    if device not in ("cpu", "cuda"):
        (die or _die)(f"--device is {device!r}; allowed: cpu | cuda")


def say_progress() -> None:
    """The runtime's lines (fallbacks, compiling) go to stderr as they are, progress notes included."""
    import logging

    logger = logging.getLogger("mg.runtime")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def engine_setup(device: str, threads: Optional[int], die=None, spare_core: bool = False) -> None:
    """After `check_device`: check --threads (one line and exit 2 through `die`), quiet the dependencies, apply
    --threads (without it and with `spare_core`, on CPU: torch's default minus one, leaving a core to the
    caller's other threads), and refuse --device cuda without a CUDA device. Shared by mg-run and mg-serve."""
    die = die or _die
    if threads is not None and threads < 1:
        die(f"--threads is {threads}; allowed: an integer >= 1")
    from mg.kernels.quiet import quiet_dependencies

    quiet_dependencies()
    say_progress()
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    elif spare_core and device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() - 1))
    if device == "cuda" and not torch.cuda.is_available():
        die("--device cuda was asked for, but torch sees no CUDA device")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mg-toolchain", prog_name="mg-run")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompt", "prompts", multiple=True, help="Text prompt (repeatable; needs tokenizer.json).")
@click.option("--input", "input_path", type=click.Path(path_type=Path), default=None,
              help='JSONL requests ("-" = stdin): {"id", "prompt"|"tokens", optional max_new_tokens, temperature, top_k, '
                   'top_p, seed, ignore_eos}.')
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="0 = greedy (then --top-k, --top-p and --seed do not matter).")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off; applies when sampling.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off; applies when sampling.")
@click.option("--seed", type=int, default=None,
              help="Seed of every sampled request that sets none [default: a fresh one per request, reported in "
                   "its output line].")
@engine_options
@click.option("--output", type=click.Path(path_type=Path), default=None,
              help="Output JSONL, one line per request as it finishes ('-' = stdout) [default: stdout].")
@click.option("--stats-json", type=click.Path(path_type=Path), default=None, help="Write the summary as JSON.")
def main(artifact, prompts, input_path, max_new_tokens, temperature, top_k, top_p, seed, device, threads, kv_layout,
         no_dflash, draft_block, speculation, compile_methods, no_cuda_graphs, fused_rounds, overlap,
         int4_tensor_cores, row_invariant, rows_kernel, no_verify, output, stats_json):
    """Serve the prompts of ARTIFACT (an mg-export directory) and write one JSON line per request."""
    if not prompts and input_path is None:
        click.echo(click.get_current_context().get_help(), err=True)
        _die("nothing to do: give --prompt TEXT or --input FILE.jsonl")
    check_device(device)
    from .sampling import SamplingParams  # imports torch: not needed for --help or --version

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    try:
        params.validate()
    except ValueError as e:
        _die(_flag_message(str(e)))
    if max_new_tokens < 1:
        _die(f"--max-new-tokens is {max_new_tokens}; allowed: an integer >= 1")
    engine_setup(device, threads)
    if output is not None and str(output) == "-":
        output = None
    _check_output_path("--output", output)
    _check_output_path("--stats-json", stats_json)
    from .serve import ServeError, serve

    sink = _Output(output)
    try:
        config = engine_config(device, no_dflash, draft_block, speculation, compile_methods, no_cuda_graphs,
                               fused_rounds, overlap, int4_tensor_cores, row_invariant, rows_kernel)
        summary = serve(artifact, prompts, input_path, max_new_tokens, params, config, sink, kv_layout,
                        verify=not no_verify)
    except ServeError as e:
        sink.close(finished=False)
        _die(str(e))
    sink.close(finished=True)
    click.echo(summary.line(), err=True)
    if stats_json is not None:
        stats_json.write_text(json.dumps(summary.as_dict(), indent=2) + "\n", encoding="utf-8")
    if summary.failed:
        sys.exit(1)


def _flag_message(msg: str) -> str:
    """SamplingParams names fields; the user typed flags."""
    for field in ("temperature", "top_k", "top_p", "seed"):
        msg = msg.replace(f"{field}", f"--{field.replace('_', '-')}", 1) if msg.startswith(field) else msg
    return msg


if __name__ == "__main__":
    main()
