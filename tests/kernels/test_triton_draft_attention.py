"""The drafter's Triton block attention (`mg::draft_attend`) matches the torch reference in both KV layouts.

Runs on CUDA, or on CPU through the Triton interpreter when MG_TRITON_INTERPRET=1 (small shapes there).
The reference gathers each block's context (`draft_context_span`) from the columns and runs
`draft_attend_ref`; the kernels read the same keys from the columns or through a shuffled cell table.
"""

from dataclasses import dataclass

import pytest
import torch

from triton_setup import DEVICE, cuda_only, module_marks  # first: sets TRITON_INTERPRET

pytest.importorskip("triton")

from mg.kernels.draft_attention_ref import draft_attend_ref, draft_context_span  # noqa: E402
from mg.kernels import triton_attention as ta  # noqa: E402

pytestmark = module_marks(ta.available(), ta.reason)


@dataclass(frozen=True)
class Case:
    name: str
    hq: int
    hkv: int
    head_dim: int
    t: int                       # rows per block
    anchors: tuple[int, ...]     # [B] each block's first position (its context: positions before it)
    window: int = 0              # 0: all of the context
    rows: int = 0                # columns' rows (0: capacity); fewer than the anchors wrap (a ring)

    @property
    def capacity(self) -> int:
        return max(self.anchors) + self.t + 2


CASES = [
    Case("g2-flat-t16", 4, 2, 16, 16, (37, 0, 70)),
    Case("g1-ring-wrap-t5", 2, 2, 16, 5, (90, 13, 24), window=24, rows=28),
    Case("g4-window-wider-than-rows", 8, 2, 16, 7, (20, 45), window=64),  # span = rows (the capacity, 54)
    Case("g3-window-t16", 6, 2, 32, 16, (1, 66), window=17),
]
CUDA_CASES = [
    Case("g4-d128-long", 16, 4, 128, 16, (2047, 5, 900, 1500)),
    Case("g8-d64-ring", 16, 2, 64, 16, (3000, 512, 100), window=512, rows=527),
]
ALL_CASES = CASES + [pytest.param(c, marks=cuda_only) for c in CUDA_CASES]


