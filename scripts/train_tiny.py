#!/usr/bin/env python3
"""Train the embedded default: a tiny MG target and its DFlash drafter on the Python standard library.

Phases (each timed and printed): read every `*.py` of the running interpreter's stdlib (sorted; dirs named
site-packages, dist-packages, test, tests, idle_test and __pycache__ skipped; files that are not UTF-8
skipped) and hold out a fixed fraction of files by a sha256 of their relative path; train a byte-level BPE
tokenizer on the training files (ids 0-3 are <pad> <bos> <eos> <mask>); train the MG target
(`mg.export.model.MuseGlimmer`) on windows of the token stream (each file is `<bos> text <eos>`); let the
frozen target continue many training prompts greedily (rollouts) and train the DFlash drafter on those
continuations, since under greedy verification a draft counts only where it agrees with the target; measure
held-out perplexity and the drafter's acceptance length on held-out prompts (the DFlash loop replayed on the
target's greedy text) and on held-out windows; write native checkpoints (`target/` with tokenizer.json,
`draft/`) and `train_report.{json,md}`.

Reproducible: fixed seeds, sorted files, a seeded batch order and deterministic torch algorithms. Training
phases run a fixed number of steps; `--time-budget-s` stops them early by wall time (the report says so).
`--keep-best` keeps the target weights of its lowest held-out probe loss instead of the last ones.

    python scripts/train_tiny.py --out out/embedded --check-repro    # the shipped default: one H200, 338 s
    python scripts/train_tiny.py --out /tmp/smoke --smoke                                # CPU, toy scale

Knows the model only through mg.export (model, drafter, checkpoint format); knows nothing about
ExecuTorch or the runtime.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

SPECIALS = ("<pad>", "<bos>", "<eos>", "<mask>")  # ids 0, 1, 2, 3
PAD_ID, BOS_ID, EOS_ID, MASK_ID = range(4)
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
TARGET_STOP_FRACTION, DRAFT_STOP_FRACTION = 0.50, 0.82  # of --time-budget-s: when each training phase stops


def _ensure_mg_importable() -> None:
    """Map the checkout's folders into the `mg` namespace when the package is not installed (as
    scripts/gpu_checks.sh does), so the script runs from a bare checkout on the GPU machine."""
    try:
        import mg.export  # noqa: F401
        return
    except ImportError:
        pass
    root = Path(__file__).resolve().parent.parent
    ns = Path(tempfile.mkdtemp(prefix="mg-ns-")) / "mg"
    ns.mkdir()
    for pkg in ("export", "kernels", "manifests", "runtime"):
        (ns / pkg).symlink_to(root / pkg)
    sys.path.insert(0, str(ns.parent))


_ensure_mg_importable()

from mg.export.checkpoint import load_config, load_state, save_checkpoint  # noqa: E402
from mg.export.config import MuseGlimmerConfig  # noqa: E402
from mg.export.draft_model import DFlashConfig, DFlashDraft, DraftLayer  # noqa: E402
from mg.export.model import MuseGlimmer  # noqa: E402


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    out: str
    smoke: bool = False
    device: str = "cpu"
    seed: int = 1234               # target init; +1 target order, +2 draft init, +3 draft order, +4 anchors, +5 rollouts
    vocab_size: int = 4096
    seq_len: int = 512             # tokens per training window (the model sees seq_len, predicts seq_len)
    heldout_fraction: float = 0.05
    max_corpus_bytes: int = 0      # 0: the whole corpus; else keep sorted files up to this many bytes
    target_steps: int = 800        # ~5 epochs of the 3.12 stdlib (the shipped default was trained with this)
    keep_best: bool = False        # keep the target weights of the evaluation step with the lowest held-out loss
    target_batch: int = 32
    target_lr: float = 2e-3
    draft_layers: int = 3
    draft_ffn_dim: int = 768
    draft_kd: float = 0.5          # weight of the soft-label term (cross-entropy to the target's distribution)
    draft_steps: int = 5000
    draft_batch: int = 32
    draft_lr: float = 2e-3
    anchors_per_seq: int = 16
    rollouts: int = 65536          # the drafter's training text: the target's own greedy continuations ...
    rollout_len: int = 384         # ... of this many tokens in all (prompt + continuation) ...
    rollout_prompts: tuple[int, ...] = (16, 32, 64, 128, 192)  # ... after <bos> + a training window's first P - 1
    rollout_batch: int = 2048      # sequences generated at once
    eval_prompt_count: int = 64    # held-out prompts (heldout_prompts; repeated texts kept) for the loop eval
    eval_new_tokens: int = 64      # greedy tokens generated per held-out prompt
    warmup_steps: int = 60
    weight_decay: float = 0.1
    log_every: int = 50
    eval_every: int = 100          # held-out loss during target training, on `probe_chunks` spread-out windows
    probe_chunks: int = 128
    eval_max_chunks: int = 2048    # held-out windows for the final perplexity (all of them on the stdlib)
    accept_chunks: int = 128       # held-out windows for the acceptance measurement
    accept_anchors: tuple[int, ...] = (32, 96, 160, 224, 288, 352, 416, 480)
    weights_dtype: str = "bfloat16"
    time_budget_s: Optional[float] = None
    check_repro: bool = False
    repro_steps: int = 20


SMOKE = dict(vocab_size=512, seq_len=128, max_corpus_bytes=1_200_000, target_steps=120, target_batch=8,
             target_lr=3e-3, draft_ffn_dim=128, draft_steps=80, draft_batch=8, draft_lr=3e-3, anchors_per_seq=4,
             warmup_steps=10,
             rollouts=64, rollout_len=96, rollout_prompts=(16, 40), rollout_batch=32, eval_prompt_count=6,
             eval_new_tokens=24,
             log_every=10, eval_every=40, probe_chunks=16, eval_max_chunks=32, accept_chunks=8,
             accept_anchors=(16, 48, 80, 104),
             repro_steps=5)


def target_config(s: Settings, vocab_size: int) -> MuseGlimmerConfig:
    """Layer i is global when (n_layers - i - 1) % 3 == 0: full scale has layers 2 and 5 global, 4 ring layers;
    smoke has layers 0 and 3 global, 2 ring layers."""
    common = dict(vocab_size=vocab_size, rope_theta=10000.0, every_n_layers_nope=3, bos_id=BOS_ID,
                  eos_ids=(EOS_ID,), dtype=s.weights_dtype)
    if s.smoke:
        return MuseGlimmerConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=192,
                                 sliding_window=16, **common)
    return MuseGlimmerConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, head_dim=64, ffn_dim=1152,
                             sliding_window=128, **common)


def draft_config(s: Settings, target: MuseGlimmerConfig) -> DFlashConfig:
    """`draft_layers` drafter layers at the target's dim and head shape; 3 taps spread over the target (entering
    layers 1, 3, 5 of 6)."""
    taps = tuple(sorted({round(1 + i * (target.n_layers - 2) / 2) for i in range(3)}))
    heads = dict(n_heads=4, n_kv_heads=2, head_dim=16) if s.smoke else dict(n_heads=6, n_kv_heads=2, head_dim=64)
    return DFlashConfig(n_layers=s.draft_layers, block_size=16, mask_token_id=MASK_ID, target_layers=taps,
                        rope_theta=10000.0, ffn_dim=s.draft_ffn_dim, **heads)


def parse_settings(argv: Optional[list[str]]) -> Settings:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output directory (target/, draft/, train_report.*)")
    p.add_argument("--smoke", action="store_true", help="toy scale on CPU (about a minute)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--seed", type=int, default=Settings.seed)
    p.add_argument("--time-budget-s", type=float, default=None,
                   help=f"wall-clock budget: target training stops at {TARGET_STOP_FRACTION:.0%} of it, drafter "
                        f"training at {DRAFT_STOP_FRACTION:.0%} (default: no budget, step counts only)")
    p.add_argument("--check-repro", action="store_true",
                   help="re-read the corpus, re-train the tokenizer and the first target steps, and compare")
    p.add_argument("--target-steps", type=int, default=None)
    p.add_argument("--keep-best", action="store_true",
                   help="keep the target weights of the held-out-best evaluation step (it overfits past ~900 steps)")
    p.add_argument("--draft-steps", type=int, default=None)
    p.add_argument("--draft-layers", type=int, default=None)
    p.add_argument("--draft-ffn-dim", type=int, default=None)
    p.add_argument("--draft-kd", type=float, default=None,
                   help="weight in [0, 1] of the soft-label loss (cross-entropy to the target's next-token "
                        "distribution); the hard greedy labels get 1 - it")
    a = p.parse_args(argv)
    if a.draft_kd is not None and not 0.0 <= a.draft_kd <= 1.0:
        p.error(f"--draft-kd must lie in [0, 1], got {a.draft_kd}")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    s = Settings(out=a.out, device=device, seed=a.seed, time_budget_s=a.time_budget_s, check_repro=a.check_repro,
                 keep_best=a.keep_best, **(SMOKE if a.smoke else {}), smoke=a.smoke)
    overrides = {k: getattr(a, k) for k in ("target_steps", "draft_steps", "draft_layers", "draft_ffn_dim", "draft_kd")
                 if getattr(a, k) is not None}
    return dataclasses.replace(s, **overrides)


# ----------------------------------------------------------------------------- corpus and tokenizer


@dataclass
class Corpus:
    root: str
    train_files: list[str]          # relative posix paths, sorted
    heldout_files: list[str]
    train_texts: list[str]
    heldout_texts: list[str]
    skipped_not_utf8: list[str]

    def fingerprint(self) -> str:
        return _sha256("\n".join(self.train_files + ["--"] + self.heldout_files).encode())


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_heldout(rel: str, fraction: float) -> bool:
    """Stable split: the first 8 bytes of sha256(relative path) as a fraction of 2**64."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") / 2 ** 64 < fraction


