"""Calibration for GPTQ at export: the inputs each quantized linear of the target sees on the user's text.

`read_calibration(path, tokenizer, bos_id, vocab_size, tokens, window)` tokenizes a UTF-8 text file into windows of
`window` tokens (each starting with BOS when the model has one), up to `tokens` tokens in all.
`InputStatistics` runs the float target over the windows layer by layer (one layer's weights in memory, read
from the weight source when its turn comes, and the residual stream of every calibration token) and gives, per
linear in `names`, E[x x^T] of its inputs ([K, K] float64); `InputFactors` turns a layer's statistics into the
factors `mg.kernels.quant.gptq` rounds the weights with (where the outputs on such text change least) when the
export first asks for one of that layer's linears, so an export holds one layer's statistics at a time.
`input_hessians` / `input_factors` give them all at once (tests, small models). The drafter is not calibrated
(its inputs need the target's hidden states; it keeps round-to-nearest). Knows nothing about ExecuTorch or the
runtime.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from mg.kernels.precision import cuda_fp32_matmuls

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


def check_memory(cfg: MuseGlimmerConfig, shapes: dict[str, tuple[int, int]], tokens: int, device: str = "cpu") -> None:
    """Refuse when the layer-by-layer pass would not fit where it runs (the host's available memory, or the
    CUDA device's free memory and the host's): the residual stream of every calibration token (updated in
    place), one layer's float32 weights, the largest layer's statistics (float64) and factors (float32) of its
    calibrated linears ({name: [out, in] features}), and the larger of the widest factorization's working set
    (three [K, K] float64 matrices) and GPTQ's on the widest weight (on CUDA the whole weight at once, with its
    transposed copy and codes; on the host a chunk). With CUDA the host holds one float layer and the
    embeddings' gathered rows."""
    per_layer: dict[str, int] = {}
    for name, (_, k) in shapes.items():
        layer = name.split(".")[1] if name.startswith("layers.") else name
        per_layer[layer] = per_layer.get(layer, 0) + 12 * k * k
    widest = max((k for _, k in shapes.values()), default=0)
    largest = max((n * k for n, k in shapes.values()), default=0)
    layer_weights = 4 * cfg.layer_params()
    stream = 4 * tokens * cfg.dim
    rounding = 9 * largest if device == "cuda" else 0
    need = stream + layer_weights + max(per_layer.values(), default=0) + max(24 * widest * widest, rounding)
    checks = [(need, "host memory", _available_bytes())]
    if device == "cuda":
        checks = [(need, "CUDA device memory", torch.cuda.mem_get_info()[0]),
                  (layer_weights + stream, "host memory", _available_bytes())]
    for bytes_, where, available in checks:
        if available is not None and bytes_ > 0.8 * available:
            raise CalibrationError(f"--calibration needs the residual stream of its tokens, one float layer and "
                                   f"that layer's input statistics in {where}: {bytes_ / 1e9:.1f} GB, "
                                   f"{available / 1e9:.1f} GB available; allowed: fewer --calibration-tokens (or "
                                   f"no --calibration: round-to-nearest needs no model in memory)")


class _Prefixed:
    """The tensors of `source` under `prefix` (`layers.3.`), by their names inside that module."""

    def __init__(self, source: WeightSource, prefix: str):
        self.source, self.prefix = source, prefix

    def chunks(self, name: str, shape: tuple[int, ...], dtype: torch.dtype):
        return self.source.chunks(self.prefix + name, shape, dtype)


def _float_module(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """`build()` with float32 parameters left uninitialised (to be filled by `materialize`: no init work on a
    real-width layer) and its computed buffers (RoPE frequencies) real."""
    from .lower import meta_parameters

    with meta_parameters():
        module = build()
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32),
                                                         requires_grad=False)
    return module.eval()


def _layer_of(name: str, n_layers: int) -> int:
    """The layer whose pass gives `name`'s inputs: i for `layers.i.*`, n_layers for the head (`output`)."""
    if name.startswith("layers."):
        return int(name.split(".")[1])
    if name == "output":
        return n_layers
    raise ValueError(f"not a calibrated linear of the target: {name}")


