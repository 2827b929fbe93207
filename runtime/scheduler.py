"""Continuous batching: which sequences run, and which of their tokens each step writes.

Host-side bookkeeping only: requests wait until a sequence slot (and, for the
cell layout, enough cells) is free; each step packs decode tokens first, then
prefill chunks, up to `max_write` tokens. A request that can never fit is
refused alone. Knows nothing about programs, tensors or sampling math.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from .sampling import SamplingParams


class RequestError(ValueError):
    """One request that cannot be served; the others go on."""


@dataclass(frozen=True)
class Request:
    id: str
    prompt: tuple[int, ...]  # token ids, used verbatim
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()


@dataclass
class Sequence:
    request: Request
    slot: int
    tokens: list[int]  # prompt, then generated tokens
    n_cached: int = 0  # tokens whose KV is written (committed)
    finish_reason: Optional[str] = None
    draft_len: int = 0  # tokens whose hidden rows are in the draft context (DFlash)

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def in_prefill(self) -> bool:
        """More than the pending token is still to be written."""
        return len(self.tokens) - self.n_cached > 1

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.request.prompt):]


@dataclass(frozen=True)
class Chunk:
    seq: Sequence
    start: int  # first position written
    length: int  # tokens written this step
    wants_logits: bool  # the chunk ends at the last known token: sample the next one
    width: int = 1  # rows reserved in the step: decode chunks may add drafts up to this (DFlash)


@dataclass
class Scheduler:
    max_write: int
    n_slots: int
    capacity: int  # per-sequence context
    vocab_size: int
    cell_budget: Optional[int] = None  # cell layout: cells all running sequences may reserve together
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self._free_slots = list(range(self.n_slots))

    def check(self, request: Request) -> None:
        """Refuse a request that can never be served, naming the limit."""
        if not request.prompt:
            raise RequestError(f"request {request.id!r}: the prompt is empty")
        bad = [t for t in request.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"request {request.id!r}: token id {bad[0]} is outside the vocabulary "
                               f"[0, {self.vocab_size})")
        if request.max_new_tokens < 1:
            raise RequestError(f"request {request.id!r}: max_new_tokens is {request.max_new_tokens}; allowed: >= 1")
        need = len(request.prompt) + request.max_new_tokens
        if need > self.capacity:
            raise RequestError(f"request {request.id!r}: prompt ({len(request.prompt)} tokens) + max_new_tokens "
                               f"({request.max_new_tokens}) = {need} exceeds the artifact's context capacity "
                               f"{self.capacity}")
        if self.cell_budget is not None and need > self.cell_budget:
            raise RequestError(f"request {request.id!r}: needs {need} KV cells; the artifact has "
                               f"{self.cell_budget}")
        request.sampling.validate()

    def submit(self, request: Request) -> None:
        self.check(request)
        self.waiting.append(request)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _reserved_cells(self) -> int:
        return sum(len(s.request.prompt) + s.request.max_new_tokens for s in self.running)

    def _admit(self) -> None:
        while self.waiting and self._free_slots:
            req = self.waiting[0]
            if self.cell_budget is not None:
                if self._reserved_cells() + len(req.prompt) + req.max_new_tokens > self.cell_budget:
                    return
            self.waiting.popleft()
            self.running.append(Sequence(req, self._free_slots.pop(0), list(req.prompt)))

    def schedule(self, decode_width: int = 1) -> list[Chunk]:
        """The next step: each decoding sequence writes up to `decode_width` rows (its pending token and,
        with DFlash, drafts, reserved here), then prefill chunks fill what is left of `max_write`."""
        self._admit()
        budget = self.max_write
        chunks: list[Chunk] = []
        for seq in self.running:
            if not seq.in_prefill and budget > 0:
                width = min(decode_width, budget)
                chunks.append(Chunk(seq, seq.n_cached, 1, True, width))
                budget -= width
        for seq in self.running:
            if seq.in_prefill and budget > 0:
                remaining = len(seq.tokens) - seq.n_cached
                n = min(remaining, budget)
                chunks.append(Chunk(seq, seq.n_cached, n, n == remaining))
                budget -= n
        return chunks

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.running.remove(seq)
        self._free_slots.append(seq.slot)
        self._free_slots.sort()
