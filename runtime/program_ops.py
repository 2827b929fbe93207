"""The program runner's operator table and steps: ExecuTorch operator name -> torch callable.

`resolve(name, overload)` turns one entry of a program's operator table into an
`OpBinding`: a functional torch callable plus where its inputs and outputs sit
in the kernel call's argument list (schema arguments, then returns). Out
variants (`aten::add.out`) run as their functional overload (`aten::add.Tensor`):
ExecuTorch's memory plan is not ours, and planned sizes are only upper bounds.
`*_copy` view ops run as torch views unless copies are asked for. Only the
operators named here are supported; anything else resolves to None.
Steps are closures over a values table (a list indexed like the program's
values), built once at load; `fold` evaluates the ones computable at load.
Knows torch and ExecuTorch's operator conventions; knows nothing about the
program file format or MG.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# aten ops run through their functional overload (names without overload or `_copy` view ops).
GENERIC_ATEN = frozenset("""
    abs acos acosh add addmm amax amin any all arange argmax argmin asin asinh atan atan2 atanh
    bitwise_and bitwise_not bitwise_or bitwise_xor bmm cat ceil clamp clone constant_pad_nd cos cosh
    cumsum div embedding empty eq erf exp expm1 fill floor floor_divide fmod full full_like gather ge
    gelu glu gt hardtanh index index_put index_select isinf isnan le leaky_relu linear log log10 log1p
    log2 _log_softmax logical_and logical_not logical_or logical_xor lt masked_fill max maximum mean min
    minimum mm mul native_layer_norm ne neg ones pow prod reciprocal relu remainder repeat round rsqrt
    rsub scalar_tensor scatter sigmoid sign silu sin sinh _softmax sort sqrt stack sub sum tan tanh
    topk tril triu var where zeros _to_copy narrow_copy
""".split())

# aten ops a caller of `Program.run` may serve with its own callable (its `ops` table, by this name): the
# runtime's float matrix products (`mg.kernels.linear`: row-invariant or few-row). Without an entry, torch's op
# runs.
MM = "aten::mm"
SERVABLE_ATEN = frozenset({MM})

# `*_copy` ops that are views of their first argument; value -> the view op's name.
VIEW_COPY = {
    "alias_copy": "alias", "detach_copy": "detach", "diagonal_copy": "diagonal", "expand_copy": "expand",
    "permute_copy": "permute", "select_copy": "select", "slice_copy": "slice", "split_copy": "split",
    "split_with_sizes_copy": "split_with_sizes", "squeeze_copy": "squeeze", "t_copy": "t",
    "transpose_copy": "transpose", "unbind_copy": "unbind", "unfold_copy": "unfold",
    "unsqueeze_copy": "unsqueeze", "view_copy": "view",
}

# Functional-only arguments an out variant takes from its out tensor (dtype) or the runner (device).
OUT_FILLED = ("dtype", "layout", "device", "pin_memory")


@dataclass(frozen=True)
class OpBinding:
    """How to run one operator. Kernel call args = schema arguments in order, then the returns."""

    fn: Callable  # called with inputs[:n_positional] positionally, the rest as keywords `kwarg_names`
    input_types: tuple[str, ...]  # schema type of each input argument, Optional stripped (out arguments left out)
    input_positions: tuple[int, ...]  # their positions in the schema's arguments
    n_positional: int
    kwarg_names: tuple[str, ...]  # names of inputs[n_positional:]
    out_positions: tuple[int, ...]  # schema positions of out arguments (`Tensor(a!)` / `Tensor(a!)[]`)
    n_args: int
    n_returns: int
    out_kwargs: tuple[str, ...] = ()  # keywords the runner fills: "dtype" (of the first out tensor), "device"
    custom: bool = False  # a bound Python callable with side effects: never folded


def _is_out(arg) -> bool:
    return arg.alias_info is not None and arg.alias_info.is_write


def _type_name(arg) -> str:
    """The argument's schema type without Optional: "ScalarType", "List[int]", "Tensor" ..."""
    name = str(getattr(arg, "real_type", arg.type))  # .type says "int" for ScalarType, MemoryFormat, Layout
    return name[len("Optional["):-1] if name.startswith("Optional[") else name


def _binding(schema, fn: Callable, fn_schema=None, out_kwargs: tuple[str, ...] = (),
             custom: bool = False) -> OpBinding:
    """`fn_schema` None: `fn` takes every input positionally; else its keyword-only names are passed by name."""
    args = list(schema.arguments)
    inputs = [(i, a) for i, a in enumerate(args) if not _is_out(a)]
    kw_only = set() if fn_schema is None else {a.name for a in fn_schema.arguments if a.kwarg_only}
    n_pos = sum(1 for _, a in inputs if a.name not in kw_only)
    assert all(a.name in kw_only for _, a in inputs[n_pos:]), f"{schema}: keyword-only inputs must come last"
    return OpBinding(fn=fn, input_types=tuple(_type_name(a) for _, a in inputs),
                     input_positions=tuple(i for i, _ in inputs), n_positional=n_pos,
                     kwarg_names=tuple(a.name for _, a in inputs[n_pos:]),
                     out_positions=tuple(i for i, a in enumerate(args) if _is_out(a)),
                     n_args=len(args), n_returns=len(schema.returns), out_kwargs=out_kwargs, custom=custom)