class InputStatistics:
    """E[x x^T] ([K, K] float64) of the inputs of the target's linears `names` ({name: in features}) on the
    calibration windows, computed layer by layer in float32 (full-precision matrix products) on `device` (the
    CPU, or CUDA: the same operations, other rounding): the residual stream of every window
    is kept ([windows, window, dim]); a layer's float weights are read from the weight source when its turn
    comes and dropped after, and only the linears of the layer being run gather statistics. The same numbers
    as the whole float model run window by window (the same operations in the same order), in the memory of
    one layer. `layer(i)` runs the pass up to layer i (i = n_layers: the head's inputs, the final norm of every
    position) and returns the statistics of that layer's linears in `names`; asking for a layer already
    passed starts the pass again from the embeddings."""

    def __init__(self, cfg: MuseGlimmerConfig, weights: WeightSource, names: dict[str, int],
                 windows: list[list[int]], progress: Callable[[str], None], device: str = "cpu"):
        self.cfg, self.weights, self.names, self.progress = cfg, weights, dict(names), progress
        self.device = torch.device(device)
        self.tokens = torch.tensor(windows, dtype=torch.long)  # [W, T]
        if self.tokens.numel() and not 0 <= int(self.tokens.min()) <= int(self.tokens.max()) < cfg.vocab_size:
            raise CalibrationError(f"--calibration: token ids {int(self.tokens.min())}..{int(self.tokens.max())}; "
                                   f"allowed: 0..{cfg.vocab_size - 1} (the model's vocabulary)")
        self._x: Optional[torch.Tensor] = None  # the residual stream entering layer self._next
        self._next = 0
        self._last = max((_layer_of(n, cfg.n_layers) for n in names), default=-1)  # no stream needed after it
        self._t0 = time.perf_counter()

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        if i < self._next or self._x is None:
            if self._next:
                self.progress(f"calibration: layer {i} asked after layer {self._next - 1}: running the pass again")
            self._x, self._next = self._embed(), 0
        while self._next < i:
            self._run(self._next, {})
        out = self._run(i, {n: k for n, k in self.names.items() if _layer_of(n, self.cfg.n_layers) == i})
        if i >= self._last:
            self._x = None  # the last calibrated layer: the stream's memory goes back (asked again: a new pass)
        return out

    def _embed(self) -> torch.Tensor:
        """The first layer's input: the embedding rows of the windows' tokens (read chunk by chunk, only the rows
        used kept), RMS-normalised as `MuseGlimmer.embed` does."""
        from .model import rms_norm_noweight

        cfg, flat = self.cfg, self.tokens.reshape(-1)
        x = torch.empty(flat.numel(), cfg.dim, dtype=torch.float32)
        at = 0
        for chunk in self.weights.chunks("tok_embeddings.weight", (cfg.vocab_size, cfg.dim), torch.float32):
            rows = chunk.reshape(-1, cfg.dim)
            hit = (flat >= at) & (flat < at + rows.shape[0])
            x[hit] = rows[flat[hit] - at]
            at += rows.shape[0]
        return rms_norm_noweight(x.to(self.device), cfg.norm_eps).reshape(*self.tokens.shape, cfg.dim)

    def _run(self, i: int, names: dict[str, int]) -> dict[str, torch.Tensor]:
        """Layer i over every window (the stream advances to layer i + 1), gathering the statistics of `names`;
        i = n_layers: the head's inputs only."""
        from .model import RMSNorm

        cfg, device = self.cfg, self.device
        sums = {n: torch.zeros(k, k, dtype=torch.float64, device=device) for n, k in names.items()}
        rows = dict.fromkeys(names, 0)

        def gather(name: str, x: torch.Tensor) -> None:
            x = x.reshape(-1, x.shape[-1]).float()
            sums[name] += (x.T @ x).double()
            rows[name] += x.shape[0]

        with torch.no_grad(), cuda_fp32_matmuls(False):  # statistics in full precision, whatever the process set
            if i == cfg.n_layers:  # the head: its inputs are the final norm of every position
                if names:
                    norm = materialize(_Prefixed(self.weights, "norm."),
                                       _float_module(lambda: RMSNorm(cfg.dim, cfg.norm_eps))).to(device)
                    for x in self._x:
                        gather("output", norm(x))
            else:
                self._layer(i, names, gather)
        self._next = i + 1
        return {n: sums[n] / max(rows[n], 1) for n in names}

    def _layer(self, i: int, names: dict[str, int], gather: Callable[[str, torch.Tensor], None]) -> None:
        """Layer i over every window, the stream advanced in place; `gather(name, x)` sees the inputs of `names`."""
        from .model import Block, rope_tables
        from .reference import dense_attend

        cfg, device = self.cfg, self.device
        block = materialize(_Prefixed(self.weights, f"layers.{i}."), _float_module(lambda: Block(cfg, i))).to(device)
        modules = dict(block.named_modules())
        prefix = f"layers.{i}."
        handles = [modules[n[len(prefix):]].register_forward_hook(lambda _m, inputs, _o, n=n: gather(n, inputs[0]))
                   for n in names]
        t = self.tokens.shape[1]
        positions, slots = torch.arange(t, device=device), torch.zeros(t, dtype=torch.long, device=device)
        rope = rope_tables(positions, block.attn.inv_freq) if block.attn.use_rope else None
        attend = dense_attend(cfg)  # one window at a time, whole: no cache
        try:
            for w in range(self._x.shape[0]):
                self._x[w] = block(self._x[w], positions, slots, attend, rope)
        finally:
            for h in handles:
                h.remove()
        elapsed = time.perf_counter() - self._t0
        left = self._last - i  # layers still to run: at the export's pace so far (its writing included)
        eta = f", about {elapsed / (i + 1) * left / 60:.0f} min to the last calibrated layer" if left > 0 else ""
        self.progress(f"calibration: layer {i + 1}/{cfg.n_layers} over {self._x.shape[0]} windows "
                      f"({elapsed:.0f}s{eta})")


