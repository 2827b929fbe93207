"""Lowering: the MG model (and drafter) -> ExecuTorch program + constant methods.

`torch.export` with a dynamic token count, `to_edge`, `to_executorch` with
portable out-variant ops, no delegate, views kept as `*_copy` ops
(`remove_view_copy=False`) and graph inputs not memory-planned. Attention is
the `mg::` op family; the graph holds no KV. Knows nothing about the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.export import Dim

import mg.kernels  # noqa: F401  (registers mg:: ops)
from mg.manifests import KVSpec, constants as C
from mg.manifests.values import target_constant_values

from .config import MuseGlimmerConfig
from .model import MuseGlimmer

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
class ProgramParts:
    """What `to_edge` receives: exported methods and constant methods."""

    methods: dict  # name -> torch.export.ExportedProgram
    constants: dict  # name -> int | list[int]


def export_target(model: MuseGlimmer, max_write: int, taps: tuple[int, ...] = ()):
    """torch.export the target forward with N in [1, max_write] and R in [1, max_write]."""
    if max_write < 2:
        raise ValueError(f"max_write is {max_write}; allowed: an integer >= 2")
    n = Dim("n_tokens", min=1, max=max_write)
    r = Dim("n_logits", min=1, max=max_write)
    example = (torch.tensor([5, 6], dtype=torch.long), torch.tensor([0, 1], dtype=torch.long),
               torch.zeros(2, dtype=torch.long), torch.tensor([0, 1], dtype=torch.long))
    with torch.no_grad():
        return torch.export.export(TargetForward(model, taps).eval(), example,
                                   dynamic_shapes=({0: n}, {0: n}, {0: n}, {0: r}), strict=False)


def target_constants(cfg: MuseGlimmerConfig, kv: KVSpec) -> dict:
    """The target's constant methods (the values the runtime will expect from the manifest)."""
    return target_constant_values(cfg.vocab_size, cfg.n_layers, kv, cfg.bos_id, tuple(cfg.eos_ids))


def to_program(parts: ProgramParts, progress: Optional[Progress] = None) -> bytes:
    """Lower exported methods + constant methods to one ExecuTorch program buffer."""
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge
    from executorch.exir.passes import MemoryPlanningPass

    say = progress or (lambda msg: None)
    say(f"to_edge: {len(parts.methods)} method(s), {len(parts.constants)} constant method(s)")
    edge = to_edge(parts.methods, constant_methods=parts.constants,
                   compile_config=EdgeCompileConfig(_check_ir_validity=False))
    say("to_executorch: portable out-variant ops, no delegate")
    config = ExecutorchBackendConfig(
        remove_view_copy=False,
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
    )
    return edge.to_executorch(config).buffer
