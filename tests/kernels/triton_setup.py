"""The Triton kernel tests' shared set-up: they run on CUDA, or on CPU through the Triton interpreter when
MG_TRITON_INTERPRET=1 (small shapes there). Import this module before anything imports triton: it sets
TRITON_INTERPRET for the interpreter."""

import os

import pytest
import torch

INTERPRET = os.environ.get("MG_TRITON_INTERPRET") == "1"
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
ON_CUDA = DEVICE == "cuda"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="large shapes run on CUDA only (the interpreter is slow)")


def module_marks(available: bool, reason: str) -> list:
    """A kernel test module's marks: CUDA-marked, skipped without CUDA or the interpreter, and skipped when its
    kernels cannot run (`reason`: why), e.g. when triton was imported before TRITON_INTERPRET was set."""
    return [
        pytest.mark.cuda,
        pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET),
                           reason="needs CUDA, or MG_TRITON_INTERPRET=1 for the Triton interpreter on CPU"),
        pytest.mark.skipif(not available, reason=f"Triton unavailable: {reason}"),
    ]
