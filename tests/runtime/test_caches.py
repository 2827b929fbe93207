"""The off-graph KV caches (kBatchedSequence, kBatchedCell) against the eager model's own ReferenceKV
and against each other: same schedule, same q/k/v, same attention."""

from __future__ import annotations

import random

import pytest
import torch

from mg.export.config import MuseGlimmerConfig
from mg.export.reference import ReferenceKV
from mg.manifests import KVLayer, KVSpec
from mg.manifests.constants import LAYOUT_CELL, LAYOUT_SEQUENCE, LAYOUTS, POLICY_FLAT, POLICY_RING
from mg.runtime.cache_base import CacheError, KVCache, make_cache
from mg.runtime.cache_cell import BatchedCellCache
from mg.runtime.cache_sequence import BatchedSequenceCache

SCALE = 0.35
N_SLOTS = 3
RING, FLAT = 0, 1  # layer ids in tiny_cfg(): layers 1 and 3 are global


def tiny_cfg(window: int = 4) -> MuseGlimmerConfig:
    return MuseGlimmerConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64, vocab_size=64,
                             sliding_window=window, every_n_layers_nope=2, dtype="float32")


def kv_spec(cfg: MuseGlimmerConfig, layout: str, capacity: int = 48, max_write: int = 8,
            max_cells: int = 160) -> KVSpec:
    layers = tuple(KVLayer(layer_id=i, policy=POLICY_FLAT if cfg.is_global(i) else POLICY_RING,
                           window=cfg.window(i), n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim)
                   for i in range(cfg.n_layers))
    cell = layout == LAYOUT_CELL
    return KVSpec(layout=layout, max_seqs=None if cell else N_SLOTS, max_cells=max_cells if cell else None,
                  capacity=capacity, max_write=max_write, dtype="float32", layers=layers)


def new_cache(cfg: MuseGlimmerConfig, layout: str, initial_rows: int = 2, device: str = "cpu",
              **spec_kw) -> KVCache:
    """Sequence caches start at 2 rows and cell caches at a read span of 2 positions, so the schedules grow
    flat columns, rings and spans."""
    spec = kv_spec(cfg, layout, **spec_kw)
    if layout == LAYOUT_SEQUENCE:
        return BatchedSequenceCache(spec, device, initial_rows=initial_rows)
    return BatchedCellCache(spec, device, n_slots=N_SLOTS, initial_span=initial_rows)


def random_qkvs(cfg: MuseGlimmerConfig, n: int, gen: torch.Generator, magnitude: float = 1.0):
    """One (q [n,Hq,D], k [n,Hkv,D], v [n,Hkv,D]) per layer."""
    def rand(h):
        return magnitude * torch.randn(n, h, cfg.head_dim, generator=gen)
    return [(rand(cfg.n_heads), rand(cfg.n_kv_heads), rand(cfg.n_kv_heads)) for _ in range(cfg.n_layers)]


def step(backend, rows, qkvs, order=None) -> list[torch.Tensor]:
    """Run one step of rows [(slot, position)] through a cache (declare, then every layer) or a
    ReferenceKV; returns the attention output of each layer, indexed by layer id."""
    positions = torch.tensor([p for _, p in rows], dtype=torch.int64)
    slots = torch.tensor([s for s, _ in rows], dtype=torch.int64)
    attend = backend
    if isinstance(backend, KVCache):
        backend.declare_step(positions, slots)
        attend = backend.update_and_attend
    positions, slots = positions.to(qkvs[0][0].device), slots.to(qkvs[0][0].device)
    outs = {}
    for layer in order if order is not None else range(len(qkvs)):
        q, k, v = qkvs[layer]
        outs[layer] = attend(q, k, v, positions, slots, layer, SCALE)
    return [outs[layer] for layer in range(len(qkvs))]


def assert_outputs_equal(got, want, where: str, n_rows: int | None = None) -> None:
    for layer, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g[:n_rows], w[:n_rows], atol=1e-5, rtol=1e-5, msg=f"{where}, layer {layer}")


def snapshot(cache: KVCache) -> list:
    state = [cache.metrics(), cache.lengths().clone()]
    state += [t.clone() for layer in range(len(cache.spec.layers)) for t in cache.storage(layer)]
    if isinstance(cache, BatchedCellCache):
        state += [cache.cell_table.clone(), [cache.cell_list(s) for s in range(cache.n_slots)]]
    return state


