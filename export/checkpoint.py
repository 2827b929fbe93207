"""The native checkpoint format: a directory with `config.json` and `model.safetensors`.

Tensor names are the model's parameter names (see README, "Checkpoint format").
Loading checks every expected tensor is present with the expected shape and
that nothing unexpected is there. Knows nothing about ExecuTorch.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import ConfigError, read_config

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file, a tensor, or holds a misshapen one."""


def expected_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def load_state(directory: Path, model: torch.nn.Module) -> None:
    """Load the weights of checkpoint `directory` (single file or shards) into `model`, refusing missing, extra,
    misshapen or non-float tensors."""
    from .weights import SafetensorsWeights, materialize

    weights = SafetensorsWeights(directory)
    try:
        weights.check(expected_shapes(model))
        materialize(weights, model)
    finally:
        weights.close()


def load_config(directory: Path, cls: type):
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory (a checkpoint is a directory with {CONFIG_FILE} "
                              f"and {WEIGHTS_FILE})")
    try:
        return read_config(cls, directory / CONFIG_FILE)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def save_checkpoint(directory: Path, cfg, model: torch.nn.Module) -> None:
    """Write `config.json` and `model.safetensors` (used by tests and the training script)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(cfg.to_json_dict(), indent=2) + "\n", encoding="utf-8")
    state = {k: v.detach().contiguous() for k, v in model.named_parameters()}
    save_file(state, str(directory / WEIGHTS_FILE))
