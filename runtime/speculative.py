"""DFlash speculative decoding as a component of the engine: choose -> propose -> (verify) -> commit.

The engine asks, each step, for:
  1. `choose(decode, rows_left)`: how many drafts k_i each decoding sequence
     verifies this round (0 = a plain decode step for it);
  2. `propose(decode, ks)`: the drafts, from one `draft_block` call for the
     sequences with k_i > 0, anchored at their pending token (whose KV is not
     written yet) and conditioned on their committed context;
  3. `reserve_known` before the forward (the rows of sequences that did not
     draft and of prompt chunks: the forward writes their hidden states to
     the rows it names), `commit` after acceptance (drafting sequences'
     committed rows) and `observe` (the round's accepted count).

Draft context is appended lazily: committed hidden rows wait per sequence
in one device buffer (written by the forward, or by one scatter after
acceptance, or a copy per sequence for one or two sequences), and enter
the draft cache (one gather, then `draft_append` for all sequences that need it)
just before that sequence's next draft, or once a sequence has `flush_rows`
waiting (one to four `draft_append` calls' worth, within WAITING_BYTES). A stretch of k = 0 rounds therefore
costs no drafter work, and the context is always complete when drafting
resumes. Only rows of committed tokens ever enter the draft cache.

Adaptive speculation (`RunConfig.speculation == "adaptive"`): the expected
committed tokens of a round are 1 + sum_{j<=k} prod_{l<=j} a_l per sequence,
with a_l the online estimate of P(draft l accepted | drafts < l accepted);
the round's time is the target `forward` at its row count plus, when anyone
drafts, `draft_block` at the drafting batch and `draft_append` of the rows
waiting. Those times come from the model runner's per-bucket measurements
on blank inputs (taken once per program, device and mode, when the first
engine starts, and kept in the tools' cache folder for later processes: the
same program on the same device, torch and runtime code skips the ~1 s of
measuring), moved towards every timed call where calls are synchronous
(CPU), plus a residual for what no table holds (host work per step, see
below). Draft rows go one at a time, highest expected gain first (`prod_{l<=j} a_l` decreases in j, so each sequence's rows go in
order), and the round keeps the prefix with the most tokens per second, so
each sequence drafts only where it pays. Estimates: per sequence, decayed
counts shrunk towards a global estimate (all sequences), itself shrunk
towards a prior. A sequence kept at k = 0 still probes with a full round now
and then (`ProbeSchedule`: a few drafts, or as many as ride free in the
step's bucket; the wait doubles after each probe that did not pay, and is
never shorter than keeps probing within PROBE_BUDGET of the sequence's plain
decoding time, by the probe's predicted and then measured cost: a first
probe's prediction is scaled by how far earlier probes of the program took
longer than predicted), so it notices when the text becomes predictable again. A greedy sequence may probe
in the shadow instead: one `draft_block` call for it
alone, left in flight after the step, whose drafts are compared with the
tokens the target's next steps make, which is exactly what a round anchored
there would have accepted (greedy acceptance takes a draft iff it is the
target's argmax given the drafts before it). It costs one draft call and
its context append, no verify rows and no round for the other sequences of
a batch, and never waits for a step in flight: a chained plain step stays
chained. Its outcome is observed like a round's once those tokens exist.
Shadow probes are opt-in (`RunConfig.probes`): on an H100 their host work
cost more than round probes saved (docs/ARCHITECTURE.md section 6.5).

Fused rounds (`fused_round.py`, on with CUDA graphs): when a step can run
its whole round as one call (every decoding sequence greedy, few enough for
a round, no prompt chunks), the engine asks `run_round` instead of propose ->
forward -> accept, and `round_done` afterwards. A fused round verifies its
whole block for every member, drafts or not, so adaptive speculation's
choice there is per step: a plain step, or a round of one of the blocks it
holds rounds for (the exported block, and a half and a quarter of it: fewer
rows per member, so cheaper rounds and more members per round), whichever
has the most expected tokens per second by a measured table of whole rounds
per block and bucket; every member of a round drafts all it may.

Host work per step is learnt apart for plain steps, steps with separate draft
calls and fused rounds, and per power-of-two bucket of decoding sequences, as
the median of the last few such steps, so one slow step (a first call's lazy
work) cannot price a kind out for long, and no higher than an unseen kind's
until three were timed; a plain step's samples expire after 64 timed steps at
their bucket, so a plain step priced high by old samples is measured again. A
step's time leaves out the host time of context
appends (rows committed earlier); steps with prompt chunks, CUDA graph
captures or a sequence that finished are not timed. A plain step chosen with
a margin is kept for a few steps without pricing the rounds again.

Knows the model runner, the scheduler's records and the run config; nothing
of sampling math (`spec_accept.py`) or mg.export. See docs/ARCHITECTURE.md
section 6.5.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import contextlib
import functools
import hashlib
import heapq
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Protocol

import torch

import mg.kernels as mg_kernels
from mg.kernels.triton_argmax import argmax_last
from mg.manifests import constants as C
from mg.manifests.values import cache_root, write_cache_file

from .config import SPECULATION_FIXED, RunConfig
from .fused_round import FusedRound, Member
from .model_runner import HiddenSink, ModelRunner, to_device

log = logging.getLogger("mg.runtime")


class DFlashError(ValueError):
    """DFlash cannot run as asked (no drafter, bad draft block)."""


class Proposer(Protocol):
    def propose(self, seqs: list, ks: list[int]) -> "torch.Tensor | list[list[int]]":
        """Drafts d1..dk for each sequence (k = ks[i] >= 1), from its pending token and committed context: a
        tensor [len(seqs), >= max(ks)] (row i's first ks[i] entries; may stay on the device), or lists."""


@dataclass
class StepDrafts:
    """The drafts of one step, for the decoding sequences in order: k per sequence (0 = none) and a tensor
    [len(ks), width] on the device whose row i starts with sequence i's k drafts (the rest is filler), or None
    when nobody drafts. The tokens stay on the device: the verify rows are filled there, and the host learns
    the accepted ones from the step's one acceptance copy."""

    ks: list[int]
    tokens: Optional[torch.Tensor]

    @classmethod
    def none(cls, n: int) -> "StepDrafts":
        return cls([0] * n, None)


@dataclass
class SpecStats:
    rounds: int = 0  # sequence-rounds that verified at least one draft
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_hist: list = field(default_factory=list)  # [a] = rounds that accepted a drafts
    chosen_k_hist: list = field(default_factory=list)  # [k] = decode sequence-steps that verified k drafts
    stalls: int = 0  # plain steps whose time was left out of the host-work windows as stalls (`CostModel.record`)
    shadow_probes: int = 0  # drafts made for a sequence at a plain step and compared with its next tokens
    shadow_accepted: int = 0  # of their drafts, those a round would have accepted
    probes: int = 0  # rounds a sequence kept at k = 0 drafted in to check on the drafter (round probes)
    probes_paid: int = 0  # of those, the ones whose accepted drafts paid for their time (probes of untimed steps,
    # with prompt chunks, graph captures or a sequence that finished, are not judged: `step_done`)

    @property
    def mean_acceptance_length(self) -> float:
        """Accepted drafts + 1 (the correction or bonus token) per round that drafted."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0


def _bump(hist: list, i: int, count: int = 1) -> None:
    hist.extend([0] * (i + 1 - len(hist)))
    hist[i] += count


class DraftModelProposer:
    """The artifact's DFlash drafter: argmax drafts from one `draft_block` call (q = one-hot)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def propose(self, seqs: list, ks: list[int]) -> torch.Tensor:
        return self.block_at(seqs, [s.n_cached for s in seqs])

    def block_at(self, seqs: list, anchors: list[int]) -> torch.Tensor:
        """Argmax drafts [B, T-1] (left on the device) of blocks anchored at each sequence's last known token,
        at position `anchors[i]` (its pending token's: `n_cached`, or earlier while steps are in flight)."""
        t = self.runner.block_size
        tokens = torch.full((len(seqs), t), self.runner.mask_token, dtype=torch.long)
        tokens[:, 0] = torch.tensor([s.tokens[-1] for s in seqs])
        positions = torch.tensor(anchors, dtype=torch.long)[:, None] + torch.arange(t)[None, :]
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long)
        logits = self.runner.draft_block(tokens, positions, slots)
        return argmax_last(logits)


class AcceptanceModel:
    """Online estimates of a_j = P(draft j accepted | drafts < j accepted), j = 1..K, per slot.

    Per slot: decayed (hits, trials) per draft row, shrunk towards the global estimate with `strength`
    pseudo-trials. Global: decayed counts over every round of every sequence, shrunk towards `prior`;
    `global_counts` ([hits], [trials], k_max long) lets engines on the same drafter share them (what the
    drafter achieves on this program is not a property of one engine: a new engine starts from what earlier
    ones saw, not from the prior)."""

    def __init__(self, n_slots: int, k_max: int, prior: float = 0.6, strength: float = 1.5, decay: float = 0.9,
                 global_decay: float = 0.98, global_counts: Optional[tuple[list, list]] = None):
        self.k_max, self.prior, self.strength = k_max, prior, strength
        self.decay, self.global_decay = decay, global_decay
        self._hits = [[0.0] * k_max for _ in range(n_slots)]
        self._trials = [[0.0] * k_max for _ in range(n_slots)]
        if global_counts is None:
            global_counts = ([0.0] * k_max, [0.0] * k_max)
        self._g_hits, self._g_trials = global_counts
        # Cleared by any observation: None -> global rates; slot -> survival over every row; (slot, k) -> its
        # first k; (slot, k, "sum") -> their sum.
        self._memo: dict = {}
        self.version = 0  # counts the changes of the estimates (observations, resets)

    def global_rates(self) -> list[float]:
        g = self._memo.get(None)
        if g is None:
            s = self.strength
            g = self._memo[None] = [(h + s * self.prior) / (n + s) for h, n in zip(self._g_hits, self._g_trials)]
        return g

    def _rows(self, slot: int) -> list[float]:
        """`slot`'s survival over all k_max rows, computed once per observation: the choice asks for several k
        of every sequence (a round of each block, the draft search)."""
        out = self._memo.get(slot)
        if out is None:
            g, s, hits, trials = self.global_rates(), self.strength, self._hits[slot], self._trials[slot]
            out, p = [], 1.0
            for j in range(self.k_max):
                p *= (hits[j] + s * g[j]) / (trials[j] + s)
                out.append(p)
            self._memo[slot] = out
        return out

    def survival(self, slot: int, k: int) -> list[float]:
        """P(at least j drafts accepted) for j = 1..k, k <= k_max (shared: do not modify). Kept until the next
        observation: while nobody drafts (steps the drafter does not help) the estimates do not change."""
        out = self._memo.get((slot, k))
        if out is None:
            out = self._memo[(slot, k)] = self._rows(slot)[:k]
        return out

    def expected(self, slot: int, k: int) -> float:
        """Expected accepted drafts of `slot` in a round of k: the sum of `survival(slot, k)` (kept as long)."""
        key = (slot, k, "sum")
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = sum(self.survival(slot, k))
        return out

    def observe(self, slot: int, k: int, accepted: int) -> None:
        """A round of k >= 1 drafts accepted `accepted`: rows 1..accepted hit, row accepted+1 missed."""
        hits, trials = self._hits[slot], self._trials[slot]
        self._memo.clear()
        self.version += 1
        for j in range(min(accepted + 1, k)):
            hit = 1.0 if j < accepted else 0.0
            hits[j] = hits[j] * self.decay + hit
            trials[j] = trials[j] * self.decay + 1.0
            self._g_hits[j] = self._g_hits[j] * self.global_decay + hit
            self._g_trials[j] = self._g_trials[j] * self.global_decay + 1.0

    def reset(self, slot: int) -> None:
        self._memo.clear()
        self.version += 1
        self._hits[slot] = [0.0] * self.k_max
        self._trials[slot] = [0.0] * self.k_max


