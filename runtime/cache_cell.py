"""kBatchedCell: one pool of cells per layer, shared by all sequences.

Layer storage is K and V `[max_cells + 1, Hkv, D]`; the last cell is the
scratch cell for padding rows. A cell holds one token (one (slot, position))
in every layer: allocation is per token, shared by all layers, and takes the
lowest free cell (a step's new rows slot by slot, in the order the slots first
appear in the step, each slot's in position order). Per sequence the host keeps the ordered cell list and the
device keeps `cell_table [n_slots + 1, capacity]` (position -> cell, unused
entries -> scratch cell), so attention gathers only that sequence's cells.
Cells carry reference counts: clone shares cells, rewind and release drop
ownership (a cell is freed when no owner is left), and a write into a shared
position takes a new cell for the writer only (copy-on-write of that position).

Pools are allocated whole at construction (max_cells is the declared budget)
and never move. What grows is the read span: a read gathers the keys of the
`read_span` positions below a query (all of them for global layers), and that
span doubles, up to the capacity, when a step declares a position beyond it.
Like the sequence layout's rows, it keeps the torch reference and the drafter's
context read from gathering `capacity` keys for short sequences; a captured
CUDA graph bakes the span in, so growing it bumps storage_version once a
reader has used it (the Triton kernel does not: with it, the target's graphs
are never recaptured for the span; the drafter's context read does).

The read side is the Triton kernel (`attend_cells_triton`) when `use_triton` (by
default: on CUDA with Triton available), else on CPU the per-sequence kernel of
`mg.kernels.cpu_attention`, else the torch reference.

Knows storage, placement and the read side (mg.kernels); must not know models,
programs, the scheduler or mg.export.
"""

from __future__ import annotations

import heapq
from typing import Optional, Union

import torch

from mg.kernels import triton_attention
from mg.kernels.attention_ref import attend_cells_ref
from mg.kernels.cpu_attention import attend_cells_cpu
from mg.manifests import KVSpec
from mg.manifests.constants import LAYOUT_CELL, POLICY_RING

from .cache_base import CacheError, KVCache, StepPlan
from .cuda_graphs import triton_enabled