def collect_corpus(fraction: float, max_bytes: int) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                  if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))
    corpus = Corpus(str(root), [], [], [], [], [])
    budget = {True: max_bytes * fraction, False: max_bytes * (1 - fraction)}
    for rel in rels:
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            corpus.skipped_not_utf8.append(rel)
            continue
        held = is_heldout(rel, fraction)
        if max_bytes:
            if budget[held] < len(text):
                continue
            budget[held] -= len(text)
        (corpus.heldout_files if held else corpus.train_files).append(rel)
        (corpus.heldout_texts if held else corpus.train_texts).append(text)
    return corpus


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (every byte is in the alphabet, so any text round-trips); specials get ids 0..3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    ids = [tok.token_to_id(t) for t in SPECIALS]
    assert ids == [PAD_ID, BOS_ID, EOS_ID, MASK_ID], f"special token ids {ids}, expected 0..3"
    tok.encode_special_tokens = True  # a literal "<eos>" in source text stays text (not saved in tokenizer.json)
    return tok


def round_trips(tok, texts: list[str]) -> int:
    """-> how many texts do NOT decode back to themselves."""
    encs = tok.encode_batch(texts, add_special_tokens=False)
    return sum(tok.decode(e.ids, skip_special_tokens=False) != t for e, t in zip(encs, texts))


def encode_stream(tok, texts: list[str]) -> torch.Tensor:
    """-> int64 [L]: every file as <bos> ids <eos>, concatenated in corpus order."""
    encs = tok.encode_batch(texts, add_special_tokens=False)
    parts = [torch.tensor([BOS_ID] + e.ids + [EOS_ID], dtype=torch.long) for e in encs]
    return torch.cat(parts)


