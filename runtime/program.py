"""The program runner: executes the methods of an ExecuTorch `.pte` program with torch ops.

The file is read with ExecuTorch's own Python deserializer. Constant tensors
(weights) are loaded once per `Program`, on its device, and shared by all
methods: from the program's constant buffer, or, for external constants
(`TensorDataLocation.EXTERNAL`), by their fully qualified name from a `.ptd`
data file (`DataFile`: used in place on CPU, copied tensor by tensor to CUDA),
after checking the file holds each key with the program's dtype and shape. Each method's instruction chain becomes a list of precomputed steps
over a values table: the per-call loop only indexes lists and calls torch.
Constant subgraphs (e.g. weight permutes) are evaluated once at load. Custom
ops (`mg::*`) are served by Python callables bound by the caller, who may also serve `aten::mm`
(`program_ops.SERVABLE_ATEN`: the runtime's float products). Unsupported
operators or instructions are refused at load, naming them.

Knows the ExecuTorch program format and the operator table (`program_ops`);
knows nothing about MG models, KV caches or the export code.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from mg.kernels.executorch_env import ensure_flatc

from . import program_ops as ops
from .data_file import SCALAR_TYPES, DataFile

# ExecuTorch ScalarType / MemoryFormat codes (c10 numbering) -> torch.
_DTYPES = SCALAR_TYPES
_MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.preserve_format, 2: torch.channels_last,
                   3: torch.channels_last_3d}
_CONVERT = {"ScalarType": _DTYPES.__getitem__, "MemoryFormat": _MEMORY_FORMATS.__getitem__,
            "Layout": lambda code: torch.strided}
_STATIC_SHAPE = 0  # schema.TensorShapeDynamism.STATIC
_DYNAMIC_BOUND = 1


class ProgramError(ValueError):
    """A program this runner cannot load, or a call it cannot run; one line naming the file, method or op."""


@dataclass(frozen=True)
class MethodInfo:
    name: str
    n_inputs: int
    operators: tuple[str, ...]  # qualified "ns::name.overload", as in the method's operator table
    n_steps: int  # steps run per call (after folding)
    n_folded: int  # steps evaluated once at load


@dataclass
class _Method:
    template: list  # the values table every call starts from: constants, folded results, None
    inputs: list[int]
    input_specs: list  # schema.Tensor (or None for non-tensor inputs)
    outputs: list[int]
    steps: list[Callable]
    straight: bool  # no jumps: the loop is a plain for
    custom_ops: frozenset[str]
    list_output: bool
    info: MethodInfo


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def deserialize(data: bytes, source: str):
    """-> the schema.Program of a `.pte` buffer; ProgramError (one line naming `source`) if it is not one."""
    if len(data) < 8 or data[4:6] != b"ET":
        raise ProgramError(f"{source}: not an ExecuTorch program (no 'ET' file identifier)")
    ensure_flatc()
    deserialize_pte_binary = _reader()[0]
    try:
        result = deserialize_pte_binary(data)
    except Exception as e:  # the flatbuffer and segment readers fail in many ways on damaged input
        raise ProgramError(f"{source}: corrupt or truncated ExecuTorch program "
                           f"({type(e).__name__}: {first_line(e)})") from None
    return getattr(result, "program", result)  # executorch 1.5: PTEFile; 1.2: Program


_READER: Optional[tuple] = None


def _reader() -> tuple:
    """(deserialize_pte_binary, the schema module). Importing them runs `executorch.exir`'s package init,
    which imports the whole exporter (about 3 s on a 2-core CPU, against 0.4 s for the reader itself). Where
    the exporter is not loaded yet, the reader's modules are imported under a bare stand-in for that package,
    which is then dropped (a later `import executorch.exir` runs the real init and reuses these modules); on
    any failure the stand-in and what was imported under it go, and the ordinary import runs."""
    global _READER
    if _READER is not None:
        return _READER
    if "executorch.exir" not in sys.modules:
        import executorch

        stub = types.ModuleType("executorch.exir")
        stub.__path__ = [str(Path(list(executorch.__path__)[0]) / "exir")]
        sys.modules["executorch.exir"] = stub
        try:
            from executorch.exir import schema
            from executorch.exir._serialize._program import deserialize_pte_binary
            _READER = (deserialize_pte_binary, schema)
        except Exception:  # another executorch layout: forget everything imported under the stand-in
            for name in [n for n in sys.modules if n == "executorch.exir" or n.startswith("executorch.exir.")]:
                del sys.modules[name]
        finally:
            if sys.modules.get("executorch.exir") is stub:
                del sys.modules["executorch.exir"]
    if _READER is None:
        from executorch.exir import schema
        from executorch.exir._serialize._program import deserialize_pte_binary
        _READER = (deserialize_pte_binary, schema)
    return _READER


def _qualified(op) -> str:
    return f"{op.name}.{op.overload}" if op.overload else op.name


def _list_output(plan) -> bool:
    try:
        return json.loads(plan.container_meta_type.encoded_out_str)[1]["type"] == "builtins.list"
    except (ValueError, LookupError, TypeError):
        return False


class Program:
    """A loaded `.pte`: `run(method, inputs)` executes a method; `constant(name)` reads a constant method."""

    def __init__(self, program, source: str, device: str | torch.device = "cpu",
                 dtype: Optional[torch.dtype] = None, custom_ops: Optional[dict[str, Optional[Callable]]] = None,
                 views_as_copies: bool = False, fold_constants: bool = True, data: Optional[DataFile] = None):
        """`custom_ops` maps qualified names ("mg::update_and_attend") to functional callables, or None
        for ops bound later with `bind`. `dtype`, when given, is checked against the stored weights. `data`
        serves the program's external constants."""
        self._S = _reader()[1]
        self.source = source
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.views_as_copies = views_as_copies
        self.fold_constants = fold_constants
        self._program = program
        self._bindings: dict[str, Optional[Callable]] = dict(custom_ops or {})
        self._local = threading.local()  # .ops: the table of the `run` in progress on this thread
        self._weights: dict[int | str, torch.Tensor] = {}  # data_buffer_idx or external key -> tensor on device
        self._data = data
        self._methods = {plan.name: self._build(plan) for plan in program.execution_plan}
        if data is not None:
            data.release_staging()
        self._check_dtype(dtype)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None,
             data_path: Optional[str | Path] = None, **kwargs: Any) -> "Program":
        """Load a `.pte`; `data_path` names the `.ptd` holding its external constants."""
        try:
            buffer = Path(path).read_bytes()
        except OSError as e:
            raise ProgramError(f"{path}: cannot read the program ({e.strerror or first_line(e)})") from None
        data = DataFile(data_path) if data_path is not None else None
        return cls(deserialize(buffer, str(path)), str(path), device, dtype, data=data, **kwargs)

    # -- public API -------------------------------------------------------------------------------

    @property
    def method_names(self) -> tuple[str, ...]:
        return tuple(self._methods)

    def info(self, method_name: str) -> MethodInfo:
        return self._method(method_name).info

    def loaded_values(self, method_name: str) -> list:
        """The values table a call of the method starts from: its constants (weights, values folded at load,
        scalars), None where the call computes the value. Shared: never modify it."""
        return self._method(method_name).template

    def bind(self, op_name: str, fn: Optional[Callable]) -> None:
        """Serve custom op `op_name` (declared in `custom_ops`) with `fn` by default; None unbinds it.
        A caller that shares the program with others passes its own table to `run(..., ops=)` instead."""
        if op_name not in self._bindings:
            raise ProgramError(f"{self.source}: custom op {op_name!r} was not declared; declared: "
                               f"{', '.join(sorted(self._bindings)) or 'none'}")
        self._bindings[op_name] = fn

    def constant(self, name: str) -> int | list[int]:
        """The value of a constant method (no inputs): an int, or a list of ints."""
        m = self._method(name)
        if m.inputs:
            raise ProgramError(f"{self.source}: method {name!r} takes {len(m.inputs)} inputs; not a constant method")
        out = self.run(name, [])
        return list(out) if m.list_output else out[0]

    def run(self, method_name: str, inputs: Sequence[Any], ops: Optional[dict[str, Callable]] = None) -> list:
        """Execute a method. `ops` serves the custom ops for this call (it must cover every custom op the
        method uses); without it the defaults from `custom_ops` / `bind` serve them. Several callers can
        share one loaded program, each with its own caches, by passing their own `ops`. `ops` may also serve
        the aten ops of `program_ops.SERVABLE_ATEN` ("aten::mm"); those it leaves out run as torch's."""
        m = self._method(method_name)
        table = self._bindings if ops is None else ops
        unbound = [n for n in m.custom_ops if table.get(n) is None]
        if unbound:
            raise ProgramError(f"method {method_name!r}: custom op {unbound[0]!r} is not bound; pass it in ops= "
                               f"or call bind() first")
        if len(inputs) != len(m.inputs):
            raise ProgramError(f"method {method_name!r} takes {len(m.inputs)} inputs; got {len(inputs)}")
        vals = list(m.template)
        for k, (idx, spec, x) in enumerate(zip(m.inputs, m.input_specs, inputs)):
            if spec is not None:
                self._check_input(method_name, k, spec, x)
                if x.device != self.device:
                    x = x.to(self.device, non_blocking=True)
            vals[idx] = x
        local = self._local
        previous, local.ops = getattr(local, "ops", None), table
        try:
            if m.straight:
                for step in m.steps:
                    step(vals)
            else:
                pc, steps, n = 0, m.steps, len(m.steps)
                while pc < n:
                    nxt = steps[pc](vals)
                    pc = pc + 1 if nxt is None else nxt
        finally:
            local.ops = previous
        return [vals[i] for i in m.outputs]

    # -- loading --------------------------------------------------------------------------------------

    def _method(self, name: str) -> _Method:
        try:
            return self._methods[name]
        except KeyError:
            raise ProgramError(f"{self.source}: no method {name!r}; methods: {', '.join(self._methods)}") from None

    def _check_input(self, method: str, k: int, spec, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise ProgramError(f"method {method!r} input {k}: expected a tensor, got {type(x).__name__}")
        want = _DTYPES.get(int(spec.scalar_type))
        bounds = spec.sizes
        too_big = spec.shape_dynamism == _DYNAMIC_BOUND and any(s > b for s, b in zip(x.shape, bounds))
        wrong = spec.shape_dynamism == _STATIC_SHAPE and list(x.shape) != list(bounds)
        if x.dtype != want or x.dim() != len(bounds) or too_big or wrong:
            raise ProgramError(f"method {method!r} input {k}: got {x.dtype} {list(x.shape)}; allowed: {want} "
                               f"with shape {'<= ' if spec.shape_dynamism == _DYNAMIC_BOUND else ''}{list(bounds)}")

    def _check_dtype(self, dtype: Optional[torch.dtype]) -> None:
        stored = {w.dtype for w in self._weights.values() if w.is_floating_point() and w.dim() >= 2}
        if dtype is not None and stored - {dtype}:
            raise ProgramError(f"{self.source}: weights are stored as {', '.join(sorted(map(str, stored)))}; "
                               f"dtype {dtype} was asked for")

    def _weight(self, method: str, index: int, t) -> torch.Tensor:
        buf = t.data_buffer_idx
        if buf not in self._weights:
            dtype = _DTYPES.get(int(t.scalar_type))
            if dtype is None:
                raise ProgramError(f"{self.source}: method {method!r} value {index} has scalar type "
                                   f"{t.scalar_type!r}, which this runner does not support")
            raw = self._program.constant_buffer[buf].storage if buf < len(self._program.constant_buffer) else b""
            start, nbytes = t.storage_offset * dtype.itemsize, math.prod(t.sizes) * dtype.itemsize
            if len(raw) < start + nbytes:
                raise ProgramError(f"{self.source}: constant buffer {buf} holds {len(raw)} bytes; method "
                                   f"{method!r} value {index} needs {start + nbytes} (truncated program?)")
            flat = torch.frombuffer(bytearray(raw[start:start + nbytes]), dtype=dtype) if nbytes else \
                torch.empty(0, dtype=dtype)
            order = list(t.dim_order)
            physical = flat.view([t.sizes[d] for d in order])
            self._weights[buf] = physical.permute(sorted(range(len(order)), key=order.__getitem__)).to(self.device)
        return self._weights[buf]

    def _external(self, method: str, t, key: str) -> torch.Tensor:
        """External constant `key` from the data file, checked against the program's dtype and shape."""
        if key not in self._weights:
            data = self._data
            if data is None:
                raise ProgramError(f"{self.source}: method {method!r} constant {key!r} lives in an external data "
                                   f"file (.ptd); none was given")
            entry = data.entries.get(key)
            want_dtype, want = _DTYPES.get(int(t.scalar_type)), tuple(t.sizes)
            if entry is None:
                raise ProgramError(f"{data.path}: holds no tensor {key!r}, which method {method!r} of "
                                   f"{self.source} needs (a data file from another export?)")
            if entry.dtype != want_dtype or entry.sizes != want:
                raise ProgramError(f"{data.path}: tensor {key!r} is {entry.dtype} {list(entry.sizes)}; method "
                                   f"{method!r} of {self.source} expects {want_dtype} {list(want)} (a data file "
                                   f"from another export?)")
            self._weights[key] = data.tensor(key, self.device)
        return self._weights[key]

    def _template(self, plan, dynamic: set[int]) -> list:
        S = self._S
        values: list = [None] * len(plan.values)
        lists = []
        for i, ev in enumerate(plan.values):
            v = ev.val
            if isinstance(v, (S.Int, S.Bool, S.String)):
                values[i] = getattr(v, {S.Int: "int_val", S.Bool: "bool_val", S.String: "string_val"}[type(v)])
            elif isinstance(v, S.Double):
                values[i] = float(v.double_val)  # "inf" / "-inf" are stored as strings
            elif isinstance(v, (S.DoubleList, S.BoolList)):
                values[i] = list(v.items)
            elif isinstance(v, (S.IntList, S.TensorList, S.OptionalTensorList)):
                lists.append((i, v))
            elif isinstance(v, S.Tensor):
                info = v.extra_tensor_info
                if info is not None and info.location == S.TensorDataLocation.EXTERNAL:
                    values[i] = self._external(plan.name, v, info.fully_qualified_name)
                elif v.data_buffer_idx > 0 and v.allocation_info is None and i not in dynamic:
                    values[i] = self._weight(plan.name, i, v)
            elif not isinstance(v, S.Null):
                raise ProgramError(f"{self.source}: method {plan.name!r} value {i} is a {type(v).__name__}, "
                                   f"which this runner does not support")
        for i, v in lists:
            if not any(j in dynamic for j in v.items):
                values[i] = [None if j < 0 else values[j] for j in v.items]
        return values

    def _build(self, plan) -> _Method:
        S = self._S
        bindings = [self._resolve(plan, op) for op in plan.operators]
        instructions = [ins.instr_args for chain in plan.chains for ins in chain.instructions]
        dynamic = set(plan.inputs)
        for a in instructions:
            if isinstance(a, S.KernelCall):
                dynamic.update(t for t, _, _ in self._targets(plan, a, bindings[a.op_index]))
            elif isinstance(a, S.MoveCall):
                dynamic.add(a.move_to)
            elif isinstance(a, S.FreeCall):
                dynamic.add(a.value_index)
        lists = (S.IntList, S.TensorList, S.OptionalTensorList)
        dynamic.update(i for i, ev in enumerate(plan.values)
                       if isinstance(ev.val, lists) and any(j in dynamic for j in ev.val.items))
        template = self._template(plan, dynamic)
        steps, jump_targets = self._steps(plan, bindings, template, dynamic)
        n_folded = 0
        if self.fold_constants and not jump_targets:
            steps, n_folded = ops.fold(steps, template, dynamic)
        specs = [plan.values[i].val for i in plan.inputs]
        operators = tuple(_qualified(op) for op in plan.operators)
        return _Method(
            template=template, inputs=list(plan.inputs),
            input_specs=[v if isinstance(v, S.Tensor) else None for v in specs], outputs=list(plan.outputs),
            steps=[s.run for s in steps], straight=not jump_targets,
            custom_ops=frozenset(op.name for op in plan.operators if op.name in self._bindings),
            list_output=_list_output(plan),
            info=MethodInfo(plan.name, len(plan.inputs), operators, len(steps), n_folded))

    def _steps(self, plan, bindings, template: list, dynamic: set[int]) -> tuple[list[ops.Step], list[int]]:
        """All chains' instructions as steps (ExecuTorch runs the chains in order), and the jump targets."""
        S = self._S
        steps: list[ops.Step] = []
        jump_targets: list[int] = []  # step index of each jump's destination, filled per chain
        for chain in plan.chains:
            first: list[int] = []  # instruction -> its first step
            jumps: list[tuple[int, int]] = []
            for ins in chain.instructions:
                first.append(len(steps))
                a = ins.instr_args
                if isinstance(a, S.KernelCall):
                    steps += self._kernel(plan, a, bindings[a.op_index], template, dynamic)
                elif isinstance(a, S.MoveCall):
                    steps.append(ops.Step(ops.move_step(a.move_from, a.move_to), (a.move_from,), (a.move_to,), True))
                elif isinstance(a, S.FreeCall):
                    steps.append(ops.Step(ops.free_step(a.value_index), (), (a.value_index,), False))
                elif isinstance(a, S.JumpFalseCall):
                    jumps.append((len(jump_targets), a.destination_instruction))
                    jump = ops.jump_false_step(a.cond_value_index, jump_targets, len(jump_targets))
                    steps.append(ops.Step(jump, (a.cond_value_index,), (), False))
                    jump_targets.append(-1)
                else:
                    what = " (backend delegates are not supported)" if isinstance(a, S.DelegateCall) else ""
                    raise ProgramError(f"{self.source}: method {plan.name!r} uses a {type(a).__name__} "
                                       f"instruction, which this runner does not support{what}")
            first.append(len(steps))
            for k, dest in jumps:
                jump_targets[k] = first[min(dest, len(first) - 1)]
        return steps, jump_targets

    def _resolve(self, plan, op) -> ops.OpBinding:
        if op.name in self._bindings:
            local, key = self._local, op.name
            binding = ops.custom_binding(op.name, op.overload, lambda *a: local.ops[key](*a))
            if binding is None:
                raise ProgramError(f"{self.source}: method {plan.name!r} uses custom op {_qualified(op)!r}, whose "
                                   f"schema is not registered with torch (import the package that defines it)")
        else:
            binding = ops.resolve(op.name, op.overload, self.views_as_copies)
            if binding is not None and op.name in ops.SERVABLE_ATEN:
                binding = ops.servable(binding, op.name, self._local)
        if binding is None:
            hint = "" if op.name.split("::")[0] in ("aten", "executorch_prim", "dim_order_ops") else \
                f" (declare custom ops in custom_ops; declared: {', '.join(sorted(self._bindings)) or 'none'})"
            raise ProgramError(f"{self.source}: method {plan.name!r} uses operator {_qualified(op)!r} "
                               f"which this runner does not support{hint}")
        return binding

    def _targets(self, plan, call, b: ops.OpBinding) -> tuple[ops.Target, ...]:
        """Where the results go: each out argument and the return values aliasing it. ExecuTorch passes
        one value per return, or all returns packed in one TensorList, or the out list for `-> ()`."""
        n = len(b.out_positions) or b.n_returns
        rets = list(call.args[b.n_args:])
        packed = n > 1 and len(rets) == 1 and isinstance(plan.values[rets[0]].val, self._S.TensorList)
        if not (len(rets) == b.n_returns or (b.out_positions and len(rets) == n) or packed):
            op = _qualified(plan.operators[call.op_index])
            raise ProgramError(f"{self.source}: method {plan.name!r} calls {op!r} with {len(call.args)} values; "
                               f"its schema takes {b.n_args} arguments and {b.n_returns} returns")
        rets = list(plan.values[rets[0]].val.items) if packed else rets
        out: list[ops.Target] = []
        for c in range(n):
            k = None if n == 1 else c
            idxs = [call.args[b.out_positions[c]]] if b.out_positions else []
            idxs += [rets[c]] if c < len(rets) else []
            for idx in idxs:
                v = plan.values[idx].val
                if isinstance(v, self._S.TensorList):
                    out += [(item, k, j) for j, item in enumerate(v.items)]
                else:
                    out.append((idx, k, None))
        return tuple(dict.fromkeys(out))

    def _kernel(self, plan, call, b: ops.OpBinding, template: list, dynamic: set[int]) -> list[ops.Step]:
        S = self._S
        steps: list[ops.Step] = []
        positional: list[int] = []
        kw_static: dict[str, Any] = {}
        kw_dynamic: list[tuple[str, int]] = []
        for j, (pos, typ) in enumerate(zip(b.input_positions, b.input_types)):
            idx = call.args[pos]
            convert = _CONVERT.get(typ)
            v = plan.values[idx].val
            if convert is not None:
                if idx in dynamic:
                    raise ProgramError(f"{self.source}: method {plan.name!r}: a {typ} argument of "
                                       f"{_qualified(plan.operators[call.op_index])!r} is computed at run time")
                template.append(None if template[idx] is None else convert(template[idx]))
                idx = len(template) - 1
            elif idx in dynamic and isinstance(v, (S.IntList, S.TensorList, S.OptionalTensorList)):
                items = tuple(v.items)
                steps.append(ops.Step(ops.pack_step(items, idx), tuple(i for i in items if i >= 0), (idx,), True))
            if j < b.n_positional:
                positional.append(idx)
            elif idx in dynamic:
                kw_dynamic.append((b.kwarg_names[j - b.n_positional], idx))
            else:
                kw_static[b.kwarg_names[j - b.n_positional]] = template[idx]
        if "dtype" in b.out_kwargs:
            kw_static["dtype"] = _DTYPES[int(plan.values[call.args[b.out_positions[0]]].val.scalar_type)]
        if "device" in b.out_kwargs:
            kw_static["device"] = self.device
        fn = functools.partial(b.fn, **kw_static) if kw_static else b.fn
        if kw_dynamic:
            fn = ops.call_with_keywords(fn, len(positional), tuple(n for n, _ in kw_dynamic))
            positional += [i for _, i in kw_dynamic]
        targets = self._targets(plan, call, b)
        steps.append(ops.Step(ops.kernel_step(fn, tuple(positional), targets), tuple(positional),
                              tuple(t for t, _, _ in targets), not b.custom))
        return steps

