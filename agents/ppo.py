"""PPO that learns while its envs keep acting with a slightly older policy.

Run:   python agents/ppo.py --env CartPole-v1 --mode async --total-timesteps 100000
Installed: asyncvec-ppo (or python -m asyncvec.agents.ppo) with the same options
Import: from asyncvec.agents.ppo import PPO, Args; result = PPO(Args(env="CartPole-v1")).train()

``--mode sync`` is the classic loop (CleanRL): step all envs in lockstep with one batched policy
call per step, then learn, then act again. ``--mode async`` acts in a process of its own beside the
learner (`ProcessCollector`): at ``--max-staleness 1`` (the default) segment k+1 is acted by the
version published after update k-1 while update k trains, every sample one version old by
construction, whatever the speeds; ``0`` is the sync run, bitwise. Above 1 the acting process
submits each env's observation as soon as it is ready (partial batches) and loads each publish as it
comes. Every sample carries the policy version that chose it.

Off-policy corrections (``--correction``), with ``mu`` the behavior policy that acted,
``pi_prox`` the learner's policy at the start of the update and ``pi`` the one being trained:

* ``none``: PPO with ``mu`` as the old policy, ``r = pi/mu`` (staleness ignored).
* ``tis``: as ``none``, but the ratio is truncated, ``min(r, C) A`` in place of ``r A``,
  so a stale sample cannot blow up the surrogate (``C = --is-cap``, 2); it stays stable under
  large lags (docs/agents.md has the measurement).
* ``vtrace``: V-trace value targets and policy-gradient advantages (IMPALA, with
  ``rho = min(1, pi_prox/mu)``), PPO clipped against ``pi_prox``.
* ``decoupled``: GAE advantages, Hilton et al.'s decoupled PPO loss, clipped against
  ``pi_prox`` and weighted by ``pi_prox/mu`` (truncated at ``--is-cap`` when given).
* ``auto`` (default): ``decoupled`` for Box actions at async ``--max-staleness 1``, ``tis`` otherwise
  (:func:`chosen_correction` has the rule and why).

Samples older than ``--max-staleness`` versions are masked out of the loss (and counted), and so
are deadline fallbacks. Time-limit truncations bootstrap from the final observation. Settings
One default for every env (chosen on a wide suite, docs/agents.md); ``--preset`` opts into named settings.
"""

from __future__ import annotations

import copy
import functools
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn

from asyncvec import RolloutStore, VersionManager
from asyncvec.agents.common import (
    NOT_REPLAYED,
    EnvAgentArgs,
    anneal,
    collector_charts,
    env_spaces,
    final_observations,
    make_policy,
    make_ray_collector,
    parse_cli,
    ray_collectors_for,
    registered_spec,
    run_from_cli,
    stored_action_space,
    vector_env_factory,
)
from asyncvec.agents.ppo_networks import Actor, Critic
from asyncvec.agents.ppo_settings import PRESETS, chosen_correction, corrected_policy_loss
from asyncvec.agents.summaries import final_return_text, restarts_text, run_steps_text
from asyncvec.buffers import policy_columns
from asyncvec.collection import next_segment
from asyncvec.collection.process import ProcessCollector
from asyncvec.losses import gae, truncated_importance_weights, vtrace
from asyncvec.metrics import EpisodeStats, StageClock
from asyncvec.normalization import RewardScaler
from asyncvec.runs import EnvStepsRun, check_resumable, load_checkpoint, rng_state, run_name, seed_everything
from asyncvec.schedule import ScheduleError, ScheduleWriter, read_schedule
from asyncvec.versioning import adapt_max_staleness, with_lag


