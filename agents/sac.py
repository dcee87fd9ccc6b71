"""Soft Actor-Critic that learns from version-tagged replay while its envs keep acting.

Run:   python agents/sac.py --env Pendulum-v1 --mode async --total-timesteps 15000
Installed: asyncvec-sac (or python -m asyncvec.agents.sac) with the same options
Import: from asyncvec.agents.sac import SAC, Args; result = SAC(Args()).train()

``--mode sync`` is CleanRL's loop: act on every env, store, take gradient steps, repeat. ``--mode async`` runs a
Collector thread that fills the replay buffer while the learner takes gradient steps, at most one step of every env
ahead of sync's update-to-data ratio (``--utd``).

Every sample carries the version of the actor that chose its action and that action's
log-prob. The learner publishes a new version every ``--publish-every`` gradient steps, by
default ``num_envs * utd`` of them: the gradient steps that go with one step of every env. So
a version is one vector step, and a staleness of ``s`` versions means the action was chosen
about ``s`` steps (per env) ago. ``--max-staleness`` drops older samples at sampling time;
while fewer than a batch of samples are recent enough, gradient steps wait for fresh data
(learning slows down, it never stops: see docs/agents.md). With ``--n-step n > 1``
the critic targets are Retrace-style n-step returns whose traces are cut by truncated
importance weights ``c_k = lambda * min(1, pi(a_k|s_k) / mu(a_k|s_k))`` (Munos et al. 2016),
so stale intermediate actions stop contributing instead of biasing the target:

    y_k = r_k + gamma (1 - d_k) [ V(s_{k+1}) + c_{k+1} (y_{k+1} - Q(s_{k+1}, a_{k+1})) ]

with the soft value ``V(s) = min_j Q'_j(s, a') - alpha log pi(a'|s)``, ``a' ~ pi``.
"""

from __future__ import annotations

import copy
import math
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F

from asyncvec import Collector, ReplayBuffer, VersionManager
from asyncvec.agents.common import (
    EnvAgentArgs,
    collector_charts,
    env_spaces,
    final_observations,
    make_policy,
    make_ray_collector,
    parse_cli,
    ray_collectors_for,
    run_from_cli,
    vector_env_factory,
)
from asyncvec.agents.sac_networks import Actor, SoftQ
from asyncvec.agents.summaries import final_return_text, restarts_text, run_steps_text
from asyncvec.buffers import Transitions, policy_columns
from asyncvec.lifecycle import release_if_held
from asyncvec.metrics import EpisodeStats, StageClock
from asyncvec.runs import EnvStepsRun, check_resumable, load_checkpoint, run_name, seed_everything
from asyncvec.versioning import with_lag


