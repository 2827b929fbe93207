"""Eager MG model equivalences: cache vs full sequence, fused vs split projections, ring wrap, layer pattern."""

from __future__ import annotations

import pytest
import torch

from mg.export.config import PRESETS, MuseGlimmerConfig
from mg.export.model import MuseGlimmer, init_random, rms_norm_noweight, rope_interleaved, rope_tables
from mg.export.reference import ReferenceKV, dense_attend


def _full_logits(model, tokens):
    n = len(tokens)
    logits, _ = model(torch.tensor(tokens), torch.arange(n), torch.zeros(n, dtype=torch.long), torch.arange(n),
                      dense_attend(model.cfg))
    return logits


def _stepwise_logits(model, tokens, chunk=1):
    kv = ReferenceKV(model.cfg)
    rows = []
    for start in range(0, len(tokens), chunk):
        part = tokens[start:start + chunk]
        n = len(part)
        logits, _ = model(torch.tensor(part), torch.arange(start, start + n), torch.zeros(n, dtype=torch.long),
                          torch.arange(n), kv)
        rows.append(logits)
    return torch.cat(rows)


@torch.no_grad()
def test_one_token_at_a_time_equals_full_sequence(tiny_model):
    tokens = torch.randint(0, tiny_model.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    full = _full_logits(tiny_model, tokens)
    torch.testing.assert_close(_stepwise_logits(tiny_model, tokens, chunk=1), full, atol=1e-4, rtol=0)
    torch.testing.assert_close(_stepwise_logits(tiny_model, tokens, chunk=7), full, atol=1e-4, rtol=0)


@torch.no_grad()
def test_ring_layers_wrap_on_prompts_longer_than_window(tiny_model):
    cfg = tiny_model.cfg
    n = 4 * cfg.sliding_window + 3
    tokens = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(2)).tolist()
    full = _full_logits(tiny_model, tokens)
    torch.testing.assert_close(_stepwise_logits(tiny_model, tokens, chunk=5), full, atol=1e-4, rtol=0)
    # The window really limits ring layers: with every layer global the late logits differ.
    unwindowed = MuseGlimmer(MuseGlimmerConfig(**{**cfg.to_json_dict(), "eos_ids": tuple(cfg.eos_ids),
                                                  "sliding_window": 10 * n}))
    unwindowed.load_state_dict(tiny_model.state_dict())
    assert not torch.allclose(_full_logits(unwindowed.eval(), tokens)[-1], full[-1], atol=1e-3)


@torch.no_grad()
def test_fused_projection_matches_separate_projections(tiny_model):
    attn = tiny_model.layers[0].attn
    cfg = tiny_model.cfg
    x = torch.randn(5, cfg.dim, generator=torch.Generator().manual_seed(3))
    hq, hkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    w = attn.qkvg_proj.weight
    wq, wk, wv, wg = w[:hq], w[hq:hq + hkv], w[hq + hkv:hq + 2 * hkv], w[hq + 2 * hkv:]
    q, k, v, g = attn.qkvg_proj(x).split(attn.split_sizes(), dim=-1)
    for fused, part in ((q, wq), (k, wk), (v, wv), (g, wg)):
        torch.testing.assert_close(fused, x @ part.T, atol=1e-5, rtol=1e-5)
    up = tiny_model.layers[0].ffn
    gate, upv = up.gate_up_proj(x).split(cfg.ffn_dim, dim=-1)
    torch.testing.assert_close(gate, x @ up.gate_up_proj.weight[:cfg.ffn_dim].T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(upv, x @ up.gate_up_proj.weight[cfg.ffn_dim:].T, atol=1e-5, rtol=1e-5)


def test_layer_pattern_of_the_30b_model():
    cfg = PRESETS["mg-30b"]
    global_layers = [i for i in range(cfg.n_layers) if cfg.is_global(i)]
    assert len(global_layers) == 13 and cfg.n_layers - len(global_layers) == 39
    assert global_layers[-1] == cfg.n_layers - 1  # the last layer is global (NoPE)
    assert cfg.window(0) == 2048 and cfg.window(51) == 0
    assert cfg.attn_scale == pytest.approx((43.7840518911 / 128 ** 0.5) / 128 ** 0.5)


def test_tiny_preset_has_ring_and_flat_layers(tiny_cfg):
    flags = [tiny_cfg.is_global(i) for i in range(tiny_cfg.n_layers)]
    assert any(flags) and not all(flags)


@torch.no_grad()
def test_nope_layers_ignore_rope_and_rope_layers_use_it(tiny_model):
    cfg = tiny_model.cfg
    assert [layer.attn.use_rope for layer in tiny_model.layers] == [not cfg.is_global(i) for i in range(cfg.n_layers)]


def test_rope_rotates_adjacent_pairs():
    x = torch.tensor([[[1.0, 0.0, 0.0, 1.0]]])
    inv = torch.tensor([1.0, 0.5])
    out = rope_interleaved(x, torch.tensor([1]), inv)
    import math
    expect = torch.tensor([[[math.cos(1), math.sin(1), -math.sin(0.5), math.cos(0.5)]]])
    torch.testing.assert_close(out, expect)


def test_logits_are_soft_capped_fp32(tiny_model):
    x = 1e3 * torch.randn(3, tiny_model.cfg.dim)
    logits = tiny_model.logits(x)
    assert logits.dtype == torch.float32
    assert logits.abs().max() <= tiny_model.cfg.output_soft_cap


def test_embedding_is_normalised(tiny_model):
    e = tiny_model.embed(torch.tensor([5, 7]))
    torch.testing.assert_close(e, rms_norm_noweight(tiny_model.tok_embeddings.weight[[5, 7]], 1e-5))
    assert torch.allclose(e.pow(2).mean(-1), torch.ones(2), atol=1e-3)


@torch.no_grad()
@pytest.mark.parametrize("layer_id", [0, 1])  # TINY: layer 0 is a RoPE ring layer, layer 1 a NoPE global one
def test_joint_q_k_norm_and_rotation_equal_separate_ones(tiny_model, layer_id):
    """The layer normalises and rotates q and k as one tensor, with RoPE tables computed once per forward;
    the attend backend must receive what per-tensor norms and rotations from the positions give."""
    attn, cfg = tiny_model.layers[layer_id].attn, tiny_model.cfg
    assert attn.use_rope == (not cfg.is_global(layer_id))
    x = torch.randn(6, cfg.dim, generator=torch.Generator().manual_seed(5))
    positions = torch.tensor([0, 1, 2, 40, 41, 7])
    seen = {}

    def attend(q, k, v, pos, slots, lid, scale):
        seen.update(q=q, k=k, v=v)
        return q

    tables = rope_tables(positions, attn.inv_freq)
    attn(x, positions, torch.zeros(6, dtype=torch.long), attend, tables)
    q, k, v, _ = attn.qkvg_proj(x).split(attn.split_sizes(), dim=-1)
    q = rms_norm_noweight(q.unflatten(-1, (cfg.n_heads, cfg.head_dim)), cfg.norm_eps)
    k = rms_norm_noweight(k.unflatten(-1, (cfg.n_kv_heads, cfg.head_dim)), cfg.norm_eps)
    if attn.use_rope:
        q, k = rope_interleaved(q, positions, attn.inv_freq), rope_interleaved(k, positions, attn.inv_freq)
    torch.testing.assert_close(seen["q"], q, atol=0, rtol=0)
    torch.testing.assert_close(seen["k"], k, atol=0, rtol=0)
    torch.testing.assert_close(seen["v"], v.unflatten(-1, (cfg.n_kv_heads, cfg.head_dim)), atol=0, rtol=0)
