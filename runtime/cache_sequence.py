"""kBatchedSequence: per-sequence KV columns, one storage pair per layer.

Layer storage is K and V `[n_slots + 1, rows, Hkv, D]` (the last slot is the
scratch slot for padding rows); position p of a slot lives at row `p % rows`.
Flat layers grow their rows by doubling up to `capacity`; ring layers grow the
same way up to `min(window + max_write - 1, capacity)` and wrap once a step
needs no more rows. Growth re-places every held position at `p % new_rows`.

Per (layer, slot) the host keeps `held_from`: the oldest position the column
still holds (later writes wrapped over older ones). Rewind, clone and a write
behind the length are allowed only while the rows hold what the next query's
window needs.

The read side is the Triton kernel (`attend_columns_triton`) when `use_triton` (by
default: on CUDA with Triton available), else on CPU the per-sequence kernel of
`mg.kernels.cpu_attention` (reads the slots on the host; never captured), else the torch
reference; the Triton kernel and the reference read only shapes on the host, so a CUDA graph
can capture them until growth moves storage.

Knows storage, placement and the read side (mg.kernels); must not know models,
programs, the scheduler or mg.export.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from mg.kernels import triton_attention
from mg.kernels.attention_ref import attend_columns_ref
from mg.kernels.cpu_attention import attend_columns_cpu
from mg.manifests import KVSpec
from mg.manifests.constants import LAYOUT_SEQUENCE, POLICY_RING

from .cache_base import CacheError, KVCache, StepPlan
from .cuda_graphs import triton_enabled


class BatchedSequenceCache(KVCache):
    layout = LAYOUT_SEQUENCE
    plans_tokens = False  # admission reads each slot's span only

    def __init__(self, spec: KVSpec, device: Union[str, torch.device], initial_rows: int = 64,
                 use_triton: Optional[bool] = None):
        super().__init__(spec, device, spec.max_seqs)
        self.use_triton = triton_enabled(self.device, use_triton)  # False: the torch reference
        self._windows = [layer.window if layer.policy == POLICY_RING else 0 for layer in spec.layers]
        self._max_rows = [min(w + spec.max_write - 1, spec.capacity) if w else spec.capacity for w in self._windows]
        start = [min(max(1, initial_rows), m) for m in self._max_rows]
        self._k = [self._zeros(layer_id, rows) for layer_id, rows in enumerate(start)]
        self._v = [self._zeros(layer_id, rows) for layer_id, rows in enumerate(start)]
        # Layers of one window have the same rows (their growth follows the same need) and so hold the same
        # positions: one `held_from` list per window, which the group's layers share.
        groups: dict[int, list[int]] = {}
        for layer_id, window in enumerate(self._windows):
            groups.setdefault(window, []).append(layer_id)
        self._groups = list(groups.values())
        held = {window: [0] * (self.n_slots + 1) for window in groups}
        self._held_from = [held[window] for window in self._windows]

    def _zeros(self, layer_id: int, rows: int) -> torch.Tensor:
        # Zeros, not empty: every key a query reads is written first, but a stray read of a fresh row stays finite.
        layer = self.spec.layers[layer_id]
        return torch.zeros(self.n_slots + 1, rows, layer.n_kv_heads, layer.head_dim, dtype=self.dtype,
                           device=self.device)

    def rows(self, layer_id: int) -> int:
        return self._k[layer_id].shape[1]

    def storage(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k[layer_id], self._v[layer_id]

    def write(self, k, v, positions, seq_slots, layer_id: int) -> None:
        # The write row is derived on the device from the op's own inputs: rows is a storage shape,
        # fixed until growth bumps storage_version. No host reads, so this can be graph-captured.
        k_store, v_store = self._k[layer_id], self._v[layer_id]
        if self.use_triton:
            triton_attention.write_columns_triton(k.to(k_store.dtype), v.to(v_store.dtype), k_store, v_store,
                                                  positions, seq_slots)
            return
        row = positions % k_store.shape[1]
        k_store.index_put_((seq_slots, row), k.to(k_store.dtype))
        v_store.index_put_((seq_slots, row), v.to(v_store.dtype))

    def gather(self, layer_id: int, key_pos, seq_slots):
        k_store, v_store = self._k[layer_id], self._v[layer_id]
        rows = key_pos % k_store.shape[1]
        slots = seq_slots[:, None].expand_as(rows)
        return k_store[slots, rows], v_store[slots, rows]

    def max_span(self, layer_id: int) -> int:
        return self.rows(layer_id)

    def attend_block(self, q, k, v, positions, seq_slots, layer_id: int, window: int, scale: float) -> torch.Tensor:
        k_store, v_store = self._k[layer_id], self._v[layer_id]
        return triton_attention.draft_attend_columns_triton(q, k, v, k_store, v_store, positions, seq_slots, window,
                                                            scale)

    def update_and_attend(self, q, k, v, positions, seq_slots, layer_id: int, scale: float) -> torch.Tensor:
        self.write(k, v, positions, seq_slots, layer_id)
        k_store, v_store = self._k[layer_id], self._v[layer_id]
        window = self._windows[layer_id]
        if self.use_triton:
            return triton_attention.attend_columns_triton(q, k_store, v_store, positions, seq_slots, window, scale)
        if self.device.type == "cpu":  # per sequence (reads the slots on the host); `row_invariant`: alike in any call
            return attend_columns_cpu(q, k_store, v_store, positions, seq_slots, window, scale, self.row_invariant)
        return attend_columns_ref(q, k_store, v_store, positions, seq_slots, window, scale)

    # ------------------------------------------------------------------ hooks

    def _refuse_step(self, plan: StepPlan) -> None:
        for slot, (first, _) in plan.spans.items():
            if first < self._length[slot]:
                self._check_keeps(slot, first, f"write of slot {slot} at position {first}")

    def _apply_step(self, plan: StepPlan, defer: bool = False) -> None:
        """Grow what the step needs, then note what its writes wrap over: once per group of layers sharing a
        window (same rows, same held positions). Storage at its most rows (reserved: always so with CUDA
        graphs) never needs growing: a step's need never exceeds it."""
        for layers in self._groups:
            first = layers[0]
            rows = self.rows(first)
            if rows < self._max_rows[first]:
                need = self._rows_needed(first, plan)
                if need > rows:
                    for layer_id in layers:
                        self._grow(layer_id, need)
                    rows = self.rows(first)
            if rows >= self.capacity:  # every position has its own row: writes never wrap
                continue
            held = self._held_from[first]
            for slot, (_, last) in plan.spans.items():
                if last + 1 - rows > held[slot]:
                    held[slot] = last + 1 - rows  # the step's writes wrap over these

    def _rows_needed(self, layer_id: int, plan: StepPlan) -> int:
        """Rows so that no write of the step lands on a position a query of the step (or a flat column) reads."""
        window, need = self._windows[layer_id], 0
        for slot, (first, last) in plan.spans.items():
            if window:
                need = max(need, last + 1 - max(0, first - window + 1))
            else:
                need = max(need, self._length[slot], last + 1)
        return need

    def _check_keeps(self, slot: int, length: int, action: str) -> None:
        for layer_id, window in enumerate(self._windows):
            lo = max(0, length - window + 1) if window else 0
            held = self._held_from[layer_id][slot]
            if length > 0 and held > lo:
                raise CacheError(
                    f"{action} refused: layer {layer_id} (ring, window={window}, rows={self.rows(layer_id)}) "
                    f"no longer holds positions {lo}..{held - 1} that a query at position {length} needs (it "
                    f"holds {held}..{self._length[slot] - 1}); allowed: a length >= {held + window - 1}, or 0")

    def _truncate(self, slot: int, new_length: int) -> None:
        for held in self._held_from:
            held[slot] = min(held[slot], new_length)

    def _copy_prefix(self, src: int, dst: int, length: int) -> None:
        # Positions below `length` live in rows [0, min(rows, length)): p % rows < length when length <= rows.
        for layer_id in range(len(self._k)):
            m = min(self.rows(layer_id), length)
            self._k[layer_id][dst, :m] = self._k[layer_id][src, :m]
            self._v[layer_id][dst, :m] = self._v[layer_id][src, :m]
            held = self._held_from[layer_id]
            held[dst] = min(held[src], length)

    def _bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._k + self._v)

    def _layout_metrics(self) -> dict:
        return {"rows": tuple(self.rows(i) for i in range(len(self._k)))}

    # ------------------------------------------------------------------ growth

    def _reserve(self) -> None:
        layers = [i for i, max_rows in enumerate(self._max_rows) if self.rows(i) < max_rows]
        # Every layer's storage first: running out of memory part way leaves the cache as it was.
        grown = {i: [self._zeros(i, self._max_rows[i]) for _ in range(2)] for i in layers}
        for i in layers:
            self._replace(i, grown.pop(i))

    def _grow(self, layer_id: int, need: int) -> None:
        new_rows = self.rows(layer_id)
        assert need <= self._max_rows[layer_id], f"layer {layer_id}: {need} rows needed > {self._max_rows[layer_id]}"
        while new_rows < need:
            new_rows = min(2 * new_rows, self._max_rows[layer_id])
        self._replace(layer_id, [self._zeros(layer_id, new_rows) for _ in range(2)])  # K and V before either moves

    def _replace(self, layer_id: int, grown: list[torch.Tensor]) -> None:
        """Move the layer's held positions into the larger K and V storage `grown`, which replaces it."""
        slots, src, dst = self._held_rows(layer_id, self.rows(layer_id), grown[0].shape[1])
        for store, new in zip((self._k, self._v), grown):
            new[slots, dst] = store[layer_id][slots, src]
            store[layer_id] = new
        self._growths += 1
        self._version += 1

    def _held_rows(self, layer_id: int, old_rows: int, new_rows: int):
        """(slot, old row, new row) of every held position p: it moves from p % old_rows to p % new_rows."""
        lengths = torch.tensor(self._length, device=self.device)
        held = torch.tensor(self._held_from[layer_id], device=self.device)
        pos = lengths[:, None] - 1 - torch.arange(old_rows, device=self.device)[None, :]  # [slots, old_rows]
        keep = (pos >= held[:, None]) & (pos >= 0)
        slots = torch.arange(self.n_slots + 1, device=self.device)[:, None].expand_as(pos)[keep]
        pos = pos[keep]
        return slots, pos % old_rows, pos % new_rows
