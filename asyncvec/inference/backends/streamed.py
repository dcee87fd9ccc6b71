"""Streamed completions and what a broken batch leaves: each completion's prefix, for a retry that
continues it (`TextPolicy.resume_from_prefix`). The server backends and `HFTextPolicy` share it."""

from __future__ import annotations

from typing import Any

from asyncvec.inference.backends.server_client import is_transient
from asyncvec.inference.types import (
    BackendRejectedError,
    BackendResult,
    GeneratedPrefix,
    PartialBatchError,
    TextPrompt,
    TransientBackendError,
)

TOKEN_ID_PREFIX = "token_id:"
"""how vLLM and asyncvec serve write a token as its id (``return_tokens_as_token_ids``)"""


class StreamedChoice:
    """One choice of a streamed completion, as its chunks arrive."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.token_logps: list[float] = []
        self.versions: list[int | None] = []
        self.tops: list[dict[int, float]] | None = []
        self.text = ""
        self.finished = False
        self.final: dict[str, Any] | None = None

    def add(self, choice: dict[str, Any], version: int | None) -> int:
        """Take one streamed chunk of this choice; returns how many tokens it brought."""
        if "completion" in choice:
            self.final, self.finished = choice["completion"], True
            return 0
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        self.token_ids += [token_id(token) for token in tokens]
        self.token_logps += [float(value) for value in logprobs.get("token_logprobs") or []]
        self.versions += [choice.get("policy_version", version)] * len(tokens)
        top = logprobs.get("top_logprobs")
        if top is None or self.tops is None:
            self.tops = None
        else:
            self.tops += [{token_id(key): float(value) for key, value in row.items()} for row in top]
        self.text += choice.get("text") or ""
        self.finished = self.finished or choice.get("finish_reason") is not None
        return len(tokens)

    def top_rows(self, top_k: int) -> list[dict[int, float]] | None:
        return self.tops if top_k and self.tops else None

    def prefix(self, version: int | None) -> GeneratedPrefix | None:
        """What this choice had when its stream broke off (None: nothing usable)."""
        if self.final is not None:
            final = self.final
            logprobs = final.get("logprobs") or {}
            ids = tuple(token_id(token) for token in logprobs.get("tokens") or ())
            own = final.get("policy_version", version)
            if own is None:
                return None
            logps = tuple(float(value) for value in logprobs.get("token_logprobs") or ())
            return GeneratedPrefix(ids, logps, (int(own),) * len(ids), final.get("text") or "", finished=True)
        if len(self.token_ids) != len(self.token_logps) or any(v is None for v in self.versions):
            return None
        tops = tuple(self.tops) if self.tops else None
        return GeneratedPrefix(
            tuple(self.token_ids), tuple(self.token_logps), tuple(int(v) for v in self.versions), self.text, tops,  # type: ignore[arg-type]
            finished=self.finished,
        )  # fmt: skip


class GroupInterrupted(TransientBackendError):
    """One streamed request broke off; ``prefixes``: each of its completions' prefix by batch index."""

    def __init__(self, prefixes: dict[int, GeneratedPrefix | None]) -> None:
        super().__init__("a streamed request broke off")
        self.prefixes = prefixes


def finished_prefix(result: BackendResult, version: int | None) -> GeneratedPrefix | None:
    """A completion that was answered, as a finished prefix (None: its versions are unknown)."""
    own = result.policy_version if result.policy_version is not None else version
    if result.token_ids is None or (own is None and result.token_versions is None):
        return None
    ids = result.token_ids
    versions = result.token_versions or (own,) * len(ids)
    return GeneratedPrefix(ids, result.token_logps or (), versions, result.text or "", result.top_logprobs, True)  # type: ignore[arg-type]


def raise_failures(parts: list[Any], streams: bool, prompts: list[TextPrompt], version: int | None) -> None:
    """Raise what failed in a batch's requests (``parts``: results or exceptions): with ``streams``
    and only retryable failures, a `PartialBatchError` with each prompt's prefix; else the first
    failure that is not retryable (or the first one)."""
    failed = [part for part in parts if isinstance(part, BaseException)]
    if not failed:
        return
    if streams and all(is_transient(part) for part in failed):
        raise _partial_batch(prompts, parts, version)  # a retry continues what each completion had
    raise next((part for part in failed if not is_transient(part)), failed[0])


def _partial_batch(prompts: list[TextPrompt], parts: list[Any], version: int | None) -> PartialBatchError:
    """The failure of a streamed batch some of whose requests broke off: each prompt's prefix (a
    request that was answered: its completions, finished; one that broke off: what it had)."""
    prefixes: list[GeneratedPrefix | None] = [None] * len(prompts)
    causes = []
    for part in parts:
        if isinstance(part, GroupInterrupted):
            causes.append(part.__cause__ or part)
            for index, prefix in part.prefixes.items():
                prefixes[index] = prefix
        elif isinstance(part, BaseException):
            causes.append(part)
        else:
            for index, result in part:
                prefixes[index] = finished_prefix(result, version)
    cause = causes[0]
    kept = sum(len(prefix.token_ids) for prefix in prefixes if prefix is not None)
    error = PartialBatchError(f"{cause} ({kept} tokens were generated before; a retry continues from them)", prefixes)
    error.__cause__ = cause
    return error


def token_id(token: Any) -> int:
    if isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX):
        return int(token[len(TOKEN_ID_PREFIX) :])
    raise BackendRejectedError(f"expected tokens as '{TOKEN_ID_PREFIX}N' (return_tokens_as_token_ids), got {token!r}")
