"""Async vs sync PPO in the regimes that decide whether async pays, each against its bound.

Every regime trains PPO (``agents/ppo.py``, through its importable API) on CartPole-v1 in both
modes with the same seeds, interleaved (sync first for one seed, async first for the next),
and measures, per mode: steady env-steps/s, wall-clock to a 20-episode mean return of
``target_return``, learner time per update and the staleness of every sample. Before the runs
it measures the stages that bound both modes:

* the policy call: ``c(B) = a + b·B`` fitted over timed backend calls of B = 1..N (the same
  ``make_policy`` server PPO uses), and the server's capacity under saturation (requests/s);
* the env step: the step times of the regime's env measured in N threads (sleep overshoot
  included): their mean ``E[L]`` and the mean of the slowest of N, ``E[max_N L]``;
* the learner: the wall time of ``PPO.update`` in the sync runs, ``U``.

The bound on the async/sync speed-up (derivation in docs/benchmarks.md), per update of
``T·N`` steps (``T`` steps per env, ``N`` envs):

    sync   S = T·(c(N) + E[max_N L]) + U                   lockstep: every step waits for the
                                                            slowest env; learning waits for acting
    async  A = max(T·max(c(1) + E[L], N / capacity), U)    each env cycles on its own; acting and
                                                            learning overlap
    bound  = S / A

Regimes (``--regimes``; the defaults of each are in ``REGIMES``):

    a  policy-bound    20 ms policy, 2 ms fixed env, cheap learner: little to overlap
    b  learner-bound   as a, with a learner update (wider network) as long as acting on its data
    c  straggler-bound 5 ms policy, 10 ms heavy-tailed env (lognormal, sigma 1), 16 envs
    d  LLM             RLOO on a vLLM server with heavy-tailed reward latency
                       (benchmarks/pipeline_llm.py; its bound is pipeline_llm.llm_bound)

Run (about 40 minutes for a b c with 3 seeds on 2 loaded cores; ``--quick`` takes about a minute):

    python benchmarks/pipeline.py
    python benchmarks/pipeline.py --regimes b c --seeds 1 2
    python benchmarks/pipeline.py --quick
"""

from __future__ import annotations

import copy
import statistics
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gymnasium as gym
import numpy as np
import torch
import tyro

from asyncvec.agents.common import make_env_fn, make_policy, make_vector_env
from asyncvec.agents.ppo import PPO, Actor, TrainResult
from asyncvec.agents.ppo import Args as PPOArgs
from asyncvec.benchmarks.report import machine_line, markdown_table, new_figure, save_figure, save_report
from asyncvec.inference.batcher import fit_batch_cost


@dataclass(frozen=True)
class Regime:
    """One scenario: the latencies, the learner's cost and the learning target."""

    key: str
    title: str
    summary: str
    num_envs: int
    num_steps: int
    policy_latency_ms: float
    env_latency_ms: float
    env_latency_dist: str
    hidden: int
    update_epochs: int
    target_return: float
    total_timesteps: int
    # When set, update_epochs is chosen each round so that one update takes this multiple of
    # the time sync acting takes to collect its data (measured; see calibrate_epochs).
    learner_to_collect: float | None = None


REGIMES: dict[str, Regime] = {
    "a": Regime(
        "a", "policy-bound", "20 ms policy, 2 ms env, cheap learner", 8, 32, 20.0, 2.0, "fixed", 64, 20, 475.0, 100_000
    ),
    "b": Regime(
        "b",
        "learner-bound",
        "20 ms policy, 2 ms env, 256-wide learner as slow as acting",
        8,
        32,
        20.0,
        2.0,
        "fixed",
        256,
        20,
        475.0,
        100_000,
        learner_to_collect=1.0,
    ),
    "c": Regime(
        "c",
        "straggler-bound",
        "5 ms policy, 10 ms lognormal env (sigma 1), 16 envs",
        16,
        16,
        5.0,
        10.0,
        "lognormal",
        64,
        20,
        475.0,
        100_000,
    ),
}

# PPO settings pinned here (SB3-zoo CartPole values) so that a change of PPO's defaults does not
# move the benchmark; the regime sets the rest.
PPO_SETTINGS: dict[str, Any] = {
    "env": "CartPole-v1",
    "max_staleness": 4,
    "correction": "decoupled",
    "is_cap": 2.0,
    "policy_lag": 0,
    "learning_rate": 1e-3,
    "anneal_lr": True,
    "gamma": 0.98,
    "gae_lambda": 0.8,
    "num_minibatches": 1,
    "clip_coef": 0.2,
    "ent_coef": 0.0,
    "vf_coef": 0.5,
    "max_grad_norm": 0.5,
    "torch_threads": 1,
    # The settings these regimes were measured with, from before PPO's default gained these guards.
    "normalize_obs": False,
    "normalize_rewards": False,
    "target_kl": None,
}


