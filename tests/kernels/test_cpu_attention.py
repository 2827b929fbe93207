"""The CPU attention kernels (per sequence, one SDPA call each) match the torch references, both KV layouts.

Random caches holding the same keys in both layouts; ragged sequences with decode rows and prefill or verify
blocks; grouped-query heads; sliding windows on wrapping ring columns; padding rows on the scratch slot; a
cloned prefix shared by two sequences' cells; rows of one sequence not adjacent in the step; fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from mg.kernels.attention_ref import attend_cells_ref, attend_columns_ref
from mg.kernels.cpu_attention import attend_cells_cpu, attend_columns_cpu

SCALE = 0.3


def _batch(hq, hkv, d, lengths, n_new, window, ring, dtype, interleave=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    slots, scratch = n + 2, n + 1
    capacity = max(lengths) + 3
    rows = window + max(n_new) - 1 if ring else capacity
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    k_store, v_store = rand(slots, rows, hkv, d), rand(slots, rows, hkv, d)
    n_cells = slots * capacity + 1
    table = torch.randperm(n_cells - 1, generator=g)[:slots * capacity].view(slots, capacity).clone()
    if n > 1:  # the second sequence shares the first one's first cells (a cloned prefix)
        shared = torch.arange(min(lengths[0], lengths[1]) // 2)
        table[1, shared] = table[0, shared]
        k_store[1, shared % rows], v_store[1, shared % rows] = k_store[0, shared % rows], v_store[0, shared % rows]
    table[scratch] = n_cells - 1
    k_pool, v_pool = rand(n_cells, hkv, d), rand(n_cells, hkv, d)
    p = torch.arange(capacity)
    for s in range(scratch):
        k_pool[table[s, p]], v_pool[table[s, p]] = k_store[s, p % rows], v_store[s, p % rows]
    k_pool[n_cells - 1], v_pool[n_cells - 1] = k_store[scratch, 0], v_store[scratch, 0]
    rows_of = [[(s, pos) for pos in range(length - new, length)] for s, (length, new) in enumerate(zip(lengths, n_new))]
    if interleave:  # one sequence's rows need not be adjacent in the step
        order = [r for group in zip(*rows_of) for r in group] + [r for g_ in rows_of for r in g_[min(n_new):]]
    else:
        order = [r for g_ in rows_of for r in g_]
    order += [(scratch, 0)] * 2
    seq_slots = torch.tensor([s for s, _ in order])
    positions = torch.tensor([pos for _, pos in order])
    q = rand(len(order), hq, d)
    return q, positions, seq_slots, k_store, v_store, k_pool, v_pool, table


CASES = {
    "decode-mha-flat": dict(hq=2, hkv=2, d=16, lengths=(37, 5, 70), n_new=(1, 1, 1), window=0, ring=False),
    "decode-gqa-ring-wrap": dict(hq=6, hkv=2, d=16, lengths=(90, 13, 131), n_new=(1, 1, 1), window=24, ring=True),
    "verify-blocks-gqa-flat": dict(hq=8, hkv=2, d=32, lengths=(40, 61, 17), n_new=(16, 16, 1), window=0, ring=False),
    "prefill-ring-wrap": dict(hq=6, hkv=2, d=16, lengths=(77, 30), n_new=(9, 5), window=20, ring=True),
    "window-not-ring": dict(hq=4, hkv=1, d=16, lengths=(61, 3), n_new=(5, 2), window=17, ring=False),
    "window-wider-than-sequence": dict(hq=4, hkv=2, d=16, lengths=(20, 30), n_new=(3, 1), window=64, ring=False),
    "prompt-chunk-and-verify": dict(hq=6, hkv=2, d=16, lengths=(150, 71, 9), n_new=(40, 16, 1), window=0, ring=False),
    "prompt-chunk-ring-wrap": dict(hq=6, hkv=2, d=16, lengths=(140, 40), n_new=(37, 3), window=30, ring=True),
}


@pytest.mark.parametrize("row_invariant", [False, True])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("name", CASES)
def test_columns_and_cells_match_the_references_fp32(name, interleave, row_invariant):
    q, pos, slots, ks, vs, kp, vp, table = _batch(**CASES[name], dtype=torch.float32, interleave=interleave)
    w = CASES[name]["window"]
    want = attend_columns_ref(q, ks, vs, pos, slots, w, SCALE)
    got = attend_columns_cpu(q, ks, vs, pos, slots, w, SCALE, row_invariant)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cells = attend_cells_cpu(q, kp, vp, table, pos, slots, w, SCALE, row_invariant)
    torch.testing.assert_close(cells, attend_cells_ref(q, kp, vp, table, pos, slots, w, SCALE), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cells, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["decode-gqa-ring-wrap", "verify-blocks-gqa-flat"])
def test_bf16_in_bf16_out_close_to_the_reference(name):
    q, pos, slots, ks, vs, kp, vp, table = _batch(**CASES[name], dtype=torch.bfloat16)
    w = CASES[name]["window"]
    got = attend_columns_cpu(q, ks, vs, pos, slots, w, SCALE)
    assert got.dtype == torch.bfloat16
    # both compute in fp32 and round once: at most one bf16 rounding step apart
    torch.testing.assert_close(got, attend_columns_ref(q, ks, vs, pos, slots, w, SCALE), rtol=1e-2, atol=1e-2)


def test_a_row_depends_only_on_its_own_sequence():
    """Batch invariance: a sequence's rows give the same result alone as with other sequences in the step."""
    q, pos, slots, ks, vs, *_ = _batch(**CASES["verify-blocks-gqa-flat"], dtype=torch.float32)
    full = attend_columns_cpu(q, ks, vs, pos, slots, 0, SCALE)
    mine = slots == 1
    alone = attend_columns_cpu(q[mine], ks, vs, pos[mine], slots[mine], 0, SCALE)
    assert torch.equal(full[mine], alone)


