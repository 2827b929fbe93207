"""Weight-only quantization at export: linear layers -> `QuantizedLinear` (the `mg::linear_int8|int4` ops),
and a weight source that quantizes the float checkpoint tensors as they stream into `model.ptd`.

`quantize_linears(module, scheme, group_size, skip)` replaces every `nn.Linear` of a (meta) module, except
those named in `skip`, by a `QuantizedLinear` whose parameters are `<name>.weight_q`, `<name>.scale` (and
`<name>.zero` for int4); it returns the plan {linear name: QuantSpec}. `QuantizedWeights(source, plan)` serves
those parameters from the float `<name>.weight` of `source`, quantized row chunk by row chunk (both schemes
are row-local, rounded to nearest or, given the inputs' statistics of calibration text, by GPTQ), so an export
still never holds more than one chunk of a weight. The formats are those of
`mg.kernels.quant`. Knows nothing about ExecuTorch or the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

import torch
from torch import nn

from mg.kernels.quant import SCHEME_INT4, SCHEME_INT8, gptq, quantize_int4, quantize_int8

from .weights import WeightSource


class QuantizeError(ValueError):
    """A model that cannot be quantized as asked; one line naming the tensor and the numbers."""


@dataclass(frozen=True)
class QuantSpec:
    scheme: str  # int8 | int4
    group_size: Optional[int]  # int4 only

    @property
    def parts(self) -> tuple[str, ...]:
        return ("weight_q", "scale", "zero") if self.scheme == SCHEME_INT4 else ("weight_q", "scale")


@dataclass(frozen=True)
class PlannedLinear:
    """A linear to quantize: its scheme and its float weight's shape [out_features, in_features]."""

    spec: QuantSpec
    shape: tuple[int, int]


class QuantizedLinear(nn.Module):
    """`y = x W~^T` with W~ the dequantized weight (no bias): `mg::linear_int8` or `mg::linear_int4`."""

    def __init__(self, in_features: int, out_features: int, spec: QuantSpec, dtype: torch.dtype,
                 device: str | torch.device = "meta"):
        super().__init__()
        self.in_features, self.out_features, self.spec = in_features, out_features, spec

        def param(shape, dt):
            return nn.Parameter(torch.empty(shape, dtype=dt, device=device), requires_grad=False)

        if spec.scheme == SCHEME_INT8:
            self.weight_q = param((out_features, in_features), torch.int8)
            self.scale = param((out_features,), dtype)
        else:
            groups = in_features // spec.group_size
            self.weight_q = param((out_features, in_features // 2), torch.uint8)
            self.scale = param((out_features, groups), dtype)
            self.zero = param((out_features, groups), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.scheme == SCHEME_INT8:
            return torch.ops.mg.linear_int8(x, self.weight_q, self.scale)
        return torch.ops.mg.linear_int4(x, self.weight_q, self.scale, self.zero, self.spec.group_size)

    def extra_repr(self) -> str:
        group = f", group_size={self.spec.group_size}" if self.spec.group_size else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.spec.scheme}{group}"


def quantize_linears(module: nn.Module, scheme: str, group_size: Optional[int], skip: frozenset = frozenset(),
                     where: str = "", device: str | torch.device = "meta") -> dict[str, PlannedLinear]:
    """Replace `module`'s linears (not those named in `skip`) by `QuantizedLinear`s with empty parameters on
    `device` (meta for export; a real device for eager references, filled by `materialize` from a
    `QuantizedWeights`), in place; -> {linear name: PlannedLinear}. Refuses (QuantizeError) a bias or an input width the scheme cannot
    split, before anything is replaced. `where` prefixes names in messages ("draft.")."""
    if scheme not in (SCHEME_INT8, SCHEME_INT4):
        raise QuantizeError(f"quantization scheme {scheme!r}; allowed: {SCHEME_INT8} | {SCHEME_INT4}")
    spec = QuantSpec(scheme, group_size if scheme == SCHEME_INT4 else None)
    targets = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear) and name not in skip]
    for name, m in targets:
        if m.bias is not None:
            raise QuantizeError(f"{where}{name} has a bias; quantized linears take none")
        if scheme == SCHEME_INT4 and m.in_features % group_size:
            raise QuantizeError(f"--group-size {group_size} does not divide the input width {m.in_features} of "
                                f"{where}{name}.weight {list(m.weight.shape)}; allowed: a group size that "
                                f"divides every quantized linear's input width")
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, QuantizedLinear(m.in_features, m.out_features, spec, m.weight.dtype, device))
    return {name: PlannedLinear(spec, (m.out_features, m.in_features)) for name, m in targets}


