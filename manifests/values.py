"""What each constant method of an artifact returns, derived from the manifest's facts.

The exporter publishes these values and the runtime expects them: one
function serves both, so the two sides cannot drift. Also the file digest both
sides compute. Imports nothing of ours but the contract.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional, Union

from . import constants as C
from .schema import DraftFacts, FileEntry, KVSpec

Value = Union[int, list]


def target_constant_values(vocab_size: int, n_layers: int, kv: KVSpec, bos_id: Optional[int],
                           eos_ids: tuple[int, ...]) -> dict[str, Value]:
    values: dict[str, Value] = {
        C.GET_MAX_CONTEXT_LEN: kv.capacity,
        C.GET_MAX_SEQ_LEN: kv.capacity,
        C.GET_MAX_WRITE: kv.max_write,
        C.GET_VOCAB_SIZE: vocab_size,
        C.GET_N_LAYERS: n_layers,
        C.GET_KV_HEADS: [layer.n_kv_heads for layer in kv.layers],
        C.GET_HEAD_DIMS: [layer.head_dim for layer in kv.layers],
        C.GET_WINDOWS: [layer.window for layer in kv.layers],
    }
    if bos_id is not None:
        values[C.GET_BOS_ID] = bos_id
    if eos_ids:
        values[C.GET_EOS_IDS] = list(eos_ids)
    if kv.layout == C.LAYOUT_SEQUENCE:
        values[C.GET_OFFGRAPH_KV_MAX_SEQS] = kv.max_seqs
    else:
        values[C.GET_OFFGRAPH_KV_MAX_CELLS] = kv.max_cells
    return values


def draft_constant_values(draft: DraftFacts) -> dict[str, Value]:
    return {
        C.GET_DRAFT_OFFGRAPH_KV_MAX_SEQS: draft.kv.max_active_seqs,
        C.GET_DRAFT_OFFGRAPH_KV_SEQ_CAPACITY: draft.kv.capacity,
        C.GET_BLOCK_SIZE: draft.block_size,
        C.GET_MASK_TOKEN_ID: draft.mask_token_id,
        C.GET_N_TARGET_LAYERS: len(draft.target_layers),
    }


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: Path) -> FileEntry:
    path = Path(path)
    return FileEntry(path.name, path.stat().st_size, sha256_file(path))
