"""`HFTextPolicy`: a transformers causal LM sampling completions in left-padded batches."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from asyncvec.inference.backends.streamed import finished_prefix
from asyncvec.inference.text import TextPolicy, group_by_sampling, truncate_at_stop
from asyncvec.inference.types import BackendResult, GeneratedPrefix, PartialBatchError, TextPrompt
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
            ``seed`` takes precedence for its request: its rows draw from a generator of that seed,
            so they sample the same tokens whatever else shares their batch.
        bitwise_seeds: a seeded request gets an engine call of its own (with the other requests
            of its seed), so its log-probs too are the same bit for bit whatever else was submitted
            (a batch's shape changes the last bits of a matmul: up to ~5e-7 here); slower: seeded
            requests are not batched together. Default False: they share batches.
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
    token's; ``stats()["inflight_swaps"]`` counts the updates that landed while a batch was
    generating (one per update, however many batches it reached). Off by default: the
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
        bitwise_seeds: bool = False,
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
        self.bitwise_seeds = bool(bitwise_seeds)
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        # Fast tokenizers are not safe to share between threads (padding state, "Already borrowed").
        self._tokenizer_lock = threading.Lock()
        self._registering = threading.local()  # `submit_streamed` -> `_check_obs`: the request's token callback
        self._token_callbacks: dict[int, tuple[TextPrompt, Callable[[int, float, int], None]]] = {}
        self._batches_sampling = 0  # batches between two decoding steps (an update then lands in flight)
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

    def _prompt_ids(self, prompt: TextPrompt) -> tuple[int, ...]:
        return tuple(self.encode(prompt.prompt))

    def _end_token_ids(self) -> frozenset[int]:
        eos = self.tokenizer.eos_token_id
        return frozenset() if eos is None else frozenset([int(eos)])

    def _decode_ids(self, token_ids: Any) -> str:
        return self.decode(token_ids)

    def submit_streamed(
        self, prompt: str | TextPrompt, n: int, on_token: Callable[[int, int, float, int], None]
    ) -> list[Future]:
        """`submit_group` that also calls ``on_token(copy, token_id, logp, version)`` on the batch
        thread for each token of copy ``copy`` as it is sampled (e.g. to stream it to a client).
        The futures' outputs are what counts: a stop string cuts a completion after sampling, so
        the last tokens streamed may not be in it."""
        futures = []
        for copy in range(n):
            self._registering.callback = functools.partial(on_token, copy)
            try:
                future = self.submit(prompt)
            finally:
                self._registering.callback = None
            key = self._registering.__dict__.pop("key", None)
            if key is not None:
                future.add_done_callback(lambda _, key=key: self._token_callbacks.pop(key, None))
            futures.append(future)
        return futures

    def _check_obs(self, obs: Any, env_id: int | None) -> TextPrompt:
        checked = super()._check_obs(obs, env_id)
        callback = getattr(self._registering, "callback", None)
        if callback is not None:  # `submit_streamed`: this request's tokens go to callback
            self._token_callbacks[id(checked)] = (checked, callback)
            self._registering.key = id(checked)
        return checked

    def _forward_batch(self, prompts: list[TextPrompt]) -> list[BackendResult]:
        results: list[BackendResult | None] = [None] * len(prompts)
        # prompts of different seeds share a call (unless bitwise_seeds): each seed's rows draw from their generator
        groups = list(group_by_sampling(prompts, seeds=self.bitwise_seeds).items())
        for position, ((max_new_tokens, temperature, top_p, top_k, stop, _), indices) in enumerate(groups):
            encoded = [self.encode(prompts[i].prompt) for i in indices]
            generator = self._row_generators([prompts[i].seed for i in indices])
            callbacks = [self._token_callbacks.get(id(prompts[i]), (None, None))[1] for i in indices]
            try:
                generated = self._generate(
                    encoded, max_new_tokens, temperature, top_p, top_k, stop, generator, callbacks
                )
            except _Interrupted as interrupted:
                # what every prompt had: the groups before, complete; this one, its tokens so far; the rest, nothing
                prefixes: list[GeneratedPrefix | None] = [
                    None if result is None else finished_prefix(result, self.policy_version) for result in results
                ]
                for index, prefix in zip(indices, interrupted.prefixes, strict=True):
                    prefixes[index] = prefix
                cause = interrupted.__cause__
                raise PartialBatchError(
                    f"{self._label}: generation failed after {interrupted.steps} step(s) of group {position + 1} of "
                    f"{len(groups)}: {type(cause).__name__}: {cause}",
                    prefixes,
                ) from cause
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
        generator: RowGenerators | torch.Generator | None = None,
        on_token: list[Callable[[int, float, int], None] | None] | None = None,
    ) -> list[BackendResult]:
        """Sample completions of ``encoded`` (``on_token[row]``: called with each token of that row as it
        is sampled). Raises `_Interrupted` with each row's tokens so far if a step fails."""
        pad = self.tokenizer.pad_token_id
        width = max(len(ids) for ids in encoded)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded], device=self.model.device)
        attention_mask = torch.tensor(
            [[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=self.model.device
        )
        steps: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (tokens, processed logits, version) per step
        with self._stats_lock:
            self._batches_sampling += 1
        try:
            self._sample(input_ids, attention_mask, max_new_tokens, temperature, top_p, generator, steps, on_token)
        except Exception as exc:
            if not steps or not self._is_transient(exc):
                raise
            rows = self._rows(steps, top_k, stop)
            current = self.policy_version
            prefixes = [
                GeneratedPrefix(
                    tuple(ids), tuple(logps), tuple(versions if self.inflight_updates else [current] * len(ids)),
                    text, None if top_rows is None else tuple(top_rows), finished=ended or len(ids) >= max_new_tokens,
                )
                for ids, logps, top_rows, versions, text, ended in rows
            ]  # fmt: skip
            raise _Interrupted(prefixes, len(steps)) from exc
        finally:
            with self._stats_lock:
                self._batches_sampling -= 1
        results = []
        for ids, logps, top_rows, versions, text, _ in self._rows(steps, top_k, stop):
            results.append(
                self._text_result(
                    text,
                    ids,
                    logps,
                    top_rows,
                    policy_version=versions[0] if self.inflight_updates else None,
                    token_versions=versions if self.inflight_updates else None,
                )
            )
        return results

    def _rows(
        self, steps: list[tuple[torch.Tensor, torch.Tensor, int]], top_k: int, stop: tuple[str, ...]
    ) -> list[tuple[list[int], list[float], list[dict[int, float]] | None, list[int], str, bool]]:
        """Each row's completion from the sampled steps: ``(token_ids, logps, top rows, versions,
        text, ended)``, cut after eos or the token that completed a stop string (``ended``)."""
        generated = torch.stack([tokens for tokens, _, _ in steps], dim=1)
        scores = torch.stack([logits for _, logits, _ in steps], dim=1)
        versions = [version for _, _, version in steps]
        # scores are the processed logits the sampler drew from: log-softmax gives the sampled distribution
        logps_all = torch.log_softmax(scores, dim=-1)
        token_logps = logps_all.gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        top = torch.topk(logps_all, top_k, dim=-1) if top_k else None
        eos = self.tokenizer.eos_token_id
        rows = []
        for row in range(generated.shape[0]):
            ids = generated[row].tolist()
            ended = eos is not None and eos in ids
            length = ids.index(eos) + 1 if ended else len(ids)
            length, text, stopped = truncate_at_stop(ids[:length], self.decode, stop)
            top_rows = None
            if top is not None:
                top_rows = [
                    dict(zip(top.indices[row, step].tolist(), top.values[row, step].tolist(), strict=True))
                    for step in range(length)
                ]
            logps = token_logps[row, :length].tolist()
            rows.append((ids[:length], logps, top_rows, versions[:length], text, ended or stopped))
        return rows

    def _sample(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        top_p: float | None,
        generator: RowGenerators | torch.Generator | None,
        steps: list[tuple[torch.Tensor, torch.Tensor, int]],
        on_token: list[Callable[[int, float, int], None] | None] | None = None,
    ) -> None:
        """Samples up to ``max_new_tokens`` per row with the KV cache, appending ``(tokens [B],
        scores [B, V], version)`` to ``steps`` after each step (what a failed step leaves is what
        was sampled), ``scores`` the processed float32 logits each token was drawn from
        (``temperature``, then ``top_p``: transformers' own warpers), ``version`` the weights'
        version at that step. It is ``model.generate``'s sampling loop (the same positions for left
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
        # every draw of the batch at once: a row's come from its own generator whatever the batch holds
        draws = _uniforms(generator, input_ids.shape[0], max_new_tokens, input_ids.device) if temperature > 0 else None
        tokens: list[torch.Tensor] = []
        streamed = [] if on_token is None else [(row, call) for row, call in enumerate(on_token) if call is not None]
        # A Cache object from the start (transformers' current API; tuples of tensors are deprecated)
        past, step_ids, cache_version = transformers.DynamicCache(), input_ids, None
        with torch.no_grad():
            for step in range(max_new_tokens):
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
                    else:
                        out = self.model(
                            input_ids=step_ids, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=past, use_cache=True,
                        )  # fmt: skip
                    cache_version = version
                past = out.past_key_values
                logits = warpers(step_ids, out.logits[:, -1].float())
                if temperature > 0:
                    next_tokens = _inverse_cdf(torch.softmax(logits, dim=-1), draws[:, step])
                else:
                    next_tokens = logits.argmax(dim=-1)
                next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, pad))
                tokens.append(next_tokens)
                steps.append((next_tokens, logits, version))
                if streamed:
                    chosen = torch.log_softmax(logits, dim=-1).gather(-1, next_tokens.unsqueeze(-1)).squeeze(-1)
                    for row, call in streamed:
                        if unfinished[row]:
                            call(int(next_tokens[row]), float(chosen[row]), version)
                if eos is not None:
                    unfinished &= next_tokens != eos
                if not unfinished.any():
                    break
                step_ids = next_tokens.unsqueeze(-1)
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], -1)
                position_ids = position_ids[:, -1:] + 1

    def _seeded_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.model.device).manual_seed(seed)

    def _row_generators(self, seeds: list[int | None]) -> RowGenerators:
        """Which rows draw from which generator: the rows of one seed from a generator of that seed,
        together (a server request's ``n`` copies: reproducible as one request), whatever else shares
        the batch; the unseeded rows from the policy's own generator."""
        rows: dict[int | None, list[int]] = {}
        for row, seed in enumerate(seeds):
            rows.setdefault(seed, []).append(row)
        return [
            (torch.tensor(members), self._generator if seed is None else self._seeded_generator(seed))
            for seed, members in rows.items()
        ]

    def _apply_weights(self, weights: WeightsSource, version: int) -> None:
        apply_state_dict(self.model, load_state_dict_source(weights))
        if self._batches_sampling:  # in flight: running batches re-run their prefix at their next step
            self._count_inflight_swap()


RowGenerators = list[tuple[torch.Tensor, "torch.Generator | None"]]
"""Rows of a batch (indices) and the generator each set draws its tokens from."""


def _uniforms(
    generator: RowGenerators | torch.Generator | None, rows: int, steps: int, device: torch.device
) -> torch.Tensor:
    """``[rows, steps]`` uniform draws in [0, 1): each set of rows' from its generator (None: torch's)."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(rows, steps, generator=generator, device=device)
    draws = torch.empty(rows, steps, device=device)
    for members, row_generator in generator:
        draws[members] = torch.rand(len(members), steps, generator=row_generator, device=device)
    return draws


def _inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] for the uniform ``draws`` [B]: the first whose cumulative
    probability reaches ``(1 - u)`` of the row's total (never a token of probability 0)."""
    cumulative = probs.cumsum(dim=-1)
    targets = (1.0 - draws).unsqueeze(-1) * cumulative[:, -1:]
    return torch.searchsorted(cumulative, targets).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


class _Interrupted(Exception):
    """A group's sampling failed after ``steps`` steps; ``prefixes``: each row's completion so far."""

    def __init__(self, prefixes: list[GeneratedPrefix], steps: int) -> None:
        super().__init__(f"sampling failed after {steps} step(s)")
        self.prefixes, self.steps = prefixes, steps