def input_hessians(cfg: MuseGlimmerConfig, weights: WeightSource, names: dict[str, int],
                   windows: list[list[int]], progress: Callable[[str], None],
                   device: str = "cpu") -> dict[str, torch.Tensor]:
    """{linear name: E[x x^T] of its inputs over `windows`} for every linear in `names`, by one layer-by-layer
    pass (`InputStatistics`), all held at once (tests, small models)."""
    stats = InputStatistics(cfg, weights, names, windows, progress, device)
    layers = sorted({_layer_of(n, cfg.n_layers) for n in names})
    return {n: h.cpu() for i in layers for n, h in stats.layer(i).items()}


def _factor(name: str, hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`gptq_factor` of `name`'s statistics, refused in one line when they or the factor are not finite or not
    positive definite (CUDA's Cholesky gives NaN where the CPU's raises)."""
    from mg.kernels.quant import gptq_factor

    refusal = CalibrationError(f"--calibration: the inputs' statistics of {name} are not finite or not positive "
                               f"definite (non-finite activations on the text?); allowed: text the float model "
                               f"runs on")
    if not bool(torch.isfinite(hessian).all()):
        raise refusal
    try:
        factor = gptq_factor(hessian)  # on the pass's device: `QuantizedWeights` rounds the weight there
    except torch.linalg.LinAlgError:
        raise refusal from None
    if not bool(torch.isfinite(factor[0]).all()):
        raise refusal
    return factor


class InputFactors:
    """`mg.kernels.quant.gptq_factor` of each calibrated linear's input statistics, made when first asked for,
    a layer at a time (`InputStatistics`), so an export streaming its weights in the program's order (layer by
    layer) holds one layer's statistics and factors at a time. `drop(name)` once a linear is written."""

    def __init__(self, cfg: MuseGlimmerConfig, weights: WeightSource, names: dict[str, int],
                 windows: list[list[int]], progress: Callable[[str], None], device: str = "cpu"):
        self.cfg, self.names = cfg, dict(names)
        self._stats = InputStatistics(cfg, weights, names, windows, progress, device)
        self._ready: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._done: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        factor = self._ready.get(name)
        if factor is None:
            if name not in self.names:
                raise KeyError(name)
            hessians = self._stats.layer(_layer_of(name, self.cfg.n_layers))
            for n in list(hessians):  # factored one by one, each statistic freed once factored
                factor_n = _factor(n, hessians.pop(n))
                if n == name or n not in self._done:
                    self._ready[n] = factor_n
            factor = self._ready[name]
        return factor

    def drop(self, name: str) -> None:
        """`name`'s weight is written: its factor goes (asked again, its layer is computed again)."""
        self._ready.pop(name, None)
        self._done.add(name)


def input_factors(cfg: MuseGlimmerConfig, weights: WeightSource, names: dict[str, int],
                  windows: list[list[int]], progress: Callable[[str], None],
                  device: str = "cpu") -> dict[str, tuple[torch.Tensor, ...]]:
    """{linear name: its factor} for every linear in `names`, all held at once (`InputFactors` makes them a
    layer at a time for an export)."""
    factors = InputFactors(cfg, weights, names, windows, progress, device)
    return {n: factors[n] for n in sorted(names, key=lambda n: _layer_of(n, cfg.n_layers))}


def _available_bytes() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
