"""The `mg::` custom op schemas: what the exported graph calls instead of holding KV.

`mg::update_and_attend(q, k, v, positions, seq_slots, layer_id, scale)`:
  q [N, Hq, D] (normed, rotated), k/v [N, Hkv, D], positions [N] int64,
  seq_slots [N] int64 -> out [N, Hq, D].
  Writes the step's K/V into the runtime-owned cache at each token's
  (sequence, position) and returns each query's attention over its own
  sequence's keys at positions <= its own, inside the layer's window.

`mg::draft_attend(q, k, v, positions, seq_slots, n_ctx_valid?, layer_id, scale)`
is the drafter's op (see `draft_ops` below).

Only schemas, fake (shape) implementations and `.out` variants live here: the
graph names the layer and the runtime binds storage. A call of the registered
op (e.g. from compiled code) goes to the callable the runtime bound for the
calling thread with `serving(table)`; without one, the op's torch reference when it has one (the quantized
linears, `mg.kernels.quant`), else a clear error.
Knows nothing about caches' internals.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Mapping, Optional

import torch
from torch.library import Library

NAMESPACE = "mg"
UPDATE_AND_ATTEND = "update_and_attend"
DRAFT_APPEND = "draft_append"
DRAFT_ATTEND = "draft_attend"

_lib = Library(NAMESPACE, "DEF")

_ATTEND_ARGS = "Tensor q, Tensor k, Tensor v, Tensor positions, Tensor seq_slots, int layer_id, float scale"
_lib.define(f"{UPDATE_AND_ATTEND}({_ATTEND_ARGS}) -> Tensor")
_lib.define(f"{UPDATE_AND_ATTEND}.out({_ATTEND_ARGS}, *, Tensor(a!) out) -> Tensor(a!)")

# Drafter: append committed context K/V rows to the draft cache (returns k for data flow).
_APPEND_ARGS = "Tensor k, Tensor v, Tensor positions, Tensor seq_slots, int layer_id"
_lib.define(f"{DRAFT_APPEND}({_APPEND_ARGS}) -> Tensor")
_lib.define(f"{DRAFT_APPEND}.out({_APPEND_ARGS}, *, Tensor(a!) out) -> Tensor(a!)")

# Drafter: non-causal attention of block queries over (cached context of the sequence) + (block K/V).
#   q [B, T, Hq, D]; k/v [B, T, Hkv, D]; positions [B, T] (block positions); seq_slots [B].
_DRAFT_ARGS = "Tensor q, Tensor k, Tensor v, Tensor positions, Tensor seq_slots, int layer_id, float scale"
_lib.define(f"{DRAFT_ATTEND}({_DRAFT_ARGS}) -> Tensor")
_lib.define(f"{DRAFT_ATTEND}.out({_DRAFT_ARGS}, *, Tensor(a!) out) -> Tensor(a!)")


_serving = threading.local()  # .table: qualified name ("mg::update_and_attend") -> callable, per thread


@contextlib.contextmanager
def serving(table: Mapping[str, Callable]) -> Iterator[None]:
    """Serve the `mg::` ops called on this thread with `table` (qualified name -> functional callable) while
    the block runs: how compiled code, which calls the registered ops, reaches a runtime's caches."""
    previous = getattr(_serving, "table", None)
    _serving.table = table
    try:
        yield
    finally:
        _serving.table = previous


def _dispatch(name: str, out: bool, fallback: Optional[Callable] = None):
    """The registered implementation of `mg::name` (`.out` when `out`): the calling thread's served callable,
    else `fallback` (a torch reference), else a clear error."""
    key = f"{NAMESPACE}::{name}"

    def fn(*args, **kwargs):
        table = getattr(_serving, "table", None)
        impl = (None if table is None else table.get(key)) or fallback
        if impl is None:
            raise RuntimeError(
                f"mg::{name} attends over a runtime-owned KV cache; run it through mg.runtime "
                f"(or pass a cache's method as the model's attention backend), not eagerly")
        result = impl(*args)
        if any(result is a for a in args):  # a registered op's output must not alias its inputs
            result = result.clone()
        return kwargs["out"].copy_(result) if out else result
    return fn


for _name in (UPDATE_AND_ATTEND, DRAFT_APPEND, DRAFT_ATTEND):
    _lib.impl(_name, _dispatch(_name, False), "CompositeExplicitAutograd")
    _lib.impl(f"{_name}.out", _dispatch(_name, True), "CompositeExplicitAutograd")


@torch.library.register_fake(f"{NAMESPACE}::{UPDATE_AND_ATTEND}")
def _update_and_attend_fake(q, k, v, positions, seq_slots, layer_id, scale):
    return q.new_empty(q.shape)


@torch.library.register_fake(f"{NAMESPACE}::{UPDATE_AND_ATTEND}.out")
def _update_and_attend_out_fake(q, k, v, positions, seq_slots, layer_id, scale, *, out):
    return out


@torch.library.register_fake(f"{NAMESPACE}::{DRAFT_APPEND}")
def _draft_append_fake(k, v, positions, seq_slots, layer_id):
    return k.new_empty(k.shape)


@torch.library.register_fake(f"{NAMESPACE}::{DRAFT_APPEND}.out")
def _draft_append_out_fake(k, v, positions, seq_slots, layer_id, *, out):
    return out


@torch.library.register_fake(f"{NAMESPACE}::{DRAFT_ATTEND}")
def _draft_attend_fake(q, k, v, positions, seq_slots, layer_id, scale):
    return q.new_empty(q.shape)


@torch.library.register_fake(f"{NAMESPACE}::{DRAFT_ATTEND}.out")
def _draft_attend_out_fake(q, k, v, positions, seq_slots, layer_id, scale, *, out):
    return out


def op_names() -> tuple[str, ...]:
    """Qualified names as they appear in an ExecuTorch program's operator table."""
    return tuple(f"{NAMESPACE}::{n}" for n in (UPDATE_AND_ATTEND, DRAFT_APPEND, DRAFT_ATTEND))