def _torch_op(ns: str, name: str, overload: str):
    try:
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, RuntimeError):
        return None


def functional_overload(op) -> Optional[tuple]:
    """The functional overload of an out variant and the extra keywords it needs: (overload, extras)."""
    ins = [(a.name, str(a.type)) for a in op._schema.arguments if not _is_out(a)]
    names = {n for n, _ in ins}
    packet = getattr(getattr(torch.ops, op.namespace), op._schema.name.split("::")[1])
    for name in packet.overloads():
        cand = getattr(packet, name)
        fargs = cand._schema.arguments
        if any(_is_out(a) for a in fargs):
            continue
        extras = tuple(a.name for a in fargs if a.name in OUT_FILLED and a.name not in names)
        if [(a.name, str(a.type)) for a in fargs if a.name not in extras] == ins:
            return cand, extras
    return None


def _with_dim_order(x: torch.Tensor, dim_order, copy: bool) -> torch.Tensor:
    if dim_order is None or list(dim_order) == list(range(x.dim())):
        return x.contiguous() if copy else x
    return torch.empty_permuted(x.shape, list(dim_order), dtype=x.dtype, device=x.device).copy_(x)


def _dim_order_ops(copy: bool) -> dict[str, tuple[str, Callable, tuple[str, ...]]]:
    def to_copy(x, non_blocking=False, dim_order=None, *, dtype):
        y = x.to(dtype, copy=copy, memory_format=torch.contiguous_format if copy else torch.preserve_format)
        return _with_dim_order(y, dim_order, copy=False)

    def clone(x, non_blocking=False, dim_order=None):
        return _with_dim_order(x, dim_order, copy=copy)

    def empty(size, dim_order=None, *, dtype, device):
        return torch.empty_permuted(size, list(dim_order or range(len(size))), dtype=dtype, device=device)

    ns = "dim_order_ops"
    return {
        f"{ns}::_to_dim_order_copy.out": (
            f"{ns}::_to_dim_order_copy.out(Tensor self, *, bool non_blocking=False, int[]? dim_order=None, "
            "Tensor(a!) out) -> Tensor(a!)", to_copy, ("dtype",)),
        f"{ns}::_clone_dim_order.out": (
            f"{ns}::_clone_dim_order.out(Tensor self, *, bool non_blocking=False, int[]? dim_order=None, "
            "Tensor(a!) out) -> Tensor(a!)", clone, ()),
        f"{ns}::_empty_dim_order.out": (
            f"{ns}::_empty_dim_order.out(int[] size, *, int[]? dim_order=None, Tensor(a!) out) -> Tensor(a!)",
            empty, ("dtype", "device")),
    }


_PRIM_BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "floordiv": operator.floordiv,
                "truediv": operator.truediv, "mod": operator.mod, "eq": operator.eq, "gt": operator.gt,
                "lt": operator.lt, "ge": operator.ge, "le": operator.le, "sym_max": max, "sym_min": min}
_PRIM_UNARY = {"neg": operator.neg, "sym_float": float, "sym_int": int, "ceil": math.ceil,
               "round": round, "trunc": math.trunc, "sym_not": operator.not_}


def _special_ops(copy: bool) -> dict[str, tuple[str, Callable, tuple[str, ...]]]:
    """ExecuTorch-specific operators: qualified name -> (schema, fn, out_kwargs)."""
    table = {
        "aten::sym_size.int": ("aten::sym_size.int(Tensor self, int dim) -> SymInt", lambda x, d: x.size(d), ()),
        "aten::sym_numel.default": ("aten::sym_numel(Tensor self) -> SymInt", lambda x: x.numel(), ()),
        "executorch_prim::et_view.default": (
            "executorch_prim::et_view(Tensor self, int[] size) -> Tensor",
            (lambda x, size: x.reshape(size).clone()) if copy else (lambda x, size: x.reshape(size)), ()),
    }
    for name, fn in _PRIM_BINARY.items():
        table[f"executorch_prim::{name}.Scalar"] = (f"executorch_prim::{name}.Scalar(Scalar a, Scalar b) -> Scalar",
                                                    fn, ())
    for name, fn in _PRIM_UNARY.items():
        table[f"executorch_prim::{name}.Scalar"] = (f"executorch_prim::{name}.Scalar(Scalar a) -> Scalar", fn, ())
    table.update(_dim_order_ops(copy))
    return table


def _view_fn(copy_name: str, functional) -> Optional[Callable]:
    """The torch view op with the functional `*_copy` op's signature."""
    if copy_name == "view_copy" and functional._overloadname == "default":  # reshape: views when it can
        return lambda x, size: x.reshape(size)
    view = _torch_op("aten", VIEW_COPY[copy_name], functional._overloadname)
    if view is None:
        return None
    names = [a.name for a in view._schema.arguments]
    return view if names == [a.name for a in functional._schema.arguments] else None


