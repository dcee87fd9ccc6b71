"""Equivalence checks of text backends against transformers, shared by the test suite (CPU)
and ``scripts/gpu_check.sh`` (CUDA).

* `teacher_forced_logps`: the log-probs transformers gives the tokens a backend sampled
  (one unpadded forward pass, the same temperature and top-p).
* `VersionedReference`: transformers models by policy version; `max_logp_error` compares
  every answer with the model of the version it claims, so an answer computed with other
  weights than it claims shows up as a large error. With per-token versions (in-flight
  updates, ``token_versions``) each token is teacher-forced under the version it claims.
* `weight_sync_check`: envs keep submitting from threads while versions are published;
  every answer must match the weights of its claimed version, and versions never go back
  for answers submitted later.

Command line (what ``scripts/gpu_check.sh`` runs on a GPU machine)::

    python -m asyncvec.testing.checks vllm-policy --work DIR [--device cuda]
    python -m asyncvec.testing.checks vllm-server --work DIR

Each prints ``PASS``/``FAIL`` lines and exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: prompts of different lengths (different left padding in batched backends)
PROMPTS = ("3+4=", "12+30=", "1+1=", "Hello, world! 7+2=")
#: default bound on |log-prob difference| for float32 engines vs transformers (measured: ~1e-6 on a CPU)
LOGP_TOLERANCE = 1e-4


def teacher_forced_logps(
    model: Any,
    tokenizer: Any,
    prompt: str | Sequence[int],
    token_ids: Sequence[int],
    temperature: float = 1.0,
    top_p: float | None = None,
) -> list[float]:
    """Log-probs of ``token_ids`` after ``prompt`` under ``model``, from one unpadded forward pass,
    for the distribution a backend samples from (logits / temperature, then top-p renormalised).

    Example:
        >>> import tempfile, transformers
        >>> from asyncvec.inference import build_tiny_lm
        >>> folder = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32)
        >>> model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        >>> tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        >>> len(teacher_forced_logps(model, tokenizer, "3+4=", [9, 1]))
        2
    """
    import transformers

    prompt_ids = list(tokenizer(prompt).input_ids) if isinstance(prompt, str) else list(prompt)
    ids = torch.tensor([prompt_ids + list(token_ids)], device=model.device)
    with torch.no_grad():
        # every position is real (a sampled <pad> token too): an explicit all-ones mask
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt_ids) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None:
        logits = transformers.TopPLogitsWarper(top_p)(ids, logits)
    index = torch.tensor(list(token_ids), device=logits.device)[:, None]
    return torch.log_softmax(logits, -1).gather(-1, index)[:, 0].tolist()


def random_weights(model_dir: str | os.PathLike, seed: int) -> dict[str, torch.Tensor]:
    """A fresh random initialisation of the model in ``model_dir`` (same architecture), as a state dict.

    Example:
        >>> import tempfile
        >>> from asyncvec.inference import build_tiny_lm
        >>> folder = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32)
        >>> a, b = random_weights(folder, 1), random_weights(folder, 1)
        >>> all(torch.equal(a[k], b[k]) for k in a)
        True
    """
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return dict(model.state_dict())


@dataclass
class VersionedReference:
    """Transformers copies of a model, one per policy version, to check answers against.

    Example:
        >>> import tempfile
        >>> from asyncvec.inference import build_tiny_lm
        >>> reference = VersionedReference(build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32))
        >>> reference.add(1, random_weights(reference.model_dir, seed=1))
        >>> sorted(reference.models)
        [0, 1]
    """

    model_dir: Path | str
    device: str = "cpu"
    models: dict[int, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        import transformers

        self.model_dir = Path(self.model_dir)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_dir)
        base = transformers.AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.models.setdefault(0, base.to(self.device).eval())
        self._lock = threading.Lock()

    def add(self, version: int, weights: Mapping[str, torch.Tensor] | str | os.PathLike) -> None:
        """Register the weights of ``version`` (a state dict or a folder)."""
        import transformers

        if isinstance(weights, (str, os.PathLike)):
            model = transformers.AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            model.load_state_dict(dict(weights), strict=False)
            model.tie_weights()
        self.models[int(version)] = model.to(self.device).eval()

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        """The weights of ``version``: registered ones, else a fresh random initialisation seeded by it."""
        if int(version) not in self.models:
            self.add(version, random_weights(self.model_dir, seed=int(version)))
        return {name: tensor.detach().clone() for name, tensor in self.models[int(version)].state_dict().items()}

    def error(
        self, prompt: str | Sequence[int], output: Any, temperature: float = 1.0, top_p: float | None = None
    ) -> float:
        """Largest |log-prob difference| of one answer against the model of its claimed version
        (of each token's claimed version when the answer has ``token_versions``)."""
        return self.logp_error(
            prompt,
            output.token_ids or (),
            output.token_logps,
            output.policy_version,
            temperature,
            top_p,
            token_versions=getattr(output, "token_versions", None),
        )

    def logp_error(
        self,
        prompt: str | Sequence[int],
        token_ids: Sequence[int],
        token_logps: Sequence[float],
        version: int,
        temperature: float = 1.0,
        top_p: float | None = None,
        *,
        token_versions: Sequence[int] | None = None,
    ) -> float:
        """Largest |log-prob difference| of ``token_ids`` sampled after ``prompt`` with the log-probs
        ``token_logps`` against the model of ``version`` (e.g. a multi-turn episode's turn).

        With ``token_versions`` (one per token) each token is compared with the model of its own
        version, teacher-forced on the whole prefix (prompt and every earlier token)."""
        if not token_ids:
            return 0.0
        claimed = [int(version)] * len(token_ids) if token_versions is None else [int(v) for v in token_versions]
        if len(claimed) != len(token_ids):
            raise ValueError(f"token_versions has {len(claimed)} entries for {len(token_ids)} tokens")
        missing = sorted(set(claimed) - set(self.models))
        if missing:
            raise KeyError(f"no reference model for version(s) {missing}; register them with add()")
        worst = 0.0
        for each in sorted(set(claimed)):
            with self._lock:
                expected = teacher_forced_logps(
                    self.models[each], self.tokenizer, prompt, token_ids, temperature, top_p
                )
            for position, (got, want) in enumerate(zip(token_logps, expected, strict=True)):
                if claimed[position] == each:
                    worst = max(worst, abs(got - want))
        return worst

    def max_logp_error(self, prompts: Sequence[Any], outputs: Sequence[Any], **sampling: Any) -> float:
        """`error` over answers (``prompts[i]`` produced ``outputs[i]``)."""
        return max((self.error(p, o, **sampling) for p, o in zip(prompts, outputs, strict=True)), default=0.0)


@dataclass
class SyncReport:
    """What `weight_sync_check` saw."""

    answers: int
    max_logp_error: float
    versions_seen: list[int]
    went_back: int
    publish_s: dict[int, float]
    first_answer_s: dict[int, float]

    def ok(self, tolerance: float = LOGP_TOLERANCE) -> bool:
        """Every answer matched its claimed version and no later answer claimed an older one."""
        return self.max_logp_error <= tolerance and self.went_back == 0


def weight_sync_check(
    policy: Any,
    reference: VersionedReference,
    publish: Mapping[int, Any],
    *,
    prompts: Sequence[str] = PROMPTS,
    submitters: int = 4,
    answers_between: int = 8,
    timeout_s: float = 300.0,
    load: Callable[[Any, int], None] | None = None,
) -> SyncReport:
    """Publish each ``version -> weights`` of ``publish`` while ``submitters`` threads keep asking.

    Each submitter submits, waits for the answer, and submits again (an env). Between two
    publishes at least ``answers_between`` answers arrive. Every answer is compared with
    ``reference``'s model of its claimed version; an answer submitted after a publish
    returned must claim that version or a newer one (counted in ``went_back`` otherwise).
    ``load(weights, version)`` publishes (default ``policy.load_weights``); its duration and
    the time from its start to the first answer claiming the new version are reported.
    """
    load = load or policy.load_weights
    lock = threading.Lock()
    records: list[tuple[str, Any, int]] = []  # prompt, output, version published when submitted
    published = {"version": policy.policy_version}
    stop = threading.Event()
    errors: list[BaseException] = []

    def submitter(index: int) -> None:
        count = 0
        while not stop.is_set():
            prompt = prompts[(index + count) % len(prompts)]
            count += 1
            with lock:
                floor = published["version"]
            try:
                output = policy.submit(prompt, env_id=index).result(timeout=timeout_s)
            except BaseException as exc:  # reported by the caller
                errors.append(exc)
                return
            with lock:
                records.append((prompt, output, floor))

    def wait_for_answers(count: int) -> None:
        deadline = time.monotonic() + timeout_s
        with lock:
            target = len(records) + count
        while len(records) < target and not errors:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {count} answers within {timeout_s} s")
            time.sleep(0.01)

    threads = [threading.Thread(target=submitter, args=(i,), daemon=True) for i in range(submitters)]
    for thread in threads:
        thread.start()
    publish_s, first_answer_s = {}, {}
    try:
        wait_for_answers(answers_between)
        for version, weights in publish.items():
            started = time.monotonic()
            load(weights, version)
            publish_s[version] = time.monotonic() - started
            with lock:
                published["version"] = version
            while not errors:
                with lock:
                    seen = any(out.policy_version >= version for _, out, _ in records)
                if seen:
                    break
                if time.monotonic() - started > timeout_s:
                    raise TimeoutError(f"no answer with version {version} within {timeout_s} s")
                time.sleep(0.005)
            first_answer_s[version] = time.monotonic() - started
            wait_for_answers(answers_between)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout_s)
    if errors:
        raise errors[0]
    went_back = sum(1 for _, output, floor in records if output.policy_version < floor)
    worst = max((reference.error(prompt, output) for prompt, output, _ in records), default=0.0)
    versions = sorted({output.policy_version for _, output, _ in records})
    return SyncReport(len(records), worst, versions, went_back, publish_s, first_answer_s)


