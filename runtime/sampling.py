"""Sampling on the device: per-request temperature / top-k / top-p and seeded noise.

Knows: target logits `[B, T, V]`, each request's `SamplingParams`, and how to
turn (seed, token position, stream) into noise with integer ops on the device.
A request's tokens depend only on its own seed, its own counter and its own
logits: never on the other rows of the batch or on which row it sits in (there
is no shared `torch.Generator`). The batched functions never sync with the host
and branch only on shapes and host-known flags, so they can be captured in a
CUDA graph.

Must not know: models, KV caches, the scheduler, drafts and acceptance
(`spec_accept.py`), or mg.export.

Noise: for request b, the noise of the token at position `counters[b] + t` of
its output (t = row of the logits) is a splitmix64 stream keyed by
(seed, stream, position) and indexed by vocabulary id. A token is drawn with the
exponential race `argmax(w / E)`, E ~ Exp(1), which picks i with probability
w_i / sum(w) for any non-negative weights (no normalisation needed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from mg.kernels.triton_argmax import argmax_last

STREAM_TARGET = 0  # draws target tokens: plain sampling, correction and bonus tokens
STREAM_ACCEPT = 1  # the uniform that accepts or rejects a draft token

_SEED_LIMIT = 1 << 64
_GOLDEN = 0x9E3779B97F4A7C15 - _SEED_LIMIT  # splitmix64 increment, as a wrapped int64
_MIX1 = 0xBF58476D1CE4E5B9 - _SEED_LIMIT
_MIX2 = 0x94D049BB133111EB - _SEED_LIMIT
_UNIFORM_BITS = 23  # (k + 0.5) / 2**23 is exact in fp32 and lies strictly inside (0, 1)


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. temperature 0 = greedy (top_k, top_p, seed unused)."""

    temperature: float = 0.0  # >= 0, finite
    top_k: int = 0  # >= 0, 0 = off
    top_p: float = 1.0  # in (0, 1], 1 = off
    seed: int | None = None  # in [0, 2**64); required for sampled requests in a batch

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        """Raise ValueError, one line naming the field, the value and the allowed range."""
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if not _is_real(t) or not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature={t!r} is invalid: must be a finite number >= 0 (0 = greedy)")
        if not _is_int(k) or k < 0:
            raise ValueError(f"top_k={k!r} is invalid: must be an integer >= 0 (0 = off)")
        if not _is_real(p) or not 0 < p <= 1:
            raise ValueError(f"top_p={p!r} is invalid: must be a number with 0 < top_p <= 1 (1 = off)")
        if s is not None and (not _is_int(s) or not 0 <= s < _SEED_LIMIT):
            raise ValueError(f"seed={s!r} is invalid: must be None or an integer in [0, 2**64)")


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingBatch:
    """The sampling parameters of B requests, as device tensors (row b = request b)."""

    temperature: torch.Tensor  # [B] fp32, 0 on greedy rows
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] fp32, 1 = off
    greedy: torch.Tensor  # [B] bool
    seed: torch.Tensor  # [B] int64, the seed wrapped to int64 (0 on greedy rows)
    all_greedy: bool  # host-known: every row is greedy (skips probabilities and noise)
    filtered: bool  # host-known: some row uses top-k or top-p (needs the sort)

    @property
    def size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> SamplingBatch:
        """Validate and batch. Sampled requests need a seed: the scheduler picks one at admission,
        so a request keeps its stream when the batch around it is rebuilt."""
        for row, p in enumerate(params):
            p.validate()
            if not p.greedy and p.seed is None:
                raise ValueError(f"seed=None on row {row}: a sampled request needs a seed in [0, 2**64) "
                                 f"(pick one when the request is admitted)")
        sampled = [p for p in params if not p.greedy]

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:  # queued: never waits for the device
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            temperature=column([float(p.temperature) for p in params], torch.float32),
            top_k=column([p.top_k for p in params], torch.int64),
            top_p=column([float(p.top_p) for p in params], torch.float32),
            greedy=column([p.greedy for p in params], torch.bool),
            seed=column([_wrap64(p.seed or 0) for p in params], torch.int64),
            all_greedy=not sampled,
            filtered=any(p.top_k > 0 or p.top_p < 1 for p in sampled),
        )


