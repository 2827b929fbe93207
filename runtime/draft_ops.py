"""The drafter's `mg::` ops served by the draft cache.

`mg::draft_append(k, v, positions, seq_slots, layer_id)` writes committed
context rows; `mg::draft_attend(q, k, v, positions, seq_slots, layer_id,
scale)` attends a block [B, T] non-causally over its sequence's cached context
(positions before the anchor, positions[:, 0]) plus the block's own K/V: with
the cache's Triton kernels (`KVCache.attend_block`) when it uses them, else
the torch reference over the gathered context (on the CPU, `draft_attend_cpu`
over no more context rows than the batch's furthest anchor has; elsewhere the
cache's static span).
Knows the cache protocol and the reference kernels; nothing about models.
"""

from __future__ import annotations

import torch

from mg.kernels.cpu_attention import draft_attend_cpu
from mg.kernels.draft_attention_ref import draft_attend_ref, draft_context_span

from .cache_base import KVCache


class DraftOps:
    kernel = True  # False: the reference even where the cache has the kernel (scripts/profile_round.py compares)

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.windows = [layer.window for layer in cache.spec.layers]

    def append(self, k, v, positions, seq_slots, layer_id: int) -> torch.Tensor:
        self.cache.write(k, v, positions, seq_slots, layer_id)
        return k

    def attend(self, q, k, v, positions, seq_slots, layer_id: int, scale: float) -> torch.Tensor:
        window = self.windows[layer_id]
        if self.kernel and self.cache.use_triton and q.dtype == self.cache.dtype:  # one kernel, not ~20 ops a layer
            q, k, v = (x.to(q.dtype) if x.stride(-1) == 1 else x.to(q.dtype).contiguous() for x in (q, k, v))
            return self.cache.attend_block(q, k, v, positions, seq_slots.contiguous(), layer_id, window, scale)
        span = self.cache.max_span(layer_id)
        span = min(window, span) if window else span
        on_cpu = positions.device.type == "cpu"
        if on_cpu and positions.numel():
            # No graph to keep valid on the CPU: read no more context rows than the furthest anchor has.
            span = min(span, int(positions[:, 0].max()))
        key_pos, valid = draft_context_span(positions[:, 0], window, span)
        ctx_k, ctx_v = self.cache.gather(layer_id, key_pos, seq_slots)
        attend = draft_attend_cpu if on_cpu else draft_attend_ref
        return attend(q, k, v, ctx_k, ctx_v, valid, scale)
