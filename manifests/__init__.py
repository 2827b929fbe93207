"""mg.manifests: the artifact contract shared by export and runtime (imports nothing of ours)."""

from . import constants
from .errors import ManifestError
from .schema import (
    DraftFacts,
    FileEntry,
    KVLayer,
    KVSpec,
    Manifest,
    MethodSpec,
    ModelFacts,
    Provenance,
    TensorSpec,
    WeightGroup,
    manifest_from_dict,
    manifest_to_dict,
    read_manifest,
    write_manifest,
)

__all__ = [
    "constants", "ManifestError", "DraftFacts", "FileEntry", "KVLayer", "KVSpec", "Manifest", "MethodSpec",
    "ModelFacts", "Provenance", "TensorSpec", "WeightGroup", "manifest_from_dict", "manifest_to_dict", "read_manifest",
    "write_manifest",
]