def assert_same_state(before: list, after: list) -> None:
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def interleaved_schedule(seed: int, capacity: int = 32, max_write: int = 8, steps: int = 40):
    """Events: ("step", rows) mixing prefill chunks and decode tokens of several sequences,
    ("rewind", slot, n) rejecting part of the last chunk, ("release", slot) at capacity."""
    rng = random.Random(seed)
    length = [0] * N_SLOTS
    for _ in range(steps):
        rows, budget, chunks = [], max_write, []
        for slot in rng.sample(range(N_SLOTS), rng.randint(1, N_SLOTS)):
            prefill = length[slot] == 0 or rng.random() < 0.3
            n = min(budget, rng.randint(2, 6) if prefill else 1, capacity - length[slot])
            if length[slot] == capacity:
                yield ("release", slot)
                length[slot] = 0
            elif n > 0:
                rows += [(slot, length[slot] + j) for j in range(n)]
                chunks.append((slot, length[slot], n))
                length[slot] += n
                budget -= n
        if rows:
            yield ("step", rows)
        for slot, first, n in chunks:
            if n > 1 and rng.random() < 0.4:
                length[slot] = rng.randint(first, first + n - 1)
                yield ("rewind", slot, length[slot])


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("window", [4, 7])
def test_layouts_agree_on_interleaved_schedule(window):
    cfg = tiny_cfg(window)
    ref = ReferenceKV(cfg)
    caches = [new_cache(cfg, LAYOUT_SEQUENCE, capacity=32), new_cache(cfg, LAYOUT_CELL, capacity=32)]
    gen, rng = torch.Generator().manual_seed(window), random.Random(window)
    kinds = set()
    for i, event in enumerate(interleaved_schedule(seed=window)):
        kinds.add(event[0])
        if event[0] != "step":
            for cache in caches:
                getattr(cache, event[0])(*event[1:])
            continue
        rows = event[1]
        qkvs = random_qkvs(cfg, len(rows), gen)
        want = step(ref, rows, qkvs)
        for cache in caches:  # layers in a random order: each layer's call stands alone
            got = step(cache, rows, qkvs, order=rng.sample(range(cfg.n_layers), cfg.n_layers))
            assert_outputs_equal(got, want, f"event {i} {cache.layout}")
        assert caches[0].metrics().lengths == caches[1].metrics().lengths
    assert kinds == {"step", "rewind", "release"}
    assert caches[0].metrics().growth_count > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padding_rows_on_scratch_slot_change_no_live_output(layout):
    cfg = tiny_cfg(4)
    padded, plain = new_cache(cfg, layout), new_cache(cfg, layout)
    gen = torch.Generator().manual_seed(3)
    schedule = [[(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]] + [[(0, p + 3), (1, p + 2)] for p in range(10)]
    for i, rows in enumerate(schedule):
        qkvs = random_qkvs(cfg, len(rows), gen)
        n_pad = padded.max_write - len(rows)
        pad = random_qkvs(cfg, n_pad, gen, magnitude=100.0)
        padded_qkvs = [tuple(torch.cat([a, b]) for a, b in zip(live, p)) for live, p in zip(qkvs, pad)]
        got = step(padded, rows + [(padded.scratch_slot, 0)] * n_pad, padded_qkvs)
        assert_outputs_equal(got, step(plain, rows, qkvs), f"step {i}", n_rows=len(rows))
    assert padded.metrics().lengths == plain.metrics().lengths == (13, 12, 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_query_never_sees_other_sequences_keys(layout):
    cfg = tiny_cfg(4)
    clean, poisoned = new_cache(cfg, layout), new_cache(cfg, layout)
    gen = torch.Generator().manual_seed(4)
    for i, event in enumerate(interleaved_schedule(seed=11, steps=12)):
        for cache in (clean, poisoned):
            if event[0] == "step":
                qkvs = random_qkvs(cfg, len(event[1]), torch.Generator().manual_seed(i))
                step(cache, event[1], qkvs)
            else:
                getattr(cache, event[0])(*event[1:])
    owned = poisoned.cell_list(0) if layout == LAYOUT_CELL else [0]  # slot 0's cells, or its column
    for layer in range(cfg.n_layers):
        for t in poisoned.storage(layer):
            others = torch.ones(t.shape[0], dtype=torch.bool)
            others[owned] = False
            t[others] = 1e4  # every other sequence, free cells and the scratch slot/cell
    n0 = clean.length(0)
    rows = [(0, n0), (0, n0 + 1)]
    qkvs = random_qkvs(cfg, len(rows), gen)
    assert_outputs_equal(step(poisoned, rows, qkvs), step(clean, rows, qkvs), "after poisoning")


# --------------------------------------------------------------------------- growth


def test_flat_doubling_keeps_contents_and_bumps_storage_version():
    cfg = tiny_cfg(4)
    grown, fixed = new_cache(cfg, LAYOUT_SEQUENCE, initial_rows=2), new_cache(cfg, LAYOUT_SEQUENCE, initial_rows=48)
    gen, pos = torch.Generator().manual_seed(5), 0
    for n in (3, 1, 5, 8, 1, 1, 8, 2):
        rows = [(0, pos + j) for j in range(n)]
        rows_before, version_before = grown.rows(FLAT), grown.storage_version()
        qkvs = random_qkvs(cfg, n, gen)
        assert_outputs_equal(step(grown, rows, qkvs), step(fixed, rows, qkvs), f"positions {pos}..{pos + n - 1}")
        pos += n
        assert grown.rows(FLAT) >= pos
        assert (grown.storage_version() > version_before) == (grown.rows(FLAT) > rows_before)
    assert grown.rows(FLAT) == 32  # 2 -> 4 -> 8 -> 16 -> 32
    assert fixed.metrics().growth_count == fixed.storage_version() == 0
    assert grown.metrics().growth_count == grown.storage_version() > 0


def test_cell_read_span_doubles_reads_the_same_keys_and_bumps_version_once_read():
    cfg = tiny_cfg(4)
    grown, whole = new_cache(cfg, LAYOUT_CELL, initial_rows=2), new_cache(cfg, LAYOUT_CELL, initial_rows=48)
    assert grown.read_span == 2 and whole.read_span == 48 == whole.capacity
    grown.declare_step(torch.arange(5), torch.zeros(5, dtype=torch.int64))  # grows 2 -> 8 before any read
    assert grown.read_span == 8 and grown.storage_version() == 0
    grown.rewind(0, 0)
    gen, pos = torch.Generator().manual_seed(15), 0
    for n in (3, 1, 5, 8, 1, 1, 8, 2):
        rows = [(0, pos + j) for j in range(n)] + [(1, j) for j in range(min(n, 2))] * (pos == 0)
        span_before, version_before = grown.read_span, grown.storage_version()
        qkvs = random_qkvs(cfg, len(rows), gen)
        assert_outputs_equal(step(grown, rows, qkvs), step(whole, rows, qkvs), f"positions {pos}..{pos + n - 1}")
        pos += n
        assert grown.read_span >= pos
        assert (grown.storage_version() > version_before) == (grown.read_span > span_before)
    assert grown.read_span == 32 and grown.max_span(FLAT) == 32  # 8 -> 16 -> 32
    assert whole.storage_version() == 0 and whole.metrics().growth_count == grown.metrics().growth_count == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reserved_cache_never_moves_and_reads_like_a_growing_one(layout):
    cfg = tiny_cfg(4)
    growing, reserved = new_cache(cfg, layout, capacity=32), new_cache(cfg, layout, capacity=32)
    reserved.max_span(FLAT)  # a reader has used the span: growing it now would bump the version
    reserved.reserve()
    version, allocated = reserved.storage_version(), reserved.metrics().bytes_allocated
    gen = torch.Generator().manual_seed(21)
    for i, event in enumerate(interleaved_schedule(seed=21)):
        if event[0] != "step":
            for cache in (growing, reserved):
                getattr(cache, event[0])(*event[1:])
            continue
        qkvs = random_qkvs(cfg, len(event[1]), gen)
        assert_outputs_equal(step(reserved, event[1], qkvs), step(growing, event[1], qkvs), f"event {i}")
    assert growing.storage_version() > 0  # the schedule does grow an unreserved cache
    assert reserved.storage_version() == version and reserved.metrics().bytes_allocated == allocated
    assert reserved.metrics().lengths == growing.metrics().lengths
    if layout == LAYOUT_SEQUENCE:
        assert reserved.metrics().rows == (4 + 8 - 1, 32, 4 + 8 - 1, 32)  # ring: window + max_write - 1
    else:
        assert reserved.read_span == 32


def test_reserve_without_the_memory_for_every_layer_changes_nothing(monkeypatch):
    cfg = tiny_cfg(4)
    cache = new_cache(cfg, LAYOUT_SEQUENCE, capacity=32)
    step(cache, [(0, p) for p in range(3)], random_qkvs(cfg, 3, torch.Generator().manual_seed(2)))
    before = snapshot(cache)
    zeros = BatchedSequenceCache._zeros

    def fails_for_the_last_layer(self, layer_id, rows):
        if layer_id == 3 and rows > 2:
            raise torch.OutOfMemoryError("out of memory (test)")
        return zeros(self, layer_id, rows)

    monkeypatch.setattr(BatchedSequenceCache, "_zeros", fails_for_the_last_layer)
    with pytest.raises(torch.OutOfMemoryError):
        cache.reserve()
    assert_same_state(before, snapshot(cache))  # layers 0-2 were not grown either


def test_ring_growth_after_wrap_replaces_positions_at_new_rows():
    cfg = tiny_cfg(4)  # ring rows grow up to window + max_write - 1 = 11
    grown, fixed = new_cache(cfg, LAYOUT_SEQUENCE, initial_rows=4), new_cache(cfg, LAYOUT_SEQUENCE, initial_rows=48)
    ref = ReferenceKV(cfg)
    gen = torch.Generator().manual_seed(6)
    decodes = [[(0, p), (1, p)] if p < 7 else [(0, p)] for p in range(10)]
    schedule = decodes + [[(0, p) for p in range(10, 16)] + [(1, 7)], [(0, 16), (1, 8)], [(0, 17), (1, 9)]]
    for i, rows in enumerate(schedule):
        if i == len(decodes):
            assert grown.rows(RING) == 4 and grown.length(0) == 10  # the 4-row ring has wrapped
            version = grown.storage_version()
        qkvs = random_qkvs(cfg, len(rows), gen)
        want = step(ref, rows, qkvs)
        assert_outputs_equal(step(grown, rows, qkvs), want, f"step {i} (grown)")
        assert_outputs_equal(step(fixed, rows, qkvs), want, f"step {i} (fixed)")
    assert grown.rows(RING) == fixed.rows(RING) == 11
    assert grown.storage_version() > version
    for slot in (0, 1):  # what the next query's window needs sits at p % 11 in both
        for p in range(grown.length(slot) - 3, grown.length(slot)):
            assert torch.equal(grown.storage(RING)[0][slot, p % 11], fixed.storage(RING)[0][slot, p % 11])


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("reserved", [False, True])
def test_ring_rewind_beyond_window_is_refused_and_changes_nothing(reserved):
    """Grown to its most rows by the steps, or reserved so from the start (no growth: the admission's path for
    storage that can never need more rows), the ring knows what its writes wrapped over."""
    cfg = tiny_cfg(4)  # ring rows = 4 + 8 - 1 = 11
    cache, ref = new_cache(cfg, LAYOUT_SEQUENCE), ReferenceKV(cfg)
    if reserved:
        cache.reserve()
    gen = torch.Generator().manual_seed(7)
    for first, n in ((0, 8), (8, 8), (16, 4)):
        rows = [(0, first + j) for j in range(n)]
        qkvs = random_qkvs(cfg, n, gen)
        step(cache, rows, qkvs), step(ref, rows, qkvs)
    before = snapshot(cache)
    # After writing 0..19 the ring holds 9..19; a query at 10 would need 7..9.
    with pytest.raises(CacheError, match=r"layer 0 \(ring, window=4, rows=11\).*positions 7\.\.8.*>= 12"):
        cache.rewind(0, 10)
    with pytest.raises(CacheError, match="layer 0"):
        cache.declare_step(torch.tensor([10]), torch.tensor([0]))  # a write behind the length needs the same
    assert_same_state(before, snapshot(cache))
    cache.rewind(0, 12)  # a query at 12 needs 9..11: still held
    rows = [(0, 12), (0, 13)]
    qkvs = random_qkvs(cfg, 2, gen)
    assert_outputs_equal(step(cache, rows, qkvs), step(ref, rows, qkvs), "after rewind to 12")


def filled_cache(cfg: MuseGlimmerConfig, layout: str, **spec_kw) -> KVCache:
    """Slot 0 holds 3 positions, slot 1 is full (capacity 16), slot 2 is empty."""
    cache = new_cache(cfg, layout, capacity=16, **spec_kw)
    gen = torch.Generator().manual_seed(8)
    for rows in ([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)], [(1, p) for p in range(2, 10)],
                 [(1, p) for p in range(10, 16)]):
        step(cache, rows, random_qkvs(cfg, len(rows), gen))
    return cache


REFUSALS = {
    "too_many_tokens": ([(2, p) for p in range(9)], r"N=9 tokens.*max_write=8"),
    "beyond_capacity": ([(1, 16)], r"positions\[0\]=16 \(slot 1\) is beyond capacity=16"),
    "slot_out_of_range": ([(0, 3), (4, 0)], r"seq_slots\[1\]=4 is out of range.*0\.\.2.*scratch_slot=3"),
    "negative_slot": ([(-1, 0)], r"seq_slots\[0\]=-1 is out of range"),
    "skips_ahead": ([(0, 5)], r"position 5 of slot 0 skips ahead of its length 3"),
    "not_contiguous": ([(0, 3), (0, 5)], r"slot 0 .*contiguous; found \[3, 5\]"),
    "padding_position": ([(3, 2)], r"scratch_slot=3; padding rows use position 0"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_beyond_a_limit_is_refused_and_changes_nothing(layout, case):
    cfg = tiny_cfg(4)
    cache, twin = filled_cache(cfg, layout), filled_cache(cfg, layout)
    rows, message = REFUSALS[case]
    before = snapshot(cache)
    with pytest.raises(CacheError, match=message):
        step(cache, rows, random_qkvs(cfg, len(rows), torch.Generator()))
    assert_same_state(before, snapshot(cache))
    rows = [(0, 3), (2, 0), (2, 1)]  # the cache still behaves as if the refused step never came
    qkvs = random_qkvs(cfg, len(rows), torch.Generator().manual_seed(9))
    assert_outputs_equal(step(cache, rows, qkvs), step(twin, rows, qkvs), "after the refusal")


def test_cells_a_step_needs_count_shared_and_new_positions_not_those_owned_alone():
    """Admission counts, per slot's span, the positions past its cells and those it shares (copy on write);
    a position whose cell it owns alone is written in place."""
    cfg = tiny_cfg(4)
    cache = new_cache(cfg, LAYOUT_CELL, max_cells=8)
    gen = torch.Generator().manual_seed(5)
    step(cache, [(0, p) for p in range(4)], random_qkvs(cfg, 4, gen))
    cache.clone(0, 1, 3)  # slot 1 shares cells 0..2 of slot 0; 4 cells free
    own = cache.cell_list(0)[3]
    # slot 1: positions 1, 2 shared and 3 past its cells (3 new); slot 0: 2 shared (1 new), 3 its own, 4 new.
    rows = [(1, 1), (1, 2), (1, 3), (0, 2), (0, 3), (0, 4)]
    before = snapshot(cache)
    with pytest.raises(CacheError, match=r"the step needs 5 new cells but 4 of max_cells=8 are free"):
        step(cache, rows, random_qkvs(cfg, len(rows), gen))
    assert_same_state(before, snapshot(cache))
    step(cache, rows[:-1], random_qkvs(cfg, 5, gen))
    # 4 cells taken; position 2's old cell, left by both owners, is free again
    assert cache.cell_list(0)[3] == own and cache.metrics().cells_free == 1
    assert cache.cell_list(1)[0] == cache.cell_list(0)[0]  # still shared where neither wrote


def test_step_needing_more_cells_than_free_is_refused_and_changes_nothing():
    cfg = tiny_cfg(4)
    cache = filled_cache(cfg, LAYOUT_CELL, max_cells=22)  # 19 cells used, 3 free
    before = snapshot(cache)
    rows = [(0, 3), (2, 0), (2, 1), (2, 2)]
    with pytest.raises(CacheError, match=r"out of cells: the step needs 4 new cells but 3 of max_cells=22 are free"):
        step(cache, rows, random_qkvs(cfg, 4, torch.Generator()))
    assert_same_state(before, snapshot(cache))
    cache.release(1)
    assert cache.metrics().cells_free == 19
    step(cache, rows, random_qkvs(cfg, 4, torch.Generator()))
    assert cache.metrics().lengths == (4, 0, 3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rewind_and_clone_outside_lengths_are_refused(layout):
    cache = filled_cache(tiny_cfg(4), layout)
    before = snapshot(cache)
    for call, message in ((lambda: cache.rewind(0, 4), r"new_length=4; allowed: 0\.\.3"),
                          (lambda: cache.rewind(3, 0), r"slot=3 is out of range"),
                          (lambda: cache.clone(0, 1, 2), r"dst=1: .* empty; its length is 16"),
                          (lambda: cache.clone(0, 2, 4), r"length=4 from slot 0; allowed: 0\.\.3"),
                          (lambda: cache.release(-1), r"slot=-1 is out of range")):
        with pytest.raises(CacheError, match=message):
            call()
    assert_same_state(before, snapshot(cache))


def as_spans(rows) -> list[tuple[int, int, int]]:
    """A step's rows [(slot, position)], contiguous per slot, as spans (slot, first position, rows)."""
    spans: dict[int, list[int]] = {}
    for slot, pos in rows:
        spans.setdefault(slot, []).append(pos)
    return [(slot, ps[0], len(ps)) for slot, ps in spans.items()]


def step_spans(cache: KVCache, rows, qkvs) -> list[torch.Tensor]:
    """`step`, with the rows admitted as spans (`declare_spans`) instead of row by row."""
    cache.declare_spans(as_spans(rows))
    positions = torch.tensor([p for _, p in rows], dtype=torch.int64)
    slots = torch.tensor([s for s, _ in rows], dtype=torch.int64)
    return [cache.update_and_attend(q, k, v, positions, slots, layer, SCALE) for layer, (q, k, v) in enumerate(qkvs)]


@pytest.mark.parametrize("reserved", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_spans_admit_as_the_rows_they_name(layout, reserved):
    """A fused round admits its rows as spans: the same lengths, held positions, cells (copy on write
    included) and outputs as the rows admitted one by one, through growth, rings wrapping, rewinds, clones and
    releases; and the same steps refused with nothing changed."""
    cfg = tiny_cfg(4)
    by_rows, by_spans = new_cache(cfg, layout, capacity=32), new_cache(cfg, layout, capacity=32)
    if reserved:
        by_rows.reserve(), by_spans.reserve()
    gen = torch.Generator().manual_seed(21)
    kinds = set()
    for i, event in enumerate(interleaved_schedule(seed=21)):
        kinds.add(event[0])
        if event[0] != "step":
            for cache in (by_rows, by_spans):
                getattr(cache, event[0])(*event[1:])
            if event[0] == "rewind" and event[2] > 0 and layout == LAYOUT_CELL:  # share a prefix, then diverge
                free = [s for s in range(N_SLOTS) if by_rows.length(s) == 0]
                if free:
                    for cache in (by_rows, by_spans):
                        cache.clone(event[1], free[0], event[2])
            continue
        qkvs = random_qkvs(cfg, len(event[1]), gen)
        assert_outputs_equal(step_spans(by_spans, event[1], qkvs), step(by_rows, event[1], qkvs), f"event {i}")
        assert_same_state(snapshot(by_rows), snapshot(by_spans))
    assert kinds == {"step", "rewind", "release"}
    while by_rows.length(0) <= 12:  # wrap slot 0's rings (11 rows) over its first positions
        rows = [(0, by_rows.length(0) + j) for j in range(min(8, 13 - by_rows.length(0)))]
        qkvs = random_qkvs(cfg, len(rows), gen)
        assert_outputs_equal(step_spans(by_spans, rows, qkvs), step(by_rows, rows, qkvs), "wrapping slot 0")
    # Refused alike, with nothing changed: limits of the step, the slot, the position, and what a ring holds.
    refused = [[(2, p) for p in range(9)], [(0, by_rows.capacity)], [(N_SLOTS + 1, 0)], [(-1, 0)],
               [(0, by_rows.length(0) + 1)]]
    if layout == LAYOUT_SEQUENCE:  # a write far behind the length: the ring wrapped over what it needs
        refused.append([(0, 4)])  # needs positions 1..3; the ring holds the last 11 of >= 13
    before = snapshot(by_spans)
    for rows in refused:
        with pytest.raises(CacheError):
            by_rows.declare_rows([p for _, p in rows], [s for s, _ in rows])
        with pytest.raises(CacheError):
            by_spans.declare_spans(as_spans(rows))
    with pytest.raises(CacheError, match="two spans"):
        by_spans.declare_spans([(0, by_spans.length(0), 1), (0, by_spans.length(0) + 1, 1)])
    for span in ((0, by_spans.length(0), 0), (N_SLOTS, 0, 1)):  # no rows; the scratch slot (padding)
        with pytest.raises(CacheError, match="at least one row"):
            by_spans.declare_spans([span])
    assert_same_state(before, snapshot(by_spans))
    assert_same_state(snapshot(by_rows), snapshot(by_spans))


# --------------------------------------------------------------------------- sharing and placement


@pytest.mark.parametrize("layout", LAYOUTS)
def test_clone_then_diverge_matches_writing_the_prefix_twice(layout):
    cfg = tiny_cfg(4)
    cloned, twice = new_cache(cfg, layout), new_cache(cfg, layout)
    gen = torch.Generator().manual_seed(10)
    chunks = [[(0, p) for p in range(8)], [(0, p) for p in range(8, 11)]]
    prefix = [random_qkvs(cfg, len(rows), gen) for rows in chunks]
    for rows, qkvs in zip(chunks, prefix):
        step(cloned, rows, qkvs), step(twice, rows, qkvs)
    cloned.clone(0, 1, 9)  # a strict prefix of slot 0
    step(twice, [(1, p) for p in range(8)], prefix[0])
    step(twice, [(1, 8)], [tuple(t[:1] for t in qkv) for qkv in prefix[1]])
    assert cloned.metrics().lengths == twice.metrics().lengths == (11, 9, 0)
    for i in range(8):
        rows = [(0, 11 + i), (1, 9 + 2 * i), (1, 10 + 2 * i)]
        qkvs = random_qkvs(cfg, len(rows), gen)
        assert_outputs_equal(step(cloned, rows, qkvs), step(twice, rows, qkvs), f"diverged step {i}")
    if layout == LAYOUT_CELL:
        assert cloned.metrics().cells_used == twice.metrics().cells_used - 9


def test_writing_a_shared_cell_copies_only_that_position():
    cfg = tiny_cfg(4)
    shared, control = new_cache(cfg, LAYOUT_CELL), new_cache(cfg, LAYOUT_CELL)
    gen = torch.Generator().manual_seed(12)
    qkvs = random_qkvs(cfg, 6, gen)
    step(shared, [(0, p) for p in range(6)], qkvs)
    step(control, [(0, p) for p in range(6)], qkvs)
    step(control, [(1, p) for p in range(5)], [tuple(t[:5] for t in qkv) for qkv in qkvs])
    shared.clone(0, 1, 6)
    assert shared.metrics().cells_used == 6
    rows = [(1, 5), (1, 6)]  # position 5 of slot 1 is shared with slot 0: it gets a cell of its own
    qkvs = random_qkvs(cfg, 2, gen)
    assert_outputs_equal(step(shared, rows, qkvs), step(control, rows, qkvs), "writer")
    assert shared.cell_list(1)[:5] == shared.cell_list(0)[:5] and shared.cell_list(1)[5] != shared.cell_list(0)[5]
    assert shared.metrics().cells_used == 8
    rows = [(0, 6)]
    qkvs = random_qkvs(cfg, 1, gen)
    assert_outputs_equal(step(shared, rows, qkvs), step(control, rows, qkvs), "the other owner")
    shared.release(0)
    assert shared.metrics().cells_used == 7  # slot 1 still owns 0..4; slot 0's own cells for 5 and 6 are freed


def test_placement_takes_the_lowest_free_cell():
    cfg = tiny_cfg(4)
    cache = new_cache(cfg, LAYOUT_CELL, max_cells=16)
    gen = torch.Generator().manual_seed(13)

    def write(rows):
        step(cache, rows, random_qkvs(cfg, len(rows), gen))

    # Rows interleaved in the step: each slot's span takes cells in position order, slots in the order they
    # first appear in the step.
    write([(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (2, 0), (2, 1)])
    assert [cache.cell_list(s) for s in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    cache.release(1)
    write([(2, 2), (0, 3)])
    assert cache.cell_list(2) == [6, 7, 3] and cache.cell_list(0) == [0, 1, 2, 4]
    cache.rewind(0, 2)  # frees 2 and 4
    write([(1, p) for p in range(4)])
    assert cache.cell_list(1) == [2, 4, 5, 8]
    assert torch.equal(cache.cell_table[1, :5], torch.tensor([2, 4, 5, 8, cache.scratch_cell]))
    write([(1, 1), (1, 0), (1, 2)])  # its own cells, owned alone: written in place, whatever the rows' order
    assert cache.cell_list(1) == [2, 4, 5, 8]


# --------------------------------------------------------------------------- factory and metrics


def test_make_cache_chooses_the_layout_the_spec_names():
    cfg = tiny_cfg(4)
    seq = make_cache(kv_spec(cfg, LAYOUT_SEQUENCE), "cpu")
    cell = make_cache(kv_spec(cfg, LAYOUT_CELL, max_cells=100), "cpu")
    assert isinstance(seq, BatchedSequenceCache) and (seq.n_slots, seq.scratch_slot) == (N_SLOTS, N_SLOTS)
    assert isinstance(cell, BatchedCellCache) and cell.n_slots == 64 and cell.scratch_slot == 64
    assert make_cache(kv_spec(cfg, LAYOUT_CELL, max_cells=10), "cpu").n_slots == 10
    assert make_cache(kv_spec(cfg, LAYOUT_CELL), "cpu", n_slots=5).lengths().shape == (6,)
    with pytest.raises(CacheError, match=r"n_slots=5 for the sequence layout; allowed: kv.max_seqs=3"):
        make_cache(kv_spec(cfg, LAYOUT_SEQUENCE), "cpu", n_slots=5)
    m = seq.metrics()
    assert (m.layout, m.lengths, m.rows, m.cells_used) == ("sequence", (0, 0, 0), (11, 48, 11, 48), None)
    slots, hkv, head_dim, fp32 = N_SLOTS + 1, 2, 8, 4
    assert m.bytes_allocated == 2 * slots * (11 + 48 + 11 + 48) * hkv * head_dim * fp32  # K and V
    assert cell.metrics().cells_free == 100 and cell.capacity == 48 and cell.max_write == 8


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_update_and_attend_replays_from_a_cuda_graph(layout):
    """declare_step on the host, then every layer's update_and_attend replayed from a captured graph
    (capture fails on a host sync), recaptured when growth moves storage."""
    cfg = tiny_cfg(4)
    graphed, eager = new_cache(cfg, layout, device="cuda"), new_cache(cfg, layout, device="cuda")
    positions, slots = torch.zeros(2, dtype=torch.int64, device="cuda"), torch.tensor([0, 1], device="cuda")
    static = [tuple(t.cuda() for t in qkv) for qkv in random_qkvs(cfg, 2, torch.Generator())]
    gen, version, captures = torch.Generator().manual_seed(14), None, 0
    for p in range(20):  # two sequences decode side by side: flat columns grow, the ring wraps
        qkvs = random_qkvs(cfg, 2, gen)
        want = step(eager, [(0, p), (1, p)], [tuple(t.cuda() for t in qkv) for qkv in qkvs])
        graphed.declare_step(torch.tensor([p, p]), torch.tensor([0, 1]))
        positions.fill_(p)
        for dst, src in zip(static, qkvs):
            for d, s in zip(dst, src):
                d.copy_(s)
        if graphed.storage_version() != version:
            graph, version, captures = torch.cuda.CUDAGraph(), graphed.storage_version(), captures + 1
            with torch.cuda.graph(graph):
                outs = [graphed.update_and_attend(q, k, v, positions, slots, i, SCALE)
                        for i, (q, k, v) in enumerate(static)]
        graph.replay()
        assert_outputs_equal(outs, want, f"position {p}")
    assert (captures > 1) == (layout == LAYOUT_SEQUENCE)  # the cell layout never moves storage


def test_deferred_placement_writes_the_same_cell_table_when_the_step_places_it():
    """Admission with `defer=True` updates the host's cells but leaves the device cell table to the step: the
    placement it returns (padding rows: the scratch cell), written by `place`, gives the table admission writes
    itself, through fresh placements, rewinds, clone-shared cells (copy on write) and padding rows; so does the
    placement of the live rows admitted as spans (`declare_spans(..., defer=True)`: a context append's). The
    sequence layout takes no placement input."""
    cfg = tiny_cfg(4)
    direct, deferred, by_spans = new_cache(cfg, LAYOUT_CELL), new_cache(cfg, LAYOUT_CELL), new_cache(cfg, LAYOUT_CELL)
    scratch = direct.scratch_slot
    steps = [[(0, p) for p in range(5)] + [(1, 0), (1, 1)] + [(scratch, 0)] * 1,
             [(0, 5), (1, 2), (scratch, 0), (scratch, 0)],
             "rewind", [(0, 3), (0, 4), (1, 3)],
             "clone", [(2, 2), (2, 3), (0, 5)]]
    for rows in steps:
        if rows == "rewind":
            direct.rewind(0, 3), deferred.rewind(0, 3), by_spans.rewind(0, 3)
            continue
        if rows == "clone":
            direct.clone(0, 2, 3), deferred.clone(0, 2, 3), by_spans.clone(0, 2, 3)
            continue
        positions, slots = [p for _, p in rows], [s for s, _ in rows]
        assert direct.declare_rows(positions, slots) is None
        before = deferred.cell_table.clone()
        placement = deferred.declare_rows(positions, slots, defer=True)
        assert torch.equal(deferred.cell_table, before)  # nothing written on the device yet
        assert len(placement) == len(rows)
        assert [c for (s, _), c in zip(rows, placement) if s == scratch] == [deferred.scratch_cell] * sum(
            s == scratch for s, _ in rows)
        deferred.place(torch.tensor(positions), torch.tensor(slots), torch.tensor(placement))
        assert torch.equal(deferred.cell_table, direct.cell_table)
        assert [deferred.cell_list(s) for s in range(N_SLOTS)] == [direct.cell_list(s) for s in range(N_SLOTS)]
        live = [(s, p) for s, p in rows if s != scratch]
        before = by_spans.cell_table.clone()
        placement = by_spans.declare_spans(as_spans(live), defer=True)
        assert torch.equal(by_spans.cell_table, before) and len(placement) == len(live)
        by_spans.place(torch.tensor([p for _, p in live]), torch.tensor([s for s, _ in live]), torch.tensor(placement))
        assert torch.equal(by_spans.cell_table, direct.cell_table)
    sequence = new_cache(cfg, LAYOUT_SEQUENCE)
    assert not sequence.placement_input
    assert sequence.declare_rows([0, 1], [0, 0], defer=True) is None
    assert sequence.declare_spans([(0, 2, 2)], defer=True) is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_draft_attention_reads_only_the_context_the_anchors_have_and_answers_as_over_the_static_span(layout):
    """`DraftOps.attend` on the CPU gathers no more context rows than the batch's furthest anchor has; its answer
    equals the reference over the cache's whole static span (the extra rows are masked there), on a ring layer
    whose window is shorter than the context and on a flat one, with anchors 0, inside and past the window."""
    from mg.kernels.draft_attention_ref import draft_attend_ref, draft_context_span
    from mg.runtime.draft_ops import DraftOps

    cfg = tiny_cfg(window=4)
    cache = new_cache(cfg, layout)
    cache.reserve()
    ops = DraftOps(cache)
    g = torch.Generator().manual_seed(5)
    lengths = {0: 11, 2: 3}
    for slot, length in lengths.items():
        for start in range(0, length, 8):  # steps of at most max_write rows
            pos = list(range(start, min(length, start + 8)))
            cache.declare_rows(pos, [slot] * len(pos))
            for layer in range(cfg.n_layers):
                k, v = (torch.randn(len(pos), cfg.n_kv_heads, cfg.head_dim, generator=g) for _ in range(2))
                ops.append(k, v, torch.tensor(pos), torch.full((len(pos),), slot), layer)
    gathered = []
    real_gather = cache.gather
    cache.gather = lambda layer, key_pos, slots: gathered.append(key_pos.shape[1]) or real_gather(layer, key_pos, slots)
    t = 4
    positions = torch.tensor([11, 0, 3])[:, None] + torch.arange(t)[None, :]
    slots = torch.tensor([0, 1, 2])
    for layer in (RING, FLAT):
        q = torch.randn(3, t, cfg.n_heads, cfg.head_dim, generator=g)
        k, v = (torch.randn(3, t, cfg.n_kv_heads, cfg.head_dim, generator=g) for _ in range(2))
        got = ops.attend(q, k, v, positions, slots, layer, SCALE)
        window = cfg.window(layer)
        span = min(window, cache.max_span(layer)) if window else cache.max_span(layer)
        key_pos, valid = draft_context_span(positions[:, 0], window, span)
        ctx_k, ctx_v = real_gather(layer, key_pos, slots)
        torch.testing.assert_close(got, draft_attend_ref(q, k, v, ctx_k, ctx_v, valid, SCALE), atol=1e-6, rtol=1e-6)
    assert gathered == [4, 11]  # the ring layer's window; the flat layer's furthest anchor