def to_windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[L] -> [M, seq_len + 1] windows with stride seq_len (inputs [:, :-1], next tokens [:, 1:])."""
    return stream.unfold(0, seq_len + 1, seq_len).contiguous()


def batch_indices(n: int, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """Seeded epochs of random permutations of range(n), cut into batches (batches may straddle epochs)."""
    gen = torch.Generator().manual_seed(seed)
    pending = torch.empty(0, dtype=torch.long)
    while True:
        while pending.numel() < batch:
            pending = torch.cat([pending, torch.randperm(n, generator=gen)])
        yield pending[:batch]
        pending = pending[batch:]


# ----------------------------------------------------------------------------- attention for training


def sdpa_gqa(q, k, v, mask: Optional[torch.Tensor], scale: float, is_causal: bool = False) -> torch.Tensor:
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D], mask (True = attend) broadcastable to [B, H, Lq, Lk] -> [B, Lq, Hq, D].

    Query head h reads KV head h // (Hq // Hkv). Inputs are cast to v's dtype (the projection's autocast dtype)."""
    rep = q.shape[2] // k.shape[2]
    q, k, v = (t.to(v.dtype).transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    return out.transpose(1, 2)


class SdpaAttend:
    """The training attend backend: B sequences of `seq_len` tokens packed row-major (row b * seq_len + t is
    position t of sequence b, seq_slots = b), causal with each layer's window (0 = global).

    Trusts that layout instead of reading positions/seq_slots (no host sync); the test checks it against
    `mg.export.reference.dense_attend`."""

    def __init__(self, cfg: MuseGlimmerConfig, seq_len: int, device):
        self.seq_len = seq_len
        self.windows = [cfg.window(i) for i in range(cfg.n_layers)]
        t = torch.arange(seq_len, device=device)
        diff = t[:, None] - t[None, :]
        self.masks = {w: (diff >= 0) & (diff < w) for w in set(self.windows) if w > 0}

    def __call__(self, q, k, v, positions, seq_slots, layer_id: int, scale: float) -> torch.Tensor:
        b, window = q.shape[0] // self.seq_len, self.windows[layer_id]
        out = sdpa_gqa(*(x.view(b, self.seq_len, *x.shape[1:]) for x in (q, k, v)), self.masks.get(window), scale,
                       is_causal=window == 0)
        return out.reshape(q.shape)


def packed_forward(model: MuseGlimmer, tokens: torch.Tensor, rows: Optional[torch.Tensor] = None, taps=()):
    """tokens [B, T] -> (logits [R, V] of packed `rows` (default: all B*T rows), hidden [B*T, taps*dim] or None)."""
    b, t = tokens.shape
    dev = tokens.device
    positions = torch.arange(t, device=dev).repeat(b)
    slots = torch.arange(b, device=dev).repeat_interleave(t)
    rows = torch.arange(b * t, device=dev) if rows is None else rows
    return model(tokens.reshape(-1), positions, slots, rows, SdpaAttend(model.cfg, t, dev), taps)


def target_loss(model: MuseGlimmer, window: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """window [B, T + 1] -> next-token cross-entropy over all B*T predictions."""
    logits, _ = packed_forward(model, window[:, :-1])
    return F.cross_entropy(logits, window[:, 1:].reshape(-1), reduction=reduction)


# ----------------------------------------------------------------------------- drafter training path


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, cfg: DFlashConfig):
    """tokens [B, T], anchors [B, K] -> block tokens [B, K, S] = [anchor token, MASK ...], positions [B, K, S]."""
    s = cfg.block_size
    blk_pos = anchors[..., None] + torch.arange(s, device=anchors.device)
    blk_tok = torch.full(blk_pos.shape, cfg.mask_token_id, dtype=torch.long, device=tokens.device)
    blk_tok[..., 0] = tokens.gather(1, anchors)
    return blk_tok, blk_pos


def block_attn_mask(anchors: torch.Tensor, n_ctx: int, block_size: int, window: int) -> torch.Tensor:
    """-> bool [B, 1, K*S, n_ctx + K*S]: a row of block j sees context positions < anchor_j (and >= anchor_j -
    window when window > 0) and every row of its own block, non-causally."""
    b, k = anchors.shape
    dev = anchors.device
    a = anchors.repeat_interleave(block_size, dim=1)[..., None]  # [B, K*S, 1]
    t = torch.arange(n_ctx, device=dev)
    ctx = t < a
    if window > 0:
        ctx &= t >= a - window
    blk = torch.arange(k, device=dev).repeat_interleave(block_size)
    same = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
    return torch.cat([ctx, same], dim=-1)[:, None]


def draft_layer_train(layer: DraftLayer, x, pos, ctx, ctx_pos, mask) -> torch.Tensor:
    """One draft layer over all blocks of a batch: x [B, K*S, dim] block rows, ctx [B, T, dim] context features."""
    a = layer.attn
    h = layer.attn_norm(x)
    q = a.project_q(h, pos)
    k_blk, v_blk = a.project_kv(h, pos)
    k_ctx, v_ctx = a.project_kv(ctx, ctx_pos)  # context rows skip attn_norm, as in the cached path
    out = sdpa_gqa(q, torch.cat([k_ctx, k_blk], 1), torch.cat([v_ctx, v_blk], 1), mask, a.scale)
    x = x + a.o_proj(out.flatten(-2))
    return x + layer.ffn(layer.ffn_norm(x))


def draft_train_logits(draft: DFlashDraft, hidden: torch.Tensor, blk_tok: torch.Tensor, blk_pos: torch.Tensor,
                       embed_weight: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """hidden [B, T, taps*dim] target rows at positions 0..T-1; blk_tok/blk_pos [B, K, S] ->
    proposal logits [B, K, S - 1, V] fp32, each block seeing only its own context (< its anchor)."""
    b, k, s = blk_tok.shape
    n_ctx = hidden.shape[1]
    ctx = draft.context(hidden)
    ctx_pos = torch.arange(n_ctx, device=hidden.device).expand(b, n_ctx)
    mask = block_attn_mask(blk_pos[..., 0], n_ctx, s, draft.cfg.sliding_window)
    x, pos = F.embedding(blk_tok.flatten(1), embed_weight), blk_pos.flatten(1)
    for layer in draft.layers:
        x = draft_layer_train(layer, x, pos, ctx, ctx_pos, mask)
    h = draft.norm(x).unflatten(1, (k, s))[:, :, 1:]
    return F.linear(h, head_weight).float()


def sample_anchors(low: torch.Tensor, k: int, seq_len: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """low [B] -> [B, K] distinct sorted anchors in [low_b, seq_len - block_size]: every label anchor + i (i < S)
    lies inside the sequence, and no anchor comes before its row's first continuation token."""
    n = seq_len - block_size + 1
    scores = torch.rand(low.shape[0], n, generator=gen)
    scores[torch.arange(n)[None, :] < low[:, None]] = -1.0
    return scores.argsort(dim=1, descending=True, stable=True)[:, :k].sort(dim=1).values


def position_weights(block_size: int, device) -> torch.Tensor:
    """Loss weight of block position i = 1 .. S-1: exp(-(i - 1) / 7) (early positions decide acceptance)."""
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / 7.0)


def draft_loss(draft: DFlashDraft, target: MuseGlimmer, tokens: torch.Tensor, anchors: torch.Tensor,
               kd: float = 0.0) -> torch.Tensor:
    """tokens [B, T], anchors [B, K] -> position-weighted cross-entropy of the block proposals against the tokens
    that follow each anchor, with the target frozen (its tapped residuals are computed without gradients).
    kd > 0 mixes in the cross-entropy to the target's own next-token distribution at each block position (soft
    labels): (1 - kd) * hard + kd * soft."""
    blk_tok, blk_pos = block_inputs(tokens, anchors, draft.cfg)
    b, t = tokens.shape
    # the target's logits predicting each block position (from the row before it), only when they are used
    rows = (blk_pos[..., :-1] + torch.arange(b, device=tokens.device)[:, None, None] * t).flatten() if kd > 0 \
        else torch.zeros(1, dtype=torch.long, device=tokens.device)
    with torch.no_grad():
        t_logits, hidden = packed_forward(target, tokens, rows, draft.cfg.target_layers)
    logits = draft_train_logits(draft, hidden.view(b, t, -1), blk_tok, blk_pos,
                                target.tok_embeddings.weight.detach(), target.output.weight.detach())
    labels = tokens.gather(1, blk_pos[..., 1:].flatten(1)).view(blk_pos[..., 1:].shape)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.reshape(-1), reduction="none").view(labels.shape)
    if kd > 0:
        soft = torch.softmax(t_logits.float(), dim=-1)
        soft_ce = -(soft * torch.log_softmax(logits.flatten(0, 2), dim=-1)).sum(-1).view(labels.shape)
        ce = (1.0 - kd) * ce + kd * soft_ce
    w = position_weights(draft.cfg.block_size, ce.device)
    return (ce * w).sum(-1).mean() / w.sum()


# ----------------------------------------------------------------------------- the target's greedy text


class CachedAttend:
    """Attend backend for batched greedy generation: B sequences that all stand at the same position, their t new
    tokens packed row-major ([B * t] rows). K/V live in per-layer [B, max_len, Hkv, D] buffers; causal with each
    layer's window, like `SdpaAttend`. Like it, trusts that layout instead of reading positions/seq_slots."""

    def __init__(self, cfg: MuseGlimmerConfig, batch: int, max_len: int):
        self.windows = [cfg.window(i) for i in range(cfg.n_layers)]
        self.batch, self.max_len, self.pos = batch, max_len, 0  # pos: tokens cached before this step
        self.k: list[Optional[torch.Tensor]] = [None] * cfg.n_layers
        self.v: list[Optional[torch.Tensor]] = [None] * cfg.n_layers

    def __call__(self, q, k, v, positions, seq_slots, layer_id: int, scale: float) -> torch.Tensor:
        b, p0 = self.batch, self.pos
        t = q.shape[0] // b
        if self.k[layer_id] is None:
            shape = (b, self.max_len, *k.shape[1:])
            self.k[layer_id], self.v[layer_id] = k.new_zeros(shape), v.new_zeros(shape)
        kc, vc = self.k[layer_id], self.v[layer_id]
        kc[:, p0:p0 + t] = k.view(b, t, *k.shape[1:])
        vc[:, p0:p0 + t] = v.view(b, t, *v.shape[1:])
        diff = torch.arange(p0, p0 + t, device=q.device)[:, None] - torch.arange(p0 + t, device=q.device)[None, :]
        window = self.windows[layer_id]
        mask = (diff >= 0) & (diff < window) if window > 0 else diff >= 0
        out = sdpa_gqa(q.view(b, t, *q.shape[1:]), kc[:, :p0 + t], vc[:, :p0 + t], mask, scale)
        return out.reshape(q.shape)


@torch.no_grad()
def greedy_extend(target: MuseGlimmer, prefix: torch.Tensor, n_new: int) -> torch.Tensor:
    """prefix [B, P] -> [B, P + n_new]: each row followed by the target's greedy continuation (KV-cached)."""
    b, _ = prefix.shape
    dev = prefix.device
    cache = CachedAttend(target.cfg, b, prefix.shape[1] + n_new)
    slots_of = lambda t: torch.arange(b, device=dev).repeat_interleave(t)  # noqa: E731
    out, step_in = [prefix], prefix
    for _ in range(n_new):
        t = step_in.shape[1]
        positions = torch.arange(cache.pos, cache.pos + t, device=dev).repeat(b)
        rows = torch.arange(b, device=dev) * t + t - 1
        with autocast(dev.type):
            logits, _ = target(step_in.reshape(-1), positions, slots_of(t), rows, cache)
        cache.pos += t
        step_in = logits.argmax(-1)[:, None]
        out.append(step_in)
    return torch.cat(out, dim=1)


def make_rollouts(target: MuseGlimmer, train_w: torch.Tensor, s: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's training text, as it meets it when serving: `<bos>` + P - 1 tokens from a random place of the
    training stream (a prompt), then the target's greedy continuation up to `rollout_len` tokens. A drafter is
    right exactly when it agrees with the target's greedy choice, so these continuations, not the corpus, are the
    labels. -> (tokens [rollouts, rollout_len], prompt length P per row)."""
    gen = torch.Generator().manual_seed(s.seed + 5)
    seqs, starts, done, t0 = [], [], 0, time.monotonic()
    for i in range(math.ceil(s.rollouts / s.rollout_batch)):
        p = s.rollout_prompts[i % len(s.rollout_prompts)]
        b = min(s.rollout_batch, s.rollouts - done)
        rows = torch.randint(train_w.shape[0], (b, 1), generator=gen)
        cols = torch.randint(train_w.shape[1] - p + 1, (b, 1), generator=gen) + torch.arange(p - 1)
        prompt = torch.cat([torch.full((b, 1), BOS_ID), train_w.cpu()[rows, cols]], dim=1).to(s.device)
        seqs.append(greedy_extend(target, prompt, s.rollout_len - p))
        starts.append(torch.full((b,), p))
        done += b
        print(f"   rollouts {done}/{s.rollouts} (prompt {p} tokens, {time.monotonic() - t0:.0f} s)", flush=True)
    return torch.cat(seqs), torch.cat(starts)


# ----------------------------------------------------------------------------- training loop


class Clock:
    """Wall time since start, per-phase durations, and the stop times of the training phases."""

    def __init__(self, device: str, budget_s: Optional[float]):
        self.t0, self.device, self.budget_s = time.monotonic(), device, budget_s
        self.phases: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def stop_at(self, fraction: float) -> Optional[float]:
        return None if self.budget_s is None else self.budget_s * fraction

    @contextlib.contextmanager
    def phase(self, name: str):
        print(f"== {name} (t = {self.elapsed():.1f} s)", flush=True)
        start = time.monotonic()
        yield
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.phases[name] = round(time.monotonic() - start, 2)
        print(f"   {name}: {self.phases[name]:.1f} s", flush=True)


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of `lr` at `steps`."""
    if step <= warmup:
        return lr * step / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, frac))))


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, device: str) -> torch.optim.AdamW:
    """AdamW; matrices (incl. embedding and head) decay, norm weights do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device == "cuda")


def autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()


def params_digest(model: torch.nn.Module) -> str:
    return _sha256(b"".join(p.detach().float().cpu().numpy().tobytes() for _, p in sorted(model.named_parameters())))


@dataclass
class LoopSpec:
    name: str
    steps: int                     # the schedule's length
    lr: float
    stop_at_s: Optional[float]     # wall time (since start) after which no new step begins
    run_steps: Optional[int] = None  # stop after this many steps (the reproducibility check)
    eval_fn: Optional[Callable[[], float]] = None  # held-out loss; the weights with the lowest one are kept


def train_loop(model, loss_fn: Callable[[int], torch.Tensor], spec: LoopSpec, s: Settings, clock: Clock) -> dict:
    """Run `loss_fn(step)` under AdamW; -> curves, first losses (exact) and a parameter digest after them."""
    opt = make_optimizer(model, spec.lr, s.weight_decay, s.device)
    log = {"loss_curve": [], "heldout_curve": [], "first_losses": [], "steps_planned": spec.steps,
           "stopped_by_time": False}
    running, count, last = torch.zeros((), device=s.device), 0, spec.run_steps or spec.steps
    step, best = 0, {}
    for step in range(1, last + 1):
        if spec.stop_at_s is not None and clock.elapsed() > spec.stop_at_s:
            log["stopped_by_time"], step = True, step - 1
            print(f"   {spec.name}: time budget reached, stopping after step {step} of {spec.steps}", flush=True)
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, spec.steps, spec.lr, s.warmup_steps)
        with autocast(s.device):
            loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running, count = running + loss.detach(), count + 1
        if step <= s.repro_steps:
            log["first_losses"].append(loss.item())
            if step == s.repro_steps:
                log["digest_after_first"] = params_digest(model)
        if step % s.log_every == 0 or step == last:
            log["loss_curve"].append([step, round(running.item() / count, 4)])
            running, count = torch.zeros((), device=s.device), 0
            print(f"   {spec.name} step {step:5d}  loss {log['loss_curve'][-1][1]:.4f}  "
                  f"({clock.elapsed():.0f} s)", flush=True)
        if spec.eval_fn is not None and (step % s.eval_every == 0 or step == last):
            track_best(model, spec.eval_fn(), step, log, best)
    log["steps_done"] = step
    if best and s.keep_best:
        model.load_state_dict(best["state"])
        log["selected_step"] = best["step"]
        print(f"   {spec.name}: kept the weights of step {best['step']} (held-out loss {best['loss']:.4f})", flush=True)
    return log


def track_best(model: torch.nn.Module, loss: float, step: int, log: dict, best: dict) -> None:
    """Record a held-out loss; keep a copy of the weights with the lowest one so far (early stopping without
    stopping: the step count, and so the run, stays fixed)."""
    log["heldout_curve"].append([step, round(loss, 4)])
    if not best or loss < best["loss"]:
        best.update(loss=loss, step=step, state={k: v.detach().clone() for k, v in model.state_dict().items()})


# ----------------------------------------------------------------------------- phases


def new_target(cfg: MuseGlimmerConfig, s: Settings) -> MuseGlimmer:
    torch.manual_seed(s.seed)  # built on CPU, so CPU and GPU runs start from the same weights
    return MuseGlimmer(cfg).to(s.device)


def train_target(cfg, train_w: torch.Tensor, heldout_w: torch.Tensor, s: Settings, clock: Clock,
                 run_steps: Optional[int] = None):
    model = new_target(cfg, s).train()
    order = batch_indices(train_w.shape[0], s.target_batch, s.seed + 1)
    probe = heldout_w[:: max(1, heldout_w.shape[0] // s.probe_chunks)][: s.probe_chunks]
    spec = LoopSpec("target", s.target_steps, s.target_lr, clock.stop_at(TARGET_STOP_FRACTION), run_steps,
                    eval_fn=None if run_steps else (lambda: heldout_loss(model, probe, s)))
    log = train_loop(model, lambda step: target_loss(model, train_w[next(order)]), spec, s, clock)
    return model.eval(), log


@torch.no_grad()
def heldout_loss(model: MuseGlimmer, windows: torch.Tensor, s: Settings) -> float:
    """Mean next-token cross-entropy (nats) over every prediction of `windows` [M, T + 1]."""
    total, count = torch.zeros((), device=s.device, dtype=torch.float64), 0
    for i in range(0, windows.shape[0], s.target_batch):
        w = windows[i:i + s.target_batch]
        with autocast(s.device):
            total += target_loss(model, w, reduction="sum").double()
        count += w[:, 1:].numel()
    return float(total) / count


def round_weights(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """Round parameters to the saved dtype in place, so later phases see exactly the shipped weights."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(getattr(torch, dtype)).float())
    return model


