"""`HFTextPolicy`: a transformers causal LM sampling completions in left-padded batches."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncvec.inference.text import TextPolicy, group_by_sampling, truncate_at_stop
from asyncvec.inference.types import BackendResult, TextPrompt
from asyncvec.inference.weights import WeightsSource, apply_state_dict, load_state_dict_source


class HFTextPolicy(TextPolicy):
    """A local ``transformers`` causal LM behind a `DynamicBatcher`.

    Prompts of a batch are left-padded and sampled together, token by token with the KV cache
    (``model.generate``'s sampling loop without its per-call set-up; requests with different
    sampling settings form separate calls). Each generated token
    comes with its log-probability **under the distribution it was sampled from**: the
    log-softmax of the logits divided by ``temperature``, renormalised over the top-p nucleus
    when ``top_p`` is set (top-k and other processors are off). With the defaults
    (``temperature=1.0``, ``top_p=None``) that is the log-softmax of the unmodified logits.
    For greedy decoding (``temperature=0``) it is the log-softmax of the unmodified logits.
    ``behavior_logp`` is the sum over the completion, eos included when it was sampled.

    Args:
        model: a ``PreTrainedModel`` or a ``save_pretrained`` folder.
        tokenizer: its tokenizer (default: loaded from the model folder). It is switched to
            left padding; without a pad token the eos token pads.
        action_parser: ``text -> action`` (see `TextPolicy`).
        max_new_tokens, temperature, top_p: default sampling settings.
        seed: seeds the policy's own sampling generator, so the same batches draw the same
            completions run after run (default None: torch's global generator). A prompt's own
            ``seed`` takes precedence for its request.
        **kwargs: `BatchedPolicy` options (``action_space`` or a ``fallback`` function is
            required for rejected completions; ``inflight_updates=True`` for the above).

    `load_weights` takes a state dict, a ``torch.save``'d file or a ``save_pretrained``
    folder; weights are copied into the model in place.

    **In-flight updates** (``inflight_updates=True``): `load_weights` waits for the running
    decoding step only, swaps the weights, and the running batch goes on from its next step.
    Its KV cache was filled by the old weights, so that next step re-runs the whole prefix
    (prompt and the tokens sampled so far) with the new weights and generation continues from
    that cache. A token's log-prob is therefore exactly what the version it claims gives it
    teacher-forced on the full prefix. Each answer carries ``token_versions`` (the version of
    the weights that sampled each token) and its ``policy_version`` is its first (oldest)
    token's; ``stats()["inflight_swaps"]`` counts the prefix re-runs. Off by default: the
    update then waits for the running batch and a completion has one version.

    Example:
        >>> import tempfile, gymnasium as gym
        >>> from asyncvec.inference import build_tiny_lm
        >>> folder = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32)
        >>> with HFTextPolicy(folder, action_parser=lambda text: int(text.strip()[:1]), action_space=gym.spaces.Discrete(10),
        ...                   max_new_tokens=2) as policy:
        ...     out = policy.submit("3+4=", env_id=0).result(timeout=30)
        >>> len(out.token_ids) <= 2 and abs(out.behavior_logp - sum(out.token_logps)) < 1e-9
        True
    """

    _supports_inflight_updates = True

    def __init__(
        self,
        model: Any | str | os.PathLike,
        tokenizer: Any = None,
        action_parser: Callable[[str], Any] | None = None,
        *,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float | None = None,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        import transformers

        if action_parser is None:
            raise TypeError("HFTextPolicy: action_parser is required (a function text -> action)")
        if isinstance(model, (str, os.PathLike)):
            folder = Path(model)
            if not folder.is_dir():
                raise FileNotFoundError(f"HFTextPolicy: no model folder at {folder}")
            model = transformers.AutoModelForCausalLM.from_pretrained(folder)
            if tokenizer is None:
                tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        if not isinstance(model, transformers.PreTrainedModel):
            raise TypeError(
                f"HFTextPolicy: model must be a transformers PreTrainedModel or a folder, got {type(model).__name__}"
            )
        if tokenizer is None:
            raise TypeError("HFTextPolicy: pass the tokenizer (or a model folder that contains one)")
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"HFTextPolicy: seed must be an int or None, got {seed!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._generator = None if seed is None else self._seeded_generator(seed)
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        # Fast tokenizers are not safe to share between threads (padding state, "Already borrowed").
        self._tokenizer_lock = threading.Lock()
        super().__init__(action_parser, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, **kwargs)

    def count_tokens(self, text: str | tuple[int, ...]) -> int:
        """Number of tokens ``text`` encodes to (as a prompt); a token-id prompt is its length."""
        return len(self.encode(text))

    def encode(self, text: str | tuple[int, ...]) -> list[int]:
        """Token ids of a prompt (a token-id prompt is returned as a list)."""
        if not isinstance(text, str):
            return list(text)
        with self._tokenizer_lock:
            return list(self.tokenizer(text).input_ids)

    def decode(self, token_ids: list[int] | tuple[int, ...]) -> str:
        """Text of ``token_ids`` (special tokens dropped)."""
        with self._tokenizer_lock:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_texts(self, token_ids: list[int] | tuple[int, ...]) -> list[str]:
        """Each token's text on its own (special tokens decode to "")."""
        with self._tokenizer_lock:
            return [self.tokenizer.decode([token], skip_special_tokens=True) for token in token_ids]

    def _check_prompt(self, prompt: TextPrompt, where: str) -> None:
        context = {"count_tokens": self.count_tokens, "vocab_size": self.model.config.vocab_size}
        self._check_fits_context(prompt, where, context=self.max_positions, **context)

    def _forward_batch(self, prompts: list[TextPrompt]) -> list[BackendResult]:
        results: list[BackendResult | None] = [None] * len(prompts)
        for (max_new_tokens, temperature, top_p, top_k, stop, seed), indices in group_by_sampling(prompts).items():
            encoded = [self.encode(prompts[i].prompt) for i in indices]
            # a prompt's seed: reproducible for the same prompts in the same group (e.g. one server request)
            generator = self._generator if seed is None else self._seeded_generator(seed)
            generated = self._generate(encoded, max_new_tokens, temperature, top_p, top_k, stop, generator)
            for index, result in zip(indices, generated, strict=True):
                results[index] = result
        return results  # type: ignore[return-value]

    def _generate(
        self,
        encoded: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float | None,
        top_k: int,
        stop: tuple[str, ...] = (),
        generator: torch.Generator | None = None,
    ) -> list[BackendResult]:
        pad = self.tokenizer.pad_token_id
        width = max(len(ids) for ids in encoded)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded], device=self.model.device)
        attention_mask = torch.tensor(
            [[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=self.model.device
        )
        generated, scores, versions = self._sample(
            input_ids, attention_mask, max_new_tokens, temperature, top_p, generator
        )
        # scores are the processed logits the sampler drew from: log-softmax gives the sampled distribution
        logps_all = torch.log_softmax(scores, dim=-1)
        token_logps = logps_all.gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        top = torch.topk(logps_all, top_k, dim=-1) if top_k else None
        eos = self.tokenizer.eos_token_id
        results = []
        for row in range(generated.shape[0]):
            ids = generated[row].tolist()
            length = ids.index(eos) + 1 if eos is not None and eos in ids else len(ids)
            length, text, _ = truncate_at_stop(ids[:length], self.decode, stop)
            ids = ids[:length]
            top_rows = None
            if top is not None:
                top_rows = [
                    dict(zip(top.indices[row, step].tolist(), top.values[row, step].tolist(), strict=True))
                    for step in range(length)
                ]
            token_versions = versions[:length] if self.inflight_updates else None
            results.append(
                self._text_result(
                    text,
                    ids,
                    token_logps[row, :length].tolist(),
                    top_rows,
                    policy_version=versions[0] if self.inflight_updates else None,
                    token_versions=token_versions,
                )
            )
        return results

    def _sample(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        top_p: float | None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Samples up to ``max_new_tokens`` per row with the KV cache: ``(tokens [B, n], scores [B, n, V],
        versions [n])``, ``scores`` the processed float32 logits each token was drawn from
        (``temperature``, then ``top_p``: transformers' own warpers), ``versions`` the weights'
        version at each step. It is ``model.generate``'s sampling loop (the same positions for left
        padding, draws, pad after eos, stop when every row has ended) without the set-up ``generate``
        does on every call, which cost a small model more than its forward passes. A step that finds
        newer weights than those that filled the KV cache (in-flight updates) re-runs the prefix."""
        import transformers

        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        warpers = transformers.LogitsProcessorList()
        if temperature > 0 and temperature != 1.0:
            warpers.append(transformers.TemperatureLogitsWarper(temperature))
        if temperature > 0 and top_p is not None and top_p < 1.0:
            warpers.append(transformers.TopPLogitsWarper(top_p))
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        tokens: list[torch.Tensor] = []
        scores: list[torch.Tensor] = []
        versions: list[int] = []
        # A Cache object from the start (transformers' current API; tuples of tensors are deprecated)
        past, step_ids, cache_version = transformers.DynamicCache(), input_ids, None
        with torch.no_grad():
            for _ in range(max_new_tokens):
                with self._decoding_step() as version:
                    if cache_version is not None and version != cache_version:
                        # the cache holds keys/values of older weights: prompt + tokens so far, again
                        prefix = torch.cat([input_ids, torch.stack(tokens, dim=1)], dim=1)
                        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
                        out = self.model(
                            input_ids=prefix,
                            attention_mask=attention_mask,
                            position_ids=position_ids,
                            past_key_values=transformers.DynamicCache(),
                            use_cache=True,
                        )
                        self._count_inflight_swap()
                    else:
                        out = self.model(
                            input_ids=step_ids, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=past, use_cache=True,
                        )  # fmt: skip
                    cache_version = version
                past = out.past_key_values
                versions.append(version)
                logits = warpers(step_ids, out.logits[:, -1].float())
                if temperature > 0:
                    next_tokens = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(1)
                else:
                    next_tokens = logits.argmax(dim=-1)
                next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, pad))
                tokens.append(next_tokens)
                scores.append(logits)
                if eos is not None:
                    unfinished &= next_tokens != eos
                if not unfinished.any():
                    break
                step_ids = next_tokens.unsqueeze(-1)
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], -1)
                position_ids = position_ids[:, -1:] + 1
        return torch.stack(tokens, dim=1), torch.stack(scores, dim=1), versions

    def _seeded_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.model.device).manual_seed(seed)

    def _apply_weights(self, weights: WeightsSource, version: int) -> None:
        apply_state_dict(self.model, load_state_dict_source(weights))
