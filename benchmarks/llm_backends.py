"""Text-policy backends side by side: transformers, in-process vLLM, a vLLM server and ``asyncvec serve``.

One run measures, on the same tiny GPT-2 (``build_tiny_lm``, float32):

* completions/s and p50/p99 latency at 1, 8 and 64 concurrent envs for ``HFTextPolicy``,
  ``VLLMPolicy``, ``OpenAIPolicy`` -> vLLM server and ``OpenAIPolicy`` -> ``asyncvec serve``,
  each env a thread that submits a prompt, waits for the completion and submits again;
* the HTTP backends batched (one request per batch, ``n`` per prompt) and with one request
  per completion (``batch_requests=False``), and the ratio;
* weight-sync time per backend: from ``load_weights`` to the first answer that carries the
  new version, while 8 envs keep asking (every answer checked against its version's weights);
* RLOO sync vs async completions/s per backend, when the LM agents can drive vLLM backends.

Cells are measured in interleaved rounds (every cell once per round) and the medians are
reported: the machine is shared and noisy. Writes ``benchmarks/results/llm_backends.{md,png}``.

Run (about 15 minutes on a loaded 2-core machine, most of it starting vLLM twice):
    python benchmarks/llm_backends.py
    python benchmarks/llm_backends.py --rounds 1 --seconds 3 --envs 1 8     # quicker
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import tyro

from asyncvec.benchmarks.report import machine_line, markdown_table, new_figure, save_report
from asyncvec.inference import AsyncvecServer, HFTextPolicy, OpenAIPolicy, VLLMPolicy, VLLMServer, build_tiny_lm
from asyncvec.testing.checks import PROMPTS, VersionedReference, weight_sync_check


@dataclass
class Args:
    envs: list[int] = field(default_factory=lambda: [1, 8, 64])
    """numbers of concurrent envs (threads that submit, wait, and submit again)"""
    seconds: float = 6.0
    """measured time per cell"""
    warmup_s: float = 1.5
    """unmeasured time per cell before measuring"""
    rounds: int = 3
    """interleaved rounds; the table shows medians"""
    max_new_tokens: int = 8
    """completion length limit"""
    max_batch_size: int = 64
    """largest batch the policies send"""
    max_wait_ms: float = 5.0
    """longest wait for a batch to fill"""
    rloo: bool = True
    """add RLOO sync vs async completions/s per backend (asyncvec.agents.rloo.RLOO sampling from each backend's policy)"""
    rloo_prompts: int = 64
    """prompts per RLOO run (8 completions each)"""
    out_dir: str | None = None
    """where to write llm_backends.md/png (default benchmarks/results)"""


def text(completion: str) -> str:
    return completion


def drive(policy: Any, num_envs: int, seconds: float, warmup_s: float) -> dict[str, float]:
    """``num_envs`` closed-loop env threads for ``warmup_s + seconds``; rate and latency of the measured part."""
    stop = threading.Event()
    measuring = threading.Event()
    latencies: list[float] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def env_loop(env_id: int) -> None:
        count = 0
        while not stop.is_set():
            prompt = PROMPTS[(env_id + count) % len(PROMPTS)]
            count += 1
            started = time.perf_counter()
            try:
                policy.submit(prompt, env_id=env_id).result(timeout=300)
            except BaseException as exc:
                errors.append(exc)
                return
            if measuring.is_set() and not stop.is_set():
                with lock:
                    latencies.append(time.perf_counter() - started)

    threads = [threading.Thread(target=env_loop, args=(i,), daemon=True) for i in range(num_envs)]
    for thread in threads:
        thread.start()
    time.sleep(warmup_s)
    measuring.set()
    started = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    elapsed = time.perf_counter() - started
    for thread in threads:
        thread.join(300)
    if errors:
        raise errors[0]
    values = np.asarray(latencies) * 1000.0
    return {
        "completions_s": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(values, 50)) if values.size else float("nan"),
        "p99_ms": float(np.percentile(values, 99)) if values.size else float("nan"),
    }