@pytest.mark.parametrize("layout", ["columns", "cells"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, ring", [(0, False), (100, False), (24, True)])
def test_row_invariant_rows_have_the_same_bits_alone_among_decode_rows_and_in_a_block(layout, dtype, window, ring):
    """`row_invariant`, what makes greedy DFlash equal target-only on the CPU with bfloat16-rounding kernels: each
    of 40 consecutive rows of one sequence (a verify block or prompt chunk, positions 30-69, across a span
    bucket's edge) gets the bits it gets in a 1-row step alone and among other sequences' decode rows (before
    and after it), and those decode rows the bits they get alone; all close to the reference."""
    q, pos, slots, ks, vs, kp, vp, table = _batch(hq=6, hkv=2, d=32, lengths=(70, 13, 131), n_new=(40, 1, 1),
                                                  window=window, ring=ring, dtype=dtype)

    def attend(rows):
        rows = torch.tensor(rows)
        if layout == "columns":
            return attend_columns_cpu(q[rows], ks, vs, pos[rows], slots[rows], window, SCALE, row_invariant=True)
        return attend_cells_cpu(q[rows], kp, vp, table, pos[rows], slots[rows], window, SCALE, row_invariant=True)

    block = attend(list(range(40)))
    others = [40, 41]  # the other sequences' decode rows
    decode = attend(others)
    for i in range(40):
        assert torch.equal(attend([i])[0], block[i]), f"row {i} alone"
        among = attend([others[0], i, others[1]])
        assert torch.equal(among[1], block[i]), f"row {i} among decode rows"
        assert torch.equal(among[0], decode[0]) and torch.equal(among[2], decode[1])
    assert torch.equal(attend([40])[0], decode[0]) and torch.equal(attend([41])[0], decode[1])
    everything = attend(list(range(len(pos))))
    want = attend_columns_ref(q, ks, vs, pos, slots, window, SCALE)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(everything.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv", [(6, 2), (4, 4)])
def test_draft_attention_matches_the_reference(hq, hkv, dtype):
    """`draft_attend_cpu` against `draft_attend_ref`: blocks with context, with none valid (an anchor at 0) and with
    invalid rows between valid ones, grouped and plain heads."""
    from mg.kernels.cpu_attention import draft_attend_cpu
    from mg.kernels.draft_attention_ref import draft_attend_ref

    g = torch.Generator().manual_seed(1)
    b, t, s, d = 3, 5, 9, 16
    q = torch.randn(b, t, hq, d, generator=g).to(dtype)
    k_blk, v_blk, ctx_k, ctx_v = (torch.randn(b, n, hkv, d, generator=g).to(dtype) for n in (t, t, s, s))
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1] = False
    valid[2, ::2] = False
    want = draft_attend_ref(q, k_blk, v_blk, ctx_k, ctx_v, valid, SCALE)
    got = draft_attend_cpu(q, k_blk, v_blk, ctx_k, ctx_v, valid, SCALE)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    ctx_k[2, ::2] = 1e3  # keys of invalid rows change nothing
    torch.testing.assert_close(draft_attend_cpu(q, k_blk, v_blk, ctx_k, ctx_v, valid, SCALE), got, atol=0, rtol=0)
