"""The generation engine: scheduler + program + KV cache + sampling, target-only decoding.

Each step packs decode tokens and prefill chunks (`Scheduler.schedule`), has
the cache admit them, runs the target `forward` once, samples the rows that
end a sequence's known tokens, and commits. The DFlash engine
(`spec_decode.py`) reuses this class for prefill and bookkeeping.

On CUDA (unless `cuda_graphs=False`) a step of N tokens and R logits rows is
padded to the token bucket of max(N, R) (1, 2, 4, ... up to max_write; see
`cuda_graphs.py`) and replayed from a CUDA graph: padding rows are token 0 at
position 0 of the cache's scratch slot, padding logits rows read row 0, and the
outputs are cut back to the live rows. `pad_steps=True` runs the same padding
without graphs (how CPU tests exercise it). Knows the model only through the
artifact; never imports mg.export.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from mg.manifests import constants as C

from .artifact import Artifact
from .cache_base import make_cache
from .cuda_graphs import GraphCounters, GraphRunner, bucket_for, pad_rows, triton_enabled
from .sampling import SamplingBatch, SamplingParams, sample
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
    accepted_hist: list = field(default_factory=list)  # [a] = DFlash rounds that accepted a drafts
    graphs: GraphCounters = field(default_factory=GraphCounters)  # CUDA-graph captures/replays/recaptures

    @property
    def graph_captures(self) -> int:
        return self.graphs.captures

    @property
    def graph_replays(self) -> int:
        return self.graphs.replays

    @property
    def recaptures(self) -> int:
        return self.graphs.recaptures

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
    """Serves requests on one artifact; `run(requests)` returns one `Result` per request, in order.

    cuda_graphs: None = on for CUDA, off elsewhere. pad_steps: None = pad exactly when graphs are
    on; True pads every step to its bucket (without graphs on CPU). use_triton: None = the caches'
    default (Triton on CUDA when available)."""

    def __init__(self, artifact: Artifact, device: str = "cpu", n_slots: Optional[int] = None, *,
                 cuda_graphs: Optional[bool] = None, pad_steps: Optional[bool] = None,
                 use_triton: Optional[bool] = None):
        self.artifact = artifact
        self.device = torch.device(device)
        self.program = artifact.program
        kv = artifact.manifest.kv
        self.cache = make_cache(kv, self.device, n_slots if n_slots is not None else kv.max_active_seqs)
        if use_triton is not None:
            self.cache.use_triton = triton_enabled(self.device, use_triton)
        self.program.bind("mg::update_and_attend", self.cache.update_and_attend)
        self.stats = EngineStats()
        self.cuda_graphs = self._graphs_wanted(cuda_graphs)
        self.pad_steps = self.cuda_graphs if pad_steps is None else pad_steps
        self._forward_graphs = GraphRunner(self.program, C.METHOD_FORWARD, self._blank_step,
                                           self.cache.storage_version, self.stats.graphs) if self.cuda_graphs else None
        self._batches: dict[tuple[SamplingParams, ...], SamplingBatch] = {}
        self.scheduler = Scheduler(max_write=kv.max_write, n_slots=self.cache.n_slots, capacity=kv.capacity,
                                   vocab_size=artifact.manifest.model.vocab_size,
                                   cell_budget=kv.max_cells if kv.layout == C.LAYOUT_CELL else None)
        self.eos = frozenset(artifact.manifest.model.eos_ids)
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
        """Admit the step in the cache, then run the target `forward`: logits [R, V] first, then
        per-token outputs [N, ...] (hidden), cut back to the live rows when the step was padded."""
        n, r = inputs.tokens.shape[0], inputs.logits_rows.shape[0]
        size = bucket_for(max(n, r, 1), self.cache.max_write) if self.pad_steps else None
        step = [inputs.tokens, inputs.positions, inputs.seq_slots, inputs.logits_rows]
        if size is not None:
            step = [pad_rows(inputs.tokens, size, 0), pad_rows(inputs.positions, size, 0),
                    pad_rows(inputs.seq_slots, size, self.cache.scratch_slot), pad_rows(inputs.logits_rows, size, 0)]
        self.cache.declare_step(step[1], step[2])  # padded rows included: the host admits them, outside the graph
        if size is not None and self._forward_graphs is not None:
            out = self._forward_graphs.run(size, step)
        else:
            out = self.program.run(C.METHOD_FORWARD, [x.to(self.device) for x in step])
        if size is None:
            return out
        return [out[0][:r], *(o[:n] for o in out[1:])]

    def _blank_step(self, size: int) -> list[torch.Tensor]:
        """A forward step of `size` padding rows only (the scratch slot at position 0): harmless to run."""
        zeros = torch.zeros(size, dtype=torch.long, device=self.device)
        return [zeros, zeros, torch.full_like(zeros, self.cache.scratch_slot), zeros]

    def _graphs_wanted(self, requested: Optional[bool]) -> bool:
        if requested is None:
            return self.device.type == "cuda"
        if requested and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs --device cuda; the device is {self.device}")
        return requested

    def sampling_batch(self, seqs: list[Sequence], device: torch.device) -> SamplingBatch:
        """The rows' SamplingBatch, built once per distinct parameter tuple (saves 5 host-to-device copies
        per step in steady decoding)."""
        key = tuple(s.request.sampling for s in seqs)
        batch = self._batches.get(key)
        if batch is None:
            if len(self._batches) >= 256:
                self._batches.clear()
            batch = self._batches[key] = SamplingBatch.from_params(key, device=device)
        return batch

    def sample_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Sample one token per logits row [R, V] with each request's own parameters and seed."""
        if not seqs:
            return []
        batch = self.sampling_batch(seqs, logits.device)
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
