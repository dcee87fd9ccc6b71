"""Reading state dicts from memory or disk and copying them into a module in place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

WeightsSource = Mapping[str, Any] | str | os.PathLike


def load_state_dict_source(weights: WeightsSource) -> dict[str, torch.Tensor]:
    """Turn a state dict, a ``torch.save``'d file, a ``.safetensors`` file or a
    ``save_pretrained`` folder into a ``{name: tensor}`` dict on the CPU.

    Example:
        >>> sd = load_state_dict_source(torch.nn.Linear(2, 1).state_dict())
        >>> sorted(sd)
        ['bias', 'weight']
    """
    if isinstance(weights, Mapping):
        state = dict(weights)
    elif isinstance(weights, (str, os.PathLike)):
        state = _read_path(Path(weights))
    else:
        raise TypeError(f"weights must be a state dict or a path, got {type(weights).__name__}")
    bad = [name for name, value in state.items() if not isinstance(value, torch.Tensor)]
    if bad:
        raise ValueError(f"state dict entries must be tensors; not tensors: {bad[:5]}")
    return state


def _read_path(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise FileNotFoundError(f"no weights at {path}")
    if path.is_dir():
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
        if not files:
            raise FileNotFoundError(f"{path} holds no *.safetensors or pytorch_model*.bin weights")
    else:
        files = [path]
    state: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state.update(load_file(str(file), device="cpu"))
        else:
            loaded = torch.load(file, map_location="cpu", weights_only=True)
            if not isinstance(loaded, Mapping):
                raise ValueError(f"{file} holds a {type(loaded).__name__}, not a state dict")
            state.update(loaded)
    return state


def apply_state_dict(module: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``module`` in place after checking every name and shape.

    Nothing is copied unless everything fits, so a bad checkpoint never leaves the module
    half-updated. A tied parameter (one storage under several names, e.g. GPT-2's
    ``lm_head.weight``) may be given under any one of its names.

    Raises:
        ValueError: missing or unexpected names, or shape mismatches.

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> apply_state_dict(net, {"weight": torch.ones(1, 2), "bias": torch.zeros(1)})
        >>> net.weight.sum().item()
        2.0
    """
    own = module.state_dict()
    aliases: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[str]] = {}
    for name, tensor in own.items():
        aliases.setdefault((tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride())), []).append(name)
    group_of = {name: names for names in aliases.values() for name in names}
    missing = [name for name in own if not any(alias in state for alias in group_of[name])]
    unexpected = [name for name in state if name not in own]
    mismatched = [
        f"{name}: got {tuple(state[name].shape)}, expected {tuple(own[name].shape)}"
        for name in state
        if name in own and tuple(state[name].shape) != tuple(own[name].shape)
    ]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} (e.g. {unexpected[:3]})")
        if mismatched:
            parts.append(f"shape mismatch {len(mismatched)} (e.g. {mismatched[:3]})")
        raise ValueError(f"weights do not fit {type(module).__name__}: " + "; ".join(parts))
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor)