def train_draft(dcfg: DFlashConfig, target: MuseGlimmer, rollouts: torch.Tensor, starts: torch.Tensor, s: Settings,
                clock: Clock):
    """Train against the target's greedy rollouts: anchors only inside each row's continuation."""
    torch.manual_seed(s.seed + 2)
    draft = DFlashDraft(dcfg, target.cfg).to(s.device).train()
    target.requires_grad_(False)
    order = batch_indices(rollouts.shape[0], s.draft_batch, s.seed + 3)
    gen = torch.Generator().manual_seed(s.seed + 4)

    def loss_fn(step: int) -> torch.Tensor:
        idx = next(order)
        anchors = sample_anchors(starts[idx], s.anchors_per_seq, rollouts.shape[1], dcfg.block_size, gen)
        return draft_loss(draft, target, rollouts[idx.to(rollouts.device)], anchors.to(s.device), s.draft_kd)

    spec = LoopSpec("draft", s.draft_steps, s.draft_lr, clock.stop_at(DRAFT_STOP_FRACTION))
    return draft.eval(), train_loop(draft, loss_fn, spec, s, clock)


def draft_proposals(target: MuseGlimmer, draft: DFlashDraft, seq: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """seq [B, L], anchors [B, K] -> the drafter's greedy proposals [B, K, S - 1] for the positions after each
    anchor, each block seeing the target's tapped residuals of the positions before its anchor."""
    cfg = draft.cfg
    dev = seq.device
    with autocast(dev.type):
        _, hidden = packed_forward(target, seq, torch.zeros(1, dtype=torch.long, device=dev), cfg.target_layers)
        blk_tok, blk_pos = block_inputs(seq, anchors, cfg)
        logits = draft_train_logits(draft, hidden.view(*seq.shape, -1), blk_tok, blk_pos,
                                    target.tok_embeddings.weight, target.output.weight)
    return logits.argmax(-1)


@torch.no_grad()
def eval_windows(target: MuseGlimmer, draft: DFlashDraft, windows: torch.Tensor, s: Settings) -> dict:
    """For held-out windows and fixed anchor positions p: the drafter drafts from the true prefix (context < p,
    anchor token at p); the target continues greedily from the same prefix. Acceptance length under greedy
    verification = 1 (the correction/bonus token) + the leading block positions where the two agree."""
    n = draft.cfg.block_size - 1
    agree, truth_d, truth_t, accept = [], [], [], []
    for p in s.accept_anchors:
        for i in range(0, windows.shape[0], s.target_batch):
            w = windows[i:i + s.target_batch]
            greedy = greedy_extend(target, w[:, :p + 1], n)[:, p + 1:]
            drafted = draft_proposals(target, draft, w[:, :p + 1], torch.full((w.shape[0], 1), p, device=w.device))
            drafted, truth = drafted[:, 0], w[:, p + 1:p + 1 + n]
            match = drafted == greedy
            agree.append(match.float())
            truth_d.append((drafted == truth).float())
            truth_t.append((greedy == truth).float())
            accept.append(1 + match.int().cumprod(dim=1).sum(dim=1).float())
    acc = torch.cat(accept)
    per_pos = lambda xs: [round(v, 4) for v in torch.cat(xs).mean(0).tolist()]  # noqa: E731
    return {"anchors": int(acc.numel()), "acceptance_length_mean": round(float(acc.mean()), 4),
            "acceptance_length_hist": torch.bincount(acc.long().cpu(), minlength=n + 2).tolist(),
            "agree_with_target_greedy": per_pos(agree), "draft_top1_vs_truth": per_pos(truth_d),
            "target_greedy_vs_truth": per_pos(truth_t)}


def simulate_rounds(drafted: torch.Tensor, seq: torch.Tensor, start: int) -> list[int]:
    """The greedy DFlash loop replayed on a known greedy text: seq [L] (prompt + the target's continuation from
    `start`), drafted [L - 1 - start, S - 1] (the proposals of the round anchored at each position from `start`).
    Each round accepts the drafts that agree with seq up to the first that does not, then the target's own token
    becomes the next anchor; like the engine, a round drafts no further than one short of the text's end (the
    target's token ends it). -> drafts accepted per round."""
    accepted, p, last = [], start, seq.shape[0] - 1
    while p < last:
        avail = min(drafted.shape[1], last - p - 1)
        m = int((drafted[p - start, :avail] == seq[p + 1:p + 1 + avail]).int().cumprod(0).sum())
        accepted.append(m)
        p += m + 1
    return accepted


@torch.no_grad()
def eval_prompts(target: MuseGlimmer, draft: DFlashDraft, prompts: list[tuple[str, list[int]]], s: Settings) -> dict:
    """What `mg-run` will see: each held-out prompt continued greedily by the target for `eval_new_tokens` tokens,
    with DFlash rounds replayed on that text (losslessness makes the greedy text the same with and without it).
    -> acceptance length pooled over rounds (accepted drafts + 1), per prompt, per block row, and a histogram."""
    n = draft.cfg.block_size - 1
    per_prompt, rounds = [], []
    for rel, ids in prompts:
        seq = greedy_extend(target, torch.tensor([ids], device=s.device), s.eval_new_tokens)
        anchors = torch.arange(len(ids), seq.shape[1] - 1, device=s.device)[None]
        drafted = draft_proposals(target, draft, seq, anchors)[0].cpu()
        acc = simulate_rounds(drafted, seq[0].cpu(), len(ids))
        rounds += acc
        per_prompt.append({"id": rel, "prompt_tokens": len(ids), "rounds": len(acc),
                           "acceptance_length": round(sum(a + 1 for a in acc) / len(acc), 4)})
    hist = [rounds.count(a) for a in range(n + 1)]
    return {"prompts": len(prompts), "new_tokens": s.eval_new_tokens, "rounds": len(rounds),
            "acceptance_length_mean": round(sum(a + 1 for a in rounds) / max(1, len(rounds)), 4),
            "accepted_hist": hist, "row_acceptance": [round(sum(hist[i:]) / max(1, len(rounds)), 4)
                                                      for i in range(1, n + 1)],
            "per_prompt": per_prompt}


def prompt_of(text: str) -> Optional[str]:
    """A held-out prompt: the 8 lines of a file that end with its first `def ...:` line after line 30 (so a
    completion continues a real function); None when the file has none."""
    lines = text.splitlines()
    for i in range(30, len(lines)):
        if lines[i].lstrip().startswith("def ") and lines[i].rstrip().endswith(":"):
            return "\n".join(lines[max(0, i - 7):i + 1]) + "\n"
    return None


def heldout_prompts(corpus: Corpus, count: int) -> list[tuple[str, str]]:
    """-> up to `count` (relative path, prompt) of held-out files, in file order."""
    rows = [(rel, prompt_of(text)) for rel, text in zip(corpus.heldout_files, corpus.heldout_texts)]
    return [(rel, prompt) for rel, prompt in rows if prompt][:count]


# ----------------------------------------------------------------------------- outputs


def save_outputs(out: Path, tcfg, target, dcfg, draft, tok, dtype: str) -> dict:
    """Write target/ (config.json, model.safetensors, tokenizer.json) and draft/; reload both to check them."""
    cast = getattr(torch, dtype)
    save_checkpoint(out / "target", tcfg, copy.deepcopy(target).to("cpu", cast))
    tok.save(str(out / "target" / "tokenizer.json"))
    save_checkpoint(out / "draft", dcfg, copy.deepcopy(draft).to("cpu", cast))
    lt = MuseGlimmer(load_config(out / "target", MuseGlimmerConfig))
    load_state(out / "target", lt)
    ld = DFlashDraft(load_config(out / "draft", DFlashConfig), lt.cfg)
    load_state(out / "draft", ld)
    for mine, loaded in ((target, lt), (draft, ld)):
        for (name, p), (_, q) in zip(sorted(mine.named_parameters()), sorted(loaded.named_parameters())):
            assert torch.equal(p.detach().cpu().to(cast).float(), q), f"reloaded tensor {name} differs"
    files = sorted(x for x in out.rglob("*") if x.is_file() and x.parent != out)
    return {x.relative_to(out).as_posix(): x.stat().st_size for x in files}


def check_repro(s: Settings, corpus: Corpus, tok, stream_digest: str, target_log: dict, tcfg, clock) -> dict:
    """Re-read the corpus, re-train the tokenizer, re-encode, re-train the first `repro_steps` target steps."""
    corpus2 = collect_corpus(s.heldout_fraction, s.max_corpus_bytes)
    tok2 = train_tokenizer(corpus2.train_texts, s.vocab_size)
    stream2 = encode_stream(tok2, corpus2.train_texts)
    train_w = to_windows(stream2, s.seq_len).to(s.device)
    _, log2 = train_target(tcfg, train_w, train_w[:1], s, clock, run_steps=s.repro_steps)
    res = {"compared": f"file lists, tokenizer.json text, encoded training stream (sha256), the first "
                       f"{s.repro_steps} target losses (exact floats) and a sha256 of all target parameters "
                       f"after step {s.repro_steps}",
           "same_files": corpus2.fingerprint() == corpus.fingerprint(),
           "same_tokenizer": tok2.to_str() == tok.to_str(),
           "same_stream": _sha256(stream2.numpy().tobytes()) == stream_digest,
           "same_losses": log2["first_losses"] == target_log["first_losses"],
           "same_params": log2.get("digest_after_first") == target_log.get("digest_after_first"),
           "losses_run1": target_log["first_losses"], "losses_run2": log2["first_losses"]}
    res["reproducible"] = all(res[k] for k in ("same_files", "same_tokenizer", "same_stream", "same_losses",
                                                "same_params"))
    return res


def environment(s: Settings) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": s.device,
           "stdlib": sysconfig.get_paths()["stdlib"], "platform": platform.platform()}
    try:
        import tokenizers
        env["tokenizers"] = tokenizers.__version__
    except ImportError:
        pass
    if s.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def write_reports(out: Path, report: dict) -> None:
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "train_report.md").write_text(render_markdown(report), encoding="utf-8")


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + \
        ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _loss_mix(kd: float) -> str:
    hard = "cross-entropy to the rollout's tokens"
    return hard if kd == 0 else f"{1 - kd:g} x {hard} + {kd:g} x cross-entropy to the target's next-token distribution"


