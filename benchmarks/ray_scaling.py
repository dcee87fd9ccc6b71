"""Ray env workers on a local multi-node cluster: scaling, per-step overhead, recv latency, recovery.

Runs on a :class:`~asyncvec.distributed.cluster.LocalCluster` of 4 raylets (1 CPU each) on this
machine, so every figure is relative (the raylets share one host):

1. **Scaling**: sleep-bound envs (CartPole behind a fixed 100 ms sleeping step, so the CPU is
   not the limit) on 1, 2, 4 and 8 actors spread over 1-4 raylets, driven by send/recv with
   partial batches of half the envs: env-steps/s against linear scaling (``n`` times one
   actor's rate; target >= 0.85 at 8 actors) and against the physical bound ``n / 0.1 s``.
   Local worker processes with the same 8 envs run in the same rounds, for comparison.
2. **Per-step overhead** on raw CartPole x4 (lockstep ``step()``): Ray actors (one per env, and
   all four in one actor with ``envs_per_worker=4``) against local worker processes.
3. **recv latency with partial batches** (8 sleep-bound envs, batch 4): how long after an env
   finished its step ``recv`` handed it to the caller (p50/p99), and how long ``recv`` blocked.
4. **Recovery after a node is removed** (8 actors over 4 raylets, 2 on the removed node, which
   may move): seconds from the removal until the lost envs answer again (truncated) and until
   every env has finished a normal step again; graceful removal and a crash (raylet killed,
   noticed by Ray's health checks).

Run: ``python benchmarks/ray_scaling.py`` (about 4 minutes; ``--quick`` about 2).
Writes ``benchmarks/results/ray_scaling.md`` and ``ray_scaling.png``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncvec import AsyncLLMVectorEnv  # noqa: E402  (after the repository is put on sys.path)
from asyncvec.benchmarks.report import machine_line, markdown_table, new_figure, save_report  # noqa: E402  (after the repository is put on sys.path)
from asyncvec.benchmarks.throughput import LockstepLoop, PartialBatchLoop, make_cartpole  # noqa: E402  (after the repository is put on sys.path)
from asyncvec.distributed.cluster import LocalCluster  # noqa: E402  (after the repository is put on sys.path)
from asyncvec.distributed.ray_env import RayBackend  # noqa: E402  (after the repository is put on sys.path)
from asyncvec.envs.slow import SlowEnv  # noqa: E402  (after the repository is put on sys.path)

RAYLETS = 4


@dataclass
class Args:
    latency_ms: float = 100.0
    """fixed sleeping step latency of the sleep-bound env"""
    actors: tuple[int, ...] = (1, 2, 4, 8)
    """actor counts for the scaling table (one env per actor)"""
    seconds: float = 6.0
    """measured seconds per configuration, split into interleaved rounds"""
    rounds: int = 3
    """interleaved rounds (the table holds medians)"""
    quick: bool = False
    """shorter measurements (about half the run time)"""
    out_dir: str | None = None
    """where to write ray_scaling.md/.png (default benchmarks/results)"""


class Stamped(gym.Wrapper):
    """Records in ``info["finished_at"]`` the wall-clock time its step finished (same host: comparable)."""

    def step(self, action: Any):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, {**info, "finished_at": time.time()}


def make_sleepy(latency_ms: float) -> gym.Env:
    return Stamped(SlowEnv(gym.make("CartPole-v1"), latency_ms=latency_ms, distribution="fixed"))


def spread(cluster: LocalCluster, raylets: int) -> RayBackend:
    """Actor ``w`` on node ``w % raylets``; soft, so a lost node's actors may move."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_ids = cluster.node_ids[:raylets]
    return RayBackend(
        num_cpus=0.1,
        actor_options=lambda w: {
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_ids[w % raylets], soft=True)
        },
    )


class StampedLoop(PartialBatchLoop):
    """The send/recv loop, recording how long after its step each env reached the caller."""

    def __init__(self, envs: AsyncLLMVectorEnv) -> None:
        self.delivery_ms: list[float] = []
        self.blocked_ms: list[float] = []
        self.since = time.time()
        super().__init__(envs)

    def step_once(self) -> dict:
        start = time.perf_counter()
        info = super().step_once()
        now_wall = time.time()
        self.blocked_ms.append((time.perf_counter() - start) * 1000)
        if "finished_at" in info:
            # Steps that finished while another loop of the interleaved rounds ran would
            # count that loop's time: only steps finished during this run are measured.
            finished = info["finished_at"][info["_finished_at"]]
            self.delivery_ms += ((now_wall - finished[finished >= self.since]) * 1000).tolist()
        return info

    def run(self, seconds: float) -> float:
        self.since = time.time()
        return super().run(seconds)


