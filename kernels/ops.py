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
graph names the layer and the runtime binds storage. Calling an op eagerly
without a runtime raises a clear error. Knows nothing about caches' internals.
"""

from __future__ import annotations

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


def _unbound(name: str):
    def fn(*args, **kwargs):
        raise RuntimeError(
            f"mg::{name} attends over a runtime-owned KV cache; run it through mg.runtime "
            f"(or pass a cache's method as the model's attention backend), not eagerly")
    return fn


for _name in (UPDATE_AND_ATTEND, DRAFT_APPEND, DRAFT_ATTEND):
    _lib.impl(_name, _unbound(_name), "CompositeExplicitAutograd")
    _lib.impl(f"{_name}.out", _unbound(_name), "CompositeExplicitAutograd")


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
