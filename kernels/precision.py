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


def _setting() -> tuple[str, object]:
    """The precision API the process uses and its value now: ("allow_tf32", bool) or ("fp32_precision", str)."""
    matmul = torch.backends.cuda.matmul
    try:
        return "allow_tf32", matmul.allow_tf32
    except RuntimeError:  # the process uses the newer API: torch refuses mixing the two
        return "fp32_precision", matmul.fp32_precision


@contextlib.contextmanager
def cuda_fp32_matmuls(tf32: bool):
    matmul = torch.backends.cuda.matmul
    name, before = _setting()
    setattr(matmul, name, tf32 if name == "allow_tf32" else "tf32" if tf32 else "ieee")
    try:
        yield
    finally:
        setattr(matmul, name, before)


def cuda_fp32_matmuls_tf32() -> bool:
    """Whether CUDA fp32 matrix products run in TF32 now (either API)."""
    name, value = _setting()
    return bool(value) if name == "allow_tf32" else value == "tf32"
