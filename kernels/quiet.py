"""Keep the tools' output to their own lines: silence dependencies' import-time noise.

Importing executorch's exporter pulls in torchao, which logs a warning for each optional CUDA extension it
cannot load on a CPU-only torch, and torch logs deprecation notes for enum constants and pytree leaf specs
that executorch still uses; Inductor suggests TF32 when it compiles a float32 model (the runtime keeps full
float32 precision on purpose). None of it concerns the user of mg-export or mg-run. Knows only logger names
and warning texts; imports nothing of ours or of torch.
"""

from __future__ import annotations

import logging
import warnings

_LOGGERS = ("torchao", "torch.utils._pytree")
_WARNINGS = (r".*isinstance\(treespec, LeafSpec\).*", r".*is an Enum subclass and is now natively supported.*",
             r"TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled.*")


def quiet_dependencies() -> None:
    """Raise the named dependencies' loggers to ERROR and ignore their known deprecation warnings."""
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message)