@dataclass
class Args:
    """Async vs sync PPO per regime, against the bound of the measured stage times."""

    regimes: list[str] = field(default_factory=lambda: ["a", "b", "c", "d"])
    """which regimes to run (a, b, c: PPO on CartPole; d: RLOO on a vLLM server, benchmarks/pipeline_llm.py)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds; each regime runs both modes per seed (interleaved; d: one round per seed)"""
    quick: bool = False
    """a smoke run: one seed, a few updates, no target"""
    total_timesteps: int | None = None
    """override every regime's env-step budget"""
    target_return: float | None = None
    """override the target return of regimes a b c"""
    llm_target_reward: float = 0.8
    """regime d: a run reaches its target once the mean reward of 10 updates reaches this"""
    llm_max_prompts: int = 4800
    """regime d: prompts per run at most"""
    calibration_s: float = 3.0
    """seconds spent measuring the env step distribution per regime"""
    out_dir: str | None = None
    """where the tables and PNGs go (default benchmarks/results)"""
    progress: bool = False
    """progress bars of the PPO runs"""
    diagnose: bool = False
    """instead of training: measure the async collector alone (no learner) against c(1) + E[L],
    with PPO's settings and with its waits turned down, to show what the overhead is"""


# ---------------------------------------------------------------------------------------------
# Stage times


@dataclass
class StageTimes:
    """The measured stage times a regime's bound is computed from (seconds)."""

    policy_a_s: float
    policy_b_s: float
    policy_capacity_per_s: float
    env_mean_s: float
    env_max_s: float
    learn_s: float = float("nan")  # filled from the sync runs

    def policy_s(self, batch: int) -> float:
        return self.policy_a_s + self.policy_b_s * batch


@dataclass
class Prediction:
    """What the stage times allow, per update of ``T·N`` steps."""

    sync_iteration_s: float
    async_iteration_s: float
    async_collect_s: float

    @property
    def bound(self) -> float:
        return self.sync_iteration_s / self.async_iteration_s


def predict(stages: StageTimes, num_envs: int, num_steps: int) -> Prediction:
    """The model of docs/benchmarks.md: lockstep sync vs overlapped, per-env async.

    Example:
        >>> stages = StageTimes(0.02, 0.0, 1600.0, 0.002, 0.002, learn_s=0.7)
        >>> p = predict(stages, num_envs=8, num_steps=32)
        >>> round(p.sync_iteration_s, 3), round(p.async_iteration_s, 3), round(p.bound, 2)
        (1.404, 0.704, 1.99)
    """
    sync = num_steps * (stages.policy_s(num_envs) + stages.env_max_s) + stages.learn_s
    per_env_cycle = stages.policy_s(1) + stages.env_mean_s
    server = num_envs / stages.policy_capacity_per_s  # seconds of serving per step of every env
    collect = num_steps * max(per_env_cycle, server)
    return Prediction(sync, max(collect, stages.learn_s), collect)


