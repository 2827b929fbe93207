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
Knows the artifact, caches and sampling; never imports mg.export.
"""

from __future__ import annotations

from typing import Optional

import torch

from mg.manifests import constants as C

from .artifact import Artifact
from .cache_base import make_cache
from .draft_ops import DraftOps
from .engine import Engine
from .sampling import SamplingBatch
from .scheduler import Chunk, Sequence
from .spec_accept import accept


class DFlashError(ValueError):
    """DFlash cannot run as asked (no drafter, bad --draft-block)."""


class DFlashEngine(Engine):
    def __init__(self, artifact: Artifact, device: str = "cpu", draft_block: Optional[int] = None,
                 n_slots: Optional[int] = None):
        draft = artifact.manifest.draft
        if draft is None:
            raise DFlashError(f"{artifact.directory} has no drafter (export with --draft-checkpoint or "
                              f"--draft-preset)")
        block = draft.block_size if draft_block is None else draft_block
        if not 2 <= block <= draft.block_size:
            raise DFlashError(f"--draft-block is {draft_block}; allowed: an integer in [2, {draft.block_size}] "
                              f"(the exported block size)")
        super().__init__(artifact, device, n_slots)
        self.block = block  # rows verified per round: the pending token + block - 1 drafts
        self.exported_block = draft.block_size
        self.mask_token = draft.mask_token_id
        draft_slots = self.cache.n_slots if draft.kv.layout == C.LAYOUT_CELL else None
        self.draft_cache = make_cache(draft.kv, self.device, draft_slots)
        ops = DraftOps(self.draft_cache)
        self.program.bind("mg::draft_append", ops.append)
        self.program.bind("mg::draft_attend", ops.attend)

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
        verify_rows = self._verify_rows(verify)
        rows = torch.cat([verify_rows, inputs.logits_rows]) if verify else inputs.logits_rows
        inputs.logits_rows = rows
        logits, hidden = self.forward(inputs)[:2]
        accepted, new_tokens = self._accept(verify, drafts, logits[:len(verify_rows)])
        prefill_tokens = self.sample_rows(logits[len(verify_rows):], inputs.sampled)
        self._commit(verify, accepted, prefill, inputs, hidden)
        for chunk, d, a, toks in zip(verify, drafts, accepted, new_tokens):
            del chunk.seq.tokens[len(chunk.seq.tokens) - len(d):]
            self.stats.rounds += 1
            self.stats.drafted_tokens += len(d)
            self.stats.accepted_tokens += a
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
        dev = self.device
        logits = self.program.run(C.METHOD_DRAFT_BLOCK, [tokens.to(dev), positions.to(dev), slots.to(dev)])[0]
        proposals = logits.argmax(dim=-1).tolist()  # [B, T-1]
        it = iter(proposals)
        return [next(it)[:k] if k > 0 else [] for k in n_drafts]

    # ------------------------------------------------------------------ pieces

    @staticmethod
    def _verify_rows(verify: list[Chunk]) -> torch.Tensor:
        """Packed row index of each verify row, padded to K + 1 per sequence with its last row."""
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
        batch = SamplingBatch.from_params([c.seq.request.sampling for c in verify], device=dev)
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
        pos = torch.tensor(positions, dtype=torch.long)
        sl = torch.tensor(slots, dtype=torch.long)
        self.draft_cache.declare_step(pos, sl)
        dev = self.device
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        self.program.run(C.METHOD_DRAFT_APPEND, [hidden.index_select(0, index), pos.to(dev), sl.to(dev)])

    def finish(self, seq: Sequence, reason: str) -> None:
        super().finish(seq, reason)
        self.draft_cache.release(seq.slot)