@contextlib.contextmanager
def backends(args: Args, model_dir: Path, work: Path) -> Iterator[dict[str, Any]]:
    """Every backend, started once: name -> policy."""
    options = {
        "fallback": lambda obs, env_id: "",
        "max_new_tokens": args.max_new_tokens,
        "max_batch_size": args.max_batch_size,
        "max_wait_ms": args.max_wait_ms,
    }
    with contextlib.ExitStack() as stack:
        print("starting the vLLM server and asyncvec serve ...", flush=True)
        vllm_server = VLLMServer(model_dir, served_model_name="tiny", max_model_len=128, startup_timeout_s=900)
        asyncvec_server = AsyncvecServer(
            model_dir, model_name="tiny", weights_dir=work, extra_args=["--max-batch-size", str(args.max_batch_size)]
        )
        stack.enter_context(vllm_server.start(wait=False))
        stack.enter_context(asyncvec_server.start(wait=False))
        print("starting the in-process engines ...", flush=True)
        policies: dict[str, Any] = {}
        policies["HFTextPolicy"] = stack.enter_context(HFTextPolicy(model_dir, None, text, **options))
        engine = {"dtype": "float32", "max_model_len": 128, "enforce_eager": True, "seed": 0}
        policies["VLLMPolicy"] = stack.enter_context(VLLMPolicy(model_dir, text, engine_kwargs=engine, **options))
        vllm_server.wait_ready()
        asyncvec_server.wait_ready()
        print(f"servers ready ({machine_line()})", flush=True)
        http = {"request_timeout_s": 300, "model_dir": model_dir, **options}
        for name, server, kind in (
            ("vLLM server", vllm_server, "vllm"),
            ("asyncvec serve", asyncvec_server, "asyncvec"),
        ):
            for batched in (True, False):
                label = f"OpenAIPolicy -> {name}" + ("" if batched else " (1 request/completion)")
                policies[label] = stack.enter_context(
                    OpenAIPolicy(
                        server.url,
                        "tiny",
                        text,
                        server_kind=kind,
                        batch_requests=batched,
                        checkpoint_dir=work / f"{kind}-{int(batched)}",
                        max_connections=128,
                        **http,
                    )
                )
        for policy in policies.values():  # first calls warm the engines up
            policy.act(list(PROMPTS), timeout=600)
        yield policies


def measure_weight_sync(policies: dict[str, Any], reference: VersionedReference, rounds: int) -> dict[str, list[float]]:
    """Seconds from load_weights to the first answer with the new version, per backend and round."""
    results: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, policy in policies.items():
            if "1 request/completion" in name:
                continue
            version = policy.policy_version + 1
            if isinstance(policy, OpenAIPolicy):
                version = max(version, (policy.server_version() or 0) + 1)
            weights = reference.weights(version)
            report = weight_sync_check(policy, reference, {version: weights}, submitters=8, answers_between=8)
            if not report.ok():
                raise AssertionError(f"{name}: weight sync check failed: {report}")
            results.setdefault(name, []).append(report.first_answer_s[version])
    return results


def rloo_rows(args: Args, model_dir: Path, policies: dict[str, Any]) -> list[list[Any]]:
    """RLOO sync vs async completions/s on each backend, through the LM agents' importable API:
    ``asyncvec.agents.rloo.RLOO(Args(...), policy=<the backend's policy>).train().samples_per_s`` (the
    learner's weights are published to the backend after every update)."""
    import torch

    from asyncvec.agents.rloo import RLOO
    from asyncvec.agents.rloo import Args as RLOOArgs

    rows = []
    for name in ("HFTextPolicy", "VLLMPolicy", "OpenAIPolicy -> vLLM server", "OpenAIPolicy -> asyncvec serve"):
        rates = []
        try:
            for mode in ("sync", "async"):
                options = {
                    "model": str(model_dir),
                    "mode": mode,
                    "total_prompts": args.rloo_prompts,
                    "prompts_per_update": 16,
                    "group_size": 8,
                    "eval_prompts": 0,
                    "progress": False,
                    "backend": "vllm" if name == "VLLMPolicy" else "hf",  # vLLM binds torch's threads itself
                    "torch_threads": torch.get_num_threads(),
                }
                rates.append(RLOO(RLOOArgs(**options), policy=policies[name]).train().samples_per_s)
            rows.append([name, rates[0], rates[1], rates[1] / rates[0]])
        except Exception as exc:  # reported in the table: which backend the agents could not drive, and why
            rows.append([name, f"failed: {type(exc).__name__}: {str(exc)[:80]}", "", ""])
        print(f"RLOO {name}: {rows[-1]}", flush=True)
    return rows


