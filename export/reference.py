"""Eager reference attention backends for the MG model (tests and export checks).

`ReferenceKV` keeps its own per-sequence K/V (plain tensors grown by `cat`),
written before attention so tokens of one step see each other causally.
`dense_attend` attends one whole sequence with a positional mask and no cache.
Neither is fast; both are small enough to read and trust.
"""

from __future__ import annotations

import torch

from mg.kernels.attention_ref import attend_dense_ref

from .config import MuseGlimmerConfig


class ReferenceKV:
    """The model's own KV for eager generation: one growing [L, Hkv, D] pair per (layer, sequence)."""

    def __init__(self, cfg: MuseGlimmerConfig):
        self.windows = [cfg.window(i) for i in range(cfg.n_layers)]
        self.k: dict[tuple[int, int], torch.Tensor] = {}
        self.v: dict[tuple[int, int], torch.Tensor] = {}

    def length(self, seq: int, layer_id: int = 0) -> int:
        t = self.k.get((layer_id, seq))
        return 0 if t is None else t.shape[0]

    def _write(self, layer_id, seq, pos, k, v):
        key = (layer_id, seq)
        old_k = self.k.get(key, k.new_empty((0, *k.shape)))
        old_v = self.v.get(key, v.new_empty((0, *v.shape)))
        if pos < old_k.shape[0]:  # overwrite: drop what follows (a rewind by rewriting)
            old_k, old_v = old_k[:pos], old_v[:pos]
        assert pos == old_k.shape[0], f"reference KV: position {pos} skips ahead of length {old_k.shape[0]}"
        self.k[key] = torch.cat([old_k, k[None]])
        self.v[key] = torch.cat([old_v, v[None]])

    def __call__(self, q, k, v, positions, seq_slots, layer_id: int, scale: float) -> torch.Tensor:
        for i in range(q.shape[0]):
            self._write(layer_id, int(seq_slots[i]), int(positions[i]), k[i], v[i])
        out = torch.empty_like(q)
        for i in range(q.shape[0]):
            key = (layer_id, int(seq_slots[i]))
            kk, vv = self.k[key], self.v[key]
            k_pos = torch.arange(kk.shape[0], device=q.device)
            out[i] = attend_dense_ref(q[i:i + 1], kk, vv, positions[i:i + 1], k_pos, self.windows[layer_id], scale)[0]
        return out


def dense_attend(cfg: MuseGlimmerConfig):
    """An attend backend for ONE sequence given whole (no cache): positional causal + window mask."""
    windows = [cfg.window(i) for i in range(cfg.n_layers)]

    def attend(q, k, v, positions, seq_slots, layer_id: int, scale: float) -> torch.Tensor:
        return attend_dense_ref(q, k, v, positions, positions, windows[layer_id], scale)

    return attend


@torch.no_grad()
def greedy_generate(model, prompt: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
    """Target-only greedy generation with `ReferenceKV`: prefill the prompt, then one token per step."""
    kv = ReferenceKV(model.cfg)
    tokens = torch.tensor(prompt, dtype=torch.long)
    positions = torch.arange(len(prompt))
    slots = torch.zeros(len(prompt), dtype=torch.long)
    logits, _ = model(tokens, positions, slots, torch.tensor([len(prompt) - 1]), kv)
    out: list[int] = []
    pos = len(prompt)
    while len(out) < max_new_tokens:
        tok = int(logits[-1].argmax())
        out.append(tok)
        if tok in eos_ids or len(out) == max_new_tokens:
            break
        logits, _ = model(torch.tensor([tok]), torch.tensor([pos]), torch.zeros(1, dtype=torch.long),
                          torch.tensor([0]), kv)
        pos += 1
    return out
