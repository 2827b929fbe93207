"""DFlash speculative decoding, batched over all decoding sequences (ARCHITECTURE.md section 6).

One round per step for every decoding sequence with committed length L and a
pending token at position L (sampled, KV not yet written):
  1. draft: `draft_block([pending, MASK...])` conditioned on the draft context
     (hidden rows of positions < L) proposes d1..dk (argmax drafts, q = 1);
  2. verify: `[pending, d1..dk]` at positions L..L+k go through the one target
     `forward` of the step, packed with other sequences' prefill chunks (this
     also writes the pending token's KV);
  3. accept on the device (`spec_accept.accept`), one small copy to the host;
  4. commit: the target cache is rewound to L + a + 1, only the hidden rows of
     committed positions enter the draft cache, and the correction or bonus
     token becomes the new pending token.
On CUDA the drafter's `draft_block` always replays from CUDA graphs (batch buckets
1, 2, 4, ... up to the draft cache's active sequences; padding rows use the draft
scratch slot with anchor position 0, so their context is empty), and `draft_append`
is padded to token buckets like the target step (padding rows write the draft
scratch slot at position 0). Knows the artifact, caches and sampling; never imports
mg.export.
"""

from __future__ import annotations

from typing import Optional

import torch

from mg.manifests import constants as C

from .artifact import Artifact
from .cache_base import make_cache
from .cuda_graphs import GraphRunner, bucket_for, pad_rows, triton_enabled
from .draft_ops import DraftOps
from .engine import Engine
from .scheduler import Chunk, Sequence
from .spec_accept import accept


class DFlashError(ValueError):
    """DFlash cannot run as asked (no drafter, bad --draft-block)."""


