"""`ServerClient`: the HTTP side of one OpenAI-compatible server (``asyncvec serve``, vLLM, SGLang).

It owns the server's root URL, the bearer tokens, a pooled ``httpx.AsyncClient`` on a private
event-loop thread, and how an HTTP answer becomes a result or one of the backend errors. The
policy sends completions through it, the per-server routes (`server_routes`) read versions and
push weights through it; neither reaches into the other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json as _json
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from asyncvec.inference.types import BackendRejectedError, TransientBackendError


def is_transient(exc: BaseException) -> bool:
    """Whether a server error is worth a retry (or a look by the supervisor): unreachable, timed
    out, 429/5xx (`TransientBackendError`) or an `OSError`; a refused token (`PermissionError`) is not."""
    return isinstance(exc, (TransientBackendError, OSError)) and not isinstance(exc, PermissionError)


class ServerClient:
    """Requests to one server, run on a private event loop so that any thread can wait for them
    (the loop's thread starts with the first `run`).

    Args:
        base_url: the server's root, e.g. ``http://127.0.0.1:8000`` (no trailing ``/`` or ``/v1``).
        api_key: bearer token sent with every request.
        update_token: bearer token of weight updates (``update=True``; default: ``api_key``).
        request_timeout_s: timeout of one request (unless a request says otherwise).
        update_timeout_s: timeout of a weight reload (the routes pass it for their long requests).
        max_connections: connection pool size.
        name: the loop thread's name.

    Example:
        >>> client = ServerClient("http://127.0.0.1:9", request_timeout_s=1)
        >>> try:
        ...     client.run(client.request("GET", "/version"))
        ... except TransientBackendError as exc:
        ...     print(is_transient(exc), str(exc).startswith("cannot reach http://127.0.0.1:9/version"))
        True True
        >>> client.close()
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        update_token: str | None = None,
        request_timeout_s: float = 30.0,
        update_timeout_s: float = 300.0,
        max_connections: int = 32,
        name: str = "asyncvec-ServerClient-http",
    ) -> None:
        import httpx

        self.base_url = base_url
        self.request_timeout_s = float(request_timeout_s)
        self.update_timeout_s = float(update_timeout_s)
        self._api_key = api_key
        self._update_token = update_token if update_token is not None else api_key
        self._httpx = httpx
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._start_lock = threading.Lock()
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout_s), limits=limits)

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        """Run a coroutine on the private loop and wait for it (at most ``timeout_s``, default the
        request timeout, plus 5 s; then `TransientBackendError`)."""
        limit = (self.request_timeout_s if timeout_s is None else timeout_s) + 5.0
        if not self._thread.is_alive():
            with self._start_lock:
                if self._thread.ident is None:
                    self._thread.start()
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout=limit)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise TransientBackendError(f"{self.base_url}: no answer within {limit} s") from exc

    async def request(
        self,
        method: str,
        route: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        update: bool = False,
        timeout_s: float | None = None,
    ) -> Any:
        """One request to ``base_url + route``; its JSON answer (None for an empty body).

        ``update=True`` sends the update token instead of the API key.

        Raises:
            TransientBackendError: unreachable, timed out, 429 or 5xx (worth a retry).
            PermissionError: 401 or 403.
            BackendRejectedError: another 4xx, or an answer that is not JSON.
        """
        httpx = self._httpx
        url = self.base_url + route
        token = self._update_token if update else self._api_key
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        timeout = httpx.Timeout(timeout_s) if timeout_s is not None else httpx.USE_CLIENT_DEFAULT
        try:
            response = await self._client.request(
                method, url, json=json, params=params, headers=headers, timeout=timeout
            )
        except httpx.TimeoutException as exc:
            raise TransientBackendError(f"{url}: timed out after {timeout_s or self.request_timeout_s} s") from exc
        except httpx.TransportError as exc:
            raise TransientBackendError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
        self._check_status(url, response)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise BackendRejectedError(
                f"{url} answered {response.status_code} with a body that is not JSON: {response.text[:200]!r}"
            ) from exc

    async def stream(
        self, route: str, *, json: Any, on_event: Callable[[dict[str, Any]], None], timeout_s: float | None = None
    ) -> None:
        """``POST`` ``json`` (with ``"stream": true``) to ``base_url + route`` and call ``on_event`` with each
        server-sent event's JSON, in order, until ``data: [DONE]``. Errors as in `request`; a stream
        cut off before ``[DONE]`` (the server died) raises `TransientBackendError` after the events
        that did arrive were handled."""
        httpx = self._httpx
        url = self.base_url + route
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        timeout = httpx.Timeout(timeout_s) if timeout_s is not None else httpx.USE_CLIENT_DEFAULT
        try:
            async with self._client.stream("POST", url, json=json, headers=headers, timeout=timeout) as response:
                if response.status_code >= 400:
                    await response.aread()
                    self._check_status(url, response)
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    try:
                        event = _json.loads(data)
                    except ValueError as exc:
                        raise BackendRejectedError(f"{url} streamed an event that is not JSON: {data[:200]!r}") from exc
                    if isinstance(event, dict) and "error" in event and "choices" not in event:
                        raise TransientBackendError(f"{url} streamed an error: {event['error']}")
                    on_event(event)
        except httpx.TimeoutException as exc:
            raise TransientBackendError(f"{url}: timed out after {timeout_s or self.request_timeout_s} s") from exc
        except httpx.TransportError as exc:
            raise TransientBackendError(f"{url}: the stream broke off: {type(exc).__name__}: {exc}") from exc
        raise TransientBackendError(f"{url}: the stream ended without data: [DONE]")

    @staticmethod
    def _check_status(url: str, response: Any) -> None:
        if response.status_code == 429 or response.status_code >= 500:
            raise TransientBackendError(f"{url} answered {response.status_code}: {_detail(response)}")
        if response.status_code in (401, 403):
            raise PermissionError(f"{url} refused the request ({response.status_code}): {_detail(response)}")
        if response.status_code >= 400:
            raise BackendRejectedError(f"{url} answered {response.status_code}: {_detail(response)}")

    def close(self) -> None:
        """Close the connections and end the loop thread."""
        try:
            self.run(self._client.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
            self._loop.close()

    def __repr__(self) -> str:
        return f"ServerClient({self.base_url!r})"


def _detail(response: Any) -> str:
    try:
        body = response.json()
    except ValueError:
        return str(response.text[:300])
    if isinstance(body, dict):
        detail = body.get("error", body.get("detail", body))
        if isinstance(detail, dict) and "message" in detail:
            return str(detail["message"])
        return str(detail)
    return str(body)[:300]
