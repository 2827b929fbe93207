"""Claims about runtime/spec_accept.py: vectorised == reference, greedy rules, and speculative
sampling commits tokens with the target's distribution (and a wrong rule would be caught)."""

from __future__ import annotations

import pytest
import torch

from mg.runtime import spec_accept
from mg.runtime.sampling import SamplingBatch, SamplingParams, target_probs
from mg.runtime.spec_accept import AcceptResult, accept, accept_ref

P = SamplingParams


def _zeros(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64)


def _tv(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    hist = torch.bincount(tokens, minlength=probs.shape[-1]).double() / tokens.numel()
    return 0.5 * (hist - probs.double()).abs().sum().item()


def _random_round(g, params, K, V, soft_q):
    """Random verify logits; drafts that often agree with the target's argmax, padded with -1
    past a random n_draft."""
    B = len(params)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    agree = torch.rand(B, K, generator=g) < 0.75
    draft = torch.where(agree, logits[:, :K].argmax(-1), torch.randint(0, V, (B, K), generator=g))
    n_draft = torch.randint(0, K + 1, (B,), generator=g)
    draft = torch.where(torch.arange(K) < n_draft[:, None], draft, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1) if soft_q else None
    return draft, q, logits, n_draft, torch.randint(0, 1000, (B,), generator=g)


def _assert_same(a: AcceptResult, b: AcceptResult):
    assert torch.equal(a.n_accepted, b.n_accepted)
    assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("mode", ["all_greedy", "mixed_argmax_drafts", "mixed_soft_q", "sampled_soft_q"])
def test_vectorised_accept_matches_reference(mode):
    g = torch.Generator().manual_seed(0)
    sampled = [P(0.9, seed=1), P(1.2, top_k=5, seed=2), P(0.7, top_p=0.8, seed=3), P(1.0, top_k=9, top_p=0.9, seed=4)]
    params = {"all_greedy": [P()] * 8, "sampled_soft_q": sampled * 6}.get(mode, (sampled + [P()]) * 6)
    for _ in range(3):
        args = _random_round(g, params, K=5, V=37, soft_q=mode.endswith("soft_q"))
        batch = SamplingBatch.from_params(params)
        _assert_same(accept(*args[:4], batch, args[4]), accept_ref(*args[:4], batch, args[4]))


def test_greedy_rows_of_a_mixed_batch_match_an_all_greedy_batch():
    g = torch.Generator().manual_seed(1)
    params = [P(), P(1.0, seed=5), P(), P(0.8, top_k=3, seed=6)]
    draft, q, logits, n_draft, counters = _random_round(g, params, K=4, V=29, soft_q=False)
    mixed = accept(draft, q, logits, n_draft, SamplingBatch.from_params(params), counters)
    greedy = accept(draft, q, logits, n_draft, SamplingBatch.from_params([P()] * 4), counters)
    assert torch.equal(mixed.tokens[[0, 2]], greedy.tokens[[0, 2]])


def test_a_row_result_does_not_depend_on_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(2)
    params = [P(0.9, seed=s, top_k=4 * (s % 2)) for s in range(6)] + [P()]
    draft, q, logits, n_draft, counters = _random_round(g, params, K=3, V=23, soft_q=True)
    whole = accept(draft, q, logits, n_draft, SamplingBatch.from_params(params), counters)
    perm = torch.tensor([5, 0, 6, 3])
    part = accept(draft[perm], q[perm], logits[perm], n_draft[perm],
                  SamplingBatch.from_params([params[i] for i in perm]), counters[perm])
    _assert_same(part, AcceptResult(whole.n_accepted[perm], whole.tokens[perm]))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_equal_to_target_argmax_is_all_accepted_with_the_bonus(temperature):
    # temperature 1 with top_k=1: the target distribution is the argmax too, so acceptance is certain
    logits = torch.randn(3, 5, 17, generator=torch.Generator().manual_seed(3))
    target = logits.argmax(-1)
    batch = SamplingBatch.from_params([P(temperature, top_k=1, seed=9)] * 3)
    result = accept(target[:, :4], None, logits, torch.full((3,), 4), batch, _zeros(3))
    assert torch.equal(result.n_accepted, torch.full((3,), 4))
    assert torch.equal(result.tokens, target)  # 4 accepted drafts, then the bonus from row 4


def test_draft_never_agreeing_accepts_none_and_gives_the_target_argmax():
    logits = torch.randn(3, 5, 17, generator=torch.Generator().manual_seed(4))
    target = logits.argmax(-1)
    draft = (target[:, :4] + 1) % 17
    result = accept(draft, None, logits, torch.full((3,), 4), SamplingBatch.from_params([P()] * 3), _zeros(3))
    assert torch.equal(result.n_accepted, _zeros(3))
    assert torch.equal(result.tokens[:, 0], target[:, 0])
    assert (result.tokens[:, 1:] == -1).all()


def test_n_draft_is_respected():
    logits = torch.randn(4, 5, 17, generator=torch.Generator().manual_seed(5))
    target = logits.argmax(-1)
    n_draft = torch.tensor([0, 1, 2, 4])
    draft = torch.where(torch.arange(4) < n_draft[:, None], target[:, :4], -1)  # padded with -1
    agreeing_past_n = target[:, :4]  # drafts past n_draft agree with the target but must not be accepted
    for batch in (SamplingBatch.from_params([P()] * 4), SamplingBatch.from_params([P(1.0, top_k=1, seed=1)] * 4)):
        for drafts in (draft, agreeing_past_n):
            result = accept(drafts, None, logits, n_draft, batch, _zeros(4))
            assert torch.equal(result.n_accepted, n_draft)
            for b, n in enumerate(n_draft.tolist()):  # drafts, the bonus from row n, then -1
                assert result.tokens[b].tolist() == target[b, : n + 1].tolist() + [-1] * (4 - n)


def test_accept_without_drafts_is_plain_sampling():
    """The engine samples every row through `accept` (k = 0 for plain decode steps and prompt ends): it must
    give exactly the tokens of `sample`, the plain sampler, with the same seeds and output positions."""
    from mg.runtime.sampling import sample

    gen = torch.Generator().manual_seed(12)
    params = [P(), P(1.0, seed=5), P(0.7, top_k=4, seed=6), P(1.3, top_p=0.8, seed=7), P()] * 40
    logits = torch.randn(len(params), 1, 37, generator=gen) * 3
    counters = torch.randint(0, 1000, (len(params),), generator=gen)
    batch = SamplingBatch.from_params(params)
    empty = torch.zeros(len(params), 0, dtype=torch.int64)
    result = accept(empty, None, logits, _zeros(len(params)), batch, counters)
    want = sample(logits, batch, counters)[:, 0]
    assert torch.equal(result.n_accepted, _zeros(len(params)))
    assert torch.equal(result.tokens[:, 0], want)
    assert len(set(want[1::5].tolist())) > 1  # sampled rows really vary: the comparison is not trivial


def test_empty_draft_commits_one_target_token():
    logits = torch.randn(2, 1, 11, generator=torch.Generator().manual_seed(6))
    for batch in (SamplingBatch.from_params([P()] * 2), SamplingBatch.from_params([P(1.0, seed=1)] * 2)):
        draft = torch.zeros(2, 0, dtype=torch.int64)
        result = accept(draft, None, logits, _zeros(2), batch, _zeros(2))
        _assert_same(result, accept_ref(draft, None, logits, _zeros(2), batch, _zeros(2)))
        assert torch.equal(result.n_accepted, _zeros(2)) and (result.tokens >= 0).all()


# --- statistics: 20000 seeds of one round over a 6-token vocabulary --------------------------------

N_SEEDS = 20000
TV_THRESHOLD = 0.02  # expected TV of 20000 draws over 6 tokens is about 0.006; the wrong rules below are > 0.1
V = 6
TARGET_LOGITS = torch.tensor([[1.2, 0.9, 0.1, 0.6, -0.4, 0.3],  # row 0: predicts the first token
                              [0.0, -1.0, 1.0, 0.5, 0.2, 0.8],  # row 1: after d1 (the same for every d1)
                              [0.4, 0.4, -0.2, 1.1, 0.0, -0.8]])  # row 2: the bonus after d2
SOFT_Q = torch.tensor([[0.05, 0.10, 0.40, 0.10, 0.15, 0.20],
                       [0.30, 0.30, 0.05, 0.05, 0.10, 0.20]])
TARGET_PARAMS = P(0.8, top_k=5, seed=0)  # temperature and top-k: token 4 has target probability 0


def _statistical_round(q_kind: str):
    """N_SEEDS requests, one seed each, the same target rows; drafts drawn from q (soft), or the
    argmax drafter's fixed token per row (one-hot q, passed as None)."""
    g = torch.Generator().manual_seed(7)
    if q_kind == "soft":
        q = SOFT_Q.expand(N_SEEDS, -1, -1)
        draft = torch.stack([torch.multinomial(SOFT_Q[j], N_SEEDS, True, generator=g) for j in range(2)], 1)
    else:
        q, draft = None, torch.tensor([1, 2]).expand(N_SEEDS, -1)
    batch = SamplingBatch.from_params([P(0.8, top_k=5, seed=s) for s in range(N_SEEDS)])
    logits = TARGET_LOGITS.expand(N_SEEDS, -1, -1)
    counters = torch.randint(0, 10**6, (N_SEEDS,), generator=g)
    args = (draft, q, logits, torch.full((N_SEEDS,), 2), batch, counters)
    p = target_probs(TARGET_LOGITS[None], SamplingBatch.from_params([TARGET_PARAMS]))[0]  # [3, V]
    return args, p


@pytest.mark.parametrize("q_kind", ["soft", "one_hot"])
def test_first_committed_token_has_the_target_distribution(q_kind, monkeypatch):
    args, p = _statistical_round(q_kind)
    assert p[0, 4] == 0 and (p[0] > 0).sum() == 5
    assert _tv(accept(*args).tokens[:, 0], p[0]) < TV_THRESHOLD
    # the threshold discriminates: always accepting the draft, or a residual that ignores q, fails it
    assert _tv(args[0][:, 0], p[0]) > TV_THRESHOLD
    monkeypatch.setattr(spec_accept, "_residual", lambda p_row, q_row: p_row)
    assert _tv(accept(*args).tokens[:, 0], p[0]) > TV_THRESHOLD


@pytest.mark.parametrize("q_kind", ["soft", "one_hot"])
def test_second_committed_token_has_the_target_conditional_distribution(q_kind):
    """Given d1 accepted (any d1: row 1 is the same for each), the second token follows row 1."""
    args, p = _statistical_round(q_kind)
    result = accept(*args)
    second = result.tokens[result.n_accepted >= 1, 1]
    assert second.numel() > N_SEEDS // 4
    assert _tv(second, p[1]) < TV_THRESHOLD * (N_SEEDS / second.numel()) ** 0.5
    bonus = result.tokens[result.n_accepted == 2, 2]
    assert _tv(bonus, p[2]) < TV_THRESHOLD * (N_SEEDS / bonus.numel()) ** 0.5
