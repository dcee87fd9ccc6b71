"""The ``asyncvec serve`` app: an OpenAI-compatible completions server around `HFTextPolicy`.

Routes: ``POST /v1/completions`` (with log-probs), ``GET /v1/models``, ``POST
/update_weights`` (json ``{"path", "version"}``), ``GET /version``, ``GET /health``,
``GET /metrics`` (Prometheus text). Every body is validated; bad input gets a 4xx with a
readable ``detail`` and never reaches the model.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from asyncvec.inference.hf_policy import HFTextPolicy
from asyncvec.inference.types import PolicyError, PolicyOutput, TextPrompt

MAX_PROMPTS_PER_REQUEST = 256


class CompletionRequest(BaseModel):
    """Body of ``POST /v1/completions`` (the OpenAI fields this server implements)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str
    prompt: str | list[str]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    logprobs: int | None = Field(None, ge=0, le=20)
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    stream: bool = Field(False, description="streaming is not supported")
    echo: bool = Field(False, description="echo is not supported")
    return_tokens_as_token_ids: bool = False
    user: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts_non_empty(cls, value: str | list[str]) -> str | list[str]:
        prompts = [value] if isinstance(value, str) else value
        if not prompts:
            raise ValueError("needs at least one prompt")
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:
            raise ValueError(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request")
        if any(not prompt for prompt in prompts):
            raise ValueError("prompts must be non-empty strings")
        return value

    @field_validator("stream", "echo")
    @classmethod
    def _unsupported(cls, value: bool) -> bool:
        if value:
            raise ValueError("not supported by asyncvec serve")
        return value


class UpdateWeightsRequest(BaseModel):
    """Body of ``POST /update_weights``: a checkpoint under ``--weights-dir`` and its version."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)
    version: int = Field(ge=0)


def _error(status: int, detail: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"detail": detail})


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
        >>> app = create_app(HFTextPolicy(folder, None, str, fallback=lambda obs, env_id: ""), model_name="tiny")
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

    @app.exception_handler(RequestValidationError)
    async def _readable_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for error in exc.errors():
            if error.get("type") == "json_invalid":
                position = error.get("loc", ("body", "?"))[-1]
                reason = error.get("ctx", {}).get("error", "malformed")
                parts.append(f"the body is not valid JSON (character {position}): {reason}")
                continue
            where = ".".join(str(item) for item in error.get("loc", ()) if item != "body") or "body"
            parts.append(f"{where}: {error.get('msg', 'invalid')}")
        return _error(422, "; ".join(parts))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "policy_version": policy.policy_version}

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"server": "asyncvec", "model": model_name, "version": policy.policy_version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "asyncvec"}]}

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
            return _error(404, f"model {body.model!r} is not served here; available: [{model_name!r}]")
        if body.max_tokens > max_tokens_limit:
            return _error(400, f"max_tokens must be <= {max_tokens_limit}, got {body.max_tokens}")
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        requests = [
            TextPrompt(
                prompt,
                max_new_tokens=body.max_tokens,
                temperature=body.temperature,
                top_p=None if body.top_p >= 1.0 else body.top_p,
                top_logprobs=body.logprobs or 0,
            )
            for prompt in prompts
        ]
        try:
            futures = [policy.submit(request) for request in requests]
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc))
        except PolicyError as exc:
            return _error(503, str(exc))
        try:
            outputs: list[PolicyOutput] = await asyncio.gather(*(asyncio.wrap_future(future) for future in futures))
        except PolicyError as exc:
            return _error(503, f"the model failed: {exc}")
        choices = [_choice(policy, index, output, body) for index, output in enumerate(outputs)]
        prompt_tokens = sum(policy.count_tokens(prompt) for prompt in prompts)
        completion_tokens = sum(len(output.token_ids or ()) for output in outputs)
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
        }

    @app.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest, request: Request) -> Any:
        if token is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return _error(401, "missing or wrong bearer token for /update_weights")
        if allowed_root is None:
            return _error(403, "weight updates are disabled; start the server with --weights-dir")
        target = (allowed_root / body.path).resolve()
        if not target.is_relative_to(allowed_root):
            return _error(403, f"path {body.path!r} is outside --weights-dir {str(allowed_root)!r}")
        if not target.exists():
            return _error(404, f"no checkpoint at {body.path!r} under --weights-dir")
        if body.version <= policy.policy_version:
            return _error(
                409, f"version must be greater than the current version {policy.policy_version}, got {body.version}"
            )
        try:
            await asyncio.to_thread(policy.load_weights, target, body.version)
        except TimeoutError as exc:
            return _error(503, str(exc))
        except Exception as exc:  # a checkpoint that does not load is bad input, not a server fault
            return _error(400, f"cannot load weights from {body.path!r}: {type(exc).__name__}: {exc}")
        return {"version": policy.policy_version, "path": str(target)}

    return app


def _choice(policy: HFTextPolicy, index: int, output: PolicyOutput, body: CompletionRequest) -> dict[str, Any]:
    token_ids = list(output.token_ids or ())
    eos = policy.tokenizer.eos_token_id
    finish = "stop" if token_ids and token_ids[-1] == eos else "length"
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
        "finish_reason": finish,
        "policy_version": output.policy_version,
    }


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
) -> None:
    """Load ``model_dir`` into an `HFTextPolicy` and serve it with uvicorn until stopped."""
    import uvicorn

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
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)).run()
