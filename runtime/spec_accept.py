"""Speculative acceptance: the accept step of a DFlash round (docs/ARCHITECTURE.md section 6.5, step 4).

Knows: the draft tokens d1..dK of B sequences, their draft probabilities q (or
None for argmax drafts, q = one-hot of the draft token), the target's logits for
the verify rows [pending, d1..dK] (row j predicts the token after row j), and
from `sampling.py` the target distribution and the per-request noise.

Greedy rows accept the longest prefix where the target's argmax equals the
draft and then take the target's argmax. Sampled rows run speculative sampling:
accept d_{j+1} with probability min(1, p(d)/q(d)); on the first reject sample
from normalize(max(p - q, 0)); if all n_draft[b] drafts pass, sample the bonus
token from p of row n_draft[b]. The committed tokens of request b then have the
target distribution, whatever q is.

Noise: the uniform judging the draft at output position counters[b] + j and the
noise drawing the correction or bonus token at position counters[b] + n_accepted
are keyed by those positions, so the result of a row never depends on the rest
of the batch. The caller advances counters[b] by n_accepted[b] + 1.

`accept` runs on the device with no host sync and no branch on tensor values
(only on shapes and host-known flags) and returns one small tensor pair for one
device-to-host copy per round. `accept_ref` is the same step as a plain loop.

Must not know: models, KV caches or their rollback, the drafter, the scheduler,
or mg.export.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mg.kernels.triton_argmax import argmax_last
from mg.runtime.sampling import (
    STREAM_ACCEPT,
    STREAM_TARGET,
    SamplingBatch,
    exponential_noise,
    exponential_race,
    one_hot,
    target_probs,
    token_positions,
    uniform_noise,
)


@dataclass(frozen=True)
class AcceptResult:
    n_accepted: torch.Tensor  # [B] int64, accepted draft tokens, 0..n_draft[b]
    tokens: torch.Tensor  # [B, K+1] int64, accepted drafts then the correction/bonus token, then -1


def accept(draft: torch.Tensor, q: torch.Tensor | None, target_logits: torch.Tensor, n_draft: torch.Tensor,
           batch: SamplingBatch, counters: torch.Tensor) -> AcceptResult:
    """draft [B, K] int64, q [B, K, V] or None, target_logits [B, K+1, V], n_draft [B] int64 in
    0..K (drafts past it are ignored and may be -1), counters [B] int64 -> AcceptResult."""
    _check_shapes(draft, q, target_logits, n_draft, counters)
    valid = torch.arange(draft.shape[1], device=draft.device) < n_draft[:, None]  # [B, K]
    draft = torch.where(valid, draft, 0)  # keep padded drafts inside the vocabulary for gathers
    target_tokens = argmax_last(target_logits)  # [B, K+1]
    greedy_ok = (target_tokens[:, :-1] == draft) & valid
    if batch.all_greedy:
        n_accepted = _prefix_len(greedy_ok)
        correction = _at(target_tokens, n_accepted)
    else:
        n_accepted, correction = _speculative(draft, q, target_logits, n_draft, batch, counters,
                                              valid, greedy_ok, target_tokens)
    return AcceptResult(n_accepted, _commit(draft, n_accepted, correction))


def _speculative(draft, q, target_logits, n_draft, batch, counters, valid, greedy_ok, target_tokens):
    """Vectorised speculative sampling; greedy rows of a mixed batch take the greedy answer."""
    p = target_probs(target_logits, batch)  # [B, K+1, V]
    K, V = draft.shape[1], p.shape[-1]
    p_draft = p[:, :K].gather(-1, draft[..., None])[..., 0]  # [B, K]
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(-1, draft[..., None])[..., 0].to(p.dtype)
    u = uniform_noise(batch.seed, token_positions(counters, K), STREAM_ACCEPT, 1)[..., 0]  # [B, K]
    sampled_ok = (u * q_draft < p_draft) & valid  # u < p/q without dividing by q
    ok = torch.where(batch.greedy[:, None], greedy_ok, sampled_ok)
    n_accepted = _prefix_len(ok)

    p_next = p.gather(1, n_accepted[:, None, None].expand(-1, 1, V))[:, 0]  # [B, V]
    rejected = (n_accepted < n_draft)[:, None]
    weights = torch.where(rejected, _residual(p_next, _draft_q_row(q, draft, n_accepted, p_next)), p_next)
    # max(p - q, 0) is all zero only where p == q, when a reject has probability 0; rounding can get there.
    weights = torch.where(weights.sum(dim=-1, keepdim=True) > 0, weights, p_next)
    noise = exponential_noise(batch.seed, (counters + n_accepted)[:, None], STREAM_TARGET, V)[:, 0]
    correction = torch.where(batch.greedy, _at(target_tokens, n_accepted), exponential_race(weights, noise))
    return n_accepted, correction


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[B, V] target and draft rows -> the unnormalised residual max(p - q, 0)."""
    return (p - q).clamp(min=0)