class QuantizedWeights:
    """`inner`'s tensors, with the parameters of the planned linears made from their float weights: by GPTQ
    for the linears `factors` has (`mg.kernels.quant.gptq_factor` of their inputs' statistics; `gptq` is
    row-local too), by rounding to nearest for the others. `factors` is a mapping; one with a `drop(name)`
    method (`mg.export.calibrate.InputFactors`, which makes them a layer at a time) is told once a linear's
    `weight_q` has been served."""

    def __init__(self, inner: WeightSource, plan: dict[str, PlannedLinear],
                 factors: Optional[Mapping[str, tuple[torch.Tensor, torch.Tensor]]] = None):
        self.inner, self.plan, self.factors = inner, plan, factors if factors is not None else {}
        schemes = sorted({p.spec.scheme for p in plan.values()})
        how = f" ({len(self.factors)} by GPTQ)" if self.factors else ""
        self.description = f"{inner.description}, linears quantized to {'/'.join(schemes)}{how}" if plan \
            else inner.description
        self._side: dict[str, dict[str, torch.Tensor]] = {}  # linear -> scale/zero computed, not yet served

    def check(self, expected) -> None:
        self.inner.check(expected)

    def close(self) -> None:
        getattr(self.inner, "close", lambda: None)()

    def chunks(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Iterator[torch.Tensor]:
        base, _, part = name.rpartition(".")
        planned = self.plan.get(base)
        spec = planned.spec if planned is not None else None
        if spec is None or part not in spec.parts:
            yield from self.inner.chunks(name, shape, dtype)
            return
        if part == "weight_q":
            side = []
            for q, *rest in self._quantized(base, planned):
                side.append(rest)
                yield q.reshape(-1)
            self._keep_side(base, spec, side)
            getattr(self.factors, "drop", lambda _name: None)(base)
        else:
            if base not in self._side:  # asked before the weight: quantize once more, keeping only the side
                self._keep_side(base, spec, [rest for _, *rest in self._quantized(base, planned)])
            value = self._side[base].pop(part)
            if not self._side[base]:
                del self._side[base]
            yield value.to(dtype).reshape(-1)

    def _keep_side(self, base: str, spec: QuantSpec, side: list) -> None:
        """Keep the scale (and zero) rows of every chunk, joined, until they are served."""
        self._side[base] = {p: torch.cat(col) for p, col in zip(spec.parts[1:], zip(*side))}

    def _quantized(self, base: str, planned: PlannedLinear) -> Iterator[tuple[torch.Tensor, ...]]:
        """(q rows, scale rows[, zero rows]) per row chunk of `<base>.weight`; by GPTQ with a factor on a CUDA
        device (calibrated there), the whole weight at once on that device (a column's small operations are
        launched once for all rows, not once per chunk), the results returned to the host."""
        spec, (n_out, n_in) = planned.spec, planned.shape
        factor = self.factors[base] if base in self.factors else None  # made before the weight is read
        chunks = self.inner.chunks(f"{base}.weight", (n_out, n_in), torch.float32)
        if factor is not None and _whole_weight(factor):
            rows, at = torch.empty((n_out, n_in), dtype=torch.float32, device=factor[0].device), 0
            for flat in chunks:
                part = flat.reshape(-1, n_in)
                rows[at:at + part.shape[0]].copy_(part)
                at += part.shape[0]
            yield tuple(t.cpu() for t in gptq(rows, factor, spec.scheme, spec.group_size))
            return
        for flat in chunks:
            rows = flat.reshape(-1, n_in)
            if factor is not None:
                yield gptq(rows, factor, spec.scheme, spec.group_size)
            else:
                yield quantize_int8(rows) if spec.scheme == SCHEME_INT8 else quantize_int4(rows, spec.group_size)


def _whole_weight(factor: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Does GPTQ take the whole weight at once: with the factor on a CUDA device (host rounding stays chunked)."""
    return factor[0].device.type == "cuda"