@dataclass
class Args(EnvAgentArgs):
    """PPO's options: those every env agent has (asyncvec.agents.common.EnvAgentArgs), then its own."""

    max_staleness: int = 1
    """async: 0 or 1, the envs step together and each segment is acted by a version fixed by construction (0:
    the last update's, the sync run bitwise; 1: the one before, while the learner trains the segment before);
    above 1, the envs step freely (partial batches, in the acting process too) and samples older than this are
    masked out (asyncvec docs agents)"""
    adaptive_staleness: bool = False
    """lower max_staleness while the importance weights of recent updates degenerate, raise it back
    (up to --max-staleness) while they are healthy (rule: asyncvec.versioning.adapt_max_staleness)"""
    correction: Literal["auto", "none", "tis", "vtrace", "decoupled"] = "auto"
    """off-policy correction for stale samples (see the module docstring); auto: decoupled for a Box action space
    at async --max-staleness 1, tis otherwise (the rule measured on a suite of tasks: asyncvec docs agents)"""
    is_cap: float | None = None
    """truncation C of the importance weights (tis: pi/mu; decoupled: pi_prox/mu); None: 2 for tis and vtrace's
    statistics, no truncation for decoupled"""
    policy_lag: int = 0
    """actors receive each new version this many updates late (a slow weight broadcast)"""
    preset: Literal["none", "cleanrl", "cleanrl-continuous"] = "none"
    """opt-in named settings (PRESETS): they replace the algorithm fields left at their defaults"""
    # Algorithm: one default for every env, chosen on benchmarks/defaults.py's suite (docs/agents.md).
    num_steps: int = 32
    """steps per env per rollout segment (the batch is num_envs * num_steps)"""
    learning_rate: float = 1e-3
    """Adam learning rate (annealed linearly to 0)"""
    anneal_lr: bool = True
    """anneal the learning rate and the clip coefficient"""
    gamma: float = 0.98
    """discount"""
    gae_lambda: float = 0.8
    """GAE lambda"""
    num_minibatches: int = 1
    """minibatches per epoch"""
    update_epochs: int = 20
    """epochs per update (at most: --target-kl may stop earlier)"""
    target_kl: float | None = 0.03
    """stop an update's epochs once the approximate KL between the policy being trained and the policy at
    the start of the update exceeds this (CleanRL's rule; None: always run every epoch)"""
    clip_coef: float = 0.2
    """PPO clip coefficient"""
    clip_vloss: bool = False
    """clip the value loss around the values at the start of the update (CleanRL's clip_vloss)"""
    ent_coef: float = 0.0
    """entropy bonus"""
    normalize_obs: bool = True
    """normalize observations by running mean and variance (clipped to +-10), kept in the actor and sent to the
    envs' policy with every version (the learner updates them from each segment it trains on)"""
    normalize_rewards: bool = True
    """scale rewards by the running standard deviation of the discounted return (clipped to +-10), in the
    learner: logged returns stay raw"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: float = 0.5
    """gradient clipping"""
    hidden: int = 64
    """width of the two hidden layers"""

    def __post_init__(self) -> None:
        if self.preset != "none":
            defaults = {f.name: f.default for f in fields(Args)}
            for name, value in PRESETS[self.preset].items():
                if getattr(self, name) == defaults[name]:
                    setattr(self, name, value)
        super().__post_init__()
        for name in ("num_steps", "update_epochs", "num_minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.policy_lag > self.max_staleness:
            raise ValueError(
                f"--policy-lag {self.policy_lag} exceeds --max-staleness {self.max_staleness}: every sample "
                f"would be too stale to learn from"
            )
        if self.is_cap is not None and self.is_cap <= 0:
            raise ValueError(f"--is-cap must be > 0, got {self.is_cap}")
        if self.target_kl is not None and self.target_kl <= 0:
            raise ValueError(f"--target-kl must be > 0 (or None), got {self.target_kl}")


@dataclass
class TrainResult:
    """What ``train`` returns: returns, speed and staleness of the run."""

    global_step: int
    updates: int
    wall_time_s: float
    env_steps_per_s: float
    episodic_returns: list[float]
    final_return: float
    reached_target_s: float | None
    staleness_mean: float
    dropped_samples: int
    history: list[dict] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """wall seconds of the run per stage of the loop: collect_wait (the learner waiting for a segment:
    acting, in sync mode), update, publish; in sync mode also policy_call and env_step, the two parts
    of acting (inside collect_wait)"""
    staleness_histogram: list[int] = field(default_factory=list)
    """``staleness_histogram[s]``: samples learned from at staleness ``s`` (the last bin counts the
    older ones; asyncvec.versioning.StalenessStats)"""
    resumed_at_step: int = 0  # where a --resume went on from; wall_time_s and env_steps_per_s cover the rest
    env_restarts: list[int] = field(default_factory=list)  # per env, with --max-restarts
    log_path: str | None = None
    """the run's TensorBoard folder (None with ``track=False``)"""
    checkpoint_path: str | None = None
    """the checkpoint file (None without ``checkpoint_dir``)"""


