"""The ``asyncvec serve`` app: an OpenAI-compatible completions server around `HFTextPolicy`.

Routes: ``POST /v1/completions`` (text or token-id prompts, ``n``, ``stop``, ``seed``, ``stream``,
log-probs), ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /update_weights`` (json
``{"path", "version"}``), ``GET /weight_info`` (vLLM's route: ``{"weight_version": "N"}``),
``GET /version``, ``GET /health``, ``GET /metrics`` (Prometheus text). Every body is
validated; bad input gets a 4xx with OpenAI's error body ``{"error": {"message", "type",
"param", "code"}}`` (which the ``openai`` client shows) and never reaches the model.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from asyncvec.extras import check_installed, hide_unloadable_torch_libraries

for _library in ("fastapi", "uvicorn", "transformers"):
    check_installed(_library, extra="serve", feature="asyncvec serve (asyncvec.inference.serving.server)")
hide_unloadable_torch_libraries()

from fastapi import FastAPI, Request  # noqa: E402  (after check_installed: a missing extra is named, not an ImportError)
from fastapi.exceptions import RequestValidationError  # noqa: E402  (after check_installed: a missing extra is named, not an ImportError)
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse  # noqa: E402  (after check_installed: a missing extra is named, not an ImportError)
from pydantic import BaseModel, ConfigDict, Field, field_validator  # noqa: E402  (after check_installed: a missing extra is named, not an ImportError)
from starlette.exceptions import HTTPException as StarletteHTTPException  # noqa: E402  (after check_installed: a missing extra is named, not an ImportError)

from asyncvec.inference.backends.hf_policy import HFTextPolicy  # noqa: E402  (after check_installed: a missing extra is named, not an ImportError)
from asyncvec.inference.text import MAX_STOP_STRINGS  # noqa: E402  (after check_installed: a missing extra is named, not an ImportError)
from asyncvec.inference.types import BackendResult, PolicyError, PolicyOutput, TextPrompt  # noqa: E402  (after check_installed: a missing extra is named, not an ImportError)

MAX_PROMPTS_PER_REQUEST = 256
MAX_N = 64

PromptField = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(BaseModel):
    """Body of ``POST /v1/completions`` (the OpenAI fields this server implements)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str
    prompt: PromptField
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    logprobs: int | None = Field(None, ge=0, le=20)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = Field(False, description="stream each token as it is sampled (server-sent events)")
    echo: bool = Field(False, description="echo is not supported")
    return_tokens_as_token_ids: bool = False
    user: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts_non_empty(cls, value: PromptField) -> PromptField:
        prompts = prompt_list(value)
        if not prompts:
            raise ValueError("needs at least one prompt")
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:
            raise ValueError(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request")
        if any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("prompts must be non-empty strings or non-empty lists of token ids")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if len(items) > MAX_STOP_STRINGS or any(not item for item in items):
            raise ValueError(f"at most {MAX_STOP_STRINGS} non-empty stop strings")
        return value

    @field_validator("echo")
    @classmethod
    def _unsupported(cls, value: bool) -> bool:
        if value:
            raise ValueError("not supported by asyncvec serve")
        return value


def prompt_list(prompt: PromptField) -> list[str | tuple[int, ...]]:
    """The prompts of a request: a str, a list of str, one token-id list, or a list of them.

    Example:
        >>> prompt_list("a"), prompt_list([1, 2]), prompt_list([[1], [2, 3]])
        (['a'], [(1, 2)], [(1,), (2, 3)])
    """
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(item, int) for item in prompt):
        return [tuple(prompt)]  # type: ignore[arg-type]
    return [item if isinstance(item, str) else tuple(item) for item in prompt]  # type: ignore[union-attr]