def measure_policy(regime: Regime, repeats: int = 5) -> tuple[float, float, float]:
    """``(a, b, capacity)``: the fit of timed backend calls of each batch size, and the server's
    answers per second when every one of its concurrent batches is full."""
    torch.manual_seed(0)
    space = gym.make(PPO_SETTINGS["env"]).observation_space
    action_space = gym.make(PPO_SETTINGS["env"]).action_space
    actor = Actor(space.shape[0], action_space, regime.hidden)
    policy = make_policy(copy.deepcopy(actor), action_space, regime.num_envs, regime.policy_latency_ms)
    try:
        obs = policy.check_observation(np.zeros(space.shape, np.float32))
        sizes, seconds = [], []
        batch_sizes = sorted({1, 2, max(1, regime.num_envs // 4), max(1, regime.num_envs // 2), regime.num_envs})
        for _ in range(repeats):
            for size in batch_sizes:
                start = time.perf_counter()
                policy.forward_batch([obs] * size)
                sizes.append(size)
                seconds.append(time.perf_counter() - start)
        a, b = fit_batch_cost(sizes, seconds)
        requests = 8 * regime.num_envs
        start = time.perf_counter()
        futures = [
            policy.submit(np.zeros(space.shape, np.float32), env_id=i % regime.num_envs) for i in range(requests)
        ]
        for future in futures:
            future.result(timeout=60)
        capacity = requests / (time.perf_counter() - start)
    finally:
        policy.close()
    return a, b, capacity


def measure_env(regime: Regime, seconds: float) -> tuple[float, float]:
    """``(E[L], E[max_N L])`` of the regime's env step, from step times measured in N threads
    (sleeping envs: the threads overlap as worker processes would)."""
    durations: list[list[float]] = [[] for _ in range(regime.num_envs)]
    deadline = time.perf_counter() + seconds

    def steps(index: int) -> None:
        env = make_env_fn(PPO_SETTINGS["env"], regime.env_latency_ms, regime.env_latency_dist, seed=index)()
        env.reset(seed=index)
        rng = np.random.default_rng(index)
        while time.perf_counter() < deadline or len(durations[index]) < 20:
            start = time.perf_counter()
            _, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
            durations[index].append(time.perf_counter() - start)
            if terminated or truncated:
                env.reset()
        env.close()

    threads = [threading.Thread(target=steps, args=(i,)) for i in range(regime.num_envs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pooled = np.concatenate([np.asarray(d) for d in durations])
    draws = np.random.default_rng(0).choice(pooled, size=(20_000, regime.num_envs))
    return float(pooled.mean()), float(draws.max(axis=1).mean())


def calibrate(regime: Regime, seconds: float) -> StageTimes:
    torch.set_num_threads(PPO_SETTINGS["torch_threads"])  # as PPO runs it (process-wide)
    a, b, capacity = measure_policy(regime)
    env_mean, env_max = measure_env(regime, seconds)
    return StageTimes(a, b, capacity, env_mean, env_max)


def calibrate_epochs(regime: Regime, stages: StageTimes, args: Args, probe_epochs: int = 4) -> int:
    """Epochs per update that make one update take ``learner_to_collect`` times the time sync
    acting needs for its ``T·N`` steps, from timed ``PPO.update`` calls on a segment of that size."""
    from asyncvec.buffers import Segment

    probe = replace(regime, update_epochs=probe_epochs)
    agent = PPO(ppo_args(probe, "sync", 0, replace(args, quick=True, total_timesteps=10**6)))
    try:
        rng = np.random.default_rng(0)
        t, n = regime.num_steps, regime.num_envs
        segment = Segment(
            obs=rng.normal(size=(t, n, 4)).astype(np.float32),
            action=rng.integers(0, 2, (t, n)),
            reward=np.ones((t, n), np.float32),
            terminated=rng.random((t, n)) < 0.05,
            truncated=np.zeros((t, n), bool),
            values=np.zeros((t, n), np.float32),
            behavior_logp=np.full((t, n), np.log(0.5), np.float32),
            policy_version=np.zeros((t, n), np.int64),
            last_obs=rng.normal(size=(n, 4)).astype(np.float32),
        )
        times = []
        for _ in range(3):
            start = time.perf_counter()
            agent.update(segment)
            times.append(time.perf_counter() - start)
    finally:
        agent.envs.close()
        agent.policy.close()
        agent.store.close()
        agent.versions.close()
    per_epoch = statistics.median(times) / probe_epochs
    collect = regime.num_steps * (stages.policy_s(regime.num_envs) + stages.env_max_s)
    return int(np.clip(round(regime.learner_to_collect * collect / per_epoch), 2, 200))


def measure_collector(regime: Regime, seconds: float, recv_batch: int, max_wait_ms: float | None) -> float:
    """env-steps/s of the async ``Collector`` alone: no learner, every segment taken the moment
    it is ready, so the only limits are the stages and the collector's own overheads.

    ``recv_batch`` is the env's partial-batch size and ``max_wait_ms`` the policy server's wait
    for a batch to fill (None: PPO's own server from ``make_policy``, which waits 2 ms).
    """
    from asyncvec import Collector, RolloutStore
    from asyncvec.inference import LatencyModel, TorchPolicy

    torch.manual_seed(0)
    envs = make_vector_env(
        PPO_SETTINGS["env"],
        regime.num_envs,
        regime.env_latency_ms,
        batch_size=recv_batch,
        distribution=regime.env_latency_dist,
    )
    space, action_space = envs.single_observation_space, envs.single_action_space
    actor = Actor(space.shape[0], action_space, regime.hidden)
    if max_wait_ms is None:
        policy = make_policy(actor, action_space, regime.num_envs, regime.policy_latency_ms)
    else:
        inner = TorchPolicy(actor, action_space, max_batch_size=regime.num_envs)
        policy = LatencyModel(
            inner,
            a_ms=regime.policy_latency_ms,
            b_ms=0.0,
            max_batch_size=regime.num_envs,
            max_wait_ms=max_wait_ms,
            max_inflight_batches=4,
        )
    store = RolloutStore(regime.num_steps, regime.num_envs, space, action_space)
    collector = Collector(envs, policy, store, seed=0).start()
    try:
        warmup_end = time.monotonic() + min(2.0, seconds / 2)
        while time.monotonic() < warmup_end:
            store.get(timeout=60)
        segments, start = 0, time.monotonic()
        while time.monotonic() - start < seconds:
            store.get(timeout=60)
            segments += 1
        return segments * regime.num_steps * regime.num_envs / (time.monotonic() - start)
    finally:
        collector.stop()
        policy.close()
        envs.close()
        store.close()


def diagnose(keys: list[str], args: Args) -> str:
    """What the async collector costs per env cycle, against the stage-time ideal ``c(1) + E[L]``:
    PPO's settings, then each knob that adds waiting turned down."""
    rows = []
    for key in keys:
        regime = REGIMES[key]
        stages = calibrate(regime, args.calibration_s)
        ideal = stages.policy_s(1) + stages.env_mean_s
        variants = [
            (f"PPO's: recv {max(1, regime.num_envs // 4)} envs, server waits 2 ms", max(1, regime.num_envs // 4), None),
            ("recv 1 env, server waits 2 ms", 1, 2.0),
            ("recv 1 env, server waits 0 ms", 1, 0.0),
        ]
        for name, recv_batch, max_wait in variants:
            sps = measure_collector(regime, 4.0 if args.quick else 15.0, recv_batch, max_wait)
            cycle = regime.num_envs / sps
            rows.append(
                [
                    key,
                    name,
                    sps,
                    regime.num_envs / ideal,
                    ideal * 1e3,
                    cycle * 1e3,
                    (cycle - ideal) * 1e3,
                    ideal / cycle,
                ]
            )
            print(
                f"[{key}] collector, {name}: {sps:.0f} steps/s, cycle {cycle * 1e3:.1f} ms vs ideal "
                f"{ideal * 1e3:.1f} ms ({machine_line()})",
                flush=True,
            )
    return markdown_table(
        [
            "regime",
            "collector",
            "steps/s",
            "ideal steps/s",
            "ideal cycle c(1)+E[L] (ms)",
            "measured cycle (ms)",
            "overhead (ms)",
            "measured / ideal",
        ],
        rows,
    )


# ---------------------------------------------------------------------------------------------
# Runs


@dataclass
class Run:
    regime: str
    mode: str
    seed: int
    update_epochs: int
    result: TrainResult
    update_s: list[float]
    update_cpu_s: list[float]
    staleness_counts: np.ndarray
    policy_call_s: list[float] = field(default_factory=list)  # sync: mean batched policy call, per update
    env_step_s: list[float] = field(default_factory=list)  # sync: mean lockstep env step, per update
    cores_used: float = float("nan")  # CPU seconds of this process (learner, collector, policy) per second

    @property
    def steady_steps_per_s(self) -> float:
        """env-steps/s after the first updates (env start-up and warm-up excluded)."""
        rows = self.result.history
        if len(rows) < 4:
            return self.result.env_steps_per_s
        first = rows[min(2, len(rows) - 2)]
        last = rows[-1]
        return (last["global_step"] - first["global_step"]) / (last["time/wall_s"] - first["time/wall_s"])

    @property
    def iteration_s(self) -> float:
        """Median wall time between updates."""
        times = [row["time/wall_s"] for row in self.result.history]
        return float(np.median(np.diff(times))) if len(times) > 2 else float("nan")

    def curve(self) -> tuple[np.ndarray, np.ndarray]:
        rows = self.result.history
        return np.array([r["time/wall_s"] for r in rows]), np.array([r["charts/episodic_return"] for r in rows])


def ppo_args(regime: Regime, mode: str, seed: int, args: Args) -> PPOArgs:
    total = args.total_timesteps or regime.total_timesteps
    target = args.target_return if args.target_return is not None else regime.target_return
    return PPOArgs(
        **PPO_SETTINGS,
        mode=mode,
        seed=seed,
        num_envs=regime.num_envs,
        num_steps=regime.num_steps,
        policy_latency_ms=regime.policy_latency_ms,
        env_latency_ms=regime.env_latency_ms,
        env_latency_dist=regime.env_latency_dist,
        hidden=regime.hidden,
        update_epochs=regime.update_epochs,
        total_timesteps=total,
        target_return=None if args.quick else target,
        progress=args.progress,
        track=False,
    )


def run_once(regime: Regime, mode: str, seed: int, args: Args) -> Run:
    cpu = time.process_time()
    result = PPO(ppo_args(regime, mode, seed, args)).train()
    cpu = time.process_time() - cpu
    return Run(
        regime.key,
        mode,
        seed,
        regime.update_epochs,
        result,
        [row["time/update_s"] for row in result.history],
        [row["time/update_cpu_s"] for row in result.history],
        np.asarray(result.staleness_histogram, dtype=np.int64),
        [row["time/policy_call_s"] for row in result.history if "time/policy_call_s" in row],
        [row["time/env_step_s"] for row in result.history if "time/env_step_s" in row],
        cpu / result.wall_time_s,
    )


# ---------------------------------------------------------------------------------------------
# Summaries


@dataclass
class Summary:
    """One regime: medians over seeds, the bound and the stage times behind it."""

    regime: Regime
    stages: StageTimes
    prediction: Prediction
    runs: list[Run]
    sync_sps: float
    async_sps: float
    ratio: float  # median of the per-seed async/sync env-steps/s ratios
    sync_ttt: float  # median wall-clock to the target (NaN when a seed missed it)
    async_ttt: float
    ttt_ratio: float  # median of the per-seed sync/async time-to-target ratios
    reached: str  # "sync 3/3, async 3/3"
    learn_async_s: float
    staleness_mean: float
    sync_policy_call_s: float  # in the sync runs: median over updates of the mean batched policy call (PPO's stage)
    sync_env_step_s: float  # in the sync runs: median over updates of the mean lockstep env step
    cores_used: dict[str, float]  # per mode: the process's CPU seconds per second (median over seeds)

    @property
    def ratio_to_bound(self) -> float:
        return self.ratio / self.prediction.bound


def _median(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def summarize(regime: Regime, stages: StageTimes, runs: list[Run]) -> Summary:
    by_mode = {mode: {r.seed: r for r in runs if r.mode == mode} for mode in ("sync", "async")}
    seeds = sorted(set(by_mode["sync"]) & set(by_mode["async"]))
    stages = replace(stages, learn_s=_median([u for r in by_mode["sync"].values() for u in r.update_s[1:]]))
    prediction = predict(stages, regime.num_envs, regime.num_steps)

    def ttt(run: Run) -> float:
        return run.result.reached_target_s if run.result.reached_target_s is not None else float("nan")

    staleness = sum((r.staleness_counts for r in by_mode["async"].values() if r.staleness_counts.size), np.zeros(1))
    reached = {m: sum(r.result.reached_target_s is not None for r in by_mode[m].values()) for m in by_mode}
    return Summary(
        regime=regime,
        stages=stages,
        prediction=prediction,
        runs=runs,
        sync_sps=_median([r.steady_steps_per_s for r in by_mode["sync"].values()]),
        async_sps=_median([r.steady_steps_per_s for r in by_mode["async"].values()]),
        ratio=_median([by_mode["async"][s].steady_steps_per_s / by_mode["sync"][s].steady_steps_per_s for s in seeds]),
        sync_ttt=_median([ttt(r) for r in by_mode["sync"].values()]),
        async_ttt=_median([ttt(r) for r in by_mode["async"].values()]),
        ttt_ratio=_median([ttt(by_mode["sync"][s]) / ttt(by_mode["async"][s]) for s in seeds]),
        reached=f"sync {reached['sync']}/{len(by_mode['sync'])}, async {reached['async']}/{len(by_mode['async'])}",
        learn_async_s=_median([u for r in by_mode["async"].values() for u in r.update_s[1:]]),
        sync_policy_call_s=_median([t for r in by_mode["sync"].values() for t in r.policy_call_s]),
        sync_env_step_s=_median([t for r in by_mode["sync"].values() for t in r.env_step_s]),
        cores_used={mode: _median([r.cores_used for r in by_mode[mode].values()]) for mode in by_mode},
        staleness_mean=float(np.dot(np.arange(staleness.size), staleness) / max(staleness.sum(), 1)),
    )


def llm_regime(args: Args) -> dict[str, Any]:
    """Regime d: ``benchmarks/pipeline_llm.py`` (RLOO on a vLLM server, lognormal reward latency),
    one sync and one async run per seed, interleaved; also writes its own ``pipeline_llm.md``/``.png``.

    Returns :func:`benchmarks.pipeline_llm.llm_regime`'s dict (modes, stages, bound, ratios).
    """
    from asyncvec.benchmarks import pipeline_llm  # imported here: it loads the LM stack, which a b c do not need

    options = pipeline_llm.Args(
        rounds=len(args.seeds),
        seed=args.seeds[0],
        target_reward=args.llm_target_reward,
        max_prompts=args.llm_max_prompts,
        out_dir=args.out_dir,
    )
    if args.quick:
        options = replace(options, rounds=1, max_prompts=64, sft_steps=50)
    return pipeline_llm.main(options, command="python benchmarks/pipeline.py " + " ".join(sys.argv[1:]))


def llm_row(llm: dict[str, Any]) -> list[Any]:
    """Regime d's row of the main table, from :func:`benchmarks.pipeline_llm.llm_regime`'s result."""
    modes, setup = llm["modes"], llm["setup"]
    rounds = len(modes["sync"]["runs"])
    title = (
        f"d. LLM (RLOO on vLLM, lognormal reward latency: median {setup['reward_median_ms']:g} ms, "
        f"sigma {setup['reward_sigma']:g}; completions/s; target reward {setup['target_reward']:g})"
    )
    return [
        title,
        modes["sync"]["completions_per_s"],
        modes["async"]["completions_per_s"],
        llm["ratio"],
        llm["bound"]["bound"],
        llm["ratio_over_bound"],
        _fmt_s(modes["sync"]["time_to_target_s"]),
        _fmt_s(modes["async"]["time_to_target_s"]),
        llm["time_to_target_ratio"],
        f"sync {modes['sync']['reached']}/{rounds}, async {modes['async']['reached']}/{rounds}",
        _median([r["staleness_mean"] for r in modes["async"]["runs"]]),
    ]


# ---------------------------------------------------------------------------------------------
# Report


def _fmt_s(value: float) -> str:
    return "not reached" if value != value else f"{value:.0f}"


def tables(summaries: list[Summary], llm: dict[str, Any] | None) -> tuple[str, str]:
    headers = [
        "regime",
        "sync steps/s",
        "async steps/s",
        "ratio",
        "bound",
        "ratio / bound",
        "sync s to target",
        "async s to target",
        "time ratio",
        "reached",
        "async staleness",
    ]
    rows = []
    for s in summaries:
        target = f"{s.regime.target_return:g}"
        rows.append(
            [
                f"{s.regime.key}. {s.regime.title} ({s.regime.summary}; target {target})",
                s.sync_sps,
                s.async_sps,
                s.ratio,
                s.prediction.bound,
                s.ratio_to_bound,
                _fmt_s(s.sync_ttt),
                _fmt_s(s.async_ttt),
                s.ttt_ratio,
                s.reached,
                s.staleness_mean,
            ]
        )
    if llm is not None:
        rows.append(llm_row(llm))
    main_table = markdown_table(headers, rows)
    stage_headers = [
        "regime",
        "epochs/update",
        "policy a (ms)",
        "policy b (ms/item)",
        "server (req/s)",
        "env E[L] (ms)",
        "env E[max_N L] (ms)",
        "in sync runs: c(N), step (ms)",
        "learner U sync (ms)",
        "U async (ms)",
        "predicted sync steps/s",
        "predicted async steps/s",
        "measured/predicted sync",
        "measured/predicted async",
        "cores used sync, async",
    ]
    stage_rows = []
    for s in summaries:
        steps = s.regime.num_envs * s.regime.num_steps
        p, st = s.prediction, s.stages
        epochs = ", ".join(str(e) for e in sorted({r.update_epochs for r in s.runs}))
        stage_rows.append(
            [
                s.regime.key,
                epochs,
                st.policy_a_s * 1e3,
                st.policy_b_s * 1e3,
                st.policy_capacity_per_s,
                st.env_mean_s * 1e3,
                st.env_max_s * 1e3,
                f"{s.sync_policy_call_s * 1e3:.1f}, {s.sync_env_step_s * 1e3:.1f}",
                st.learn_s * 1e3,
                s.learn_async_s * 1e3,
                steps / p.sync_iteration_s,
                steps / p.async_iteration_s,
                s.sync_sps * p.sync_iteration_s / steps,
                s.async_sps * p.async_iteration_s / steps,
                f"{s.cores_used['sync']:.2f}, {s.cores_used['async']:.2f}",
            ]
        )
    return main_table, markdown_table(stage_headers, stage_rows)


def figures(summaries: list[Summary]):
    warnings.simplefilter("ignore", RuntimeWarning)  # NaN returns before the first episode ends
    keys = [s.regime.key for s in summaries]
    fig, axes = new_figure(ncols=2, width=5.5)
    ax_sps, ax_ratio = np.ravel(axes)
    x = np.arange(len(summaries))
    steps = [s.regime.num_envs * s.regime.num_steps for s in summaries]
    ax_sps.bar(x - 0.2, [s.sync_sps for s in summaries], 0.4, label="sync (measured)", color="tab:gray")
    ax_sps.bar(x + 0.2, [s.async_sps for s in summaries], 0.4, label="async (measured)", color="tab:blue")
    ax_sps.scatter(
        x - 0.2,
        [n / s.prediction.sync_iteration_s for n, s in zip(steps, summaries)],
        marker="_",
        s=400,
        color="black",
        label="model",
        zorder=3,
    )
    ax_sps.scatter(
        x + 0.2,
        [n / s.prediction.async_iteration_s for n, s in zip(steps, summaries)],
        marker="_",
        s=400,
        color="black",
        zorder=3,
    )
    ax_sps.set_xticks(x, [f"{s.regime.key}. {s.regime.title}" for s in summaries])
    ax_sps.set_ylabel("env-steps/s (steady)")
    ax_sps.legend()
    ax_ratio.bar(x - 0.2, [s.prediction.bound for s in summaries], 0.4, label="bound", color="tab:green")
    ax_ratio.bar(x + 0.2, [s.ratio for s in summaries], 0.4, label="measured ratio", color="tab:blue")
    ax_ratio.scatter(
        x - 0.2,
        [0.9 * s.prediction.bound for s in summaries],
        marker="_",
        s=400,
        color="black",
        label="0.9 x bound",
        zorder=3,
    )
    ax_ratio.axhline(1.0, color="gray", lw=0.8)
    ax_ratio.set_xticks(x, keys)
    ax_ratio.set_ylabel("async / sync env-steps/s")
    ax_ratio.legend()

    curves, axes = new_figure(ncols=len(summaries), width=4.5)
    axes = np.ravel(axes)
    for ax, s in zip(axes, summaries):
        for mode, color in (("sync", "tab:gray"), ("async", "tab:blue")):
            runs = [r for r in s.runs if r.mode == mode]
            end = max(r.curve()[0][-1] for r in runs if len(r.result.history))
            grid = np.linspace(0, end, 200)
            # A run that stopped at the target keeps its last value.
            values = np.array([np.interp(grid, *r.curve(), left=np.nan) for r in runs if len(r.result.history)])
            mean = np.nanmean(values, axis=0) if len(values) else grid * np.nan
            ax.plot(grid, mean, color=color, label=f"{mode} (mean of {len(values)})")
            ax.fill_between(grid, np.nanmin(values, axis=0), np.nanmax(values, axis=0), color=color, alpha=0.2)
        ax.axhline(s.regime.target_return, color="black", lw=0.8, ls="--")
        ax.set_title(f"{s.regime.key}. {s.regime.title}")
        ax.set_xlabel("wall-clock (s)")
        ax.set_ylabel("return (20-episode mean)")
        ax.legend()

    stale, axes = new_figure(ncols=len(summaries), width=3.5, height=3.0)
    axes = np.ravel(axes)
    for ax, s in zip(axes, summaries):
        counts = sum((r.staleness_counts for r in s.runs if r.mode == "async" and r.staleness_counts.size), np.zeros(1))
        ax.bar(np.arange(counts.size), counts / max(counts.sum(), 1), color="tab:blue")
        ax.set_title(f"{s.regime.key}. async staleness (mean {s.staleness_mean:.2f})")
        ax.set_xlabel("versions behind the learner")
        ax.set_ylabel("fraction of samples")
    return fig, curves, stale


def run_regimes(keys: list[str], args: Args) -> list[Summary]:
    """Runs both modes per seed, interleaving regimes and mode orders; each round starts by
    measuring every regime's stage times again (the bound uses their medians over rounds)."""
    regimes = [REGIMES[k] for k in keys]
    stages: dict[str, list[StageTimes]] = {r.key: [] for r in regimes}
    runs: dict[str, list[Run]] = {r.key: [] for r in regimes}
    for round_index, seed in enumerate(args.seeds):
        this_round = {}
        for regime in regimes:
            st = calibrate(regime, args.calibration_s)
            stages[regime.key].append(st)
            this_round[regime.key] = regime
            if regime.learner_to_collect is not None:
                this_round[regime.key] = replace(regime, update_epochs=calibrate_epochs(regime, st, args))
            print(
                f"[{regime.key}] stages: policy {st.policy_a_s * 1e3:.1f} + {st.policy_b_s * 1e3:.2f}·B ms "
                f"(server {st.policy_capacity_per_s:.0f} req/s), env E[L] {st.env_mean_s * 1e3:.1f} ms, "
                f"E[max of {regime.num_envs}] {st.env_max_s * 1e3:.1f} ms, "
                f"{this_round[regime.key].update_epochs} epochs per update ({machine_line()})",
                flush=True,
            )
        for regime_index, regime in enumerate(regimes):
            modes = ("sync", "async") if (round_index + regime_index) % 2 == 0 else ("async", "sync")
            regime = this_round[regime.key]
            for mode in modes:
                run = run_once(regime, mode, seed, args)
                runs[regime.key].append(run)
                reached = run.result.reached_target_s
                print(
                    f"[{regime.key}] seed {seed} {mode:>5}: {run.steady_steps_per_s:6.0f} steps/s, "
                    f"{run.result.global_step} steps, return {run.result.final_return:.0f}, "
                    f"{'target at %.0f s' % reached if reached is not None else 'target not reached'}, "
                    f"update {np.median(run.update_s) * 1e3:.0f} ms, staleness {run.result.staleness_mean:.2f} "
                    f"({run.result.dropped_samples} samples dropped), {run.cores_used:.2f} cores "
                    f"({machine_line()})",
                    flush=True,
                )
    return [summarize(r, median_stages(stages[r.key]), runs[r.key]) for r in regimes]


def median_stages(measured: list[StageTimes]) -> StageTimes:
    """Field-wise median of the stage times measured in each round."""
    return StageTimes(
        *(
            statistics.median(getattr(m, name) for m in measured)
            for name in ("policy_a_s", "policy_b_s", "policy_capacity_per_s", "env_mean_s", "env_max_s")
        )
    )


def main(args: Args) -> list[Summary]:
    if args.quick:
        args = replace(args, seeds=args.seeds[:1], total_timesteps=args.total_timesteps or 2048, calibration_s=0.5)
    unknown = set(args.regimes) - set(REGIMES) - {"d"}
    if unknown:
        raise SystemExit(f"unknown regimes {sorted(unknown)}; choose from a, b, c, d")
    print(f"Machine: {machine_line()}", flush=True)
    if args.diagnose:
        table = diagnose([k for k in args.regimes if k in REGIMES], args)
        print(f"\nMachine: {machine_line()}\n\n{table}")
        command = "python benchmarks/pipeline.py " + " ".join(sys.argv[1:])
        save_report("pipeline_collector", table, out_dir=args.out_dir, command=command.strip())
        return []
    summaries = run_regimes([k for k in args.regimes if k in REGIMES], args)
    if summaries:  # saved before regime d starts, so that a failure there loses nothing
        report(summaries, None, args)
    if "d" in args.regimes:
        report(summaries, llm_regime(args), args)
    return summaries


def report(summaries: list[Summary], llm: dict[str, Any] | None, args: Args) -> None:
    """Prints the tables and writes ``pipeline.md`` (with, for regimes a b c, its PNGs)."""
    main_table, stage_table = tables(summaries, llm)
    command = "python benchmarks/pipeline.py " + " ".join(sys.argv[1:])
    print(f"\nMachine: {machine_line()}\n\n{main_table}\n\nStage times and the model:\n\n{stage_table}")
    notes = (
        "ratio: median over seeds of async/sync steady env-steps/s (d: of the median completions/s); bound: S/A of "
        "the stage times (docs/benchmarks.md; d: pipeline_llm.llm_bound, its stages in pipeline_llm.md); time ratio: "
        "median over seeds of sync/async wall-clock to the target.\n\n"
        "Stage times and the model (a b c):\n\n" + stage_table
    )
    throughput = None
    if summaries:
        throughput, curves, staleness = figures(summaries)
        save_figure("pipeline_curves", curves, out_dir=args.out_dir)
        save_figure("pipeline_staleness", staleness, out_dir=args.out_dir)
    save_report("pipeline", main_table, throughput, out_dir=args.out_dir, command=command.strip(), notes=notes)


if __name__ == "__main__":
    main(tyro.cli(Args))