def _inputs(case: Case, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, slots = len(case.anchors), len(case.anchors) + 2  # an idle slot, then the scratch slot
    rows = case.rows or case.capacity

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    k_store, v_store = rand(slots, rows, case.hkv, case.head_dim), rand(slots, rows, case.hkv, case.head_dim)
    # The cell layout holds the same keys at shuffled cells: (slot, position) -> the column's row p % rows.
    n_cells = slots * case.capacity + 1
    cell_table = torch.randperm(n_cells - 1, generator=g)[: slots * case.capacity].view(slots, case.capacity)
    k_pool, v_pool = rand(n_cells, case.hkv, case.head_dim), rand(n_cells, case.hkv, case.head_dim)
    p = torch.arange(case.capacity)
    for s in range(slots):
        k_pool[cell_table[s, p]], v_pool[cell_table[s, p]] = k_store[s, p % rows], v_store[s, p % rows]
    q = rand(b, case.t, case.hq, case.head_dim)
    k_blk, v_blk = rand(b, case.t, case.hkv, case.head_dim), rand(b, case.t, case.hkv, case.head_dim)
    anchors = torch.tensor(case.anchors, dtype=torch.int64)
    positions = anchors[:, None] + torch.arange(case.t)[None, :]
    seq_slots = torch.arange(b - 1, -1, -1, dtype=torch.int64)  # distinct slots, not in block order
    to = lambda *xs: [x.to(DEVICE) for x in xs]  # noqa: E731
    return to(q, k_blk, v_blk, k_store, v_store, k_pool, v_pool, cell_table, positions, seq_slots), rows


def _reference(q, k_blk, v_blk, k_store, v_store, positions, seq_slots, window, rows):
    span = min(window, rows) if window else rows
    key_pos, valid = draft_context_span(positions[:, 0], window, span)
    slots = seq_slots[:, None].expand_as(key_pos)
    return draft_attend_ref(q, k_blk, v_blk, k_store[slots, key_pos % rows], v_store[slots, key_pos % rows],
                            valid, 0.3)


@pytest.mark.parametrize("num_splits", [None, 1, 3], ids=lambda n: f"splits-{n or 'planned'}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_draft_attend_triton_matches_the_reference_in_both_layouts(case, dtype, num_splits):
    """Planned splits, one program per (block, KV head), and 3 splits (a block with no context leaves every split
    but the last, which adds the block's keys, empty; short contexts leave trailing splits empty)."""
    (q, k_blk, v_blk, k_store, v_store, k_pool, v_pool, table, positions, slots), rows = _inputs(case, dtype)
    want = _reference(q, k_blk, v_blk, k_store, v_store, positions, slots, case.window, rows).float()
    columns = ta.draft_attend_columns_triton(q, k_blk, v_blk, k_store, v_store, positions, slots, case.window, 0.3,
                                             num_splits=num_splits)
    cells = ta.draft_attend_cells_triton(q, k_blk, v_blk, k_pool, v_pool, table, positions, slots, case.window, 0.3,
                                         num_splits=num_splits)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert columns.shape == cells.shape == q.shape and columns.dtype == cells.dtype == dtype
    torch.testing.assert_close(columns.float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(cells.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", [CASES[0], pytest.param(CUDA_CASES[0], marks=cuda_only)], ids=lambda c: c.name)
def test_float32_dots_follow_the_callers_tf32_setting(case):
    """Where the caller's fp32 products run in TF32 (the drafter's methods on CUDA: RunConfig.draft_tf32), so do
    the kernel's dots: within TF32's rounding of the reference, and on CUDA not the full-precision answer."""
    from mg.kernels.precision import cuda_fp32_matmuls

    (q, k_blk, v_blk, k_store, v_store, *_, positions, slots), rows = _inputs(case, torch.float32)
    want = _reference(q, k_blk, v_blk, k_store, v_store, positions, slots, case.window, rows)
    with cuda_fp32_matmuls(False):
        ieee = ta.draft_attend_columns_triton(q, k_blk, v_blk, k_store, v_store, positions, slots, case.window, 0.3)
    with cuda_fp32_matmuls(True):
        tf32 = ta.draft_attend_columns_triton(q, k_blk, v_blk, k_store, v_store, positions, slots, case.window, 0.3)
    torch.testing.assert_close(ieee, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(tf32, want, atol=1e-2, rtol=1e-2)
    if DEVICE == "cuda":  # the interpreter computes every dot in full precision
        assert not torch.equal(tf32, ieee)


def test_draft_attend_triton_reads_only_the_context_before_the_anchor():
    """Keys at and after each block's anchor (stale rows of rejected drafts) change nothing; the context
    before it does."""
    case = CASES[0]
    (q, k_blk, v_blk, k_store, v_store, _, _, _, positions, slots), rows = _inputs(case, torch.float32)
    before = ta.draft_attend_columns_triton(q, k_blk, v_blk, k_store, v_store, positions, slots, 0, 0.3)
    stale = k_store.clone()
    for b, anchor in enumerate(case.anchors):
        stale[slots[b], anchor:] = 1e3
    after = ta.draft_attend_columns_triton(q, k_blk, v_blk, stale, v_store, positions, slots, 0, 0.3)
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    changed = k_store.clone()
    changed[slots[0], case.anchors[0] - 1] += 1.0
    moved = ta.draft_attend_columns_triton(q, k_blk, v_blk, changed, v_store, positions, slots, 0, 0.3)
    assert not torch.equal(moved[0], before[0]) and torch.equal(moved[1:], before[1:])


def test_draft_attend_triton_refuses_mismatched_inputs_with_one_clear_line():
    (q, k_blk, v_blk, k_store, v_store, _, _, _, positions, slots), _ = _inputs(CASES[0], torch.float32)
    with pytest.raises(ValueError, match=r"k/v must both be \[B, T, Hkv, D\]"):
        ta.draft_attend_columns_triton(q, k_blk[:, :3], v_blk, k_store, v_store, positions, slots, 0, 0.3)
    with pytest.raises(ValueError, match="must share one dtype"):
        ta.draft_attend_columns_triton(q, k_blk.bfloat16(), v_blk, k_store, v_store, positions, slots, 0, 0.3)
    with pytest.raises(ValueError, match=r"seq_slots must be a contiguous \[B\]"):
        ta.draft_attend_columns_triton(q, k_blk, v_blk, k_store, v_store, positions, slots.int(), 0, 0.3)
    with pytest.raises(ValueError, match=r"num_splits must be an int in \[1, 64\], got 0"):
        ta.draft_attend_columns_triton(q, k_blk, v_blk, k_store, v_store, positions, slots, 0, 0.3, num_splits=0)


def test_plan_draft_splits_fills_the_device_without_cutting_the_span_below_the_minimum():
    sms = 132
    assert ta.plan_draft_splits(1, 2, 1024, sms) == 1024 // ta.MIN_DRAFT_KEYS_PER_SPLIT  # the span limits it
    assert ta.plan_draft_splits(1, 2, 64, sms) == 1                                     # a short span: one split
    assert ta.plan_draft_splits(8, 4, 1 << 20, sms) == ta.DRAFT_TARGET_WAVES * sms // 32  # the device does
    assert ta.plan_draft_splits(8, 8, 1 << 20, sms) == 2  # 128 programs: a third split would start a second wave
    assert ta.plan_draft_splits(1, 8, 1 << 20, sms) == 16
    assert ta.plan_draft_splits(1, 1, 1 << 30, sms) == ta.MAX_SPLITS
    assert ta.plan_draft_splits(256, 8, 1 << 20, sms) == 1                              # already many programs


@pytest.mark.parametrize("layout", ["sequence", "cell"])
def test_draft_ops_give_the_reference_answer_through_either_cache_with_the_kernel(layout):
    """The drafter's op as the runtime binds it (`DraftOps.attend`): with the cache's Triton kernel
    (`KVCache.attend_block`) it answers as with the torch reference, on a ring that has wrapped, a flat
    layer and a padding block on the scratch slot."""
    from mg.manifests import KVLayer, KVSpec
    from mg.manifests.constants import POLICY_FLAT, POLICY_RING
    from mg.runtime.cache_base import make_cache
    from mg.runtime.draft_ops import DraftOps

    cell = layout == "cell"
    layers = (KVLayer(0, POLICY_RING, 6, 2, 16), KVLayer(1, POLICY_FLAT, 0, 2, 16))
    spec = KVSpec(layout=layout, max_seqs=None if cell else 3, max_cells=120 if cell else None, capacity=40,
                  max_write=8, dtype="float32", layers=layers)
    cache = make_cache(spec, DEVICE)
    ops = DraftOps(cache)
    g = torch.Generator().manual_seed(3)
    lengths = {0: 21, 2: 9}  # slot -> committed context (slot 0's ring of 13 rows has wrapped)
    for slot, length in lengths.items():
        for start in range(0, length, 8):
            pos = list(range(start, min(length, start + 8)))
            cache.declare_rows(pos, [slot] * len(pos))
            for layer in range(2):
                k, v = (torch.randn(len(pos), 2, 16, generator=g).to(DEVICE) for _ in range(2))
                ops.append(k, v, torch.tensor(pos, device=DEVICE), torch.full((len(pos),), slot, device=DEVICE), layer)
    t = 16
    anchors = torch.tensor([21, 0, 9], device=DEVICE)
    positions = anchors[:, None] + torch.arange(t, device=DEVICE)[None, :]
    slots = torch.tensor([0, cache.scratch_slot, 2], device=DEVICE)
    for layer in range(2):
        q = torch.randn(3, t, 4, 16, generator=g).to(DEVICE)
        k, v = (torch.randn(3, t, 2, 16, generator=g).to(DEVICE) for _ in range(2))
        cache.use_triton = False
        want = ops.attend(q, k, v, positions, slots, layer, 0.25)
        cache.use_triton = True
        got = ops.attend(q, k, v, positions, slots, layer, 0.25)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
