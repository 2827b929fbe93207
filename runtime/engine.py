"""The generation engine: `step` = schedule -> run -> postprocess, with or without DFlash.

    schedule     the scheduler picks decoding sequences and prefill chunks; the
                 speculative component (when the artifact has a drafter and the
                 run config allows it) chooses each decoding sequence's drafts
                 and proposes them
    run          the model runner packs the step and runs the target `forward`
                 once: verify rows ([pending, d1..dk] per decoding sequence,
                 k = 0 being a plain decode step) first, then prefill chunks
    postprocess  acceptance on the device for every sampled row (`spec_accept`;
                 with no drafts it is plain sampling), one copy to the host,
                 rejected KV rolled back, committed hidden rows handed to the
                 drafter's context, tokens appended, finished sequences freed

A greedy DFlash step without prompt chunks and with few enough sequences
runs schedule's drafts, run and postprocess's acceptance as one fused round
(`fused_round.py`: one CUDA graph on CUDA), then the same bookkeeping.

Overlap (`RunConfig.overlap`, on with CUDA graphs): a greedy plain decode step
(no drafts, no prompt chunk) is launched and left in flight: its argmax and
the copy of its tokens to the host are queued, and `step` returns without
waiting. The next step is scheduled (and the speculator chooses) with that
step still in flight when every running sequence is in it and none is at
its last token (`Sequence.in_flight` keeps their room for drafts right; a
slot an EOS frees in that step goes to a waiting request one step later).
If it is a plain step of those sequences only (not one admitted now: a
one-token prompt decodes at once) it takes their tokens
on the device (`ModelRunner.pack(head_tokens=)`), launches, and only then
reads the previous step's tokens back: the host's work of one step runs
while the device computes the one before. Otherwise the step in flight is
read back first (sequences it ended leave the scheduled batch) and the step
runs as usual. A sequence that ended on EOS in a step read back late wasted
one row in the step after it (its token is dropped; its caches were freed
and the device's writes to them come before any later use in stream order).

Greedy output is the same token for token with and without drafts, in both
layouts, batched or alone. Knows the model only through the artifact; never
imports mg.export. See docs/ARCHITECTURE.md section 6.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from mg.kernels.triton_argmax import argmax_last
from mg.manifests import constants as C

from .artifact import Artifact
from .config import RunConfig
from .cuda_graphs import GraphCounters
from .model_runner import ModelRunner, long_tensor, to_device
from .sampling import SamplingBatch, SamplingParams
from .scheduler import Batch, Request, RequestError, Scheduler, Sequence
from .spec_accept import accept
from .speculative import DFlashError, Proposer, SpecStats, Speculator, StepDrafts


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
    overlapped_steps: int = 0  # steps launched before the tokens of the step before were read back
    overlap_wasted_rows: int = 0  # rows of sequences that had ended (EOS, cancel) by the time they were read back


@dataclass
class _InFlight:
    """A greedy plain decode step launched and not read back (module docstring, Overlap)."""

    seqs: list  # its decode sequences, in row order
    rows: dict  # id(sequence) -> its row: which sequences are in it, and where
    tokens: torch.Tensor  # [len(seqs)] each one's next token, on the device
    host: torch.Tensor  # their copy on the way to the host (CUDA: pinned), or `tokens` itself on CPU
    ready: Optional["torch.cuda.Event"]  # recorded after that copy (CUDA)


class Engine:
    """Serves requests on one artifact; `run(requests)` returns one `Result` per request, in order.

    `proposer` replaces the artifact's drafter (tests: oracle or adversarial drafts)."""

    def __init__(self, artifact: Artifact, config: RunConfig = RunConfig(), proposer: Optional[Proposer] = None):
        self.artifact = artifact
        self.config = config
        speculate = config.dflash and artifact.has_draft
        if config.draft_block is not None and not artifact.has_draft:
            raise DFlashError(f"a draft block was given, but {artifact.directory} has no drafter")
        if proposer is not None and not speculate:
            raise DFlashError("a proposer was given, but this engine does not speculate (no drafter, or dflash off)")
        self.runner = ModelRunner(artifact, config, with_draft=speculate)
        self.spec = Speculator(self.runner, config, proposer) if speculate else None
        m, cache = artifact.manifest, self.runner.cache
        self.scheduler = Scheduler(max_write=m.kv.max_write, n_slots=cache.n_slots, capacity=m.kv.capacity,
                                   vocab_size=m.model.vocab_size, eos_ids=frozenset(m.model.eos_ids),
                                   cell_budget=m.kv.max_cells if m.kv.layout == C.LAYOUT_CELL else None)
        self.stats = EngineStats()
        self._batches: dict[tuple, SamplingBatch] = {}
        self._results: dict[str, Result] = {}
        self._overlap = config.overlapped
        self._inflight: Optional[_InFlight] = None
        self._pinned: list[Optional[torch.Tensor]] = [None, None]  # host buffers of the last two launched steps
        self._launches = 0

    # ------------------------------------------------------------------ public

    @property
    def cache(self):
        return self.runner.cache

    @property
    def spec_stats(self) -> SpecStats:
        return self.spec.stats if self.spec is not None else SpecStats()

    @property
    def graph_counters(self) -> GraphCounters:
        return self.runner.counters

    def warm_up(self, rehearse: Optional[bool] = None) -> None:
        """Capture the CUDA graphs of every bucket now rather than at first use, then `rehearse` (None: exactly
        when graphs are on). Without graphs and rehearsal it does nothing."""
        if self.spec is not None:
            self.spec.before_capture()
        self.runner.warm_up()
        if self.spec is not None:
            self.spec.warm_up()
        if self.config.graphs if rehearse is None else rehearse:
            self.rehearse()

    def rehearse(self) -> None:
        """Serve a few short throwaway requests through every kind of step a first request may take, so that
        the process's one-time work on each path (on CUDA: kernels loaded at their first launch, the first
        call of each eager operation) is paid now, not inside the first requests' time (docs/ARCHITECTURE.md
        section 6.1, "Rehearsal"). Steps with drafts first, when the engine speculates: a prompt step, a round of
        one greedy sequence (fused where it can be), a step that drafts beside two prompt chunks, then greedy and
        sampled sequences drafting together; then plain steps of a greedy and a sampled sequence, and of the
        greedy one alone. Nothing is learnt or counted (`Speculator.rehearsal`); results are dropped. Only on an
        idle engine (a no-op otherwise: requests or results of the caller's are pending), and requests that the
        artifact's limits refuse are left out."""
        if not self.scheduler.idle or self._inflight is not None or self._results:
            return
        m = self.artifact.manifest
        length = max(2, min(12, m.kv.capacity // 4, m.kv.max_write // 4))  # two prompts and drafts fit one step
        greedy = SamplingParams()
        sampled = SamplingParams(temperature=0.8, top_k=min(20, m.model.vocab_size), top_p=0.9, seed=0)

        def request(i: int, sampling: SamplingParams, new: int = length) -> Request:
            prompt = tuple((101 + 37 * (i * length + j)) % m.model.vocab_size for j in range(length))
            return Request(f"rehearsal-{i}", prompt, new, sampling, ignore_eos=True)

        def offer(batch: list[Request]) -> None:
            for req in batch:
                try:
                    self.submit(req)
                except RequestError:
                    pass

        def serve(first: list[Request], then: list[Request] = ()) -> None:
            offer(first)
            if then:  # admitted after the first ones' prompt step and a step of theirs alone
                for _ in range(2):
                    if not self.scheduler.idle:
                        self.step()
                offer(then)
            while not self.scheduler.idle:
                self.step()
            self.drain()
            self._results.clear()

        stats, self.stats = self.stats, EngineStats()
        try:
            if self.spec is not None:
                with self.spec.rehearsal(drafts=True):
                    serve([request(0, greedy)], [request(1, greedy), request(2, sampled)])
            with self.spec.rehearsal(drafts=False) if self.spec is not None else contextlib.nullcontext():
                serve([request(3, greedy), request(4, sampled, length // 2)])
        finally:
            self.stats = stats

    def submit(self, request: Request) -> None:
        """Queue a request (RequestError when it can never be served)."""
        self.scheduler.submit(request)
        self.stats.prompt_tokens += len(request.prompt)

    def cancel(self, request_id: str) -> bool:
        """Stop serving request `request_id` now: out of the queue, or its slot, cells and draft state freed
        before the next step. False when it is not queued or running (finished, or never submitted)."""
        found = self.scheduler.cancel(request_id)
        if isinstance(found, Sequence):
            self._free(found)
        return found is not None

    def take_finished(self) -> list[Result]:
        """Results of the requests that finished since the last call, in finishing order."""
        done = list(self._results.values())
        self._results.clear()
        return done

    def run(self, requests: Iterable[Request]) -> list[Result]:
        """Serve `requests` to the end and return one Result per request, in order (ids must be unique)."""
        requests = list(requests)
        done: dict[str, Result] = {}
        self.serve(requests, lambda r: done.__setitem__(r.id, r))
        return [done[r.id] for r in requests]

    def serve(self, requests: Iterable[Request], on_result: Callable[[Result], None]) -> None:
        """Serve `requests` to the end, handing each Result to `on_result` as soon as it is known: refused
        requests first, then the others as they finish. Ids must be unique (ValueError before any work)."""
        requests = list(requests)
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"request id {dup!r} appears more than once; ids must be unique")
        for req in requests:
            try:
                self.submit(req)
            except RequestError as e:
                on_result(Result(req.id, (), None, str(e)))
        t0 = time.perf_counter()
        try:
            while not self.scheduler.idle:
                self.step()
                for result in self.take_finished():
                    on_result(result)
            self.drain()  # a step of sequences that all ended on EOS may still be in flight
        finally:
            self.stats.wall_s += time.perf_counter() - t0

    def drain(self) -> None:
        """Read back the step in flight, if any (module docstring, Overlap): afterwards every sequence's tokens
        are on the host. `step` does this itself whenever the next step cannot chain."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._read_back(inflight)

    def step(self) -> None:
        t0 = time.perf_counter()
        chained = None
        choose = self._choose if self.spec is not None else None
        if self._inflight is not None and self._may_chain():
            # Scheduled with the step in flight: the choice needs no token, and runs while the device computes.
            batch = self.scheduler.schedule(choose)
            rows = self._chain_rows(batch)
            if rows is not None:
                chained, self._inflight = self._inflight, None
            else:  # drafts, and sequences admitted now, need the tokens on the host: read back first
                self.drain()
                batch = self._without_finished(batch)
                if not batch:  # every sequence ended in the step read back
                    return
        else:
            if self._inflight is not None:
                self.drain()
                if self.scheduler.idle:  # that step ended every sequence
                    return
            batch = self.scheduler.schedule(choose)
        if not batch:
            raise RuntimeError("scheduler produced an empty step with requests pending")  # invariant
        if self.spec is not None and self.spec.fuses(batch):
            self._fused_step(batch)
            rows = len(batch.decode) + sum(batch.n_drafts)  # the forward rows the unfused step would have had
        else:
            drafts = (self.spec.propose(batch.decode, batch.n_drafts) if self.spec is not None
                      else StepDrafts.none(len(batch.decode)))
            # The rows whose commit does not wait for acceptance: the forward writes them to the draft context.
            known = self.spec.reserve_known(batch.decode, drafts.ks, batch.prefill) if self.spec is not None else None
            head = self._chained_tokens(chained, rows) if chained is not None else None
            step = self.runner.pack(batch.decode, drafts.ks, batch.prefill, drafts.tokens, known, head)
            out = self.runner.forward(step)
            if self._overlap and not batch.prefill and not any(drafts.ks) and self._sampling_batch(
                    batch.decode, out[0].device).all_greedy:
                self._launch(batch.decode, out[0])
                if self.spec is not None:  # shadow probes: their host work before waiting on the step before
                    self.spec.launch_shadows()
                if chained is not None:
                    self.stats.overlapped_steps += 1
                    self._read_back(chained)
                if self.spec is not None:
                    self.spec.end_commits()
            else:
                if chained is not None:  # invariant: a chained step is greedy, as the step it chains on
                    raise RuntimeError("a step chained on the device's tokens was not launched as a plain step")
                hidden = out[1] if len(out) > 1 else None
                accepted, new_tokens = self._accept(step.groups, drafts, out[0])
                self._postprocess(batch, step, drafts, accepted, new_tokens, hidden)
            rows = step.n
        self.stats.steps += 1
        if self.spec is not None:
            self.spec.step_done(time.perf_counter() - t0, rows, prefill=bool(batch.prefill))

    # ------------------------------------------------------------------ overlap (module docstring)

    def _may_chain(self) -> bool:
        """May the next step be scheduled with the step in flight, and run on its tokens if it is a plain step?
        Only if every running sequence is in that step and none of their tokens in flight is its last (such a
        sequence ends when read back, and its slot goes to a waiting request at once). Requests may wait: if the
        scheduler admits one, the step has a prompt chunk and reads the step in flight back first; a slot that
        an EOS in the step in flight frees is seen by the step after."""
        running = self.scheduler.running
        if not running:
            return False
        members = self._inflight.rows  # running only loses members while a step is in flight
        for seq in running:
            if id(seq) not in members or seq.n_generated + 1 >= seq.request.max_new_tokens:
                return False
        return True

    @staticmethod
    def _without_finished(batch: Batch) -> Batch:
        """`batch`, scheduled with a step in flight, less the sequences that ended when it was read back."""
        if all(seq.finish_reason is None for seq in batch.decode):
            return batch
        kept = [(seq, k) for seq, k in zip(batch.decode, batch.n_drafts) if seq.finish_reason is None]
        return Batch([seq for seq, _ in kept], [k for _, k in kept], batch.prefill)

    def _chain_rows(self, batch: Batch) -> Optional[list[int]]:
        """For a plain step of sequences all in the step in flight: each one's row there. None otherwise: a
        prompt chunk or drafts, or a sequence admitted now (a one-token prompt is a decode sequence at once)."""
        if batch.prefill or any(batch.n_drafts):
            return None
        row = self._inflight.rows
        rows = [row.get(id(seq)) for seq in batch.decode]
        return None if None in rows else rows

    @staticmethod
    def _chained_tokens(chained: _InFlight, rows: list[int]) -> torch.Tensor:
        """The device tokens of a chained step's decode rows: `rows` of the step in flight's."""
        if rows == list(range(len(chained.seqs))):  # the same sequences in the same order
            return chained.tokens
        return chained.tokens.index_select(0, to_device(long_tensor(rows), chained.tokens.device))

    def _launch(self, decode: list, logits: torch.Tensor) -> None:
        """Leave a greedy plain step in flight: each sequence's token is its row's argmax, on the device, and its
        copy to the host is queued; the step's token-independent bookkeeping is done now."""
        b = len(decode)
        tokens = argmax_last(logits if logits.shape[0] == b else logits.narrow(0, 0, b))
        ready = None
        host = tokens
        if tokens.device.type == "cuda":  # two pinned buffers, alternating: the chained step's and this one's
            i = self._launches % 2
            if self._pinned[i] is None or self._pinned[i].shape[0] < b:
                self._pinned[i] = torch.empty(max(b, self.cache.n_slots), dtype=torch.long, pin_memory=True)
            host = self._pinned[i][:b]
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tokens.device))  # the stream of the copy, whatever device is current
        for seq in decode:
            seq.n_cached += 1
            seq.in_flight += 1
        if self.spec is not None:
            self.spec.observe_plain(decode)
        self._inflight = _InFlight(list(decode), {id(seq): i for i, seq in enumerate(decode)}, tokens, host, ready)
        self._launches += 1

    def _read_back(self, inflight: _InFlight) -> None:
        """The tokens of a step left in flight, to their sequences (waiting for them if need be); sequences that
        ended since (EOS in the step before, a cancel) drop theirs."""
        if inflight.ready is not None:
            inflight.ready.synchronize()
        for seq, token in zip(inflight.seqs, inflight.host.tolist()):
            seq.in_flight -= 1
            if seq.finish_reason is None:
                self._append(seq, [token])
            else:
                self.stats.overlap_wasted_rows += 1

    def _choose(self, decode: list, rows_left: int, prompts: bool) -> list[int]:
        """The speculator's drafts, told whether prompt chunks may join the step (the scheduler has admitted
        this step's requests when it asks)."""
        return self.spec.choose(decode, rows_left, prefill=prompts)

    # ------------------------------------------------------------------ run and postprocess

    def _accept(self, groups: list, drafts: StepDrafts, logits: torch.Tensor):
        """Accept drafts and sample the next token of every group, on the device; one copy to the host.
        A group without drafts (a plain decode step, a prompt's last chunk) is plain sampling."""
        b = len(groups)
        if b == 0:
            return [], []
        width = max(n for _, _, n, _ in groups)
        seqs = [g[0] for g in groups]
        dev = logits.device
        sampling = self._sampling_batch(seqs, dev)
        if width == 1 and groups[-1][1] == b - 1 and sampling.all_greedy:
            # Greedy with no drafts (a plain step): group i's logits are row i, and acceptance is its argmax.
            # Two calls instead of about fifteen: on a GPU serving a small model the host's calls are the step.
            tokens = argmax_last(logits if logits.shape[0] == b else logits.narrow(0, 0, b)).tolist()
            return [0] * b, [[t] for t in tokens]
        # Logits rows of each group (its last row repeated up to the width), drafts per group and output
        # counters: one host-to-device copy, which never waits for the device.
        host = [first + min(j, n - 1) for _, first, n, _ in groups for j in range(width)]
        host += [n - 1 for _, _, n, _ in groups] + [s.n_generated for s in seqs]
        index, n_draft, counters = to_device(torch.tensor(host, dtype=torch.long), dev).split([b * width, b, b])
        draft = torch.zeros(b, width - 1, dtype=torch.long, device=dev)  # past a group's k: ignored by accept
        if drafts.tokens is not None and width > 1:
            cols = min(width - 1, drafts.tokens.shape[1])
            draft[:len(drafts.ks), :cols] = drafts.tokens[:, :cols]  # decode groups come first
        result = accept(draft, None, logits.index_select(0, index).view(b, width, -1),
                        n_draft, sampling, counters)
        host = torch.cat([result.n_accepted[:, None], result.tokens], dim=1).tolist()  # the one copy per step
        return [row[0] for row in host], [row[1:2 + row[0]] for row in host]

    def _postprocess(self, batch: Batch, step, drafts, accepted, new_tokens, hidden) -> None:
        """After the step's host copy: sequences advance, and the drafting ones commit their verified rows
        (the forward wrote the others: `Speculator.reserve_known`)."""
        if not any(drafts.ks):  # a plain step (the common step where the drafter does not pay): nothing to undo
            for seq in batch.decode:
                seq.n_cached += 1
            if self.spec is not None:
                self.spec.observe_plain(batch.decode)
        else:
            committed_rows, owners = [], []  # rows of drafting sequences whose hidden state enters the draft context
            for i, seq in enumerate(batch.decode):
                k, a = drafts.ks[i], accepted[i]
                self._advance(seq, k, a)
                if k and self.spec is not None:
                    first = step.groups[i][3]
                    committed_rows += range(first, first + a + 1)
                    owners.append((seq.slot, a + 1))
            if owners:
                self.spec.commit(hidden, committed_rows, owners)
        for chunk in batch.prefill:
            chunk.seq.n_cached += chunk.length
        self._append_tokens([g[0] for g in step.groups], new_tokens)

    def _fused_step(self, batch: Batch) -> None:
        """A greedy DFlash round of the decoding sequences as one fused call (`fused_round.py`): one copy to
        the host, then the same bookkeeping as an unfused step."""
        decode, ks = batch.decode, batch.n_drafts
        out, hidden = self.spec.run_round(decode, ks)
        host = out.tolist()  # the one copy per step
        accepted = [row[0] for row in host]
        for seq, k, a in zip(decode, ks, accepted):
            self._advance(seq, k, a)
        self.spec.round_done(decode, ks, accepted, hidden)
        self._append_tokens(decode, [row[1:2 + row[0]] for row in host])

    def _advance(self, seq: Sequence, k: int, accepted: int) -> None:
        """A decoding sequence verified k drafts and accepted `accepted`: its pending token and those drafts
        are committed, the target KV of the rejected ones rolled back, the round observed."""
        seq.n_cached += accepted + 1
        if accepted < k:
            self.runner.cache.rewind(seq.slot, seq.n_cached)
        if self.spec is not None:
            self.spec.observe(seq, k, accepted)

    def _append_tokens(self, seqs: list, new_tokens: list) -> None:
        """Each sequence's new tokens; finished sequences are freed. Then context appends that are due."""
        for seq, toks in zip(seqs, new_tokens):
            self._append(seq, toks)
        if self.spec is not None:
            self.spec.end_commits()

    def _append(self, seq: Sequence, tokens: list) -> None:
        before = len(seq.tokens)
        reason = self.scheduler.append(seq, tokens)
        self.stats.generated_tokens += len(seq.tokens) - before
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._free(seq)
        self._results[seq.request.id] = Result(seq.request.id, tuple(seq.generated), reason)

    def _free(self, seq: Sequence) -> None:
        self.runner.cache.release(seq.slot)
        if self.spec is not None:
            self.spec.release(seq.slot)

    def _sampling_batch(self, seqs: list[Sequence], device: torch.device) -> SamplingBatch:
        """The rows' SamplingBatch, built once per distinct parameter tuple (saves host-to-device copies
        in steady decoding)."""
        key = tuple(s.request.sampling for s in seqs)
        batch = self._batches.get(key)
        if batch is None:
            if len(self._batches) >= 256:
                self._batches.clear()
            batch = self._batches[key] = SamplingBatch.from_params(key, device=device)
        return batch
