"""Shared types of the inference layer: the `Policy` protocol, its outputs and its errors.

Nothing here imports torch, transformers or an HTTP client, so the collector and the
vector env can type against these names cheaply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


class PolicyError(Exception):
    """Base class of the errors raised by the inference layer."""


class PolicyClosedError(PolicyError, RuntimeError):
    """The policy was closed: no new requests, and unanswered ones fail with this."""


class BackendError(PolicyError, RuntimeError):
    """The backend failed for good (after its retries); set on the affected futures."""


class BackendRejectedError(PolicyError, ValueError):
    """The backend refused a request as invalid (e.g. an HTTP 4xx); never retried."""


class TransientBackendError(PolicyError, ConnectionError):
    """A failure worth retrying (server unreachable, 5xx, timeout)."""


@dataclass(frozen=True)
class PolicyOutput:
    """One answer of a policy to one observation.

    Attributes:
        action: the action to execute (for Box spaces unclipped; the env wrapper may clip).
        behavior_logp: log-probability of ``action`` under the behaviour policy that produced
            it. For text policies it is the log-probability of the sampled completion (sum of
            ``token_logps``), also when the parser rejected it. For deadline fallbacks it is
            0.0: the fallback rule is deterministic, so it chose its action with probability 1.
        policy_version: version of the weights that computed the answer (for fallbacks: the
            version current when the fallback was delivered).
        latency_s: seconds from ``submit`` to delivery.
        fallback: True when ``action`` is the configured fallback (deadline missed, or a text
            completion the action parser rejected).
        text: the sampled completion (text policies only).
        token_ids: token ids of the completion, eos included when sampled (text policies).
        token_logps: log-probability of each token in ``token_ids`` (text policies).
        top_logprobs: per generated token, the most likely tokens of the sampling
            distribution and their log-probabilities, when requested (text policies).
        token_versions: the policy version that sampled each token of ``token_ids`` (None: every token has ``policy_version``)

    Example:
        >>> out = PolicyOutput(action=1, behavior_logp=-0.69, policy_version=3, latency_s=0.01)
        >>> out.fallback
        False
    """

    action: Any
    behavior_logp: float
    policy_version: int
    latency_s: float
    fallback: bool = False
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    token_logps: tuple[float, ...] | None = None
    top_logprobs: tuple[Mapping[int, float], ...] | None = None
    token_versions: tuple[int, ...] | None = None


@dataclass(frozen=True)
class BackendResult:
    """What a backend's ``_forward_batch`` returns for one observation.

    ``rejected=True`` marks a text completion the action parser could not turn into an
    action; the policy then executes its fallback action (flagged) and keeps ``logp`` and
    the token fields. ``policy_version`` is set by backends that learn the version from the
    server (an asyncvec server reports it); otherwise the policy fills in its own.

    token_versions: the policy version that sampled each token of ``token_ids`` (None: every token has ``policy_version``)

    Example:
        >>> BackendResult(action=2, logp=-1.1).rejected
        False
    """

    action: Any
    logp: float
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    token_logps: tuple[float, ...] | None = None
    top_logprobs: tuple[Mapping[int, float], ...] | None = None
    rejected: bool = False
    policy_version: int | None = None
    token_versions: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TextPrompt:
    """A prompt for a text policy with per-request sampling settings.

    A plain ``str`` observation means "this prompt with the policy's defaults"; a
    ``TextPrompt`` overrides them for one request (``None`` keeps the default). The
    OpenAI-compatible server uses it to honour each request's settings.

    Attributes:
        prompt: the text, or the prompt's token ids (a tuple of ints: token-in, token-out).
        max_new_tokens, temperature, top_p: sampling settings (None: the policy's default).
        top_logprobs: how many of the most likely tokens to report per step (0-20).
        stop: strings that end the completion; the text stops before the first one found, the
            token ids and log-probs run up to the token that completed it.
        seed: seed of this request's sampling (None: the engine's random stream).

    Example:
        >>> TextPrompt("3+4=", max_new_tokens=2, temperature=0.0).prompt
        '3+4='
        >>> TextPrompt((6, 13, 7, 17), stop=("\\n",), seed=7).seed
        7
    """

    prompt: str | tuple[int, ...]
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None


@runtime_checkable
class Policy(Protocol):
    """What the collector needs from a policy: futures in, versioned answers out.

    Example:
        >>> import gymnasium as gym, torch
        >>> from asyncvec.inference import TorchPolicy
        >>> policy = TorchPolicy(torch.nn.Linear(4, 2), gym.spaces.Discrete(2))
        >>> isinstance(policy, Policy)
        True
        >>> policy.submit([0.0, 0.1, 0.2, 0.3], env_id=0).result(timeout=10).policy_version
        0
        >>> policy.close()
    """

    @property
    def policy_version(self) -> int:
        """Version of the weights currently answering."""
        ...

    def submit(self, obs: Any, *, env_id: int | None = None, priority: int = 0) -> Future:
        """Queue one observation; the future resolves to a `PolicyOutput`."""
        ...

    def act(
        self,
        obs_batch: Any,
        *,
        env_ids: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> list[PolicyOutput]:
        """Submit a batch and wait for all answers."""
        ...

    def load_weights(self, weights: Any, version: int) -> None:
        """Publish new weights; every answer delivered afterwards reports ``version``."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters and latency percentiles."""
        ...

    def close(self) -> None:
        """Stop threads and fail unanswered requests with `PolicyClosedError`."""
        ...

    def __enter__(self) -> Policy: ...

    def __exit__(self, *exc_info: Any) -> None: ...