# ------------------------------------------------------------------------ command line
def _report(ok: bool, name: str, detail: str, failures: list[str]) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def check_backend(
    label: str, policy: Any, reference: VersionedReference, tolerance: float, failures: list[str]
) -> None:
    """Groups of 4 completions per prompt against transformers, then a weight update under load."""
    futures = [(prompt, future) for prompt in PROMPTS for future in policy.submit_group(prompt, 4)]
    outputs = [future.result(timeout=600) for _, future in futures]
    error = reference.max_logp_error([prompt for prompt, _ in futures], outputs)
    requests = policy.stats().get("http_requests")
    sent = f"; {requests} HTTP request(s)" if requests is not None else ""
    _report(
        error <= tolerance,
        f"{label} log-probs vs transformers",
        f"max |diff| {error:.2e} over {len(outputs)} completions{sent} (tolerance {tolerance:g})",
        failures,
    )
    version = policy.policy_version + 1
    report = weight_sync_check(policy, reference, {version: reference.weights(version)})
    _report(
        report.ok(tolerance),
        f"{label} weight update under load",
        f"{report.answers} answers, versions {report.versions_seen}, max |diff| {report.max_logp_error:.2e}, "
        f"older-version answers {report.went_back}, publish {report.publish_s[version]:.2f} s",
        failures,
    )