class ProbeSchedule:
    """When a sequence the estimates keep at k = 0 drafts anyway, to find out whether drafting pays again.

    A sequence probes after `max(wait, floor)` plain steps. `wait` starts at `start`, doubles (up to `cap`)
    after a probe that did not pay for its time and goes back to `start` after one that did, so probing a
    drafter that stays useless costs less and less. `floor` keeps the cost of probing within a budget of the
    sequence's plain decoding time (see `Speculator`): where a probe costs many plain steps (a large batch on
    a CPU, whose every row costs time) probes are rare from the start, whatever `wait` says."""

    def __init__(self, n_slots: int, start: int = 8, cap: int = 64):
        self.start, self.cap = start, cap
        self._wait = [start] * n_slots
        self._floor = [0.0] * n_slots  # the budget's wait measured at the slot's last probe
        self._since = [0] * n_slots  # plain steps since the slot last drafted

    def due(self, slot: int, share: float = 1.0, floor: float = 0.0) -> bool:
        """Has `slot` waited `share` of its wait (at least `floor` steps, or the floor its last probe set)?"""
        return self._since[slot] >= share * max(self._wait[slot], floor, self._floor[slot])

    def steps_until_due(self, slot: int, floor: float = 0.0) -> int:
        """Plain steps after which `slot` is due (`due(slot, 1.0, floor)`), counted from now (<= 0: due now)."""
        return math.ceil(max(self._wait[slot], floor, self._floor[slot])) - self._since[slot]

    def plain(self, slot: int) -> None:
        self._since[slot] += 1

    def plain_all(self, slots: list[int]) -> None:
        since = self._since
        for slot in slots:
            since[slot] += 1

    def drafted(self, slot: int) -> None:
        self._since[slot] = 0

    def probed(self, slot: int, paid: bool, floor: float = 0.0) -> None:
        """The outcome of `slot`'s probe; `floor`: the wait its measured cost asks for (0 after a paid one)."""
        self._wait[slot] = self.start if paid else min(self.cap, 2 * self._wait[slot])
        self._floor[slot] = 0.0 if paid else floor

    def reset(self, slot: int) -> None:
        self._wait[slot], self._floor[slot], self._since[slot] = self.start, 0.0, 0


PLAIN, DRAFTING, FUSED = "plain", "drafting", "fused"  # kinds of step, each with its own host work


class CostModel:
    """Seconds of a step from the model runner's per-bucket measurements, refined online.

    `forward(n)`, `draft(b)`, `append(m)`, `round(name, n)` (a fused round of n members, `FusedRound.name`):
    the time at n's bucket when calls are padded to buckets, else interpolated linearly between measured
    sizes; never below a smaller size's time (a table refined by noisy calls may dip, and a dip would make
    extra rows look free). `observe(name, n, seconds)` moves the bucket's entry towards a measured call, and
    buckets not timed yet by the mean ratio of measured to blank-input time (calls are timed where they are
    synchronous: on CPU; blank inputs miss attention over real contexts). `residual(kind, n)`: what a step
    of that kind (PLAIN, DRAFTING: separate calls with drafts, FUSED: one fused round) of n decoding
    sequences costs beyond the tables (host work, which grows with the sequences; on CUDA also the wait for
    the step's one copy to the host): the median of the last `window` steps of the kind at n's power-of-two
    bucket (`plain_window` for plain steps: they are plentiful, and a GPU host's step times swing by tens of
    percent for stretches of steps, which a short window of plain steps followed while the rounds' price
    stood, choosing rounds the drafter did not serve because plain steps looked slow). One slow step (a first
    call's lazy work, a pause of the host) moves a median by nothing, where a mean taken from it would keep a kind that is then rarely chosen priced high for long. A kind not seen at
    a bucket is priced low, not high, so that it is chosen and measured: a plain step at no host work, the
    others at a plain step's; so is one seen fewer than `min_samples` times there, at most. Plain steps'
    samples also age: those older than `plain_age` timed steps at their bucket no longer count, so a plain
    step priced high by old samples (an engine's first steps) is measured again rather than never chosen
    while rounds win by that price. (Rounds priced high are not aged: that error only costs speed-up, and
    measuring them again costs rounds a poor drafter wastes.) `host_work` lets engines of the same program
    and settings share those windows."""

    def __init__(self, forward: dict[int, float], draft: dict[int, float], append: dict[int, float],
                 padded: bool, smoothing: float = 0.2, rounds: Optional[dict[str, dict[int, float]]] = None,
                 window: int = 9, host_work: Optional["HostWork"] = None, min_samples: int = 3,
                 plain_age: int = 64, plain_window: int = 33):
        self.tables = {"forward": dict(forward), "draft": dict(draft), "append": dict(append)}
        for name, table in (rounds or {}).items():  # fused rounds: the whole round's time per bucket of members
            self.tables[name] = dict(table)
        self._blank = {name: dict(t) for name, t in self.tables.items()}
        self._sizes = {name: sorted(t) for name, t in self.tables.items()}
        self._seen_sizes: dict[str, set] = {name: set() for name in self.tables}
        self._scale = {name: 1.0 for name in self.tables}  # measured / blank, over every timed call
        self._doubted: set = set()  # (table, bucket) whose first timed call was left out as a stall (`observe`)
        self.padded = padded
        self.smoothing = smoothing
        self._host = host_work if host_work is not None else HostWork()
        self.window, self.min_samples, self.plain_age = window, min_samples, plain_age
        self.plain_window = max(window, plain_window)
        self._monotone: dict[str, dict[int, float]] = {}
        self._known: dict[str, dict[int, float]] = {}  # n -> _predict(name, n) for the tables as they are
        for name in self.tables:
            self._update_monotone(name)

    def _at(self, name: str, n: int) -> float:
        return self._at_table(self.tables[name], self._sizes[name], n)

    def _predict(self, name: str, n: int) -> float:
        """The table's time at n, never below a smaller size's: entries refined online by noisy calls can
        fall below a smaller bucket's, and a dip would make extra rows look free. Answers are kept until the
        table changes (on CUDA, where calls are not timed, for good): the draft search asks hundreds per step."""
        known = self._known[name]
        t = known.get(n)
        if t is None:
            t = known[n] = self._at_table(self._monotone[name], self._sizes[name], n)
        return t

    def _update_monotone(self, name: str) -> None:
        table, out, top = self.tables[name], {}, 0.0
        for size in self._sizes[name]:
            top = max(top, table[size])
            out[size] = top
        self._monotone[name] = out
        self._known[name] = {}

    def _at_table(self, table: dict[int, float], sizes: list[int], n: int) -> float:
        if n <= 0:
            return 0.0
        if n >= sizes[-1]:
            last = sizes[-1]
            return table[last] * n / last  # beyond the largest call: calls of the largest size
        k = bisect.bisect_left(sizes, n)
        hi = sizes[k]
        if self.padded or hi == n:
            return table[hi]
        lo = sizes[k - 1] if k else 0
        t_lo = table[lo] if lo else 0.0
        return t_lo + (table[hi] - t_lo) * (n - lo) / (hi - lo)

    def forward(self, n: int) -> float:
        return self._predict("forward", n)

    def draft(self, b: int) -> float:
        return self._predict("draft", b)

    def append(self, m: int) -> float:
        return self._predict("append", m)

    def round(self, name: str, n: int) -> float:
        return self._predict(name, n)

    def observe(self, name: str, n: int, seconds: float) -> None:
        """A measured call of `name` with leading dimension n: its bucket's entry moves towards it, and the
        entries of buckets not timed yet follow the mean ratio of measured to blank-input time. A bucket's first
        timed call sets its entry outright, unless it took more than STALL_RATIO times its price: such a call
        is left out, and the bucket's next call sets the entry whatever it takes (a cost that lasts is learnt
        one call later). A stalled first call set outright (a 1 s step in a run that competed for the CPU)
        priced its bucket high until many later calls had pulled it back."""
        table, sizes, blank = self.tables[name], self._sizes[name], self._blank[name]
        if n <= 0:
            return
        hi = sizes[min(bisect.bisect_left(sizes, n), len(sizes) - 1)]
        expected, expected_blank = self._at(name, n), self._at_table(blank, sizes, n)
        if expected <= 0 or expected_blank <= 0:
            return
        a = self.smoothing
        seen = hi in self._seen_sizes[name]
        if not seen and seconds > STALL_RATIO * expected and (name, hi) not in self._doubted:
            self._doubted.add((name, hi))
            return
        self._scale[name] += a * (seconds / expected_blank - self._scale[name])
        if seen:
            table[hi] += a * (seconds * table[hi] / expected - table[hi])
        else:
            self._seen_sizes[name].add(hi)
            table[hi] = seconds * table[hi] / expected
        for size in sizes:
            if size not in self._seen_sizes[name]:
                table[size] = blank[size] * self._scale[name]
        self._update_monotone(name)

    def residual(self, kind: str, n: int = 1) -> float:
        """Host work per step of `kind` with n decoding sequences. Until a kind is seen at n's bucket it is
        priced as a plain step's (a plain step's work is part of every step), and a plain step not seen there
        at none; a step with separate draft calls does all a plain step does and more, so its residual is
        never taken below the plain one. A fused round replaces the plain step's calls, so its own residual
        stands once seen."""
        b = _bucket(n)
        plain = self._median((PLAIN, b), 0.0)
        if kind == PLAIN:
            return plain
        own = self._median((kind, b), plain)
        return max(own, plain) if kind == DRAFTING else own

    def probe_overrun(self) -> float:
        """How many times its predicted extra seconds a probe has taken: the median of the last probes judged (by
        any engine of the program), within [1, PROBE_OVERRUN_MAX]; 1 before any. A probe's predicted price is
        scaled by it (a sequence's own measured probe cost sets a floor of its own too): a probe's round waits
        for the step in flight and appends context the sequence would not have appended otherwise, which the
        tables of blank calls do not hold (on an H100, a round probe of one sequence took 1.3-1.6 ms against about 0.65
        predicted). Until `min_samples` probes were judged the window is read as if filled up with probes
        timed as predicted (1), so one probe that met a stall or a first call's one-time work cannot set every
        later first probe's price on its own: one such sample at 4x would make a first probe wait four times
        as long, longer than a short request lasts, and no later probe would come to outvote it."""
        window = self._host.probe_overrun
        count, median = window.median()
        if 0 < count < self.min_samples:
            median = statistics.median(window.values() + [1.0] * (self.min_samples - count))
        return min(max(median, 1.0), PROBE_OVERRUN_MAX) if count else 1.0

    def record_probe(self, measured_extra: float, predicted_extra: float, plain_s: float) -> bool:
        """A probe's step took `measured_extra` seconds more than a plain step (predicted at `plain_s`), where
        `predicted_extra` was predicted (`probe_overrun`). -> whether it became a sample. A probe predicted at
        under a quarter of a plain step is none: its ratio would be the plain step's own noise over a few
        microseconds."""
        if predicted_extra > 0.25 * plain_s:
            self._host.probe_overrun.append(measured_extra / predicted_extra, 0)
            self._host.overrun_changed = True
            return True
        return False

    def _median(self, key: tuple, unseen: float) -> float:
        """The window's median; until it holds `min_samples` steps, no more than the unseen price (the first
        steps of a kind carry lazy work, and a kind priced high by them might never be chosen again)."""
        seen = self._host.windows.get(key)
        if not seen:
            return unseen
        kind, bucket = key
        oldest = self._host.clock[bucket] - self.plain_age if kind == PLAIN else None
        count, median = seen.median(oldest)
        if not count:
            return unseen
        return median if count >= self.min_samples else min(median, unseen)

    def record(self, kind: str, predicted: float, measured: float, n: int = 1) -> bool:
        """A whole step of `kind` and n decoding sequences took `measured` seconds where the tables predicted
        `predicted`. -> whether it became a sample. A plain step that took more than `STALL_RATIO` times what a
        plain step is priced at now (its prediction plus the window's median if positive, once the window holds
        `min_samples`) is none: a stall (on an H100, 32 plain steps at 1.6-13x their predicted 0.22 ms between
        two prompts), during which rounds, not timed, would keep their price while plain steps looked slow,
        so rounds the drafter does not serve would run until the stall's samples left the window. Measured
        against the window's own median, not the prediction alone: where a plain step's host work is as long
        as its forward (no overlap on a GPU, many sequences) its normal steps stay samples, and a change that
        lasts but stays under the ratio is followed. Rounds' slow samples are kept: they only price rounds
        higher."""
        bucket = _bucket(n)
        self._host.clock[bucket] += 1
        window = self._host.windows.get((kind, bucket))
        if kind == PLAIN and window is not None:
            count, median = window.median(self._host.clock[bucket] - self.plain_age)
            # Never below the prediction: a window of steps whose prediction holds calls their measurement leaves
            # out (context appends) has a negative median, which would make normal steps look slow.
            if count >= self.min_samples and measured > STALL_RATIO * (predicted + max(median, 0.0)) > 0:
                return False
        if window is None:
            window = self._host.windows[(kind, bucket)] = _Window(self.plain_window if kind == PLAIN else self.window)
        window.append(measured - predicted, self._host.clock[bucket])
        return True


