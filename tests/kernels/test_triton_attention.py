"""Triton attention kernels match the torch references on irregular sizes, both KV layouts.

Runs on CUDA, or on CPU through the Triton interpreter when MG_TRITON_INTERPRET=1
(small shapes there; the larger cases run only on CUDA). Skips cleanly when triton
is not importable.
"""

from dataclasses import dataclass, replace

import pytest
import torch

from triton_setup import DEVICE, cuda_only, module_marks  # first: sets TRITON_INTERPRET

pytest.importorskip("triton")

from mg.kernels.attention_ref import attend_cells_ref, attend_columns_ref, key_span  # noqa: E402
from mg.kernels import triton_attention as ta  # noqa: E402

pytestmark = module_marks(ta.available(), ta.reason)

MG_SCALE = (43.7840518911 / 128 ** 0.5) / 128 ** 0.5  # the MG target's sharp softmax scale at head_dim 128


@dataclass(frozen=True)
class Case:
    """One batch: sequences with a length each, the last `n_new` positions of each are queried."""

    name: str
    hq: int
    hkv: int
    head_dim: int
    lengths: tuple[int, ...]      # [B] tokens each sequence holds after this step
    n_new: tuple[int, ...]        # [B] queries per sequence (1 = decode)
    window: int = 0               # 0 = full attention
    ring: bool = False            # columns hold window + max_write - 1 rows (positions wrap)
    n_pad: int = 1                # padding rows (scratch slot, position 0)
    block_q: int | None = None
    num_splits: int | None = None

    @property
    def max_write(self) -> int:
        return max(self.n_new)

    @property
    def capacity(self) -> int:
        return max(self.lengths) + 3


CASES = [
    Case("decode-mha-flat", 2, 2, 16, (37, 5, 70), (1, 1, 1)),
    Case("decode-g3-ring-wrap", 6, 2, 16, (90, 13, 131), (1, 1, 1), window=24, ring=True),
    Case("decode-g4-window-flat", 4, 1, 16, (61, 3), (1, 1), window=17),
    Case("decode-g8-split", 8, 1, 16, (133, 1, 66), (1, 1, 1), num_splits=3),
    Case("prefill-g1-flat", 3, 3, 16, (29, 40), (7, 11)),
    Case("prefill-g3-ring-wrap", 6, 2, 16, (77, 30), (9, 5), window=20, ring=True),
    Case("prefill-g4-split", 8, 2, 16, (45, 100), (6, 3), num_splits=2),
    Case("prefill-g8-decode-tiles", 8, 1, 16, (52, 23), (6, 4), window=9, block_q=1),
    Case("decode-d64-g4", 8, 2, 64, (70, 9), (1, 1), window=32, ring=True),
    Case("prefill-d64-g8-flat", 8, 1, 64, (33,), (17,), n_pad=2),
    Case("window-wider-than-rows", 4, 2, 16, (20, 30), (3, 1), window=64),  # span = rows (33)
]
CUDA_CASES = [
    Case("decode-d128-g8-long", 16, 2, 128, (4097, 1, 777, 2048, 3000), (1, 1, 1, 1, 1)),
    Case("decode-d128-g16-ring", 32, 2, 128, (5000, 2049, 100), (1, 1, 1), window=2048, ring=True),
    Case("decode-d128-g4-cells-scale", 32, 8, 128, (1500, 333), (1, 1)),
    Case("prefill-d128-g8-chunk", 16, 2, 128, (1200, 700), (256, 129), window=512, ring=True),
    Case("prefill-d64-g3-flat", 12, 4, 64, (300, 257, 90), (100, 64, 90)),
]
ALL_CASES = CASES + [pytest.param(c, marks=cuda_only) for c in CUDA_CASES]


def _ids(case: Case) -> str:
    return case.name


@dataclass
class Batch:
    q: torch.Tensor            # [N, Hq, D]
    positions: torch.Tensor    # [N] int64
    seq_slots: torch.Tensor    # [N] int64
    k_store: torch.Tensor      # [slots, rows, Hkv, D]
    v_store: torch.Tensor
    k_pool: torch.Tensor       # [cells, Hkv, D]
    v_pool: torch.Tensor
    cell_table: torch.Tensor   # [slots, capacity] int64