def render_markdown(r: dict) -> str:
    t, d, acc, win = r["target"], r["draft"], r["draft"]["eval"], r["draft"]["eval_windows"]
    lines = [f"# train_tiny report ({'smoke' if r['settings']['smoke'] else 'full'})", "",
             f"Python {r['env']['python']}, torch {r['env']['torch']}, device {r['env'].get('gpu', r['env']['device'])}; "
             f"stdlib `{r['env']['stdlib']}`: {r['corpus']['train_files']} training files "
             f"({r['corpus']['train_tokens']} tokens), {r['corpus']['heldout_files']} held-out files "
             f"({r['corpus']['heldout_tokens']} tokens). Seeds: {r['seeds']}.", "",
             f"Tokenizer: byte-level BPE, {r['tokenizer']['vocab_size']} ids, {r['tokenizer']['bytes_per_token']} "
             f"bytes/token on held-out text, round-trip failures {r['tokenizer']['round_trip_failures']}.", "",
             "## Models", ""]
    lines += _table(["model", "parameters", "steps", "stopped by time", "weights kept", "final train loss"],
                    [[name, m["params"], f"{m['train']['steps_done']}/{m['train']['steps_planned']}",
                      m["train"]["stopped_by_time"], f"step {m['train'].get('selected_step', m['train']['steps_done'])}",
                      m["train"]["loss_curve"][-1][1]] for name, m in (("target", t), ("draft", d))])
    kept = (f"; the weights kept are those of the lowest held-out loss on {r['settings']['probe_chunks']} of these "
            f"windows, every {r['settings']['eval_every']} steps" if r["settings"]["keep_best"] else "")
    lines += ["", f"Target held-out: loss {t['heldout_loss']} nats/token, perplexity {t['heldout_ppl']} "
                  f"({t['heldout_tokens']} predictions{kept}).", "",
              f"Drafter (block {d['config']['block_size']}, {d['config']['n_layers']} layers, FFN "
              f"{d['config']['ffn_dim']}, taps {d['config']['target_layers']}), trained on {d['rollouts']['count']} "
              f"greedy rollouts of the target ({d['rollouts']['tokens']} tokens each, prompts of "
              f"{d['rollouts']['prompt_tokens']} tokens); its loss is {_loss_mix(r['settings'].get('draft_kd', 0.0))}:",
              "",
              f"- held-out prompts (the DFlash loop replayed on the target's greedy text, {acc['new_tokens']} new tokens "
              f"per prompt): mean acceptance length **{acc['acceptance_length_mean']}** over {acc['rounds']} rounds of "
              f"{acc['prompts']} prompts;",
              f"- held-out windows (drafts from the true text at fixed positions): mean acceptance length "
              f"{win['acceptance_length_mean']} ({win['anchors']} anchors).", "",
              "Held-out prompts, per block row (P(row i accepted)) and per prompt:", ""]
    lines += _table(["row"] + [str(i + 1) for i in range(len(acc["row_acceptance"]))],
                    [["P"] + acc["row_acceptance"]])
    lines += [""] + _table(["prompt", "prompt tokens", "rounds", "acceptance length"],
                           [[x["id"], x["prompt_tokens"], x["rounds"], x["acceptance_length"]]
                            for x in acc["per_prompt"]])
    lines += ["", "Held-out windows, per block position:", ""]
    lines += _table(["block position", "agrees with target greedy", "draft == truth", "target greedy == truth"],
                    [[i + 1, a, b, c] for i, (a, b, c) in enumerate(zip(win["agree_with_target_greedy"],
                                                                        win["draft_top1_vs_truth"],
                                                                        win["target_greedy_vs_truth"]))])
    lines += ["", "## Loss curves", ""]
    held = dict(map(tuple, t["train"]["heldout_curve"]))
    lines += _table(["target step", "train loss", "held-out loss"],
                    [[st, v, held.get(st, "")] for st, v in t["train"]["loss_curve"]])
    lines += [""] + _table(["draft step", "weighted train loss"], d["train"]["loss_curve"])
    lines += ["", "## Files and time", ""] + _table(["file", "bytes"], list(r["files"].items()))
    lines += [""] + _table(["phase", "seconds"], list(r["phases_s"].items()) + [["total", r["total_s"]]])
    if "repro" in r:
        lines += ["", f"Reproducibility ({r['repro']['compared']}): **{r['repro']['reproducible']}**."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


def seeds(s: Settings) -> dict:
    return {"target_init": s.seed, "target_order": s.seed + 1, "draft_init": s.seed + 2, "draft_order": s.seed + 3,
            "anchors": s.seed + 4, "rollout_prompts": s.seed + 5}


def prepare_data(s: Settings, clock: Clock) -> dict:
    with clock.phase("corpus"):
        corpus = collect_corpus(s.heldout_fraction, s.max_corpus_bytes)
        print(f"   {corpus.root}: {len(corpus.train_files)} training files, {len(corpus.heldout_files)} held out, "
              f"{len(corpus.skipped_not_utf8)} skipped (not UTF-8)", flush=True)
    with clock.phase("tokenizer"):
        tok = train_tokenizer(corpus.train_texts, s.vocab_size)
        failures = round_trips(tok, corpus.heldout_texts + corpus.train_texts[:50])
        assert failures == 0, f"{failures} files do not round-trip through the tokenizer"
        train_stream, held_stream = encode_stream(tok, corpus.train_texts), encode_stream(tok, corpus.heldout_texts)
        held_bytes = sum(len(t.encode()) for t in corpus.heldout_texts)
        print(f"   vocab {tok.get_vocab_size()}, {train_stream.numel()} training tokens, "
              f"{held_stream.numel()} held-out tokens", flush=True)
    return {"corpus": corpus, "tok": tok, "stream_digest": _sha256(train_stream.numpy().tobytes()),
            "train_w": to_windows(train_stream, s.seq_len).to(s.device),
            "heldout_w": to_windows(held_stream, s.seq_len).to(s.device),
            "tokenizer": {"vocab_size": tok.get_vocab_size(), "specials": list(SPECIALS),
                          "round_trip_failures": failures,
                          "bytes_per_token": round(held_bytes / max(1, held_stream.numel()), 3)},
            "corpus_info": {"root": corpus.root, "train_files": len(corpus.train_files),
                            "heldout_files": len(corpus.heldout_files), "skipped_not_utf8": corpus.skipped_not_utf8,
                            "skip_dirs": sorted(SKIP_DIRS), "train_tokens": train_stream.numel(),
                            "heldout_tokens": held_stream.numel(), "heldout_bytes": held_bytes}}


def run_target(s: Settings, data: dict, clock: Clock) -> tuple:
    tcfg = target_config(s, data["tok"].get_vocab_size())
    with clock.phase("target_train"):
        target, log = train_target(tcfg, data["train_w"], data["heldout_w"], s, clock)
        round_weights(target, s.weights_dtype)
    with clock.phase("target_eval"):
        held = data["heldout_w"][: s.eval_max_chunks]
        loss = heldout_loss(target, held, s)
        print(f"   held-out loss {loss:.4f}, perplexity {math.exp(loss):.2f}", flush=True)
    info = {"config": tcfg.to_json_dict(), "params": sum(p.numel() for p in target.parameters()),
            "train": log, "heldout_loss": round(loss, 4), "heldout_ppl": round(math.exp(loss), 3),
            "heldout_tokens": held[:, 1:].numel()}
    return tcfg, target, info


def run_draft(s: Settings, data: dict, target: MuseGlimmer, clock: Clock) -> tuple:
    dcfg = draft_config(s, target.cfg)
    with clock.phase("rollouts"):
        rollouts, starts = make_rollouts(target, data["train_w"], s)
    with clock.phase("draft_train"):
        draft, log = train_draft(dcfg, target, rollouts, starts, s, clock)
        round_weights(draft, s.weights_dtype)
    with clock.phase("draft_eval"):
        tok = data["tok"]
        prompts = [(rel, [BOS_ID] + tok.encode(text, add_special_tokens=False).ids)
                   for rel, text in heldout_prompts(data["corpus"], s.eval_prompt_count)]
        loop = eval_prompts(target, draft, prompts, s)
        print(f"   held-out prompts: mean acceptance length {loop['acceptance_length_mean']:.3f} over "
              f"{loop['rounds']} rounds of {loop['prompts']} prompts; P(row i accepted) "
              f"{loop['row_acceptance'][:6]} ...", flush=True)
        windows = eval_windows(target, draft, data["heldout_w"][: s.accept_chunks], s)
        print(f"   held-out windows: mean acceptance length {windows['acceptance_length_mean']:.3f}; agreement "
              f"by position {windows['agree_with_target_greedy'][:6]} ...", flush=True)
    info = {"config": dcfg.to_json_dict(), "params": sum(p.numel() for p in draft.parameters()), "train": log,
            "rollouts": {"count": rollouts.shape[0], "tokens": rollouts.shape[1],
                         "prompt_tokens": list(s.rollout_prompts)},
            "eval": loop, "eval_windows": windows}
    return dcfg, draft, info


def main(argv: Optional[list[str]] = None) -> dict:
    s = parse_settings(argv)
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before its first use)
    was_deterministic, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.use_deterministic_algorithms(True)  # also makes SDPA's backward deterministic (it only warns otherwise)
    if s.smoke:  # the toy model's ops are too small for intra-op threads: on a busy 2-core machine they cost 5-10x
        torch.set_num_threads(1)
    try:
        print("settings:", json.dumps(dataclasses.asdict(s)), "\nseeds:", seeds(s), flush=True)
        clock = Clock(s.device, s.time_budget_s)
        data = prepare_data(s, clock)
        tcfg, target, tinfo = run_target(s, data, clock)
        dcfg, draft, dinfo = run_draft(s, data, target, clock)
        with clock.phase("save"):
            files = save_outputs(out, tcfg, target, dcfg, draft, data["tok"], s.weights_dtype)
        report = {"settings": dataclasses.asdict(s), "seeds": seeds(s), "env": environment(s),
                  "corpus": data["corpus_info"], "tokenizer": data["tokenizer"], "target": tinfo, "draft": dinfo,
                  "files": files}
        if s.check_repro:
            with clock.phase("repro"):
                report["repro"] = check_repro(s, data["corpus"], data["tok"], data["stream_digest"], tinfo["train"],
                                              tcfg, Clock(s.device, None))
                print(f"   reproducible: {report['repro']['reproducible']}", flush=True)
        report.update(phases_s=clock.phases, total_s=round(clock.elapsed(), 1))
        write_reports(out, report)
        print(f"done in {report['total_s']} s: {out}", flush=True)
        return report
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
