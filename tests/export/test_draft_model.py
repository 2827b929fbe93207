"""Claims about the DFlash drafter: the cached path equals the no-cache reference, the block is non-causal
and position-aware, checkpoints round-trip, and the draft methods lower beside the target's forward with
the shared embedding and LM head stored once."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from mg.export.checkpoint import WEIGHTS_FILE, CheckpointError, load_config, load_state, save_checkpoint
from mg.export.weights import materialize
from mg.export.config import TINY, ConfigError, config_from_dict
from mg.export.draft_lower import (
    draft_constants, draft_facts, draft_kv_spec, draft_max_seqs, draft_methods, export_draft, load_draft,
)
from mg.export.draft_model import DRAFT_PRESETS, DFlashConfig, DFlashDraft, rope_neox
from mg.export.draft_reference import ReferenceDraftKV, draft_block_ref
from mg.export.lower import ProgramParts, export_target, target_constants, to_program
from mg.export.model import MuseGlimmer, init_random, rope_inv_freq
from mg.export.reference import dense_attend
from mg.manifests import KVLayer, KVSpec, constants as C

DCFG = DRAFT_PRESETS["tiny"]


@pytest.fixture(scope="module")
def target(tiny_model) -> MuseGlimmer:
    return tiny_model


def make_draft(cfg: DFlashConfig = DCFG, target_cfg=TINY, seed: int = 1) -> DFlashDraft:
    return init_random(DFlashDraft(cfg, target_cfg), seed).eval()


@torch.no_grad()
def target_hidden(target: MuseGlimmer, tokens: torch.Tensor, taps) -> torch.Tensor:
    n = tokens.shape[0]
    _, hidden = target(tokens, torch.arange(n), torch.zeros(n, dtype=torch.long), torch.tensor([n - 1]),
                       dense_attend(target.cfg), taps)
    return hidden


def block_tokens(cfg: DFlashConfig, anchors: list[int]) -> torch.Tensor:
    tokens = torch.full((len(anchors), cfg.block_size), cfg.mask_token_id, dtype=torch.long)
    tokens[:, 0] = torch.tensor(anchors)
    return tokens


@torch.no_grad()
def cached_logits(draft, target, store, tokens, anchor_pos: list[int], slots: list[int]) -> torch.Tensor:
    positions = torch.tensor(anchor_pos)[:, None] + torch.arange(tokens.shape[1])
    return draft.block_logits(tokens, positions, torch.tensor(slots), target.tok_embeddings.weight,
                              target.output.weight, store.attend)


# ----------------------------------------------------------------------------- cached == reference


@pytest.mark.parametrize("window", [0, 4])
def test_cached_drafting_matches_no_cache_reference(target, window):
    cfg = dataclasses.replace(DCFG, sliding_window=window)
    draft = make_draft(cfg)
    gen = torch.Generator().manual_seed(0)
    seqs = {3: torch.randint(4, TINY.vocab_size, (11,), generator=gen),  # slot -> committed tokens
            0: torch.randint(4, TINY.vocab_size, (6,), generator=gen)}
    hidden = {s: target_hidden(target, toks, cfg.target_layers) for s, toks in seqs.items()}
    rows = torch.cat(list(hidden.values()))
    positions = torch.cat([torch.arange(len(t)) for t in seqs.values()])
    slots = torch.cat([torch.full((len(t),), s) for s, t in seqs.items()])
    store = ReferenceDraftKV(cfg)
    with torch.no_grad():
        for lo in range(0, rows.shape[0], 5):  # packed chunks that straddle the two sequences
            draft.append(rows[lo:lo + 5], positions[lo:lo + 5], slots[lo:lo + 5], store.append)
    # slot 3 drafts from its pending token (anchor = length); slot 0 from position 4, leaving rows 4, 5 unread.
    anchors, anchor_pos = [7, 9], [11, 4]
    got = cached_logits(draft, target, store, block_tokens(cfg, anchors), anchor_pos, [3, 0])
    for b, slot in enumerate([3, 0]):
        want = draft_block_ref(draft, target.tok_embeddings.weight, target.output.weight, hidden[slot],
                               torch.arange(len(seqs[slot])), anchors[b], anchor_pos[b])
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)


def test_block_without_context_reads_only_its_own_rows(target):
    draft = make_draft()
    got = cached_logits(draft, target, ReferenceDraftKV(DCFG), block_tokens(DCFG, [5]), [0], [0])
    want = draft_block_ref(draft, target.tok_embeddings.weight, target.output.weight,
                           torch.zeros(0, 3 * TINY.dim), torch.zeros(0, dtype=torch.long), 5, 0)
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- block semantics


@pytest.fixture(scope="module")
def filled(target):
    """A drafter and a store holding 9 committed rows of slot 0."""
    draft = make_draft()
    toks = torch.randint(4, TINY.vocab_size, (9,), generator=torch.Generator().manual_seed(2))
    store = ReferenceDraftKV(DCFG)
    with torch.no_grad():
        draft.append(target_hidden(target, toks, DCFG.target_layers), torch.arange(9),
                     torch.zeros(9, dtype=torch.long), store.append)
    return draft, store


def test_changing_a_later_mask_row_changes_earlier_rows(target, filled):
    draft, store = filled
    tokens = block_tokens(DCFG, [7])
    base = cached_logits(draft, target, store, tokens, [9], [0])
    tokens[0, -1] = 11  # the last row (proposal for anchor_pos + T - 1 comes from it; rows 1.. read it)
    changed = cached_logits(draft, target, store, tokens, [9], [0])
    assert not torch.allclose(base[0, 0], changed[0, 0], atol=1e-4)


def test_mask_rows_differ_only_by_position_and_their_logits_differ(target, filled):
    draft, store = filled
    logits = cached_logits(draft, target, store, block_tokens(DCFG, [7]), [9], [0])[0]
    for i in range(1, logits.shape[0]):
        assert not torch.allclose(logits[0], logits[i], atol=1e-4), f"rows 1 and {i + 1} match"


def test_rope_is_half_split_neox():
    """x * cos + rotate_half(x) * sin with cos/sin of [freqs, freqs] (the NEOX / HF form), not adjacent pairs."""
    x, pos = torch.randn(3, 2, 16), torch.tensor([0, 5, 1234])
    inv_freq = rope_inv_freq(16, 10000.0)
    freqs = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)[:, None, :]
    rotate_half = torch.cat([-x[..., 8:], x[..., :8]], dim=-1)
    torch.testing.assert_close(rope_neox(x, pos, inv_freq), x * freqs.cos() + rotate_half * freqs.sin())


def test_uniform_position_shift_leaves_logits_unchanged(target):
    """RoPE sees only position differences, so shifting context and block together changes nothing."""
    draft = make_draft()
    hidden = target_hidden(target, torch.arange(4, 12), DCFG.target_layers)
    args = (draft, target.tok_embeddings.weight, target.output.weight, hidden)
    base = draft_block_ref(*args, torch.arange(8), 6, 8)
    shifted = draft_block_ref(*args, torch.arange(8) + 37, 6, 45)
    torch.testing.assert_close(base, shifted, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- config and checkpoint


def test_config_json_round_trip_and_absent_sliding_window_means_none():
    data = DCFG.to_json_dict()
    assert config_from_dict(DFlashConfig, data, "config.json") == DCFG
    del data["sliding_window"]
    assert config_from_dict(DFlashConfig, data, "config.json").sliding_window == 0


@pytest.mark.parametrize("field,value", [("block_size", 1), ("target_layers", [3, 1]), ("target_layers", []),
                                         ("n_heads", 3), ("sliding_window", -1)])
def test_bad_config_field_is_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        config_from_dict(DFlashConfig, {**DCFG.to_json_dict(), field: value}, "config.json")


@pytest.mark.parametrize("field,value", [("target_layers", (1, 6)), ("mask_token_id", 512)])
def test_drafter_that_does_not_fit_the_target_is_refused(field, value):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        DFlashDraft(dataclasses.replace(DCFG, **{field: value}), TINY)


def test_checkpoint_round_trip_gives_identical_logits(target, filled, tmp_path):
    draft, store = filled
    save_checkpoint(tmp_path, DCFG, draft)
    loaded = load_draft(tmp_path, None, TINY)
    assert loaded.cfg == DCFG
    tokens = block_tokens(DCFG, [7])
    model = materialize(loaded.weights, DFlashDraft(loaded.cfg, TINY)).eval()
    assert torch.equal(cached_logits(model, target, store, tokens, [9], [0]),
                       cached_logits(draft, target, store, tokens, [9], [0]))


@pytest.mark.parametrize("name,change", [("layers.1.attn.k_norm.weight", "drop"), ("fc.weight", "reshape")])
def test_missing_or_misshapen_tensor_is_refused_by_name(filled, tmp_path, name, change):
    draft, _ = filled
    save_checkpoint(tmp_path, DCFG, draft)
    tensors = load_file(str(tmp_path / WEIGHTS_FILE))
    if change == "drop":
        del tensors[name]
    else:
        tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(tmp_path / WEIGHTS_FILE))
    fresh = DFlashDraft(load_config(tmp_path, DFlashConfig), TINY)
    with pytest.raises(CheckpointError, match=f"'{name}'"):
        load_state(tmp_path, fresh)


def test_n_params_counts_the_module():
    draft = DFlashDraft(DCFG, TINY)
    assert DCFG.n_params(TINY.dim) == sum(p.numel() for p in draft.parameters())


def test_unknown_draft_preset_is_refused():
    with pytest.raises(ConfigError, match="--draft-preset"):
        load_draft(None, "huge", TINY)


# ----------------------------------------------------------------------------- cache spec and constants


def kv_spec(layout: str) -> KVSpec:
    layers = tuple(KVLayer(i, C.POLICY_FLAT, 0, 2, 16) for i in range(TINY.n_layers))
    seqs, cells = (4, None) if layout == C.LAYOUT_SEQUENCE else (None, 40)
    return KVSpec(layout, seqs, cells, capacity=64, max_write=16, dtype="float32", layers=layers)


@pytest.mark.parametrize("layout,max_seqs", [(C.LAYOUT_SEQUENCE, 4), (C.LAYOUT_CELL, 16)])
def test_draft_cache_follows_the_target_cache(layout, max_seqs):
    tkv = kv_spec(layout)
    dkv = draft_kv_spec(dataclasses.replace(DCFG, sliding_window=4), tkv)
    dkv.check("draft.kv")
    assert (dkv.layout, dkv.max_seqs, dkv.max_cells, dkv.capacity, dkv.max_write) == \
        (tkv.layout, tkv.max_seqs, tkv.max_cells, tkv.capacity, tkv.max_write)
    assert [(layer.policy, layer.window) for layer in dkv.layers] == [(C.POLICY_RING, 4)] * DCFG.n_layers
    assert draft_max_seqs(dkv) == max_seqs
    consts = draft_constants(DCFG, dkv)
    assert consts[C.GET_DRAFT_OFFGRAPH_KV_MAX_SEQS] == max_seqs
    assert (consts[C.GET_BLOCK_SIZE], consts[C.GET_MASK_TOKEN_ID], consts[C.GET_N_TARGET_LAYERS]) == (8, 3, 3)
    draft_facts(DCFG, dkv).check("draft")
    for spec in draft_methods(DCFG, TINY, dkv):
        spec.check(f"methods.{spec.name}")


# ----------------------------------------------------------------------------- lowering (exported once)

# A 2-layer target (one ring layer, one flat) keeps to_edge of the target forward short on CPU;
# what is claimed here (methods present, ops kept, shared weights stored once) does not depend on depth.
LOWER_TARGET = dataclasses.replace(TINY, n_layers=2)
LOWER_DRAFT = dataclasses.replace(DCFG, target_layers=(0, 1))


@pytest.fixture(scope="module")
def lowered():
    from executorch.exir._serialize._program import deserialize_pte_binary

    target = init_random(MuseGlimmer(LOWER_TARGET), 0).eval()
    draft = make_draft(LOWER_DRAFT, LOWER_TARGET)
    tkv = kv_spec(C.LAYOUT_SEQUENCE)
    tkv = dataclasses.replace(tkv, layers=tkv.layers[:2])
    dkv = draft_kv_spec(LOWER_DRAFT, tkv)
    methods = {C.METHOD_FORWARD: export_target(target, tkv.max_write, LOWER_DRAFT.target_layers),
               **export_draft(draft, target, dkv)}
    constants = {**target_constants(LOWER_TARGET, tkv), **draft_constants(LOWER_DRAFT, dkv)}
    buffer, external = to_program(ProgramParts(methods, constants))
    pte = deserialize_pte_binary(buffer)
    return external, getattr(pte, "program", pte)


def plan(program, name: str):
    (found,) = [p for p in program.execution_plan if p.name == name]
    return found


def op_calls(plan_, op: str) -> int:
    names = [o.name for o in plan_.operators]
    calls = [i.instr_args for i in plan_.chains[0].instructions if type(i.instr_args).__name__ == "KernelCall"]
    return sum(names[c.op_index] == op for c in calls)


@pytest.mark.slow
def test_program_holds_target_and_draft_methods_with_their_ops(lowered):
    _, program = lowered
    names = {p.name for p in program.execution_plan}
    assert {C.METHOD_FORWARD, C.METHOD_DRAFT_APPEND, C.METHOD_DRAFT_BLOCK, C.GET_BLOCK_SIZE} <= names
    assert op_calls(plan(program, C.METHOD_DRAFT_BLOCK), "mg::draft_attend") == LOWER_DRAFT.n_layers
    # The head is one 2-D product over every sequence's rows, not a batched one that reads it once per sequence.
    assert op_calls(plan(program, C.METHOD_DRAFT_BLOCK), "aten::bmm") == 0


@pytest.mark.slow
def test_draft_append_keeps_every_layers_append(lowered):
    _, program = lowered
    assert op_calls(plan(program, C.METHOD_DRAFT_APPEND), "mg::draft_append") == LOWER_DRAFT.n_layers


@pytest.mark.slow
def test_shared_embedding_and_head_are_stored_once_and_used_by_both_methods(lowered):
    external, program = lowered

    def names(method):
        return [v.val.extra_tensor_info.fully_qualified_name for v in plan(program, method).values
                if type(v.val).__name__ == "Tensor" and v.val.extra_tensor_info is not None]

    assert all(len(program.constant_buffer[i].storage) < 64 for i in range(len(program.constant_buffer)))
    for key in ("model.tok_embeddings.weight", "model.output.weight"):
        assert key in external  # one model.ptd entry
        for method in (C.METHOD_FORWARD, C.METHOD_DRAFT_BLOCK):
            assert names(method).count(key) == 1, f"{method} does not read {key} once"
    assert not [k for k in names(C.METHOD_DRAFT_APPEND) if k.startswith("model.")]
