"""A whole DFlash round as one call: draft -> verify -> accept -> draft context, one CUDA graph per bucket.

The unfused round (docs/ARCHITECTURE.md section 6.5) is three method calls with host work between them:
`draft_block`, then the drafts packed into the target `forward`'s verify rows, then acceptance, and the
committed rows' hidden states appended to the draft cache by a later `draft_append`. On a GPU each call is
a graph replay of a few hundred microseconds of small kernels, and the host work between them costs as much
again. `FusedRound` runs the round for up to `limit` decoding sequences ("members") as one function of one
packed index tensor, captured in one CUDA graph per bucket of members (1, 2, 4, ...):

    1. `draft_block` of every drafting member's block [pending, mask, ...] anchored at its pending
       token's position; argmax drafts stay on the device;
    2. the target `forward` of `block` rows per member: [pending, d1 .. d_{block-1}]; a member verifies
       only its first 1 + cap rows (cap = its chosen k; the other rows are padding on the scratch slot);
    3. greedy acceptance (`spec_accept.accept`): the longest prefix of drafts, up to cap, equal to the
       target's argmax, then the target's argmax;
    4. `draft_append` of the verified rows' hidden states of drafting members at their positions.

Step 4 appends every verified row, accepted or not: the drafter reads only positions before a block's
anchor (`mg::draft_attend`), so rows past the committed length are never read, and the host rewinds the
draft cache to the committed length after the round, as it does the target cache. A drafting member's
context must be complete before the round (its waiting rows appended: `Speculator` does that). Non-drafting
members (cap 0) are plain decode steps inside the round: no draft rows, their one row's hidden state is
left in the output for the caller to commit.

Output: [bucket, block + 1] int64 per member: accepted drafts, then the committed tokens (-1 after), and
the hidden states [bucket * block, width]; both are static buffers overwritten by the next call. The host
learns the outcome from one copy of the live members' rows. Greedy only: sampled requests take the
unfused round.

Without CUDA graphs (CPU; `RunConfig.fused_rounds=True` forces it there) the same function runs eagerly:
that is the path the CPU tests compare with the unfused round and with target-only decoding.

Knows the model runner's methods, caches and op table, and the acceptance step; nothing of scheduling or
adaptive speculation. Never imports mg.export.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from mg.kernels.triton_argmax import argmax_last
from mg.manifests import constants as C

from .cuda_graphs import GraphRunner, bucket_for, buckets
from .model_runner import ModelRunner, long_tensor, time_buckets
from .sampling import SamplingBatch, SamplingParams
from .spec_accept import accept

ROUND = "dflash_round"  # the call log's name for fused rounds (of one block: `FusedRound.name`)


@dataclass(frozen=True)
class Member:
    """One decoding sequence of a fused round: its pending token, the position and slot it goes to, and the
    most drafts it may accept (0: a plain decode step in the round)."""

    pending: int
    position: int
    slot: int
    cap: int


class FusedRound:
    """One DFlash round per call for up to `limit` members; see the module docstring."""

    def __init__(self, runner: ModelRunner, block: int):
        self.runner, self.block = runner, block
        self.name = f"{ROUND}_{block}"  # the call log's and the cost tables' name for rounds of this block
        self.t = runner.block_size  # the exported drafter's block (its drafts: t - 1 >= block - 1)
        plans = runner.plans
        self.limit = min(plans[C.METHOD_DRAFT_BLOCK].limit, plans[C.METHOD_FORWARD].limit // block,
                         plans[C.METHOD_DRAFT_APPEND].limit // block)
        self._greedy: dict[int, SamplingBatch] = {}
        self._graphs: Optional[GraphRunner] = None
        if runner.config.graphs and self.limit >= 1:
            self._graphs = GraphRunner(self._round, lambda b: [self._pack([], b)[0].to(runner.device)],
                                       self._version, runner.counters)

    # ------------------------------------------------------------------ the packed inputs

    def _sizes(self, b: int) -> list[int]:
        k = self.block
        # pending | block positions | block slots | verify positions | verify slots | caps | append positions | append slots
        return [b, b * self.t, b, b * k, b * k, b, b * k, b * k]

    def _pack(self, members: list[Member], bucket: int) -> tuple[torch.Tensor, list, list]:
        """The round's index tensor on the host (members first, then padding members), and the rows it writes as
        spans (slot, first position, rows) for admission: verify rows in the target cache, append rows in the
        draft cache. Built as lists, one tensor at the end: a round's host work is part of its time."""
        k, t = self.block, self.t
        ts, ds = self.runner.cache.scratch_slot, self.runner.draft_cache.scratch_slot
        pending, blk_pos, blk_slot, ver_pos, ver_slot, caps, app_pos, app_slot = [], [], [], [], [], [], [], []
        verify, append = [], []
        blank_blk = list(range(t))
        for m in members:
            pending.append(m.pending)
            caps.append(m.cap)
            a = m.position
            if m.cap > 0:  # drafting: its block at its position; rows 0..cap verified and appended
                v = min(m.cap, k - 1) + 1
                rest = k - v
                blk_pos += range(a, a + t)
                blk_slot.append(m.slot)
                ver_pos += range(a, a + v)
                ver_pos += [0] * rest
                ver_slot += [m.slot] * v + [ts] * rest
                app_pos += range(a, a + v)
                app_pos += [0] * rest
                app_slot += [m.slot] * v + [ds] * rest
                verify.append((m.slot, a, v))
                append.append((m.slot, a, v))
            else:  # a plain step in the round: its one row verified, nothing drafted or appended
                blk_pos += blank_blk
                blk_slot.append(ds)
                ver_pos += [a] + [0] * (k - 1)
                ver_slot += [m.slot] + [ts] * (k - 1)
                app_pos += [0] * k
                app_slot += [ds] * k
                verify.append((m.slot, a, 1))
        pad = bucket - len(members)
        if pad:
            pending += [0] * pad
            caps += [0] * pad
            blk_pos += blank_blk * pad
            blk_slot += [ds] * pad
            ver_pos += [0] * (k * pad)
            ver_slot += [ts] * (k * pad)
            app_pos += [0] * (k * pad)
            app_slot += [ds] * (k * pad)
        packed = long_tensor(pending, blk_pos, blk_slot, ver_pos, ver_slot, caps, app_pos, app_slot)
        return packed, verify, append

    def _split(self, packed: torch.Tensor, b: int) -> list[torch.Tensor]:
        return list(packed.split(self._sizes(b)))

    # ------------------------------------------------------------------ the round

    def _round(self, inputs: list) -> list:
        """The round on device inputs of one bucket (captured in a graph on CUDA): [out, hidden]."""
        (packed,) = inputs
        b = packed.shape[0] // sum(self._sizes(1))
        pending, blk_pos, blk_slot, ver_pos, ver_slot, cap, app_pos, app_slot = self._split(packed, b)
        r, k, dev = self.runner, self.block, packed.device
        drafts = self.draft(pending, blk_pos.view(b, self.t), blk_slot)[:, :k - 1]
        tokens = torch.cat([pending[:, None], drafts], 1).reshape(-1)
        rows = torch.arange(b * k, device=dev)
        logits, hidden = r.run_method(C.METHOD_FORWARD, [tokens, ver_pos, ver_slot, rows])[:2]
        zeros = torch.zeros(b, dtype=torch.long, device=dev)
        result = accept(drafts, None, logits.view(b, k, -1), cap, self._greedy_batch(b, dev), zeros)
        r.run_method(C.METHOD_DRAFT_APPEND, [hidden, app_pos, app_slot])
        return [torch.cat([result.n_accepted[:, None], result.tokens], 1), hidden]

    def draft(self, pending: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Argmax drafts [b, t - 1] of the blocks [pending, mask, ...] at `positions` [b, t] of draft `slots`."""
        blk = torch.cat([pending[:, None], torch.full((pending.shape[0], self.t - 1), self.runner.mask_token,
                                                      dtype=torch.long, device=pending.device)], 1)
        return argmax_last(self.runner.run_method(C.METHOD_DRAFT_BLOCK, [blk, positions, slots])[0])

    def _greedy_batch(self, b: int, device: torch.device) -> SamplingBatch:
        if b not in self._greedy:
            self._greedy[b] = SamplingBatch.from_params([SamplingParams()] * b, device=device)
        return self._greedy[b]

    def _version(self) -> tuple[int, int]:
        return self.runner.cache.storage_version(), self.runner.draft_cache.storage_version()

    def run(self, members: list[Member]) -> tuple[torch.Tensor, torch.Tensor]:
        """The round of `members` (1 .. limit): admits its rows in both caches (host), runs it (graph replay on
        CUDA), returns (out [len(members), block + 1], hidden [bucket * block, width]) on the device."""
        n = len(members)
        bucket = bucket_for(n, self.limit)
        if n == 0 or bucket is None:
            raise ValueError(f"a fused round of {n} sequences; allowed: 1..{self.limit}")
        t0 = time.perf_counter()
        out, hidden = self._launch(*self._pack(members, bucket), bucket)
        log = self.runner.call_log
        if log is not None:
            log.append((self.name, n, time.perf_counter() - t0))
        return out[:n], hidden

    # ------------------------------------------------------------------ warm-up and costs

    @property
    def captured(self) -> tuple[int, ...]:
        """Buckets of members with a live CUDA graph now (empty without graphs)."""
        return self._graphs.captured if self._graphs is not None else ()

    def warm_up(self) -> None:
        """Capture every bucket's graph now, on padding-only rounds (nothing to do without graphs)."""
        if self._graphs is not None:
            for b in buckets(self.limit):
                self._run_blank(b)

    def _launch(self, packed: torch.Tensor, verify: list, append: list, bucket: int) -> list:
        """Admit the packed round's verify rows (target cache) and append rows (draft cache) on the host,
        then run it: the bucket's graph replay, or the round eagerly without graphs. -> [out, hidden]."""
        self.runner.cache.declare_spans(verify)
        self.runner.draft_cache.declare_spans(append)
        if self._graphs is not None:
            return self._graphs.run(bucket, [packed])
        return self._round([packed.to(self.runner.device)])

    def _run_blank(self, b: int) -> None:
        self._launch(*self._pack([], b), b)

    def measure(self, reps: int = 3) -> dict[int, float]:
        """Seconds per round at each bucket, on padding-only rounds (as `ModelRunner.measure` times methods)."""
        return time_buckets(self.runner.device, buckets(self.limit), self._run_blank, reps)

