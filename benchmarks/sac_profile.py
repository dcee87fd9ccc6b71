"""Where SAC's time goes, sync vs async, against the bound that the measured stage times allow.

First each stage is timed alone on this machine: one vector env step, one batched policy call,
one gradient step (CleanRL's SAC update: critic, and every ``policy_frequency`` steps the actor
and alpha), one weight publication. From them, per env step (``N`` envs, ``utd`` gradient steps
per env step):

    sync  = N / (t_policy + t_env + N * utd * t_grad)         (act, then learn, in turn)
    bound = N / max(t_policy + t_env, N * utd * t_grad)        (acting fully hidden behind learning)

Then both modes run end to end, interleaved over ``--rounds``, and report env-steps/s after
``learning_starts``, the ratio to the bound, and how long a gradient step took inside the run
(longer than alone: the collector thread, the batcher thread and the learner share the GIL and
the cores). Regimes: the env as it is, and the env behind a sleeping ``--slow-env-ms`` latency
(a real robot or a remote simulator), where acting costs as much as learning and overlap pays.

Run (about 10 minutes on 2 idle cores; HalfCheetah-v5 needs ``pip install -e ".[mujoco]"``,
otherwise ``--env Pendulum-v1``):
    python benchmarks/sac_profile.py
    python benchmarks/sac_profile.py --env Pendulum-v1 --total-timesteps 2500 --rounds 1
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncvec.agents import sac  # noqa: E402  (after the repository is put on sys.path)
from asyncvec.agents.common import final_observations  # noqa: E402  after the repository is put on sys.path
from asyncvec.benchmarks.report import machine_line, markdown_table, new_figure, save_report  # noqa: E402  (after the repository is put on sys.path)
from asyncvec.buffers import Transitions  # noqa: E402  (after the repository is put on sys.path)


@dataclass
class Args:
    env: str = "HalfCheetah-v5"
    """gymnasium env id with a Box action space"""
    total_timesteps: int = 4_000
    """env steps per run (the rate is measured after learning_starts)"""
    learning_starts: int = 1_000
    """env steps of random-ish acting before the first gradient step"""
    num_envs: int = 2
    """envs (worker processes)"""
    utd: float = 1.0
    """gradient steps per env step"""
    hidden: int = 256
    """width of SAC's hidden layers (CleanRL: 256)"""
    slow_env_ms: float = 20.0
    """the second regime's env latency (sleeping), in ms"""
    rounds: int = 2
    """rounds of (sync, async) per regime, interleaved; medians are reported"""
    name: str = "sac_profile"
    """report name (benchmarks/results/<name>.md and .png)"""
    out_dir: str | None = None
    """where the report goes (default benchmarks/results)"""


def sac_args(args: Args, mode: str, env_latency_ms: float, total: int) -> sac.Args:
    return sac.Args(
        env=args.env,
        track=False,  # timed: no TensorBoard files
        mode=mode,
        num_envs=args.num_envs,
        utd=args.utd,
        hidden=args.hidden,
        total_timesteps=total,
        learning_starts=args.learning_starts,
        env_latency_ms=env_latency_ms,
        progress=False,
        seed=1,
    )


def stage_times(args: Args, env_latency_ms: float) -> dict[str, float]:
    """Median seconds of one vector env step, one batched policy call, one gradient step, one publication."""
    agent = sac.SAC(sac_args(args, "sync", env_latency_ms, args.learning_starts))
    ids = np.arange(args.num_envs)
    policy_s, env_s, grad_s, publish_s = [], [], [], []
    try:
        obs, _ = agent.envs.reset(seed=1)
        episode_ids = ids.copy()
        while agent.global_step < args.learning_starts:
            start = time.perf_counter()
            outputs = agent.policy.act(obs, env_ids=ids, timeout=60)
            policy_s.append(time.perf_counter() - start)
            actions = np.stack([o.action for o in outputs])
            start = time.perf_counter()
            next_obs, rewards, terminated, truncated, info = agent.envs.step(
                np.clip(actions, agent.action_space.low, agent.action_space.high)
            )
            env_s.append(time.perf_counter() - start)
            done = terminated | truncated
            agent.store(
                Transitions(
                    env_id=ids,
                    obs=obs,
                    action=actions,
                    reward=rewards,
                    next_obs=final_observations(next_obs, done, info),
                    terminated=terminated,
                    truncated=truncated,
                    behavior_logp=np.array([o.behavior_logp for o in outputs], np.float32),
                    policy_version=np.array([o.policy_version for o in outputs]),
                    fallback=np.zeros(args.num_envs, bool),
                    episode_id=episode_ids.copy(),
                )
            )
            episode_ids[done] = episode_ids.max() + 1 + np.arange(done.sum())
            obs = next_obs
        for _ in range(200):
            start = time.perf_counter()
            agent.gradient_step()
            grad_s.append(time.perf_counter() - start)
        weights = {k: v.detach().clone() for k, v in agent.actor.state_dict().items()}
        for _ in range(50):
            start = time.perf_counter()
            agent.versions.publish({k: v.clone() for k, v in weights.items()})
            publish_s.append(time.perf_counter() - start)
    finally:
        agent.policy.close()
        agent.envs.close()
        agent.versions.close()
    return {
        "policy": float(np.median(policy_s)),
        "env": float(np.median(env_s)),
        "grad": float(np.median(grad_s)),
        "publish": float(np.median(publish_s)),
    }


