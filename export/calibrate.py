"""Calibration for GPTQ at export: the inputs each quantized linear of the target sees on the user's text.

`read_calibration(path, tokenizer, bos_id, vocab_size, tokens, window)` tokenizes a UTF-8 text file into windows of
`window` tokens (each starting with BOS when the model has one), up to `tokens` tokens in all.
`input_hessians(cfg, weights, names, windows, progress)` builds the float target in host memory from its weight
source, runs it over the windows and returns, per linear in `names`, E[x x^T] of its inputs ([K, K] float64),
which `mg.kernels.quant.gptq` uses (through `input_factors`: its factor per linear) to round the weights where
the outputs on such text change least. The drafter
is not calibrated (its inputs need the target's hidden states; it keeps round-to-nearest). Knows nothing about
ExecuTorch or the runtime.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from .config import MuseGlimmerConfig
from .weights import WeightSource, materialize

DEFAULT_TOKENS = 65536
WINDOW = 256


class CalibrationError(ValueError):
    """Calibration text or memory that will not do; one line naming what and what is allowed."""


def read_calibration(path: Path, tokenizer: Optional[Path], bos_id: Optional[int], vocab_size: int, tokens: int,
                     window: int = WINDOW) -> list[list[int]]:
    """Windows of `window` token ids from the text at `path`, at most `tokens` ids in all; refuses a file it
    cannot read as UTF-8, one shorter than one window, and a tokenizer whose ids the model does not have.
    `tokenizer` None: the byte-level tokenizer that presets get."""
    from tokenizers import Tokenizer

    path = Path(path)
    if tokens < window:
        raise CalibrationError(f"--calibration-tokens is {tokens}; allowed: an integer >= {window} (one window)")
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise CalibrationError(f"--calibration {path}: file not found; allowed: a UTF-8 text file") from None
    except IsADirectoryError:
        raise CalibrationError(f"--calibration {path}: is a directory; allowed: a UTF-8 text file") from None
    except UnicodeDecodeError as e:
        raise CalibrationError(f"--calibration {path}: not UTF-8 (byte {e.start}); allowed: a UTF-8 text "
                               f"file") from None
    except OSError as e:
        raise CalibrationError(f"--calibration {path}: cannot read ({e.strerror})") from None
    with tempfile.TemporaryDirectory() as tmp:
        if tokenizer is None:  # presets: the byte-level tokenizer their artifacts get
            from .tokenizer import write_byte_tokenizer

            tokenizer = Path(tmp) / "tokenizer.json"
            write_byte_tokenizer(tokenizer)
        tok = Tokenizer.from_file(str(tokenizer))
    head = [bos_id] if bos_id is not None else []
    per = window - len(head)
    ids = tok.encode(text[:64 * tokens], add_special_tokens=False).ids  # far more characters than needed
    windows = [head + ids[i:i + per] for i in range(0, len(ids) - per + 1, per)][:tokens // window]
    if not windows:
        raise CalibrationError(f"--calibration {path}: {len(ids)} tokens; allowed: a text of at least {per} "
                               f"tokens (one window of {window})")
    top = max(max(w) for w in windows)
    if top >= vocab_size:
        raise CalibrationError(f"--calibration: the tokenizer gives id {top}, the model's vocabulary has "
                               f"{vocab_size}; allowed: the checkpoint's own tokenizer.json")
    return windows


def check_memory(cfg: MuseGlimmerConfig, in_features: Iterable[int]) -> None:
    """Refuse when the float target and the inputs' statistics would not fit in the host's available memory."""
    need = 4 * cfg.n_params() + sum(8 * k * k for k in in_features)
    available = _available_bytes()
    if available is not None and need > 0.8 * available:
        raise CalibrationError(f"--calibration needs the float target and its inputs' statistics in host memory: "
                               f"{need / 1e9:.1f} GB, {available / 1e9:.1f} GB available; allowed: a model "
                               f"that fits (or no --calibration: round-to-nearest needs no model in memory)")


def input_hessians(cfg: MuseGlimmerConfig, weights: WeightSource, names: dict[str, int],
                   windows: list[list[int]], progress: Callable[[str], None]) -> dict[str, torch.Tensor]:
    """{linear name: E[x x^T] of its inputs over `windows`} for the target's linears in `names` ({name: in
    features}), from the float target run in float32 on the CPU."""
    from .model import MuseGlimmer
    from .reference import dense_attend

    model = MuseGlimmer(cfg).float().eval()  # built whole (its buffers are computed), then filled
    materialize(weights, model)
    attend = dense_attend(cfg)  # one window at a time, whole: no cache
    sums = {n: torch.zeros(k, k, dtype=torch.float64) for n, k in names.items()}
    rows = dict.fromkeys(names, 0)

    def hook(name):
        def run(_module, inputs, _output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            sums[name] += (x.T @ x).double()
            rows[name] += x.shape[0]
        return run

    modules = dict(model.named_modules())
    handles = [modules[n].register_forward_hook(hook(n)) for n in names]
    all_rows = "output" in names  # the head's inputs are every position's, not only the last
    t0 = last = time.perf_counter()
    try:
        with torch.no_grad():
            for i, ids in enumerate(windows):
                t = torch.tensor(ids)
                logit_rows = torch.arange(len(ids)) if all_rows else torch.tensor([len(ids) - 1])
                model(t, torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long), logit_rows, attend)
                if time.perf_counter() - last > 10 or i + 1 == len(windows):
                    last = time.perf_counter()
                    progress(f"calibration: {i + 1}/{len(windows)} windows ({last - t0:.0f}s)")
    finally:
        for h in handles:
            h.remove()
    return {n: sums[n] / max(rows[n], 1) for n in names}


def input_factors(cfg: MuseGlimmerConfig, weights: WeightSource, names: dict[str, int],
                  windows: list[list[int]], progress: Callable[[str], None]) -> dict[str, tuple[torch.Tensor, ...]]:
    """{linear name: `mg.kernels.quant.gptq_factor` of its inputs' statistics} (`input_hessians`), each statistic
    freed once factored; a statistic that cannot be factored is refused in one line."""
    from mg.kernels.quant import gptq_factor

    hessians = input_hessians(cfg, weights, names, windows, progress)
    factors = {}
    for name in names:
        try:
            factors[name] = gptq_factor(hessians.pop(name))
        except torch.linalg.LinAlgError:
            raise CalibrationError(f"--calibration: the inputs' statistics of {name} are not positive definite "
                                   f"(non-finite activations on the text?); allowed: text the float model runs "
                                   f"on") from None
    return factors


def _available_bytes() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