def _wrap64(x: int) -> int:
    """A Python int as the int64 with the same low 64 bits."""
    return (x + (1 << 63)) % _SEED_LIMIT - (1 << 63)


# --- noise -------------------------------------------------------------------------------------


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: mask off the copied sign bits)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser; int64 multiplication wraps, which is what the hash wants."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniform_noise(seed: torch.Tensor, positions: torch.Tensor, stream: int, width: int) -> torch.Tensor:
    """seed [B] int64, positions [B, T] int64 -> [B, T, width] fp32 in (0, 1), a pure function of
    (seed[b], stream, positions[b, t], lane)."""
    key = _mix64(_mix64(_mix64(seed) ^ stream)[:, None] ^ positions)  # [B, T]
    lanes = torch.arange(1, width + 1, dtype=torch.int64, device=seed.device) * _GOLDEN  # [width]
    bits = _mix64(key[..., None] + lanes)  # [B, T, width]
    return (_shr(bits, 64 - _UNIFORM_BITS).to(torch.float32) + 0.5) * 2.0 ** -_UNIFORM_BITS


def exponential_noise(seed: torch.Tensor, positions: torch.Tensor, stream: int, width: int) -> torch.Tensor:
    """Exp(1) noise [B, T, width], strictly positive and finite."""
    return -torch.log(uniform_noise(seed, positions, stream, width))


def exponential_race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """[..., V] non-negative weights (not all zero), Exp(1) noise -> [...] int64 index,
    drawn with probability weights / weights.sum(-1)."""
    return (weights / noise).argmax(dim=-1)


def token_positions(counters: torch.Tensor, rows: int) -> torch.Tensor:
    """counters [B] int64 (tokens already generated per request) -> [B, rows] output positions."""
    return counters[:, None] + torch.arange(rows, dtype=torch.int64, device=counters.device)


# --- target distribution -----------------------------------------------------------------------


def one_hot(index: torch.Tensor, vocab: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[...] int64 -> [..., vocab]; a comparison, so no bounds check syncs with the device."""
    return (torch.arange(vocab, device=index.device) == index[..., None]).to(dtype)


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [B, T, V] fp32 -> probs [B, T, V]: softmax(logits / temperature) restricted to the
    top-k, then to the top-p of what is left, renormalised; greedy rows are one-hot at the argmax."""
    greedy = batch.greedy[:, None, None]
    temperature = torch.where(batch.greedy, 1.0, batch.temperature)[:, None, None]  # no 0 divisor
    scaled = logits.float() / temperature
    probs = torch.softmax(scaled, dim=-1)
    if batch.filtered:  # unfiltered rows keep the plain softmax, so a row's bits never depend on the batch
        row_filtered = ((batch.top_k > 0) | (batch.top_p < 1))[:, None, None]
        probs = torch.where(row_filtered, _filtered_probs(scaled, batch), probs)
    return torch.where(greedy, one_hot(logits.argmax(dim=-1), logits.shape[-1]), probs)


def _filtered_probs(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Top-k then top-p with per-row k and p: one stable sort, masks by rank and by the mass of
    the better-ranked tokens, scatter back. Rank 0 is always kept (top_p > 0)."""
    ranked, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)
    k = batch.top_k[:, None, None]
    ranked = ranked.masked_fill((k > 0) & (rank >= k), float("-inf"))
    probs = torch.softmax(ranked, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass ranked strictly above each token
    top_p = batch.top_p[:, None, None]
    probs = probs.masked_fill((top_p < 1) & (before >= top_p), 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def sample(logits: torch.Tensor, batch: SamplingBatch, counters: torch.Tensor,
           stream: int = STREAM_TARGET) -> torch.Tensor:
    """logits [B, T, V], counters [B] int64 (tokens already generated per request) -> tokens [B, T]
    int64. Row t of request b is output position counters[b] + t; the caller advances counters
    by the number of tokens it keeps."""
    if batch.all_greedy:
        return argmax_last(logits)
    probs = target_probs(logits, batch)
    noise = exponential_noise(batch.seed, token_positions(counters, logits.shape[1]), stream, logits.shape[-1])
    return exponential_race(probs, noise)
