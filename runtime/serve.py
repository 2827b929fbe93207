"""One `mg-run` invocation as a library call: artifact + requests -> result records + summary.

Never imports mg.export: the artifact is the only source of model facts.
"""

from __future__ import annotations

import dataclasses
import secrets
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from .artifact import ArtifactError, load_artifact
from .config import ConfigError, RunConfig
from .engine import Engine
from .requests_io import EMPTY_PROMPT, BadRequest, Defaults, read_jsonl, read_lines, result_record
from .sampling import SamplingParams
from .scheduler import Request
from .speculative import DFlashError
from .tokenizer import TextCodec


class ServeError(ValueError):
    """The whole run cannot proceed (bad artifact, unreadable input); one line."""


@dataclass(frozen=True)
class Summary:
    layout: str
    device: str
    requests: int
    failed: int
    prompt_tokens: int
    generated_tokens: int
    steps: int
    wall_s: float
    tokens_per_s: float
    dflash: bool = False
    speculation: str = ""
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    mean_acceptance_length: float = 0.0
    chosen_k_hist: tuple = ()  # [k] = decode steps of one sequence that verified k drafts
    stalls: int = 0  # plain steps left out of adaptive speculation's pricing as stalls (`SpecStats.stalls`)
    probes: int = 0  # round probes of sequences kept at plain steps (`SpecStats.probes`)
    probes_paid: int = 0  # of those, the ones that paid for their time (`SpecStats.probes_paid`)
    cuda_graphs: bool = False
    graph_captures: int = 0
    graph_replays: int = 0
    recaptures: int = 0
    weights: str = ""  # how the artifact stores its weights (`Manifest.weights_label`)
    overlapped_steps: int = 0  # steps launched before the step before was read back (`RunConfig.overlap`)

    def line(self) -> str:
        cache = {"sequence": "kBatchedSequence", "cell": "kBatchedCell"}[self.layout]
        stored = f", {self.weights} weights" if self.weights else ""
        text = (f"mg-run: {cache} on {self.device}{stored}: {self.requests} requests ({self.failed} failed), "
                f"{self.prompt_tokens} prompt + {self.generated_tokens} generated tokens in {self.steps} steps, "
                f"{self.wall_s:.2f}s, {self.tokens_per_s:.1f} tokens/s")
        if self.dflash:
            plain = self.chosen_k_hist[0] if self.chosen_k_hist else 0
            text += (f"; DFlash ({self.speculation}) {self.rounds} rounds, {self.drafted_tokens} drafted, "
                     f"{self.accepted_tokens} accepted, mean acceptance length {self.mean_acceptance_length:.2f}, "
                     f"{plain} plain decode steps")
            if self.probes:
                text += f", {self.probes} probes ({self.probes_paid} paid)"
        if self.overlapped_steps:
            text += f"; {self.overlapped_steps} steps overlapped"
        if self.cuda_graphs:
            text += (f"; CUDA graphs: {self.graph_captures} captures ({self.recaptures} after cache growth), "
                     f"{self.graph_replays} replays")
        return text

    def as_dict(self) -> dict:
        return asdict(self)


def _summary(layout: str, n: int, failed: int, engine: Engine) -> Summary:
    stats, spec, config = engine.stats, engine.spec_stats, engine.config
    graphs = engine.graph_counters
    return Summary(layout=layout, device=config.device, requests=n, failed=failed,
                   prompt_tokens=stats.prompt_tokens, generated_tokens=stats.generated_tokens, steps=stats.steps,
                   wall_s=stats.wall_s, tokens_per_s=stats.generated_tokens / stats.wall_s if stats.wall_s else 0.0,
                   dflash=engine.spec is not None, speculation=config.speculation if engine.spec else "",
                   rounds=spec.rounds, drafted_tokens=spec.drafted_tokens, accepted_tokens=spec.accepted_tokens,
                   mean_acceptance_length=spec.mean_acceptance_length, chosen_k_hist=tuple(spec.chosen_k_hist),
                   stalls=spec.stalls, probes=spec.probes, probes_paid=spec.probes_paid,
                   cuda_graphs=config.graphs, graph_captures=graphs.captures, graph_replays=graphs.replays,
                   recaptures=graphs.recaptures, weights=engine.runner.artifact.manifest.weights_label,
                   overlapped_steps=stats.overlapped_steps)


