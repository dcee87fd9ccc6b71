"""`OpenAIPolicy`: completions with log-probs from an OpenAI-compatible HTTP server."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any

from asyncvec.inference.text import TextPolicy
from asyncvec.inference.types import (
    BackendError,
    BackendRejectedError,
    BackendResult,
    TextPrompt,
    TransientBackendError,
)

TOKEN_ID_PREFIX = "token_id:"


class OpenAIPolicy(TextPolicy):
    """A text policy served by ``/v1/completions`` (vLLM, SGLang, TGI, ``asyncvec serve``).

    Requests run on an ``httpx.AsyncClient`` with pooled connections on a private event
    loop thread; each prompt of a batch is one concurrent request (the server batches them
    again). Every request asks for ``logprobs`` and, with ``return_token_ids`` (vLLM and
    ``asyncvec serve``), for token ids (``return_tokens_as_token_ids``).

    Errors: unreachable server, timeouts, 429 and 5xx are retried (`TransientBackendError`);
    other 4xx are not (`BackendRejectedError`); after ``max_attempts`` the futures get a
    `BackendError`. The sampled tokens' log-probs are whatever the server reports: an
    asyncvec server reports the sampled distribution; start ``vllm serve`` with
    ``--logprobs-mode processed_logprobs`` when sampling with temperature != 1 or top_p.

    Versions: an asyncvec server reports the version of the weights that answered, and that
    is what the outputs carry. `load_weights(path, version)` asks an asyncvec server to load
    a checkpoint folder (``POST /update_weights``; ``path`` is read on the server, under its
    ``--weights-dir``); other servers update their weights with their own tools.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted).
        model: the served model name.
        action_parser: ``text -> action`` (see `TextPolicy`).
        api_key: sent as a bearer token with completions.
        update_token: bearer token for ``/update_weights`` (default: ``api_key``).
        request_timeout_s: timeout of one HTTP request.
        max_connections: connection pool size.
        return_token_ids: ask for token ids (vLLM/asyncvec extension).
        **kwargs: `TextPolicy`/`BatchedPolicy` options (default ``max_inflight_batches=4``).

    Example:
        >>> import gymnasium as gym
        >>> policy = OpenAIPolicy("http://127.0.0.1:9", "tiny", int, action_space=gym.spaces.Discrete(10),
        ...                       max_attempts=1, request_timeout_s=1)
        >>> policy.submit("3+4=").exception(timeout=10).__class__.__name__
        'BackendError'
        >>> policy.close()
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        action_parser: Callable[[str], Any],
        *,
        api_key: str | None = None,
        update_token: str | None = None,
        request_timeout_s: float = 30.0,
        max_connections: int = 32,
        return_token_ids: bool = True,
        **kwargs: Any,
    ) -> None:
        import httpx

        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"OpenAIPolicy: base_url must start with http:// or https://, got {base_url!r}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"OpenAIPolicy: model must be a non-empty str, got {model!r}")
        if not isinstance(request_timeout_s, (int, float)) or not request_timeout_s > 0:
            raise ValueError(f"OpenAIPolicy: request_timeout_s must be > 0, got {request_timeout_s!r}")
        kwargs.setdefault("max_inflight_batches", 4)
        super().__init__(action_parser, **kwargs)
        base_url = base_url.rstrip("/")
        self.base_url = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
        self.model = model
        self.return_token_ids = bool(return_token_ids)
        self.request_timeout_s = float(request_timeout_s)
        self._api_key = api_key
        self._update_token = update_token if update_token is not None else api_key
        self._httpx = httpx
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="asyncvec-OpenAIPolicy-http", daemon=True
        )
        self._loop_thread.start()
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout_s), limits=limits)

    # -------------------------------------------------------------------------- plumbing
    def _run_on_loop(self, coroutine: Any) -> Any:
        """Run a coroutine on the private loop and wait for it (bounded)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout=self.request_timeout_s + 5.0)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise TransientBackendError(f"{self.base_url}: no answer within {self.request_timeout_s + 5.0} s") from exc

    async def _request(self, method: str, route: str, *, json: Any = None, token: str | None = None) -> Any:
        url = self.base_url + route
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            response = await self._client.request(method, url, json=json, headers=headers)
        except self._httpx.TimeoutException as exc:
            raise TransientBackendError(f"{url}: timed out after {self.request_timeout_s} s") from exc
        except self._httpx.TransportError as exc:
            raise TransientBackendError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 429 or response.status_code >= 500:
            raise TransientBackendError(f"{url} answered {response.status_code}: {_detail(response)}")
        if response.status_code in (401, 403):
            raise PermissionError(f"{url} refused the request ({response.status_code}): {_detail(response)}")
        if response.status_code >= 400:
            raise BackendRejectedError(f"{url} answered {response.status_code}: {_detail(response)}")
        try:
            return response.json()
        except ValueError as exc:
            raise BackendRejectedError(
                f"{url} answered {response.status_code} with a body that is not JSON: {response.text[:200]!r}"
            ) from exc

    # --------------------------------------------------------------------------- forward
    def _is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, (TransientBackendError, OSError)) and not isinstance(exc, PermissionError)

    def _forward_batch(self, prompts: list[TextPrompt]) -> list[BackendResult]:
        async def complete_all() -> list[BackendResult]:
            return list(await asyncio.gather(*(self._complete_prompt(prompt) for prompt in prompts)))

        return self._run_on_loop(complete_all())

    async def _complete_prompt(self, prompt: TextPrompt) -> BackendResult:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt.prompt,
            "max_tokens": prompt.max_new_tokens,
            "temperature": prompt.temperature,
            "logprobs": prompt.top_logprobs,
            "n": 1,
        }
        if prompt.top_p is not None:
            body["top_p"] = prompt.top_p
        if self.return_token_ids:
            body["return_tokens_as_token_ids"] = True
        data = await self._request("POST", "/v1/completions", json=body, token=self._api_key)
        try:
            choice = data["choices"][0]
            text = choice["text"]
            logprobs = choice["logprobs"]
            token_logps = logprobs["token_logprobs"]
            tokens = logprobs.get("tokens")
            top = logprobs.get("top_logprobs")
        except (KeyError, IndexError, TypeError) as exc:
            raise BackendRejectedError(
                f"{self.base_url}/v1/completions: answer lacks choices[0].text/logprobs.token_logprobs ({exc!r}); "
                "does the server support logprobs?"
            ) from exc
        token_ids = [_token_id(token) for token in tokens] if self.return_token_ids and tokens is not None else None
        top_rows = None
        if prompt.top_logprobs and top is not None:
            top_rows = [
                {_token_id(key) if self.return_token_ids else key: value for key, value in row.items()} for row in top
            ]
        version = choice.get("policy_version", data.get("policy_version"))
        return self._text_result(text, token_ids, token_logps, top_rows, policy_version=version)

    # --------------------------------------------------------------------------- weights
    def _apply_weights(self, weights: str | os.PathLike, version: int) -> None:
        if not isinstance(weights, (str, os.PathLike)):
            raise TypeError(
                "OpenAIPolicy.load_weights takes a checkpoint folder path as the server sees it "
                f"(under its --weights-dir), got {type(weights).__name__}"
            )
        info = self._run_on_loop(self._request("GET", "/version"))
        if not isinstance(info, dict) or info.get("server") != "asyncvec":
            raise BackendError(
                f"{self.base_url} is not an asyncvec server (GET /version -> {info!r}); "
                "update the weights of a vLLM/SGLang/TGI server with its own tools"
            )
        answer = self._run_on_loop(
            self._request(
                "POST",
                "/update_weights",
                json={"path": os.fspath(weights), "version": version},
                token=self._update_token,
            )
        )
        if not isinstance(answer, dict) or answer.get("version") != version:
            raise BackendError(f"{self.base_url}/update_weights answered {answer!r}, expected version {version}")

    def server_version(self) -> int:
        """The version the server reports now (``GET /version``, asyncvec servers)."""
        info = self._run_on_loop(self._request("GET", "/version"))
        return int(info["version"])

    def _close_backend(self) -> None:
        try:
            self._run_on_loop(self._client.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(5.0)
            self._loop.close()


def _token_id(token: Any) -> int:
    if isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX):
        return int(token[len(TOKEN_ID_PREFIX) :])
    raise BackendRejectedError(f"expected tokens as '{TOKEN_ID_PREFIX}N' (return_tokens_as_token_ids), got {token!r}")


def _detail(response: Any) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict):
        detail = body.get("detail", body.get("error", body))
        if isinstance(detail, dict) and "message" in detail:
            return str(detail["message"])
        return str(detail)
    return str(body)[:300]
