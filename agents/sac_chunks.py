"""SAC on action chunks: a pixel policy plays H-action chunks at a control rate; a critic over H executed actions.

Run:   python agents/sac_chunks.py --env asyncvec/PixelCartPole-v0 --iterations 20
Installed: asyncvec-sac-chunks (or python -m asyncvec.agents.sac_chunks) with the same options
Import: from asyncvec.agents.sac_chunks import SACChunks, Args; history = SACChunks(Args(iterations=20)).train()

The acting side is agents/ppo_chunks.py's: the same envs, image encoder, `ChunkExecutor` on the simulated clock and
evaluation (`ChunkTask`); the actor is SAC's tanh-squashed Gaussian (agents/sac_networks.py), here over a whole
chunk of ``H`` actions, served by `GaussianChunkPolicy(squash=True)`.

* **The critic scores H executed actions.** ``Q(o, a_{t:t+H})``: ``o`` the observation ``L = --latency-ticks``
  ticks before tick ``t`` (a chunk requested at ``o`` starts playing ``L`` ticks later), ``a_{t:t+H}`` the actions
  the envs EXECUTED at ticks ``t..t+H-1`` (after clipping and any safety filter), whoever chose them. Its target is

      y = sum_{k<H} gamma^k r_{t+k} + gamma^H (1 - d) [min_j Q'_j(o_{t+H-L}, A') - alpha log pi(A' | o_{t+H-L})]

  with ``A' ~ pi(o_{t+H-L})``: the next chunk, requested ``L`` ticks before it would start. An episode that ends
  inside the window cuts it (terminated: no bootstrap; truncated: bootstrap from its final observation), the
  actions after the end are zeros. Every window of H ticks of one episode is a sample, not only those a chunk
  started on: the critic learns from every executed transition, fallbacks and replaced actions included (they are
  what the robot did), with H times the samples of one per chunk.
* **Whole chunks play.** A chunk is asked for when ``L - 1`` actions of the current one remain
  (``request_at``), so on the simulated clock the next one arrives as the last action plays: nothing is dropped
  and every chunk the actor chooses is a window the critic scores.
* **The actor** maximizes ``min_j Q_j(o, A) - alpha log pi(A | o)``, ``A ~ pi(o)``, over the observations of the
  replay; ``alpha`` is tuned towards the target entropy ``-H * dim(action)`` (``--autotune``).
* **After behaviour cloning** (``behavior_clone`` then ``train``). Cloning regresses the squashed chunk mean on the
  demonstrations and freezes a copy of the actor as the reference. ``train`` then runs
  ``--critic-warmup-iterations`` rollouts of the cloned policy that train the critics alone (the actor and alpha do
  not move: its first gradient comes from a critic that knows the cloned policy's values), and every actor step adds
  ``--anchor-coef * KL(pi || pi_cloned)`` (the Gaussians before the squash: the same tanh on both sides leaves the
  KL unchanged; per action, mean over the H actions) on the observations where the anchor holds: all but those
  where both critics score the actor's chunk above the cloned policy's (``--anchor-filter q-pessimistic``, a
  Q-filter). ``--alpha`` starts small (0.01): a large entropy bonus pays a cloned policy for random actions before
  the critic knows anything. The defaults and what each is worth come from ``benchmarks/chunk_suite.py --agent sac``
  (docs/robots.md): without the warm-up the gain halves on cartpole and pendulum; without the anchor cartpole ends
  below its cloned start; an anchor everywhere holds a weak cloned start (pendulum) near where it began, and the
  filter lets it go where both critics see better chunks; alpha 0.01 against 0.2 is not separated by one seed.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from gymnasium.vector import AutoresetMode
from torch.distributions import Independent, Normal, kl_divergence

from asyncvec import AsyncLLMVectorEnv
from asyncvec.agents.common import parse_cli, run_from_cli
from asyncvec.agents.ppo_chunks import ChunkTask, ObservationEncoder, ended_episode_returns, evaluation_text
from asyncvec.agents.sac_networks import Actor, SoftQ
from asyncvec.control import SOURCES, ChunkExecutor, ChunkRollout
from asyncvec.control.chunk_policy import GaussianChunkPolicy
from asyncvec.metrics import RunLogger
from asyncvec.runs import run_name, seed_everything

RESET = SOURCES.index("reset")


@dataclass
class Args:
    env: str = "asyncvec/PixelCartPole-v0"
    """a registered env with image (or Dict(image, instruction)) observations and a Box action space, or
    module:EnvId (module, in the current folder or installed, registers EnvId when imported)"""
    env_kwargs: str = '{"size": 16}'
    """keyword arguments of gym.make, as JSON (the asyncvec/Pixel* envs take size; give '{}' for an env that takes
    none)"""
    image_size: int = 16
    """side of the square image the networks read: camera images of another size are resized to it (bilinear)"""
    instruction_buckets: int = 64
    """a Dict observation's Text instruction is read as its words hashed into this many buckets (0: ignored)"""
    max_episode_steps: int = 200
    """time limit of an episode (0: the env's own)"""
    num_envs: int = 8
    """envs stepped in lockstep by the chunk executor"""
    async_envs: bool = False
    """step the envs in worker processes (AsyncLLMVectorEnv) instead of in this process"""
    horizon: int = 8
    """H: actions per chunk"""
    latency_ticks: int = 2
    """L: each chunk arrives this many ticks after its request, on the simulated clock (ticks unpaced, the same data
    at any machine load); the critic pairs each window of H actions with the observation L ticks before it"""
    ticks_per_rollout: int = 64
    """control ticks per rollout; a rollout gives about ticks_per_rollout * num_envs windows to the replay"""
    iterations: int = 20
    """rollout + gradient steps rounds"""
    gradient_steps: int = 64
    """gradient steps (critic and actor) after each rollout"""
    batch_size: int = 128
    """windows per gradient step"""
    buffer_size: int = 50_000
    """windows the replay keeps (the oldest go first)"""
    gamma: float = 0.98
    """discount per tick"""
    tau: float = 0.01
    """target critic smoothing"""
    policy_lr: float = 3e-4
    """actor learning rate"""
    q_lr: float = 1e-3
    """critic learning rate"""
    clone_learning_rate: float = 1e-3
    """Adam learning rate of behavior_clone (its own optimizer; at --policy-lr 150 steps do not reach saturated
    expert actions through the squash: mountain_car cloned to -4.9 against 89.7 at 1e-3)"""
    alpha: float = 0.01
    """entropy coefficient (its initial value with --autotune)"""
    autotune: bool = True
    """tune alpha towards the target entropy -H * dim(action)"""
    hidden: int = 256
    """width of the actor's and the critics' hidden layers (on the encoder's 128 features)"""
    eval_rounds: int = 2
    """evaluation: rounds of one episode per env, from reset (0: no evaluation)"""
    seed: int = 1
    """seed of torch, numpy, the envs and the acting policy's noise"""
    torch_threads: int = 1
    """torch CPU threads for the learner"""
    track: bool = True
    """write TensorBoard logs to --log-dir/<run> (--no-track writes none)"""
    log_dir: str = "runs"
    """TensorBoard log root"""
    progress: bool = True
    """show a progress bar over the iterations"""
    critic_warmup_iterations: int = 5
    """after behavior_clone: this many rollouts of the cloned policy that train the critics alone (the actor and
    alpha do not move) before the ``iterations`` (0: none; no effect without behavior_clone)"""
    anchor_coef: float = 1.0
    """after behavior_clone: weight of ``KL(pi || pi_cloned)`` (per action, mean over the H actions) in the actor's
    loss, which holds the actor near the frozen cloned policy (0: none; no effect without behavior_clone; at 0 and
    0.1 cartpole ended below its cloned start)"""
    anchor_filter: Literal["none", "q", "q-pessimistic"] = "q-pessimistic"
    """where the anchor holds (a Q-filter, Nair et al. 2018), per observation: q-pessimistic, unless both critics
    score the actor's chunk above the cloned one (``max_j Q_j(o, mean_cloned(o)) >= min_j Q_j(o, mean_pi(o))``);
    q, where ``min_j Q_j`` does not prefer the actor's (cartpole fell below its cloned start); none, everywhere
    (a weak cloned start stays weak: pendulum +60 against +540)"""

    def __post_init__(self) -> None:
        positive = ("image_size", "num_envs", "horizon", "ticks_per_rollout", "batch_size", "buffer_size", "hidden")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("latency_ticks", "iterations", "gradient_steps", "critic_warmup_iterations", "eval_rounds"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.latency_ticks > self.horizon:
            raise ValueError(f"--latency-ticks {self.latency_ticks} exceeds --horizon {self.horizon}: chunks would not "
                             "follow each other (ask for longer chunks)")  # fmt: skip
        if not 0.0 < self.gamma <= 1.0 or not 0.0 < self.tau <= 1.0:
            raise ValueError(f"--gamma and --tau must be in (0, 1], got {self.gamma} and {self.tau}")
        if self.alpha <= 0 or self.anchor_coef < 0:
            raise ValueError(f"--alpha must be > 0 and --anchor-coef >= 0, got {self.alpha} and {self.anchor_coef}")
        if self.anchor_filter not in ("none", "q", "q-pessimistic"):
            raise ValueError(f"--anchor-filter must be none, q or q-pessimistic, got {self.anchor_filter!r}")


class ChunkActor(nn.Module):
    """SAC's actor on the image encoder: a tanh-squashed Gaussian over a whole chunk, ``H * dim(action)`` numbers.

    ``distribution(obs)`` is the squashed distribution (flat chunks); ``forward(obs)`` is the acting policy's view,
    the Gaussian before the squash as ``(mean [B, H, d], log_std [B, H, d])`` for `GaussianChunkPolicy(squash=True)`.
    """

    def __init__(self, observation_space: gym.Space, image_size: int, chunk_space: gym.spaces.Box, hidden: int) -> None:
        super().__init__()
        self.encoder = encoder_for(observation_space, image_size)
        flat = gym.spaces.Box(chunk_space.low.reshape(-1), chunk_space.high.reshape(-1), dtype=np.float32)
        self.head = Actor(128, flat, hidden)
        self.chunk_shape = (chunk_space.shape[0], -1)

    def distribution(self, observations: torch.Tensor) -> Independent:
        return self.head(self.encoder(observations))

    def gaussian(self, observations: torch.Tensor) -> Normal:
        """The Gaussian before the squash (flat chunks)."""
        return self.distribution(observations).base_dist.base_dist

    def forward(self, observations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gaussian = self.gaussian(observations)
        shape = (len(observations), *self.chunk_shape)
        return gaussian.loc.reshape(shape), gaussian.scale.log().reshape(shape)

    def squashed_mean(self, observations: torch.Tensor) -> torch.Tensor:
        """The chunk the policy plays deterministically, ``[B, H * d]``: the mean through the squash."""
        return self.squash(self.gaussian(observations).loc)

    def squash(self, values: torch.Tensor) -> torch.Tensor:
        """Values of the Gaussian before the squash, as chunks in the action bounds."""
        return self.head.bias + self.head.scale * torch.tanh(values)


class ChunkCritic(nn.Module):
    """Two soft Q-functions (agents/sac_networks.py) on one image encoder: ``Q_j(o, a_{t:t+H})``."""

    def __init__(self, observation_space: gym.Space, image_size: int, chunk_dim: int, hidden: int) -> None:
        super().__init__()
        self.encoder = encoder_for(observation_space, image_size)
        self.q1, self.q2 = SoftQ(128, chunk_dim, hidden), SoftQ(128, chunk_dim, hidden)

    def forward(self, observations: torch.Tensor, chunks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.encoder(observations)
        return self.q1(features, chunks), self.q2(features, chunks)

    def min_q(self, features: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        """``min_j Q_j`` on features the encoder already computed (the actor's step: no gradient to the encoder)."""
        return torch.min(self.q1(features, chunks), self.q2(features, chunks))


def encoder_for(observation_space: gym.Space, image_size: int) -> ObservationEncoder:
    """agents/ppo_chunks.py's encoder: the image (and the hashed instruction of a Dict observation) -> 128."""
    image_space = observation_space["image"] if isinstance(observation_space, gym.spaces.Dict) else observation_space
    extra = gym.spaces.flatdim(observation_space) - int(np.prod(image_space.shape))
    return ObservationEncoder(image_space, extra, image_size)


class WindowReplay:
    """Every tick's observation once, and per window of H executed actions: the rows of its observation and of its
    next observation, the actions, the discounted reward sum and the bootstrap discount (0 after a termination)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.observations = torch.zeros(0)
        self.observation_offset = 0  # observation rows dropped from the front
        self.obs_row = self.next_row = torch.zeros(0, dtype=torch.long)
        self.chunks = self.rewards = self.discounts = torch.zeros(0)

    def __len__(self) -> int:
        return len(self.obs_row)

    def add(self, observations: torch.Tensor, obs_row: np.ndarray, next_row: np.ndarray, chunks: np.ndarray,
            rewards: np.ndarray, discounts: np.ndarray) -> None:  # fmt: skip
        """``observations [R, D]`` (new rows); the windows' rows index them from 0."""
        base = self.observation_offset + len(self.observations)
        self.observations = torch.cat([self.observations.reshape(-1, observations.shape[1]), observations])
        self.obs_row = torch.cat([self.obs_row, torch.as_tensor(obs_row) + base])
        self.next_row = torch.cat([self.next_row, torch.as_tensor(next_row) + base])
        self.chunks = torch.cat(
            [self.chunks.reshape(-1, chunks.shape[1]), torch.as_tensor(chunks, dtype=torch.float32)]
        )
        self.rewards = torch.cat([self.rewards, torch.as_tensor(rewards, dtype=torch.float32)])
        self.discounts = torch.cat([self.discounts, torch.as_tensor(discounts, dtype=torch.float32)])
        if len(self) > self.capacity:  # the oldest windows go, and the observation rows no window needs any more
            keep = slice(len(self) - self.capacity, None)
            self.obs_row, self.next_row = self.obs_row[keep], self.next_row[keep]
            self.chunks, self.rewards, self.discounts = self.chunks[keep], self.rewards[keep], self.discounts[keep]
            first = int(self.obs_row.min()) - self.observation_offset
            self.observations, self.observation_offset = self.observations[first:], self.observation_offset + first

    def sample(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """``(observations, chunks, rewards, discounts, next_observations)`` of random windows."""
        idx = torch.randint(len(self), (batch_size,))
        rows, next_rows = self.obs_row[idx] - self.observation_offset, self.next_row[idx] - self.observation_offset
        return (
            self.observations[rows],
            self.chunks[idx],
            self.rewards[idx],
            self.discounts[idx],
            self.observations[next_rows],
        )


def rollout_windows(rollout: ChunkRollout, horizon: int, latency: int, gamma: float) -> dict[str, np.ndarray]:
    """The windows of ``horizon`` executed actions in a rollout (module docstring): per window the tick row of its
    observation and of its next one (rows ``0..T``; ``T`` is ``rollout.next_obs``) and its env, the actions, the
    discounted reward sum and the bootstrap discount. A window needs its observation and its H ticks (or its
    episode's end) inside the rollout and inside one episode."""
    T, n = rollout.rewards.shape
    ended = rollout.terminated | rollout.truncated
    is_reset = rollout.source == RESET
    actions = rollout.actions.reshape(T, n, -1)
    out: dict[str, list] = {key: [] for key in ("obs_tick", "next_tick", "env", "chunk", "reward", "discount")}
    for env in range(n):
        for start in range(latency, T):
            first = start - latency  # the tick of the observation
            if is_reset[first : start + 1, env].any() or ended[first:start, env].any():
                continue  # the observation belongs to another episode than the window's first action
            chunk, reward, discount, next_tick = np.zeros((horizon, actions.shape[2]), np.float32), 0.0, 1.0, None
            for k in range(horizon):
                tick = start + k
                if tick >= T:
                    break
                chunk[k], reward, discount = (
                    actions[tick, env],
                    reward + discount * rollout.rewards[tick, env],
                    discount * gamma,
                )
                if rollout.terminated[tick, env]:
                    next_tick, discount = first, 0.0  # nothing to bootstrap from
                    break
                if rollout.truncated[tick, env]:
                    next_tick = tick + 1  # NEXT_STEP autoreset: the reset tick's observation is the final one
                    break
            else:
                next_tick = start + horizon - latency
            if next_tick is None:  # the window runs past the rollout
                continue
            for key, value in zip(out, (first, next_tick, env, chunk.reshape(-1), reward, discount), strict=True):
                out[key].append(value)
    return {key: np.asarray(values) for key, values in out.items()}


class SACChunks(ChunkTask):
    """SAC on chunks (module docstring). ``behavior_clone`` then ``train()``; ``train`` returns a history dict."""

    def __init__(self, args: Args) -> None:
        self.args = args
        torch.set_num_threads(args.torch_threads)
        seed_everything(args.seed)
        super().__init__(args, "SACChunks")
        chunk_dim = int(np.prod(self.chunk_space.shape))
        self.actor = ChunkActor(self.observation_space, args.image_size, self.chunk_space, args.hidden)
        self.critic = ChunkCritic(self.observation_space, args.image_size, chunk_dim, args.hidden)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.actor_optimizer = torch.optim.Adam(self.actor.parameters(), lr=args.policy_lr)
        self.q_optimizer = torch.optim.Adam(self.critic.parameters(), lr=args.q_lr)
        self.target_entropy = -float(chunk_dim)
        self.log_alpha = torch.tensor(np.log(args.alpha), dtype=torch.float32, requires_grad=True)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=args.q_lr)
        self.replay = WindowReplay(args.buffer_size)
        self.version = 0
        self.policy: GaussianChunkPolicy | None = None
        self.reference: ChunkActor | None = None  # the frozen cloned actor (behavior_clone), the anchor's
        self.anchor_held = torch.ones(())  # --anchor-filter: per observation of the last actor step, 1 where it held
        self.iteration = 0
        self.run_name = run_name(args.env, "sac_chunks", "sim", args.seed)

    def make_policy(self, **kwargs: Any) -> GaussianChunkPolicy:
        """A squashed `GaussianChunkPolicy` over a copy of the actor, reading whole observations."""
        network = copy.deepcopy(self.actor)
        return GaussianChunkPolicy(
            network, self.chunk_space, observation_space=self.observation_space, squash=True, **kwargs
        )

    def publish(self) -> None:
        """A new version of the actor's weights for the acting policy."""
        self.version += 1
        if self.policy is not None:
            self.policy.load_weights(copy.deepcopy(self.actor.state_dict()), self.version)

    # ------------------------------------------------------------------ learning
    def behavior_clone(self, observations: Any, chunks: np.ndarray, steps: int, batch_size: int = 128) -> float:
        """A warm start: regress the squashed chunk mean on demonstration chunks ``[N, H, *action_shape]``, each
        after its observation (a batch as `flatten` takes, from ``make_env()``'s envs); returns the last loss. The
        cloned actor is kept, frozen, as the anchor's reference."""
        inputs = self.flatten(observations)
        targets = torch.as_tensor(chunks, dtype=torch.float32).reshape(len(chunks), -1)
        if len(inputs) != len(targets) or targets.shape[1] != int(np.prod(self.chunk_space.shape)):
            raise ValueError(
                f"behavior_clone: chunks must be [N, H={self.args.horizon}, *{self.action_space.shape}] with N the "
                f"number of observations ({len(inputs)}), got {tuple(np.shape(chunks))}"
            )
        optimizer = torch.optim.Adam(self.actor.parameters(), lr=self.args.clone_learning_rate)
        loss = torch.zeros(())
        for _ in range(steps):
            idx = torch.randint(len(inputs), (batch_size,))
            loss = ((self.actor.squashed_mean(inputs[idx]) - targets[idx]) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        self.reference = copy.deepcopy(self.actor).requires_grad_(False)
        self.publish()
        return float(loss.detach())

    def store(self, rollout: ChunkRollout) -> int:
        """Puts the rollout's windows in the replay; returns how many."""
        if rollout.observations is None:
            raise ValueError("store needs a rollout from ChunkExecutor(record_obs=True)")
        windows = rollout_windows(rollout, self.args.horizon, self.args.latency_ticks, self.args.gamma)
        n = self.args.num_envs
        observations = torch.cat([self.flatten(obs) for obs in [*rollout.observations, rollout.next_obs]])
        obs_rows, next_rows = (windows[key] * n + windows["env"] for key in ("obs_tick", "next_tick"))  # [T + 1, n]
        self.replay.add(observations, obs_rows, next_rows, windows["chunk"], windows["reward"], windows["discount"])
        return len(windows["env"])

    def anchor_kl(self, observations: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        """``KL(pi || pi_cloned)`` per action (summed over its dimensions, mean over the H actions and the batch), of
        the Gaussians before the squash; zero without a cloned reference. With ``--anchor-filter`` (and the critics'
        ``features`` of the observations) only the observations where the critics do not prefer the actor's chunk
        to the cloned one count (the others count zero)."""
        if self.reference is None:
            return torch.zeros(())
        with torch.no_grad():
            reference = self.reference.gaussian(observations)
        actor = self.actor.gaussian(observations)
        kl = kl_divergence(actor, reference).sum(-1)
        if self.args.anchor_filter == "none" or features is None:
            return kl.mean() / self.args.horizon
        with torch.no_grad():  # the chunks played deterministically, squashed from the Gaussians above
            cloned_chunk, actor_chunk = self.actor.squash(reference.loc), self.actor.squash(actor.loc)
            if self.args.anchor_filter == "q":
                cloned_q = self.critic.min_q(features, cloned_chunk)
            else:
                cloned_q = torch.max(self.critic.q1(features, cloned_chunk), self.critic.q2(features, cloned_chunk))
            self.anchor_held = (cloned_q >= self.critic.min_q(features, actor_chunk)).float()
        return (self.anchor_held * kl).mean() / self.args.horizon

    def gradient_step(self, critic_only: bool = False) -> dict[str, float]:
        """One critic step on a replay batch, then (unless ``critic_only``: the warm-up) one actor and alpha step."""
        args = self.args
        observations, chunks, rewards, discounts, next_observations = self.replay.sample(args.batch_size)
        alpha = self.log_alpha.exp().detach()
        with torch.no_grad():
            next_chunks, next_logp = self.actor.head.sample(self.actor.encoder(next_observations))
            next_q = torch.min(*self.critic_target(next_observations, next_chunks)) - alpha * next_logp
            target = rewards + discounts * next_q
        q1, q2 = self.critic(observations, chunks)
        q_loss = F.mse_loss(q1, target) + F.mse_loss(q2, target)
        self.q_optimizer.zero_grad()
        q_loss.backward()
        self.q_optimizer.step()
        stats = {"q_loss": float(q_loss.detach()), "q": float(q1.mean().detach())}
        if not critic_only:
            new_chunks, logp = self.actor.head.sample(self.actor.encoder(observations))
            with torch.no_grad():
                features = self.critic.encoder(observations)
            anchor = self.anchor_kl(observations, features) if args.anchor_coef > 0 else torch.zeros(())
            actor_loss = (alpha * logp - self.critic.min_q(features, new_chunks)).mean()
            self.actor_optimizer.zero_grad()
            (actor_loss + args.anchor_coef * anchor).backward()
            self.actor_optimizer.step()
            if args.autotune:
                alpha_loss = -(self.log_alpha.exp() * (logp.detach() + self.target_entropy)).mean()
                self.alpha_optimizer.zero_grad()
                alpha_loss.backward()
                self.alpha_optimizer.step()
            stats.update(actor_loss=float(actor_loss.detach()), anchor_kl=float(anchor.detach()),
                         anchor_held=float(self.anchor_held.mean()),
                         entropy=float(-logp.mean().detach()), alpha=float(self.log_alpha.exp().detach()))  # fmt: skip
        with torch.no_grad():
            for param, target_param in zip(self.critic.parameters(), self.critic_target.parameters(), strict=True):
                target_param.lerp_(param, args.tau)
        return stats

    def update(self, critic_only: bool = False) -> dict[str, float]:
        """``gradient_steps`` gradient steps; the stats of the last."""
        stats: dict[str, float] = {}
        for _ in range(self.args.gradient_steps if len(self.replay) else 0):
            stats = self.gradient_step(critic_only)
        return stats

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, Any]:
        """Evaluates, runs ``iterations`` rounds of rollout + gradient steps, evaluates again.

        Returns ``{"eval_start", "eval_end", "episode_returns" (per iteration, the mean of the episodes that ended in
        it; NaN if none), "windows" (stored in the replay), "sources" (executed actions per source), "stats" (the
        executor's), "last_update", "seconds"}`` (and ``"warmup_q_loss"`` after a critic warm-up).
        """
        args = self.args
        env_fns = [self.make_env] * args.num_envs
        if args.async_envs:
            envs = AsyncLLMVectorEnv(env_fns, autoreset_mode=AutoresetMode.NEXT_STEP)
        else:
            envs = gym.vector.SyncVectorEnv(env_fns, autoreset_mode=AutoresetMode.NEXT_STEP)
        self.policy = self.make_policy(max_batch_size=args.num_envs, max_wait_ms=1.0, seed=args.seed)
        self.publish()
        executor = ChunkExecutor(
            envs,
            self.policy,
            period_s=0.005,  # unused on the simulated clock
            horizon=args.horizon,
            request_at=max(0, args.latency_ticks - 1),  # the next chunk arrives as the last action plays
            record_obs=True,
            latency_ticks=args.latency_ticks,
        )
        start = time.perf_counter()
        history: dict[str, Any] = {"episode_returns": [], "sources": dict.fromkeys(SOURCES, 0), "windows": 0}
        logger = RunLogger(self.run_dir, track=args.track, total_steps=args.iterations, progress=args.progress,
                           hparams=asdict(args), unit="iteration")  # fmt: skip
        try:
            history["eval_start"] = self.evaluate(executor, args.seed) if args.eval_rounds else float("nan")
            executor.reset(seed=args.seed)
            running = np.zeros(args.num_envs)
            warmup_iterations = args.critic_warmup_iterations if self.reference is not None else 0
            for _ in range(warmup_iterations):  # the critics learn the cloned policy's values; the actor waits
                rollout = executor.run(args.ticks_per_rollout)
                ended_episode_returns(rollout, running)
                history["windows"] += self.store(rollout)
                history["warmup_q_loss"] = self.update(critic_only=True).get("q_loss", float("nan"))
            for iteration in range(args.iterations):
                rollout = executor.run(args.ticks_per_rollout)
                ended = ended_episode_returns(rollout, running)
                history["episode_returns"].append(float(np.mean(ended)) if ended else float("nan"))
                for name in SOURCES:
                    history["sources"][name] += rollout.count(name)
                history["windows"] += self.store(rollout)
                history["last_update"] = self.update()
                self.publish()
                self.iteration = iteration + 1
                logger.log(
                    {
                        **{f"losses/{key}": value for key, value in history["last_update"].items()},
                        "charts/episodic_return": history["episode_returns"][-1],
                        "charts/version": self.version,
                        "time/wall_s": time.perf_counter() - start,
                    },
                    self.iteration,
                )
            history["stats"] = executor.stats()
            history["eval_end"] = self.evaluate(executor, args.seed) if args.eval_rounds else float("nan")
        finally:
            logger.close()
            self.policy.close()
            envs.close()
        history["seconds"] = time.perf_counter() - start
        return history


def summary(args: Args, result: dict[str, Any]) -> str:
    """The command line's report of a run: evaluation before and after, the replay, time."""
    return (
        f"SAC on chunks, {args.env}: {args.iterations} iterations in {result['seconds']:.1f} s; "
        f"{evaluation_text(args, result)}; "
        f"{result['windows']} windows of {args.horizon} executed actions in the replay"
    )


def cli() -> None:
    """``asyncvec-sac-chunks``, ``python -m asyncvec.agents.sac_chunks``, in a clone ``python agents/sac_chunks.py``."""
    args = parse_cli(Args)
    run_from_cli(lambda: SACChunks(args), lambda result: summary(args, result), name="SAC on chunks", saves="")


if __name__ == "__main__":
    cli()
