"""What each constant method of an artifact returns, derived from the manifest's facts.

The exporter publishes these values and the runtime expects them: one
function serves both, so the two sides cannot drift. Also the file digest both
sides compute. Imports nothing of ours but the contract.
"""

from __future__ import annotations

import hashlib
import os
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


# -- verified stamps: a file's sha256, remembered while the file stays the same --------------------------
# Hashing a multi-GB model.ptd costs about a second per GB. After a file has been hashed (by the export that
# wrote it, or by a load that verified it), a stamp keyed by (device, inode, size, mtime) records the digest;
# a later load of the same unchanged file trusts the stamp. A rewritten or replaced file gets a new key.


def cache_root() -> Path:
    """The tools' cache folder: $MG_CACHE_DIR, else $XDG_CACHE_HOME/mg-toolchain, else ~/.cache/mg-toolchain."""
    return Path(os.environ.get("MG_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mg-toolchain"))


def stamp_dir() -> Path:
    return cache_root() / "verified"


def _stamp_path(path: Path) -> Optional[Path]:
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return stamp_dir() / f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"


def stamped_sha256(path: Path) -> Optional[str]:
    """The digest a stamp records for `path` as it is now, or None."""
    stamp = _stamp_path(path)
    try:
        return stamp.read_text(encoding="ascii").strip() if stamp is not None else None
    except OSError:
        return None


def write_cache_file(path: Path, text: str) -> None:
    """Write a file of the cache folder whole (via a temporary name, so readers never see half of it); best
    effort: an unwritable cache is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="ascii")
        tmp.replace(path)
    except OSError:
        pass


def write_stamp(path: Path, sha256: str) -> None:
    """Remember that `path`, as it is now, has digest `sha256` (best effort: an unwritable cache is skipped)."""
    stamp = _stamp_path(path)
    if stamp is not None:
        write_cache_file(stamp, sha256 + "\n")