class PPO(EnvStepsRun):
    """Proximal Policy Optimization over an AsyncLLMVectorEnv, sync or async (see module doc)."""

    def __init__(self, args: Args) -> None:
        self.args = args
        seed_everything(args.seed)
        torch.set_num_threads(args.torch_threads)
        self.replay = (
            list(read_schedule(args.replay, "ppo", args, NOT_REPLAYED)) if args.replay else None
        )  # (read through now)
        if self.replay and [r.version for r in self.replay] != list(range(len(self.replay))):
            raise ScheduleError(f"--replay {args.replay}: the updates' versions are not 0, 1, 2...: not from the start")
        # The spaces first, from one env here: a clear error before any worker starts.
        obs_space, self.action_space = env_spaces(args.env, args.env_kwargs_dict())
        flat_box = isinstance(obs_space, gym.spaces.Box) and len(obs_space.shape) == 1
        if isinstance(obs_space, gym.spaces.Text) or isinstance(self.action_space, gym.spaces.Text):
            raise ValueError(
                f"{args.env} is a text env (Text observations or actions), which PPO's MLP cannot take: train a "
                f"language model on it with RLOO, REINFORCE++ or GRPO: asyncvec-rloo --env {args.env} (or -reinforce-pp, -grpo)"
            )
        if not flat_box or not isinstance(self.action_space, (gym.spaces.Discrete, gym.spaces.Box)):
            raise ValueError(
                f"PPO needs a flat Box observation space and a Discrete or Box action space; {args.env} has "
                f"observation space {obs_space} and action space {self.action_space}"
            )
        self.correction, self.is_cap = chosen_correction(
            args.correction, args.is_cap, args.mode, args.max_staleness, self.action_space
        )
        # async at --max-staleness 0 or 1: acting runs in a process of its own (ProcessCollector, which builds the
        # envs there), the envs step together, and each segment is acted by a version fixed by construction
        self.lockstep = args.mode == "async" and args.backend == "local" and args.max_staleness <= 1 and not args.replay
        # above 1 it runs there too, with partial batches: the learner's update never shares an interpreter with acting
        self.acting_process = args.mode == "async" and args.backend == "local" and not args.replay
        self.make_envs = vector_env_factory(
            args, batch_size=max(1, args.num_envs // 4) if args.mode == "async" and not self.lockstep else None
        )
        if args.backend == "ray":
            self.envs = ray_collectors_for(args)
        else:
            self.envs = self.make_envs() if not self.acting_process else None
        obs_dim = obs_space.shape[0]
        self.actor = Actor(obs_dim, self.action_space, args.hidden, normalize_obs=args.normalize_obs)
        self.critic = Critic(obs_dim, args.hidden, obs_norm=self.actor.obs_norm)
        self.optimizer = torch.optim.Adam(
            [*self.actor.parameters(), *self.critic.parameters()], lr=args.learning_rate, eps=1e-5
        )
        self.reward_scaler = RewardScaler(args.num_envs, args.gamma) if args.normalize_rewards else None
        self.policy = (
            make_policy(  # (in sync mode; the acting process's is built there, from the actor of then)
                copy.deepcopy(self.actor), self.action_space, args.num_envs, args.policy_latency_ms, args.mode == "sync"
            )
            if not self.acting_process
            else None
        )
        self.learner_rng = torch.Generator().manual_seed(args.seed)  # minibatch order: the acting threads never draw
        self.max_staleness = args.max_staleness  # lowered and raised by --adaptive-staleness
        self.versions = VersionManager(max_lag=args.max_staleness)
        self.stages = StageClock()  # wall and CPU seconds per stage of the loop (train starts a fresh one)
        if self.policy is not None:
            self.versions.register(with_lag(self.policy, args.policy_lag))
        self.store = RolloutStore(args.num_steps, args.num_envs, obs_space, stored_action_space(self.action_space))
        self.global_step = 0
        self.updates = 0
        self.prior_returns: list[float] = []  # after --resume: the checkpoint's recent episode returns
        self._recent_returns: list[float] = []
        self.run_name = run_name(args.env, "ppo", "replay" if args.replay else args.mode, args.seed)
        self.checkpoint_path = Path(args.checkpoint_dir) / "ppo.pt" if args.checkpoint_dir else None
        if args.resume:
            try:
                self._resume()
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ checkpoints

    def _resume(self) -> None:
        if self.checkpoint_path is None:
            raise ValueError("--resume needs --checkpoint-dir DIR, the folder of the checkpoint to continue from")
        state = load_checkpoint(self.checkpoint_path)
        check_resumable(
            state, self.checkpoint_path, env=self.args.env, env_kwargs=self.args.env_kwargs, num_envs=self.args.num_envs
        )
        self.run_name = state.get("run_name", self.run_name)
        self.prior_returns = list(state.get("recent_returns", []))
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "learner_rng" in state:
            self.learner_rng.set_state(state["learner_rng"])
        self.global_step, self.updates = state["global_step"], state["updates"]
        if self.reward_scaler is not None and state.get("reward_scaler") is not None:
            self.reward_scaler.load_state_dict(state["reward_scaler"])
        # Bring the version counter and the actors' weights to the checkpoint's version, in one publish.
        if self.versions.current_version < state["version"]:
            self.versions.publish(self._actor_weights(), version=state["version"])

    def save(self) -> None:
        if self.checkpoint_path is not None:
            self.write_checkpoint(
                actor=self.actor.state_dict(),
                critic=self.critic.state_dict(),
                optimizer=self.optimizer.state_dict(),
                version=self.versions.current_version,
                global_step=self.global_step,
                updates=self.updates,
                reward_scaler=self.reward_scaler.state_dict() if self.reward_scaler is not None else None,
                args=asdict(self.args),
                run_name=self.run_name,
                recent_returns=self._recent_returns[-100:],
                learner_rng=self.learner_rng.get_state(),
            )

    def start_collector(self) -> Any:
        """Async mode: starts acting beside the learner and returns the collector (None in sync mode or --replay):
        a `ProcessCollector` (acting in a process of its own): at --max-staleness 0 or 1 lockstep, a version fixed by
        construction per segment, above it with partial batches and the max-lag gate; on Ray, collector actors."""
        args = self.args
        if args.mode == "async" and args.backend == "ray":
            return make_ray_collector(
                self.envs, self.actor, self.store, self.versions,
                policy_latency_ms=args.policy_latency_ms, policy_lag=args.policy_lag, seed=args.seed,
            ).start()  # fmt: skip
        if self.acting_process:
            policy = functools.partial(  # built in the acting process, from the actor as it is now
                make_policy,
                copy.deepcopy(self.actor),
                self.action_space,
                args.num_envs,
                args.policy_latency_ms,
                self.lockstep,
            )
            shapes = (args.num_steps, args.num_envs, self.store.observation_space, self.store.action_space)
            return ProcessCollector(
                self.make_envs, policy, self._actor_weights(), *shapes, self.versions, args.max_staleness, args.seed,
                env_specs=registered_spec(args.env), random_state=rng_state(),
                partial_batches=not self.lockstep, policy_lag=0 if self.lockstep else args.policy_lag,
            ).start()  # fmt: skip
        return None

    def _actor_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.actor.state_dict().items()}

    # ------------------------------------------------------------------ learning

    def advantages_and_returns(
        self, segment, values: torch.Tensor, prox_logp: torch.Tensor, rewards: np.ndarray | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """GAE (or V-trace) advantages and value targets of a ``[T, N]`` segment, detached.

        ``rewards`` replaces ``segment.reward`` (the scaled rewards of ``--normalize-rewards``).
        An episode that ended by ``terminated`` has no future value; one cut off by a time limit
        (``truncated``) bootstraps from the value of its final observation, ``segment.next_obs[t]``.
        """
        args = self.args
        rewards = torch.as_tensor(segment.reward if rewards is None else rewards)
        terminated = torch.as_tensor(segment.terminated)
        truncated = torch.as_tensor(segment.truncated) & ~terminated
        with torch.no_grad():
            bootstrap = self.critic(torch.as_tensor(segment.last_obs, dtype=torch.float32))
            final_values = torch.zeros_like(values)
            if truncated.any():
                final_values[truncated] = self.critic(torch.as_tensor(segment.next_obs, dtype=torch.float32)[truncated])
            if self.correction == "vtrace":
                # The trace stops at every episode end; a truncated step's reward carries gamma V(final obs).
                discounts = args.gamma * (~(terminated | truncated)).float()
                targets = vtrace(
                    torch.as_tensor(segment.behavior_logp),
                    prox_logp,
                    rewards + args.gamma * final_values,
                    values,
                    bootstrap,
                    discounts,
                )
                return targets.pg_advantages, targets.vs
            return gae(
                rewards,
                values,
                bootstrap,
                terminated,
                truncated,
                gamma=args.gamma,
                lam=args.gae_lambda,
                final_values=final_values,
            )

    def update(self, segment) -> dict[str, float]:
        """One PPO update on a [T, N] segment; returns loss and correction statistics."""
        args = self.args
        T, N = segment.reward.shape
        obs = torch.as_tensor(segment.obs, dtype=torch.float32)
        actions = torch.as_tensor(segment.action)
        behavior_logp = torch.as_tensor(segment.behavior_logp)
        staleness = torch.as_tensor(segment.staleness(self.versions.current_version))
        no_fallbacks = segment.fallback is None
        fallback = torch.zeros_like(staleness, dtype=torch.bool) if no_fallbacks else torch.as_tensor(segment.fallback)
        fresh = staleness <= self.max_staleness
        # Deadline fallbacks were not sampled from the policy: no loss term learns from them.
        valid = fresh & ~fallback
        self.versions.record_staleness(staleness[~fallback].tolist())
        if (~fresh).any():
            self.versions.record_dropped(int((~fresh).sum()))

        # Guards that need no per-task setting: observation statistics (used by the actors from the next
        # version on) and reward scale follow the data; the epochs stop early on a large policy change.
        self.actor.obs_norm.update(obs[valid])
        rewards = segment.reward
        if self.reward_scaler is not None:
            rewards = self.reward_scaler(segment.reward, segment.terminated | segment.truncated)
        with torch.no_grad():
            values = self.critic(obs)
            prox_logp, _ = self.actor.log_prob_entropy(obs, actions)
            advantages, returns = self.advantages_and_returns(segment, values, prox_logp, rewards)
            # How off-policy the data is, whatever the correction: weights pi_prox/mu on the valid samples.
            _, offpolicy = truncated_importance_weights(prox_logp, behavior_logp, self.is_cap, mask=valid)

        b = {
            "obs": obs.reshape(T * N, -1),
            "actions": actions.reshape(T * N, *actions.shape[2:]),
            "behavior_logp": behavior_logp.reshape(-1),
            "prox_logp": prox_logp.reshape(-1),
            "values": values.reshape(-1),
            "advantages": advantages.reshape(-1),
            "returns": returns.reshape(-1),
            "valid": valid.reshape(-1),
        }
        frac = 1.0 - (self.global_step - T * N) / args.total_timesteps if args.anneal_lr else 1.0  # as CleanRL's
        clip = anneal(self.optimizer, args.learning_rate, args.clip_coef, frac)
        batch_size = T * N
        minibatch = max(1, batch_size // args.num_minibatches)
        stats: dict[str, list[float]] = {}
        epochs, stopped_early = 0, False
        for _ in range(args.update_epochs):
            order = torch.randperm(batch_size, generator=self.learner_rng)
            for start in range(0, batch_size, minibatch):
                idx = order[start : start + minibatch]
                mask = b["valid"][idx]
                if not mask.any():
                    continue
                logp, entropy = self.actor.log_prob_entropy(b["obs"][idx], b["actions"][idx])
                with torch.no_grad():  # k3 estimator of KL(pi_prox || pi), as CleanRL's approx_kl
                    log_ratio = (logp - b["prox_logp"][idx])[mask]
                    approx_kl = float((log_ratio.exp() - 1 - log_ratio).mean())
                if args.target_kl is not None and approx_kl > args.target_kl:
                    stopped_early = True
                    break
                adv = b["advantages"][idx]
                adv = (adv - adv[mask].mean()) / (adv[mask].std() + 1e-8) if mask.sum() > 1 else adv
                pg_loss, pg_stats = corrected_policy_loss(
                    self.correction, self.is_cap, logp, b["prox_logp"][idx], b["behavior_logp"][idx], adv, clip, mask
                )
                value = self.critic(b["obs"][idx])
                v_error = (value - b["returns"][idx]) ** 2
                if args.clip_vloss:
                    clipped = b["values"][idx] + (value - b["values"][idx]).clamp(-clip, clip)
                    v_error = torch.max(v_error, (clipped - b["returns"][idx]) ** 2)
                v_loss = 0.5 * v_error[mask].mean()
                ent = entropy[mask].mean()
                loss = pg_loss - args.ent_coef * ent + args.vf_coef * v_loss
                self.optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_([*self.actor.parameters(), *self.critic.parameters()], args.max_grad_norm)
                self.optimizer.step()
                for key, value in {
                    "policy_loss": pg_loss,
                    "value_loss": v_loss,
                    "entropy": ent,
                    "approx_kl": approx_kl,
                    **pg_stats,
                }.items():
                    stats.setdefault(key, []).append(float(value.detach()) if torch.is_tensor(value) else float(value))
            if stopped_early:
                break
            epochs += 1
        self.updates += 1
        out = {f"losses/{k}": float(np.mean(v)) for k, v in stats.items()}
        out["losses/epochs"] = float(epochs)
        out["staleness/mean"] = float(staleness.float().mean())
        out["staleness/max"] = float(staleness.max())
        out["staleness/dropped_fraction"] = float((~fresh).float().mean())
        out["staleness/fallback_fraction"] = float(fallback.float().mean())
        out["staleness/behavior_ess"] = float(offpolicy["ess"])
        out["staleness/behavior_clipped_fraction"] = float(offpolicy["clipped_fraction"])
        if args.adaptive_staleness and valid.any():
            self.max_staleness = adapt_max_staleness(
                self.max_staleness,
                ess=out["staleness/behavior_ess"],
                clipped_fraction=out["staleness/behavior_clipped_fraction"],
                floor=min(args.policy_lag + 1, args.max_staleness),
                ceiling=args.max_staleness,
            )
            self.versions.max_lag = self.max_staleness
        out["staleness/max_staleness"] = float(self.max_staleness)
        return out

    # ------------------------------------------------------------------ acting

    def _sync_segment(self, episodes: EpisodeStats, obs: np.ndarray) -> np.ndarray:
        """Acts T lockstep steps with one batched policy call each; fills the store."""
        ids = np.arange(self.args.num_envs)
        for _ in range(self.args.num_steps):
            with self.stages("policy_call"):
                outputs = self.policy.act(obs, env_ids=ids, timeout=60)
            actions = np.stack([np.asarray(o.action) for o in outputs])
            executed = (
                np.clip(actions, self.action_space.low, self.action_space.high)
                if isinstance(self.action_space, gym.spaces.Box)
                else actions
            )
            with self.stages("env_step"):
                next_obs, rewards, terminated, truncated, info = self.envs.step(executed)
            done = terminated | truncated
            final = final_observations(next_obs, done, info)
            self.store.add(obs, actions, rewards, final, terminated, truncated, env_id=ids, **policy_columns(outputs))
            episodes.update(ids, rewards, done)
            obs = next_obs
        return obs

    def train(self) -> TrainResult:
        """Trains until ``total_timesteps`` (or ``target_return``); closes envs and policy."""
        args = self.args
        # first: the acting process may be a fork of this one, started before it runs threads (TensorBoard's writer)
        collector = self.start_collector()
        try:
            logger = self.run_logger()
        except BaseException:
            if collector is not None:
                collector.stop()
            raise
        history: list[dict] = []
        reached_at = None
        stages = self.stages = StageClock()
        start = time.monotonic()
        start_step = self.global_step  # after --resume: steps/s counts this run's steps only
        episodes = EpisodeStats(args.num_envs)
        self._recent_returns = list(self.prior_returns)
        schedule = ScheduleWriter(self.run_dir / "schedule", "ppo", args) if args.record_schedule else None
        try:
            if collector is None and self.replay is None:
                obs, _ = self.envs.reset(seed=args.seed)
            while self.global_step < args.total_timesteps:
                with stages("collect_wait"):
                    if collector is not None:
                        segment = next_segment(collector if self.acting_process else self.store, collector)
                    elif self.replay is not None:  # the recorded segments, in order, and no more
                        if self.updates == len(self.replay):
                            break
                        segment = self.replay[self.updates].batch
                    else:
                        obs = self._sync_segment(episodes, obs)
                        segment = self.store.get(timeout=0)
                self.global_step += segment.reward.size
                with stages("update"):
                    stats = self.update(segment)
                if args.adaptive_staleness and self.acting_process and not self.lockstep:
                    collector.set_max_lag(self.max_staleness)  # the acting process's gate follows the learner's
                if schedule is not None:  # (after the update: the record holds the complete ones)
                    schedule.write(batch=segment, version=self.versions.current_version, position=self.global_step)
                # (read before the publish, which releases a lockstep collector: the returns of this segment's steps)
                returns = self._recent_returns = self.prior_returns + (
                    collector.recent_returns() if collector is not None else episodes.returns()
                )
                mean20 = float(np.mean(returns[-20:])) if returns else float("nan")
                reached = args.target_return is not None and len(returns) >= 20 and mean20 >= args.target_return
                if self.lockstep and collector is not None and (reached or self.global_step >= args.total_timesteps):
                    collector.stop_soon()  # lag 0 is sync: the publish below releases no step past the run's end
                with stages("publish"):
                    self.versions.publish(self._actor_weights())
                elapsed = time.monotonic() - start
                row = {
                    **stats,
                    "charts/episodic_return": mean20,
                    "charts/env_steps_per_s": (self.global_step - start_step) / elapsed,
                    "charts/version": self.versions.current_version,
                    "time/wall_s": elapsed,
                    "global_step": self.global_step,
                    **stages.scalars(),
                }
                if collector is not None:
                    row.update(collector_charts(collector))
                history.append(row)
                logger.log(row, self.global_step)
                if self.updates % 10 == 0:
                    logger.histogram(
                        "staleness/histogram",
                        segment.staleness(self.versions.current_version).ravel(),
                        self.global_step,
                    )
                    if collector is not None:
                        logger.histogram("charts/policy_latency_ms", collector.latencies() * 1000, self.global_step)
                self.save()
                if reached:
                    reached_at = elapsed
                    break
        finally:
            if collector is not None:
                self.versions.close()  # (ends a lockstep collector's wait for a publish)
                self.store.release_after_interrupt()  # a Ctrl-C inside store.get can leave its lock held
                collector.stop()
                self.acting_placement = getattr(collector, "placement", None)  # (the acting process's envs)
            logger.close()
            self.close()
        wall = time.monotonic() - start
        returns = self.prior_returns + (collector.recent_returns() if collector is not None else episodes.returns())
        staleness = self.versions.staleness_stats()
        return TrainResult(
            global_step=self.global_step,
            updates=self.updates,
            wall_time_s=wall,
            env_steps_per_s=(self.global_step - start_step) / wall,
            resumed_at_step=start_step,
            env_restarts=list(getattr(collector if self.acting_process else self.envs, "restarts", [])),  # (Ray: none)
            episodic_returns=returns,
            final_return=float(np.mean(returns[-20:])) if returns else float("nan"),
            reached_target_s=reached_at,
            staleness_mean=staleness.mean,
            dropped_samples=staleness.dropped,
            history=history,
            stage_seconds=dict(stages.totals),
            staleness_histogram=staleness.histogram,
            log_path=str(self.log_path) if self.log_path is not None else None,
            checkpoint_path=str(self.checkpoint_path) if self.checkpoint_path is not None else None,
        )

    def close(self) -> None:
        """Stops the policy server and the env workers (``train`` does this itself when it ends)."""
        if not self.acting_process:  # (else they live in the acting process, which train stops)
            self.policy.close()
            self.envs.close()
        self.store.close()
        self.versions.close()


def train(args: Args) -> TrainResult:
    """Builds a PPO from ``args``, trains it and returns the result."""
    return PPO(args).train()


def main(args: Args) -> TrainResult | None:
    """The command line: trains, then says where the logs and the checkpoint went (Ctrl-C stops cleanly)."""
    return run_from_cli(
        lambda: PPO(args),
        lambda result: (
            f"PPO {run_steps_text(result.global_step, result.resumed_at_step)} in {result.wall_time_s:.1f} s "
            f"({result.env_steps_per_s:.0f} steps/s), "
            f"{final_return_text(result.final_return, 20)}, mean staleness {result.staleness_mean:.2f}"
            + restarts_text(result.env_restarts, args.max_restarts)
            + (
                f", reached the target after {result.reached_target_s:.1f} s"
                if result.reached_target_s is not None
                else ""
            )
            + f"\ntime: {StageClock.words(result.stage_seconds)}"
        ),
        name="PPO",
        saves="after every update",
    )


def cli() -> None:
    """``asyncvec-ppo``, ``python -m asyncvec.agents.ppo`` or, in a clone, ``python agents/ppo.py``."""
    main(parse_cli(Args))


if __name__ == "__main__":
    cli()