class HostWork:
    """What a step costs beyond the tables, per (kind, bucket): a `_Window` of samples each, and per bucket a
    clock (timed steps of any kind there) that dates them. Shared by the engines of one program and settings.
    The probe overrun's samples persist in `overrun_file` when given: a process starts from what the last
    ones of the same program, settings, device and runtime code measured (`_load_overrun`), so a short run's
    first probe is priced by what probes really cost there (a first probe priced as its blank-call tables say
    ran in the first of 20 single prompts of every H100 process, and lost it 11-15%: BENCHMARKS.md). They are
    written once, when the process exits (`save_overrun`), not after each probe: a write of the cache file
    takes a few hundred microseconds of host time, a fraction of a probe round on a GPU."""

    def __init__(self, overrun_file: Optional[Path] = None):
        self.windows: dict[tuple, _Window] = {}
        self.clock: collections.Counter = collections.Counter()
        self.probe_overrun = _Window(9)  # judged probes' measured over predicted extra seconds (`CostModel`)
        self.overrun_file = overrun_file
        self.overrun_changed = False  # samples taken since the file was read or written
        if overrun_file is not None:
            for value in _load_overrun(overrun_file):
                self.probe_overrun.append(value, 0)
            atexit.register(self.save_overrun)

    def save_overrun(self) -> None:
        """Keep the probe overrun's samples for later processes (best effort), when a file was given and a probe
        was judged since it was read or last written. Runs at the process's exit."""
        if self.overrun_file is not None and self.overrun_changed:
            write_cache_file(self.overrun_file, json.dumps(self.probe_overrun.values()))
            self.overrun_changed = False


class _Window:
    """The last `size` values, each with the clock reading it was taken at, and their median, kept as the values
    change: a sorted copy updated by bisection, where sorting the window again after each step's sample was
    part of every plain step's host work (BENCHMARKS.md, "host-work windows without a sort")."""

    def __init__(self, size: int):
        self._values: collections.deque = collections.deque(maxlen=size)  # (reading, value), oldest first
        self._sorted: list[float] = []  # the same values, sorted

    def __len__(self) -> int:
        return len(self._values)

    def append(self, value: float, reading: int) -> None:
        if len(self._values) == self._values.maxlen:
            self._remove(self._values[0][1])
        self._values.append((reading, value))
        bisect.insort(self._sorted, value)

    def _remove(self, value: float) -> None:
        del self._sorted[bisect.bisect_left(self._sorted, value)]

    def values(self) -> list[float]:
        """The values, oldest first."""
        return [value for _, value in self._values]

    def median(self, after: Optional[int] = None) -> tuple[int, float]:
        """(count, median) of the values taken after clock reading `after` (None: all of them); (0, 0.0)
        when there are none. Values taken at or before `after` leave the window for good: callers pass
        readings that never decrease (a plain step's samples age, `CostModel`)."""
        values = self._values
        if after is not None:
            while values and values[0][0] <= after:
                self._remove(values.popleft()[1])
        s = self._sorted
        n = len(s)
        if not n:
            return 0, 0.0
        i = n // 2
        return n, (s[i] if n % 2 else (s[i - 1] + s[i]) / 2)


def _bucket(n: int) -> int:
    """n's power-of-two bucket (1, 2, 4, ...): steps of about as many sequences share a host-work window."""
    return 1 << max(0, n - 1).bit_length()


KEEP_MARGIN, KEEP_STEPS = 0.9, 15  # a plain step chosen with a round 10% worse or more is kept for 15 more steps
KEEP_NEAR_STEPS = 4  # one chosen over a round within that margin, for 4 (the choice moves only as costs drift)
PROBE_WAIT = 8  # steps in a row with prompt chunks during which due probes wait for a step that fuses
_NONE: frozenset = frozenset()  # no slot probes this step
STALL_RATIO = 2.0  # a plain step timed above this many times a plain step's price is a stall (CostModel.record)
PROBE_BUDGET = 0.05  # probes of a sequence the estimates keep at k = 0 cost at most this share of its plain steps
PROBE_OVERRUN_MAX = 4.0  # a probe's price is never scaled by more than this (CostModel.probe_overrun)
WAITING_BYTES = 256 << 20  # committed hidden rows waiting for the drafter, all slots together, at most about this