def servable(binding: OpBinding, name: str, local) -> OpBinding:
    """`binding` calling the callable the running call's table (`local.ops`) has for `name`, if any."""
    default = binding.fn

    def fn(*args, **kwargs):
        table = getattr(local, "ops", None)
        return (table.get(name, default) if table is not None else default)(*args, **kwargs)

    return dataclasses.replace(binding, fn=fn)


def custom_binding(qualified: str, overload: str, call: Callable) -> Optional[OpBinding]:
    """A custom op (e.g. `mg::update_and_attend.out`) served by `call`, which takes the functional inputs."""
    ns, name = qualified.split("::", 1)
    op = _torch_op(ns, name, overload or "default")
    return None if op is None else _binding(op._schema, call, custom=True)


def resolve(qualified: str, overload: str, views_as_copies: bool) -> Optional[OpBinding]:
    """Bind `ns::name.overload` from a program's operator table; None when this runner does not support it."""
    full = f"{qualified}.{overload or 'default'}"
    special = _special_ops(views_as_copies).get(full)
    if special is not None:
        schema, fn, out_kwargs = special
        return _binding(torch._C.parse_schema(schema), fn, out_kwargs=out_kwargs)
    ns, name = qualified.split("::", 1)
    if ns != "aten" or (name not in GENERIC_ATEN and name not in VIEW_COPY):
        return None
    op = _torch_op(ns, name, overload or "default")
    if op is None:
        return None
    is_out_variant = any(_is_out(a) for a in op._schema.arguments)
    found = functional_overload(op) if is_out_variant else (op, ())
    if found is None:
        return None
    functional, extras = found
    fn = functional
    if name in VIEW_COPY and not views_as_copies:
        fn = _view_fn(name, functional)
        if fn is None:
            return None
        return _binding(op._schema, fn, getattr(fn, "_schema", None))
    fill = tuple(e for e in extras if e in ("dtype", "device"))
    return _binding(op._schema, fn, functional._schema, out_kwargs=fill)


# -- steps: one instruction over the values table `v` (a list), everything precomputed at load --------

Target = tuple[int, Optional[int], Optional[int]]  # (value index, result component or None, list item or None)


@dataclass
class Step:
    run: Callable[[list], Optional[int]]  # returns a step index only for a taken jump
    inputs: tuple[int, ...]  # value indices read
    outputs: tuple[int, ...]  # value indices written
    foldable: bool  # pure: may be evaluated once at load when its inputs are known then


def fold(steps: list[Step], template: list, dynamic: set[int]) -> tuple[list[Step], int]:
    """Evaluate, once and into `template`, every step whose inputs are all known at load (straight-line code)."""
    known = {i for i in range(len(template)) if i not in dynamic}
    kept: list[Step] = []
    for s in steps:
        if s.foldable and all(i in known for i in s.inputs):
            s.run(template)
            known.update(s.outputs)
        else:
            kept.append(s)
            known.difference_update(s.outputs)
    return kept, len(steps) - len(kept)


def kernel_step(fn: Callable, arg_idx: tuple[int, ...], targets: tuple[Target, ...]) -> Callable[[list], None]:
    """Call `fn` on the values at `arg_idx` and store (parts of) the result at `targets`."""
    if len(targets) == 1 and targets[0][1:] == (None, None):
        t = targets[0][0]

        def run(v):
            v[t] = fn(*[v[i] for i in arg_idx])
    elif all(k is None and j is None for _, k, j in targets):
        ts = tuple(t for t, _, _ in targets)

        def run(v):
            r = fn(*[v[i] for i in arg_idx])
            for t in ts:
                v[t] = r
    else:
        def run(v):
            r = fn(*[v[i] for i in arg_idx])
            for t, k, j in targets:
                x = r if k is None else r[k]
                v[t] = x if j is None else x[j]
    return run


def pack_step(items: tuple[int, ...], dst: int) -> Callable[[list], None]:
    """Gather list items (value indices; -1 = None) into one list value, before an op reads it."""
    if any(i < 0 for i in items):
        def run(v):
            v[dst] = [None if i < 0 else v[i] for i in items]
    else:
        def run(v):
            v[dst] = [v[i] for i in items]
    return run


def move_step(src: int, dst: int) -> Callable[[list], None]:
    def run(v):
        v[dst] = v[src]
    return run


def free_step(idx: int) -> Callable[[list], None]:
    def run(v):
        v[idx] = None
    return run


def jump_false_step(cond: int, targets: list[int], k: int) -> Callable[[list], Optional[int]]:
    """Jump to step `targets[k]` (filled in once all steps exist) when the condition is false."""
    def run(v):
        c = v[cond]
        if isinstance(c, torch.Tensor):  # data-dependent control flow: a host sync is unavoidable
            c = bool(c.all())
        return None if c else targets[k]
    return run


def call_with_keywords(fn: Callable, n_positional: int, names: tuple[str, ...]) -> Callable:
    """`fn` taking its trailing keyword-only arguments positionally (for keywords computed at run time)."""
    def call(*args):
        return fn(*args[:n_positional], **dict(zip(names, args[n_positional:])))
    return call
