"""`VLLMPolicy`: an in-process vLLM engine (GPU only; the ``vllm`` extra)."""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
from collections.abc import Callable
from typing import Any

from asyncvec.inference.text import TextPolicy, group_by_sampling
from asyncvec.inference.types import BackendResult, TextPrompt
from asyncvec.inference.weights import WeightsSource, load_state_dict_source

INSTALL_HINT = "VLLMPolicy needs vLLM, which runs on a GPU: pip install -e .[vllm]"


def _import_vllm() -> Any:
    # In-process engine core: apply_model then runs on the model object itself, so weight
    # updates need no pickling of tensors or functions across processes.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return vllm


def _engine_supports(vllm: Any, option: str) -> bool:
    engine_args = getattr(vllm, "EngineArgs", None)
    if engine_args is None or not dataclasses.is_dataclass(engine_args):
        return False
    return option in {field.name for field in dataclasses.fields(engine_args)}


def _load_into(model: Any, *, weights: list[tuple[str, Any]]) -> None:
    model.load_weights(weights=weights)


class VLLMPolicy(TextPolicy):
    """A text policy on an in-process ``vllm.LLM`` engine.

    Token log-probs are those of the distribution sampled from: the engine is created with
    ``logprobs_mode="processed_logprobs"`` (after temperature and top-p) where vLLM has that
    option (>= 0.10.2). Older vLLM versions report log-probs of the raw logits, so there
    the policy only accepts ``temperature`` 1.0 (or 0: greedy) and no ``top_p``.

    `load_weights` takes a state dict, a ``torch.save``'d file or a ``save_pretrained``
    folder with HF parameter names; it goes through vLLM's own loading path (the model's
    ``load_weights``, via ``LLM.apply_model`` or, on old versions, the driver worker's
    model runner) and then resets the prefix cache, whose entries hold old-weight KV.

    Requires a GPU and ``pip install -e .[vllm]``; constructing it without vLLM raises
    ImportError with that hint. ``scripts/gpu_check.sh`` exercises it.

    Args:
        model: a model folder or hub name vLLM can load.
        action_parser: ``text -> action`` (see `TextPolicy`).
        max_new_tokens, temperature, top_p: default sampling settings.
        engine_kwargs: passed to ``vllm.LLM`` (e.g. ``dtype``, ``gpu_memory_utilization``).
        **kwargs: `BatchedPolicy` options (``max_inflight_batches`` must stay 1: one engine).

    Example (on a GPU machine with vLLM):
        >>> policy = VLLMPolicy("./tiny-lm", int, action_space=gym.spaces.Discrete(10))  # doctest: +SKIP
        >>> policy.submit("3+4=").result(timeout=60).token_logps  # doctest: +SKIP
    """

    def __init__(
        self,
        model: str | os.PathLike,
        action_parser: Callable[[str], Any],
        *,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        vllm = _import_vllm()
        if kwargs.get("max_inflight_batches", 1) != 1:
            raise ValueError("VLLMPolicy: max_inflight_batches must be 1 (vllm.LLM.generate is not re-entrant)")
        self._vllm = vllm
        self._processed_logprobs = _engine_supports(vllm, "logprobs_mode")
        super().__init__(action_parser, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, **kwargs)
        options = dict(engine_kwargs or {})
        if self._processed_logprobs:
            options.setdefault("logprobs_mode", "processed_logprobs")
        self.llm = vllm.LLM(model=os.fspath(model), **options)

    def _check_sampling(self, prompt: TextPrompt, where: str) -> TextPrompt:
        prompt = super()._check_sampling(prompt, where)
        if not self._processed_logprobs and (prompt.temperature not in (0.0, 1.0) or prompt.top_p not in (None, 1.0)):
            raise ValueError(
                f"{self._label}: {where}this vLLM reports log-probs of the raw logits, so only temperature 1.0 "
                f"(or 0) without top_p gives behaviour log-probs; got temperature={prompt.temperature}, "
                f"top_p={prompt.top_p} (vLLM >= 0.10.2 lifts this)"
            )
        return prompt

    def _forward_batch(self, prompts: list[TextPrompt]) -> list[BackendResult]:
        results: list[BackendResult | None] = [None] * len(prompts)
        for (max_new_tokens, temperature, top_p, top_k), indices in group_by_sampling(prompts).items():
            params = self._vllm.SamplingParams(
                n=1,
                max_tokens=max_new_tokens,
                temperature=temperature,
                top_p=1.0 if top_p is None else top_p,
                logprobs=top_k,
            )
            outputs = self.llm.generate([prompts[i].prompt for i in indices], params, use_tqdm=False)
            for index, request_output in zip(indices, outputs, strict=True):
                completion = request_output.outputs[0]
                token_ids = list(completion.token_ids)
                steps = completion.logprobs or []
                if len(steps) != len(token_ids):
                    raise RuntimeError(
                        f"{self._label}: vLLM returned {len(steps)} log-prob steps for {len(token_ids)} tokens"
                    )
                token_logps = [step[token].logprob for step, token in zip(steps, token_ids, strict=True)]
                top = [{token: entry.logprob for token, entry in step.items()} for step in steps] if top_k else None
                results[index] = self._text_result(completion.text, token_ids, token_logps, top)
        return results  # type: ignore[return-value]

    def _apply_weights(self, weights: WeightsSource, version: int) -> None:
        items = list(load_state_dict_source(weights).items())
        load = functools.partial(_load_into, weights=items)
        if hasattr(self.llm, "apply_model"):
            self.llm.apply_model(load)
        else:  # vLLM < 0.8
            load(self.llm.llm_engine.model_executor.driver_worker.model_runner.model)
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()

    def _close_backend(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        del self.llm
        gc.collect()
