"""Continuous batching: admission, which tokens each step writes, and what a step's new tokens do.

Host-side bookkeeping only. `check` is the one admission check: a request that
can never be served is refused alone, naming the limit. Requests wait until a
sequence slot (and, for the cell layout, enough cells) is free. Each step takes
the decoding sequences first (their pending token plus the draft rows the
speculative decoder asks for), then prefill chunks, up to `max_write` tokens.
`append` adds a step's new tokens to a sequence and finishes it on EOS (unless
the request sets `ignore_eos`) or at `max_new_tokens`. Knows nothing about
programs, tensors or sampling math.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from .sampling import SamplingParams


class RequestError(ValueError):
    """One request that cannot be served; the others go on."""


@dataclass(frozen=True)
class Request:
    id: str
    prompt: tuple[int, ...]  # token ids, used verbatim
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks)


@dataclass
class Sequence:
    request: Request
    slot: int
    tokens: list[int]  # prompt, then generated tokens
    n_cached: int = 0  # tokens whose KV is written (committed)
    finish_reason: Optional[str] = None
    in_flight: int = 0  # tokens made on the device and not appended yet (an overlapped step: engine.py)

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

    @property
    def room(self) -> int:
        """Draft rows this sequence may still verify: tokens left to generate after the pending one's
        successor (so a round never overshoots max_new_tokens), tokens in flight counted as generated."""
        return self.request.max_new_tokens - self.n_generated - self.in_flight - 1


@dataclass(frozen=True)
class Chunk:
    """Prefill: `length` prompt tokens of `seq` from position `start`."""

    seq: Sequence
    start: int  # first position written
    length: int  # tokens written this step
    wants_logits: bool  # the chunk ends at the last known token: sample the next one


@dataclass(frozen=True)
class Batch:
    """One scheduled step: decode sequences with their draft-row counts, then prefill chunks."""

    decode: list  # Sequence, each writing its pending token + n_drafts[i] draft rows
    n_drafts: list  # int per decode sequence
    prefill: list  # Chunk

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


# (decode sequences, rows left in the step, whether prompt chunks may join the step) -> draft rows per sequence,
# summing to at most those rows
DraftRows = Callable[[list, int, bool], list]


@dataclass
class Scheduler:
    max_write: int
    n_slots: int
    capacity: int  # per-sequence context
    vocab_size: int
    eos_ids: frozenset = frozenset()
    cell_budget: Optional[int] = None  # cell layout: cells all running sequences may reserve together
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self._free_slots = list(range(self.n_slots))

    def check(self, request: Request) -> None:
        """The one admission check: refuse a request that can never be served, naming the limit."""
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
        try:
            request.sampling.validate()
        except ValueError as e:
            raise RequestError(f"request {request.id!r}: {e}") from None

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

    def schedule(self, draft_rows: Optional[DraftRows] = None) -> Batch:
        """The next step: every decoding sequence writes its pending token, prompt chunks take what is left
        of `max_write`, and the draft rows `draft_rows(decode, rows_left, prompts)` gives fill the rest (`prompts`:
        some running sequence is in prefill, so prompt chunks may join). Prompt rows
        come before drafts: every prompt token must be computed, a finished prompt joins the decoding batch,
        and a draft row is a bet (with drafts first, 8 sequences drafting 15 rows each left a 128-row step 8
        rows of prefill, and 12 admitted prompts waited for dozens of steps)."""
        self._admit()
        decode, prompting, prompt_rows = [], [], 0  # one pass: this runs every step
        for seq in self.running:
            left = len(seq.tokens) - seq.n_cached
            if left > 1:  # in prefill
                prompting.append(seq)
                prompt_rows += left
            elif len(decode) < self.max_write:
                decode.append(seq)
        budget = self.max_write - len(decode)
        rows_left = max(0, budget - prompt_rows)
        n_drafts = (list(draft_rows(decode, rows_left, bool(prompting))) if draft_rows is not None and decode
                    else [0] * len(decode))
        if len(n_drafts) != len(decode) or sum(n_drafts) > rows_left or min(n_drafts, default=0) < 0:
            raise RuntimeError(f"draft rows {n_drafts} for {len(decode)} sequences exceed the {rows_left} rows left")
        budget -= sum(n_drafts)
        prefill: list[Chunk] = []
        for seq in prompting:
            if budget <= 0:
                break
            remaining = len(seq.tokens) - seq.n_cached
            n = min(remaining, budget)
            prefill.append(Chunk(seq, seq.n_cached, n, n == remaining))
            budget -= n
        return Batch(decode, n_drafts, prefill)

    def append(self, seq: Sequence, new_tokens: list[int]) -> Optional[str]:
        """Add a step's new tokens to `seq`; returns the finish reason ("eos" | "length") when it finished
        (tokens after an EOS are dropped), else None. The caller frees the slot's caches."""
        for tok in new_tokens:
            seq.tokens.append(tok)
            if tok in self.eos_ids and not seq.request.ignore_eos:
                return self._finish(seq, "eos")
            if seq.n_generated >= seq.request.max_new_tokens:
                return self._finish(seq, "length")
        return None

    def cancel(self, request_id: str) -> Optional[Sequence | Request]:
        """Take request `request_id` out: its Request when it was waiting, its Sequence (slot freed; the caller
        frees the caches) when it was running, None when it is not here."""
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                return req
        for seq in self.running:
            if seq.request.id == request_id:
                self._finish(seq, "cancelled")
                return seq
        return None

    def _finish(self, seq: Sequence, reason: str) -> str:
        seq.finish_reason = reason
        self.running.remove(seq)
        self._free_slots.append(seq.slot)
        self._free_slots.sort()
        return reason
