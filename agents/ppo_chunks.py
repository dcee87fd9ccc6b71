"""PPO on action chunks: a pixel policy plays H-action chunks at a control rate and learns from what was executed.

Run:   python agents/ppo_chunks.py --env asyncvec/PixelCartPole-v0 --iterations 30
Installed: asyncvec-ppo-chunks (or python -m asyncvec.agents.ppo_chunks) with the same options
Import: from asyncvec.agents.ppo_chunks import PPOChunks, Args; history = PPOChunks(Args(iterations=30)).train()

The policy maps the camera image to a factorized Gaussian over the next ``H`` actions
(`GaussianChunkPolicy`); a `ChunkExecutor` plays the chunks one action per control tick and
asks for the next chunk while the current one runs (docs/robots.md). The learner trains on the
EXECUTED actions, one sample per tick and env:

* **Whose choice.** Only the actions that are exactly a chunk's own sample
  (``rollout.policy_choice``) enter the policy loss. An action that the overlap rule blended
  (``ensemble``), the fallback supplied (the chunk ran out, or the policy missed its deadline),
  the safety layer replaced, or an autoreset step ignored is masked out: it is never trained on
  as the policy's choice.
* **Value targets.** Every env transition except the NEXT_STEP reset steps feeds the value
  targets and GAE, replaced actions included: the critic estimates the return of what the
  robot really does (fallbacks and safety replacements are part of that), and the advantage of
  a policy action sees the rewards that followed it, whoever chose the later actions.
* **Per-action log-probs.** The log-prob of action ``j`` of a chunk is ``log N(a_j; mu_j(o), sigma_j)``
  on its own, with ``o`` the observation the chunk was requested with
  (``rollout.chunk_obs``). The behavior log-prob of an executed action is its own chunk's
  (``rollout.action_logp``), and so is its version.
* **Staleness.** A chunk computed with version ``v`` may still be playing after the learner
  published ``v + 1`` (chunks in flight cross updates). Decoupled PPO (Hilton et al. 2022)
  corrects it: clip against the learner's policy at the start of the update (``pi_prox``), weight
  by ``min(pi_prox / mu, C)`` with ``mu`` the action's own chunk's log-prob (``--behavior-cap``).
  Actions older than ``--max-policy-lag`` versions are masked out.
* **Advantage.** GAE over the ticks with ``V`` of each tick's image: the action played at tick
  ``t`` is credited with the rewards from ``t`` on, compared with ``V(o_t)``.
* **After behaviour cloning** (``behavior_clone`` then ``train``, issue 50). Cloning freezes a copy
  of the network as the reference. ``train`` first runs ``--critic-warmup-iterations`` rollouts of
  the cloned policy that fit the critic alone (the actor does not move), so the first advantages
  are not the noise of an untrained critic; then every PPO update adds
  ``--anchor-coef * KL(pi || pi_cloned)`` (analytic, per action, over the minibatch's chunks),
  which holds the actor near the policy that was good. Without cloning there is no reference:
  neither applies. The defaults come from the ablation in ``benchmarks/chunk_suite.py``
  (docs/robots.md).

**What the network reads.** The camera image, resized to ``--image-size`` pixels a side, and, when the
observation is a ``Dict`` with a ``Text`` instruction, the instruction as a bag of words hashed into
``--instruction-buckets`` numbers (`asyncvec.control.HashedInstruction`), joined to the image's
features: a task whose instruction names the goal (asyncvec/PixelReach-v0) is learnable. Any env
whose observation is an image ``Box(H, W, C)`` or a ``Dict`` holding one under ``"image"`` works;
its ``gym.make`` options come from ``--env-kwargs``.

**The clock.** Learning runs the executor on a simulated clock by default
(``--latency-ticks 2``): each chunk arrives exactly 2 ticks after its request, ticks are not
paced, and the seeded policy computes requests one at a time, so a run replays exactly at any
machine load (same seed, same data, same result). On the wall clock (``--latency-ticks None``,
ticks ``--period-s`` apart, as on a robot) the share of ticks that play the fallback follows the
machine's load, and learning with it: beside 2 busy processes on 2 cores the policy answered in
220-350 ms against 8 ticks of 5 ms, 64-71% of the ticks played the fallback and no seed learned
(docs/robots.md).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
from gymnasium.vector import AutoresetMode

from asyncvec import AsyncLLMVectorEnv
from asyncvec.agents.common import anneal, layer_init, parse_cli, run_from_cli
from asyncvec.control import SOURCES, ChunkExecutor, ChunkRollout, HashedInstruction
from asyncvec.control.chunk_policy import GaussianChunkPolicy
from asyncvec.losses import decoupled_ppo_loss, gae, masked_mean
from asyncvec.metrics import RunLogger
from asyncvec.runs import RunFolder, check_env_id, run_name, seed_everything

RESET = SOURCES.index("reset")


@dataclass
class Args:
    env: str = "asyncvec/PixelCartPole-v0"
    """a registered env with Dict(image, instruction) observations and a Box action space, or module:EnvId
    (module, in the current folder or installed, registers EnvId when imported)"""
    env_kwargs: str = '{"size": 16}'
    """keyword arguments of gym.make, as JSON (the asyncvec/Pixel* envs take size: the camera image's side in pixels;
    give '{}' for an env that takes none)"""
    image_size: int = 16
    """side of the square image the network reads: camera images of another size are resized to it (bilinear)"""
    instruction_buckets: int = 64
    """a Dict observation's Text instruction is read as its words hashed into this many buckets, next to the image
    (0: the instruction is ignored)"""
    max_episode_steps: int = 200
    """time limit of an episode (0: the env's own)"""
    num_envs: int = 8
    """envs stepped in lockstep by the chunk executor"""
    async_envs: bool = False
    """step the envs in worker processes (AsyncLLMVectorEnv) instead of in this process"""
    horizon: int = 8
    """H: actions per chunk"""
    overlap: Literal["newest", "ensemble"] = "newest"
    """rule for overlapping chunks (ensembled actions are never trained on)"""
    period_s: float = 0.005
    """control period on the wall clock (seconds; a robot would use e.g. 0.02); unused by the simulated clock"""
    request_at: int | None = None
    """ask for the next chunk when this many actions remain (None: from the measured latency)"""
    latency_ticks: int | None = 2
    """simulated clock: each chunk arrives this many ticks after its request, ticks unpaced, the same
    data at any machine load (ChunkExecutor's latency_ticks); None: the wall clock at period_s"""
    ticks_per_rollout: int = 64
    """control ticks per rollout; a rollout gives ticks_per_rollout * num_envs samples"""
    iterations: int = 20
    """rollout + update rounds"""
    learning_rate: float = 1e-3
    """Adam learning rate (annealed linearly to 0 with anneal_lr)"""
    anneal_lr: bool = True
    """anneal the learning rate and the clip coefficient over the iterations, as agents/ppo.py: the last
    updates are small, so one noisy update at the end cannot undo the training"""
    update_epochs: int = 10
    """passes over each rollout"""
    num_minibatches: int = 1
    """minibatches per pass"""
    gamma: float = 0.98
    """discount"""
    gae_lambda: float = 0.8
    """GAE lambda"""
    clip_coef: float = 0.2
    """PPO clip range, against the learner's policy at the start of the update"""
    target_kl: float | None = 0.02
    """stop the update's epochs early once the approximate KL to pi_prox exceeds this (None: never)"""
    behavior_cap: float = 2.0
    """C: truncation of the behavior weight pi_prox / mu"""
    max_policy_lag: int = 2
    """actions from chunks more than this many versions old are masked out"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: float = 0.5
    """gradient clipping"""
    init_log_std: float = -0.5
    """initial log standard deviation of every chunk action"""
    eval_rounds: int = 2
    """evaluation: rounds of one episode per env, from reset (0: no evaluation)"""
    seed: int = 1
    """seed of torch, numpy and the envs"""
    torch_threads: int = 1
    """torch CPU threads for the learner"""
    track: bool = True
    """write TensorBoard logs to --log-dir/<run> (as CleanRL; --no-track writes none)"""
    log_dir: str = "runs"
    """TensorBoard log root"""
    progress: bool = True
    """show a progress bar over the iterations"""
    critic_warmup_iterations: int = 5
    """after behavior_clone: this many rollouts of the cloned policy that train the critic alone (the actor does not
    move) before the ``iterations`` of PPO, so the first advantages come from a fitted value and not from noise
    (0: none; no effect without behavior_clone)"""
    anchor_coef: float = 0.1
    """after behavior_clone: weight of the KL anchor ``KL(pi || pi_cloned)`` (per action, mean over the minibatch's
    chunks) in the loss, which holds the actor near the frozen cloned policy (0: none; no effect without
    behavior_clone)"""


class ObservationEncoder(nn.Module):
    """The flat observation (the image's pixels, then any other numbers: the hashed instruction) ->
    ``[B, 128]``: the image scaled to 0-1 and resized to ``image_size``, two stride-2 convolutions,
    then a linear layer over the convolutions' output and the other numbers, and a ReLU."""

    def __init__(self, image_space: gym.spaces.Box, extra: int, image_size: int) -> None:
        super().__init__()
        self.image_shape, self.image_size = tuple(image_space.shape), image_size
        self.image_numbers = int(np.prod(image_space.shape))
        low, high = float(np.min(image_space.low)), float(np.max(image_space.high))
        self.low, self.range = (low, high - low) if np.isfinite([low, high]).all() and high > low else (0.0, 1.0)
        side = image_size // 4
        self.convolutions = nn.Sequential(
            layer_init(nn.Conv2d(self.image_shape[2], 16, 4, stride=2, padding=1)), nn.ReLU(),
            layer_init(nn.Conv2d(16, 32, 4, stride=2, padding=1)), nn.ReLU(), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Sequential(layer_init(nn.Linear(32 * side * side + extra, 128)), nn.ReLU())

    def forward(self, observations: torch.Tensor) -> torch.Tensor:
        observations = observations.reshape(len(observations), -1)  # an image-only observation comes unflattened
        images = observations[:, : self.image_numbers].reshape(-1, *self.image_shape).permute(0, 3, 1, 2)
        images = (images - self.low) / self.range
        if images.shape[-2:] != (self.image_size, self.image_size):
            images = nn.functional.interpolate(images, size=(self.image_size,) * 2, mode="bilinear", antialias=True)
        return self.head(torch.cat([self.convolutions(images), observations[:, self.image_numbers :]], dim=1))


class ChunkActorCritic(nn.Module):
    """Two small encoders (actor and critic apart, as CleanRL's continuous PPO: the value loss, large
    at first, never washes out a warm-started actor); heads: a Gaussian over H actions, and a value.

    Inputs are flat observations ``[B, D]`` (``gymnasium.spaces.flatten`` of the observation:
    the image's pixels first). ``forward(observations)`` is the policy's view (``(mean [B, H, d],
    log_std [H, d])``), as `GaussianChunkPolicy` calls it.
    """

    def __init__(self, observation_space: gym.Space, image_size: int, horizon: int, action_space: gym.spaces.Box,
                 init_log_std: float) -> None:  # fmt: skip
        super().__init__()
        is_dict = isinstance(observation_space, gym.spaces.Dict)
        image_space = observation_space["image"] if is_dict else observation_space
        extra = gym.spaces.flatdim(observation_space) - int(np.prod(image_space.shape))
        self.horizon, self.action_dim = horizon, int(np.prod(action_space.shape))
        self.actor_encoder = ObservationEncoder(image_space, extra, image_size)
        self.critic_encoder = ObservationEncoder(image_space, extra, image_size)
        self.actor_mean = layer_init(nn.Linear(128, horizon * self.action_dim), std=0.01)
        self.critic = layer_init(nn.Linear(128, 1), std=1.0)
        self.log_std = nn.Parameter(torch.full((horizon, self.action_dim), float(init_log_std)))
        low, high = (torch.as_tensor(b, dtype=torch.float32).reshape(-1) for b in (action_space.low, action_space.high))
        self.register_buffer("center", (high + low) / 2)
        self.register_buffer("scale", (high - low) / 2)

    def forward(self, observations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chunk_mean(self.actor_encoder(observations)), self.log_std

    def chunk_mean(self, features: torch.Tensor) -> torch.Tensor:
        """Unsquashed, as CleanRL's continuous PPO: the executor clips what it executes, and a mean
        past a bound lets the policy become sure of a saturated action without shrinking sigma."""
        return self.center + self.scale * self.actor_mean(features).reshape(-1, self.horizon, self.action_dim)

    def value(self, observations: torch.Tensor) -> torch.Tensor:
        return self.critic(self.critic_encoder(observations)).squeeze(-1)

    def action_logp(
        self, chunk_obs: torch.Tensor, which: torch.Tensor, index: torch.Tensor, actions: torch.Tensor
    ) -> torch.Tensor:
        """log-prob of action ``index`` of the chunk requested with ``chunk_obs[which]``, on its own.

        (Several executed actions share a chunk: its observation goes through the network once.)
        """
        unique, inverse = torch.unique(which, return_inverse=True)
        mean = self.chunk_mean(self.actor_encoder(chunk_obs[unique]))[inverse, index]
        std = self.log_std[index].exp()
        return torch.distributions.Normal(mean, std).log_prob(actions).sum(-1)


@dataclass
class ChunkBatch:
    """One rollout flattened to ``T * num_envs`` samples (one per tick and env)."""

    observations: torch.Tensor  # the tick's observation, flat: value targets
    chunk_obs: torch.Tensor  # [num_chunks + 1]: the observation each chunk was requested with (last: zeros)
    chunk_row: torch.Tensor  # per sample: the row of its chunk in chunk_obs (the zeros row: no chunk)
    chunk_index: torch.Tensor  # j: the action's index in its chunk
    actions: torch.Tensor  # the chunk's own sample (unclipped), to which the log-prob belongs
    behavior_logp: torch.Tensor  # mu: the action's log-prob under its own chunk's policy version
    versions: torch.Tensor  # that version (-1: no chunk)
    prox_logp: torch.Tensor  # pi_prox: under the learner's weights at the start of the update
    advantages: torch.Tensor
    returns: torch.Tensor
    policy_mask: torch.Tensor  # trained on as the policy's choice
    value_mask: torch.Tensor  # an env transition (not a reset step)


class ChunkTask(RunFolder):
    """The env side that PPOChunks and SACChunks (agents/sac_chunks.py) share: the checked env settings (``args``:
    env, env_kwargs, max_episode_steps, instruction_buckets, horizon, num_envs, eval_rounds), ``make_env``,
    ``flatten``, ``evaluate`` and the chunk space. ``agent`` names the agent in error messages."""

    def __init__(self, args: Any, agent: str) -> None:
        self.args = args
        check_env_id(args.env)
        try:
            self.env_kwargs = json.loads(args.env_kwargs)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--env-kwargs {args.env_kwargs!r} is not JSON: {exc}") from None
        if not isinstance(self.env_kwargs, dict):
            raise ValueError(f"--env-kwargs must be a JSON object, got {args.env_kwargs!r}")
        try:
            probe = self.make_env()
        except TypeError as exc:  # an env that takes none of --env-kwargs
            raise ValueError(
                f"{args.env}: gym.make({args.env!r}, **{self.env_kwargs}) failed: {exc} (--env-kwargs)"
            ) from exc
        self.observation_space, self.action_space = probe.observation_space, probe.action_space
        probe.close()
        if not isinstance(self.action_space, gym.spaces.Box):
            raise ValueError(f"{args.env}: {agent} needs a Box action space, got {self.action_space}")
        space = self.observation_space
        image = space.spaces.get("image") if isinstance(space, gym.spaces.Dict) else space
        if not (isinstance(image, gym.spaces.Box) and len(image.shape) == 3):
            raise ValueError(
                f"{args.env}: {agent} needs image observations, a Box (height, width, channels) or a Dict holding "
                f"one under 'image' (and a Text 'instruction' if any), got {self.observation_space}"
            )
        self.chunk_space = gym.spaces.Box(
            np.broadcast_to(self.action_space.low, (args.horizon, *self.action_space.shape)),
            np.broadcast_to(self.action_space.high, (args.horizon, *self.action_space.shape)),
            dtype=np.float32,
        )

    # ------------------------------------------------------------------ where the run is (the command line's)
    checkpoint_path = None  # neither chunk agent keeps a checkpoint
    length_flag = "--iterations"
    iteration: int  # the iterations done (the agent counts them)
    policy: Any  # the acting policy, or None

    @property
    def position(self) -> str:
        """Where the run is, in words (the command line's Ctrl-C message)."""
        return f"iteration {self.iteration} of {self.args.iterations}"

    @property
    def work_left(self) -> int:
        return self.args.iterations - self.iteration

    def close(self) -> None:
        """Closes the acting policy (``train`` does this itself when it ends)."""
        if self.policy is not None:
            self.policy.close()

    def make_env(self) -> gym.Env:
        """The env as the policy sees it: a Dict observation keeps its image and its instruction, hashed."""
        kwargs: dict[str, Any] = dict(self.env_kwargs)
        if self.args.max_episode_steps > 0:
            kwargs["max_episode_steps"] = self.args.max_episode_steps
        env = gym.make(self.args.env, **kwargs)
        space = env.observation_space
        if isinstance(space, gym.spaces.Dict) and "image" in space.spaces:
            instruction = space.spaces.get("instruction")
            reads_instruction = self.args.instruction_buckets > 0 and isinstance(instruction, gym.spaces.Text)
            env = gym.wrappers.FilterObservation(env, ["image", "instruction"] if reads_instruction else ["image"])
            if reads_instruction:
                env = HashedInstruction(env, self.args.instruction_buckets)
        return env

    def flatten(self, observations: Any) -> torch.Tensor:
        """A batch of observations (``[N, ...]`` arrays, or a dict of them, as a vector env gives) as
        the network's input ``[N, D]``: the same order as ``gymnasium.spaces.flatten``."""
        if isinstance(self.observation_space, gym.spaces.Dict):
            parts = [np.asarray(observations[key]) for key in self.observation_space.spaces]
            parts = [part.reshape(len(part), -1) for part in parts]
            return torch.as_tensor(np.concatenate(parts, axis=1), dtype=torch.float32)
        array = np.asarray(observations)
        return torch.as_tensor(array.reshape(len(array), -1), dtype=torch.float32)

    def evaluate(self, executor: ChunkExecutor, seed: int) -> float:
        """Mean return of the first episode of every env, from reset (``eval_rounds`` rounds)."""
        returns = []
        limit = self.args.max_episode_steps or gym.spec(self.args.env).max_episode_steps or 1000
        record_obs, executor.record_obs = executor.record_obs, False
        try:
            for round_ in range(self.args.eval_rounds):
                executor.reset(seed=seed + 1000 * round_)
                totals, ended, ticks = np.zeros(self.args.num_envs), np.zeros(self.args.num_envs, dtype=bool), 0
                while not ended.all() and ticks <= limit:  # in slices: stop once every env's first episode ended
                    rollout = executor.run(min(50, limit + 1 - ticks))
                    ticks += len(rollout.rewards)
                    for rewards, done in zip(rollout.rewards, rollout.terminated | rollout.truncated, strict=True):
                        totals += np.where(ended, 0.0, rewards)  # up to and with the first end
                        ended |= done
                returns.extend(totals.tolist())
        finally:
            executor.record_obs = record_obs
        return float(np.mean(returns))


class PPOChunks(ChunkTask):
    """PPO from executed chunk actions (module docstring). ``train()`` returns a history dict."""

    def __init__(self, args: Args) -> None:
        self.args = args
        torch.set_num_threads(args.torch_threads)
        seed_everything(args.seed)
        super().__init__(args, "PPOChunks")
        self.agent = ChunkActorCritic(
            self.observation_space, args.image_size, args.horizon, self.action_space, args.init_log_std
        )
        self.optimizer = torch.optim.Adam(self.agent.parameters(), lr=args.learning_rate, eps=1e-5)
        self.version = 0
        self.clip_coef = args.clip_coef
        self.policy: GaussianChunkPolicy | None = None
        self.reference: ChunkActorCritic | None = None  # the frozen cloned policy (behavior_clone), the anchor's
        self.iteration = 0
        self.run_name = run_name(args.env, "ppo_chunks", "sim" if args.latency_ticks is not None else "wall", args.seed)

    def make_policy(self, **kwargs: Any) -> GaussianChunkPolicy:
        """A `GaussianChunkPolicy` over a copy of the learner's network, reading whole observations."""
        network = copy.deepcopy(self.agent)
        return GaussianChunkPolicy(network, self.chunk_space, observation_space=self.observation_space, **kwargs)

    # ------------------------------------------------------------------ acting
    def publish(self) -> None:
        """A new version of the learner's weights for the acting policy."""
        self.version += 1
        if self.policy is not None:
            self.policy.load_weights(copy.deepcopy(self.agent.state_dict()), self.version)

    # ------------------------------------------------------------------ learning
    def behavior_clone(self, observations: Any, chunks: np.ndarray, steps: int, batch_size: int = 128) -> float:
        """A warm start: regress the chunk mean on demonstration chunks ``[N, H, *action_shape]``, each
        after its observation (a batch as `flatten` takes, from ``make_env()``'s envs); returns the last loss."""
        inputs = self.flatten(observations)
        targets = torch.as_tensor(chunks, dtype=torch.float32).reshape(len(chunks), self.args.horizon, -1)
        loss = torch.zeros(())
        for _ in range(steps):
            idx = torch.randint(len(inputs), (batch_size,))
            loss = ((self.agent(inputs[idx])[0] - targets[idx]) ** 2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
        self.reference = copy.deepcopy(self.agent).requires_grad_(False)  # what RL is anchored to
        self.publish()
        return float(loss.detach())

    def prepare(self, rollout: ChunkRollout) -> ChunkBatch:
        """Flattens a rollout: masks, each action's own behavior log-prob and version, GAE."""
        args, agent = self.args, self.agent
        if rollout.observations is None:
            raise ValueError("prepare needs a rollout from ChunkExecutor(record_obs=True)")
        T, n = rollout.rewards.shape
        observations = torch.stack([self.flatten(obs) for obs in rollout.observations])  # [T, n, D]
        chunk_ids = sorted(rollout.chunk_obs)
        flat = [gym.spaces.flatten(self.observation_space, rollout.chunk_obs[c]) for c in chunk_ids]
        chunk_obs = torch.as_tensor(np.stack([*flat, np.zeros(observations.shape[2])]), dtype=torch.float32)
        row_of = {c: row for row, c in enumerate(chunk_ids)}
        chunk_row = torch.as_tensor([row_of.get(int(c), len(chunk_ids)) for c in rollout.chunk_id.reshape(-1)])
        index = torch.as_tensor(rollout.chunk_index.reshape(-1)).clamp(min=0)
        actions = torch.as_tensor(rollout.proposed.reshape(T * n, -1), dtype=torch.float32)
        behavior = torch.as_tensor(rollout.action_logp.reshape(-1), dtype=torch.float32)
        versions = torch.as_tensor(rollout.policy_version.reshape(-1))
        policy_mask = (
            torch.as_tensor(rollout.policy_choice.reshape(-1))
            & torch.isfinite(behavior)
            & (versions >= self.version - args.max_policy_lag)
        )
        value_mask = torch.as_tensor(rollout.source.reshape(-1) != RESET)
        with torch.no_grad():
            values = agent.value(observations.flatten(0, 1)).reshape(T, n)
            bootstrap = agent.value(self.flatten(rollout.next_obs))
            # NEXT_STEP autoreset: the observation after a truncated step is its final observation
            next_values = torch.cat([values[1:], bootstrap.unsqueeze(0)])
            advantages, returns = gae(
                torch.as_tensor(rollout.rewards, dtype=torch.float32),
                values,
                bootstrap,
                torch.as_tensor(rollout.terminated),
                torch.as_tensor(rollout.truncated),
                gamma=args.gamma,
                lam=args.gae_lambda,
                final_values=next_values,
            )
            prox = agent.action_logp(chunk_obs, chunk_row, index, actions)
        return ChunkBatch(
            observations.flatten(0, 1),
            chunk_obs,
            chunk_row,
            index,
            actions,
            torch.nan_to_num(behavior),
            versions,
            prox,
            advantages.reshape(-1),
            returns.reshape(-1),
            policy_mask,
            value_mask,
        )

    def value_loss(self, batch: ChunkBatch, idx: torch.Tensor) -> torch.Tensor:
        """Half the squared error of the value against the GAE returns, on every env transition."""
        values = self.agent.value(batch.observations[idx])
        return 0.5 * masked_mean((values - batch.returns[idx]) ** 2, batch.value_mask[idx])

    def anchor_kl(self, batch: ChunkBatch, idx: torch.Tensor) -> torch.Tensor:
        """``KL(pi || pi_cloned)`` of one action (summed over its dimensions, mean over the H actions and the
        minibatch's chunks), analytic for the two Gaussians; zero without a cloned reference."""
        rows = torch.unique(batch.chunk_row[idx])
        rows = rows[rows < len(batch.chunk_obs) - 1]  # the last row is the zeros of "no chunk"
        if self.reference is None or len(rows) == 0:
            return torch.zeros(())
        mean, log_std = self.agent(batch.chunk_obs[rows])
        with torch.no_grad():
            reference_mean, reference_log_std = self.reference(batch.chunk_obs[rows])
        kl = (
            reference_log_std
            - log_std
            + ((2 * log_std).exp() + (mean - reference_mean) ** 2) / (2 * (2 * reference_log_std).exp())
            - 0.5
        )
        return kl.sum(-1).mean()

    def loss(self, batch: ChunkBatch, idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Decoupled PPO on the policy's own actions, the KL anchor to the cloned policy, and the value loss on
        every env transition."""
        mask = batch.policy_mask[idx]
        advantages = batch.advantages[idx]
        if mask.any():
            mean, std = advantages[mask].mean(), advantages[mask].std().nan_to_num(0.0)
            advantages = (advantages - mean) / (std + 1e-8)
        logp = self.agent.action_logp(batch.chunk_obs, batch.chunk_row[idx], batch.chunk_index[idx], batch.actions[idx])
        policy_loss, stats = decoupled_ppo_loss(
            logp,
            batch.prox_logp[idx],
            batch.behavior_logp[idx],
            advantages,
            clip_coef=self.clip_coef,
            behavior_cap=self.args.behavior_cap,
            mask=mask,
        )
        if not mask.any():
            policy_loss = 0.0 * logp.sum()
        anchor = self.anchor_kl(batch, idx) if self.args.anchor_coef > 0 else torch.zeros(())
        value_loss = self.value_loss(batch, idx)
        stats = {**stats, "policy_loss": policy_loss.detach(), "value_loss": value_loss.detach(),
                 "anchor_kl": anchor.detach()}  # fmt: skip
        return policy_loss + self.args.anchor_coef * anchor + self.args.vf_coef * value_loss, stats

    def update(self, batch: ChunkBatch, critic_only: bool = False) -> dict[str, float]:
        """``update_epochs`` passes over the batch; ``critic_only``: the value loss alone (the critic warm-up:
        the actor's parameters get no gradient, so Adam leaves them where they are)."""
        size = len(batch.advantages)
        minibatch = max(1, size // self.args.num_minibatches)
        stats: dict[str, torch.Tensor] = {}
        for _ in range(self.args.update_epochs):
            order = torch.randperm(size)
            for start in range(0, size, minibatch):
                if critic_only:
                    value_loss = self.value_loss(batch, order[start : start + minibatch])
                    loss, stats = self.args.vf_coef * value_loss, {"value_loss": value_loss.detach()}
                else:
                    loss, stats = self.loss(batch, order[start : start + minibatch])
                self.optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(self.agent.parameters(), self.args.max_grad_norm)
                self.optimizer.step()
            if not critic_only and self.args.target_kl is not None and stats["approx_kl"] > self.args.target_kl:
                break
        return {key: float(value) for key, value in stats.items()}

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, Any]:
        """Evaluates, runs ``iterations`` rounds of rollout + update, evaluates again.

        Returns ``{"eval_start", "eval_end", "episode_returns" (per iteration, the mean of the
        episodes that ended in it; NaN if none), "trained_fraction" (share of executed actions
        trained on as the policy's choice), "sources" (executed actions per source), "stats"
        (the executor's), "seconds"}``.
        """
        args = self.args
        env_fns = [self.make_env] * args.num_envs
        if args.async_envs:
            envs = AsyncLLMVectorEnv(env_fns, autoreset_mode=AutoresetMode.NEXT_STEP)
        else:
            envs = gym.vector.SyncVectorEnv(env_fns, autoreset_mode=AutoresetMode.NEXT_STEP)
        self.policy = self.make_policy(max_batch_size=args.num_envs, max_wait_ms=1.0, seed=args.seed)
        self.policy.load_weights(copy.deepcopy(self.agent.state_dict()), self.version + 1)
        self.version += 1
        executor = ChunkExecutor(
            envs,
            self.policy,
            period_s=args.period_s,
            horizon=args.horizon,
            overlap=args.overlap,
            request_at=args.request_at,
            record_obs=True,
            latency_ticks=args.latency_ticks,
        )
        start = time.perf_counter()
        history: dict[str, Any] = {"episode_returns": [], "sources": dict.fromkeys(SOURCES, 0)}
        logger = RunLogger(
            self.run_dir,
            track=args.track,
            total_steps=args.iterations,
            progress=args.progress,
            hparams=asdict(args),
            unit="iteration",
        )
        try:
            history["eval_start"] = self.evaluate(executor, args.seed) if args.eval_rounds else float("nan")
            executor.reset(seed=args.seed)
            running = np.zeros(args.num_envs)
            warmup_iterations = args.critic_warmup_iterations if self.reference is not None else 0
            for _ in range(warmup_iterations):  # the critic learns the cloned policy's values; the actor waits
                rollout = executor.run(args.ticks_per_rollout)
                ended_episode_returns(rollout, running)
                history["warmup_value_loss"] = self.update(self.prepare(rollout), critic_only=True)["value_loss"]
            trained = executed = 0
            for iteration in range(args.iterations):
                frac = 1.0 - iteration / args.iterations if args.anneal_lr else 1.0
                self.clip_coef = anneal(self.optimizer, args.learning_rate, args.clip_coef, frac)
                tick = time.perf_counter()
                rollout = executor.run(args.ticks_per_rollout)
                history["act_seconds"] = history.get("act_seconds", 0.0) + time.perf_counter() - tick
                ended = ended_episode_returns(rollout, running)
                history["episode_returns"].append(float(np.mean(ended)) if ended else float("nan"))
                for name in SOURCES:
                    history["sources"][name] += rollout.count(name)
                batch = self.prepare(rollout)
                trained += int(batch.policy_mask.sum())
                executed += int(batch.value_mask.sum())
                tick = time.perf_counter()
                history["last_update"] = self.update(batch)
                history["learn_seconds"] = history.get("learn_seconds", 0.0) + time.perf_counter() - tick
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
            history["trained_fraction"] = trained / max(1, executed)
            history["stats"] = executor.stats()
            history["eval_end"] = self.evaluate(executor, args.seed) if args.eval_rounds else float("nan")
        finally:
            logger.close()
            self.policy.close()
            envs.close()
        history["seconds"] = time.perf_counter() - start
        return history


def ended_episode_returns(rollout: ChunkRollout, running: np.ndarray) -> list[float]:
    """The returns of the episodes that ended in the rollout; ``running`` (per env, the return so far) is updated."""
    ended = []
    for row in range(len(rollout.rewards)):
        running += rollout.rewards[row]
        for env_id in np.flatnonzero(rollout.terminated[row] | rollout.truncated[row]):
            ended.append(float(running[env_id]))
            running[env_id] = 0.0
    return ended


def evaluation_text(args: Any, result: dict[str, Any]) -> str:
    """A chunk agent's evaluation before and after training, in words (its summary line's)."""
    if not args.eval_rounds:
        return "not evaluated (--eval-rounds 0)"
    return (
        f"mean return of {args.eval_rounds} x {args.num_envs} evaluation episodes {result['eval_start']:.1f} -> "
        f"{result['eval_end']:.1f}"
    )


def summary(args: Args, result: dict[str, Any]) -> str:
    """The command line's report of a run: evaluation before and after, what was trained on, time."""
    sources = ", ".join(f"{name} {count}" for name, count in result["sources"].items())
    return (
        f"PPO on chunks, {args.env}: {args.iterations} iterations in {result['seconds']:.1f} s; "
        f"{evaluation_text(args, result)}; "
        f"{result['trained_fraction']:.0%} of the executed actions trained on (executed actions by source: {sources})"
    )


def cli() -> None:
    """``asyncvec-ppo-chunks``, ``python -m asyncvec.agents.ppo_chunks``, in a clone ``python agents/ppo_chunks.py``."""
    args = parse_cli(Args)
    run_from_cli(lambda: PPOChunks(args), lambda result: summary(args, result), name="PPO on chunks", saves="")


if __name__ == "__main__":
    cli()
