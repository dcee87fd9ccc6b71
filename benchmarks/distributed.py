"""Routing over several policy replicas, and PPO with remote collectors, on a local Ray cluster.

Two measurements, each side by side in one run on a `LocalCluster` (several raylets on this
machine: every figure is relative, the raylets share one host):

* ``router``: a `RoutedPolicy` over 1, 2 and 4 `RayPolicy` replicas (one per raylet), each a
  model server that sleeps ``a_ms`` per batch of at most ``replica_batch`` (so one replica
  serves at most ``replica_batch / a_ms`` answers per second, whatever the CPU), driven by
  ``num_envs`` closed-loop threads. Answers per second against linear scaling from one
  replica, and the router's overhead against calling one replica directly. Rounds are
  interleaved and the medians reported.
* ``ppo``: `agents/ppo.py` on CartPole with ``--backend local`` (env worker processes here)
  and ``--backend ray`` (collector actors on the raylets), same settings and seeds,
  interleaved: env steps per second and the return reached.

Run:
    python benchmarks/distributed.py                    # both (15-30 minutes on 2 busy cores)
    python benchmarks/distributed.py --part router --rounds 3
    python benchmarks/distributed.py --quick            # a few seconds per part: a smoke run
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import tyro

from asyncvec.benchmarks.report import machine_line, markdown_table, new_figure, save_report


@dataclass
class Args:
    part: Literal["all", "router", "ppo"] = "all"
    """which measurement to run"""
    quick: bool = False
    """a smoke run: short rounds, one seed, a short PPO run"""
    out_dir: str | None = None
    """where to write the tables and plots (default benchmarks/results)"""
    # router
    replicas: tuple[int, ...] = (1, 2, 4)
    """replica counts to compare"""
    a_ms: float = 40.0
    """sleep of a replica per batch (ms)"""
    replica_batch: int = 4
    """largest batch a replica serves at once"""
    num_envs: int = 32
    """closed-loop requesters"""
    seconds: float = 5.0
    """measured seconds per round and configuration"""
    rounds: int = 3
    """interleaved rounds (medians are reported)"""
    # ppo
    total_timesteps: int = 20_000
    """env steps per PPO run"""
    ppo_envs: int = 6
    """envs of each PPO run (split over 3 collectors with --backend ray)"""
    seeds: tuple[int, ...] = (1, 2)
    """PPO seeds; each seed runs both backends back to back"""
    env_latencies: tuple[float, ...] = (0.0, 20.0)
    """env step latencies (ms, a sleeping SlowEnv): 0 is raw CartPole (CPU-bound), 20 a slow simulator"""


def make_replica(a_ms: float, max_batch_size: int):
    """A model server: a small torch policy behind a `LatencyModel` that sleeps per batch."""
    import gymnasium as gym
    import torch

    from asyncvec.inference import LatencyModel, TorchPolicy

    torch.set_num_threads(1)
    net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    inner = TorchPolicy(net, gym.spaces.Discrete(2), max_batch_size=max_batch_size)
    return LatencyModel(inner, a_ms=a_ms, b_ms=0.0, max_batch_size=max_batch_size, max_wait_ms=1.0)


def drive(policy, num_envs: int, seconds: float) -> tuple[float, float]:
    """Answers per second of ``num_envs`` threads that submit, wait and submit again, and the
    CPU milliseconds this (the requesting) process spent per answer."""
    stop = threading.Event()
    counts = [0] * num_envs

    def loop(env_id: int) -> None:
        obs = np.random.default_rng(env_id).normal(size=4).astype(np.float32)
        while not stop.is_set():
            policy.submit(obs, env_id=env_id).result(timeout=60)
            counts[env_id] += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(num_envs)]
    for thread in threads:
        thread.start()
    time.sleep(min(1.0, seconds / 4))  # warm-up
    start, first, cpu = time.monotonic(), sum(counts), time.process_time()
    time.sleep(seconds)
    answers = sum(counts) - first
    rate, cpu_ms = answers / (time.monotonic() - start), 1000.0 * (time.process_time() - cpu) / max(answers, 1)
    stop.set()
    for thread in threads:
        thread.join(60)
    return rate, cpu_ms


def router_part(args: Args, cluster) -> tuple[str, object]:
    from asyncvec.distributed import RayPolicy, RoutedPolicy

    fn = functools.partial(make_replica, args.a_ms, args.replica_batch)
    nodes = cluster.node_indices
    pool = [
        RayPolicy(fn, name=f"replica{i}", actor_options=cluster.pin(nodes[i % len(nodes)]))
        for i in range(max(args.replicas))
    ]
    # Warm every replica up (imports, first batch) before measuring.
    for replica in pool:
        replica.act(np.zeros((2, 4), np.float32), timeout=120)
    configs = [("direct", 1)] + [("router", n) for n in args.replicas]
    rates: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    cpu: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    for round_index in range(args.rounds):
        for kind, n in configs:
            policy = pool[0] if kind == "direct" else RoutedPolicy(pool[:n], close_replicas=False)
            rate, cpu_ms = drive(policy, args.num_envs, args.seconds)
            rates[(kind, n)].append(rate)
            cpu[(kind, n)].append(cpu_ms)
            if kind == "direct":
                continue
            router = policy
            shares = [row.answered for row in router.endpoints()]
            router.close()
            print(
                f"round {round_index}: router over {n}: {rates[(kind, n)][-1]:.0f}/s, answers per replica {shares}",
                flush=True,
            )
    for replica in pool:
        replica.close()
    bound = 1000.0 * args.replica_batch / args.a_ms
    base = float(np.median(rates[("router", 1)])) if ("router", 1) in rates else float("nan")
    rows = []
    for kind, n in configs:
        median = float(np.median(rates[(kind, n)]))
        label = "one RayPolicy, no router" if kind == "direct" else f"RoutedPolicy over {n}"
        rows.append(
            [
                label,
                n,
                median,
                bound * n,
                median / (bound * n),
                median / (base * n) if kind == "router" else float("nan"),
                float(np.median(cpu[(kind, n)])),
            ]
        )
    headers = ["configuration", "replicas", "answers/s (median)", "sleep bound/s", "of the bound", "of linear from 1"]
    table = markdown_table([*headers, "requester CPU ms/answer"], rows)
    fig, ax = new_figure()
    counts = [n for kind, n in configs if kind == "router"]
    ax.plot(counts, [np.median(rates[("router", n)]) for n in counts], "o-", label="RoutedPolicy")
    ax.plot(counts, [base * n for n in counts], "--", label="linear from 1 replica")
    ax.plot(counts, [bound * n for n in counts], ":", label="sleep bound")
    ax.set_xlabel("replicas (one per raylet)")
    ax.set_ylabel("answers per second")
    ax.set_xticks(counts)
    ax.legend()
    return table, fig


def ppo_part(args: Args) -> tuple[str, object]:
    from asyncvec.agents.ppo import PPO
    from asyncvec.agents.ppo import Args as PPOArgs

    results: dict[tuple[float, str], list] = {}
    for latency in args.env_latencies:
        for seed in args.seeds:
            for backend in ("local", "ray"):
                ppo_args = PPOArgs(
                    env="CartPole-v1",
                    track=False,  # timed: no TensorBoard files
                    backend=backend,
                    num_envs=args.ppo_envs,
                    ray_collectors=3,
                    env_latency_ms=latency,
                    total_timesteps=args.total_timesteps,
                    seed=seed,
                    progress=False,
                )
                result = PPO(ppo_args).train()
                results.setdefault((latency, backend), []).append(result)
                print(
                    f"env latency {latency:.0f} ms, seed {seed}, {backend}: {result.env_steps_per_s:.0f} env steps/s, "
                    f"return {result.final_return:.0f}, {result.wall_time_s:.0f} s, "
                    f"staleness {result.staleness_mean:.2f}",
                    flush=True,
                )
    rows = []
    for latency in args.env_latencies:
        local_rate = float(np.median([r.env_steps_per_s for r in results[(latency, "local")]]))
        for backend, label in (
            ("local", "--backend local (worker processes)"),
            ("ray", "--backend ray (3 collectors)"),
        ):
            runs = results[(latency, backend)]
            rate = float(np.median([r.env_steps_per_s for r in runs]))
            rows.append(
                [
                    f"{latency:.0f} ms",
                    label,
                    len(runs),
                    rate,
                    rate / local_rate,
                    float(np.median([r.final_return for r in runs])),
                    float(np.median([r.staleness_mean for r in runs])),
                    float(np.median([r.wall_time_s for r in runs])),
                ]
            )
    table = markdown_table(
        [
            "env step latency",
            "backend",
            "runs",
            "env steps/s (median)",
            "vs local",
            "final return (median)",
            "mean staleness",
            "wall s",
        ],
        rows,
    )
    fig, axes = new_figure(ncols=len(args.env_latencies))
    for ax, latency in zip(np.ravel(axes), args.env_latencies, strict=True):
        for backend, style in (("local", "-"), ("ray", "--")):
            for run in results[(latency, backend)]:
                steps = [row["global_step"] for row in run.history]
                ax.plot(steps, [row["charts/episodic_return"] for row in run.history], style, label=backend)
        ax.set_title(f"CartPole, env step latency {latency:.0f} ms")
        ax.set_xlabel("env steps")
        ax.set_ylabel("return (last 20 episodes)")
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys())
    return table, fig


def start_cluster(num_nodes: int, attempts: int = 3):
    """A `LocalCluster`; a raylet that cannot register within Ray's 30 s on a busy machine is retried."""
    from asyncvec.distributed.cluster import LocalCluster

    for attempt in range(attempts):
        try:
            return LocalCluster(num_nodes)
        except Exception as exc:  # Ray raises a bare Exception for a raylet start-up timeout
            if attempt == attempts - 1 or "timed out during startup" not in str(exc):
                raise
            print(f"cluster start failed ({exc}); retrying", flush=True)