@dataclass
class Args(EnvAgentArgs):
    """SAC's options: those every env agent has (asyncvec.agents.common.EnvAgentArgs, with SAC's defaults for
    --env, --num-envs and --total-timesteps), then its own."""

    env: str = "Pendulum-v1"
    """gymnasium env id with a Box action space (Pendulum-v1), or module:EnvId for your own env: module (a file
    in the current folder or an installed package) is imported first and registers EnvId (mymod:MyEnv-v0)"""
    num_envs: int = 2
    """number of parallel envs"""
    total_timesteps: int = 15_000
    """env steps to train for"""
    max_staleness: int | None = None
    """drop samples more than this many versions older than the learner (None: keep all); a version is
    --publish-every gradient steps, by default one step of every env"""
    n_step: int = 1
    """n-step Retrace targets with truncated traces (1: the usual one-step target)"""
    trace_lambda: float = 1.0
    """lambda of the Retrace traces"""
    is_cap: float = 1.0
    """truncation of the trace importance weights"""
    policy_lag: int = 0
    """actors receive each new version this many publications late"""
    lockstep: bool = False
    """async at lag 0: the envs step together and each step waits for the gradient steps (and the publish) due on
    the data before it, so the actors act with the learner's current version and the run is the sync run,
    bitwise (a check of the async path, not a speed-up: asyncvec docs agents)"""
    publish_every: int | None = None
    """publish the actor's weights (a new version) every this many gradient steps (None: num_envs * utd,
    so that one version is one step of every env)"""
    checkpoint_every: int = 5000
    """env steps between checkpoints"""
    # Algorithm (CleanRL's SAC)
    buffer_size: int = 100_000
    """replay capacity"""
    batch_size: int = 256
    """minibatch size"""
    learning_starts: int = 1000
    """env steps before the first gradient step"""
    utd: float = 1.0
    """gradient steps per env step, counted from learning_starts"""
    gamma: float = 0.99
    """discount"""
    tau: float = 0.005
    """target network smoothing"""
    policy_lr: float = 3e-4
    """actor learning rate"""
    q_lr: float = 1e-3
    """critic learning rate"""
    policy_frequency: int = 2
    """actor (and alpha) updates every this many critic updates (each then done this many times)"""
    alpha: float = 0.2
    """entropy coefficient (initial value when autotuned)"""
    autotune: bool = True
    """tune alpha towards the target entropy -dim(A)"""
    hidden: int = 256
    """width of the hidden layers"""

    def __post_init__(self) -> None:
        if self.publish_every is None:
            self.publish_every = max(1, round(self.num_envs * self.utd))
        super().__post_init__()
        for name in ("batch_size", "n_step", "publish_every", "buffer_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.utd <= 0:
            raise ValueError(f"--utd must be > 0, got {self.utd}")
        if self.record_schedule or self.replay:
            raise ValueError(
                "SAC records no schedule (--record-schedule and --replay are PPO's): its gradient steps meet the "
                "collector's writes at times a record per update does not keep (asyncvec docs agents, section Record and replay)"
            )
        if self.lockstep and (self.mode != "async" or self.backend != "local" or self.policy_lag):
            raise ValueError("--lockstep is async at lag 0: it needs --mode async, --backend local, --policy-lag 0")
        if self.max_staleness is not None and self.policy_lag > self.max_staleness:
            raise ValueError(f"--policy-lag {self.policy_lag} exceeds --max-staleness {self.max_staleness}")


@dataclass
class TrainResult:
    global_step: int
    gradient_steps: int
    wall_time_s: float
    env_steps_per_s: float
    episodic_returns: list[float]
    final_return: float
    reached_target_s: float | None
    staleness_mean: float
    dropped_samples: int
    history: list[dict] = field(default_factory=list)
    starved_gradient_steps: int = 0
    resumed_at_step: int = 0  # where a --resume went on from; wall_time_s and env_steps_per_s cover the rest
    env_restarts: list[int] = field(default_factory=list)  # per env, with --max-restarts
    """gradient steps that waited because fewer than a batch of samples were within --max-staleness"""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """wall seconds of the run per stage of the loop: collect (sync: act, step, store) or collect_wait (async:
    the learner waiting for samples), update (gradient steps), publish"""
    log_path: str | None = None
    """the run's TensorBoard folder (None with ``track=False``)"""
    checkpoint_path: str | None = None
    """the checkpoint file (None without ``checkpoint_dir``)"""


class NStepIndex:
    """Links each replay slot to the same env's next transition, for n-step sequences.

    The collector writes transitions of many envs interleaved; ``link`` remembers, per env,
    the slot of its previous transition, so ``sequences`` can follow an episode forward.
    """

    def __init__(self, capacity: int, num_envs: int) -> None:
        self.next_slot = np.full(capacity, -1, dtype=np.int64)
        self.episode = np.full(capacity, -1, dtype=np.int64)
        self.last_slot = np.full(num_envs, -1, dtype=np.int64)
        self.lock = threading.Lock()

    def link(self, slots: np.ndarray, env_ids: np.ndarray, episode_ids: np.ndarray, dones: np.ndarray) -> None:
        with self.lock:
            for slot, env_id, episode, done in zip(slots, env_ids, episode_ids, dones):
                self.next_slot[slot] = -1
                self.episode[slot] = episode
                previous = self.last_slot[env_id]
                if previous >= 0 and self.episode[previous] == episode:
                    self.next_slot[previous] = slot
                self.last_slot[env_id] = -1 if done else slot

    def sequences(self, start: np.ndarray, n: int) -> np.ndarray:
        """``[B, n]`` slots from each start (-1 once the episode or the stored data ends)."""
        with self.lock:
            out = np.full((len(start), n), -1, dtype=np.int64)
            out[:, 0] = start
            for k in range(1, n):
                prev = out[:, k - 1]
                nxt = np.where(prev >= 0, self.next_slot[np.maximum(prev, 0)], -1)
                same = (nxt >= 0) & (self.episode[np.maximum(nxt, 0)] == self.episode[np.maximum(prev, 0)])
                out[:, k] = np.where(same, nxt, -1)
            return out


class SAC(EnvStepsRun):
    """SAC over an AsyncLLMVectorEnv, sync or async (see the module docstring)."""

    def __init__(self, args: Args) -> None:
        self.args = args
        seed_everything(args.seed)
        torch.set_num_threads(args.torch_threads)
        env_spaces(args.env, args.env_kwargs_dict())  # one env built here first: its errors before any worker starts
        if args.backend == "ray":
            self.envs = ray_collectors_for(args)
        else:
            self.envs = vector_env_factory(
                args, batch_size=max(1, args.num_envs // 2) if args.mode == "async" else None
            )()
        obs_space, self.action_space = self.envs.single_observation_space, self.envs.single_action_space
        if not isinstance(self.action_space, gym.spaces.Box):
            self.envs.close()
            raise ValueError(
                f"SAC needs a continuous (Box) action space; {args.env} has {self.action_space}. "
                f"For discrete actions use PPO: asyncvec-ppo --env {args.env} (agents/ppo.py)."
            )
        if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
            self.envs.close()
            raise ValueError(f"SAC here takes flat Box observations, {args.env} has {obs_space}")
        obs_dim, act_dim = obs_space.shape[0], int(np.prod(self.action_space.shape))
        self.actor = Actor(obs_dim, self.action_space, args.hidden)
        self.qf1, self.qf2 = SoftQ(obs_dim, act_dim, args.hidden), SoftQ(obs_dim, act_dim, args.hidden)
        self.qf1_target, self.qf2_target = copy.deepcopy(self.qf1), copy.deepcopy(self.qf2)
        self.q_optimizer = torch.optim.Adam([*self.qf1.parameters(), *self.qf2.parameters()], lr=args.q_lr)
        self.actor_optimizer = torch.optim.Adam(self.actor.parameters(), lr=args.policy_lr)
        self.target_entropy = -float(act_dim)
        self.log_alpha = torch.tensor(np.log(args.alpha), dtype=torch.float32, requires_grad=True)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=args.q_lr)
        whole_steps = args.mode == "sync" or args.lockstep
        self.policy = make_policy(
            copy.deepcopy(self.actor), self.action_space, args.num_envs, args.policy_latency_ms, whole_steps
        )
        self.versions = VersionManager(max_lag=None)
        self.versions.register(with_lag(self.policy, args.policy_lag))
        self.buffer = ReplayBuffer(args.buffer_size, obs_space, self.action_space, seed=args.seed)
        self.index = NStepIndex(args.buffer_size, args.num_envs)
        self.global_step = 0
        self.gradient_steps = 0
        self.starved_gradient_steps = 0
        self.stages = StageClock()  # seconds per stage of the loop (collect, update, publish), logged as time/*
        self._starved = False  # the last gradient step found too few eligible samples
        self._stopping = threading.Event()
        self._progress = threading.Condition()
        self.prior_returns: list[float] = []  # after --resume: the checkpoint's recent episode returns
        self._recent_returns: list[float] = []
        self.run_name = run_name(args.env, "sac", args.mode, args.seed)  # --resume: the checkpoint's run
        self.checkpoint_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
        if args.resume:
            try:
                self._resume()
            except BaseException:
                self.policy.close()
                self.envs.close()
                self.versions.close()
                raise

    @property
    def checkpoint_path(self) -> Path | None:
        """The checkpoint file (the replay buffer sits beside it, in ``replay/``); None without ``--checkpoint-dir``."""
        return self.checkpoint_dir / "sac.pt" if self.checkpoint_dir is not None else None

    # ------------------------------------------------------------------ data

    def store(self, t: Transitions) -> None:
        """Adds a batch of transitions to the replay buffer and links them for n-step targets."""
        slots = self.buffer.add_transitions(t)
        self.index.link(slots, t.env_id, t.episode_id, t.terminated | t.truncated)
        with self._progress:
            self.global_step += len(slots)
            self._progress.notify_all()

    def _gradient_steps_due(self) -> int:
        """Gradient steps owed: ``utd`` per env step after ``learning_starts`` (CleanRL's), minus those taken."""
        if self.global_step < self.args.learning_starts:
            return 0
        return int(self.args.utd * (self.global_step - self.args.learning_starts)) - self.gradient_steps

    def _pace(self, written: int) -> None:
        """Holds the collector back while it is ahead of the learner's update-to-data ratio by more than one step
        of every env (so the gradient steps per env step are sync's, ``--utd``, from the first step on: the envs
        act on step t+1 while the learner takes the gradient steps due on step t), and once the run has its
        ``total_timesteps``."""
        args = self.args
        if args.lockstep:
            with self._progress:
                while not self._stopping.is_set() and (
                    self._learner_behind() or self.global_step >= args.total_timesteps
                ):
                    self._progress.wait(0.1)
            return
        with self._progress:
            while not self._stopping.is_set() and (
                self.global_step >= args.total_timesteps
                or (
                    not self._starved
                    and self.global_step >= args.learning_starts
                    and self.global_step > args.learning_starts + self.gradient_steps / args.utd + args.num_envs
                )
            ):
                self._progress.wait(0.1)

    def _learner_behind(self) -> bool:
        """Async: gradient steps are due on the stored data (and can be taken), or the last one's publish is under way."""
        args = self.args
        published = self._first_version + self.gradient_steps // args.publish_every - self._first_publishes
        return (self._gradient_steps_due() > 0 and not self._starved) or self.versions.current_version < published

    def _gather(self, slots: np.ndarray) -> dict[str, torch.Tensor]:
        """The transitions at ``slots`` ([B, k]; -1 entries read slot 0 and must be masked), as tensors."""
        rows = self.buffer.gather(np.maximum(slots.reshape(-1), 0), self.versions.current_version)
        fields = {
            "obs": rows.obs,
            "action": rows.action,
            "reward": rows.reward,
            "next_obs": rows.next_obs,
            "terminated": rows.terminated,
            "behavior_logp": rows.behavior_logp,
        }
        return {
            k: torch.as_tensor(np.asarray(v), dtype=torch.float32).reshape(*slots.shape, *np.shape(v)[1:])
            for k, v in fields.items()
        }

    # ------------------------------------------------------------------ learning

    def soft_value(self, next_obs: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        action, logp = self.actor.sample(next_obs)
        return torch.min(self.qf1_target(next_obs, action), self.qf2_target(next_obs, action)) - alpha * logp

    def critic_targets(self, batch, alpha: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """One-step soft targets, or Retrace n-step targets with truncated traces."""
        args = self.args
        reward = torch.as_tensor(batch.reward, dtype=torch.float32)
        not_done = 1.0 - torch.as_tensor(batch.terminated, dtype=torch.float32)
        next_obs = torch.as_tensor(batch.next_obs, dtype=torch.float32)
        with torch.no_grad():
            target = reward + args.gamma * not_done * self.soft_value(next_obs, alpha)
            if args.n_step == 1:
                return target, {}
            seq = self.index.sequences(batch.indices, args.n_step)  # [B, n]
            rows = self._gather(seq[:, 1:])  # steps 1..n-1
            valid = torch.as_tensor(seq[:, 1:] >= 0)
            B, n1 = valid.shape
            obs_k = rows["obs"].reshape(B * n1, -1)
            act_k = rows["action"].reshape(B * n1, -1)
            q_k = torch.min(self.qf1_target(obs_k, act_k), self.qf2_target(obs_k, act_k)).reshape(B, n1)
            pi_logp = self.actor.log_prob(obs_k, act_k).reshape(B, n1)
            c = args.trace_lambda * torch.exp(torch.clamp(pi_logp - rows["behavior_logp"], max=np.log(args.is_cap)))
            c = torch.where(valid, c.clamp(max=1.0), torch.zeros_like(c))
            v_next = self.soft_value(rows["next_obs"].reshape(B * n1, -1), alpha).reshape(B, n1)
            not_done_k = 1.0 - rows["terminated"]
            # Backward recursion: y_k = r_k + gamma (1 - d_k) [V(s_{k+1}) + c_{k+1} (y_{k+1} - Q(s_{k+1}, a_{k+1}))]
            y_next = rows["reward"][:, -1] + args.gamma * not_done_k[:, -1] * v_next[:, -1]
            for k in range(n1 - 2, -1, -1):
                correction = c[:, k + 1] * (y_next - q_k[:, k + 1])
                y_next = rows["reward"][:, k] + args.gamma * not_done_k[:, k] * (v_next[:, k] + correction)
            y_next = torch.where(valid[:, 0], y_next, torch.zeros_like(y_next))
            trace = torch.where(valid[:, 0], c[:, 0] * (y_next - q_k[:, 0]), torch.zeros_like(y_next))
            target = target + args.gamma * not_done * trace
        return target, {"trace/mean_c": float(c[valid].mean()) if valid.any() else float("nan")}

    def gradient_step(self) -> dict[str, float] | None:
        """One critic (and every ``policy_frequency``-th an actor) update; None if it must wait for data."""
        args = self.args
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            batch = self.buffer.sample(
                args.batch_size, current_version=self.versions.current_version, max_staleness=args.max_staleness
            )
        except ValueError as exc:  # (Args are checked, so this is: fewer than batch_size eligible samples)
            self._wait_for_eligible(exc)
            return None
        self._starved = False
        alpha = self.log_alpha.exp().detach()
        target, stats = self.critic_targets(batch, alpha)
        obs = torch.as_tensor(batch.obs, dtype=torch.float32)
        action = torch.as_tensor(batch.action, dtype=torch.float32)
        q_loss = F.mse_loss(self.qf1(obs, action), target) + F.mse_loss(self.qf2(obs, action), target)
        self.q_optimizer.zero_grad()
        q_loss.backward()
        self.q_optimizer.step()
        self.versions.record_staleness(batch.staleness.tolist())
        stats.update({"losses/q_loss": float(q_loss.detach()), "staleness/mean": float(batch.staleness.mean())})
        if self.gradient_steps % args.policy_frequency == 0:
            for _ in range(args.policy_frequency):
                new_action, logp = self.actor.sample(obs)
                q = torch.min(self.qf1(obs, new_action), self.qf2(obs, new_action))
                actor_loss = (alpha * logp - q).mean()
                self.actor_optimizer.zero_grad()
                actor_loss.backward()
                self.actor_optimizer.step()
                if args.autotune:
                    alpha_loss = -(self.log_alpha.exp() * (logp.detach() + self.target_entropy)).mean()
                    self.alpha_optimizer.zero_grad()
                    alpha_loss.backward()
                    self.alpha_optimizer.step()
                    alpha = self.log_alpha.exp().detach()
            stats.update({"losses/actor_loss": float(actor_loss.detach()), "losses/alpha": float(alpha)})
        with torch.no_grad():
            for net, target_net in ((self.qf1, self.qf1_target), (self.qf2, self.qf2_target)):
                for p, tp in zip(net.parameters(), target_net.parameters()):
                    tp.mul_(1 - args.tau).add_(args.tau * p)
        self.gradient_steps += 1
        self.stages.add("update", time.perf_counter() - wall, time.thread_time() - cpu)
        if self.gradient_steps % args.publish_every == 0:
            with self.stages("publish"):
                self.versions.publish({k: v.detach().clone() for k, v in self.actor.state_dict().items()})
        return stats

    def _wait_for_eligible(self, exc: ValueError) -> None:
        """Counts a postponed gradient step, lets the collector run past the pacing, warns once."""
        if not self.starved_gradient_steps and self.global_step >= self.args.learning_starts:
            args = self.args
            per_version = args.publish_every / args.utd  # env steps between two versions
            if args.max_staleness is None:
                message = f"SAC: gradient steps wait until --batch-size {args.batch_size} samples are stored ({exc})"
            else:
                kept, needed = args.max_staleness + 1, max(0, math.ceil(args.batch_size / per_version) - 1)
                message = (
                    f"SAC: gradient steps wait for fresh samples ({exc}). --max-staleness {args.max_staleness} keeps "
                    f"the samples of the last {kept} versions, about {kept * per_version:.0f} env steps, fewer than "
                    f"--batch-size {args.batch_size}: learning slows down. A full batch stays eligible with "
                    f"--max-staleness >= {needed}."
                )
            warnings.warn(
                message,
                RuntimeWarning,
                stacklevel=3,
            )
        self.starved_gradient_steps += 1
        with self._progress:
            self._starved = True
            self._progress.notify_all()

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> None:
        if self.checkpoint_dir is None:
            return
        self.buffer.save(self.checkpoint_dir / "replay")
        self.write_checkpoint(
            actor=self.actor.state_dict(),
            qf1=self.qf1.state_dict(),
            qf2=self.qf2.state_dict(),
            qf1_target=self.qf1_target.state_dict(),
            qf2_target=self.qf2_target.state_dict(),
            log_alpha=self.log_alpha.detach(),
            q_optimizer=self.q_optimizer.state_dict(),
            actor_optimizer=self.actor_optimizer.state_dict(),
            alpha_optimizer=self.alpha_optimizer.state_dict(),
            version=self.versions.current_version,
            global_step=self.global_step,
            gradient_steps=self.gradient_steps,
            index=(self.index.next_slot, self.index.episode),
            args=asdict(self.args),
            run_name=self.run_name,
            recent_returns=self._recent_returns[-100:],
        )

    def _resume(self) -> None:
        if self.checkpoint_dir is None:
            raise ValueError("--resume needs --checkpoint-dir DIR, the folder of the checkpoint to continue from")
        state = load_checkpoint(self.checkpoint_dir / "sac.pt")
        check_resumable(
            state,
            self.checkpoint_dir / "sac.pt",
            env=self.args.env,
            env_kwargs=self.args.env_kwargs,
            num_envs=self.args.num_envs,
        )
        self.run_name = state.get("run_name", self.run_name)
        self.prior_returns = list(state.get("recent_returns", []))
        for name in ("actor", "qf1", "qf2", "qf1_target", "qf2_target"):
            getattr(self, name).load_state_dict(state[name])
        for name in ("q_optimizer", "actor_optimizer", "alpha_optimizer"):
            getattr(self, name).load_state_dict(state[name])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.buffer = ReplayBuffer.load(self.checkpoint_dir / "replay", seed=self.args.seed)
        self.index.next_slot[:], self.index.episode[:] = state["index"]
        self.global_step, self.gradient_steps = state["global_step"], state["gradient_steps"]
        if self.versions.current_version < state["version"]:  # one publish, not one per gradient step
            self.versions.publish(
                {k: v.detach().clone() for k, v in self.actor.state_dict().items()}, version=state["version"]
            )

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainResult:
        """Trains until ``total_timesteps`` (or ``target_return``); closes envs and policy."""
        args = self.args
        logger = self.run_logger()
        history: list[dict] = []
        start = time.monotonic()
        reached_at = None
        collector = None
        episodes = EpisodeStats(args.num_envs)
        ids = np.arange(args.num_envs)
        next_log = next_checkpoint = start_step = self.global_step  # after --resume: steps/s counts this run's steps
        stats: dict[str, float] = {}
        self._recent_returns = list(self.prior_returns)
        interrupted = False
        self._first_version = self.versions.current_version
        self._first_publishes = self.gradient_steps // args.publish_every
        try:
            if args.mode == "async" and args.backend == "ray":
                collector = make_ray_collector(
                    self.envs, self.actor, self.store, self.versions,
                    policy_latency_ms=args.policy_latency_ms, policy_lag=args.policy_lag, seed=args.seed, pace=self._pace,
                ).start()  # fmt: skip
            elif args.mode == "async":
                collector = Collector(
                    self.envs, self.policy, self.store, seed=args.seed, pace=self._pace, lockstep=args.lockstep
                ).start()
            else:
                obs, _ = self.envs.reset(seed=args.seed)
                episode_ids = ids.copy()
            # (async: the gradient steps due on the last env steps too, as the sync loop takes them)
            while self.global_step < args.total_timesteps or (collector is not None and self._learner_behind()):
                if collector is None:
                    with self.stages("collect"):
                        outputs = self.policy.act(obs, env_ids=ids, timeout=60)
                        actions = np.stack([o.action for o in outputs])
                        next_obs, rewards, terminated, truncated, info = self.envs.step(
                            np.clip(actions, self.action_space.low, self.action_space.high)
                        )
                        done = terminated | truncated
                        final = final_observations(next_obs, done, info)
                        self.store(
                            Transitions(
                                obs, actions, rewards, final, terminated, truncated, **policy_columns(outputs),
                                env_id=ids, episode_id=episode_ids.copy(),
                            )
                        )  # fmt: skip
                        episodes.update(ids, rewards, done)
                        episode_ids[done] = episode_ids.max() + 1 + np.arange(done.sum())
                        obs = next_obs
                        steps_due = self._gradient_steps_due()
                else:
                    with self.stages("collect_wait"), self._progress:
                        if self._gradient_steps_due() <= 0:
                            self._progress.wait(0.05)
                    collector.check()
                    steps_due = min(self._gradient_steps_due(), 1)
                for _ in range(max(steps_due, 0)):
                    step_stats = self.gradient_step()
                    if step_stats is None:  # too few eligible samples: act more first
                        if collector is not None:
                            with self.stages("collect_wait"), self._progress:
                                self._progress.wait(0.05)
                        break
                    stats = step_stats
                with self._progress:
                    self._progress.notify_all()
                if self.global_step >= next_log:
                    next_log += 500
                    returns = self._recent_returns = self.prior_returns + (
                        collector.recent_returns() if collector is not None else episodes.returns()
                    )
                    mean10 = float(np.mean(returns[-10:])) if returns else float("nan")
                    elapsed = time.monotonic() - start
                    row = {
                        **stats,
                        **self.stages.scalars(),
                        "charts/episodic_return": mean10,
                        "charts/env_steps_per_s": (self.global_step - start_step) / elapsed,
                        "charts/gradient_steps": self.gradient_steps,
                        "time/wall_s": elapsed,
                        "global_step": self.global_step,
                    }
                    if collector is not None:
                        row.update(collector_charts(collector))
                    history.append(row)
                    logger.log(row, self.global_step)
                    if args.target_return is not None and len(returns) >= 10 and mean10 >= args.target_return:
                        reached_at = elapsed
                        break
                if self.checkpoint_dir is not None and self.global_step >= next_checkpoint + args.checkpoint_every:
                    next_checkpoint = self.global_step
                    self.save()
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            self._stopping.set()
            if collector is not None:
                release_if_held(self._progress)  # a Ctrl-C as `with self._progress` was entered can leave it held
                collector.stop()
            logger.close(final_step=self.global_step)
            self.policy.close()
            self.envs.close()
            if interrupted and self.checkpoint_dir is not None:
                self.save()  # Ctrl-C: the state of the last complete gradient step, for --resume
        if self.checkpoint_dir is not None:
            self.save()
        wall = time.monotonic() - start
        returns = self.prior_returns + (collector.recent_returns() if collector is not None else episodes.returns())
        staleness = self.versions.staleness_stats()
        self.versions.close()
        return TrainResult(
            global_step=self.global_step,
            gradient_steps=self.gradient_steps,
            wall_time_s=wall,
            env_steps_per_s=(self.global_step - start_step) / wall,
            resumed_at_step=start_step,
            env_restarts=list(getattr(self.envs, "restarts", [])),  # Ray's collectors: no --max-restarts
            episodic_returns=returns,
            final_return=float(np.mean(returns[-10:])) if returns else float("nan"),
            reached_target_s=reached_at,
            staleness_mean=staleness.mean,
            dropped_samples=staleness.dropped,
            history=history,
            starved_gradient_steps=self.starved_gradient_steps,
            stage_seconds=dict(self.stages.totals),
            log_path=str(self.log_path) if self.log_path is not None else None,
            checkpoint_path=str(self.checkpoint_path) if self.checkpoint_path is not None else None,
        )

    def close(self) -> None:
        """Stops the policy server and the env workers (``train`` does this itself when it ends; the command line
        calls it when there is nothing left to train, e.g. ``--resume`` of a finished run)."""
        self.policy.close()
        self.envs.close()
        self.versions.close()


def train(args: Args) -> TrainResult:
    """Builds a SAC from ``args``, trains it and returns the result."""
    return SAC(args).train()


def main(args: Args) -> TrainResult | None:
    """The command line: trains, then says where the logs and the checkpoint went (Ctrl-C stops cleanly)."""
    return run_from_cli(
        lambda: SAC(args),
        lambda result: (
            f"SAC {run_steps_text(result.global_step, result.resumed_at_step)}, {result.gradient_steps} gradient steps "
            f"in {result.wall_time_s:.1f} s "
            f"({result.env_steps_per_s:.0f} steps/s), {final_return_text(result.final_return, 10)}"
            f"{restarts_text(result.env_restarts, args.max_restarts)}"
            f"\ntime: {StageClock.words(result.stage_seconds)}"
        ),
        name="SAC",
        saves="every --checkpoint-every env steps, at the end and on Ctrl-C",
    )


def cli() -> None:
    """``asyncvec-sac``, ``python -m asyncvec.agents.sac`` or, in a clone, ``python agents/sac.py``."""
    main(parse_cli(Args))


if __name__ == "__main__":
    cli()
