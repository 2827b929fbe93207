"""Claims about runtime/sampling.py: seeded per request, filters as specified, the right distribution."""

from __future__ import annotations

import math

import pytest
import torch

from mg.runtime.sampling import (
    STREAM_ACCEPT,
    STREAM_TARGET,
    SamplingBatch,
    SamplingParams,
    sample,
    target_probs,
    uniform_noise,
)

P = SamplingParams


def _counters(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def _tv(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Total variation between the empirical distribution of tokens and probs [V]."""
    hist = torch.bincount(tokens, minlength=probs.shape[-1]).double() / tokens.numel()
    return 0.5 * (hist - probs.double()).abs().sum().item()


def test_same_seed_gives_same_tokens_whatever_the_batch_and_row():
    g = torch.Generator().manual_seed(0)
    logits = {name: torch.randn(4, 53, generator=g) for name in "abcde"}
    params = {"a": P(0.8, seed=1), "b": P(1.0, top_k=5, seed=2), "c": P(1.3, top_p=0.9, seed=3),
              "d": P(0.0), "e": P(0.7, seed=1)}  # e shares a's seed, not its logits
    counters = {"a": 0, "b": 7, "c": 3, "d": 0, "e": 5}

    def run(names):
        batch = SamplingBatch.from_params([params[n] for n in names])
        tokens = sample(torch.stack([logits[n] for n in names]), batch, _counters(counters[n] for n in names))
        return dict(zip(names, tokens))

    alone = {n: run([n])[n] for n in params}
    for names in (["a", "b", "c", "d", "e"], ["e", "c", "a"], ["d", "b", "a", "c"], ["c", "e"]):
        got = run(names)
        for n in names:
            assert torch.equal(got[n], alone[n]), (n, names)


def test_noise_is_a_function_of_seed_position_and_stream():
    seed, pos = torch.tensor([5, 5, 6], dtype=torch.int64), torch.tensor([[0, 1], [0, 1], [0, 1]])
    u = uniform_noise(seed, pos, STREAM_TARGET, 1000)
    assert torch.equal(u[0], u[1])  # same seed, same positions
    assert not torch.equal(u[0, 0], u[0, 1])  # next position
    assert not torch.equal(u[0], u[2])  # other seed
    assert not torch.equal(u, uniform_noise(seed, pos, STREAM_ACCEPT, 1000))  # other stream
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(3, 5, 41, generator=torch.Generator().manual_seed(1))
    counters = _counters([0, 4, 9])
    all_greedy = SamplingBatch.from_params([P()] * 3)
    mixed = SamplingBatch.from_params([P(), P(1.0, top_k=3, seed=7), P()])
    assert torch.equal(sample(logits, all_greedy, counters), logits.argmax(-1))
    assert torch.equal(sample(logits, mixed, counters)[[0, 2]], logits.argmax(-1)[[0, 2]])
    assert torch.equal(target_probs(logits, mixed)[0].argmax(-1), logits[0].argmax(-1))
    assert torch.equal(target_probs(logits, mixed)[0].amax(-1), torch.ones(5))


@pytest.mark.parametrize("params", [P(1.5, top_k=1, seed=3), P(1.5, top_p=1e-6, seed=3)], ids=["top_k_1", "top_p_tiny"])
def test_top_k_1_and_tiny_top_p_are_greedy(params):
    logits = torch.randn(6, 7, 97, generator=torch.Generator().manual_seed(2))
    batch = SamplingBatch.from_params([params] * 6)
    assert torch.equal(sample(logits, batch, _counters(range(6))), logits.argmax(-1))


def _filter_ref(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row, float64, the words of the definitions: temperature, keep the k best, then the
    fewest best tokens whose mass reaches top_p, renormalise."""
    if params.greedy:
        return torch.nn.functional.one_hot(row.argmax(), row.numel()).double()
    values = row.tolist()
    order = sorted(range(len(values)), key=lambda i: -values[i])
    keep = order[: params.top_k] if params.top_k else order
    probs = torch.softmax(row.double()[keep] / params.temperature, dim=0)
    kept, mass = [], 0.0
    for token, prob in zip(keep, probs.tolist()):
        if params.top_p < 1 and mass >= params.top_p:
            break
        kept.append(token)
        mass += prob
    out = torch.zeros(row.numel(), dtype=torch.float64)
    out[kept] = probs[: len(kept)] / probs[: len(kept)].sum()
    return out


def test_top_k_top_p_masks_match_a_per_row_reference():
    params = [P(1.0, top_k=4, seed=0), P(0.7, top_p=0.8, seed=0), P(1.3, top_k=10, top_p=0.5, seed=0), P(),
              P(0.9, seed=0), P(2.0, top_k=57, seed=0), P(0.5, top_k=200, top_p=0.95, seed=0), P(1.0, top_p=0.3, seed=0)]
    logits = torch.randn(len(params), 3, 57, generator=torch.Generator().manual_seed(3)) * 2
    probs = target_probs(logits, SamplingBatch.from_params(params))
    for b, p in enumerate(params):
        for t in range(3):
            expected = _filter_ref(logits[b, t], p)
            assert torch.equal(probs[b, t] > 0, expected > 0), (b, t, p)
            torch.testing.assert_close(probs[b, t].double(), expected, atol=1e-6, rtol=1e-5)


def test_sampled_tokens_stay_inside_the_top_k_top_p_set():
    params = [P(1.0, top_k=3, seed=s) for s in range(50)] + [P(1.0, top_p=0.6, seed=s) for s in range(50)]
    logits = torch.randn(1, 4, 31, generator=torch.Generator().manual_seed(4)).expand(100, -1, -1)
    batch = SamplingBatch.from_params(params)
    tokens = sample(logits, batch, _counters([0] * 100))
    allowed = target_probs(logits, batch) > 0
    assert allowed.gather(-1, tokens[..., None]).all()
    assert len(set(tokens[:50, 0].tolist())) == 3  # and the whole set is reachable


@pytest.mark.parametrize("field, kwargs", [
    ("temperature", dict(temperature=-1.0)),
    ("temperature", dict(temperature=float("nan"))),
    ("temperature", dict(temperature=float("inf"))),
    ("top_p", dict(top_p=1.5)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=float("nan"))),
    ("top_k", dict(top_k=-1)),
    ("top_k", dict(top_k=2.5)),
    ("seed", dict(seed=-3)),
    ("seed", dict(seed=2**64)),
])
def test_invalid_values_raise_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"^{field}=") as err:
        SamplingParams(**kwargs).validate()
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=rf"^{field}="):
        SamplingBatch.from_params([P(), SamplingParams(**kwargs)])