def interleaved(loops: dict[str, Any], seconds: float, rounds: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {label: [] for label in loops}
    for loop in loops.values():
        loop.run(min(0.5, seconds / rounds))  # warm up
    for _ in range(rounds):
        for label, loop in loops.items():
            samples[label].append(loop.run(seconds / rounds))
    return {label: float(np.median(values)) for label, values in samples.items()}


def scaling(cluster: LocalCluster, args: Args, seconds: float) -> tuple[list[list], dict]:
    env_fn = partial(make_sleepy, args.latency_ms)
    loops: dict[str, PartialBatchLoop] = {}
    for n in args.actors:
        raylets = min(n, RAYLETS)
        loops[f"{n} actors / {raylets} raylets"] = PartialBatchLoop(
            AsyncLLMVectorEnv(
                [env_fn] * n, batch_size=max(1, n // 2), envs_per_worker=1, backend=spread(cluster, raylets)
            )
        )
    n_max = max(args.actors)
    loops[f"{n_max} local worker processes"] = PartialBatchLoop(
        AsyncLLMVectorEnv([env_fn] * n_max, batch_size=max(1, n_max // 2), envs_per_worker=1)
    )
    try:
        rates = interleaved(loops, seconds, args.rounds)
    finally:
        for loop in loops.values():
            loop.close()
    one = rates[next(iter(rates))]
    rows = []
    for (label, rate), n in zip(rates.items(), [*args.actors, n_max]):
        rows.append([label, rate, n * one, f"{rate / (n * one):.2f}", f"{rate / (n * 1000 / args.latency_ms):.0%}"])
    return rows, rates


def overhead(cluster: LocalCluster, args: Args, seconds: float) -> list[list]:
    fns = [make_cartpole] * 4
    loops = {
        "local worker processes (1 env each)": LockstepLoop(AsyncLLMVectorEnv(fns, envs_per_worker=1)),
        "Ray actors (1 env each)": LockstepLoop(
            AsyncLLMVectorEnv(fns, envs_per_worker=1, backend=spread(cluster, RAYLETS))
        ),
        "Ray actor (envs_per_worker=4)": LockstepLoop(
            AsyncLLMVectorEnv(fns, envs_per_worker=4, backend=spread(cluster, 1))
        ),
    }
    try:
        rates = interleaved(loops, seconds, args.rounds)
    finally:
        for loop in loops.values():
            loop.close()
    ms = {label: len(fns) * 1000 / rate for label, rate in rates.items()}
    local = ms["local worker processes (1 env each)"]
    return [[label, value, value * 1000 / 4, f"{value / local:.1f}x"] for label, value in ms.items()]


def latency(cluster: LocalCluster, args: Args, seconds: float) -> list[list]:
    env_fn = partial(make_sleepy, args.latency_ms)
    loops = {
        "local worker processes": StampedLoop(AsyncLLMVectorEnv([env_fn] * 8, batch_size=4)),
        "Ray actors (4 raylets)": StampedLoop(
            AsyncLLMVectorEnv([env_fn] * 8, batch_size=4, backend=spread(cluster, RAYLETS))
        ),
    }
    try:
        interleaved(loops, seconds, args.rounds)
    finally:
        for loop in loops.values():
            loop.close()
    rows = []
    for label, loop in loops.items():
        delivery, blocked = np.asarray(loop.delivery_ms), np.asarray(loop.blocked_ms)
        rows.append(
            [
                label,
                np.percentile(delivery, 50),
                np.percentile(delivery, 99),
                np.percentile(blocked, 50),
                np.percentile(blocked, 99),
                len(delivery),
            ]
        )
    return rows


def recovery(cluster: LocalCluster, args: Args, graceful: bool) -> list:
    """Removes a node under 8 running envs; seconds until its envs answer again and until all step normally."""
    node = cluster.add_node()
    nodes = [node, *cluster.node_indices[:3]]  # the new node hosts actors 0 and 4
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_ids = [cluster.node_id(i) for i in nodes]
    backend = RayBackend(
        num_cpus=0.1,
        actor_options=lambda w: {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_ids[w % 4], soft=True)},
    )
    envs = AsyncLLMVectorEnv([partial(make_sleepy, args.latency_ms)] * 8, batch_size=4, backend=backend, max_restarts=2)
    loop = StampedLoop(envs)
    try:
        loop.run(1.0)
        removed_at = time.perf_counter()
        cluster.remove_node(node, graceful=graceful)
        answered_at: float | None = None
        normal_after: set[int] = set()
        lost = {0, 4}
        while len(normal_after) < 8:
            info = loop.step_once()
            now = time.perf_counter()
            restarted = info.get("_env_restarted", np.zeros(len(info["env_id"]), bool))
            for k, i in enumerate(info["env_id"].tolist()):
                if restarted[k] and i in lost:
                    lost.discard(i)
                    if not lost:
                        answered_at = now
                elif not restarted[k] and (i not in {0, 4} or answered_at is not None):
                    normal_after.add(i)
        all_back = time.perf_counter() - removed_at
        return ["graceful removal" if graceful else "crash (raylet killed)", answered_at - removed_at, all_back]
    finally:
        loop.close()


def main(args: Args) -> dict[str, list]:
    seconds = args.seconds / 2 if args.quick else args.seconds
    print(f"starting a local cluster of {RAYLETS} raylets ...", flush=True)
    start = time.perf_counter()
    cluster = LocalCluster(RAYLETS, num_cpus=1)
    print(f"cluster up in {time.perf_counter() - start:.1f} s; {machine_line()}", flush=True)
    results: dict[str, list] = {}
    try:
        results["scaling"], rates = scaling(cluster, args, seconds)
        scaling_table = markdown_table(
            [
                "configuration",
                "env-steps/s",
                "linear (n x 1 actor)",
                "fraction of linear",
                "fraction of bound n/latency",
            ],
            results["scaling"],
        )
        print("\n### scaling, sleep-bound envs\n" + scaling_table, flush=True)
        results["overhead"] = overhead(cluster, args, seconds)
        overhead_table = markdown_table(
            ["raw CartPole x4, lockstep step()", "ms per vector step", "us per env-step", "vs local processes"],
            results["overhead"],
        )
        print("\n### per-step overhead\n" + overhead_table, flush=True)
        results["latency"] = latency(cluster, args, seconds)
        latency_table = markdown_table(
            [
                "8 sleep-bound envs, recv batch 4",
                "delivery p50 ms",
                "delivery p99 ms",
                "recv blocked p50 ms",
                "recv blocked p99 ms",
                "samples",
            ],
            results["latency"],
        )
        print("\n### recv latency with partial batches\n" + latency_table, flush=True)
        results["recovery"] = [recovery(cluster, args, graceful) for graceful in (True, False)]
        recovery_table = markdown_table(
            ["node removal (2 of 8 actors on it)", "lost envs answer again (s)", "all 8 stepping normally (s)"],
            results["recovery"],
        )
        print("\n### recovery\n" + recovery_table, flush=True)
    finally:
        cluster.shutdown()

    figure, axes = new_figure(ncols=2, width=5.5, height=4.0)
    ax_scale, ax_over = axes[0]
    counts = list(args.actors)
    measured = [row[1] for row in results["scaling"][: len(counts)]]
    ax_scale.plot(counts, measured, "o-", label="Ray actors, measured")
    ax_scale.plot(counts, [n * measured[0] for n in counts], "--", color="gray", label="linear (n x 1 actor)")
    ax_scale.plot(
        counts, [0.85 * n * measured[0] for n in counts], ":", color="tab:red", label="0.85 x linear (target)"
    )
    ax_scale.set_xlabel("actors (one sleep-bound env each)")
    ax_scale.set_ylabel("env-steps/s")
    ax_scale.set_title(f"{args.latency_ms:.0f} ms sleeping steps, 1-4 raylets", fontsize=9)
    ax_scale.legend(fontsize=7)
    ax_over.barh(
        [row[0] for row in results["overhead"]][::-1], [row[1] for row in results["overhead"]][::-1], color="tab:blue"
    )
    ax_over.set_xlabel("ms per lockstep step, raw CartPole x4")
    ax_over.tick_params(axis="y", labelsize=7)
    table = "\n\n".join(
        [
            "Scaling, sleep-bound envs:\n\n" + scaling_table,
            "Per-step overhead:\n\n" + overhead_table,
            "recv latency with partial batches:\n\n" + latency_table,
            "Recovery after a node is removed:\n\n" + recovery_table,
        ]
    )
    command = " ".join(["python benchmarks/ray_scaling.py", *sys.argv[1:]])
    save_report(
        "ray_scaling",
        table,
        figure,
        out_dir=args.out_dir,
        command=command,
        notes="All raylets share one host: relative figures only.",
    )
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
