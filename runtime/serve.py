"""One `mg-run` invocation as a library call: artifact + requests -> result records + summary.

Never imports mg.export: the artifact is the only source of model facts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from .artifact import ArtifactError, load_artifact
from .engine import Engine, EngineStats
from .requests_io import BadRequest, Defaults, read_jsonl, result_record
from .sampling import SamplingParams
from .scheduler import Request
from .spec_decode import DFlashEngine, DFlashError
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
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    mean_acceptance_length: float = 0.0
    cuda_graphs: bool = False
    graph_captures: int = 0
    graph_replays: int = 0
    recaptures: int = 0

    def line(self) -> str:
        cache = {"sequence": "kBatchedSequence", "cell": "kBatchedCell"}[self.layout]
        text = (f"mg-run: {cache} on {self.device}: {self.requests} requests ({self.failed} failed), "
                f"{self.prompt_tokens} prompt + {self.generated_tokens} generated tokens in {self.steps} steps, "
                f"{self.wall_s:.2f}s, {self.tokens_per_s:.1f} tokens/s")
        if self.dflash:
            text += (f"; DFlash {self.rounds} rounds, {self.drafted_tokens} drafted, {self.accepted_tokens} "
                     f"accepted, mean acceptance length {self.mean_acceptance_length:.2f}")
        if self.cuda_graphs:
            text += (f"; CUDA graphs: {self.graph_captures} captures ({self.recaptures} after cache growth), "
                     f"{self.graph_replays} replays")
        return text

    def as_dict(self) -> dict:
        return asdict(self)


def _summary(layout: str, device: str, n: int, failed: int, stats: EngineStats, dflash: bool,
             cuda_graphs: bool) -> Summary:
    return Summary(layout=layout, device=device, requests=n, failed=failed, prompt_tokens=stats.prompt_tokens,
                   generated_tokens=stats.generated_tokens, steps=stats.steps, wall_s=stats.wall_s,
                   tokens_per_s=stats.tokens_per_s, dflash=dflash, rounds=stats.rounds,
                   drafted_tokens=stats.drafted_tokens, accepted_tokens=stats.accepted_tokens,
                   mean_acceptance_length=stats.mean_acceptance_length, cuda_graphs=cuda_graphs,
                   graph_captures=stats.graph_captures, graph_replays=stats.graph_replays,
                   recaptures=stats.recaptures)


def serve(artifact_dir: Path, prompts: Sequence[str], input_path: Optional[Path], max_new_tokens: int,
          params: SamplingParams, device: str = "cpu", layout: Optional[str] = None, dflash: bool = True,
          draft_block: Optional[int] = None, cuda_graphs: bool = True):
    """`cuda_graphs=False` runs every step eagerly on CUDA (for comparison); graphs are never used on CPU."""
    try:
        artifact = load_artifact(artifact_dir, device=device, layout=layout)
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
    defaults = Defaults(max_new_tokens, params)
    items: list = [Request(f"prompt-{i}", tuple(codec.encode(p)), max_new_tokens, params)
                   for i, p in enumerate(prompts)]
    if input_path is not None:
        try:
            items += read_jsonl(input_path, defaults, codec)
        except OSError as e:
            raise ServeError(f"{input_path}: cannot read ({e.strerror})") from None
        except ValueError as e:
            raise ServeError(str(e)) from None
    use_dflash = dflash and artifact.has_draft
    if draft_block is not None and not artifact.has_draft:
        raise ServeError(f"--draft-block was given, but {artifact_dir} has no drafter")
    graphs = cuda_graphs and device == "cuda"
    try:
        engine = (DFlashEngine(artifact, device=device, draft_block=draft_block, cuda_graphs=graphs) if use_dflash
                  else Engine(artifact, device=device, cuda_graphs=graphs))
    except DFlashError as e:
        raise ServeError(str(e)) from None
    results = {r.id: r for r in engine.run([i for i in items if isinstance(i, Request)])}
    records = []
    for item in items:
        if isinstance(item, BadRequest):
            records.append(result_record(item.id, (), None, item.error, codec))
        else:
            r = results[item.id]
            records.append(result_record(r.id, r.tokens, r.finish_reason, r.error, codec))
    failed = sum("error" in r for r in records)
    return records, _summary(artifact.layout, device, len(records), failed, engine.stats, use_dflash, graphs)