def test_sampled_request_without_seed_is_refused():
    with pytest.raises(ValueError, match=r"^seed=None on row 1"):
        SamplingBatch.from_params([P(), P(temperature=1.0)])
    SamplingBatch.from_params([P(), P(temperature=1.0, seed=2**64 - 1)])  # the whole range is accepted


N_DRAWS = 20000
TV_THRESHOLD = 0.02  # expected TV of 20000 draws over 6 tokens is about 0.006


@pytest.mark.parametrize("over", ["seeds", "positions"])
def test_empirical_distribution_matches_softmax(over):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])
    temperature = 0.8
    seeds = range(N_DRAWS) if over == "seeds" else [12345] * N_DRAWS
    counters = _counters([0] * N_DRAWS if over == "seeds" else range(N_DRAWS))
    batch = SamplingBatch.from_params([P(temperature, seed=s) for s in seeds])
    tokens = sample(logits.expand(N_DRAWS, 1, -1), batch, counters)[:, 0]
    expected = torch.softmax(logits / temperature, dim=0)
    assert _tv(tokens, expected) < TV_THRESHOLD
    assert _tv(tokens, torch.softmax(logits, dim=0)) > TV_THRESHOLD  # the threshold sees temperature
    assert math.isclose(float(expected.sum()), 1.0, rel_tol=1e-6)
