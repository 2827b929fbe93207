"""The drafter's side of export: method wrappers, its cache spec, constants, manifest facts and method specs.

Two methods, both calling the `mg::` draft ops so the graph holds no KV:
`draft_append(hidden[M, taps*dim], positions[M], seq_slots[M]) -> ack[M]` and
`draft_block(tokens[B, T], positions[B, T], seq_slots[B]) -> logits[B, T-1, V]`.
`draft_block` holds the target's `tok_embeddings` and `output` modules under
the same names as the target's `forward` (`model.tok_embeddings.weight`,
`model.output.weight`), so `model.ptd` stores them once for all methods. Knows nothing about the runtime.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.export import Dim

import mg.kernels  # noqa: F401  (registers mg:: ops)
from mg.manifests.values import draft_constant_values
from mg.manifests import DraftFacts, KVLayer, KVSpec, MethodSpec, TensorSpec, constants as C

from .checkpoint import expected_shapes, load_config
from .config import ConfigError, MuseGlimmerConfig
from .draft_model import DRAFT_PRESETS, DFlashConfig, DFlashDraft
from .lower import export_lifted, meta_parameters
from .weights import RandomWeights, SafetensorsWeights, WeightSource
from .model import MuseGlimmer


class DraftAppendMethod(nn.Module):
    """The `draft_append` method: committed rows' target hidden -> context K/V of every layer into the draft cache."""

    def __init__(self, draft: DFlashDraft):
        super().__init__()
        self.draft = draft

    def forward(self, hidden, positions, seq_slots):
        return self.draft.append(hidden, positions, seq_slots, torch.ops.mg.draft_append.default)


class _TargetShared(nn.Module):
    """The target's embedding table and LM head, under the target's own parameter names."""

    def __init__(self, target: MuseGlimmer):
        super().__init__()
        self.tok_embeddings = target.tok_embeddings
        self.output = target.output


class DraftBlockMethod(nn.Module):
    """The `draft_block` method: [anchor, MASK, ...] rows of B sequences -> proposal logits [B, T-1, V]."""

    def __init__(self, draft: DFlashDraft, target: MuseGlimmer):
        super().__init__()
        self.draft = draft
        self.model = _TargetShared(target)  # same FQNs as TargetForward.model.*

    def forward(self, tokens, positions, seq_slots):
        rows = self.draft.block_rows(tokens, positions, seq_slots, self.model.tok_embeddings.weight,
                                     torch.ops.mg.draft_attend.default)  # [B, T-1, dim], a slice of the block
        # The target's head module (a quantized one when the head is) over all B * (T-1) rows as one 2-D product:
        # on the 3-D slice, matmul would make a batched product that reads the head once per sequence.
        logits = self.model.output(rows.reshape(-1, rows.shape[-1]))
        return logits.view(rows.shape[0], rows.shape[1], -1).float()


def draft_max_seqs(kv: KVSpec) -> int:
    """Sequence slots of the draft cache (the bound on B of `draft_block`): `KVSpec.max_active_seqs`."""
    return kv.max_active_seqs


def draft_kv_spec(dcfg: DFlashConfig, target_kv: KVSpec) -> KVSpec:
    """The draft context cache: the target's layout, slot/cell limits, capacity, max_write and dtype;
    one layer per draft layer, ring when the drafter has a sliding window, else flat."""
    window = dcfg.sliding_window
    policy = C.POLICY_RING if window > 0 else C.POLICY_FLAT
    layers = tuple(KVLayer(layer_id=i, policy=policy, window=window, n_kv_heads=dcfg.n_kv_heads,
                           head_dim=dcfg.head_dim) for i in range(dcfg.n_layers))
    return dataclasses.replace(target_kv, layers=layers)


def draft_constants(dcfg: DFlashConfig, draft_kv: KVSpec) -> dict:
    return draft_constant_values(draft_facts(dcfg, draft_kv))


def draft_facts(dcfg: DFlashConfig, draft_kv: KVSpec) -> DraftFacts:
    return DraftFacts(block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                      target_layers=tuple(dcfg.target_layers), n_layers=dcfg.n_layers, kv=draft_kv)


def draft_append_method(dcfg: DFlashConfig, target: MuseGlimmerConfig, draft_kv: KVSpec) -> MethodSpec:
    return MethodSpec(
        name=C.METHOD_DRAFT_APPEND,
        inputs=(TensorSpec("hidden", "target residual entering each tapped layer, committed rows", draft_kv.dtype,
                           ("M", len(dcfg.target_layers) * target.dim)),
                TensorSpec("positions", "position of each row in its sequence", "int64", ("M",)),
                TensorSpec("seq_slots", "sequence slot of each row (max_seqs = scratch)", "int64", ("M",))),
        outputs=(TensorSpec("ack", "data dependency on every layer's append; ignore the values", "float32",
                            ("M",)),),
        bounds={"M": (1, draft_kv.max_write)},
    )


