"""The generation engine: scheduler + program + KV cache + sampling, target-only decoding.

Each step packs decode tokens and prefill chunks (`Scheduler.schedule`), has
the cache admit them, runs the target `forward` once, samples the rows that
end a sequence's known tokens, and commits. The DFlash engine
(`spec_decode.py`) reuses this class for prefill and bookkeeping. Knows the
model only through the artifact; never imports mg.export.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from mg.manifests import constants as C

from .artifact import Artifact
from .cache_base import make_cache
from .sampling import SamplingBatch, sample
from .scheduler import Chunk, Request, RequestError, Scheduler, Sequence


@dataclass(frozen=True)
class Result:
    id: str
    tokens: tuple[int, ...]  # generated ids, ending with the EOS id when generation stopped on it
    finish_reason: Optional[str]  # "length" | "eos" | None on error
    error: Optional[str] = None


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    rounds: int = 0  # DFlash rounds
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Accepted drafts + 1 (the correction or bonus token) per round."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass
class StepInputs:
    tokens: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    seq_slots: torch.Tensor  # [N] int64
    logits_rows: torch.Tensor  # [R] int64
    sampled: list = field(default_factory=list)  # the Sequence of each logits row


class Engine:
    """Serves requests on one artifact; `run(requests)` returns one `Result` per request, in order."""

    def __init__(self, artifact: Artifact, device: str = "cpu", n_slots: Optional[int] = None):
        self.artifact = artifact
        self.device = torch.device(device)
        self.program = artifact.program
        kv = artifact.manifest.kv
        self.cache = make_cache(kv, self.device, n_slots if n_slots is not None else kv.max_active_seqs)
        self.program.bind("mg::update_and_attend", self.cache.update_and_attend)
        self.scheduler = Scheduler(max_write=kv.max_write, n_slots=self.cache.n_slots, capacity=kv.capacity,
                                   vocab_size=artifact.manifest.model.vocab_size,
                                   cell_budget=kv.max_cells if kv.layout == C.LAYOUT_CELL else None)
        self.eos = frozenset(artifact.manifest.model.eos_ids)
        self.stats = EngineStats()
        self._results: dict[str, Result] = {}

    # ------------------------------------------------------------------ public

    def run(self, requests: Iterable[Request]) -> list[Result]:
        order = []
        for req in requests:
            order.append(req.id)
            try:
                self.scheduler.submit(req)
                self.stats.prompt_tokens += len(req.prompt)
            except (RequestError, ValueError) as e:
                self._results[req.id] = Result(req.id, (), None, str(e))
        t0 = time.perf_counter()
        while not self.scheduler.idle:
            self.step()
        self.stats.wall_s += time.perf_counter() - t0
        return [self._results.pop(rid) for rid in order]

    def step(self) -> None:
        chunks = self.scheduler.schedule()
        if not chunks:
            raise RuntimeError("scheduler produced an empty step with requests pending")  # invariant
        inputs = self.pack(chunks)
        logits = self.forward(inputs)[0]
        new_tokens = self.sample_rows(logits, inputs.sampled)
        for chunk in chunks:
            chunk.seq.n_cached += chunk.length
        for seq, tok in zip(inputs.sampled, new_tokens):
            self.append(seq, [tok])
        self.stats.steps += 1

    # ------------------------------------------------------------------ pieces shared with DFlash

    def pack(self, chunks: list[Chunk]) -> StepInputs:
        tokens, positions, slots, rows, sampled = [], [], [], [], []
        for chunk in chunks:
            seq = chunk.seq
            tokens += seq.tokens[chunk.start:chunk.start + chunk.length]
            positions += range(chunk.start, chunk.start + chunk.length)
            slots += [seq.slot] * chunk.length
            if chunk.wants_logits:
                rows.append(len(tokens) - 1)
                sampled.append(seq)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        return StepInputs(as_long(tokens), as_long(positions), as_long(slots), as_long(rows), sampled)

    def forward(self, inputs: StepInputs) -> list:
        """Admit the step in the cache, then run the target `forward` (logits [R, V] first)."""
        self.cache.declare_step(inputs.positions, inputs.seq_slots)
        dev = self.device
        return self.program.run(C.METHOD_FORWARD, [inputs.tokens.to(dev), inputs.positions.to(dev),
                                                   inputs.seq_slots.to(dev), inputs.logits_rows.to(dev)])

    def sample_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Sample one token per logits row [R, V] with each request's own parameters and seed."""
        if not seqs:
            return []
        batch = SamplingBatch.from_params([s.request.sampling for s in seqs], device=logits.device)
        counters = torch.tensor([s.n_generated for s in seqs], dtype=torch.long, device=logits.device)
        return sample(logits[:, None, :], batch, counters)[:, 0].tolist()

    def append(self, seq: Sequence, new_tokens: list[int]) -> None:
        """Add sampled tokens to a sequence; finish it on EOS or at max_new_tokens."""
        for tok in new_tokens:
            seq.tokens.append(tok)
            self.stats.generated_tokens += 1
            if tok in self.eos:
                return self.finish(seq, "eos")
            if seq.n_generated >= seq.request.max_new_tokens:
                return self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.cache.release(seq.slot)
        self._results[seq.request.id] = Result(seq.request.id, tuple(seq.generated), reason)
