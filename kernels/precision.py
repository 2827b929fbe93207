"""CUDA float32 matrix-product precision for a block of code, whichever of torch's two precision APIs the
process uses.

`cuda_fp32_matmuls(tf32)`: inside the block, CUDA fp32 matrix products run in TF32 (True) or in full precision
(False); after it, as before. Set through the older `allow_tf32` flag, which leaves every reader of either API
working inside the block; a process that set the newer `fp32_precision` (torch then refuses the older flag)
gets that one.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def cuda_fp32_matmuls(tf32: bool):
    matmul = torch.backends.cuda.matmul
    try:
        name, before, value = "allow_tf32", matmul.allow_tf32, tf32
    except RuntimeError:  # the process uses the newer API: torch refuses mixing the two
        name, before, value = "fp32_precision", matmul.fp32_precision, "tf32" if tf32 else "ieee"
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, before)


def cuda_fp32_matmuls_tf32() -> bool:
    """Whether CUDA fp32 matrix products run in TF32 now (either API)."""
    matmul = torch.backends.cuda.matmul
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:
        return matmul.fp32_precision == "tf32"
