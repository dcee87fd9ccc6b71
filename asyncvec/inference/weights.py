"""Reading state dicts from memory or disk, checking them against a model, writing checkpoints."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
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
    _raise_if_unfit(f"weights do not fit {type(module).__name__}", missing, unexpected, mismatched)
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor)


def _raise_if_unfit(what: str, missing: list[str], unexpected: list[str], mismatched: list[str]) -> None:
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} (e.g. {missing[:3]})")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)} (e.g. {unexpected[:3]})")
    if mismatched:
        parts.append(f"shape mismatch {len(mismatched)} (e.g. {mismatched[:3]})")
    if parts:
        raise ValueError(f"{what}: " + "; ".join(parts))


def state_dict_of(weights: Any) -> dict[str, torch.Tensor]:
    """Like `load_state_dict_source`, and also takes a ``torch.nn.Module`` (its ``state_dict()``).

    Example:
        >>> sorted(state_dict_of(torch.nn.Linear(2, 1)))
        ['bias', 'weight']
    """
    if isinstance(weights, torch.nn.Module):
        return dict(weights.state_dict())
    return load_state_dict_source(weights)


@dataclass(frozen=True)
class ParameterSpec:
    """Names and shapes a checkpoint of a transformers model must hold, and its tied names.

    ``tied`` maps a tied name (e.g. GPT-2's ``lm_head.weight``) to the name it shares storage
    with (``transformer.wte.weight``). Built from the model's ``config.json`` on the meta
    device: no weights are read or allocated.

    Example:
        >>> import tempfile
        >>> from asyncvec.inference import build_tiny_lm
        >>> spec = ParameterSpec.from_model_dir(build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32))
        >>> spec.tied, spec.shapes["transformer.wte.weight"]
        ({'lm_head.weight': 'transformer.wte.weight'}, (92, 32))
    """

    shapes: Mapping[str, tuple[int, ...]]
    tied: Mapping[str, str]

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> ParameterSpec:
        import transformers

        config = transformers.AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
        if not isinstance(tied, Mapping):  # older transformers list the tied names only
            embeddings = model.get_input_embeddings()
            source = next(name for name, param in model.named_parameters() if param is embeddings.weight)
            tied = {name: source for name in tied}
        shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
        return cls(shapes=shapes, tied={str(k): str(v) for k, v in dict(tied).items() if k in shapes})

    def check(self, shapes: Mapping[str, tuple[int, ...]], where: str = "weights") -> None:
        """Raise ValueError naming missing, unexpected and mis-shaped tensors (tied names may be absent)."""
        missing = [name for name in self.shapes if name not in shapes and name not in self.tied]
        unexpected = [name for name in shapes if name not in self.shapes]
        mismatched = [
            f"{name}: got {tuple(shapes[name])}, expected {self.shapes[name]}"
            for name in shapes
            if name in self.shapes and tuple(shapes[name]) != self.shapes[name]
        ]
        _raise_if_unfit(f"{where} do not fit the model", missing, unexpected, mismatched)

    def complete(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` with every tied name present (copied from the name it is tied to).

        vLLM's in-place reload loads each parameter from its own name; a tied name left out
        (``save_pretrained`` leaves it out) would keep its old weights.
        """
        full = dict(state)
        for name, source in self.tied.items():
            if name not in full and source in full:
                full[name] = full[source]
        return full


def write_checkpoint(
    weights: Any,
    folder: str | os.PathLike,
    *,
    config_from: str | os.PathLike | None = None,
) -> Path:
    """Write weights as ``model.safetensors`` into ``folder`` atomically; returns the folder.

    The files are written to a temporary folder next to ``folder`` and renamed into place,
    so a server never reads a half-written checkpoint. Every tensor is stored under its own
    name, tied ones included (vLLM's in-place reload needs them). ``config.json`` (and the
    generation config) are copied from ``config_from`` when given, so the folder also loads
    as a model. An existing ``folder`` is replaced.

    Args:
        weights: a state dict, a ``torch.nn.Module``, or a path `load_state_dict_source` reads.
        folder: the checkpoint folder to create.
        config_from: a model folder whose ``config.json`` to copy.

    Example:
        >>> import tempfile
        >>> folder = write_checkpoint(torch.nn.Linear(2, 1), Path(tempfile.mkdtemp()) / "v1")
        >>> sorted(p.name for p in folder.iterdir()), sorted(load_state_dict_source(folder))
        (['model.safetensors'], ['bias', 'weight'])
    """
    import shutil
    import uuid

    from safetensors.torch import save_file

    state = state_dict_of(weights)
    target = Path(folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        seen: set[int] = set()
        tensors = {}
        for name, tensor in state.items():
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.data_ptr() in seen:  # safetensors refuses shared storage
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            tensors[name] = tensor
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        if config_from is not None:
            for name in ("config.json", "generation_config.json"):
                if (Path(config_from) / name).exists():
                    shutil.copy2(Path(config_from) / name, staging / name)
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(target, old)
        os.replace(staging, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def checkpoint_shapes(folder: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a checkpoint folder, read from the safetensors headers only.

    Raises:
        FileNotFoundError: no such folder, not a folder, or no ``*.safetensors`` in it.
        PermissionError: the folder or a file cannot be read.
        ValueError: a file is not a readable safetensors file.

    Example:
        >>> import tempfile
        >>> checkpoint_shapes(write_checkpoint(torch.nn.Linear(2, 1), Path(tempfile.mkdtemp()) / "v1"))
        {'bias': (1,), 'weight': (1, 2)}
    """
    from safetensors import safe_open

    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"weights folder {str(path)!r} does not exist or is not a folder")
    if not os.access(path, os.R_OK | os.X_OK):
        raise PermissionError(f"weights folder {str(path)!r} cannot be read")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"weights folder {str(path)!r} holds no *.safetensors file")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        if not os.access(file, os.R_OK):
            raise PermissionError(f"{str(file)!r} cannot be read")
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except Exception as exc:
            raise ValueError(f"{str(file)!r} is not a readable safetensors file: {exc}") from exc
    return shapes