def draft_block_method(dcfg: DFlashConfig, target: MuseGlimmerConfig, draft_kv: KVSpec) -> MethodSpec:
    t = dcfg.block_size
    return MethodSpec(
        name=C.METHOD_DRAFT_BLOCK,
        inputs=(TensorSpec("tokens", "[anchor, MASK, ...] per sequence", "int64", ("B", t)),
                TensorSpec("positions", "anchor_pos + 0 .. T-1; context is positions < anchor_pos", "int64",
                           ("B", t)),
                TensorSpec("seq_slots", "draft cache slot of each sequence (max_seqs = scratch)", "int64", ("B",))),
        outputs=(TensorSpec("logits", "proposal logits for positions anchor_pos + 1 .. anchor_pos + T-1",
                            "float32", ("B", t - 1, target.vocab_size)),),
        bounds={"B": (1, draft_max_seqs(draft_kv))},
    )


def draft_methods(dcfg: DFlashConfig, target: MuseGlimmerConfig, draft_kv: KVSpec) -> tuple[MethodSpec, ...]:
    return draft_append_method(dcfg, target, draft_kv), draft_block_method(dcfg, target, draft_kv)


def export_draft(draft: DFlashDraft, target: MuseGlimmer, draft_kv: KVSpec) -> dict:
    """Trace both draft methods under the bounds `draft_methods` declares: M in [1, max_write];
    B in [1, draft_max_seqs] (static 1 when that is 1); T = block_size static. -> {method name: LiftedMethod}."""
    max_write, max_seqs = draft_kv.max_write, draft_max_seqs(draft_kv)
    if max_write < 2:
        raise ValueError(f"max_write is {max_write}; allowed: an integer >= 2")
    cfg, dtype = draft.cfg, draft.hidden_norm.weight.dtype  # (fc may be quantized: the norm is float)
    m = Dim("n_rows", min=1, max=max_write)
    hidden = torch.zeros(2, draft.fc.in_features, dtype=dtype)
    append_args = (hidden, torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long))
    b_ex = 2 if max_seqs >= 2 else 1
    b = Dim("n_seqs", min=1, max=max_seqs) if max_seqs >= 2 else None
    tokens = torch.full((b_ex, cfg.block_size), cfg.mask_token_id, dtype=torch.long)
    positions = torch.arange(cfg.block_size).repeat(b_ex, 1)
    block_args = (tokens, positions, torch.arange(b_ex))
    append = export_lifted(DraftAppendMethod(draft), append_args, ({0: m}, {0: m}, {0: m}))
    block = export_lifted(DraftBlockMethod(draft, target), block_args, ({0: b}, {0: b}, {0: b}))
    return {C.METHOD_DRAFT_APPEND: append, C.METHOD_DRAFT_BLOCK: block}


@dataclass(frozen=True)
class DraftSource:
    name: str
    cfg: DFlashConfig
    weights: WeightSource  # by the drafter's parameter names


def load_draft(checkpoint: Optional[Path], preset: Optional[str], target: MuseGlimmerConfig,
               seed: int = 0) -> DraftSource:
    """A drafter for `target` from a native checkpoint directory (weights read when the export writes them), or
    a random-weight preset. A preset's tapped layers that do not fit a shortened target are spread over the
    target's layers in the same proportions."""
    if checkpoint is not None:
        cfg = load_config(checkpoint, DFlashConfig)
        shapes = expected_shapes(_checked(cfg, target, str(Path(checkpoint) / "config.json")))
        weights = SafetensorsWeights(checkpoint)
        weights.check(shapes)
        return DraftSource(Path(checkpoint).resolve().name, cfg, weights)
    if preset not in DRAFT_PRESETS:
        raise ConfigError(f"--draft-preset is {preset!r}; allowed: {' | '.join(DRAFT_PRESETS)}")
    cfg = DRAFT_PRESETS[preset]
    if cfg.target_layers[-1] >= target.n_layers:
        span = cfg.target_layers[-1] + 2  # the depth the preset's taps were laid out for
        taps = sorted({min(target.n_layers - 1, round(t * target.n_layers / span)) for t in cfg.target_layers})
        cfg = dataclasses.replace(cfg, target_layers=tuple(taps))
    _checked(cfg, target, f"--draft-preset {preset}")
    return DraftSource(f"preset-{preset}", cfg, RandomWeights(seed))


def _checked(cfg: DFlashConfig, target: MuseGlimmerConfig, source: str) -> DFlashDraft:
    try:
        with meta_parameters():
            return DFlashDraft(cfg, target)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e} (drafter does not fit the target)") from None