def flush_rows(append_rows: int, n_slots: int, row_bytes: int) -> int:
    """Waiting context rows of one sequence that trigger its append without a draft: as many as WAITING_BYTES
    holds for every slot, between one `draft_append` call (`append_rows`) and four. Rows wait for the
    sequence's next draft; a sequence that does not draft again before it ends never pays for them, so a
    drafter that stopped paying costs nothing per token until that many rows have waited."""
    return max(append_rows, min(4 * append_rows, WAITING_BYTES // max(1, n_slots * row_bytes)))

_COST_TABLES: dict[tuple, tuple] = {}  # (program digest, device, graphs, padded, triton) -> measured tables
# What engines of one process on the same program learn online and share: host work per kind of step and probes'
# overrun (by the cost tables' key and the kind of probes: a shadow probe's device time lands in the next plain
# step) and the drafter's global acceptance counts (by program and block).
_HOST_WORK: dict[tuple, HostWork] = {}
_GLOBAL_ACCEPTANCE: dict[tuple, tuple[list, list]] = {}


@functools.lru_cache(maxsize=None)
def _code_digest() -> str:
    """A hash of the code that runs the timed methods (the runtime's and the kernels' sources): a newer
    toolchain measures again instead of trusting an older one's times (a faster kernel, say)."""
    h = hashlib.sha256()
    for package in (Path(__file__).resolve().parent, Path(mg_kernels.__file__).resolve().parent):
        for path in sorted(package.glob("*.py")):
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def _program_key(runner: ModelRunner) -> str:
    """The program's identity: its weights file's sha256 (the folder when the manifest lists no file)."""
    files = runner.artifact.manifest.files
    return files[0].sha256 if files else str(runner.artifact.directory)


def cost_key(program: str, device: torch.device, cfg: RunConfig, use_triton: Optional[bool], blocks: tuple) -> tuple:
    """What measured cost tables depend on: the program, the device and every setting that changes what a
    method call runs (graphs, padding, compiled code, attention kernels, BLAS library, the drafter's precision,
    the kernels of quantized and float linears, the CPU attention's) and the fused rounds' blocks."""
    return (program, str(device), cfg.graphs, cfg.padded, cfg.compiled, use_triton, cfg.prefer_cublaslt,
            cfg.drafter_tf32, cfg.int4_tensor_cores, cfg.row_invariant_mm, cfg.rows_mm,
            cfg.row_invariant_attention, blocks)


def _tables_path(key: tuple, device: torch.device) -> Path:
    """Where measured tables persist between processes: keyed by the program, the run settings, the device
    (CUDA: its name; CPU: torch's thread count), the torch version and the runtime's code."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{torch.get_num_threads()}"
    digest = hashlib.sha256(json.dumps([*map(str, key), where, torch.__version__, _code_digest()])
                            .encode()).hexdigest()[:32]
    return cache_root() / "cost-tables" / f"{digest}.json"


def _load_tables(key: tuple, device: torch.device) -> Optional[tuple]:
    """Tables a previous process measured for the same key, or None (missing or unreadable: measured again)."""
    try:
        data = json.loads(_tables_path(key, device).read_text(encoding="ascii"))
        return tuple({int(size): float(t) for size, t in table.items()} for table in data)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _save_tables(key: tuple, device: torch.device, tables: tuple) -> tuple:
    """Keep `tables` for later processes (best effort: an unwritable cache is skipped); returns them."""
    write_cache_file(_tables_path(key, device), json.dumps(tables))
    return tables


def _overrun_path(key: tuple, device: torch.device, probes: str) -> Path:
    """Where the probe overrun's samples persist between processes: next to the cost tables of the same key, per
    kind of probes (`HostWork`)."""
    tables = _tables_path(key, device)
    return tables.with_name(f"{tables.stem}-probe-overrun-{probes}.json")


def _load_overrun(path: Path) -> list[float]:
    """The probe overrun samples a previous process left, oldest first; none when missing or unreadable (a file
    that is not a list of positive finite numbers is not trusted: the window starts empty, and the next judged
    probe writes it whole again)."""
    try:
        values = json.loads(path.read_text(encoding="ascii"))
    except (OSError, ValueError):
        return []
    if not isinstance(values, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in values):
        return []
    return [float(v) for v in values]
_TABLE_OF = {C.METHOD_FORWARD: "forward", C.METHOD_DRAFT_BLOCK: "draft", C.METHOD_DRAFT_APPEND: "append"}


@dataclass
class _Shadow:
    """A shadow probe whose outcome is not known yet (`Speculator._launch_shadows`)."""

    seq: object  # the Sequence
    first: int  # index in seq.tokens of the token its first draft guesses
    k: int  # drafts to compare, at most
    drafts: torch.Tensor  # [>= k] on the host once `ready` has passed
    ready: Optional["torch.cuda.Event"]  # recorded after the drafts' copy to the host (CUDA)
    need: float  # accepted drafts with which a round of `rows` drafts would have paid (`ProbeSchedule.probed`)
    rows: int  # that round's drafts
    floor: float  # the wait, in plain steps, its cost asks for within PROBE_BUDGET


class Speculator:
    """DFlash for one engine; see the module docstring. `proposer` replaces the artifact's drafter (tests)."""

    def __init__(self, runner: ModelRunner, config: RunConfig, proposer: Optional[Proposer] = None):
        draft = runner.artifact.manifest.draft
        block = draft.block_size if config.draft_block is None else config.draft_block
        if not 2 <= block <= draft.block_size:
            raise DFlashError(f"--draft-block is {config.draft_block}; allowed: an integer in [2, "
                              f"{draft.block_size}] (the exported block size)")
        self.runner = runner
        self.config = config
        self.block = block  # the most rows verified per round: the pending token + block - 1 drafts
        self.adaptive = config.speculation != SPECULATION_FIXED
        self.proposer = proposer if proposer is not None else DraftModelProposer(runner)
        self.stats = SpecStats()
        self.acceptance = AcceptanceModel(runner.cache.n_slots, block - 1, global_counts=_GLOBAL_ACCEPTANCE.setdefault(
            (_program_key(runner), block), ([0.0] * (block - 1), [0.0] * (block - 1))))
        self.probes = ProbeSchedule(runner.cache.n_slots)
        self.costs: Optional[CostModel] = None
        self._flush_rows = flush_rows(runner.draft_cache.max_write, runner.cache.n_slots,
                                      runner.hidden_width * runner.hidden_dtype.itemsize)
        self._waiting = WaitingRows(runner.cache.n_slots, self._flush_rows + runner.cache.max_write,
                                    runner.hidden_width, runner.hidden_dtype, runner.device)
        waiting = self._waiting  # the forward writes the rows `reserve_known` names (its hidden sink)
        runner.set_hidden_sink(HiddenSink(lambda: waiting.buffer, lambda: waiting.version, WaitingRows.SCRATCH))
        self._appended: dict[int, int] = {}  # slot -> positions in the draft cache
        self._prediction: Optional[tuple[int, int]] = None  # (sequences drafting, context rows to append)
        self._probing: set[int] | frozenset = set()  # slots whose draft this round is a probe
        self._flushed = 0  # context rows appended this step without a draft (a full call's worth waited)
        self._extra: dict[int, float] = {}  # drafting slot -> predicted seconds on top of a plain step
        self._plain_rate = 0.0  # a plain step's tokens per second, as predicted when the round was chosen
        self._probed: dict[int, int] = {}  # slot -> drafts its probe had accepted, until the step is timed
        self._append_host = 0.0  # host seconds of this step's context appends outside the tables' calls
        self._draft_append_host = 0.0  # of those, the appends before this step's drafts (a probe's cost)
        self._released = False  # a sequence finished or was cancelled since the last timed step
        # Shadow probes (module docstring): greedy sequences with the artifact's drafter, adaptive speculation.
        self.shadow = self.adaptive and config.shadow_probes and proposer is None
        self._shadow_next: list[tuple] = []  # (sequence, need, floor, rows) chosen this step, launched at its end
        self._shadows: dict[int, _Shadow] = {}  # slot -> its shadow probe in flight
        # Greedy rounds as one fused call (one CUDA graph): with the artifact's drafter only. Adaptive
        # speculation also has rounds of smaller blocks to choose from: cheaper, and more sequences fit one.
        self.rounds: list[FusedRound] = []
        if config.fused and proposer is None:
            blocks = [block] + ([b for b in (block // 2, block // 4) if b >= 3] if self.adaptive else [])
            self.rounds = [r for r in (FusedRound(runner, b) for b in blocks) if r.limit >= 1]
        self.fused = next((r for r in self.rounds if r.block == block), None)  # the full block's rounds
        self._round_now: Optional[FusedRound] = None  # this step's fused round, if anyone drafts (as chosen)
        self._kept: Optional[tuple] = None  # a plain step chosen, kept for the next few steps (`_keep`)
        self._steps = 0  # steps chosen so far (`choose` calls): the clock of kept plain steps
        self._prompt_steps = 0  # steps in a row that prompt chunks could join (due probes wait: PROBE_WAIT)
        self._clear_plain = False  # `_best_drafts`: even every draft accepted would pay KEEP_MARGIN less than plain
        self._fused_n = 0  # members of the fused round run this step (0: none)
        self._n = 0
        self._captures = runner.counters.captures  # graph captures inside a step: its time is not the step's
        # A list to have adaptive speculation's choices logged, one dict per step (scripts: why it drafted or
        # not): sequences, the plain step's predicted seconds and each option's expected tokens and seconds
        # ("kept": True instead when a kept plain step was not priced again), then the step's kind and
        # measured seconds ("stall": True when a plain step's time was left out as a stall).
        self.trace: Optional[list] = None
        self._rehearsing_plain = False  # inside `rehearsal(drafts=False)`: every step plain
        if self.adaptive:
            self.costs = self._cost_model()  # measured now, at warm-up, not inside the first request's time
            if runner.device.type == "cpu":  # calls are synchronous there: time each one
                runner.call_log = []

    @property
    def shadow_queue(self) -> list:
        """The sequences whose shadow probe `choose` queued this step (launched at its end: `end_commits`)."""
        return [entry[0] for entry in self._shadow_next]

    # ------------------------------------------------------------------ 1. choose

    def choose(self, decode: list, rows_left: int, prefill: bool = False) -> list[int]:
        """Drafts per decoding sequence this round, summing to at most `rows_left`. `prefill`: prompt chunks
        may join the step (it then cannot fuse, and is priced as separate calls)."""
        if self._rehearsing_plain:  # (`rehearsal`)
            self._n, self._prediction, self._probing, self._round_now = len(decode), None, _NONE, None
            return [0] * len(decode)
        self._n = len(decode)  # the step's decoding sequences, for its host work
        self._round_now = None
        self._steps += 1
        self._prompt_steps = self._prompt_steps + 1 if prefill else 0
        if self._kept is not None and not prefill:  # a kept plain step first: the common step of a stretch
            slots = [s.slot for s in decode]        # the drafter does not serve, so its cheapest path
            if self._keep_plain(slots):
                self._probing = _NONE
                return [0] * len(slots)
        self._probing = set()
        if rows_left <= 0 and self.adaptive:  # prompt chunks fill the step: no row for a draft, nothing to price
            self._prediction = (0, 0)
            if self.trace is not None:
                self.trace.append({"n": len(decode), "unfused_drafts": 0})
            return [0] * len(decode)
        limits = [max(0, min(self.block - 1, s.room, self.runner.cache.capacity - 1 - s.n_cached)) for s in decode]
        if self._shadows:  # a sequence waits for its shadow probe's outcome before drafting (its append is paid now,
            limits = [0 if s.slot in self._shadows else k for s, k in zip(decode, limits)]  # the estimates not yet)
        rounds = self._fusable_rounds(decode)
        if not self.adaptive:  # fused whenever the step turns out to have no prompt chunks (`fuses`)
            ks = []
            for k in limits:
                ks.append(min(k, rows_left))
                rows_left -= ks[-1]
            self._round_now = rounds[0] if rounds else None
            self._prediction = None
            return ks
        if rounds and not prefill:  # priced as fused only when it surely runs fused
            return self._choose_round(decode, limits, rows_left, rounds)
        ks = self._best_drafts(decode, limits, rows_left)
        rows_left -= sum(ks)
        c, n = self.costs, len(decode)
        rate = n / max(c.forward(n) + c.residual(PLAIN, n), 1e-9)  # a plain step's tokens per second
        # Sequences kept at k = 0 for a while probe; once the step pays for a draft call anyway, those
        # halfway to their probe join it (their probe costs only verify rows now). A probe is due no sooner
        # than its predicted cost, in plain-step tokens, allows within PROBE_BUDGET of plain decoding. A step
        # with prompt chunks whose sequences could fuse a round without them starts no probe of its own: its
        # drafts would run as separate calls (append, draft, acceptance's dozen calls), not overlapped, where
        # the next step without prompt chunks runs the probe as one fused round. Not for long: after
        # PROBE_WAIT such steps in a row (prompts admitted back to back) the probe rides the prompt step.
        # A greedy sequence probes in the shadow instead (module docstring): a draft call, no verify rows, due
        # by the draft call's cost; whether a round with what it accepts would have paid is priced as a probe.
        shadow_floor = self._shadow_floor(rate) if self.shadow else 0.0
        overrun = c.probe_overrun()
        for share in (1.0, 0.5):
            if share < 1.0 and not any(ks):
                break
            wait = share == 1.0 and prefill and rounds and self._prompt_steps <= PROBE_WAIT
            for i, s in enumerate(decode):
                if ks[i] or not limits[i] or not self.probes.due(s.slot, share):
                    continue  # (the budget's floor below only lengthens the wait: not due without it, not due)
                shadow = share == 1.0 and self.shadow and s.request.sampling.greedy
                if shadow:  # no verify rows: due by the draft call's cost, once no earlier one is pending
                    if s.slot in self._shadows or not self.probes.due(s.slot, 1.0, floor=shadow_floor):
                        continue
                elif wait or rows_left <= 0:
                    continue  # (every probe due at share 1.0 is due at 0.5: they join a step that drafts anyway)
                rows, b = n + sum(ks), sum(1 for k in ks if k)
                k = min(limits[i] if shadow else min(limits[i], rows_left), self._probe_rows(rows))
                extra = self._step_cost(n, rows - n + k, b + 1) - self._step_cost(n, rows - n, b)
                if shadow:  # priced as the probe round it stands for
                    self._queue_shadow(s, rate * extra, shadow_floor, k)
                elif self.probes.due(s.slot, share, floor=rate * extra * overrun / PROBE_BUDGET):
                    ks[i] = k
                    rows_left -= k
                    self._probing.add(s.slot)
        chosen = [i for i, k in enumerate(ks) if k]
        if not chosen and not prefill:  # a plain step: kept (`_keep_plain`), for fewer steps if drafts came near
            slots = [s.slot for s in decode]
            # Kept no later than the first probe could fall due: its wait's floor is at least that of the cheapest
            # probe (one draft row), or of a shadow probe.
            floor = rate * (self._step_cost(n, 1, 1) - self._step_cost(n, 0, 0)) * overrun / PROBE_BUDGET
            self._keep(slots, min(floor, shadow_floor) if self.shadow else floor,
                       KEEP_STEPS if self._clear_plain else KEEP_NEAR_STEPS)
        self._prediction = (len(chosen), sum(self._waiting.count[decode[i].slot] for i in chosen))
        if chosen:  # each drafting sequence's predicted seconds on top of a plain step: verify rows, draft share
            rows, share = n + sum(ks), c.draft(len(chosen)) / len(chosen)
            self._extra = {decode[i].slot: c.forward(rows) - c.forward(rows - ks[i]) + share for i in chosen}
            self._plain_rate = rate
        if self.trace is not None:
            self.trace.append({"n": n, "unfused_drafts": sum(ks)})
            if self._shadow_next:
                self.trace[-1]["shadows"] = len(self._shadow_next)
        return ks

    @contextlib.contextmanager
    def rehearsal(self, drafts: bool):
        """Steps run inside draft all they may (`drafts`: fixed speculation's choice, a fused round where the step
        can fuse, separate calls where it cannot) or nothing, and teach nothing: no acceptance estimate, probe,
        host-work sample, timed call, trace entry or statistic is taken, and what the speculator had learnt is
        as before afterwards (`Engine.rehearse`)."""
        saved = (self.stats, self.trace, self.runner.call_log, self.adaptive, self._kept, self._steps,
                 self._prompt_steps)
        self.stats, self.trace, self.runner.call_log, self.adaptive, self._kept = SpecStats(), None, None, False, None
        self._rehearsing_plain = not drafts
        try:
            yield
        finally:
            self._rehearsing_plain = False
            (self.stats, self.trace, self.runner.call_log, self.adaptive, self._kept, self._steps,
             self._prompt_steps) = saved
            self._prediction, self._probing, self._probed, self._round_now = None, set(), {}, None

    def _choose_round(self, decode: list, limits: list[int], rows_left: int, rounds: list[FusedRound]) -> list[int]:
        """A step that can fuse: a plain step, or one fused round (of one of `rounds`' blocks) with the most
        expected tokens per second. A fused round verifies its whole block for every member whatever the
        drafts, so every member drafts all it may (its `limits`); the choice is the block, or none. When a
        plain step wins and a sequence's probe is due (`ProbeSchedule`, its cost a member's share of the
        round over the plain step), the round with the best rate runs anyway."""
        c, n = self.costs, len(decode)
        slots = [s.slot for s in decode]
        plain_t = c.forward(n) + c.residual(PLAIN, n)
        rate = n / max(plain_t, 1e-9)  # a plain step's tokens per second
        host, count, expected = c.residual(FUSED, n), self._waiting.count, self.acceptance.expected
        top, options = None, []  # top: (tokens per second, round, drafts, seconds) of the best round
        for fr in rounds:
            most = fr.block - 1
            ks = [k if k < most else most for k in limits]
            drafts = sum(ks)
            if not drafts or drafts > rows_left:
                continue
            members = [(slot, k) for slot, k in zip(slots, ks) if k]
            # Never below a plain step's price: a round verifies every member's block, the plain step's rows and
            # more (blank-call tables measured on a busy CPU once priced a one-row round under a forward).
            t = max(c.round(fr.name, n) + c.append(sum(count[slot] for slot, _ in members)) + host, plain_t)
            tokens = n + sum(expected(slot, k) for slot, k in members)
            options.append([fr.block, tokens, t])
            if top is None or tokens / t > top[0]:
                top = (tokens / t, fr, ks, t)
        if self.trace is not None:
            self.trace.append({"n": n, "plain": [n, plain_t], "rounds": options, "chose": 0})
        self._prediction = (0, 0)  # a plain step, unless a round pays or carries a due probe
        if top is None:
            return [0] * n
        best_rate, fr, ks, t = top
        chosen = [s.slot for s, k in zip(decode, ks) if k]
        share = max(t - plain_t, 0.0) / len(chosen)  # each drafting member's seconds on top of a plain step
        if best_rate <= rate:  # a plain step pays better; due probes still ride the round, or go in the shadow
            if self.shadow:  # (every member greedy, as in any fused round): a draft call each, no round
                floor = self._shadow_floor(rate)
                for s, k in zip(decode, ks):
                    if k and s.slot not in self._shadows and self.probes.due(s.slot, 1.0, floor=floor):
                        self._queue_shadow(s, rate * share, floor, k)
                if self.trace is not None and self._shadow_next:
                    self.trace[-1]["shadows"] = len(self._shadow_next)
            else:
                floor = rate * share * c.probe_overrun() / PROBE_BUDGET
                self._probing = {slot for slot in chosen if self.probes.due(slot, 1.0, floor=floor)}
            if not self._probing:
                self._keep(slots, floor, KEEP_STEPS if best_rate <= KEEP_MARGIN * rate else KEEP_NEAR_STEPS)
                return [0] * n
        self._round_now = fr
        if self.trace is not None:
            self.trace[-1].update(chose=fr.block, probe=bool(self._probing))
        self._prediction = (len(chosen), sum(self._waiting.count[slot] for slot in chosen))
        self._extra = {slot: share for slot in chosen}
        self._plain_rate = rate
        return ks

    def _keep_plain(self, slots: list[int]) -> bool:
        """Is this step a plain step because one was chosen at most KEEP_STEPS steps ago with a margin (over fused
        rounds, or over separate calls by the bound of `_best_drafts`), or at most KEEP_NEAR_STEPS ago without
        it, for the same sequences (so a step that could fuse then can now: no prompt chunk may join, which
        `choose` checks), with no observation since in this engine's estimates, the same cost model object
        and no probe due? Within those few steps the cost tables and host-work windows may move (they are
        refined in place and shared by engines), as may the global acceptance others observe: the margin covers
        that, and without it the keeping is short. Pricing every round again costs tens of microseconds of host
        time per step, a tenth of a plain step on a GPU, and a sequence whose rounds come within the margin
        without paying (its estimates near the break-even point, and no observation to move them while it does
        not draft) would pay it at every step; the check is a few comparisons (the last kept step was computed
        when the plain step was chosen, `_keep`)."""
        kept_slots, acceptance, version, costs, until = self._kept
        if (self._steps > until or kept_slots != slots or acceptance is not self.acceptance
                or version != acceptance.version or costs is not self.costs):
            self._kept = None
            return False
        self._prediction = (0, 0)
        if self.trace is not None:
            self.trace.append({"n": len(slots), "chose": 0, "kept": True})
        return True

    def _keep(self, slots: list[int], floor: float, keep: int) -> None:
        """Keep the plain step chosen now for `slots` (`_keep_plain`): for `keep` more steps, and none at or
        after the first step at which one of `slots` has a probe due (by `floor`, as the choice computed it). A
        slot's plain-step count grows by at most one per step, so no due probe is ever skipped; a drafting step
        changes the estimates' version, which ends the keeping too."""
        until = self._steps + min(keep, min(self.probes.steps_until_due(slot, floor) for slot in slots) - 1)
        if until > self._steps:
            self._kept = (slots, self.acceptance, self.acceptance.version, self.costs, until)

    def _best_drafts(self, decode: list, limits: list[int], rows_left: int) -> list[int]:
        """The draft rows with the most expected committed tokens per second (module docstring)."""
        costs = self.costs
        gains = [self.acceptance.survival(s.slot, k) for s, k in zip(decode, limits)]
        n = len(decode)
        best_ratio = n / (costs.forward(n) + costs.residual(PLAIN, n))
        # Bounds (most steps of a batch the drafter does not help end at the first): every draft row accepted
        # in expectation, at the cheapest drafting step's time; in the search, at the time of the prefix so
        # far (a step's time never falls as rows, drafting sequences and waiting context grow).
        # `_clear_plain`: no prefix could beat KEEP_MARGIN of a plain step's rate (none drafts, by a margin): the
        # search goes on past where it could stop until that is known, and `choose` keeps the plain step.
        host = costs.residual(DRAFTING, n)
        cheapest = self._step_cost(n, 1, 1) + host
        bound = n + sum(map(sum, gains))
        margin = KEEP_MARGIN * best_ratio
        self._clear_plain = cheapest > 0 and bound / cheapest <= margin
        if rows_left <= 0 or (cheapest > 0 and bound / cheapest <= best_ratio):
            return [0] * n
        # Every (gain, sequence, row) in one list, best first; a sequence's rows come in order (gains decrease).
        order = heapq.merge(*[[(-p, i, j) for j, p in enumerate(gs)] for i, gs in enumerate(gains)])
        ks = [0] * n
        rows, tokens, drafting, waiting = 0, 0.0, 0, 0
        best, taken, top, clear = 0, [], 0.0, True  # top: the best prefix's rate; clear: every prefix was seen
        for neg_p, i, _ in order:
            if rows >= rows_left:
                clear = False  # longer prefixes were not allowed this step
                break
            taken.append(i)
            rows += 1
            tokens -= neg_p
            if ks[i] == 0:
                drafting += 1
                waiting += self._waiting.count[decode[i].slot]
            ks[i] += 1
            t = self._step_cost(n, rows, drafting) + costs.append(waiting) + host
            ratio = (n + tokens) / t
            top = max(top, ratio)
            if ratio > best_ratio:
                best_ratio, best = ratio, len(taken)
            elif t > 0 and bound / t <= best_ratio and (best or bound / t <= margin):
                break  # no longer prefix can do better (nor, when none pays, come within the margin)
        self._clear_plain = not best and clear and top <= margin
        ks = [0] * n
        for i in taken[:best]:
            ks[i] += 1
        return ks

    def _step_cost(self, n: int, draft_rows: int, drafting: int) -> float:
        """Predicted seconds of the calls of an unfused step of n decoding sequences with `draft_rows` drafts
        among `drafting` of them (context appends and host work apart): the target forward over every row
        plus the draft call."""
        c = self.costs
        return c.forward(n + draft_rows) + c.draft(drafting)

    def _probe_rows(self, rows: int) -> int:
        """Drafts of a probe: at least 4, more while the step's rows stay nearly free (within 10% of one more
        row's forward time: padded buckets on CUDA), up to the block."""
        c, k = self.costs, 4
        while k < self.block - 1 and c.forward(rows + k + 1) <= 1.1 * c.forward(rows + 1):
            k += 1
        return k

    def _judge_probes(self, measured_s: float) -> None:
        """Did each probe of the step just run pay: did its accepted drafts come faster than plain steps make
        tokens? Its cost: the step's measured time over a plain step's predicted time for the rows without
        drafts, shared among the drafting sequences as predicted (never below its own prediction). A probe
        that accepted nothing never paid, whatever the (possibly noisy) times say; one that did not pay waits
        at least as many steps as keep its cost within PROBE_BUDGET."""
        c, n = self.costs, self._n
        plain_s = c.forward(n) + c.residual(PLAIN, n) + c.append(self._flushed)
        over = measured_s - plain_s
        predicted = sum(self._extra.values())
        c.record_probe(over, predicted, plain_s)
        if self.trace is not None and self.trace:
            self.trace[-1].update(probe_extra=[over, predicted], probe_overrun=c.probe_overrun())
        for slot, accepted in self._probed.items():
            extra = self._extra[slot]
            if predicted > 0:
                extra = max(extra, over * extra / predicted)
            need = self._plain_rate * extra  # tokens the probe had to accept to pay
            paid = accepted > 0 and accepted >= need
            self.stats.probes_paid += paid
            self.probes.probed(slot, paid, 0.0 if paid else need / PROBE_BUDGET)

    def _cost_model(self) -> CostModel:
        r, cfg = self.runner, self.config
        key = cost_key(_program_key(r), r.device, cfg, getattr(r.cache, "use_triton", None),
                       tuple(fr.block for fr in self.rounds))
        if key not in _COST_TABLES:
            tables = _load_tables(key, r.device)
            if tables is None or len(tables) != 3 + len(self.rounds):
                tables = _save_tables(key, r.device, (
                    r.measure(C.METHOD_FORWARD), r.measure(C.METHOD_DRAFT_BLOCK), r.measure(C.METHOD_DRAFT_APPEND),
                    *(fr.measure() for fr in self.rounds)))
            _COST_TABLES[key] = tables
        forward, draft, append, *rounds = _COST_TABLES[key]
        host_work = _HOST_WORK.get((key, cfg.probes))
        if host_work is None:
            host_work = _HOST_WORK[(key, cfg.probes)] = HostWork(_overrun_path(key, r.device, cfg.probes))
        return CostModel(forward, draft, append, padded=cfg.padded, host_work=host_work,
                         rounds={fr.name: table for fr, table in zip(self.rounds, rounds)})

    def step_done(self, measured_s: float, rows: int, prefill: bool = False) -> None:
        """The engine's wall time of the step just run, its forward's row count and whether prompt chunks
        were in it. Timed calls (CPU) refine the tables, and the step's time outside them is its host work;
        without timed calls (CUDA) the host work is what the tables do not predict. What the choice of a
        step does not decide is left out: the host work of context appends (rows committed earlier, appended
        now or at a later flush whatever this step does; their calls stay in the prediction), and whole steps
        with prompt chunks (a prompt's first step does more host work than a decode step), with graph
        captures (their capture's time) or in which a sequence finished (its release), which teach no host
        work and judge no probe."""
        log, c = self.runner.call_log, self.costs
        captures, self._captures = self._captures, self.runner.counters.captures
        timed = captures == self._captures and not prefill and not self._released
        measured_s -= self._append_host
        if c is not None and self._prediction is not None and timed:
            drafting, waiting = self._prediction
            kind = FUSED if self._fused_n else DRAFTING if drafting else PLAIN
            if log is not None:
                predicted = sum(seconds for _, _, seconds in log)
            elif self._fused_n:
                predicted = c.round(self._round_now.name, self._fused_n) + c.append(waiting) + c.append(self._flushed)
            else:
                predicted = c.forward(rows) + (c.draft(drafting) + c.append(waiting) if drafting else 0.0)
                if self._flushed:
                    predicted += c.append(self._flushed)
            stall = not c.record(kind, predicted, measured_s, self._n)
            self.stats.stalls += stall
            if self.trace is not None and self.trace and "measured" not in self.trace[-1]:
                self.trace[-1].update(kind=kind, predicted=predicted, measured=measured_s)
                if stall:
                    self.trace[-1]["stall"] = True
        if self._probed:
            if timed:  # a probe's own context append is its cost: the sequence would not have appended it now
                self._judge_probes(measured_s + self._draft_append_host)
            self._probed = {}
        if c is not None and log is not None:
            for method, n, seconds in log:
                c.observe(_TABLE_OF.get(method, method), n, seconds)  # fused rounds: tables by their name
        if log is not None:
            log.clear()
        self._prediction, self._flushed, self._fused_n = None, 0, 0
        self._append_host, self._draft_append_host, self._released = 0.0, 0.0, False

    # ------------------------------------------------------------------ 2. propose

    def propose(self, decode: list, ks: list[int]) -> StepDrafts:
        """Drafts for each decoding sequence (k = 0: none); the drafting ones' context is made current first."""
        hist = self.stats.chosen_k_hist
        if not any(ks):  # a plain step: the common case where the drafter does not pay, kept cheap
            if ks:
                _bump(hist, 0, len(ks))
            return StepDrafts(ks, None)
        live = [(s, k) for s, k in zip(decode, ks) if k > 0]
        for k in ks:
            _bump(hist, k)
        self._append_waiting([s.slot for s, _ in live], drafting=True)
        self._check_context([s for s, _ in live])
        drafts = self.proposer.propose([s for s, _ in live], [k for _, k in live])
        device = self.runner.device
        if not isinstance(drafts, torch.Tensor):  # lists (e.g. a test's proposer): one host-to-device copy
            width = max(k for _, k in live)
            drafts = torch.tensor([list(d)[:width] + [0] * (width - len(d)) for d in drafts], dtype=torch.long)
        drafts = to_device(drafts, device)
        if len(live) < len(decode):  # rows in decode order; non-drafting rows are filler
            rows = to_device(torch.tensor([i for i, k in enumerate(ks) if k > 0], dtype=torch.long), device)
            drafts = torch.zeros(len(decode), drafts.shape[1], dtype=torch.long, device=device).index_copy_(
                0, rows, drafts)
        return StepDrafts(list(ks), drafts)

    # ------------------------------------------------------------------ 2'. the fused round

    def _fusable_rounds(self, decode: list) -> list[FusedRound]:
        """The fused rounds that can take these decoding sequences (full block first): fused rounds on, within
        the round's limit of sequences, every one greedy. (The step must also have no prompt chunks.)"""
        if not self.rounds or not decode or not all(s.request.sampling.greedy for s in decode):
            return []
        return [fr for fr in self.rounds if len(decode) <= fr.limit]

    def fuses(self, batch) -> bool:
        """Does the scheduled step run as one fused round: chosen so by `choose`, someone drafts, and no
        prompt chunk joined it."""
        return self._round_now is not None and not batch.prefill and any(batch.n_drafts)

    def run_round(self, decode: list, ks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused round `choose` picked for `decode` (`fused_round.py`), k = ks[i] drafts at most each (0: a
        plain step for it): the drafting sequences' waiting context is appended first. Returns the round's
        outputs on the device: [len(decode), block + 1] (accepted drafts, then the committed tokens) and
        hidden rows."""
        for k in ks:
            _bump(self.stats.chosen_k_hist, k)
        drafting = [s for s, k in zip(decode, ks) if k > 0]
        self._append_waiting([s.slot for s in drafting], drafting=True)
        self._check_context(drafting)
        self._fused_n = len(decode)
        return self._round_now.run([Member(s.tokens[-1], s.n_cached, s.slot, k) for s, k in zip(decode, ks)])

    def round_done(self, decode: list, ks: list[int], accepted: list[int], hidden: torch.Tensor) -> None:
        """After a fused round, each sequence's `n_cached` already advanced by its committed tokens: the
        draft context of drafting sequences holds every verified row and goes back to the committed ones;
        a sequence that did not draft commits its one row's hidden state like an unfused plain step."""
        rows, owners = [], []
        for i, (seq, k, a) in enumerate(zip(decode, ks, accepted)):
            if k > 0:
                if a < k:
                    self.runner.draft_cache.rewind(seq.slot, seq.n_cached)
                self._appended[seq.slot] = seq.n_cached
            else:
                rows.append(i * self._round_now.block)
                owners.append((seq.slot, 1))
        self.commit(hidden, rows, owners)

    def before_capture(self) -> None:
        """Before the engine captures its graphs (`Engine.warm_up`): the waiting-row buffer the forward writes
        takes its full size now, so that the graphs captured next stay valid whatever the batch (with CUDA
        graphs only: elsewhere it keeps growing with the sequences served at once)."""
        if self.runner.config.graphs:
            try:
                self._waiting.grow_to_all_slots()
            except torch.OutOfMemoryError:
                log.warning(f"mg-run: not enough {self.runner.device} memory for the drafter's waiting context rows "
                            f"of all {self.runner.cache.n_slots} sequences at once; the buffer grows with the "
                            f"sequences served, and CUDA graphs are captured again after each growth")

    def warm_up(self) -> None:
        """Capture the fused rounds' graphs now (nothing to do without fused rounds or without graphs)."""
        for fr in self.rounds:
            fr.warm_up()

    # ------------------------------------------------------------------ 3. observe and commit

    def observe_plain(self, decode: list) -> None:
        """A step in which none of `decode` drafted: `observe(seq, 0, 0)` for each, at once."""
        if self.adaptive:
            self.probes.plain_all([s.slot for s in decode])

    def observe(self, seq, k: int, accepted: int) -> None:
        """A decode round of `seq` that verified k drafts accepted `accepted` of them."""
        if k == 0:
            if self.adaptive:
                self.probes.plain(seq.slot)
            return
        st = self.stats
        st.rounds += 1
        st.drafted_tokens += k
        st.accepted_tokens += accepted
        _bump(st.accepted_hist, accepted)
        if self.adaptive:
            self.acceptance.observe(seq.slot, k, accepted)
            self.probes.drafted(seq.slot)
            if seq.slot in self._probing:
                st.probes += 1
                self._probed[seq.slot] = accepted  # judged in step_done, once the step's time is known

    def reserve_known(self, decode: list, ks: list[int], prefill: list) -> list[int]:
        """Before a step's forward: the hidden sink's row for each of its rows (decode rows, then prompt
        chunks', as packed). The rows whose commit does not wait for acceptance (a sequence that does not
        draft: its one row; a prompt chunk: all of its rows) are counted as waiting now, and the forward
        writes them; the verify rows of drafting sequences go to the scratch row, committed after acceptance
        (`commit`). Their host work then costs no call of its own: on a GPU serving a small model, host work
        is the step time (docs/ARCHITECTURE.md section 6.1)."""
        if not prefill and not any(ks):  # a plain step: one row each
            return self._waiting.reserve_one_each([s.slot for s in decode])
        owners = [(s.slot, 1) for s, k in zip(decode, ks) if k == 0]
        owners += [(chunk.seq.slot, chunk.length) for chunk in prefill]
        rows = iter(self._waiting.reserve(owners))
        scratch, out = WaitingRows.SCRATCH, []
        for k in ks:
            if k:
                out += [scratch] * (1 + k)
            else:
                out.append(next(rows))
        out.extend(rows)  # the prompt chunks' rows, in order
        return out

    def commit(self, hidden: torch.Tensor, rows: list[int], owners: list[tuple[int, int]]) -> None:
        """The step's committed positions: `rows` of the step's hidden states [N, taps*dim], in `owners` order
        ((slot, m): the next m committed positions of slot, in position order). They wait on the device."""
        self._waiting.put(hidden, rows, owners)

    def launch_shadows(self) -> None:
        """Launch the shadow probes `choose` queued for this step now (else `end_commits` does): an overlapped
        step calls this right after launching its forward, so the host's work for them runs while the device
        still computes the step before."""
        if self._shadow_next:
            self._launch_shadows()

    def end_commits(self) -> None:
        """After a step's commits: append the context of sequences with a full call's worth waiting; launch the
        shadow probes chosen for the step (if not yet), and judge those whose tokens are all known now."""
        full = self._waiting.at_least(self._flush_rows)
        if full:
            self._flushed += self._append_waiting(full)
        if self._shadow_next:
            self._launch_shadows()
        if self._shadows:
            done = [slot for slot, sh in self._shadows.items() if len(sh.seq.tokens) - sh.first >= sh.k]
            for slot in done:
                self._judge_shadow(self._shadows.pop(slot))

    # ------------------------------------------------------------------ 3'. shadow probes (module docstring)

    def _shadow_floor(self, rate: float) -> float:
        """The wait, in plain steps of `rate` tokens per second, that keeps a shadow probe's draft call within
        PROBE_BUDGET of plain decoding."""
        return rate * self.costs.draft(1) / PROBE_BUDGET

    def _queue_shadow(self, seq, need: float, floor: float, rows: int) -> None:
        """`seq` probes in the shadow at the end of this step (`end_commits`); `need`: the accepted drafts with
        which a round of `rows` drafts would have paid; `floor`: the wait the draft call's cost asks for within
        PROBE_BUDGET."""
        self._shadow_next.append((seq, need, floor, rows))
        self.probes.drafted(seq.slot)  # its wait starts again now; the outcome sets the next one

    def _launch_shadows(self) -> None:
        """One `draft_block` call for the sequences queued this step, anchored at each one's last token known on
        the host (steps in flight come later in the device's order: their rows are past the anchor, which the
        drafter's context ends before), after appending their waiting context; the drafts' copy to the host
        is queued, not waited for. Its host time is kept out of the step's, as a context append's."""
        queued, self._shadow_next = self._shadow_next, []
        live = []
        for seq, need, floor, rows in queued:
            k = min(self.block - 1, seq.request.max_new_tokens - seq.n_generated)  # tokens still to come
            if seq.finish_reason is None and k > 0 and seq.slot not in self._shadows:
                live.append((seq, k, need, floor, rows))
        if not live:
            return
        with self._host_apart():
            seqs = [seq for seq, *_ in live]
            self._append_rows([s.slot for s in seqs])
            drafts = self._shadow_drafts(seqs)
            ready = None
            if drafts.device.type == "cuda":
                host = torch.empty(drafts.shape, dtype=drafts.dtype, pin_memory=True)
                host.copy_(drafts, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(drafts.device))
                drafts = host
            for i, (seq, k, need, floor, rows) in enumerate(live):
                self._shadows[seq.slot] = _Shadow(seq, len(seq.tokens), k, drafts[i], ready, need, rows, floor)
            self.stats.shadow_probes += len(live)

    def _shadow_drafts(self, seqs: list) -> torch.Tensor:
        """Drafts [B, >= block - 1] of blocks anchored at each sequence's last known token (position: its index)."""
        return self.proposer.block_at(seqs, [len(s.tokens) - 1 for s in seqs])

    def _judge_shadow(self, sh: _Shadow) -> None:
        """A shadow probe's outcome: the drafts a round anchored there would have accepted (the longest prefix
        equal to the tokens that followed; fewer to compare when the sequence ended first), observed as that
        round's, and whether such a round would have paid (the probe's next wait)."""
        got = sh.seq.tokens[sh.first:sh.first + sh.k]
        if not got:
            return
        if sh.ready is not None:
            sh.ready.synchronize()  # (done, or nearly: the steps that made `got` were queued after it)
        accepted = 0
        for draft, token in zip(sh.drafts[:len(got)].tolist(), got):
            if draft != token:
                break
            accepted += 1
        slot = sh.seq.slot
        self.acceptance.observe(slot, len(got), accepted)
        paid = accepted > 0 and min(accepted, sh.rows) >= sh.need  # (a round of `rows` drafts takes no more)
        self.probes.probed(slot, paid, 0.0 if paid else sh.floor)
        self.stats.shadow_accepted += accepted

    def waiting_rows(self, slot: int) -> int:
        """Committed positions of `slot` waiting to enter the draft cache."""
        return self._waiting.count[slot]

    def context_length(self, slot: int) -> int:
        """Committed positions of `slot` the drafter holds: in its cache or waiting to be appended."""
        return self._appended.get(slot, 0) + self._waiting.count[slot]

    def release(self, slot: int) -> None:
        """A finished sequence: its draft context and estimates go (a shadow probe in flight is judged first, by
        the tokens it has)."""
        shadow = self._shadows.pop(slot, None)
        if shadow is not None:
            self._judge_shadow(shadow)
        if self._shadow_next:
            self._shadow_next = [entry for entry in self._shadow_next if entry[0].slot != slot]
        self._waiting.drop(slot)
        self._appended.pop(slot, None)
        self.runner.draft_cache.release(slot)
        self.acceptance.reset(slot)
        self.probes.reset(slot)
        self._probed.pop(slot, None)
        self._released = True

    def _check_context(self, seqs: list) -> None:
        """An invariant before a draft: the drafter holds every committed row of each sequence."""
        for s in seqs:
            if self._appended.get(s.slot, 0) != s.n_cached:
                raise RuntimeError(f"draft context of slot {s.slot} holds {self._appended.get(s.slot, 0)} "
                                   f"positions; the sequence has {s.n_cached} committed")

    def _append_waiting(self, slots: list[int], drafting: bool = False) -> int:
        """Append the waiting context rows of `slots` (one gather, then `draft_append` calls); returns how many.
        `drafting`: before their drafts (a probe's judgement counts it: `_draft_append_host`), not a flush.
        Its host time is kept apart from the step's (`step_done`): on CPU outside the timed calls (whose times
        are the prediction's), on CUDA all of it (the calls' blank-input table times stay in the prediction,
        so such a step's host work is learnt low by about their host share; an append of rows on the cell
        layout costs far more host time than the blank call of the table, and that is what is left out)."""
        with self._host_apart(drafting):
            return self._append_rows(slots)

    @contextlib.contextmanager
    def _host_apart(self, drafting: bool = False):
        """Count the host time of the work inside, less its timed calls (CPU: their times are the prediction's),
        as context-append time that the step's timing leaves out (`_append_host`; `drafting`: also as the
        appends before this step's drafts, `_draft_append_host`)."""
        t0, log = time.perf_counter(), self.runner.call_log
        logged = len(log) if log is not None else 0
        try:
            yield
        finally:
            inside = sum(seconds for _, _, seconds in log[logged:]) if log is not None else 0.0
            host = time.perf_counter() - t0 - inside
            self._append_host += host
            if drafting:
                self._draft_append_host += host

    def _append_rows(self, slots: list[int]) -> int:
        positions, seq_slots, taken, spans = [], [], [], []
        for slot in slots:
            m = self._waiting.count[slot]
            if not m:
                continue
            start = self._appended.get(slot, 0)
            positions += range(start, start + m)
            seq_slots += [slot] * m
            taken.append(slot)
            spans.append((slot, start, m))
            self._appended[slot] = start + m
        if not taken:
            return 0
        self.runner.draft_append(self._waiting.take(taken), torch.tensor(positions, dtype=torch.long),
                                 torch.tensor(seq_slots, dtype=torch.long), spans)
        return len(positions)


class WaitingRows:
    """Committed hidden rows waiting to enter the draft cache, in one device buffer of regions of `rows` rows
    (a live slot's waiting rows at the start of its region, in position order), so a commit is one scatter
    (one copy per sequence for one or two sequences: no index to send) and an append's rows one
    gather, however many sequences take part. `rows` must cover what a slot
    can hold between appends: the flush threshold plus one step's writes. Regions go to slots as they first
    commit and come back when they are released; the buffer doubles when every region is taken (starting at
    8, never beyond `n_slots`), so its memory follows the sequences served at once, not the slots declared.

    Rows whose commit does not wait for acceptance are `reserve`d before the step's forward, which writes them
    itself (the model runner's hidden sink, inside its CUDA graph): row 0 of the buffer is a scratch row for
    the forward's other rows, and `version` counts the buffer's moves (a move captures that graph again)."""

    START_REGIONS = 8
    COPY_OWNERS = 2  # a commit of at most this many sequences goes as one copy each (else one scatter)
    SCRATCH = 0  # the buffer's scratch row: regions start after it

    def __init__(self, n_slots: int, rows: int, width: int, dtype: torch.dtype, device: torch.device):
        self.rows, self.n_slots = rows, n_slots
        self.count = [0] * n_slots
        self.version = 0
        self._region: dict[int, int] = {}  # slot -> region index
        self._bases = [-1] * n_slots  # slot -> its region's first row (-1: none yet); `_base` without a call
        self._free = list(range(min(n_slots, self.START_REGIONS)))[::-1]
        self._buf = torch.empty(1 + len(self._free) * rows, width, dtype=dtype, device=device)
        self._views: dict[int, torch.Tensor] = {}  # start row -> one-row view of _buf (`_dst`)

    @property
    def buffer(self) -> torch.Tensor:
        """The device buffer as it is now ([1 + regions x rows, width]; it moves when it grows)."""
        return self._buf

    @property
    def regions(self) -> int:
        return (self._buf.shape[0] - 1) // self.rows

    def _base(self, slot: int) -> int:
        region = self._region.get(slot)
        if region is None:
            if not self._free:
                self._grow(min(self.n_slots, 2 * self.regions))
            region = self._region[slot] = self._free.pop()
            self._bases[slot] = 1 + region * self.rows
        return 1 + region * self.rows

    def grow_to_all_slots(self) -> None:
        """Hold a region for every slot now, so that the buffer never moves later: before CUDA graphs that
        write it are captured (a batch of more than START_REGIONS sequences then captures no graph mid-run)."""
        if self.regions < self.n_slots:
            self._grow(self.n_slots)

    def _grow(self, regions: int) -> None:
        """A buffer of `regions` regions in place of this one: the waiting rows move, the new regions are free."""
        old = self.regions
        buf = torch.empty(1 + regions * self.rows, self._buf.shape[1], dtype=self._buf.dtype, device=self._buf.device)
        live = [i for s, r in self._region.items() for i in range(1 + r * self.rows, 1 + r * self.rows + self.count[s])]
        if live:  # only the waiting rows move (a region is mostly empty: rows waiting between appends)
            index = to_device(torch.tensor(live, dtype=torch.long), buf.device)
            buf.index_copy_(0, index, self._buf.index_select(0, index))
        self._buf, self._views = buf, {}
        self.version += 1
        self._free = list(range(old, regions))[::-1] + self._free

    def reserve(self, owners: list[tuple[int, int]]) -> list[int]:
        """The buffer rows of the next m waiting rows of each (slot, m) in `owners`, in order, counted as
        waiting now: the caller has them written (the step's forward) before anything reads them."""
        self._check(owners)
        return self._reserve(owners)

    def reserve_one_each(self, slots: list[int]) -> list[int]:
        """`reserve([(slot, 1) for slot in slots])` for distinct slots (a plain step's), in one pass."""
        count, rows, bases = self.count, self.rows, self._bases
        out = []
        for slot in slots:
            at = count[slot]
            if at >= rows:  # an invariant (as `_check`): undo this call's reservations, then raise naming the slot
                for done in slots[:len(out)]:
                    count[done] -= 1
                self._check([(slot, 1)])
            base = bases[slot]
            out.append((base if base >= 0 else self._base(slot)) + at)
            count[slot] = at + 1
        return out

    def _reserve(self, owners: list[tuple[int, int]]) -> list[int]:
        out = []
        for slot, m in owners:
            at, base = self.count[slot], self._base(slot)
            out += range(base + at, base + at + m)
            self.count[slot] = at + m
        return out

    def _check(self, owners: list[tuple[int, int]]) -> None:
        for slot, m in owners:  # an invariant: appends keep every slot under its share (checked before any change)
            if self.count[slot] + m > self.rows:
                raise RuntimeError(f"slot {slot} has {self.count[slot]} context rows waiting and commits {m}; its "
                                   f"buffer holds {self.rows}")

    def _dst(self, start: int, m: int) -> torch.Tensor:
        """Rows start..start+m-1 of the buffer as a view; one-row views are kept (until the buffer grows): a
        fused round's members that did not draft commit one row each, and on a GPU host making a view costs
        about half the copy."""
        if m != 1:
            return self._buf.narrow(0, start, m)
        view = self._views.get(start)
        if view is None:
            view = self._views[start] = self._buf.narrow(0, start, 1)
        return view

    def put(self, hidden: torch.Tensor, src: list[int], owners: list[tuple[int, int]]) -> None:
        """Rows `src` of `hidden`, the next m waiting rows of each (slot, m) in `owners` in order."""
        if not src:
            return
        self._check(owners)
        if len(owners) <= self.COPY_OWNERS:  # few owners (a lone sequence's step): a copy each, no index to send
            i = 0
            for slot, m in owners:
                if src[i:i + m] != list(range(src[i], src[i] + m)):  # its rows are not consecutive: gather them
                    break
                i += m
            else:
                i, whole = 0, hidden.shape[0]
                for slot, m in owners:
                    at, base, first = self.count[slot], self._base(slot), src[i]
                    self._dst(base + at, m).copy_(hidden if first == 0 and m == whole else hidden.narrow(0, first, m))
                    self.count[slot] = at + m
                    i += m
                return
        dst = self._reserve(owners)
        n, lo = len(src), src[0]
        if src[-1] - lo == n - 1 and src == list(range(lo, lo + n)):  # consecutive rows (a plain step's): no gather
            self._buf.index_copy_(0, to_device(torch.tensor(dst, dtype=torch.long), self._buf.device),
                                  hidden.narrow(0, lo, n))
            return
        index = to_device(torch.tensor(src + dst, dtype=torch.long), self._buf.device)
        self._buf.index_copy_(0, index[n:], hidden.index_select(0, index[:n]))

    def at_least(self, n: int) -> list[int]:
        """Slots with at least n rows waiting (only slots holding a region can have any)."""
        return [slot for slot in self._region if self.count[slot] >= n]

    def take(self, slots: list[int]) -> torch.Tensor:
        """The waiting rows of `slots` (in that order), removed: [sum of counts, width] on the device. The rows
        of up to COPY_OWNERS slots come as views of their regions (one slot: the region itself, no copy), more
        as one gather. A view is read before anything writes the region again: later commits are queued after
        the append that reads it (the same stream on a GPU). On an H100 the gather, with its index sent to the
        device, took 0.14-0.19 ms of host time per append (BENCHMARKS.md)."""
        spans = []
        for slot in slots:
            if self.count[slot]:
                spans.append((self._base(slot), self.count[slot]))
                self.count[slot] = 0
        if len(spans) <= self.COPY_OWNERS:
            views = [self._buf.narrow(0, base, m) for base, m in spans]
            if len(views) == 1:
                return views[0]
            return torch.cat(views) if views else self._buf.narrow(0, 0, 0)
        index = [i for base, m in spans for i in range(base, base + m)]
        return self._buf.index_select(0, to_device(torch.tensor(index, dtype=torch.long), self._buf.device))

    def drop(self, slot: int) -> None:
        """`slot` finished: its rows and its region go."""
        self.count[slot] = 0
        self._bases[slot] = -1
        region = self._region.pop(slot, None)
        if region is not None:
            self._free.append(region)