def make_batch(case: Case, dtype: torch.dtype, seed: int = 0) -> Batch:
    """Random K/V in both layouts holding the same keys; the scratch slot/cell is the last one."""
    g = torch.Generator().manual_seed(seed)
    n_seqs = len(case.lengths)
    slots = n_seqs + 2                          # one idle slot, then the scratch slot
    scratch = slots - 1
    rows = case.window + case.max_write - 1 if case.ring else case.capacity
    d, hkv = case.head_dim, case.hkv

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    k_store, v_store = rand(slots, rows, hkv, d), rand(slots, rows, hkv, d)
    # Cells: every (slot, position) gets its own cell in a shuffled pool, except that the
    # second sequence shares the first one's first cells (a cloned prefix).
    n_cells = slots * case.capacity + 1
    order = torch.randperm(n_cells - 1, generator=g)
    cell_table = order[: slots * case.capacity].view(slots, case.capacity).clone()
    if n_seqs > 1:
        shared = torch.arange(min(case.lengths[0], case.lengths[1]) // 2)
        cell_table[1, shared] = cell_table[0, shared]
        k_store[1, shared % rows], v_store[1, shared % rows] = k_store[0, shared % rows], v_store[0, shared % rows]
    cell_table[scratch] = n_cells - 1
    # The pool holds the same keys as the columns, so both layouts give the same answer.
    k_pool, v_pool = rand(n_cells, hkv, d), rand(n_cells, hkv, d)
    p = torch.arange(case.capacity)
    for s in range(scratch):
        k_pool[cell_table[s, p]], v_pool[cell_table[s, p]] = k_store[s, p % rows], v_store[s, p % rows]
    k_pool[n_cells - 1], v_pool[n_cells - 1] = k_store[scratch, 0], v_store[scratch, 0]

    positions, seq_slots = [], []
    for s, (length, new) in enumerate(zip(case.lengths, case.n_new)):
        positions += list(range(length - new, length))
        seq_slots += [s] * new
    positions += [0] * case.n_pad
    seq_slots += [scratch] * case.n_pad
    q = rand(len(positions), case.hq, d)
    t = lambda x: x.to(DEVICE)  # noqa: E731
    return Batch(t(q), t(torch.tensor(positions)), t(torch.tensor(seq_slots)), t(k_store), t(v_store),
                 t(k_pool), t(v_pool), t(cell_table))


def run_columns(case: Case, b: Batch, **kw) -> torch.Tensor:
    kw = {"block_q": case.block_q, "num_splits": case.num_splits, **kw}
    return ta.attend_columns_triton(b.q, b.k_store, b.v_store, b.positions, b.seq_slots, case.window, MG_SCALE, **kw)


def run_cells(case: Case, b: Batch, **kw) -> torch.Tensor:
    kw = {"block_q": case.block_q, "num_splits": case.num_splits, **kw}
    return ta.attend_cells_triton(b.q, b.k_pool, b.v_pool, b.cell_table, b.positions, b.seq_slots, case.window,
                                  MG_SCALE, **kw)


def ref_columns(case: Case, b: Batch) -> torch.Tensor:
    return attend_columns_ref(b.q, b.k_store, b.v_store, b.positions, b.seq_slots, case.window, MG_SCALE)


def ref_cells(case: Case, b: Batch) -> torch.Tensor:
    return attend_cells_ref(b.q, b.k_pool, b.v_pool, b.cell_table, b.positions, b.seq_slots, case.window, MG_SCALE)


def as_fp32(b: Batch) -> Batch:
    return Batch(*(t.float() if t.is_floating_point() else t for t in vars(b).values()))


def attend_lowp(case: Case, b: Batch, layout: str) -> torch.Tensor:
    """Torch doing the math in the inputs' dtype (bf16 scores, probabilities and outputs):
    torch's own bf16 error, the yardstick of the 2x rule. Gathers like the references."""
    if layout == "columns":
        rows = b.k_store.shape[1]
        key_pos, valid = key_span(b.positions, case.window, min(case.window, rows) if case.window else rows)
        slots = b.seq_slots[:, None].expand_as(key_pos)
        k, v = b.k_store[slots, key_pos % rows], b.v_store[slots, key_pos % rows]
    else:
        cap = b.cell_table.shape[1]
        key_pos, valid = key_span(b.positions, case.window, min(case.window, cap) if case.window else cap)
        cells = b.cell_table[b.seq_slots[:, None].expand_as(key_pos), key_pos]
        k, v = b.k_pool[cells], b.v_pool[cells]
    n, hq, d = b.q.shape
    qg = b.q.view(n, case.hkv, hq // case.hkv, d)
    scores = torch.einsum("nhgd,nshd->nhgs", qg, k) * MG_SCALE
    probs = torch.softmax(scores.masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1)
    return torch.einsum("nhgs,nshd->nhgd", probs, v).reshape(n, hq, d)


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids)
def test_attend_columns_triton_matches_ref_fp32(case):
    b = make_batch(case, torch.float32)
    out = run_columns(case, b)
    assert out.dtype == torch.float32 and out.shape == b.q.shape
    torch.testing.assert_close(out, ref_columns(case, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids)
def test_attend_cells_triton_matches_ref_fp32(case):
    b = make_batch(case, torch.float32)
    out = run_cells(case, b)
    torch.testing.assert_close(out, ref_cells(case, b), atol=1e-4, rtol=1e-4)
    # Same keys in both layouts: the cell kernel agrees with the column reference too.
    torch.testing.assert_close(out, ref_columns(case, b), atol=1e-4, rtol=1e-4)


BF16_CASES = [CASES[1], CASES[6], CASES[8]] + [pytest.param(c, marks=cuda_only) for c in CUDA_CASES]


@pytest.mark.parametrize("layout", ["columns", "cells"])
@pytest.mark.parametrize("case", BF16_CASES, ids=_ids)
def test_bf16_error_is_within_twice_torch_bf16_error(case, layout):
    """Against an fp32 reference on the same bf16 inputs, the kernel's error is at most 2x the
    error of torch computing the same attention in bf16."""
    run, ref = (run_columns, ref_columns) if layout == "columns" else (run_cells, ref_cells)
    b = make_batch(case, torch.bfloat16)
    exact = ref(case, as_fp32(b))
    torch_err = (attend_lowp(case, b, layout).float() - exact).abs()
    out = run(case, b)
    assert out.dtype == torch.bfloat16
    kernel_err = (out.float() - exact).abs()
    assert kernel_err.max() <= 2 * torch_err.max() + 1e-6, (kernel_err.max(), torch_err.max())
    assert kernel_err.mean() <= 2 * torch_err.mean() + 1e-6, (kernel_err.mean(), torch_err.mean())


@pytest.mark.parametrize("layout", ["columns", "cells"])
def test_split_k_equals_one_pass(layout):
    case = Case("split", 4, 2, 16, (150, 9, 64), (1, 1, 1), window=0)
    b = make_batch(case, torch.float32, seed=1)
    run = run_columns if layout == "columns" else run_cells
    one = run(case, b, num_splits=1)
    # 5 splits of whole 32-key tiles: 150 keys use all 5, 64 keys use 2, 9 keys 1 (the rest are empty).
    torch.testing.assert_close(run(case, b, num_splits=5), one, atol=1e-5, rtol=1e-5)


def test_default_plan_splits_long_decode_and_tiles_prefill():
    decode = ta.plan_attention(n_queries=1, n_slots=9, n_q_heads=16, n_kv_heads=2, head_dim=128, span=32768,
                               dtype=torch.bfloat16, sms=132)
    assert decode.block_q == 1 and decode.num_splits > 1 and decode.block_q * decode.gp >= 16
    short = ta.plan_attention(n_queries=64, n_slots=65, n_q_heads=16, n_kv_heads=2, head_dim=128, span=200,
                              dtype=torch.bfloat16, sms=132)
    assert short.num_splits == 1
    prefill = ta.plan_attention(n_queries=512, n_slots=9, n_q_heads=16, n_kv_heads=2, head_dim=128, span=4096,
                                dtype=torch.bfloat16, sms=132)
    assert prefill.block_q > 1 and prefill.block_q * prefill.gp >= 16
    for plan in (decode, short, prefill):
        assert plan.block_n >= 16 and plan.block_d >= 16


@pytest.mark.parametrize("layout", ["columns", "cells"])
def test_query_order_and_tiling_do_not_change_the_output(layout):
    """Prefill queries interleaved across sequences (several slots in one program) give the
    same rows as the decode tiling (one query per program)."""
    case = Case("mixed", 6, 2, 16, (40, 27, 12), (4, 3, 1), window=15, n_pad=2)
    b = make_batch(case, torch.float32, seed=2)
    run = run_columns if layout == "columns" else run_cells
    base = run(case, b, block_q=1)
    perm = torch.randperm(b.q.shape[0], generator=torch.Generator().manual_seed(3)).to(DEVICE)
    shuffled = replace(b, q=b.q[perm].contiguous(), positions=b.positions[perm].contiguous(),
                       seq_slots=b.seq_slots[perm].contiguous())
    for block_q in (4, 16):
        torch.testing.assert_close(run(case, shuffled, block_q=block_q), base[perm], atol=1e-5, rtol=1e-5)


def test_padding_rows_read_only_the_scratch_key():
    case = Case("pad", 8, 2, 16, (20,), (1,), n_pad=3)
    b = make_batch(case, torch.float32)
    out = run_columns(case, b)[-3:]                             # [3, Hq, D]
    scratch_v = b.v_store[-1, 0].repeat_interleave(4, dim=0)     # [Hq, D]: one key, weight 1
    torch.testing.assert_close(out, scratch_v.expand_as(out), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_columns_triton_matches_ref(dtype):
    case = Case("write", 4, 2, 16, (30, 11), (3, 1), window=8, ring=True)
    b = make_batch(case, dtype)
    n = b.q.shape[0]
    k_new = torch.randn(n, 2, 16).to(dtype).to(DEVICE)
    v_new = torch.randn(n, 2, 16).to(dtype).to(DEVICE)
    want_k, want_v = b.k_store.clone(), b.v_store.clone()
    ta.write_columns_ref(k_new[:-1], v_new[:-1], want_k, want_v, b.positions[:-1], b.seq_slots[:-1])
    ta.write_columns_triton(k_new[:-1], v_new[:-1], b.k_store, b.v_store, b.positions[:-1], b.seq_slots[:-1])
    assert torch.equal(b.k_store, want_k) and torch.equal(b.v_store, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_cells_triton_matches_ref(dtype):
    case = Case("write", 4, 2, 16, (30, 11), (3, 1))
    b = make_batch(case, dtype)
    n = b.q.shape[0] - 1
    k_new = torch.randn(n, 2, 16).to(dtype).to(DEVICE)
    v_new = torch.randn(n, 2, 16).to(dtype).to(DEVICE)
    want_k, want_v = b.k_pool.clone(), b.v_pool.clone()
    args = (b.cell_table, b.positions[:n], b.seq_slots[:n])
    ta.write_cells_ref(k_new, v_new, want_k, want_v, *args)
    ta.write_cells_triton(k_new, v_new, b.k_pool, b.v_pool, *args)
    assert torch.equal(b.k_pool, want_k) and torch.equal(b.v_pool, want_v)


def test_launcher_names_the_bad_argument():
    case = Case("bad", 4, 2, 16, (10,), (1,))
    b = make_batch(case, torch.float32)
    with pytest.raises(ValueError, match="positions must be int64"):
        ta.attend_columns_triton(b.q, b.k_store, b.v_store, b.positions.int(), b.seq_slots, 0, 1.0)
    with pytest.raises(ValueError, match="k_store dtype"):
        ta.attend_columns_triton(b.q, b.k_store.double(), b.v_store, b.positions, b.seq_slots, 0, 1.0)
    with pytest.raises(ValueError, match="contiguous last dim"):
        ta.attend_columns_triton(b.q.transpose(1, 2).contiguous().transpose(1, 2), b.k_store, b.v_store,
                                 b.positions, b.seq_slots, 0, 1.0)
    with pytest.raises(ValueError, match="multiple of"):
        ta.attend_cells_triton(b.q[:, :3], b.k_pool, b.v_pool, b.cell_table, b.positions, b.seq_slots, 0, 1.0)
    with pytest.raises(ValueError, match="cell_table"):
        ta.attend_cells_triton(b.q, b.k_pool, b.v_pool, b.cell_table.int(), b.positions, b.seq_slots, 0, 1.0)


def test_strided_query_view_is_accepted():
    """q may be a view of a fused projection (row stride > Hq * D); only the last dim must be dense."""
    case = Case("view", 4, 2, 16, (25, 8), (1, 1))
    b = make_batch(case, torch.float32)
    fused = torch.randn(b.q.shape[0], 4 + 2, 16, device=DEVICE)
    fused[:, :4] = b.q
    view = replace(b, q=fused[:, :4])
    torch.testing.assert_close(run_columns(case, view), ref_columns(case, b), atol=1e-4, rtol=1e-4)


@cuda_only
@pytest.mark.parametrize("layout", ["columns", "cells"])
def test_cuda_graph_replay_follows_positions_on_device(layout):
    """Captured once; positions and slots change in place; replays match the reference (no host sync)."""
    case = Case("graph", 16, 2, 128, (3000, 700, 1), (1, 1, 1))
    b = make_batch(case, torch.bfloat16)
    run, ref = (run_columns, ref_columns) if layout == "columns" else (run_cells, ref_cells)
    run(case, b)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(case, b)
    for new_pos, new_slots in (([2999, 699, 0], [0, 1, 2]), ([17, 2000, 5], [1, 0, 0])):
        b.positions[:3].copy_(torch.tensor(new_pos))
        b.seq_slots[:3].copy_(torch.tensor(new_slots))
        graph.replay()
        want = ref(case, as_fp32(b))
        torch_err = (attend_lowp(case, b, layout).float() - want).abs().max()
        assert (out.float() - want).abs().max() <= 2 * torch_err + 1e-6
