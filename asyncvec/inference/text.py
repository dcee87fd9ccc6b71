"""`TextPolicy`: what the text backends (HF, OpenAI HTTP, vLLM) share.

Observations are prompts (``str`` or `TextPrompt`); the model's completion goes through
``action_parser(text) -> action``. A completion the parser rejects (it raises ValueError,
TypeError, KeyError or IndexError, returns None, or returns an action outside
``action_space``) becomes the fallback action with ``fallback=True``; the completion, its
token ids and log-probs are kept, and ``behavior_logp`` is the completion's log-probability.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from asyncvec.inference.base import BatchedPolicy
from asyncvec.inference.requests import Request
from asyncvec.inference.types import BackendResult, GeneratedPrefix, PartialBatchError, TextPrompt

REJECTING_ERRORS = (ValueError, TypeError, KeyError, IndexError)
MAX_STOP_STRINGS = 4


def sampling_key(prompt: TextPrompt) -> tuple[Any, ...]:
    """The settings that must be equal for prompts to share one engine call.

    Example:
        >>> sampling_key(TextPrompt("a", 4, 1.0, stop=("\\n",)))
        (4, 1.0, None, 0, ('\\n',), None)
    """
    return (prompt.max_new_tokens, prompt.temperature, prompt.top_p, prompt.top_logprobs, prompt.stop, prompt.seed)


def group_by_sampling(prompts: Sequence[TextPrompt], seeds: bool = True) -> dict[tuple[Any, ...], list[int]]:
    """Indices of prompts that share sampling settings (one backend call per group); ``seeds=False``:
    prompts of different seeds share a group too (a backend that samples each seed's rows with
    their own generator in one call), the key's seed is then None.

    Example:
        >>> groups = group_by_sampling([TextPrompt("a", 4, 1.0), TextPrompt("b", 4, 1.0), TextPrompt("c", 2, 1.0)])
        >>> list(groups.values())
        [[0, 1], [2]]
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, prompt in enumerate(prompts):
        key = sampling_key(prompt)
        groups.setdefault(key if seeds else (*key[:-1], None), []).append(index)
    return groups


def group_identical(prompts: Sequence[TextPrompt], indices: Iterable[int]) -> dict[TextPrompt, list[int]]:
    """Indices (from ``indices``) of equal prompts (same text, same settings), in first-seen
    order: ``k`` copies of one prompt become one engine request with ``n = k`` completions.

    Example:
        >>> groups = group_identical([TextPrompt("a"), TextPrompt("b"), TextPrompt("a")], [0, 1, 2])
        >>> list(groups.values())
        [[0, 2], [1]]
    """
    copies: dict[TextPrompt, list[int]] = {}
    for index in indices:
        copies.setdefault(prompts[index], []).append(index)
    return copies


def truncate_at_stop(
    token_ids: Sequence[int], decode: Callable[[Sequence[int]], str], stop: Sequence[str]
) -> tuple[int, str, bool]:
    """Where a completion ends with stop strings: ``(tokens_kept, text, stopped)``.

    The completion ends at the first token after which the decoded text contains a stop
    string; the text ends before that string (as in OpenAI's API), the tokens and their
    log-probs run up to and including that token.

    Example:
        >>> decode = lambda ids: "".join("ab\\ncd"[i] for i in ids)
        >>> truncate_at_stop([0, 1, 2, 3, 4], decode, ["\\n"])
        (3, 'ab', True)
        >>> truncate_at_stop([0, 1], decode, ["\\n"])
        (2, 'ab', False)
    """
    if stop:
        for kept in range(1, len(token_ids) + 1):
            text = decode(token_ids[:kept])
            positions = [text.find(item) for item in stop if item in text]
            if positions:
                return kept, text[: min(positions)], True
    return len(token_ids), decode(token_ids), False