class UpdateWeightsRequest(BaseModel):
    """Body of ``POST /update_weights``: a checkpoint under ``--weights-dir`` and its version."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)
    version: int = Field(ge=0)


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    503: "service_unavailable",
}


def _error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": code}}
    )


def create_app(
    policy: HFTextPolicy,
    *,
    model_name: str,
    weights_dir: str | Path | None = None,
    token: str | None = None,
    max_tokens_limit: int = 256,
) -> FastAPI:
    """Build the FastAPI app serving ``policy``; the app closes the policy on shutdown.

    Args:
        policy: the model, already wrapped in its batcher.
        model_name: the name clients put in ``"model"``.
        weights_dir: ``/update_weights`` loads only from inside this folder (None: disabled).
        token: if set, ``/update_weights`` requires ``Authorization: Bearer <token>``.
        max_tokens_limit: largest ``max_tokens`` a request may ask for.

    Example:
        >>> import tempfile
        >>> from fastapi.testclient import TestClient
        >>> from asyncvec.inference import build_tiny_lm
        >>> folder = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32)
        >>> app = create_app(HFTextPolicy(folder, action_parser=str, fallback=lambda obs, env_id: ""), model_name="tiny")
        >>> with TestClient(app) as client:
        ...     client.get("/version").json()["version"]
        0
    """
    allowed_root = Path(weights_dir).resolve() if weights_dir is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(policy.close)

    app = FastAPI(title="asyncvec serve", lifespan=lifespan)
    started = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _readable_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts, params = [], []
        for error in exc.errors():
            if error.get("type") == "json_invalid":
                position = error.get("loc", ("body", "?"))[-1]
                reason = error.get("ctx", {}).get("error", "malformed")
                parts.append(f"the body is not valid JSON (character {position}): {reason}")
                continue
            location = [str(item) for item in error.get("loc", ()) if item != "body"]
            where = ".".join(location) or "body"
            if location:
                params.append(location[0])
            parts.append(f"{where}: {error.get('msg', 'invalid')}")
        return _error(400, "; ".join(parts), param=params[0] if params else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "policy_version": policy.policy_version}

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"server": "asyncvec", "model": model_name, "version": policy.policy_version}

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": started, "owned_by": "asyncvec"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        if model_id != model_name:
            return _error(
                404,
                f"model {model_id!r} is not served here; available: [{model_name!r}]",
                param="model",
                code="model_not_found",
            )
        return model_card()

    @app.get("/weight_info")
    async def weight_info() -> dict[str, Any]:
        return {"weight_version": str(policy.policy_version)}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lines = []
        for key, value in policy.stats().items():
            if isinstance(value, (int, float)):
                number = "NaN" if isinstance(value, float) and math.isnan(value) else repr(float(value))
                lines.append(f"asyncvec_{key} {number}")
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        if body.model != model_name:
            return _error(
                404,
                f"model {body.model!r} is not served here; available: [{model_name!r}]",
                param="model",
                code="model_not_found",
            )
        if body.max_tokens > max_tokens_limit:
            return _error(400, f"max_tokens must be <= {max_tokens_limit}, got {body.max_tokens}", param="max_tokens")
        prompts = prompt_list(body.prompt)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        requests = []
        for index, prompt in enumerate(prompts):
            request = TextPrompt(
                prompt,
                max_new_tokens=body.max_tokens,
                temperature=body.temperature,
                top_p=None if body.top_p >= 1.0 else body.top_p,
                top_logprobs=body.logprobs or 0,
                stop=stop,
                seed=body.seed,
            )
            try:
                requests.append(policy.check_observation(request))
            except (ValueError, TypeError) as exc:
                where = f"prompt {index}: " if len(prompts) > 1 else ""
                return _error(400, where + str(exc), param="prompt")
        if body.stream:
            stream = _stream_completions(policy, requests, body, stop, model_name)
            try:
                await stream.__anext__()  # queues the requests: a closed policy refuses them here
            except PolicyError as exc:
                return _error(503, str(exc))
            return StreamingResponse(stream, media_type="text/event-stream")
        if body.seed is not None:
            # a seeded request is one backend call of its own: the same request gives the same completions
            # whatever else the server is doing (in the shared batcher, other requests would change its batch)
            copies = [request for request in requests for _ in range(body.n)]
            try:
                outputs: list[Any] = await asyncio.to_thread(policy.forward_batch, copies)
            except Exception as exc:  # noqa: BLE001 - the model failed: a 503 with the reason
                return _error(503, f"the model failed: {type(exc).__name__}: {exc}")
        else:
            try:
                futures = [future for request in requests for future in policy.submit_group(request, body.n)]
            except PolicyError as exc:
                return _error(503, str(exc))
            try:
                outputs = await asyncio.gather(*(asyncio.wrap_future(future) for future in futures))
            except PolicyError as exc:
                return _error(503, f"the model failed: {exc}")
        choices = [_choice(policy, index, output, body, stop) for index, output in enumerate(outputs)]
        prompt_tokens = sum(policy.count_tokens(prompt) for prompt in prompts)
        completion_tokens = sum(len(output.token_ids or ()) for output in outputs)
        versions = {output.policy_version for output in outputs}
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "metadata": {"weight_version": str(versions.pop()) if len(versions) == 1 else None},
        }

    @app.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest, request: Request) -> Any:
        if token is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return _error(401, "missing or wrong bearer token for /update_weights", code="invalid_api_key")
        if allowed_root is None:
            return _error(403, "weight updates are disabled; start the server with --weights-dir")
        target = (allowed_root / body.path).resolve()
        if not target.is_relative_to(allowed_root):
            return _error(403, f"path {body.path!r} is outside --weights-dir {str(allowed_root)!r}")
        if not target.exists():
            return _error(404, f"no checkpoint at {body.path!r} under --weights-dir", param="path")
        if body.version <= policy.policy_version:
            return _error(
                409,
                f"version must be greater than the current version {policy.policy_version}, got {body.version}",
                param="version",
            )
        try:
            await asyncio.to_thread(policy.load_weights, target, body.version)
        except TimeoutError as exc:
            return _error(503, str(exc))
        except Exception as exc:  # a checkpoint that does not load is bad input, not a server fault
            return _error(400, f"cannot load weights from {body.path!r}: {type(exc).__name__}: {exc}", param="path")
        return {"version": policy.policy_version, "path": str(target)}

    return app


async def _stream_completions(
    policy: HFTextPolicy, requests: list[TextPrompt], body: CompletionRequest, stop: tuple[str, ...], model_name: str
) -> AsyncIterator[str]:
    """Server-sent events of a streamed request. The first item is "" once the requests are queued
    (a closed policy raises before any event). Then one event per sampled token: ``text`` its
    piece, ``logprobs`` its token and log-prob, ``policy_version`` the weights that sampled it;
    and as soon as a choice is done, its last event, with ``finish_reason`` and the whole choice under
    ``"completion"`` (as ``"stream": false`` answers it: a stop string cuts the completion after
    sampling, so it is what counts); then ``data: [DONE]``."""
    loop = asyncio.get_running_loop()
    tokens: asyncio.Queue[tuple[int, int, float, int]] = asyncio.Queue()
    futures = []
    for position, request in enumerate(requests):

        def on_token(copy: int, token: int, logp: float, version: int, first: int = position * body.n) -> None:
            loop.call_soon_threadsafe(tokens.put_nowait, (first + copy, token, logp, version))

        futures += policy.submit_streamed(request, body.n, on_token)
    yield ""
    identity, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def event(choice: dict[str, Any]) -> str:
        data = {"id": identity, "object": "text_completion", "created": created, "model": model_name}
        return f"data: {json.dumps({**data, 'choices': [choice]})}\n\n"

    def token_event(index: int, token: int, logp: float, version: int) -> str:
        piece = policy.token_texts([token])[0]
        name = f"token_id:{token}" if body.return_tokens_as_token_ids else piece
        logprobs = {"tokens": [name], "token_logprobs": [logp], "top_logprobs": None, "text_offset": None}
        return event(
            {"index": index, "text": piece, "logprobs": logprobs, "finish_reason": None, "policy_version": version}
        )

    # each choice's last event goes out as soon as it is done, not once every choice of the request is: a
    # client whose stream breaks off then knows which completions had ended (and does not continue them)
    pending = {asyncio.wrap_future(future): index for index, future in enumerate(futures)}
    waiting = asyncio.ensure_future(tokens.get())
    try:
        while pending:
            finished, _ = await asyncio.wait({waiting, *pending}, return_when=asyncio.FIRST_COMPLETED)
            if waiting in finished:
                yield token_event(*waiting.result())
                waiting = asyncio.ensure_future(tokens.get())
            for future in [future for future in finished if future in pending]:
                index = pending.pop(future)
                # its tokens were queued before its result: they go out, then its end; the other choices' tokens
                # (a loop that fell behind queued them too) go back first, in their order, to follow its end
                queued = [tokens.get_nowait() for _ in range(tokens.qsize())]
                for token in queued:
                    if token[0] != index:
                        tokens.put_nowait(token)
                for token in queued:
                    if token[0] == index:
                        yield token_event(*token)
                try:
                    output = future.result()
                except PolicyError as exc:
                    error = {"message": f"the model failed: {exc}", "type": "server_error"}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                    return
                choice = _choice(policy, index, output, body, stop)
                yield event(
                    {"index": index, "text": "", "finish_reason": choice["finish_reason"], "completion": choice}
                )
    finally:
        waiting.cancel()
    while not tokens.empty():
        yield token_event(*tokens.get_nowait())
    yield "data: [DONE]\n\n"


def _choice(
    policy: HFTextPolicy,
    index: int,
    output: PolicyOutput | BackendResult,
    body: CompletionRequest,
    stop: tuple[str, ...],
) -> dict[str, Any]:
    token_ids = list(output.token_ids or ())
    eos = policy.tokenizer.eos_token_id
    stopped = bool(token_ids) and (token_ids[-1] == eos or any(item in policy.decode(token_ids) for item in stop))
    logprobs = None
    if body.logprobs is not None:
        pieces = policy.token_texts(token_ids)
        names = [f"token_id:{token}" for token in token_ids] if body.return_tokens_as_token_ids else pieces
        offsets, position = [], 0
        for piece in pieces:
            offsets.append(position)
            position += len(piece)
        top = None
        if body.logprobs and output.top_logprobs is not None:
            top = []
            for row in output.top_logprobs:
                keys = list(row)
                labels = (
                    [f"token_id:{key}" for key in keys] if body.return_tokens_as_token_ids else policy.token_texts(keys)
                )
                top.append(dict(zip(labels, row.values(), strict=True)))
        logprobs = {
            "tokens": names,
            "token_logprobs": list(output.token_logps or ()),
            "top_logprobs": top,
            "text_offset": offsets,
        }
    return {
        "index": index,
        "text": output.text or "",
        "logprobs": logprobs,
        "finish_reason": "stop" if stopped else "length",
        "policy_version": output.policy_version,
    }


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port).

    Raises:
        OSError: the port is in use or the address cannot be bound, with that in the message.

    Example:
        >>> sock = bind_socket("127.0.0.1", 0)
        >>> sock.getsockname()[1] > 0
        True
        >>> sock.close()
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(
    model_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    weights_dir: str | Path | None = None,
    token: str | None = None,
    model_name: str | None = None,
    max_batch_size: int = 32,
    max_wait_ms: float = 5.0,
    max_tokens_limit: int = 256,
    log_level: str = "warning",
    sock: socket.socket | None = None,
) -> None:
    """Load ``model_dir`` into an `HFTextPolicy` and serve it with uvicorn until stopped.

    The port is bound before the model loads (pass ``sock`` from `bind_socket`, or it is
    bound here), so a port in use is reported at once.
    """
    import uvicorn

    sock = sock if sock is not None else bind_socket(host, port)
    policy = HFTextPolicy(
        model_dir,
        None,
        str,  # the server returns text; a str parser never rejects
        fallback=lambda obs, env_id: "",
        max_batch_size=max_batch_size,
        max_wait_ms=max_wait_ms,
    )
    name = model_name or Path(model_dir).resolve().name
    app = create_app(policy, model_name=name, weights_dir=weights_dir, token=token, max_tokens_limit=max_tokens_limit)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False))
    server.run(sockets=[sock])