class DFlashEngine(Engine):
    def __init__(self, artifact: Artifact, device: str = "cpu", draft_block: Optional[int] = None,
                 n_slots: Optional[int] = None, **engine_options):
        draft = artifact.manifest.draft
        if draft is None:
            raise DFlashError(f"{artifact.directory} has no drafter (export with --draft-checkpoint or "
                              f"--draft-preset)")
        block = draft.block_size if draft_block is None else draft_block
        if not 2 <= block <= draft.block_size:
            raise DFlashError(f"--draft-block is {draft_block}; allowed: an integer in [2, {draft.block_size}] "
                              f"(the exported block size)")
        super().__init__(artifact, device, n_slots, **engine_options)
        self.block = block  # rows verified per round: the pending token + block - 1 drafts
        self.exported_block = draft.block_size
        self.mask_token = draft.mask_token_id
        draft_slots = self.cache.n_slots if draft.kv.layout == C.LAYOUT_CELL else None
        self.draft_cache = make_cache(draft.kv, self.device, draft_slots)
        if engine_options.get("use_triton") is not None:  # draft_ops writes through the cache's kernels
            self.draft_cache.use_triton = triton_enabled(self.device, engine_options["use_triton"])
        self.max_draft_batch = draft.kv.max_active_seqs  # the draft_block bound on B
        ops = DraftOps(self.draft_cache)
        self.program.bind("mg::draft_append", ops.append)
        self.program.bind("mg::draft_attend", ops.attend)
        self._draft_graphs = self._append_graphs = None
        if self.cuda_graphs:
            version = self.draft_cache.storage_version
            self._draft_graphs = GraphRunner(self.program, C.METHOD_DRAFT_BLOCK, self._blank_block, version,
                                             self.stats.graphs)
            self._append_graphs = GraphRunner(self.program, C.METHOD_DRAFT_APPEND, self._blank_append, version,
                                              self.stats.graphs)

    # ------------------------------------------------------------------ one step = one round

    def step(self) -> None:
        chunks = self.scheduler.schedule(decode_width=self.block)
        decode = [c for c in chunks if not c.seq.in_prefill]
        prefill = [c for c in chunks if c.seq.in_prefill]
        n_drafts = [self._n_drafts(c) for c in decode]
        drafts = self.propose([c.seq for c in decode], n_drafts)
        verify = [Chunk(c.seq, c.start, 1 + k, False) for c, k in zip(decode, n_drafts)]
        for chunk, d in zip(verify, drafts):
            chunk.seq.tokens.extend(d)  # provisional: trimmed back to what is accepted below
        inputs = self.pack(verify + prefill)
        n_verify = sum(c.length for c in verify)  # verify rows come first in the packed step
        inputs.logits_rows = torch.cat([torch.arange(n_verify), inputs.logits_rows])  # R <= N <= max_write
        logits, hidden = self.forward(inputs)[:2]
        verify_logits = logits[:n_verify].index_select(0, self._verify_index(verify).to(logits.device))
        accepted, new_tokens = self._accept(verify, drafts, verify_logits)
        prefill_tokens = self.sample_rows(logits[n_verify:], inputs.sampled)
        self._commit(verify, accepted, prefill, inputs, hidden)
        for chunk, d, a, toks in zip(verify, drafts, accepted, new_tokens):
            del chunk.seq.tokens[len(chunk.seq.tokens) - len(d):]
            self.stats.rounds += 1
            self.stats.drafted_tokens += len(d)
            self.stats.accepted_tokens += a
            hist = self.stats.accepted_hist
            hist.extend([0] * (a + 1 - len(hist)))
            hist[a] += 1
            self.append(chunk.seq, toks)
        for seq, tok in zip(inputs.sampled, prefill_tokens):
            self.append(seq, [tok])
        self.stats.steps += 1

    def _n_drafts(self, chunk: Chunk) -> int:
        """Drafts this round: the step's budget, the block, the capacity, and what is left to generate."""
        seq = chunk.seq
        room = self.scheduler.capacity - 1 - seq.n_cached
        left = seq.request.max_new_tokens - seq.n_generated - 1
        return max(0, min(chunk.width - 1, self.block - 1, room, left))

    def propose(self, seqs: list[Sequence], n_drafts: list[int]) -> list[list[int]]:
        """Argmax drafts d1..dk for each sequence from one `draft_block` call (empty where k = 0)."""
        live = [(s, k) for s, k in zip(seqs, n_drafts) if k > 0]
        if not live:
            return [[] for _ in seqs]
        t = self.exported_block
        tokens = torch.full((len(live), t), self.mask_token, dtype=torch.long)
        tokens[:, 0] = torch.tensor([s.tokens[-1] for s, _ in live])
        anchors = torch.tensor([s.n_cached for s, _ in live], dtype=torch.long)
        positions = anchors[:, None] + torch.arange(t)[None, :]
        slots = torch.tensor([s.slot for s, _ in live], dtype=torch.long)
        block = [tokens, positions, slots]
        size = bucket_for(len(live), self.max_draft_batch) if self.pad_steps else None
        if size is not None:  # padding rows: anchor 0 on the draft scratch slot, so no context is read
            block = [pad_rows(tokens, size, self.mask_token), pad_rows(positions, size, torch.arange(t)),
                     pad_rows(slots, size, self.draft_cache.scratch_slot)]
        if size is not None and self._draft_graphs is not None:
            logits = self._draft_graphs.run(size, block)[0]
        else:
            logits = self.program.run(C.METHOD_DRAFT_BLOCK, [x.to(self.device) for x in block])[0]
        proposals = logits[:len(live)].argmax(dim=-1).tolist()  # [B, T-1]
        it = iter(proposals)
        return [next(it)[:k] if k > 0 else [] for k in n_drafts]

    # ------------------------------------------------------------------ pieces

    @staticmethod
    def _verify_index(verify: list[Chunk]) -> torch.Tensor:
        """[B * (K + 1)] index into the verify logits: each sequence's rows, padded with its last row."""
        width = max((c.length for c in verify), default=1)
        rows, offset = [], 0
        for c in verify:
            rows.append([offset + min(j, c.length - 1) for j in range(width)])
            offset += c.length
        return torch.tensor(rows, dtype=torch.long).flatten()

    def _accept(self, verify: list[Chunk], drafts: list[list[int]], logits: torch.Tensor):
        if not verify:
            return [], []
        b, width = len(verify), max(c.length for c in verify)
        dev = logits.device
        draft = torch.zeros(b, width - 1, dtype=torch.long)
        for i, d in enumerate(drafts):
            draft[i, :len(d)] = torch.tensor(d, dtype=torch.long)
        n_draft = torch.tensor([len(d) for d in drafts], dtype=torch.long, device=dev)
        batch = self.sampling_batch([c.seq for c in verify], dev)
        counters = torch.tensor([c.seq.n_generated - len(d) for c, d in zip(verify, drafts)], dtype=torch.long,
                                device=dev)
        result = accept(draft.to(dev), None, logits.view(b, width, -1), n_draft, batch, counters)
        host = torch.cat([result.n_accepted[:, None], result.tokens], dim=1).tolist()  # the one copy per round
        accepted = [row[0] for row in host]
        return accepted, [row[1:2 + row[0]] for row in host]

    def _commit(self, verify, accepted, prefill, inputs, hidden) -> None:
        """Roll back rejected KV; feed the hidden rows of committed positions to the draft context."""
        rows, positions, slots = [], [], []
        offset = 0
        for chunk, a in zip(verify, accepted):
            seq = chunk.seq
            seq.n_cached = chunk.start + a + 1
            self.cache.rewind(seq.slot, seq.n_cached)
            rows += range(offset, offset + a + 1)
            positions += range(chunk.start, chunk.start + a + 1)
            slots += [seq.slot] * (a + 1)
            offset += chunk.length
        for chunk in prefill:
            chunk.seq.n_cached += chunk.length
            rows += range(offset, offset + chunk.length)
            positions += range(chunk.start, chunk.start + chunk.length)
            slots += [chunk.seq.slot] * chunk.length
            offset += chunk.length
        self.append_context(hidden, rows, positions, slots)

    def append_context(self, hidden: torch.Tensor, rows: list[int], positions: list[int], slots: list[int]) -> None:
        if not rows:
            return
        size = bucket_for(len(rows), self.draft_cache.max_write) if self.pad_steps else None
        if size is not None:  # padding rows repeat a committed hidden row into the draft scratch slot, position 0
            pad = size - len(rows)
            rows, positions, slots = rows + [rows[0]] * pad, positions + [0] * pad, slots + [
                self.draft_cache.scratch_slot] * pad
        pos = torch.tensor(positions, dtype=torch.long)
        sl = torch.tensor(slots, dtype=torch.long)
        self.draft_cache.declare_step(pos, sl)
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        step = [hidden.index_select(0, index), pos, sl]
        if size is not None and self._append_graphs is not None:
            self._append_graphs.run(size, step)
        else:
            self.program.run(C.METHOD_DRAFT_APPEND, [x.to(self.device) for x in step])

    def _blank_block(self, size: int) -> list[torch.Tensor]:
        """`size` draft rows anchored at 0 on the draft scratch slot: they read no context, write nothing."""
        t, dev = self.exported_block, self.device
        return [torch.full((size, t), self.mask_token, dtype=torch.long, device=dev),
                torch.arange(t, device=dev).repeat(size, 1),
                torch.full((size,), self.draft_cache.scratch_slot, dtype=torch.long, device=dev)]

    def _blank_append(self, size: int) -> list[torch.Tensor]:
        """`size` context rows written to the draft scratch slot at position 0."""
        spec = next(m for m in self.artifact.manifest.methods if m.name == C.METHOD_DRAFT_APPEND).inputs[0]
        hidden = torch.zeros(size, spec.shape[1], dtype=getattr(torch, spec.dtype), device=self.device)
        zeros = torch.zeros(size, dtype=torch.long, device=self.device)
        return [hidden, zeros, torch.full_like(zeros, self.draft_cache.scratch_slot)]

    def finish(self, seq: Sequence, reason: str) -> None:
        super().finish(seq, reason)
        self.draft_cache.release(seq.slot)
