"""`OpenAIPolicy`: completions with log-probs from an OpenAI-compatible server (vLLM, SGLang,
``asyncvec serve``), batched requests, and weight sync through each server's own routes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import threading
from collections.abc import Callable
from functools import reduce
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from asyncvec.inference.backends.server_client import ServerClient, is_transient
from asyncvec.inference.backends.server_routes import GENERATE_ROUTE, ROUTES, SERVER_KINDS, parse_version
from asyncvec.inference.backends.streamed import (
    GroupInterrupted,
    StreamedChoice,
    finished_prefix,
    raise_failures,
    token_id,
)
from asyncvec.inference.backends.vllm_policy import token_versions_of
from asyncvec.inference.backends.weight_publisher import WeightPublisher
from asyncvec.inference.text import TextPolicy, group_by_sampling, group_identical
from asyncvec.inference.types import (
    BackendError,
    BackendRejectedError,
    BackendResult,
    GeneratedPrefix,
    TextPrompt,
    TransientBackendError,
)

if TYPE_CHECKING:
    from asyncvec.inference.serving.supervisor import EngineSupervisor


class OpenAIPolicy(TextPolicy):
    """A text policy served over ``/v1/completions`` by vLLM, SGLang or ``asyncvec serve``.

    **Requests.** Each batch is one HTTP request per group of equal sampling settings (one
    request in the usual case): ``prompt`` is the list of the batch's prompts (text or token
    ids) and ``k`` copies of a prompt (`submit_group`) are asked for once with ``n = k``.
    ``batch_requests=False`` sends one request per completion instead (the slow path, kept
    for comparison). Requests run on a pooled ``httpx.AsyncClient`` on a private event-loop
    thread, ask for ``logprobs`` and, with ``return_token_ids``, for the token ids.

    **Errors.** An unreachable server, timeouts, 429 and 5xx are retried (`BatchedPolicy`'s
    ``max_attempts`` with back-off); other 4xx are not (`BackendRejectedError`, with the
    server's message). Then the futures fail with `BackendError`, or get the fallback action
    at their ``deadline_ms``. A server that comes back (restarted on the same address) is used
    again by the next batch.

    **A server that dies** (``supervisor=EngineSupervisor(server)``, for a server this process
    started as a `ServerProcess`): a failed request first goes to the supervisor, which
    restarts a dead or hung server and has it load the last weights given to `load_weights`
    (as that version) before anything else is sent; then the batch is retried (so
    ``max_attempts`` must be >= 2) and answered by the restarted server. Requests that still
    fail are answered with the flagged fallback (``fallback_on_error`` defaults to True here):
    ``fallback=True`` and no text, which learners leave out. A publish that meets a dead
    server is repeated once after the restart. `stats` adds the supervisor's counts.

    **Resume from the prefix** (with a supervisor and ``return_token_ids``): completions are
    streamed (``"stream": true``, also through ``/inference/v1/generate`` with
    ``inflight_updates``), so the policy holds each completion's tokens, log-probs and versions
    as they are sampled. When the server dies
    mid-generation, the retry sends each unfinished completion as prompt + its tokens so far
    (token ids: a text prompt needs ``model_dir``'s tokenizer) with ``max_tokens`` less those
    tokens; completions that had finished are delivered as they were. No token is sampled twice
    (``stats()["resumed_tokens"]``; ``regenerated_tokens`` stays 0); the prefix keeps its
    versions and the continuation's tokens carry the restarted server's (``token_versions`` when
    they differ). In flight, vLLM streams the tokens' versions only with a completion's last
    chunk: an unfinished completion's prefix has the batch's start version if no publish of this
    policy began since the batch read it, else it is sampled again (``regenerated_tokens``). A
    completion whose request finally fails is never delivered in part: it gets the flagged
    fallback. See `TextPolicy` (``resume_from_prefix``).

    **Versions.** Every answer carries the version of the weights that produced it:

    * ``asyncvec``: each choice reports ``policy_version``.
    * ``sglang``: the response reports ``metadata.weight_version``.
    * ``vllm``: completions carry no version, so the policy reads ``GET /weight_info`` before
      and after each request; if the two differ (the weights changed meanwhile, by this or
      another client) the answers are discarded and the batch retried. Weight updates pause
      the server, so a request finishes under the version read before it or is retried.
      A server without a numeric version (vLLM's ``"default"``, e.g. after a restart from
      the model folder) serves the policy's initial ``version``, and answers say so.

    **In-flight updates** (``inflight_updates=True``, ``server_kind="vllm"`` only, with
    ``model_dir``; the server started with ``--enable-scale-out``, e.g.
    ``VLLMServer(..., enable_scale_out=True)``): completions go through vLLM's
    token-in-token-out route ``POST /inference/v1/generate`` (one request per distinct prompt
    of a batch, ``n`` copies each; prompts are tokenized here with ``model_dir``'s tokenizer and
    the text decoded from the sampled ids), whose answers carry vLLM's per-token weight-version
    spans: they become ``token_versions`` and ``policy_version`` is the oldest token's. A
    `load_weights` then does not wait for running requests: ``POST /pause?mode=keep`` freezes
    them, the weights are reloaded, ``POST /reset_prefix_cache?reset_running_requests=true``
    preempts them (their prefix is recomputed with the new weights when they go on),
    ``POST /update_weight_version``, ``POST /resume``. Each update costs one re-prefill of the
    running requests; batches are not discarded when the version changes under them.

    **Weights** (`load_weights(weights, version)`): ``weights`` is a checkpoint folder as the
    server sees it, or a state dict / ``torch.nn.Module`` that the policy writes atomically to
    ``checkpoint_dir/<model>-v<version>`` (a folder the server can read; the last
    ``keep_checkpoints`` are kept). Then, through the server's own routes:

    * ``vllm`` (started with ``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=wait`` (in-flight
      requests finish), ``POST /collective_rpc`` ``reload_weights`` from the folder,
      ``POST /update_weight_version``, ``POST /resume``; the version is read back from
      ``GET /weight_info``. A failed reload ends vLLM's engine (and its server), so the folder
      is checked here first: it must be readable on this machine at the same path, hold
      ``*.safetensors``, and, with ``model_dir`` (or a ``config.json`` in the folder), fit the
      model's parameter names and shapes, tied ones included (vLLM reloads every parameter
      from its own name: a ``save_pretrained`` folder lacks GPT-2's ``lm_head.weight``; use
      `write_checkpoint`).
    * ``sglang``: ``POST /pause_generation``, ``POST /update_weights_from_disk``
      (``model_path``, ``weight_version``), ``POST /continue_generation``; the version is read
      back from ``GET /model_info`` (older releases: ``/get_model_info``,
      ``/get_weight_version``). Written to SGLang's documented API; untested here (SGLang
      does not run on these CPU machines).
    * ``asyncvec``: ``POST /update_weights`` (``path``, ``version``), which swaps weights and
      version in one step (its own batcher keeps batches from mixing versions, so it needs no
      pause); read back from ``GET /weight_info``.

    A version that is not newer than the server's, a server of another kind, or a folder that
    cannot be read raise a clear error, and the server keeps serving its current weights.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted).
        model: the served model name.
        action_parser: ``text -> action`` (see `TextPolicy`).
        server_kind: ``"asyncvec"``, ``"vllm"`` or ``"sglang"``: how versions are read and
            weights pushed.
        api_key: bearer token sent with every request.
        update_token: bearer token for weight updates (default: ``api_key``).
        checkpoint_dir: where state dicts given to `load_weights` are written.
        keep_checkpoints: how many written checkpoints to keep (older ones are deleted).
        model_dir: the served model's folder (``config.json`` and tokenizer): checkpoints are
            checked against it, its config is copied into the checkpoints the policy writes,
            and prompts are checked against the context length when they are submitted (a
            prompt the server would refuse would otherwise fail its whole batch).
        max_model_len: context length for that check (default: the config's positions).
        batch_requests: one request per batch (True) or per completion (False).
        request_timeout_s: timeout of one completion request.
        update_timeout_s: timeout of a weight reload.
        max_connections: connection pool size.
        return_token_ids: ask for token ids (``return_tokens_as_token_ids``: vLLM and asyncvec;
            default True except for SGLang).
        supervisor: an `EngineSupervisor` of the server at ``base_url``: restarts it when it
            dies or hangs (see above).
        **kwargs: `TextPolicy`/`BatchedPolicy` options (default ``max_inflight_batches=4``;
            ``inflight_updates=True``: see above).

    Example:
        >>> import gymnasium as gym
        >>> policy = OpenAIPolicy("http://127.0.0.1:9", "tiny", int, action_space=gym.spaces.Discrete(10),
        ...                       max_attempts=1, request_timeout_s=1)
        >>> policy.submit("3+4=").exception(timeout=10).__class__.__name__
        'BackendError'
        >>> policy.close()
    """

    _supports_inflight_updates = True  # for server_kind="vllm" only (checked in __init__)

    def __init__(
        self,
        base_url: str,
        model: str,
        action_parser: Callable[[str], Any],
        *,
        server_kind: str = "asyncvec",
        api_key: str | None = None,
        update_token: str | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        keep_checkpoints: int = 2,
        model_dir: str | os.PathLike | None = None,
        max_model_len: int | None = None,
        batch_requests: bool = True,
        request_timeout_s: float = 30.0,
        update_timeout_s: float = 300.0,
        max_connections: int = 32,
        return_token_ids: bool | None = None,
        supervisor: EngineSupervisor | None = None,
        **kwargs: Any,
    ) -> None:
        import httpx  # noqa: F401 (the serve extra: fail here, before any thread starts, if it is missing)

        from asyncvec.inference.serving.supervisor import EngineSupervisor

        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"OpenAIPolicy: base_url must start with http:// or https://, got {base_url!r}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"OpenAIPolicy: model must be a non-empty str, got {model!r}")
        if server_kind not in SERVER_KINDS:
            raise ValueError(f"OpenAIPolicy: server_kind must be one of {SERVER_KINDS}, got {server_kind!r}")
        for field, value in (("request_timeout_s", request_timeout_s), ("update_timeout_s", update_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"OpenAIPolicy: {field} must be > 0, got {value!r}")
        if isinstance(keep_checkpoints, bool) or not isinstance(keep_checkpoints, int) or keep_checkpoints < 1:
            raise ValueError(f"OpenAIPolicy: keep_checkpoints must be an int >= 1, got {keep_checkpoints!r}")
        if model_dir is not None and not (Path(model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"OpenAIPolicy: model_dir {str(model_dir)!r} has no config.json")
        if kwargs.get("inflight_updates") is True:
            if server_kind != "vllm":
                raise ValueError(
                    f"OpenAIPolicy: inflight_updates=True needs server_kind='vllm', got server_kind={server_kind!r} "
                    "(only vLLM's /inference/v1/generate reports which weights sampled each token)"
                )
            if model_dir is None:
                raise ValueError(
                    "OpenAIPolicy: inflight_updates=True needs model_dir (its tokenizer turns prompts into the "
                    "token ids vLLM's /inference/v1/generate takes and decodes the sampled ones)"
                )
        base_url = base_url.rstrip("/")
        base_url = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
        if supervisor is not None:
            if not isinstance(supervisor, EngineSupervisor):
                raise TypeError(
                    f"OpenAIPolicy: supervisor must be an EngineSupervisor or None, got {type(supervisor).__name__}"
                )
            if supervisor.url != base_url:
                raise ValueError(
                    f"OpenAIPolicy: base_url {base_url!r} is not the supervised server's url {supervisor.url!r}"
                )
            attempts = kwargs.get("max_attempts", 3)
            if isinstance(attempts, int) and not isinstance(attempts, bool) and attempts < 2:
                raise ValueError(
                    f"OpenAIPolicy: max_attempts must be >= 2 with a supervisor (a batch lost with the server is "
                    f"sent again to the restarted one), got {attempts!r}"
                )
            kwargs.setdefault("fallback_on_error", True)
        kwargs.setdefault("max_inflight_batches", 4)
        super().__init__(action_parser, **kwargs)
        self.base_url = base_url
        self.supervisor = supervisor
        self._batch_state = threading.local()  # per batcher thread: did this batch meet a dead engine?
        self._engine_counts = {"resubmitted_requests": 0, "failed_requests": 0}
        self.model = model
        self.server_kind = server_kind
        self.return_token_ids = server_kind != "sglang" if return_token_ids is None else bool(return_token_ids)
        self.batch_requests = bool(batch_requests)
        self.request_timeout_s = float(request_timeout_s)
        self.update_timeout_s = float(update_timeout_s)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.keep_checkpoints = keep_checkpoints
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self._tokenizer = None
        self.max_model_len = max_model_len
        if self.model_dir is not None:
            import transformers

            self._tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_dir)
            config = transformers.AutoConfig.from_pretrained(self.model_dir)
            if self.max_model_len is None:
                self.max_model_len = getattr(config, "max_position_embeddings", None)
            self._vocab_size = int(config.vocab_size)
        self._tokenizer_lock = threading.Lock()
        self._initial_version = self.policy_version
        self._http_requests = 0
        self._streamed_tokens = 0
        self._batches_generating = 0
        self._publishes_begun = 0  # in flight: a stream's prefix has its start version if none began meanwhile
        self._client = ServerClient(
            base_url,
            api_key=api_key,
            update_token=update_token,
            request_timeout_s=self.request_timeout_s,
            update_timeout_s=self.update_timeout_s,
            max_connections=max_connections,
            name="asyncvec-OpenAIPolicy-http",
        )
        self._routes = ROUTES[server_kind](
            self._client, label=self._label, initial_version=self._initial_version, inflight=self.inflight_updates
        )
        #: completions are streamed, so that a server dying mid-generation leaves their prefix here
        self.streams = supervisor is not None and self.return_token_ids
        self._publisher = WeightPublisher(
            self._routes,
            model=model,
            checkpoint_dir=self.checkpoint_dir,
            keep_checkpoints=keep_checkpoints,
            model_dir=self.model_dir,
            supervisor=supervisor,
        )

    # -------------------------------------------------------------------------- plumbing
    def _check_prompt(self, prompt: TextPrompt, where: str) -> None:
        if self._tokenizer is not None:
            self._check_fits_context(
                prompt, where, count_tokens=self._count_tokens, vocab_size=self._vocab_size, context=self.max_model_len
            )

    def _count_tokens(self, text: str) -> int:
        with self._tokenizer_lock:
            return len(self._tokenizer(text).input_ids)

    def _prompt_ids(self, prompt: TextPrompt) -> tuple[int, ...] | None:
        if isinstance(prompt.prompt, tuple):
            return prompt.prompt
        if self._tokenizer is None:
            return None
        with self._tokenizer_lock:
            return tuple(self._tokenizer(prompt.prompt).input_ids)

    def _decode_ids(self, token_ids: Any) -> str | None:
        if self._tokenizer is None:
            return None
        with self._tokenizer_lock:
            return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def _end_token_ids(self) -> frozenset[int]:
        eos = None if self._tokenizer is None else self._tokenizer.eos_token_id
        return frozenset() if eos is None else frozenset([int(eos)])

    def stats(self) -> dict[str, float]:
        """`TextPolicy.stats` plus ``http_requests`` (completion requests sent, retries included) and
        ``streamed_tokens`` (tokens received in streamed answers so far, see "Resume from the prefix").

        With a supervisor also: ``engine_failures``, ``engine_restarts``,
        ``engine_restart_failures``, ``engine_gave_up`` (`EngineSupervisor.stats`),
        ``resubmitted_requests`` (requests sent again after the server they were sent to died or
        hung) and ``failed_requests`` (requests of such batches answered with the flagged
        fallback or an error instead of a completion).
        """
        stats = {**super().stats(), "http_requests": self._http_requests, "streamed_tokens": self._streamed_tokens}
        if self.supervisor is not None:
            with self._stats_lock:
                stats.update(self._engine_counts)
            stats.update(self.supervisor.stats())
        return stats

    # --------------------------------------------------------------------------- forward
    def _is_transient(self, exc: BaseException) -> bool:
        return is_transient(exc)

    def _forward_batch(self, prompts: list[TextPrompt]) -> list[BackendResult]:
        supervisor = self.supervisor
        if supervisor is None:
            return self._client.run(self._complete_batch(prompts))
        if getattr(self._batch_state, "engine_failed", False):
            with self._stats_lock:
                self._engine_counts["resubmitted_requests"] += len(prompts)
        generation = supervisor.generation  # waits while the server is being restarted
        try:
            supervisor.check_alive()
            results = self._client.run(self._complete_batch(prompts))
            if supervisor.generation != generation:  # answered across a restart: by which weights is unclear
                raise TransientBackendError(f"{self.base_url} was restarted while the batch ran; it is sent again")
        except Exception as exc:
            if self._is_transient(exc):
                # True: the server died under this batch and was restarted (if recover raises: it could
                # not be, and this batch's requests are failed ones); False: it is fine, a plain retry
                restarted = True
                try:
                    restarted = self._publisher.recover(exc, generation)
                finally:
                    if restarted:
                        self._batch_state.engine_failed = True
            raise
        supervisor.request_succeeded()
        return results

    def _run_batch_with_retries(self, batch: list[Any]) -> float | None:
        """`BatchedPolicy`'s retries; with a supervisor, counts what became of a batch that met a dead server."""
        if self.supervisor is None:
            return super()._run_batch_with_retries(batch)
        self._batch_state.engine_failed = False
        try:
            return super()._run_batch_with_retries(batch)
        finally:
            if self._batch_state.engine_failed:
                failed = sum(_not_answered(request.future) for request in batch)
                with self._stats_lock:
                    self._engine_counts["failed_requests"] += failed
            self._batch_state.engine_failed = False

    async def _complete_batch(self, prompts: list[TextPrompt]) -> list[BackendResult]:
        if self.batch_requests:
            groups = list(group_by_sampling(prompts).values())
        else:
            groups = [[index] for index in range(len(prompts))]
        publishes = self._publishes_begun  # read before the version: a publish after it changes the count
        before = await self._routes.batch_version()
        if self.inflight_updates:  # tokens carry their own versions: a version change is no reason to discard
            start = self._initial_version if before is None else before
            self._batches_generating += 1  # this event-loop thread only
            try:
                parts = await asyncio.gather(
                    *(self._generate_group(prompts, indices, start, publishes) for indices in groups),
                    return_exceptions=True,
                )
            finally:
                self._batches_generating -= 1
            raise_failures(parts, self.streams, prompts, start)
            answered = dict(item for part in parts for item in part)
            return [answered[index] for index in range(len(prompts))]
        parts = await asyncio.gather(
            *(self._complete_group(prompts, indices, before) for indices in groups), return_exceptions=True
        )
        raise_failures(parts, self.streams, prompts, before)
        after = await self._routes.batch_version()
        if before != after:
            raise TransientBackendError(
                f"{self.base_url}: the weights changed during the batch (version {before} -> {after}); "
                "its answers are discarded and the batch retried"
            )
        results: list[BackendResult | None] = [None] * len(prompts)
        for part in parts:
            for index, result in part:
                results[index] = result if result.policy_version is not None or before is None else _tag(result, before)
        return results  # type: ignore[return-value]

    async def _complete_group(
        self, prompts: list[TextPrompt], indices: list[int], version: int | None = None
    ) -> list[tuple[int, BackendResult]]:
        copies = list(group_identical(prompts, indices).values())
        n = reduce(math.gcd, (len(group) for group in copies))
        entries = [group[start : start + n] for group in copies for start in range(0, len(group), n)]
        first = prompts[entries[0][0]]
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": [_wire_prompt(prompts[entry[0]].prompt) for entry in entries],
            **_sampling_fields(first, n),
        }
        if self.return_token_ids:
            body["return_tokens_as_token_ids"] = True
        self._http_requests += 1  # one event-loop thread: no lock needed
        if self.streams:
            return await self._stream_group(prompts, body, entries, n, version)
        data = await self._client.request("POST", "/v1/completions", json=body)
        try:
            choices = sorted(data["choices"], key=lambda choice: choice["index"])
        except (KeyError, TypeError) as exc:
            raise BackendRejectedError(f"{self.base_url}/v1/completions: answer has no choices ({exc!r})") from exc
        expected = len(entries) * n
        if len(choices) != expected:
            raise BackendRejectedError(
                f"{self.base_url}/v1/completions returned {len(choices)} choices for {len(entries)} prompts x n={n}"
            )
        response_version = self._routes.response_version(data)
        out = []
        for position, choice in enumerate(choices):
            index = entries[position // n][position % n]
            out.append((index, self._choice_result(choice, prompts[index].top_logprobs, response_version)))
        return out

    async def _stream_group(
        self, prompts: list[TextPrompt], body: dict[str, Any], entries: list[list[int]], n: int, version: int | None
    ) -> list[tuple[int, BackendResult]]:
        """`_complete_group` streamed: each choice's tokens are kept as they arrive, so that a stream
        cut off by a dying server raises `GroupInterrupted` with every completion's prefix."""
        streamed = [StreamedChoice() for _ in range(len(entries) * n)]
        where = f"{self.base_url}/v1/completions"

        def on_event(event: dict[str, Any]) -> None:
            for choice in event.get("choices") or ():
                try:
                    self._streamed_tokens += streamed[int(choice["index"])].add(choice, version)
                except (KeyError, IndexError, TypeError, ValueError) as exc:
                    raise BackendRejectedError(f"{where} streamed a choice this policy cannot read ({exc!r})") from exc

        try:
            await self._client.stream("/v1/completions", json={**body, "stream": True}, on_event=on_event)
        except TransientBackendError as exc:
            prefixes = {
                entries[position // n][position % n]: each.prefix(version) for position, each in enumerate(streamed)
            }
            raise GroupInterrupted(prefixes) from exc
        out = []
        for position, each in enumerate(streamed):
            index = entries[position // n][position % n]
            if each.final is not None:  # asyncvec serve: the whole choice at the end of its stream
                result = self._choice_result(each.final, prompts[index].top_logprobs, None)
            else:
                result = self._text_result(
                    each.text, each.token_ids, each.token_logps, each.top_rows(prompts[index].top_logprobs)
                )
            out.append((index, result))
        return out

    async def _generate_group(
        self, prompts: list[TextPrompt], indices: list[int], start: int, publishes: int = 0
    ) -> list[tuple[int, BackendResult]]:
        """In-flight updates: one ``POST /inference/v1/generate`` per distinct prompt (``n`` copies),
        each answer with the version of each of its tokens (vLLM's weight-version spans)."""
        requests = [
            self._generate_one(prompts, copies, start, publishes)
            for copies in group_identical(prompts, indices).values()
        ]
        parts = await asyncio.gather(*requests, return_exceptions=True)
        failed = [part for part in parts if isinstance(part, BaseException)]
        if failed and self.streams and all(is_transient(part) for part in failed):
            prefixes: dict[int, GeneratedPrefix | None] = {}
            for part in parts:
                if isinstance(part, GroupInterrupted):
                    prefixes.update(part.prefixes)
                elif not isinstance(part, BaseException):
                    prefixes.update((index, finished_prefix(result, start)) for index, result in part)
            raise GroupInterrupted(prefixes) from failed[0]
        if failed:
            raise next((part for part in failed if not is_transient(part)), failed[0])
        return [item for part in parts for item in part]  # type: ignore[union-attr]

    async def _generate_one(
        self, prompts: list[TextPrompt], copies: list[int], start: int, publishes: int = 0
    ) -> list[tuple[int, BackendResult]]:
        first = prompts[copies[0]]
        if isinstance(first.prompt, str):
            with self._tokenizer_lock:
                token_ids = list(self._tokenizer(first.prompt).input_ids)
        else:
            token_ids = list(first.prompt)
        sampling = _sampling_fields(first, len(copies))
        body = {"model": self.model, "token_ids": token_ids, "sampling_params": sampling, "output_mode": "tokens"}
        self._http_requests += 1  # one event-loop thread: no lock needed
        where = f"{self.base_url}{GENERATE_ROUTE}"
        if self.streams:
            data = await self._stream_generate(body, copies, first, start, publishes, where)
        else:
            data = await self._client.request("POST", GENERATE_ROUTE, json=body)
        try:
            choices = sorted(data["choices"], key=lambda choice: choice["index"])
        except (KeyError, TypeError) as exc:
            raise BackendRejectedError(f"{where}: answer has no choices ({exc!r})") from exc
        if len(choices) != len(copies):
            raise BackendRejectedError(f"{where} returned {len(choices)} choices for n={len(copies)}")
        return [
            (index, self._generated_result(choice, first, start, where))
            for index, choice in zip(copies, choices, strict=True)
        ]

    async def _stream_generate(
        self, body: dict[str, Any], copies: list[int], prompt: TextPrompt, start: int, publishes: int, where: str
    ) -> dict[str, Any]:
        """``/inference/v1/generate`` streamed: the answer as the route gives it unstreamed (each choice's
        tokens, log-probs and, from its last chunk, weight-version spans). A stream that breaks off
        raises `GroupInterrupted`: a finished choice whole; an unfinished one its tokens so far, at
        ``start`` if no publish began since the batch read its version (vLLM sends the spans only at
        the end), else none (they are sampled again, counted in ``regenerated_tokens``)."""
        choices = [{"index": i, "token_ids": [], "logprobs": {"content": []}} for i in range(len(copies))]

        def on_event(event: dict[str, Any]) -> None:
            for chunk in event.get("choices") or ():
                choice = choices[int(chunk["index"])]
                tokens = [int(token) for token in chunk.get("token_ids") or ()]
                choice["token_ids"] += tokens
                choice["logprobs"]["content"] += (chunk.get("logprobs") or {}).get("content") or []
                for key in ("weight_versions", "finish_reason"):
                    if chunk.get(key) is not None:
                        choice[key] = chunk[key]
                self._streamed_tokens += len(tokens)

        try:
            await self._client.stream(GENERATE_ROUTE, json={**body, "stream": True}, on_event=on_event)
        except TransientBackendError as exc:
            prefixes: dict[int, GeneratedPrefix | None] = {}
            for index, choice in zip(copies, choices, strict=True):
                ids, content = choice["token_ids"], choice["logprobs"]["content"]
                if "weight_versions" in choice:  # finished: its last chunk came
                    prefixes[index] = finished_prefix(self._generated_result(choice, prompt, start, where), start)
                elif len(content) == len(ids) and self._publishes_begun == publishes:
                    logps = tuple(float(entry["logprob"]) for entry in content)
                    prefixes[index] = GeneratedPrefix(tuple(ids), logps, (start,) * len(ids))
                else:
                    with self._stats_lock:
                        self._resume_counts["regenerated_tokens"] += len(ids)
            raise GroupInterrupted(prefixes) from exc
        return {"choices": choices}

    def _generated_result(self, choice: dict[str, Any], prompt: TextPrompt, start: int, where: str) -> BackendResult:
        """A ``/inference/v1/generate`` choice as a result: text decoded here (cut before the first
        stop string, as ``/v1/completions`` does), versions from its weight-version spans."""
        try:
            token_ids = [int(token) for token in choice["token_ids"]]
            content = choice["logprobs"]["content"]
            token_logps = [float(entry["logprob"]) for entry in content]
            spans = [
                SimpleNamespace(
                    version=str(self._version_label(span["version"])), start=int(span["start"]), end=int(span["end"])
                )
                for span in choice.get("weight_versions") or []
            ]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise BackendRejectedError(
                f"{where}: a choice lacks token_ids/logprobs.content/weight_versions ({exc!r}); is the server "
                "vLLM >= 0.32 with --logprobs-mode processed_logprobs?"
            ) from exc
        try:
            versions = token_versions_of(
                SimpleNamespace(token_ids=token_ids, weight_versions=spans), start, self._label
            )
        except RuntimeError as exc:
            raise BackendError(str(exc)) from None
        top_rows = None
        if prompt.top_logprobs:
            top_rows = [
                {int(top["token_id"]): float(top["logprob"]) for top in entry["top_logprobs"]} for entry in content
            ]
        with self._tokenizer_lock:
            text = self._tokenizer.decode(token_ids, skip_special_tokens=True)
        cuts = [text.find(stop) for stop in prompt.stop if stop in text]
        text = text[: min(cuts)] if cuts else text
        version = versions[0] if versions else start
        return self._text_result(
            text, token_ids, token_logps, top_rows, policy_version=version, token_versions=versions
        )

    def _version_label(self, label: Any) -> int:
        """A vLLM weight-version label as a version (``"default"``: the policy's initial version)."""
        version = parse_version(label)
        return self._initial_version if version is None else version

    def _choice_result(self, choice: dict[str, Any], top_k: int, response_version: int | None) -> BackendResult:
        try:
            text = choice["text"]
            logprobs = choice["logprobs"]
            token_logps = logprobs["token_logprobs"]
            tokens = logprobs.get("tokens")
            top = logprobs.get("top_logprobs")
        except (KeyError, IndexError, TypeError) as exc:
            raise BackendRejectedError(
                f"{self.base_url}/v1/completions: a choice lacks text/logprobs.token_logprobs ({exc!r}); "
                "does the server support logprobs?"
            ) from exc
        token_ids = [token_id(token) for token in tokens] if self.return_token_ids and tokens is not None else None
        top_rows = None
        if top_k and top is not None:
            top_rows = [
                {token_id(key) if self.return_token_ids else key: value for key, value in row.items()} for row in top
            ]
        version = choice.get("policy_version", response_version)
        return self._text_result(text, token_ids, token_logps, top_rows, policy_version=version)

    # --------------------------------------------------------------------------- weights
    def check_server(self) -> dict[str, Any]:
        """Ask the server what it is; raise `BackendRejectedError` if it is not ``server_kind``.

        Returns what the server said (e.g. vLLM's ``{"version": "0.32.0"}``).
        """
        return self._publisher.identify()

    def server_version(self) -> int | None:
        """The weight version the server reports now (None: it has none yet, e.g. vLLM's "default")."""
        return self._publisher.server_version()

    def _prepare_weights(self, weights: Any, version: int) -> str:
        return self._publisher.prepare(weights, version)

    def _apply_weights(self, weights: str, version: int) -> None:
        self._publishes_begun += 1  # only this thread writes it (load_weights holds its update mutex)
        generating = self._batches_generating > 0  # in flight: the update lands inside them
        self._publisher.send(weights, version)
        if self.inflight_updates and generating:
            self._count_inflight_swap()

    def _close_backend(self) -> None:
        self._client.close()


def _not_answered(future: concurrent.futures.Future) -> bool:
    """Whether a resolved request got an error or a fallback with nothing sampled (not a completion)."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return True
    output = future.result()
    return bool(output.fallback and output.text is None)


def _tag(result: BackendResult, version: int) -> BackendResult:
    import dataclasses

    return dataclasses.replace(result, policy_version=version)


def _sampling_fields(prompt: TextPrompt, n: int) -> dict[str, Any]:
    """The sampling settings of ``n`` completions of ``prompt`` as vLLM and OpenAI requests name them."""
    fields: dict[str, Any] = {
        "n": n,
        "max_tokens": prompt.max_new_tokens,
        "temperature": prompt.temperature,
        "logprobs": prompt.top_logprobs,
    }
    if prompt.top_p is not None:
        fields["top_p"] = prompt.top_p
    if prompt.stop:
        fields["stop"] = list(prompt.stop)
    if prompt.seed is not None:
        fields["seed"] = prompt.seed
    return fields


def _wire_prompt(prompt: str | tuple[int, ...]) -> str | list[int]:
    return prompt if isinstance(prompt, str) else list(prompt)