def run(args: Args, mode: str, env_latency_ms: float) -> dict[str, float]:
    result = sac.SAC(sac_args(args, mode, env_latency_ms, args.total_timesteps)).train()
    after = [
        (row["global_step"], row["time/wall_s"]) for row in result.history if row["global_step"] >= args.learning_starts
    ]
    (s0, t0), (s1, t1) = after[0], after[-1]
    grad_s = result.stage_seconds.get("update", float("nan")) / max(result.gradient_steps, 1)  # SAC's own stage clock
    return {"steps_per_s": (s1 - s0) / (t1 - t0), "grad_ms": 1000 * grad_s}


def main(args: Args) -> list[list]:
    print(
        f"SAC on {args.env}: {args.num_envs} envs, utd {args.utd}, hidden {args.hidden}; {machine_line()}", flush=True
    )
    rows, plot_rows = [], []
    for regime, latency in (("env as is", 0.0), (f"env +{args.slow_env_ms:g} ms", args.slow_env_ms)):
        t = stage_times(args, latency)
        n, grad_per_vector_step = args.num_envs, args.num_envs * args.utd * t["grad"]
        sync_model = n / (t["policy"] + t["env"] + grad_per_vector_step)
        bound = n / max(t["policy"] + t["env"], grad_per_vector_step)
        print(
            f"{regime}: env step {1000 * t['env']:.2f} ms, policy call {1000 * t['policy']:.2f} ms, gradient step "
            f"{1000 * t['grad']:.2f} ms, publish {1000 * t['publish']:.3f} ms -> sync model {sync_model:.0f}, "
            f"async bound {bound:.0f} env-steps/s",
            flush=True,
        )
        measured: dict[str, list[dict]] = {"sync": [], "async": []}
        for _ in range(args.rounds):
            for mode in ("sync", "async"):
                measured[mode].append(run(args, mode, latency))
                print(
                    f"  {mode}: {measured[mode][-1]['steps_per_s']:.1f} env-steps/s, gradient step "
                    f"{measured[mode][-1]['grad_ms']:.2f} ms in the run",
                    flush=True,
                )
        medians = {mode: {k: float(np.median([m[k] for m in ms])) for k in ms[0]} for mode, ms in measured.items()}
        for mode in ("sync", "async"):
            m = medians[mode]
            rows.append(
                [
                    regime,
                    mode,
                    1000 * t["env"],
                    1000 * t["policy"],
                    1000 * t["grad"],
                    m["grad_ms"],
                    m["steps_per_s"],
                    sync_model if mode == "sync" else bound,
                    m["steps_per_s"] / (sync_model if mode == "sync" else bound),
                    m["steps_per_s"] / medians["sync"]["steps_per_s"],
                ]
            )
        plot_rows.append((regime, medians["sync"]["steps_per_s"], medians["async"]["steps_per_s"], sync_model, bound))
    headers = [
        "regime",
        "mode",
        "env step (ms)",
        "policy call (ms)",
        "gradient step alone (ms)",
        "gradient step in run (ms)",
        "env-steps/s",
        "model / bound",
        "ratio to it",
        "vs sync",
    ]
    table = markdown_table(headers, rows)
    print(f"\n{table}\n\n{machine_line()}")
    fig, ax = new_figure()
    x = np.arange(len(plot_rows))
    ax.bar(x - 0.2, [r[1] for r in plot_rows], 0.4, label="sync (measured)")
    ax.bar(x + 0.2, [r[2] for r in plot_rows], 0.4, label="async (measured)")
    ax.scatter(x - 0.2, [r[3] for r in plot_rows], color="k", marker="_", s=400, label="sync model")
    ax.scatter(x + 0.2, [r[4] for r in plot_rows], color="r", marker="_", s=400, label="async bound")
    ax.set_xticks(x, [r[0] for r in plot_rows])
    ax.set_ylabel("env-steps/s after learning starts")
    ax.set_title(f"SAC {args.env}, {args.num_envs} envs, utd {args.utd:g}")
    ax.legend(fontsize=8)
    command = "python benchmarks/sac_profile.py " + " ".join(sys.argv[1:])
    for path in save_report(args.name, table, fig, out_dir=args.out_dir, command=command.strip()):
        print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main(tyro.cli(Args))