def _draft_q_row(q: torch.Tensor | None, draft: torch.Tensor, row: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """q[b, row[b]] (one-hot of draft[b, row[b]] when q is None) -> [B, V]; rows past K are unused."""
    K, V = draft.shape[1], like.shape[-1]
    if K == 0:
        return torch.zeros_like(like)
    row = row.clamp(max=K - 1)
    if q is None:
        return one_hot(_at(draft, row), V, like.dtype)
    return q.gather(1, row[:, None, None].expand(-1, 1, V))[:, 0].to(like.dtype)


def _at(x: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """x [B, N], col [B] -> x[b, col[b]] [B]."""
    return x.gather(1, col[:, None])[:, 0]


def _prefix_len(ok: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] int64 length of the all-true prefix."""
    return ok.long().cumprod(dim=1).sum(dim=1)


def _commit(draft: torch.Tensor, n_accepted: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    """[B, K+1]: draft[:, :n] then the correction/bonus token, -1 after."""
    B, K = draft.shape
    col = torch.arange(K + 1, device=draft.device)
    n = n_accepted[:, None]
    padded = torch.cat([draft, draft.new_full((B, 1), -1)], dim=1)
    tokens = torch.where(col < n, padded, -1)
    return torch.where(col == n, correction[:, None], tokens)


def _check_shapes(draft, q, target_logits, n_draft, counters) -> None:
    """Shapes are host-known: these asserts never sync with the device."""
    B, K = draft.shape
    assert target_logits.shape[:2] == (B, K + 1), f"target_logits {tuple(target_logits.shape)} vs draft {(B, K)}"
    assert q is None or q.shape == (B, K, target_logits.shape[-1]), f"q {tuple(q.shape)}"
    assert n_draft.shape == (B,) and counters.shape == (B,), f"n_draft {tuple(n_draft.shape)}"
    assert draft.dtype == n_draft.dtype == counters.dtype == torch.int64


# --- reference -----------------------------------------------------------------------------------


def accept_ref(draft: torch.Tensor, q: torch.Tensor | None, target_logits: torch.Tensor, n_draft: torch.Tensor,
               batch: SamplingBatch, counters: torch.Tensor) -> AcceptResult:
    """The same step, one row and one draft at a time, in the words of the paper."""
    B, K = draft.shape
    p = target_probs(target_logits, batch)  # the filters are checked against their own reference
    n_accepted, tokens = [], torch.full((B, K + 1), -1, dtype=torch.int64)
    for b in range(B):
        committed = _accept_row_ref(b, draft, q, target_logits, p, int(n_draft[b]), batch, int(counters[b]))
        n_accepted.append(len(committed) - 1)
        tokens[b, : len(committed)] = torch.tensor(committed)
    return AcceptResult(torch.tensor(n_accepted, dtype=torch.int64).to(draft.device), tokens.to(draft.device))


def _accept_row_ref(b, draft, q, target_logits, p, n, batch, counter) -> list[int]:
    greedy, seed = bool(batch.greedy[b]), batch.seed[b : b + 1]
    committed = []
    for j in range(n):
        d = int(draft[b, j])
        if greedy:
            ok = int(target_logits[b, j].argmax()) == d
        else:
            q_d = 1.0 if q is None else float(q[b, j, d])
            ratio = float(p[b, j, d]) / q_d if q_d > 0 else float("inf")
            ok = float(uniform_noise(seed, _position(seed, counter + j), STREAM_ACCEPT, 1)) < min(1.0, ratio)
        if not ok:
            break
        committed.append(d)
    j = len(committed)
    if greedy:
        return committed + [int(target_logits[b, j].argmax())]
    weights = p[b, j]
    if j < n:  # rejected d_{j+1}: residual max(p - q, 0), normalised
        q_row = one_hot(draft[b, j], p.shape[-1]) if q is None else q[b, j].float()
        residual = (p[b, j] - q_row).clamp(min=0)
        weights = residual / residual.sum() if residual.sum() > 0 else p[b, j]
    noise = exponential_noise(seed, _position(seed, counter + j), STREAM_TARGET, p.shape[-1])[0, 0]
    return committed + [int(torch.argmax(weights / noise))]


def _position(seed: torch.Tensor, position: int) -> torch.Tensor:
    return torch.tensor([[position]], dtype=torch.int64, device=seed.device)
