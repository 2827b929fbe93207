"""Lowering: the MG model (and drafter) -> ExecuTorch program + constant methods, weights kept outside.

`torch.export` with a dynamic token count, `to_edge`, `to_executorch` with
portable out-variant ops, no delegate, views kept as `*_copy` ops
(`remove_view_copy=False`) and graph inputs not memory-planned. Attention is
the `mg::` op family; the graph holds no KV.

Weights never exist during lowering: the model is built with its parameters on
the meta device, and each method is traced (on meta tensors) with every
parameter and buffer lifted to a leading graph input. After emission those
inputs become what ExecuTorch calls external constants: tensors with
`TensorDataLocation.EXTERNAL` and their fully qualified name (`model.*` for the
target, `draft.*` for the drafter), resolved at load from `model.ptd`
(docs/ARCHITECTURE.md, "Artifact"). The bytes go there separately (export/ptd.py).
Knows nothing about the runtime.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import nn
from torch.export import Dim

import mg.kernels  # noqa: F401  (registers mg:: ops)
from mg.manifests import KVSpec, constants as C
from mg.manifests.values import target_constant_values

from .config import MuseGlimmerConfig
from .model import MuseGlimmer
from .ptd import SCALAR_TYPE_NAMES

Progress = Callable[[str], None]


class TargetForward(torch.nn.Module):
    """The `forward` method: (tokens[N], positions[N], seq_slots[N], logits_rows[R]) -> logits[R, V] (, hidden)."""

    def __init__(self, model: MuseGlimmer, taps: tuple[int, ...] = ()):
        super().__init__()
        self.model = model
        self.taps = taps

    def forward(self, tokens, positions, seq_slots, logits_rows):
        logits, hidden = self.model(tokens, positions, seq_slots, logits_rows,
                                    torch.ops.mg.update_and_attend.default, self.taps)
        return (logits, hidden) if self.taps else logits


@dataclass(frozen=True)
class LiftedMethod:
    """A traced method whose first `len(keys)` inputs are the weights (parameters, then buffers) it holds."""

    program: torch.export.ExportedProgram
    keys: tuple[str, ...]  # fully qualified names, in input order
    n_inputs: int  # the method's own inputs, after the weights


@dataclass(frozen=True)
class ProgramParts:
    """What `to_edge` receives: traced methods and constant methods."""

    methods: dict  # name -> LiftedMethod (weights external), or a plain ExportedProgram (weights inside)
    constants: dict  # name -> int | list[int]


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no init work); buffers, which
    are computed from the configuration (RoPE frequencies), stay real."""
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                 requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


class _Lifted(nn.Module):
    """`inner` called with its parameters and buffers taken from the leading `weights` input."""

    def __init__(self, inner: nn.Module, keys: tuple[str, ...]):
        super().__init__()
        self.inner, self.keys = inner, keys

    def forward(self, weights, *args):
        return torch.func.functional_call(self.inner, dict(zip(self.keys, weights)), tuple(args), strict=False,
                                          tie_weights=False)


def lifted_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a method holds, by fully qualified name: parameters (meta) then buffers (real)."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


@contextlib.contextmanager
def _stripped(module: nn.Module) -> Iterator[None]:
    """`module` without parameters or buffers while tracing (they come in as inputs), restored after."""
    saved = [(m, dict(m._parameters), dict(m._buffers)) for m in module.modules()]
    for m, params, _ in saved:
        for name in [n for n, p in params.items() if p is not None]:
            del m._parameters[name]
        m._buffers.clear()
    try:
        yield
    finally:
        for m, params, buffers in saved:
            m._parameters.update(params)
            m._buffers.update(buffers)


def export_lifted(method: nn.Module, example: tuple, dynamic_shapes: tuple) -> LiftedMethod:
    """torch.export `method` on meta tensors, its weights lifted to a leading input (a list of tensors)."""
    tensors = lifted_tensors(method)
    keys = tuple(tensors)
    weights = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors.values()]
    args = tuple(x.to("meta") for x in example)
    with torch.no_grad(), _stripped(method):
        program = torch.export.export(_Lifted(method.eval(), keys), (weights, *args),
                                      dynamic_shapes={"weights": [None] * len(keys), "args": tuple(dynamic_shapes)},
                                      strict=False)
    return LiftedMethod(program, keys, len(example))


