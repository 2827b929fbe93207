"""The native checkpoint format: a directory with `config.json` and `model.safetensors`.

Tensor names are the model's parameter names (see README, "Checkpoint format").
Loading checks every expected tensor is present with the expected shape and
that nothing unexpected is there. Knows nothing about ExecuTorch.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import ConfigError, read_config

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file, a tensor, or holds a misshapen one."""


def expected_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def load_state(directory: Path, model: torch.nn.Module) -> None:
    """Load `model.safetensors` of `directory` into `model`, refusing missing, extra or misshapen tensors."""
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found (a checkpoint directory holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types across versions
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    want = expected_shapes(model)
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise CheckpointError(f"{path}: missing tensor '{missing[0]}' with shape {list(want[missing[0]])}"
                              f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise CheckpointError(f"{path}: unexpected tensor '{extra[0]}'; this configuration has "
                              f"{len(want)} tensors (see the checkpoint format in README.md)")
    for name, shape in want.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise CheckpointError(f"{path}: tensor '{name}' has shape {list(got)}; expected {list(shape)}")
        if not tensors[name].is_floating_point():
            raise CheckpointError(f"{path}: tensor '{name}' has dtype {tensors[name].dtype}; expected a float dtype")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t.to(params[name].dtype))


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