def _seeded(item):
    """A sampled request without a seed gets a fresh one (reported in its output line), so that identical
    prompts sample independently from run to run."""
    if not isinstance(item, Request) or item.sampling.greedy or item.sampling.seed is not None:
        return item
    return dataclasses.replace(item, sampling=dataclasses.replace(item.sampling, seed=secrets.randbits(63)))


def serve(artifact_dir: Path, prompts: Sequence[str], input_path: Optional[Path], max_new_tokens: int,
          params: SamplingParams, config: RunConfig, sink: Callable[[dict], None],
          layout: Optional[str] = None, verify: bool = True) -> Summary:
    """Load, check every request, then serve them, handing each result record to `sink` as soon as it is
    known (bad lines first, then requests as they finish); returns the Summary. `input_path` "-" reads
    standard input. Nothing reaches `sink` when the run cannot start (ServeError)."""
    try:
        artifact = load_artifact(artifact_dir, device=config.device, layout=layout, verify=verify)
    except ArtifactError as e:
        raise ServeError(str(e)) from None
    m = artifact.manifest
    codec = None
    if artifact.tokenizer_path is not None:
        try:
            codec = TextCodec(artifact.tokenizer_path, m.model.bos_id)
        except ValueError as e:
            raise ServeError(str(e)) from None
    if prompts and codec is None:
        raise ServeError(f"--prompt needs a tokenizer, and {artifact_dir} has no tokenizer.json; "
                         f"use --input FILE.jsonl with token ids")
    empty = next((i for i, p in enumerate(prompts) if not p), None)
    if empty is not None:
        raise ServeError(f"--prompt {empty}: {EMPTY_PROMPT}")
    defaults = Defaults(max_new_tokens, params)
    items: list = [Request(f"prompt-{i}", tuple(codec.encode(p)), max_new_tokens, params)
                   for i, p in enumerate(prompts)]
    if input_path is not None:
        try:
            items += read_jsonl(input_path, defaults, codec) if str(input_path) != "-" else \
                read_lines(sys.stdin, "<stdin>", defaults, codec)
        except OSError as e:
            raise ServeError(f"{input_path}: cannot read ({e.strerror})") from None
        except ValueError as e:
            raise ServeError(str(e)) from None
        taken = {f"prompt-{i}" for i in range(len(prompts))}
        clash = next((item.id for item in items[len(prompts):] if item.id in taken), None)
        if clash is not None:
            raise ServeError(f"{input_path}: request id {clash!r} is also the id of --prompt {clash.split('-')[1]} "
                             f"(--prompt requests are named prompt-0, prompt-1, ...); ids must be unique")
    items = [_seeded(item) for item in items]
    seeds = {item.id: item.sampling.seed for item in items if isinstance(item, Request) and not item.sampling.greedy}
    if config.draft_block is not None and not artifact.has_draft:
        raise ServeError(f"--draft-block was given, but {artifact_dir} has no drafter")
    try:
        engine = Engine(artifact, config)
    except (DFlashError, ConfigError) as e:
        raise ServeError(str(e)) from None
    counts = {"records": 0, "failed": 0}

    def emit(rid: str, tokens, finish_reason, error) -> None:
        counts["records"] += 1
        counts["failed"] += error is not None
        sink(result_record(rid, tokens, finish_reason, error, codec, seeds.get(rid)))

    for item in items:
        if isinstance(item, BadRequest):
            emit(item.id, (), None, item.error)
    engine.serve([i for i in items if isinstance(i, Request)],
                 lambda r: emit(r.id, r.tokens, r.finish_reason, r.error))
    return _summary(artifact.layout, counts["records"], counts["failed"], engine)