class BatchedCellCache(KVCache):
    layout = LAYOUT_CELL

    def __init__(self, spec: KVSpec, device: Union[str, torch.device], n_slots: Optional[int] = None,
                 use_triton: Optional[bool] = None, initial_span: int = 64):
        n_slots = min(spec.max_cells, 64) if n_slots is None else n_slots
        if n_slots < 1:
            raise CacheError(f"n_slots={n_slots} for the cell layout; allowed: an integer >= 1")
        super().__init__(spec, device, n_slots)
        self.use_triton = triton_enabled(self.device, use_triton)  # False: the torch reference
        self.max_cells = spec.max_cells
        self.scratch_cell = spec.max_cells
        self._windows = [layer.window if layer.policy == POLICY_RING else 0 for layer in spec.layers]
        self._k = [self._zeros(layer.n_kv_heads, layer.head_dim) for layer in spec.layers]
        self._v = [self._zeros(layer.n_kv_heads, layer.head_dim) for layer in spec.layers]
        self.cell_table = torch.full((n_slots + 1, spec.capacity), self.scratch_cell, dtype=torch.int64,
                                     device=self.device)
        self._cells: list[list[int]] = [[] for _ in range(n_slots + 1)]  # per slot: position -> cell
        self._refs = [0] * self.max_cells
        self._free = list(range(self.max_cells))  # a heap: the lowest free cell is _free[0]
        self.read_span = min(max(1, initial_span), spec.capacity)  # > every declared position
        self._span_read = False  # a read has used read_span: growing it must invalidate captured graphs

    def _zeros(self, n_kv_heads: int, head_dim: int) -> torch.Tensor:
        # Zeros, not empty: every key a query reads is written first, but a stray read of a fresh row stays finite.
        return torch.zeros(self.max_cells + 1, n_kv_heads, head_dim, dtype=self.dtype, device=self.device)

    def storage(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k[layer_id], self._v[layer_id]

    def cell_list(self, slot: int) -> list[int]:
        """The ordered cells of `slot` (position -> cell id)."""
        return list(self._cells[slot])

    def write(self, k, v, positions, seq_slots, layer_id: int) -> None:
        # Admission (or the step itself: `place`) put the step's cells in the device cell_table; padding rows
        # map to the scratch cell.
        k_pool, v_pool = self._k[layer_id], self._v[layer_id]
        if self.use_triton:
            triton_attention.write_cells_triton(k.to(k_pool.dtype), v.to(v_pool.dtype), k_pool, v_pool,
                                                self.cell_table, positions, seq_slots)
            return
        cells = self.cell_table[seq_slots, positions]
        k_pool.index_put_((cells,), k.to(k_pool.dtype))
        v_pool.index_put_((cells,), v.to(v_pool.dtype))

    def gather(self, layer_id: int, key_pos, seq_slots):
        cells = self.cell_table[seq_slots[:, None].expand_as(key_pos), key_pos]
        return self._k[layer_id][cells], self._v[layer_id][cells]

    def max_span(self, layer_id: int) -> int:
        self._span_read = True
        return self.read_span

    def attend_block(self, q, k, v, positions, seq_slots, layer_id: int, window: int, scale: float) -> torch.Tensor:
        # The kernel bounds its context loop by the anchor: the read span is not used (graphs stay valid as it grows).
        return triton_attention.draft_attend_cells_triton(q, k, v, self._k[layer_id], self._v[layer_id],
                                                          self.cell_table, positions, seq_slots, window, scale)

    def update_and_attend(self, q, k, v, positions, seq_slots, layer_id: int, scale: float) -> torch.Tensor:
        self.write(k, v, positions, seq_slots, layer_id)
        k_pool, v_pool = self._k[layer_id], self._v[layer_id]
        attend = triton_attention.attend_cells_triton if self.use_triton else attend_cells_ref
        if self.use_triton:  # the kernel bounds each query's loop by its own position
            return attend(q, k_pool, v_pool, self.cell_table, positions, seq_slots, self._windows[layer_id], scale)
        self._span_read = True
        if self.device.type == "cpu":  # per sequence, keys gathered once (reads the slots on the host)
            return attend_cells_cpu(q, k_pool, v_pool, self.cell_table, positions, seq_slots,
                                    self._windows[layer_id], scale, self.row_invariant)
        return attend(q, k_pool, v_pool, self.cell_table, positions, seq_slots, self._windows[layer_id], scale,
                      self.read_span)

    # ------------------------------------------------------------------ hooks

    # Admission reads each slot's span, not its rows one by one: a span's rows past the slot's cells take new
    # cells in one pass (`_apply_step`). A context append of ~90 rows spent 0.4 ms of host time in per-row
    # admission on an H100 host (BENCHMARKS.md).
    plans_tokens = False

    def _refuse_step(self, plan: StepPlan) -> None:
        needed = sum(self._cells_needed(slot, first, last) for slot, (first, last) in plan.spans.items())
        if needed > len(self._free):
            raise CacheError(f"out of cells: the step needs {needed} new cells but {len(self._free)} of "
                             f"max_cells={self.max_cells} are free")

    def _owned_alone(self, slot: int, pos: int) -> bool:
        """The slot's cell at `pos` exists and no other sequence shares it: it is overwritten in place."""
        cells = self._cells[slot]
        return pos < len(cells) and cells[pos] >= 0 and self._refs[cells[pos]] == 1

    def _cells_needed(self, slot: int, first: int, last: int) -> int:
        """New cells that writing positions first..last of `slot` takes: every position past its cells, and
        those of its cells that are missing or shared."""
        held = len(self._cells[slot])
        fresh = last + 1 - max(first, held) if last >= held else 0
        return fresh + sum(1 for pos in range(first, min(last + 1, held)) if not self._owned_alone(slot, pos))

    def _apply_step(self, plan: StepPlan, defer: bool = False) -> None:
        need = max((last + 1 for _, last in plan.spans.values()), default=0)
        if need > self.read_span:
            while self.read_span < need:
                self.read_span = min(2 * self.read_span, self.capacity)
            self._version += self._span_read
        # Each span's rows in position order, slots in the step's order: rows within its cells are kept in place
        # when owned alone, else take a cell (`_take`); rows past them take the lowest free cells, in one pass.
        slots, positions, placed = [], [], []
        free, refs = self._free, self._refs
        for slot, (first, last) in plan.spans.items():
            cells = self._cells[slot]
            held = len(cells)
            for pos in range(first, min(last + 1, held)):
                if not self._owned_alone(slot, pos):
                    slots.append(slot)
                    positions.append(pos)
                    placed.append(self._take(slot, pos))
            start = max(first, held)
            if last >= start:
                new = [heapq.heappop(free) for _ in range(last + 1 - start)]
                for cell in new:
                    refs[cell] = 1
                cells.extend([-1] * (start - held))  # positions before the span, if any, stay placeholders
                cells.extend(new)
                slots += [slot] * len(new)
                positions += range(start, last + 1)
                placed += new
        if placed and not defer:  # one host tensor, one copy: on a GPU host each small copy costs about a launch
            index = torch.tensor(slots + positions + placed, dtype=torch.int64)
            slots_d, positions_d, cells_d = index.to(self.device, non_blocking=True).view(3, len(placed))
            self.place(positions_d, slots_d, cells_d)

    placement_input = True  # a step may write its cells to the cell table itself (`declare_rows(defer=True)`)

    def place(self, positions: torch.Tensor, seq_slots: torch.Tensor, placement: torch.Tensor) -> None:
        """cell_table[seq_slots, positions] = placement: the cells of an admitted step's rows (padding rows: the
        scratch slot's position 0 and the scratch cell, which it holds already). Device ops only: capturable."""
        self.cell_table.index_put_((seq_slots, positions), placement)

    def _placement(self, positions: list[int], seq_slots: list[int]) -> list[int]:
        """Each row's cell after admission (padding rows: the scratch cell)."""
        cells, scratch, scratch_cell = self._cells, self.scratch_slot, self.scratch_cell
        return [scratch_cell if slot == scratch else cells[slot][pos] for slot, pos in zip(seq_slots, positions)]

    def _placement_spans(self, spans: list[tuple[int, int, int]]) -> list[int]:
        """Each row's cell after admission, the spans' rows in order."""
        cells, out = self._cells, []
        for slot, first, m in spans:
            out += cells[slot][first:first + m]
        return out

    def _take(self, slot: int, pos: int) -> int:
        """Place (slot, pos) in the lowest free cell; a shared cell it replaces stays with its other owners."""
        cell = heapq.heappop(self._free)
        old = self._cells[slot][pos]
        if old >= 0:
            self._unref(old)
        self._cells[slot][pos] = cell
        self._refs[cell] = 1
        return cell

    def _unref(self, cell: int) -> None:
        self._refs[cell] -= 1
        if self._refs[cell] == 0:
            heapq.heappush(self._free, cell)

    def _reserve(self) -> None:
        if self.read_span < self.capacity:  # pools never move; a read span baked into a graph would grow
            self.read_span = self.capacity
            self._version += self._span_read

    def _check_keeps(self, slot: int, length: int, action: str) -> None:
        """Cells keep every position until it is rewound: nothing to refuse."""

    def _truncate(self, slot: int, new_length: int) -> None:
        for cell in self._cells[slot][new_length:]:
            self._unref(cell)
        del self._cells[slot][new_length:]
        self.cell_table[slot, new_length:] = self.scratch_cell

    def _copy_prefix(self, src: int, dst: int, length: int) -> None:
        shared = self._cells[src][:length]
        for cell in shared:
            self._refs[cell] += 1
        self._cells[dst] = list(shared)
        self.cell_table[dst, :length] = self.cell_table[src, :length]

    def _bytes(self) -> int:
        pools = sum(t.numel() * t.element_size() for t in self._k + self._v)
        return pools + self.cell_table.numel() * self.cell_table.element_size()

    def _layout_metrics(self) -> dict:
        return {"cells_used": self.max_cells - len(self._free), "cells_free": len(self._free)}
