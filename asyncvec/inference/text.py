"""`TextPolicy`: what the text backends (HF, OpenAI HTTP, vLLM) share.

Observations are prompts (``str`` or `TextPrompt`); the model's completion goes through
``action_parser(text) -> action``. A completion the parser rejects (it raises ValueError,
TypeError, KeyError or IndexError, returns None, or returns an action outside
``action_space``) becomes the fallback action with ``fallback=True``; the completion, its
token ids and log-probs are kept, and ``behavior_logp`` is the completion's log-probability.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from asyncvec.inference.base import BatchedPolicy
from asyncvec.inference.types import BackendResult, TextPrompt

REJECTING_ERRORS = (ValueError, TypeError, KeyError, IndexError)


def group_by_sampling(prompts: Sequence[TextPrompt]) -> dict[tuple[Any, ...], list[int]]:
    """Indices of prompts that share sampling settings (one backend call per group).

    Example:
        >>> group_by_sampling([TextPrompt("a", 4, 1.0), TextPrompt("b", 4, 1.0), TextPrompt("c", 2, 1.0)])
        {(4, 1.0, None, 0): [0, 1], (2, 1.0, None, 0): [2]}
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, prompt in enumerate(prompts):
        key = (prompt.max_new_tokens, prompt.temperature, prompt.top_p, prompt.top_logprobs)
        groups.setdefault(key, []).append(index)
    return groups


class TextPolicy(BatchedPolicy):
    """Base of the text backends: prompt validation, sampling defaults and action parsing.

    Args:
        action_parser: ``text -> action``; reject a completion by raising ValueError (or
            TypeError/KeyError/IndexError) or returning None.
        max_new_tokens: default completion length limit.
        temperature: default sampling temperature; 0 means greedy decoding.
        top_p: default nucleus mass (None: no nucleus filtering).
        **kwargs: `BatchedPolicy` options. ``action_space`` (or a ``fallback`` function) is
            required, since rejected completions need a fallback action.
    """

    _can_reject = True

    def __init__(
        self,
        action_parser: Callable[[str], Any],
        *,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float | None = None,
        **kwargs: Any,
    ) -> None:
        if not callable(action_parser):
            label = kwargs.get("name") or type(self).__name__
            raise TypeError(f"{label}: action_parser must be callable, got {type(action_parser).__name__}")
        super().__init__(**kwargs)
        self.action_parser = action_parser
        self.defaults = self._check_sampling(TextPrompt("-", max_new_tokens, float(temperature), top_p), "")

    def _check_sampling(self, prompt: TextPrompt, where: str) -> TextPrompt:
        """Validate sampling fields (backends may add limits) and return ``prompt``."""
        if (
            isinstance(prompt.max_new_tokens, bool)
            or not isinstance(prompt.max_new_tokens, int)
            or prompt.max_new_tokens < 1
        ):
            raise ValueError(f"{self._label}: {where}max_new_tokens must be an int >= 1, got {prompt.max_new_tokens!r}")
        if (
            isinstance(prompt.temperature, bool)
            or not isinstance(prompt.temperature, (int, float))
            or not prompt.temperature >= 0
        ):
            raise ValueError(f"{self._label}: {where}temperature must be a number >= 0, got {prompt.temperature!r}")
        if prompt.top_p is not None and (not isinstance(prompt.top_p, (int, float)) or not 0 < prompt.top_p <= 1):
            raise ValueError(f"{self._label}: {where}top_p must be in (0, 1] or None, got {prompt.top_p!r}")
        if (
            isinstance(prompt.top_logprobs, bool)
            or not isinstance(prompt.top_logprobs, int)
            or not 0 <= prompt.top_logprobs <= 20
        ):
            raise ValueError(
                f"{self._label}: {where}top_logprobs must be an int in [0, 20], got {prompt.top_logprobs!r}"
            )
        return prompt

    def _check_obs(self, obs: Any, env_id: int | None) -> TextPrompt:
        where = f"env_id={env_id}: " if env_id is not None else ""
        if isinstance(obs, str):
            prompt = TextPrompt(obs)
        elif isinstance(obs, TextPrompt):
            prompt = obs
        else:
            raise ValueError(f"{self._label}: {where}expected a str prompt or a TextPrompt, got {type(obs).__name__}")
        if not isinstance(prompt.prompt, str) or not prompt.prompt:
            raise ValueError(f"{self._label}: {where}the prompt must be a non-empty str, got {prompt.prompt!r}")
        defaults = self.defaults
        prompt = TextPrompt(
            prompt.prompt,
            defaults.max_new_tokens if prompt.max_new_tokens is None else prompt.max_new_tokens,
            defaults.temperature if prompt.temperature is None else float(prompt.temperature),
            defaults.top_p if prompt.top_p is None else prompt.top_p,
            prompt.top_logprobs,
        )
        if prompt.temperature == 0:
            prompt = TextPrompt(prompt.prompt, prompt.max_new_tokens, 0.0, None, prompt.top_logprobs)
        self._check_sampling(prompt, where)
        self._check_prompt(prompt, where)
        return prompt

    def _check_prompt(self, prompt: TextPrompt, where: str) -> None:
        """Backend-specific prompt checks (e.g. length against the context window)."""

    def parse(self, text: str) -> tuple[Any, bool]:
        """Run the action parser: ``(action, False)``, or ``(None, True)`` when rejected."""
        try:
            action = self.action_parser(text)
        except REJECTING_ERRORS:
            return None, True
        except Exception as exc:  # a parser bug is not a bad completion: fail loudly, without retries
            raise TypeError(f"{self._label}: action_parser raised {type(exc).__name__}: {exc}") from exc
        if action is None or (self.action_space is not None and not self.action_space.contains(action)):
            return None, True
        return action, False

    def _text_result(
        self,
        text: str,
        token_ids: Iterable[int] | None,
        token_logps: Iterable[float],
        top_logprobs: Iterable[dict[int, float]] | None = None,
        policy_version: int | None = None,
    ) -> BackendResult:
        logps = tuple(float(value) for value in token_logps)
        action, rejected = self.parse(text)
        return BackendResult(
            action=action,
            logp=float(sum(logps)),
            text=text,
            token_ids=None if token_ids is None else tuple(int(t) for t in token_ids),
            token_logps=logps,
            top_logprobs=None if top_logprobs is None else tuple(top_logprobs),
            rejected=rejected,
            policy_version=policy_version,
        )