def export_target(model: MuseGlimmer, max_write: int, taps: tuple[int, ...] = ()) -> LiftedMethod:
    """Trace the target forward with N in [1, max_write] and R in [1, max_write]."""
    if max_write < 2:
        raise ValueError(f"max_write is {max_write}; allowed: an integer >= 2")
    n = Dim("n_tokens", min=1, max=max_write)
    r = Dim("n_logits", min=1, max=max_write)
    example = (torch.tensor([5, 6], dtype=torch.long), torch.tensor([0, 1], dtype=torch.long),
               torch.zeros(2, dtype=torch.long), torch.tensor([0, 1], dtype=torch.long))
    return export_lifted(TargetForward(model, taps), example, ({0: n}, {0: n}, {0: n}, {0: r}))


def target_constants(cfg: MuseGlimmerConfig, kv: KVSpec) -> dict:
    """The target's constant methods (the values the runtime will expect from the manifest)."""
    return target_constant_values(cfg.vocab_size, cfg.n_layers, kv, cfg.bos_id, tuple(cfg.eos_ids))


def to_program(parts: ProgramParts, progress: Optional[Progress] = None) -> tuple[bytes, dict[str, tuple]]:
    """Lower traced methods + constant methods to one ExecuTorch program buffer whose weights are external
    constants. -> (the buffer, {key: (dtype, shape)} of every external tensor, in first-use order)."""
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge
    from executorch.exir.passes import MemoryPlanningPass

    say = progress or (lambda msg: None)
    say(f"to_edge: {len(parts.methods)} method(s), {len(parts.constants)} constant method(s)")
    edge = to_edge({name: getattr(m, "program", m) for name, m in parts.methods.items()},
                   constant_methods=parts.constants,
                   compile_config=EdgeCompileConfig(_check_ir_validity=False))
    say("to_executorch: portable out-variant ops, no delegate, weights external")
    config = ExecutorchBackendConfig(
        remove_view_copy=False,
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
    )
    manager = edge.to_executorch(config)
    program = manager.executorch_program
    external = externalize(program, parts.methods)
    from executorch.exir._serialize._program import PTEFile, serialize_pte_binary

    return bytes(serialize_pte_binary(PTEFile(program=program), segment_alignment=config.segment_alignment,
                                      constant_tensor_alignment=config.constant_tensor_alignment,
                                      delegate_alignment=config.delegate_alignment)), external


_TORCH_DTYPES = {name: dtype for dtype, name in SCALAR_TYPE_NAMES.items()}


def externalize(program, methods: dict) -> dict[str, tuple]:
    """Turn each plan's lifted weight inputs into external constants named by their keys, and give the plan
    back its own inputs only. -> {key: (torch dtype, shape)} in first-use order."""
    from executorch.exir import schema as S
    import executorch.extension.pytree as ex_pytree

    external: dict[str, tuple] = {}
    index: dict[str, int] = {}
    for plan in program.execution_plan:
        lifted = methods.get(plan.name)
        if not isinstance(lifted, LiftedMethod):
            continue
        k = len(lifted.keys)
        if len(plan.inputs) != k + lifted.n_inputs:
            raise RuntimeError(f"method {plan.name!r}: {len(plan.inputs)} inputs after lowering; expected "
                               f"{k} weights + {lifted.n_inputs}")
        for key, idx in zip(lifted.keys, plan.inputs[:k]):
            t = plan.values[idx].val
            info = (_TORCH_DTYPES[S.ScalarType(t.scalar_type).name], tuple(t.sizes))
            if external.setdefault(key, info) != info:
                raise RuntimeError(f"external tensor {key!r} is {info} in {plan.name!r} and {external[key]} "
                                   f"elsewhere")
            t.extra_tensor_info = S.ExtraTensorInfo(fully_qualified_name=key, location=S.TensorDataLocation.EXTERNAL)
            t.data_buffer_idx = index.setdefault(key, len(index))
            t.shape_dynamism = S.TensorShapeDynamism.STATIC
        plan.inputs = plan.inputs[k:]
        _, spec = ex_pytree.tree_flatten(((0,) * lifted.n_inputs, {}))
        plan.container_meta_type.encoded_inp_str = spec.to_str()
    return external
