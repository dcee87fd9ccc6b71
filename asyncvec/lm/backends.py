"""The LM agents' inference backends (``--backend``), one table entry each: :data:`LM_BACKENDS`.

``LMArgs``' choices and checks of ``--backend`` (``asyncvec.lm.options``: ``--base-url``,
``--inflight-updates``, ``--bitwise-sampling``), the policy :func:`asyncvec.lm.build.make_text_policy`
builds, whether the learner sends its starting weights first, whether requests are seeded and whether
``--torch-threads`` applies all read this table. Each row is its engine's row of
:data:`asyncvec.inference.engines.ENGINES` (the policy class, where it lives, its library and extra, what the
engine can do) with the factory below that makes its text policy. Adding an engine is its policy's file in
``asyncvec/inference/backends/``, its row in ``ENGINES``, its factory here (in ``_FACTORIES``: a row without one
fails at import) and its extra in setup.py.

Example:
    >>> from asyncvec.lm.backends import LM_BACKENDS
    >>> list(LM_BACKENDS)
    ['hf', 'openai', 'vllm']
    >>> LM_BACKENDS["openai"].needs_sync, LM_BACKENDS["vllm"].sets_torch_threads
    (True, False)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from asyncvec.inference.engines import ENGINES, Engine

# ``args`` below is an asyncvec.lm.options.LMArgs (typed Any: options.py reads this table, so it is not imported here)
PolicyFactory = Callable[[Any, Path, Any, dict[str, Any], Path | None], Any]
"""``make_policy(args, model_dir, action_parser, options, weights_dir) -> text policy``; ``options``: the
``DynamicBatcher`` and sampling keywords every backend takes (action space, max new tokens, temperature,
batch size and wait, deadline, in-flight batches)."""


@dataclass(frozen=True)
class LMBackend(Engine):
    """One ``--backend``: its engine's row (:data:`asyncvec.inference.engines.ENGINES`) and the factory making its
    text policy from an LM agent's options."""

    make_policy: PolicyFactory | None = None
    """builds the text policy (see :data:`PolicyFactory`; its class from :meth:`policy_class`)"""

    def seeds_requests(self, args: Any) -> bool:
        """Whether the collectors give each request of a run with these ``args`` its own sampling seed."""
        kinds = self.seeded_server_kinds
        return kinds is None or (self.needs_base_url and args.server_kind in kinds)

    def check(self, args: Any) -> None:
        """Raises ValueError when ``args`` ask this backend for what it cannot do (naming the flag)."""
        if self.needs_base_url and not args.base_url:
            raise ValueError(f"--backend {self.name} needs --base-url (e.g. http://127.0.0.1:8000)")
        if not self.needs_base_url and args.base_url is not None:
            takes = " or ".join(name for name, backend in LM_BACKENDS.items() if backend.needs_base_url)
            raise ValueError(f"--base-url is only used with --backend {takes}, got --backend {self.name}")
        if args.bitwise_sampling and not self.bitwise_sampling:
            takes = " or ".join(name for name, backend in LM_BACKENDS.items() if backend.bitwise_sampling)
            raise ValueError(
                f"--bitwise-sampling needs --backend {takes}: {self.name} batches requests as its engine decides"
            )
        kinds = self.inflight_server_kinds
        if args.inflight_updates and kinds is not None and args.server_kind not in kinds:
            anywhere = " or ".join(name for name, b in LM_BACKENDS.items() if b.inflight_server_kinds is None)
            raise ValueError(
                f"--inflight-updates needs --backend {anywhere}, or --backend {self.name} with --server-kind "
                f"{' or '.join(kinds)}: a {args.server_kind} server's completions carry one version "
                "(asyncvec docs inference, section In-flight weight updates)"
            )


def make_hf_policy(
    args: Any, model_dir: Path, action_parser: Any, options: dict[str, Any], weights_dir: Path | None
) -> Any:
    """``HFTextPolicy``: transformers in this process, weights copied into the model in place."""
    from asyncvec.lm.learner import load_causal_lm

    policy_class = LM_BACKENDS["hf"].policy_class()
    model, tokenizer = load_causal_lm(model_dir, args.device)
    return policy_class(
        model,
        tokenizer,
        action_parser,
        seed=args.seed,
        bitwise_seeds=args.bitwise_sampling,
        inflight_updates=args.inflight_updates,
        **options,
    )


def make_vllm_policy(
    args: Any, model_dir: Path, action_parser: Any, options: dict[str, Any], weights_dir: Path | None
) -> Any:
    """``VLLMPolicy``: an in-process vLLM engine (``--vllm-engine``: its ``vllm.LLM`` options)."""
    engine = {"seed": args.seed, **json.loads(args.vllm_engine)}
    return LM_BACKENDS["vllm"].policy_class()(
        model_dir, action_parser, engine_kwargs=engine, inflight_updates=args.inflight_updates, **options
    )


def make_openai_policy(
    args: Any, model_dir: Path, action_parser: Any, options: dict[str, Any], weights_dir: Path | None
) -> Any:
    """``OpenAIPolicy`` against ``--base-url`` (``--server-kind``), checked before it is returned: each
    published version is written to ``--weights-dir`` (or ``weights_dir``), a folder the server must be
    able to read, and the server loads it."""
    policy_class = LM_BACKENDS["openai"].policy_class()
    if args.inflight_updates:
        options = {**options, "inflight_updates": True}
    token = args.update_token if args.update_token is not None else os.environ.get("ASYNCVEC_SERVE_TOKEN")
    assert args.base_url is not None  # LMArgs checked it
    policy = policy_class(
        args.base_url,
        args.served_model or served_model_name(args.base_url, model_dir),
        action_parser,
        server_kind=args.server_kind,
        update_token=token,
        checkpoint_dir=args.weights_dir or weights_dir,
        model_dir=model_dir,
        max_attempts=3,
        **options,
    )
    try:
        policy.check_server()
    except Exception as exc:
        policy.close()
        raise ValueError(f"--base-url {args.base_url} (--server-kind {args.server_kind}): {exc}") from exc
    return policy


def served_model_name(base_url: str, model_dir: Path) -> str:
    """The model name to ask ``base_url`` for when --served-model is not given.

    The server's one model at ``/v1/models`` (vLLM serves ``--model`` as given, a path, unless
    ``--served-model-name`` says otherwise); with several, the one named like ``model_dir``.
    A server that cannot be asked gets ``model_dir``'s name (the server check then says why).
    """
    import httpx

    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10.0)
        served = [entry["id"] for entry in response.json()["data"]]
    except Exception:
        return model_dir.name
    if len(served) == 1:
        return served[0]
    for name in served:
        if name in (model_dir.name, str(model_dir)) or Path(name).name == model_dir.name:
            return name
    raise ValueError(f"--base-url {base_url} serves {served}: pick one with --served-model")


_FACTORIES: dict[str, PolicyFactory] = {"hf": make_hf_policy, "openai": make_openai_policy, "vllm": make_vllm_policy}

LM_BACKENDS: dict[str, LMBackend] = {
    name: LMBackend(
        **{field.name: getattr(engine, field.name) for field in fields(Engine)}, make_policy=_FACTORIES[name]
    )
    for name, engine in ENGINES.items()
}
"""``--backend`` name -> :class:`LMBackend` (``--help`` lists them in this order)."""