class TextPolicy(BatchedPolicy):
    """Base of the text backends: prompt validation, sampling defaults and action parsing.

    Args:
        action_parser: ``text -> action``; reject a completion by raising ValueError (or
            TypeError/KeyError/IndexError) or returning None.
        max_new_tokens: default completion length limit.
        temperature: default sampling temperature; 0 means greedy decoding.
        top_p: default nucleus mass (None: no nucleus filtering).
        resume_from_prefix: when an attempt fails while generating and the backend reports what
            each completion had generated (`PartialBatchError`: a server killed mid-stream, an
            in-process engine that failed mid-batch), the retry continues each completion from
            there: prompt + the tokens so far as its prompt, ``max_new_tokens`` less those tokens.
            The prefix keeps its log-probs and versions, the continuation's tokens carry the
            version that sampled them (``token_versions`` when they differ). False: the retry
            starts each completion again, finished ones too (as before this option; their tokens
            are counted in ``regenerated_tokens``).
        **kwargs: `BatchedPolicy` options. ``action_space`` (or a ``fallback`` function) is
            required, since rejected completions need a fallback action.

    `stats` adds ``resumed_requests`` (completions delivered after being continued from a
    prefix), ``resumed_tokens`` (prefix tokens kept, not sampled again) and
    ``regenerated_tokens`` (tokens generated before a failure and sampled again: the prompt
    could not be turned into token ids, or ``resume_from_prefix=False``).
    """

    _can_reject = True

    def __init__(
        self,
        action_parser: Callable[[str], Any],
        *,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float | None = None,
        resume_from_prefix: bool = True,
        **kwargs: Any,
    ) -> None:
        label = kwargs.get("name") or type(self).__name__
        if not callable(action_parser):
            raise TypeError(f"{label}: action_parser must be callable, got {type(action_parser).__name__}")
        if not isinstance(resume_from_prefix, bool):
            raise TypeError(f"{label}: resume_from_prefix must be a bool, got {type(resume_from_prefix).__name__}")
        super().__init__(**kwargs)
        self.resume_from_prefix = resume_from_prefix
        self._resume_counts = {"resumed_requests": 0, "resumed_tokens": 0, "regenerated_tokens": 0}
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
        stop = prompt.stop
        if (
            not isinstance(stop, tuple)
            or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(item, str) and item for item in stop)
        ):
            raise ValueError(
                f"{self._label}: {where}stop must be a tuple of at most {MAX_STOP_STRINGS} non-empty str, got {stop!r}"
            )
        if prompt.seed is not None and (isinstance(prompt.seed, bool) or not isinstance(prompt.seed, int)):
            raise ValueError(f"{self._label}: {where}seed must be an int or None, got {prompt.seed!r}")
        return prompt

    def _check_obs(self, obs: Any, env_id: int | None) -> TextPrompt:
        where = f"env_id={env_id}: " if env_id is not None else ""
        if isinstance(obs, (str, list, tuple)):
            prompt = TextPrompt(obs)
        elif isinstance(obs, TextPrompt):
            prompt = obs
        else:
            raise ValueError(
                f"{self._label}: {where}expected a str prompt, a list of token ids or a TextPrompt, "
                f"got {type(obs).__name__}"
            )
        text = prompt.prompt
        if type(text) is tuple and text and set(map(type, text)) == {int}:  # 3x faster than all(...) per token
            pass  # already a tuple of int (the common case: a conversation's ids)
        elif isinstance(text, (list, tuple)):
            if not text or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in text):
                raise ValueError(f"{self._label}: {where}a token-id prompt must be a non-empty list of int")
            text = tuple(int(t) for t in text)
        elif not isinstance(text, str) or not text:
            raise ValueError(f"{self._label}: {where}the prompt must be a non-empty str, got {text!r}")
        defaults = self.defaults
        stop = (
            prompt.stop
            if not isinstance(prompt.stop, (list, str))
            else ((prompt.stop,) if isinstance(prompt.stop, str) else tuple(prompt.stop))
        )
        temperature = defaults.temperature if prompt.temperature is None else float(prompt.temperature)
        prompt = TextPrompt(
            text,
            defaults.max_new_tokens if prompt.max_new_tokens is None else prompt.max_new_tokens,
            temperature,
            None if temperature == 0 else (defaults.top_p if prompt.top_p is None else prompt.top_p),
            prompt.top_logprobs,
            stop,
            prompt.seed,
        )
        self._check_sampling(prompt, where)
        self._check_prompt(prompt, where)
        return prompt

    def _check_prompt(self, prompt: TextPrompt, where: str) -> None:
        """Backend-specific prompt checks (e.g. length against the context window)."""

    def _check_fits_context(
        self,
        prompt: TextPrompt,
        where: str,
        *,
        count_tokens: Callable[[str], int],
        vocab_size: int | None,
        context: int | None,
    ) -> None:
        """Token ids inside the vocabulary, and prompt + ``max_new_tokens`` inside the context."""
        if isinstance(prompt.prompt, str):
            length = count_tokens(prompt.prompt)
        else:
            bad = [token for token in prompt.prompt if vocab_size is not None and not 0 <= token < vocab_size]
            if bad:
                raise ValueError(f"{self._label}: {where}token ids must be in [0, {vocab_size}), got {bad[:5]}")
            length = len(prompt.prompt)
        if length == 0:
            raise ValueError(f"{self._label}: {where}the prompt tokenizes to no tokens")
        if context is not None and length + prompt.max_new_tokens > context:
            raise ValueError(
                f"{self._label}: {where}prompt of {length} tokens + max_new_tokens {prompt.max_new_tokens} "
                f"exceeds the model's context of {context} tokens"
            )

    def submit_group(
        self, prompt: str | Sequence[int] | TextPrompt, n: int, *, env_id: int | None = None, priority: int = 0
    ) -> list[Future]:
        """Queue ``n`` completions of one prompt (e.g. an RLOO group); one future each.

        The copies enter the batcher together, so they normally reach the engine in one batch,
        where the vLLM and OpenAI backends send them as one request with ``n`` completions.

        Example:
            >>> import tempfile, gymnasium as gym
            >>> from asyncvec.inference import HFTextPolicy, build_tiny_lm
            >>> folder = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32)
            >>> with HFTextPolicy(folder, action_parser=str, action_space=gym.spaces.Text(8), max_new_tokens=2) as policy:
            ...     answers = [f.result(timeout=30) for f in policy.submit_group("3+4=", 4)]
            >>> len(answers)
            4
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{self._label}: n must be an int >= 1, got {n!r}")
        return [self.submit(prompt, env_id=env_id, priority=priority) for _ in range(n)]

    def stats(self) -> dict[str, float]:
        """`BatchedPolicy.stats` plus ``resumed_requests``, ``resumed_tokens`` and ``regenerated_tokens``
        (see the class docstring)."""
        stats = super().stats()
        with self._stats_lock:
            stats.update(self._resume_counts)
        return stats

    # ------------------------------------------------------------------ resume from a prefix
    def _prompt_ids(self, prompt: TextPrompt) -> tuple[int, ...] | None:
        """The prompt's token ids as the engine sees them (None: they cannot be known here)."""
        return prompt.prompt if isinstance(prompt.prompt, tuple) else None

    def _decode_ids(self, token_ids: Sequence[int]) -> str | None:
        """Text of ``token_ids`` as the engine decodes a completion (None: no tokenizer here)."""
        return None

    def _end_token_ids(self) -> frozenset[int]:
        """Token ids that end a completion (the tokenizer's end-of-sequence): a prefix ending in one is
        finished, whatever its stream said (empty: not known here)."""
        return frozenset()

    def _attempt_obs(self, request: Request) -> Any:
        prefix: GeneratedPrefix | None = request.prefix
        if prefix is None:
            return request.obs
        prompt: TextPrompt = request.obs
        ids = self._prompt_ids(prompt)
        assert ids is not None  # _keep_partial keeps a prefix only when the prompt's ids are known
        return dataclasses.replace(
            prompt,
            prompt=ids + prefix.token_ids,
            max_new_tokens=prompt.max_new_tokens - len(prefix.token_ids),  # type: ignore[operator]
        )

    def _keep_partial(self, requests: list[Request], error: BaseException) -> list[tuple[Request, BackendResult]]:
        # a supervisor that gives up raises its own error over the batch's PartialBatchError (its context): the
        # completions that had finished are still delivered, the others then get their fallbacks
        while not isinstance(error, PartialBatchError) and error.__context__ is not None:
            error = error.__context__
        if not isinstance(error, PartialBatchError) or len(error.prefixes) != len(requests):
            return []
        ready = []
        ends = self._end_token_ids()
        for request, prefix in zip(requests, error.prefixes, strict=True):
            if prefix is None or (not prefix.token_ids and not prefix.finished):
                continue
            if not prefix.finished and prefix.token_ids[-1] in ends:
                # it sampled its end token before the failure (its final event had not come yet): it is done,
                # and continuing it would add tokens after the end
                prefix = dataclasses.replace(prefix, finished=True)
            keep = self.resume_from_prefix and (prefix.finished or self._prompt_ids(request.obs) is not None)
            if not keep:
                with self._stats_lock:
                    self._resume_counts["regenerated_tokens"] += len(prefix.token_ids)
                continue
            joined = prefix if request.prefix is None else join_prefixes(request.prefix, prefix)
            if not joined.finished and len(joined.token_ids) >= request.obs.max_new_tokens:
                joined = dataclasses.replace(joined, finished=True)  # its length is reached
            request.prefix = joined
            if joined.finished:
                ready.append((request, self._joined_result(request, None)))
        return ready

    def _finish(self, request: Request, result: BackendResult, version: int) -> BackendResult:
        if request.prefix is None:
            return result
        return self._joined_result(request, result, version)

    def _joined_result(self, request: Request, result: BackendResult | None, version: int = 0) -> BackendResult:
        """``request``'s prefix followed by ``result`` (None: the prefix is the whole completion)."""
        prefix: GeneratedPrefix = request.prefix
        prompt: TextPrompt = request.obs
        ids, logps, versions = list(prefix.token_ids), list(prefix.token_logps), list(prefix.token_versions)
        top = None if prefix.top_logprobs is None else list(prefix.top_logprobs)
        text = prefix.text
        if result is not None:
            new_ids = list(result.token_ids or ())
            ids += new_ids
            logps += list(result.token_logps or ())
            own = result.policy_version if result.policy_version is not None else version
            versions += list(result.token_versions or [own] * len(new_ids))
            top = None if top is None or result.top_logprobs is None else top + list(result.top_logprobs)
            text += result.text or ""
        decoded = self._decode_ids(ids)
        if decoded is not None:
            kept, text, _ = truncate_at_stop(ids, self._decode_ids, prompt.stop)  # a stop string across the seam
            ids, logps, versions = ids[:kept], logps[:kept], versions[:kept]
            top = None if top is None else top[:kept]
        else:
            cuts = [text.find(stop) for stop in prompt.stop if stop in text]
            text = text[: min(cuts)] if cuts else text
        with self._stats_lock:
            self._resume_counts["resumed_requests"] += 1
            self._resume_counts["resumed_tokens"] += len(prefix.token_ids)
        spanning = len(set(versions)) > 1
        return self._text_result(
            text,
            ids,
            logps,
            top,
            policy_version=min(versions) if versions else version,
            token_versions=versions if (spanning or self.inflight_updates) else None,
        )

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
        token_versions: Iterable[int] | None = None,
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
            token_versions=None if token_versions is None else tuple(int(v) for v in token_versions),
        )


def join_prefixes(first: GeneratedPrefix, then: GeneratedPrefix) -> GeneratedPrefix:
    """``first`` followed by ``then`` (what an attempt that continued ``first`` generated before it failed too).

    Example:
        >>> a = GeneratedPrefix((1,), (-0.5,), (2,), "a")
        >>> join_prefixes(a, GeneratedPrefix((5, 6), (-1.0, -2.0), (3, 3), "bc", finished=True)).token_versions
        (2, 3, 3)
    """
    top = None
    if first.top_logprobs is not None and then.top_logprobs is not None:
        top = first.top_logprobs + then.top_logprobs
    return GeneratedPrefix(
        first.token_ids + then.token_ids,
        first.token_logps + then.token_logps,
        first.token_versions + then.token_versions,
        first.text + then.text,
        top,
        then.finished,
    )