def main(args: Args) -> None:
    if args.quick:
        args.seconds, args.rounds, args.replicas, args.total_timesteps, args.seeds = 1.0, 1, (1, 2), 2_000, (1,)
    print(machine_line())
    command = "python benchmarks/distributed.py" + (f" --part {args.part}" if args.part != "all" else "")
    with start_cluster(4 if args.part != "ppo" else 3) as cluster:
        if args.part in ("all", "router"):
            table, fig = router_part(args, cluster)
            print(table)
            notes = (
                f"Each replica sleeps {args.a_ms:.0f} ms per batch of at most {args.replica_batch} "
                f"({1000 * args.replica_batch / args.a_ms:.0f} answers/s), {args.num_envs} closed-loop requesters, "
                f"{args.seconds:.0f} s per measurement, median of {args.rounds} interleaved rounds. "
                "All raylets share one host: the figures are relative."
            )
            save_report("distributed_router", table, fig, out_dir=args.out_dir, command=command, notes=notes)
        if args.part in ("all", "ppo"):
            if args.part == "all":  # the PPO comparison runs on 3 raylets
                cluster.remove_node(cluster.node_indices[-1])
            table, fig = ppo_part(args)
            print(table)
            notes = (
                f"PPO on CartPole-v1 (env step latencies {list(args.env_latencies)} ms), {args.ppo_envs} envs, "
                f"{args.total_timesteps} env steps, default PPO settings, "
                f"seeds {list(args.seeds)}; --backend ray runs 3 collector actors on a 3-raylet local cluster. "
                "All raylets share one host: the figures are relative."
            )
            save_report("distributed_ppo", table, fig, out_dir=args.out_dir, command=command, notes=notes)


if __name__ == "__main__":
    main(tyro.cli(Args))