def _tiny_model(folder: Path, arch: str) -> Path:
    from asyncvec.inference import build_tiny_lm

    return build_tiny_lm(folder, arch=arch, n_layer=2, n_embd=128, n_head=2, seed=0)  # head size 64: GPU kernels


def check_vllm_policy(work: Path, device: str, tolerance: float, failures: list[str]) -> None:
    """VLLMPolicy on tiny GPT-2 and Llama models."""
    from asyncvec.inference import VLLMPolicy

    for arch in ("gpt2", "llama"):
        folder = _tiny_model(work / f"{arch}-policy", arch)
        engine = {"dtype": "float32", "max_model_len": 128, "enforce_eager": True, "seed": 0}
        if device == "cuda":
            engine["gpu_memory_utilization"] = 0.3
        options = {"max_new_tokens": 8, "max_batch_size": 64, "max_wait_ms": 20}
        with VLLMPolicy(folder, str, fallback=_no_action, engine_kwargs=engine, **options) as policy:
            check_backend(f"VLLMPolicy[{arch}]", policy, VersionedReference(folder, device=device), tolerance, failures)


def check_vllm_server(work: Path, tolerance: float, failures: list[str]) -> None:
    """OpenAIPolicy against a vLLM server (`VLLMServer`), weights through vLLM's routes."""
    from asyncvec.inference import OpenAIPolicy, VLLMServer

    folder = _tiny_model(work / "gpt2-server", "gpt2")
    extra = ["--gpu-memory-utilization", "0.3"] if torch.cuda.is_available() else []
    with VLLMServer(folder, served_model_name="tiny", max_model_len=128, extra_args=extra) as server:
        _report(True, "vLLM server", f"ready on {server.url} after {server.startup_s:.0f} s", failures)
        options = {"max_new_tokens": 8, "max_batch_size": 64, "max_wait_ms": 20}
        with OpenAIPolicy(
            server.url,
            "tiny",
            str,
            server_kind="vllm",
            fallback=_no_action,
            checkpoint_dir=work / "checkpoints",
            model_dir=folder,
            **options,
        ) as policy:
            check_backend("OpenAIPolicy->vLLM server", policy, VersionedReference(folder), tolerance, failures)


def _no_action(obs: Any, env_id: int | None) -> str:
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncvec.testing.checks", description=__doc__.split("\n")[0])
    parser.add_argument("check", choices=["vllm-policy", "vllm-server"])
    parser.add_argument("--work", type=Path, required=True, help="folder for models and checkpoints")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tolerance", type=float, default=float(os.environ.get("LOGP_TOL", LOGP_TOLERANCE)))
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    try:
        if args.check == "vllm-policy":
            check_vllm_policy(args.work, args.device, args.tolerance, failures)
        else:
            check_vllm_server(args.work, args.tolerance, failures)
    except Exception as exc:  # a crash is a failure with its reason, not a traceback-only exit
        _report(False, args.check, f"{type(exc).__name__}: {exc}", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
