"""The protocol shared by the runtime-owned off-graph KV caches (docs/ARCHITECTURE.md section 5).

Holds what both layouts agree on: the error type, the metrics record, the
committed lengths (a host mirror and a device tensor), admission control for a
step (`declare_step` refuses a step that breaks a limit before anything
changes), and rewind / clone / release bookkeeping. The layouts
(`cache_sequence`, `cache_cell`) add storage, placement and the
`mg::update_and_attend` semantics through a few `_hooks`.

Knows a cache only through `KVSpec`. Must not know models, programs, the
scheduler or mg.export.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional, Union

import torch

from mg.manifests import KVSpec
from mg.manifests.constants import LAYOUT_CELL, LAYOUT_SEQUENCE

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class CacheError(ValueError):
    """A request the cache refuses. The message names the limit and the values; nothing changed."""


@dataclass(frozen=True)
class CacheMetrics:
    layout: str  # "sequence" | "cell"
    lengths: tuple[int, ...]  # committed length of each usable slot [n_slots]
    bytes_allocated: int  # K/V storage of every layer (and the cell table)
    growth_count: int  # storage reallocations so far
    storage_version: int  # bumps whenever storage tensors move or read shapes grow (CUDA graphs recapture)
    rows: Optional[tuple[int, ...]] = None  # sequence layout: rows per layer now
    cells_used: Optional[int] = None  # cell layout: cells owned by at least one sequence
    cells_free: Optional[int] = None  # cell layout: cells free for placement


@dataclass(frozen=True)
class StepPlan:
    """An admitted step, on the host. Padding rows (the scratch slot) are not in it."""

    tokens: tuple[tuple[int, int], ...]  # (slot, position) of each live row, in step order
    spans: dict[int, tuple[int, int]]  # live slot -> (first, last) position written this step


def _check_index_tensor(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
        found = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise CacheError(f"{name} must be a 1-D int64 tensor [N]; found {found}")


class KVCache(abc.ABC):
    """Common state and admission control; see docs/ARCHITECTURE.md section 5 for the contract."""

    layout: str = ""

    def __init__(self, spec: KVSpec, device: Union[str, torch.device], n_slots: int):
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[spec.dtype]
        self.n_slots = n_slots
        self.scratch_slot = n_slots
        self.capacity = spec.capacity
        self.max_write = spec.max_write
        self._length = [0] * (n_slots + 1)  # the committed lengths; the scratch slot stays 0
        # CPU read side: every row's attention row-invariant (`mg.kernels.cpu_attention`); the model
        # runner sets it from RunConfig.row_invariant.
        self.row_invariant = False
        self._growths = 0
        self._version = 0

    # ------------------------------------------------------------------ the protocol

    def declare_step(self, positions: torch.Tensor, seq_slots: torch.Tensor, defer: bool = False) -> Optional[list[int]]:
        """Admit the next step's tokens (positions/seq_slots [N] int64), or refuse with nothing changed.
        `defer`: see `declare_rows`."""
        _check_index_tensor("positions", positions)
        _check_index_tensor("seq_slots", seq_slots)
        return self.declare_rows(positions.tolist(), seq_slots.tolist(), defer)

    def declare_rows(self, positions: list[int], seq_slots: list[int], defer: bool = False) -> Optional[list[int]]:
        """`declare_step` of rows given as lists of ints (a packed step's, made on the host). `defer` (layouts
        with `placement_input`): the device side of the rows' placement is left to the caller, who passes the
        returned placement of every row (padding rows included) to `place` before anything reads the cache
        (the model runner does it inside the step's forward, in its CUDA graph); None otherwise."""
        defer = defer and self.placement_input
        self._admit(self._plan(positions, seq_slots), defer)
        return self._placement(positions, seq_slots) if defer else None

    def declare_spans(self, spans: list[tuple[int, int, int]], defer: bool = False) -> Optional[list[int]]:
        """`declare_rows` of rows given as spans (slot, first position, rows), one per live slot: a fused round's
        or a context append's (their padding rows, on the scratch slot, need no admission). The same checks
        and the same effect as the rows listed one by one, without a loop over rows where the layout needs
        none. `defer`: as `declare_rows`; the placement returned is of the spans' rows only."""
        defer = defer and self.placement_input
        self._admit(self._plan_spans(spans), defer)
        return self._placement_spans(spans) if defer else None

    def _admit(self, plan: StepPlan, defer: bool = False) -> None:
        """Refuse the planned step with nothing changed, or apply it and extend the slots' lengths."""
        self._refuse_step(plan)
        self._apply_step(plan, defer)
        for slot, (_, last) in plan.spans.items():
            self._length[slot] = max(self._length[slot], last + 1)

    # Layouts whose admission writes per-row placement to the device (the cell table): with `declare_rows(...,
    # defer=True)` the step writes it itself (`place`), from one more input column, instead of admission
    # sending it in copies of its own.
    placement_input: bool = False

    def place(self, positions: torch.Tensor, seq_slots: torch.Tensor, placement: torch.Tensor) -> None:
        """Write a deferred admission's placement (device tensors [N]); see `declare_rows`."""
        raise NotImplementedError(f"the {self.layout} layout has no placement input")

    def _placement(self, positions: list[int], seq_slots: list[int]) -> list[int]:
        raise NotImplementedError(f"the {self.layout} layout has no placement input")

    def _placement_spans(self, spans: list[tuple[int, int, int]]) -> list[int]:
        raise NotImplementedError(f"the {self.layout} layout has no placement input")

    @abc.abstractmethod
    def update_and_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          seq_slots: torch.Tensor, layer_id: int, scale: float) -> torch.Tensor:
        """Write k/v [N, Hkv, D] at each token's (slot, position), return attention [N, Hq, D]."""

    @abc.abstractmethod
    def storage(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V storage tensors (for kernels and tests)."""

    @abc.abstractmethod
    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor,
              layer_id: int) -> None:
        """Write k/v [N, Hkv, D] at each token's (slot, position) of a declared step, without attending."""

    @abc.abstractmethod
    def gather(self, layer_id: int, key_pos: torch.Tensor, seq_slots: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [B, S, Hkv, D] of slot seq_slots[b] at positions key_pos [B, S] (positions must be held)."""

    @abc.abstractmethod
    def attend_block(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     seq_slots: torch.Tensor, layer_id: int, window: int, scale: float) -> torch.Tensor:
        """The drafter's block attention (`mg::draft_attend`) with the Triton kernel, for caches that use it:
        q [B, T, Hq, D] and the block's k/v [B, T, Hkv, D] in the storage dtype, positions [B, T] (anchor in
        column 0), seq_slots [B] -> [B, T, Hq, D]; the context read is `draft_context_span`'s, span
        min(window, max rows) (window 0: all)."""

    @abc.abstractmethod
    def max_span(self, layer_id: int) -> int:
        """How many positions a read of this layer may need at most, from storage shapes only."""

    def length(self, slot: int) -> int:
        return self._length[slot]

    def lengths(self) -> torch.Tensor:
        """Committed lengths on the device, [n_slots + 1] int64 (the scratch slot's is 0): a copy made now.
        The host holds the lengths; no kernel reads them, so steps never copy them to the device."""
        return torch.tensor(self._length, dtype=torch.int64).to(self.device)

    def reserve(self) -> None:
        """Allocate storage at its declared size now, so that it never moves later (a CUDA graph replays
        fixed addresses: growth would capture every graph of this cache again, mid-run). Raises
        torch.OutOfMemoryError, with nothing changed, when the device lacks the memory (it then grows as before)."""
        self._reserve()

    def rewind(self, slot: int, new_length: int) -> None:
        """Drop positions >= new_length of `slot`."""
        self._check_live_slot("slot", slot)
        length = self._length[slot]
        if not 0 <= new_length <= length:
            raise CacheError(f"rewind of slot {slot} to new_length={new_length}; allowed: 0..{length} (its length)")
        self._check_keeps(slot, new_length, f"rewind of slot {slot} to {new_length}")
        self._set_length(slot, new_length)

    def clone(self, src: int, dst: int, length: int) -> None:
        """Prefix reuse: the empty slot `dst` gets the first `length` positions of `src`."""
        self._check_live_slot("src", src)
        self._check_live_slot("dst", dst)
        if src == dst or self._length[dst] != 0:
            raise CacheError(f"clone into dst={dst}: dst must be another slot than src={src} and empty; "
                             f"its length is {self._length[dst]}")
        if not 0 <= length <= self._length[src]:
            raise CacheError(f"clone of length={length} from slot {src}; allowed: 0..{self._length[src]} "
                             f"(its length)")
        self._check_keeps(src, length, f"clone of slot {src} at length {length}")
        self._copy_prefix(src, dst, length)
        self._length[dst] = length

    def release(self, slot: int) -> None:
        """Free a finished sequence."""
        self._check_live_slot("slot", slot)
        self._set_length(slot, 0)

    def metrics(self) -> CacheMetrics:
        return CacheMetrics(layout=self.layout, lengths=tuple(self._length[:self.n_slots]),
                            bytes_allocated=self._bytes(), growth_count=self._growths,
                            storage_version=self._version, **self._layout_metrics())

    def storage_version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ admission

    def _plan(self, positions: list[int], seq_slots: list[int]) -> StepPlan:
        n = len(positions)
        if len(seq_slots) != n:
            raise CacheError(f"positions has {n} rows but seq_slots has {len(seq_slots)}; they must match")
        self._check_count(n)
        by_slot: dict[int, list[int]] = {}
        tokens = []
        scratch, capacity = self.scratch_slot, self.capacity
        for i, (slot, pos) in enumerate(zip(seq_slots, positions)):
            if not (0 <= slot < scratch and 0 <= pos < capacity):  # out of range, or a padding row
                self._check_row(i, slot, pos)  # raises unless a padding row
                continue
            ps = by_slot.get(slot)
            if ps is None:
                by_slot[slot] = [pos]
            else:
                ps.append(pos)
            tokens.append((slot, pos))
        spans = {slot: self._check_span(slot, ps) for slot, ps in by_slot.items()}
        return StepPlan(tuple(tokens), spans)

    # Does `_apply_step` / `_refuse_step` read a plan's tokens (per-row placement), or its spans only?
    plans_tokens = True

    def _plan_spans(self, spans: list[tuple[int, int, int]]) -> StepPlan:
        n = sum(m for _, _, m in spans)
        self._check_count(n)
        by_slot: dict[int, tuple[int, int]] = {}
        tokens: list[tuple[int, int]] = []
        for slot, first, m in spans:
            last = first + m - 1
            if m < 1 or not 0 <= slot < self.scratch_slot:
                raise CacheError(f"span ({slot}, {first}, {m}): a span names a live slot in 0..{self.n_slots - 1} "
                                 f"and at least one row (padding rows need no admission)")
            for pos in (first, last):
                if not 0 <= pos < self.capacity:
                    raise CacheError(f"position {pos} (slot {slot}) is beyond capacity={self.capacity}; "
                                     f"allowed: 0..{self.capacity - 1}")
            if slot in by_slot:
                raise CacheError(f"positions of slot {slot} in one step must be distinct and contiguous; "
                                 f"found two spans")
            self._check_start(slot, first)
            by_slot[slot] = (first, last)
            if self.plans_tokens:
                tokens += [(slot, pos) for pos in range(first, last + 1)]
        return StepPlan(tuple(tokens), by_slot)

    def _check_count(self, n: int) -> None:
        if n > self.max_write:
            raise CacheError(f"the step has N={n} tokens; allowed: at most max_write={self.max_write}")

    def _check_start(self, slot: int, first: int) -> None:
        if first > self._length[slot]:
            raise CacheError(f"position {first} of slot {slot} skips ahead of its length {self._length[slot]}; "
                             f"allowed: a step starts at a position <= length")

    def _check_row(self, i: int, slot: int, pos: int) -> None:
        if not 0 <= slot <= self.scratch_slot:
            raise CacheError(f"seq_slots[{i}]={slot} is out of range; allowed: 0..{self.n_slots - 1}, or "
                             f"scratch_slot={self.scratch_slot} for padding rows")
        if not 0 <= pos < self.capacity:
            raise CacheError(f"positions[{i}]={pos} (slot {slot}) is beyond capacity={self.capacity}; "
                             f"allowed: 0..{self.capacity - 1}")
        if slot == self.scratch_slot and pos != 0:
            raise CacheError(f"positions[{i}]={pos} on scratch_slot={slot}; padding rows use position 0")

    def _check_span(self, slot: int, ps: list[int]) -> tuple[int, int]:
        if len(ps) == 1:  # a decode step's one row
            first = last = ps[0]
        else:
            first, last = min(ps), max(ps)
            if sorted(ps) != list(range(first, last + 1)):
                raise CacheError(f"positions of slot {slot} in one step must be distinct and contiguous; "
                                 f"found {sorted(ps)}")
        self._check_start(slot, first)
        return first, last

    def _check_live_slot(self, name: str, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise CacheError(f"{name}={slot} is out of range; allowed: 0..{self.n_slots - 1}")

    def _set_length(self, slot: int, new_length: int) -> None:
        self._truncate(slot, new_length)
        self._length[slot] = new_length

    # ------------------------------------------------------------------ layout hooks

    @abc.abstractmethod
    def _refuse_step(self, plan: StepPlan) -> None:
        """Raise CacheError for a layout limit (ring contents, free cells); change nothing."""

    @abc.abstractmethod
    def _apply_step(self, plan: StepPlan, defer: bool = False) -> None:
        """Grow storage, place the step's tokens (`defer`: the device side of placement is the caller's, see
        `declare_rows`). Runs before lengths are updated."""

    @abc.abstractmethod
    def _check_keeps(self, slot: int, length: int, action: str) -> None:
        """Raise CacheError unless `slot` still holds what a query at position `length` needs."""

    @abc.abstractmethod
    def _reserve(self) -> None:
        """Grow storage (and whatever a captured read bakes in) to the largest size it can ever need."""

    @abc.abstractmethod
    def _truncate(self, slot: int, new_length: int) -> None:
        """Drop positions >= new_length of `slot` (checks already passed)."""

    @abc.abstractmethod
    def _copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Give the empty `dst` the first `length` positions of `src` (checks already passed)."""

    @abc.abstractmethod
    def _bytes(self) -> int:
        """Bytes of storage allocated now."""

    @abc.abstractmethod
    def _layout_metrics(self) -> dict:
        """Layout-specific CacheMetrics fields."""


def make_cache(spec: KVSpec, device: Union[str, torch.device], n_slots: Optional[int] = None) -> KVCache:
    """The cache class the manifest's layout names: kBatchedSequence or kBatchedCell."""
    # Imported here: both layout modules import this one.
    from .cache_cell import BatchedCellCache
    from .cache_sequence import BatchedSequenceCache

    if spec.layout == LAYOUT_SEQUENCE:
        if n_slots is not None and n_slots != spec.max_seqs:
            raise CacheError(f"n_slots={n_slots} for the sequence layout; allowed: kv.max_seqs={spec.max_seqs} "
                             f"(or None)")
        return BatchedSequenceCache(spec, device)
    if spec.layout == LAYOUT_CELL:
        return BatchedCellCache(spec, device, n_slots)
    raise CacheError(f"kv.layout={spec.layout!r}; allowed: {LAYOUT_SEQUENCE} | {LAYOUT_CELL}")
