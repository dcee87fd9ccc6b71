"""A tiny vision-language-action model (image + instruction -> action tokens) and its policy.

Architecture (the shape of RT-2 / OpenVLA, at toy size):

* **Vision encoder**: a ViT-style patch embedding (a ``Conv2d`` with kernel = stride =
  ``patch_size``), learned position embeddings and ``vision_layers`` pre-norm transformer
  encoder layers: an ``image_size x image_size`` RGB image becomes
  ``(image_size / patch_size) ** 2`` patch embeddings.
* **Projector**: a 2-layer MLP maps each patch embedding into the language model's hidden
  size; the projected patches are the prompt's first tokens ("soft tokens").
* **Language model**: a transformers causal LM (Llama or GPT-2 config) that reads
  ``[image soft tokens][instruction tokens]`` and writes action tokens.
* **Action tokens**: ``num_bins`` (256) extra tokens appended after the text vocabulary
  (ids ``action_token_start .. action_token_start + num_bins - 1``); see `ActionTokenizer`.
  OpenVLA overwrites the 256 least used ids of Llama's vocabulary instead; our character
  vocabulary is tiny, so we append.

`build_tiny_vla` writes a ``save_pretrained`` folder (model + character tokenizer) built from
a config: no download. `TinyVLAPolicy` serves it behind the `Policy` interface.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import transformers
from torch import nn

from asyncvec.inference.action_tokens import ActionTokenizer
from asyncvec.inference.base import BatchedPolicy
from asyncvec.inference.requests import split_batch
from asyncvec.inference.tiny_models import (
    DEFAULT_VOCAB,
    build_char_tokenizer,
    check_lm_sizes,
    save_tiny_model,
    text_model_config,
)
from asyncvec.inference.types import BackendResult, PolicyOutput
from asyncvec.inference.weights import WeightsSource, apply_state_dict, load_state_dict_source

__all__ = [
    "TinyVLAConfig",
    "TinyVLAModel",
    "TinyVLAPolicy",
    "build_tiny_vla",
    "load_tiny_vla",
    "per_action_logps",
]


class TinyVLAConfig(transformers.PretrainedConfig):
    """Config of `TinyVLAModel`.

    Args:
        text_config: the language model's config as a dict (``model_type`` "llama" or "gpt2");
            its ``vocab_size`` includes the action tokens.
        image_size: side of the square RGB input image, in pixels.
        patch_size: side of a patch; ``image_size`` must be a multiple of it.
        vision_dim: width of the vision encoder.
        vision_layers: transformer encoder layers after the patch embedding (0: patches only).
        num_bins: action tokens (bins per action dimension).
        action_token_start: id of the first action token (= the text vocabulary's size).
    """

    model_type = "asyncvec_tiny_vla"

    def __init__(
        self,
        text_config: dict[str, Any] | None = None,
        image_size: int = 64,
        patch_size: int = 16,
        vision_dim: int = 64,
        vision_layers: int = 1,
        num_bins: int = 256,
        action_token_start: int = 0,
        initializer_range: float = 0.02,
        **kwargs: Any,
    ) -> None:
        self.text_config = dict(text_config or {})
        self.image_size = image_size
        self.patch_size = patch_size
        self.vision_dim = vision_dim
        self.vision_layers = vision_layers
        self.num_bins = num_bins
        self.action_token_start = action_token_start
        self.initializer_range = initializer_range
        super().__init__(**kwargs)

    @property
    def num_patches(self) -> int:
        """Image soft tokens per observation."""
        return (self.image_size // self.patch_size) ** 2


class _VisionEncoder(nn.Module):
    """Patch embedding + position embedding + a few pre-norm transformer encoder layers."""

    def __init__(self, config: TinyVLAConfig) -> None:
        super().__init__()
        dim = config.vision_dim
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=config.patch_size, stride=config.patch_size)
        self.position = nn.Parameter(torch.zeros(1, config.num_patches, dim))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model=dim,
                nhead=max(1, dim // 32),
                dim_feedforward=2 * dim,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(config.vision_layers)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embed(pixels).flatten(2).transpose(1, 2)  # [B, P, dim]
        hidden = patches + self.position
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm(hidden)


class TinyVLAModel(transformers.PreTrainedModel):
    """Image encoder -> projector -> soft tokens prepended to a causal LM that emits action tokens.

    Inputs are ``images`` (uint8 ``[B, S, S, 3]``, scaled to ``[-1, 1]`` inside) and the
    instruction's token ids, left-padded (``input_ids``, ``attention_mask`` ``[B, L]``). The
    sequence the LM reads is ``[P image tokens][L instruction tokens][action tokens]``; padding
    sits between the image and the instruction, masked, and position ids count real tokens only.

    Example:
        >>> import tempfile
        >>> model, tokenizer = load_tiny_vla(build_tiny_vla(tempfile.mkdtemp(), n_layer=1, n_embd=32,
        ...                                                 vision_dim=32, image_size=32))
        >>> model.config.num_patches, model.config.action_token_start == len(tokenizer)
        (4, True)
    """

    config_class = TinyVLAConfig
    base_model_prefix = "vla"
    main_input_name = "images"
    _no_split_modules: list[str] = []
    _supports_sdpa = True

    def __init__(self, config: TinyVLAConfig) -> None:
        super().__init__(config)
        text_config = transformers.AutoConfig.for_model(**config.text_config)
        hidden = text_config.hidden_size
        self.vision = _VisionEncoder(config)
        self.projector = nn.Sequential(nn.Linear(config.vision_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden))
        self.language_model = transformers.AutoModelForCausalLM.from_config(text_config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, _VisionEncoder):
            nn.init.normal_(module.position, mean=0.0, std=std)

    # ------------------------------------------------------------------------ inputs
    @property
    def action_token_range(self) -> tuple[int, int]:
        """``(first, stop)`` of the action token ids."""
        start = int(self.config.action_token_start)
        return start, start + int(self.config.num_bins)

    def embed_prefix(
        self, images: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(inputs_embeds [B, P + L, h], attention_mask [B, P + L], position_ids [B, P + L])``."""
        pixels = images.permute(0, 3, 1, 2).to(self.dtype) / 127.5 - 1.0
        soft_tokens = self.projector(self.vision(pixels))
        text = self.language_model.get_input_embeddings()(input_ids)
        embeds = torch.cat([soft_tokens, text], dim=1)
        ones = torch.ones(soft_tokens.shape[:2], dtype=attention_mask.dtype, device=attention_mask.device)
        mask = torch.cat([ones, attention_mask], dim=1)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return embeds, mask, positions

    def action_logits(
        self,
        images: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        action_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Teacher-forced logits over the whole vocabulary for each action token ``[B, T, V]``:
        row ``t`` is the distribution the model predicts token ``action_ids[:, t]`` from."""
        embeds, mask, positions = self.embed_prefix(images, input_ids, attention_mask)
        steps = action_ids.shape[1]
        if steps > 1:
            fed = self.language_model.get_input_embeddings()(action_ids[:, :-1])
            embeds = torch.cat([embeds, fed], dim=1)
            mask = torch.cat([mask, torch.ones_like(action_ids[:, :-1], dtype=mask.dtype)], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, steps, device=positions.device)], 1)
        out = self.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=False)
        prefix = embeds.shape[1] - (steps - 1)
        return out.logits[:, prefix - 1 : prefix - 1 + steps]

    def action_logprobs(
        self,
        images: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        action_ids: torch.Tensor,
        *,
        constrained: bool = True,
    ) -> torch.Tensor:
        """Teacher-forced log-probability of each action token ``[B, T]`` (differentiable).

        ``constrained=True`` renormalises over the action tokens (the distribution
        `TinyVLAPolicy` samples from by default), so these are the policy's log-probs at
        temperature 1. A chunk's log-prob is the sum over its tokens.
        """
        logits = self.action_logits(images, input_ids, attention_mask, action_ids).float()
        first, stop = self.action_token_range
        if constrained:
            if bool(((action_ids < first) | (action_ids >= stop)).any()):
                raise ValueError(f"action_logprobs: every action id must be in [{first}, {stop}) when constrained")
            logps = torch.log_softmax(logits[..., first:stop], dim=-1)
            return logps.gather(-1, (action_ids - first).unsqueeze(-1)).squeeze(-1)
        return torch.log_softmax(logits, dim=-1).gather(-1, action_ids.unsqueeze(-1)).squeeze(-1)

    @torch.no_grad()
    def generate_actions(
        self,
        images: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        num_tokens: int,
        *,
        temperature: float = 1.0,
        constrained: bool = True,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``num_tokens`` tokens with a KV cache: ``(token_ids [B, T], logps [B, T])``.

        ``constrained``: only action tokens can be drawn (the logits outside the action range
        are dropped and the rest renormalised). The log-probs are those of the distribution
        each token was drawn from (logits / temperature); for ``temperature=0`` (greedy) the
        unscaled distribution's.
        """
        first, stop = self.action_token_range
        embed = self.language_model.get_input_embeddings()
        embeds, mask, positions = self.embed_prefix(images, input_ids, attention_mask)
        out = self.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=True)
        tokens, logps = [], []
        for step in range(num_tokens):
            logits = out.logits[:, -1].float()
            if constrained:
                logits = logits[:, first:stop]
            if temperature > 0:
                dist = torch.log_softmax(logits / temperature, dim=-1)
                choice = torch.multinomial(dist.exp(), 1, generator=generator).squeeze(-1)
            else:
                dist = torch.log_softmax(logits, dim=-1)
                choice = dist.argmax(-1)
            logps.append(dist.gather(-1, choice.unsqueeze(-1)).squeeze(-1))
            token = choice + first if constrained else choice
            tokens.append(token)
            if step + 1 == num_tokens:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out = self.language_model(
                inputs_embeds=embed(token.unsqueeze(-1)),
                attention_mask=mask,
                position_ids=positions,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        return torch.stack(tokens, dim=1), torch.stack(logps, dim=1)


try:  # AutoConfig (and AutoTokenizer, which reads config.json) then know the model type
    transformers.AutoConfig.register(TinyVLAConfig.model_type, TinyVLAConfig, exist_ok=True)
except TypeError:  # older transformers without exist_ok
    if TinyVLAConfig.model_type not in transformers.CONFIG_MAPPING:
        transformers.AutoConfig.register(TinyVLAConfig.model_type, TinyVLAConfig)


def build_tiny_vla(
    path: str | os.PathLike,
    *,
    arch: str = "llama",
    image_size: int = 64,
    patch_size: int = 16,
    vision_dim: int = 64,
    vision_layers: int = 1,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int | None = None,
    max_positions: int = 256,
    num_bins: int = 256,
    vocab: str = DEFAULT_VOCAB,
    seed: int = 0,
) -> Path:
    """Build a randomly initialised `TinyVLAModel` from a config and ``save_pretrained`` it
    (with its character tokenizer) to ``path``.

    The language model's vocabulary is the character tokenizer's plus ``num_bins`` action
    tokens appended after it. ``max_positions`` must hold the image tokens
    (``(image_size / patch_size) ** 2``), the instruction and the action tokens of a chunk.

    Example:
        >>> import tempfile
        >>> folder = build_tiny_vla(tempfile.mkdtemp(), image_size=32, n_layer=1, n_embd=32, vision_dim=32)
        >>> sorted(p.name for p in folder.iterdir() if p.suffix == ".json")[:2]
        ['config.json', 'tokenizer.json']
    """
    vision = {"image_size": image_size, "patch_size": patch_size, "vision_dim": vision_dim}  # checked, then configured
    heads = check_lm_sizes(
        arch, n_head, **vision, n_layer=n_layer, n_embd=n_embd, max_positions=max_positions, num_bins=num_bins
    )
    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} must be a multiple of patch_size {patch_size}")
    if isinstance(vision_layers, bool) or not isinstance(vision_layers, int) or vision_layers < 0:
        raise ValueError(f"vision_layers must be an int >= 0, got {vision_layers!r}")
    tokenizer = build_char_tokenizer(vocab)
    text_vocab = len(tokenizer)
    text_config = text_model_config(
        arch, tokenizer, text_vocab + num_bins, n_layer, n_embd, heads, max_positions, tie_word_embeddings=False
    )
    config = TinyVLAConfig(
        text_config=text_config.to_dict(),
        **vision,
        vision_layers=vision_layers,
        num_bins=num_bins,
        action_token_start=text_vocab,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyVLAModel(config)
    return save_tiny_model(model, tokenizer, path)


def load_tiny_vla(path: str | os.PathLike) -> tuple[TinyVLAModel, Any]:
    """``(model, tokenizer)`` from a folder written by `build_tiny_vla` (or ``save_pretrained``)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no TinyVLA model folder at {folder} (config.json missing)")
    model = TinyVLAModel.from_pretrained(folder)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    return model, tokenizer


def per_action_logps(token_logps: Sequence[float] | np.ndarray, action_dim: int) -> np.ndarray:
    """Log-probability of each action of a chunk: the sum over its ``action_dim`` tokens.

    Example:
        >>> per_action_logps([-1.0, -2.0, -0.5, -0.5], 2).tolist()
        [-3.0, -1.0]
    """
    logps = np.asarray(token_logps, dtype=np.float64)
    if logps.ndim != 1 or logps.size % action_dim:
        raise ValueError(f"per_action_logps: expected a multiple of {action_dim} token log-probs, got {logps.shape}")
    return logps.reshape(-1, action_dim).sum(-1)


def resolve_vla(model: Any, tokenizer: Any, owner: str) -> tuple["TinyVLAModel", Any]:
    """``(model, tokenizer)`` from a TinyVLAModel and its tokenizer, or from a folder holding both
    (a tokenizer passed explicitly wins); ``owner`` names the caller in the errors."""
    if isinstance(model, (str, os.PathLike)):
        model, loaded_tokenizer = load_tiny_vla(model)
        tokenizer = loaded_tokenizer if tokenizer is None else tokenizer
    if not isinstance(model, TinyVLAModel):
        raise TypeError(f"{owner}: model must be a TinyVLAModel or a folder, got {type(model).__name__}")
    if tokenizer is None:
        raise TypeError(f"{owner}: pass the tokenizer (or a model folder that contains one)")
    return model, tokenizer


class TinyVLAPolicy(BatchedPolicy):
    """A `TinyVLAModel` behind the `Policy` interface: image + instruction in, actions out.

    Observations are dicts ``{"image": uint8 [S, S, 3], "instruction": str}`` (the per-env
    form of ``Dict(image=Box(0, 255, (S, S, 3), uint8), instruction=Text)``); ``act`` also
    takes the batched form ``{"image": uint8 [B, S, S, 3], "instruction": B strings}``.

    Every call emits ``chunk_size * D`` action tokens for a ``D``-dimensional Box action space
    (each dimension binned into ``num_bins`` over its bounds, see `ActionTokenizer`), decoded
    to an action ``[D]`` (``chunk_size=None``) or a chunk ``[chunk_size, D]``.
    ``behavior_logp`` is the log-probability of the emitted tokens (their sum: a chunk's
    log-prob); ``token_ids``/``token_logps`` hold each token's, and `action_logps` gives each
    action's. The action is the bin centre, so it lies within the bounds.

    Decoding: ``constrained=True`` (default) draws only action tokens, so every output
    decodes. With ``constrained=False`` the model samples from its whole vocabulary; an output
    holding a non-action token decodes to no action: the policy then answers with its
    fallback action (``fallback=True``, counted in ``stats()["parse_failures"]``), keeping the
    tokens and their log-prob; the learner must not train on it as the policy's choice.

    Args:
        model: a `TinyVLAModel` or a folder from `build_tiny_vla`.
        action_space: a 1-D ``Box`` with finite bounds (one action).
        tokenizer: the instruction tokenizer (default: loaded from the model folder).
        chunk_size: actions per call (None: one action of shape ``[D]``).
        temperature: sampling temperature (0: greedy).
        constrained: decode only action tokens.
        seed: seed of the sampling generator (None: torch's global stream).
        **kwargs: `BatchedPolicy` options (``max_batch_size``, ``max_wait_ms``,
            ``deadline_ms``, ``fallback``...). The fallback action of a chunked policy is a chunk.

    `load_weights` takes a state dict, a ``torch.save``'d file or a ``save_pretrained``
    folder; weights are copied in place and answers report the new version.

    Example:
        >>> import tempfile, numpy as np, gymnasium as gym
        >>> folder = build_tiny_vla(tempfile.mkdtemp(), image_size=32, n_layer=1, n_embd=32, vision_dim=32)
        >>> space = gym.spaces.Box(-1.0, 1.0, (2,))
        >>> with TinyVLAPolicy(folder, space, chunk_size=4, max_wait_ms=1, seed=0) as policy:
        ...     obs = {"image": np.zeros((32, 32, 3), np.uint8), "instruction": "push the cube"}
        ...     out = policy.submit(obs, env_id=0).result(timeout=60)
        >>> out.action.shape, len(out.token_ids), np.isclose(out.behavior_logp, sum(out.token_logps))
        ((4, 2), 8, np.True_)
    """

    def __init__(
        self,
        model: TinyVLAModel | str | os.PathLike,
        action_space: gym.spaces.Box,
        *,
        tokenizer: Any = None,
        chunk_size: int | None = None,
        temperature: float = 1.0,
        constrained: bool = True,
        seed: int | None = None,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        model, tokenizer = resolve_vla(model, tokenizer, "TinyVLAPolicy")
        if not isinstance(action_space, gym.spaces.Box) or len(action_space.shape) != 1:
            raise ValueError(f"TinyVLAPolicy: action_space must be a 1-D gymnasium Box, got {action_space!r}")
        bad_chunk = isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        if chunk_size is not None and bad_chunk:
            raise ValueError(f"TinyVLAPolicy: chunk_size must be an int >= 1 or None, got {chunk_size!r}")
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError(f"TinyVLAPolicy: temperature must be a number >= 0, got {temperature!r}")
        config = model.config
        self.action_tokenizer = ActionTokenizer(
            action_space, num_bins=int(config.num_bins), first_token_id=int(config.action_token_start)
        )
        self.single_action_space = action_space
        self.chunk_size = chunk_size
        self.action_dim = int(action_space.shape[0])
        self.num_action_tokens = (chunk_size or 1) * self.action_dim
        if chunk_size is not None:  # the fallback (and the space of an answer) is a whole chunk
            low = np.broadcast_to(action_space.low, (chunk_size, self.action_dim))
            high = np.broadcast_to(action_space.high, (chunk_size, self.action_dim))
            answer_space = gym.spaces.Box(low, high, dtype=action_space.dtype)
        else:
            answer_space = action_space
        self._can_reject = not constrained
        self.constrained = bool(constrained)
        self.temperature = float(temperature)
        self.image_shape = (int(config.image_size), int(config.image_size), 3)
        text_config = transformers.AutoConfig.for_model(**config.text_config)
        self.max_positions = int(
            getattr(text_config, "max_position_embeddings", None) or getattr(text_config, "n_positions")
        )
        self.model = model.eval()
        if device is not None:
            self.model.to(device)
        self.device = next(self.model.parameters()).device
        self.tokenizer = tokenizer
        self._tokenizer_lock = threading.Lock()
        self._generator = None
        if seed is not None:
            self._generator = torch.Generator(device=self.device)
            self._generator.manual_seed(int(seed))
        super().__init__(action_space=answer_space, **kwargs)

    # ------------------------------------------------------------------------ observations
    def encode_instruction(self, instruction: str) -> tuple[int, ...]:
        """Token ids of an instruction."""
        with self._tokenizer_lock:
            return tuple(self.tokenizer(instruction).input_ids)

    def _check_obs(self, obs: Any, env_id: int | None) -> tuple[np.ndarray, tuple[int, ...]]:
        where = f"{self._label}: env_id={env_id}: " if env_id is not None else f"{self._label}: "
        if not isinstance(obs, Mapping) or "image" not in obs or "instruction" not in obs:
            got = sorted(obs) if isinstance(obs, Mapping) else type(obs).__name__
            raise ValueError(f"{where}expected a dict observation with keys 'image' and 'instruction', got {got}")
        image = obs["image"]
        if not isinstance(image, np.ndarray):
            raise ValueError(
                f"{where}observation['image'] must be a numpy uint8 array of shape {self.image_shape}, "
                f"got {type(image).__name__}"
            )
        if image.dtype != np.uint8 or image.shape != self.image_shape:
            raise ValueError(
                f"{where}observation['image'] has dtype {image.dtype} shape {image.shape}, "
                f"expected uint8 {self.image_shape}"
            )
        instruction = obs["instruction"]
        if not isinstance(instruction, str):
            raise ValueError(f"{where}observation['instruction'] must be a str, got {type(instruction).__name__}")
        ids = self.encode_instruction(str(instruction))
        patches = int(self.model.config.num_patches)
        total = patches + len(ids) + self.num_action_tokens
        if total > self.max_positions:
            raise ValueError(
                f"{where}observation['instruction'] of {len(ids)} tokens is over the context: {patches} image "
                f"tokens + {len(ids)} instruction tokens + {self.num_action_tokens} action tokens = {total} > "
                f"the model's {self.max_positions} positions"
            )
        return np.ascontiguousarray(image), ids

    def _inputs(self, checked: Sequence[tuple[np.ndarray, tuple[int, ...]]]) -> tuple[torch.Tensor, ...]:
        pad = self.tokenizer.pad_token_id or 0
        width = max(1, max(len(ids) for _, ids in checked))
        input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for _, ids in checked], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in checked], dtype=torch.long)
        images = torch.from_numpy(np.stack([image for image, _ in checked]))
        return images.to(self.device), input_ids.to(self.device), mask.to(self.device)

    def model_inputs(self, obs_batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(images, input_ids, attention_mask)`` tensors of a batch of observations (the
        form `TinyVLAModel.action_logprobs` takes), checked as `submit` checks them."""
        return self._inputs([self._check_obs(obs, index) for index, obs in enumerate(split_batch(obs_batch))])

    # ---------------------------------------------------------------------------- forward
    def _forward_batch(self, obs_list: list[tuple[np.ndarray, tuple[int, ...]]]) -> list[BackendResult]:
        images, input_ids, mask = self._inputs(obs_list)
        tokens, logps = self.model.generate_actions(
            images,
            input_ids,
            mask,
            self.num_action_tokens,
            temperature=self.temperature,
            constrained=self.constrained,
            generator=self._generator,
        )
        return self._action_results(tokens.cpu().numpy(), logps.double().cpu().numpy())

    def _action_results(self, token_rows: Sequence[Any], logp_rows: Sequence[Any]) -> list[BackendResult]:
        """Decode each row of emitted token ids into an answer. A row that decodes to no action
        (a non-action token, or not ``chunk_size * D`` tokens) is rejected: the policy answers
        with its fallback action (counted in ``parse_failures``), keeping the tokens."""
        results = []
        for ids, token_logps in zip(token_rows, logp_rows, strict=True):
            ids = np.asarray(ids, dtype=np.int64)
            token_logps = np.asarray(token_logps, dtype=np.float64)
            valid = len(ids) == self.num_action_tokens and bool(self.action_tokenizer.is_action_token(ids).all())
            action = None
            if valid:
                action = self.action_tokenizer.decode(ids.reshape(-1, self.action_dim))
                action = action.astype(self.single_action_space.dtype)
                if self.chunk_size is None:
                    action = action[0]
            results.append(
                BackendResult(
                    action=action,
                    logp=float(token_logps.sum()),
                    token_ids=tuple(int(i) for i in ids),
                    token_logps=tuple(float(x) for x in token_logps),
                    rejected=not valid,
                )
            )
        return results

    def action_logps(self, output: PolicyOutput) -> np.ndarray:
        """Each action's log-probability in an answer (the sum over its tokens), ``[H]``."""
        if output.token_logps is None:
            raise ValueError(f"{self._label}: this answer has no token log-probs (a deadline fallback?)")
        return per_action_logps(output.token_logps, self.action_dim)

    def score(self, obs_batch: Any, actions: Any) -> np.ndarray:
        """Log-probability under the current weights (temperature 1, constrained) of the
        action tokens of ``actions`` (``[B, D]``, or chunks ``[B, chunk_size, D]`` for a chunked
        policy), per observation.

        Raises:
            ValueError: ``actions`` is not one action (or one whole chunk) per observation.
        """
        images, input_ids, mask = self.model_inputs(obs_batch)
        actions = np.asarray(actions)
        per_obs = (self.action_dim,) if self.chunk_size is None else (self.chunk_size, self.action_dim)
        if actions.shape != (images.shape[0], *per_obs):
            raise ValueError(
                f"{self._label}.score: actions have shape {actions.shape}, expected {(images.shape[0], *per_obs)}: "
                f"{'one action' if self.chunk_size is None else f'a chunk of chunk_size={self.chunk_size} actions'} "
                f"of {self.action_dim} dimensions per observation"
            )
        ids = self.action_tokenizer.encode(actions)
        ids = torch.as_tensor(ids.reshape(ids.shape[0], -1), device=self.device)
        with self._version_lock.read(), torch.no_grad():
            logps = self.model.action_logprobs(images, input_ids, mask, ids)
        return logps.sum(-1).double().cpu().numpy()

    # ---------------------------------------------------------------------------- weights
    def _apply_weights(self, weights: WeightsSource | nn.Module, version: int) -> None:
        if isinstance(weights, nn.Module):
            weights = weights.state_dict()
        apply_state_dict(self.model, load_state_dict_source(weights))
