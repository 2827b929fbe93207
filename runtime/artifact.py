"""Loading an artifact directory: manifest, file hashes, program, and their cross-check.

The runtime knows the model only through this: `manifest.json` (validated by
mg.manifests), `model.pte` (run by `Program`), `model.ptd` (its weights, read
in place or streamed to the device), and the constant methods, which must agree
with the manifest value for value. Every listed file's size is checked; its
sha256 too, except that `model.ptd` is hashed only when no verified stamp
matches it (mg.manifests.values) and never with `verify=False`. The KV layout is chosen here from
what the program publishes: kBatchedSequence when it declares
`get_offgraph_kv_max_seqs`, kBatchedCell otherwise. Never imports mg.export.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import mg.kernels  # noqa: F401  (registers the mg:: op schemas the program names)
from mg.kernels import quant
from mg.kernels.ops import op_names
from mg.manifests import Manifest, ManifestError, constants as C, read_manifest
from mg.manifests.values import (draft_constant_values, sha256_file, stamped_sha256, target_constant_values,
                                 write_stamp)

from .data_file import DataFileError
from .program import Program, ProgramError

CUSTOM_OPS = op_names() + quant.op_names()  # bound per model runner (its caches; the quantized linears' kernels)


class ArtifactError(ValueError):
    """An artifact that cannot be served as it is; one line naming the file and both values."""


@dataclass
class Artifact:
    directory: Path
    manifest: Manifest
    program: Program
    layout: str  # chosen from the program's constant methods
    tokenizer_path: Optional[Path]

    @property
    def has_draft(self) -> bool:
        return self.manifest.draft is not None


def _check_files(directory: Path, manifest: Manifest, verify: bool = True) -> None:
    for entry in manifest.files:
        path = directory / entry.name
        if not path.is_file():
            raise ArtifactError(f"{path}: file not found (listed in {C.MANIFEST_FILE})")
        size = path.stat().st_size
        if size != entry.size:
            raise ArtifactError(f"{path}: size is {size} bytes; {C.MANIFEST_FILE} says {entry.size}"
                                f"{' (truncated file?)' if size < entry.size else ''}")
        weights = entry.name == C.WEIGHTS_FILE
        if weights and (not verify or stamped_sha256(path) == entry.sha256):
            continue
        digest = sha256_file(path)
        if digest != entry.sha256:
            raise ArtifactError(f"{path}: sha256 is {digest[:16]}...; {C.MANIFEST_FILE} says {entry.sha256[:16]}..."
                                f"{' (a damaged file, or one from another export)' if weights else ''}")
        if weights:
            write_stamp(path, digest)


def expected_constants(manifest: Manifest) -> dict[str, object]:
    """What each constant method must return, from the manifest."""
    model = manifest.model
    expect = target_constant_values(model.vocab_size, model.n_layers, manifest.kv, model.bos_id, model.eos_ids)
    if manifest.draft is not None:
        expect.update(draft_constant_values(manifest.draft))
    return expect


def _as_value(found, expected):
    if isinstance(expected, list):
        return list(found) if isinstance(found, (list, tuple)) else [found]
    if isinstance(found, (list, tuple)) and len(found) == 1:
        return found[0]
    return found


def _cross_check(program: Program, manifest: Manifest, source: str) -> str:
    names = set(program.method_names)
    for spec in manifest.methods:
        if spec.name not in names:
            raise ArtifactError(f"{source}: method '{spec.name}' is declared in {C.MANIFEST_FILE} but not in the "
                                f"program (program has: {', '.join(sorted(names))})")
    for name, expected in expected_constants(manifest).items():
        if name not in names:
            raise ArtifactError(f"{source}: constant method '{name}' is missing from the program; "
                                f"{C.MANIFEST_FILE} says {expected} (an artifact from an older mg-export: "
                                f"export it again)")
        found = _as_value(program.constant(name), expected)
        if found != expected:
            raise ArtifactError(f"{source}: constant method '{name}' returns {found}; {C.MANIFEST_FILE} says "
                                f"{expected}")
    has_seqs = C.GET_OFFGRAPH_KV_MAX_SEQS in names
    has_cells = C.GET_OFFGRAPH_KV_MAX_CELLS in names
    layout = C.LAYOUT_SEQUENCE if has_seqs else C.LAYOUT_CELL
    if has_seqs and has_cells:
        raise ArtifactError(f"{source}: the program declares both '{C.GET_OFFGRAPH_KV_MAX_SEQS}' and "
                            f"'{C.GET_OFFGRAPH_KV_MAX_CELLS}'; an artifact has one KV layout")
    if layout != manifest.kv.layout:
        raise ArtifactError(f"{source}: the program's constant methods give layout '{layout}'; "
                            f"{C.MANIFEST_FILE} says '{manifest.kv.layout}'")
    return layout


def load_artifact(directory: Path, device: str = "cpu", layout: Optional[str] = None,
                  verify: bool = True) -> Artifact:
    """Load and verify an artifact. `layout`, when given, must equal the exported one (it is fixed at export).
    `verify=False` skips hashing `model.ptd` (sizes, keys and shapes are still checked)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: not an artifact directory (expected {C.MANIFEST_FILE} and "
                            f"{C.PROGRAM_FILE} in it)")
    try:
        manifest = read_manifest(directory / C.MANIFEST_FILE)
    except ManifestError as e:
        raise ArtifactError(str(e)) from None
    if layout is not None and layout != manifest.kv.layout:
        raise ArtifactError(f"--kv-layout {layout} was asked for, but {directory} was exported with the "
                            f"'{manifest.kv.layout}' layout; the layout is fixed at export (re-export to change it)")
    _check_files(directory, manifest, verify)
    program_path = directory / C.PROGRAM_FILE
    listed = {entry.name for entry in manifest.files}
    try:
        program = Program.load(program_path, device=device, dtype=getattr(torch, manifest.model.dtype),
                               custom_ops={name: None for name in CUSTOM_OPS},
                               data_path=directory / C.WEIGHTS_FILE if C.WEIGHTS_FILE in listed else None)
    except (ProgramError, DataFileError) as e:
        raise ArtifactError(str(e)) from None
    chosen = _cross_check(program, manifest, str(directory))
    tok = directory / C.TOKENIZER_FILE
    return Artifact(directory, manifest, program, chosen, tok if tok.is_file() else None)