def main(args: Args) -> None:
    print(machine_line(), flush=True)
    with tempfile.TemporaryDirectory(prefix="llm-backends-") as tmp:
        work = Path(tmp)
        model_dir = build_tiny_lm(work / "tiny", arch="gpt2", seed=0)
        reference = VersionedReference(model_dir)
        with backends(args, model_dir, work) as policies:
            cells: dict[tuple[str, int], list[dict[str, float]]] = {}
            for round_index in range(args.rounds):
                for num_envs in args.envs:
                    for name, policy in policies.items():
                        result = drive(policy, num_envs, args.seconds, args.warmup_s)
                        cells.setdefault((name, num_envs), []).append(result)
                        print(f"round {round_index + 1} {name} envs={num_envs}: {result}", flush=True)
            sync_times = measure_weight_sync(policies, reference, args.rounds)
            rloo = rloo_rows(args, model_dir, policies) if args.rloo else None
    write_report(args, cells, sync_times, rloo)


def median(cells: dict[tuple[str, int], list[dict[str, float]]], name: str, envs: int, key: str) -> float:
    return statistics.median(result[key] for result in cells[(name, envs)])


def write_report(args: Args, cells: dict, sync_times: dict[str, list[float]], rloo: list[list[Any]] | None) -> None:
    names = list(dict.fromkeys(name for name, _ in cells))
    rows = [
        [
            name,
            envs,
            median(cells, name, envs, "completions_s"),
            median(cells, name, envs, "p50_ms"),
            median(cells, name, envs, "p99_ms"),
        ]
        for envs in args.envs
        for name in names
    ]
    table = markdown_table(["backend", "envs", "completions/s", "p50 ms", "p99 ms"], rows)
    most = max(args.envs)
    ratio_rows = []
    for server in ("vLLM server", "asyncvec serve"):
        batched = median(cells, f"OpenAIPolicy -> {server}", most, "completions_s")
        single = median(cells, f"OpenAIPolicy -> {server} (1 request/completion)", most, "completions_s")
        ratio_rows.append([f"OpenAIPolicy -> {server}", most, batched, single, batched / single])
    ratios = markdown_table(["backend", "envs", "batched /s", "1 request/completion /s", "ratio"], ratio_rows)
    in_process = median(cells, "VLLMPolicy", most, "completions_s")
    server_rate = median(cells, "OpenAIPolicy -> vLLM server", most, "completions_s")
    targets = (
        f"Targets at {most} envs: OpenAIPolicy -> vLLM server batched / 1 request per completion = "
        f"{ratio_rows[0][4]:.1f}x (target >= 5x); / in-process VLLMPolicy = {server_rate / in_process:.2f}x "
        f"(target >= 0.5x)."
    )
    sync_rows = [[name, statistics.median(times), min(times), max(times)] for name, times in sync_times.items()]
    sync_table = markdown_table(["backend", "publish -> first new-version answer (s, median)", "min", "max"], sync_rows)
    if rloo is None:
        rloo_table = "RLOO sync vs async completions/s: not measured (--no-rloo)."
    else:
        rloo_table = markdown_table(["backend", "RLOO sync /s", "RLOO async /s", "async/sync"], rloo)
    full = "\n\n".join([table, ratios, targets, sync_table, rloo_table])
    print(full)
    figure, axes = new_figure(ncols=1, width=9.0, height=4.5)
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        values = [median(cells, name, envs, "completions_s") for envs in args.envs]
        axes.bar(np.arange(len(args.envs)) + index * width, values, width, label=name)
    axes.set_xticks(np.arange(len(args.envs)) + 0.4 - width / 2, [f"{envs} envs" for envs in args.envs])
    axes.set_yscale("log")
    axes.set_ylabel("completions/s (median)")
    axes.set_title(f"tiny GPT-2, {args.max_new_tokens} new tokens, float32, CPU")
    axes.legend(fontsize=7)
    command = "python benchmarks/llm_backends.py " + " ".join(sys.argv[1:])
    paths = save_report("llm_backends", full, figure, out_dir=args.out_dir, command=command.strip())
    print("wrote", ", ".join(str(path) for path in paths))


if __name__ == "__main__":
    main(tyro.cli(Args))
