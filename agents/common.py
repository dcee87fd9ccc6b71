"""Pieces the agents share: env and policy construction, Ray collectors, command-line errors and summaries."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import gymnasium as gym
import numpy as np
import torch
import tyro
from gymnasium.vector import AutoresetMode

from asyncvec import AsyncLLMVectorEnv
from asyncvec.envs.slow import SlowEnv
from asyncvec.extras import MissingExtraError, missing_env_extra
from asyncvec.inference import BatchedPolicy, LatencyModel, TorchPolicy
from asyncvec.lm.results import summary
from asyncvec.runs import check_env_id
from asyncvec.versioning import LaggedWeights

if TYPE_CHECKING:
    from asyncvec import VersionManager
    from asyncvec.distributed import DistributedCollector, RayCollectors
    from asyncvec.lm.options import LMArgs
    from asyncvec.lm.training import LMAgent


def env_spaces(env_id: str) -> tuple[gym.Space, gym.Space]:
    """The single-env observation and action spaces of ``env_id``, from one env built and closed here
    (so an agent can refuse unsupported spaces before it starts any worker)."""
    check_env_id(env_id)
    try:
        env = flat_observations(gym.make(env_id))
    except gym.error.DependencyNotInstalled as exc:
        missing = missing_env_extra(env_id, exc)
        if missing is None:
            raise
        raise missing from exc
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def flat_observations(env: gym.Env) -> gym.Env:
    """``env`` with flat vector observations, as the agents' MLPs take them: a 1-D Box is kept, any
    other space of numbers is flattened (``gym.wrappers.FlattenObservation``: a Discrete observation
    becomes a one-hot vector, an image a vector, a Tuple or Dict the concatenation of its parts).
    Anything else (Text, for one) is kept, for the agent to refuse.

    Example:
        >>> flat_observations(gym.make("FrozenLake-v1")).observation_space
        Box(0, 1, (16,), int64)
    """
    space = env.observation_space
    if isinstance(space, gym.spaces.Box) and len(space.shape) == 1:
        return env
    return gym.wrappers.FlattenObservation(env) if _numeric_leaves(space) else env


def _numeric_leaves(space: gym.Space) -> bool:
    """Whether every leaf of ``space`` is a number array (gymnasium would also "flatten" Text into
    character indices, which no MLP should read as a vector)."""
    if isinstance(space, gym.spaces.Tuple):
        return all(_numeric_leaves(s) for s in space.spaces)
    if isinstance(space, gym.spaces.Dict):
        return all(_numeric_leaves(s) for s in space.spaces.values())
    return isinstance(space, (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary))


def stored_action_space(action_space: gym.Space) -> gym.Space:
    """The space a rollout stores actions in: a Box becomes unbounded (same shape and dtype), because
    the stored action is the policy's unclipped sample, the one its log-prob belongs to; the env
    executes it clipped into ``action_space``. Other spaces are kept.

    Example:
        >>> stored_action_space(gym.spaces.Box(-2.0, 2.0, (1,)))
        Box(-inf, inf, (1,), float32)
    """
    if isinstance(action_space, gym.spaces.Box):
        return gym.spaces.Box(-np.inf, np.inf, action_space.shape, action_space.dtype)
    return action_space


def make_env_fn(
    env_id: str,
    env_latency_ms: float = 0.0,
    distribution: str = "fixed",
    seed: int | None = None,
    normalize_obs: bool = False,
) -> Callable[[], gym.Env]:
    """A picklable function building ``env_id``, slowed by a sleeping SlowEnv when asked, its
    observations normalized by running statistics (gymnasium's NormalizeObservation) when asked."""

    def make() -> gym.Env:
        env = flat_observations(gym.make(env_id))
        if normalize_obs:
            env = gym.wrappers.NormalizeObservation(env)
        if env_latency_ms > 0:
            env = SlowEnv(env, latency_ms=env_latency_ms, distribution=distribution, seed=seed)
        return env

    return make


@dataclass
class EnvAgentArgs:
    """The options PPO and SAC share (where the envs run, how they fail, seeds, logs, checkpoints); each agent's
    ``Args`` adds its algorithm's options below these and may change their defaults."""

    env: str = "CartPole-v1"
    """gymnasium env id, or module:EnvId for your own env: module (a file in the current folder or an installed
    package) is imported first and registers EnvId (mymod:MyEnv-v0)"""
    num_envs: int = 8
    """number of parallel envs"""
    mode: Literal["sync", "async"] = "async"
    """sync: act then learn, in turn; async: a collector thread acts while the learner trains"""
    backend: Literal["local", "ray"] = "local"
    """local: env worker processes here; ray: collector actors (envs + a copy of the policy each) on a Ray cluster"""
    ray_address: str | None = None
    """Ray cluster for --backend ray (default: $RAY_ADDRESS, else a local Ray started for the run)"""
    ray_collectors: int = 2
    """collector actors for --backend ray; the envs are split among them"""
    policy_latency_ms: float = 0.0
    """latency of each policy call (a LatencyModel playing a remote model server)"""
    env_latency_ms: float = 0.0
    """latency of each env step (a sleeping SlowEnv playing a slow simulator)"""
    env_latency_dist: Literal["fixed", "uniform", "lognormal"] = "fixed"
    """distribution of the env latency (lognormal: heavy-tailed, e.g. a robot or a remote simulator)"""
    max_restarts: int = 0
    """times each env may be rebuilt after a crash or hang (episode truncated); envs then stay in workers"""
    step_timeout: float | None = None
    """seconds an env step may take before its worker counts as hung (killed; rebuilt with --max-restarts)"""
    total_timesteps: int = 100_000
    """env steps to train for"""
    target_return: float | None = None
    """stop once the mean return of the recent episodes reaches this"""
    seed: int = 1
    """seed of torch, numpy and the envs"""
    track: bool = False
    """write TensorBoard logs to --log-dir"""
    log_dir: str = "runs"
    """TensorBoard log root"""
    progress: bool = True
    """show a progress bar"""
    checkpoint_dir: str | None = None
    """save checkpoints here (weights, optimizers, version, RNG state, and what the agent keeps)"""
    resume: bool = False
    """continue from the checkpoint in --checkpoint-dir"""
    torch_threads: int = 1
    """torch CPU threads for the learner (small nets run faster on one)"""

    def __post_init__(self) -> None:
        """Refuses run options out of range with one line naming the flag."""
        if self.backend == "ray" and self.mode != "async":
            raise ValueError("--backend ray runs remote collectors: it needs --mode async")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.step_timeout is not None and self.step_timeout <= 0:
            raise ValueError(f"--step-timeout must be > 0 seconds (or None), got {self.step_timeout}")
        if self.backend == "ray" and (self.max_restarts or self.step_timeout is not None):
            raise ValueError("--max-restarts and --step-timeout are for --backend local (Ray restarts its own actors)")
        for name in ("num_envs", "total_timesteps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("policy_latency_ms", "env_latency_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (milliseconds), got {getattr(self, name)}")


def make_vector_env(
    env_id: str,
    num_envs: int,
    env_latency_ms: float = 0.0,
    batch_size: int | None = None,
    distribution: str = "fixed",
    normalize_obs: bool = False,
    max_restarts: int = 0,
    step_timeout: float | None = None,
) -> AsyncLLMVectorEnv:
    """Worker processes with SAME_STEP autoreset (no wasted reset steps), shared by both modes; ``max_restarts``
    and ``step_timeout`` as ``AsyncLLMVectorEnv`` takes them (either keeps the envs in worker processes)."""
    check_env_id(env_id)
    return AsyncLLMVectorEnv(
        [make_env_fn(env_id, env_latency_ms, distribution, i, normalize_obs) for i in range(num_envs)],
        batch_size=batch_size,
        autoreset_mode=AutoresetMode.SAME_STEP,
        max_restarts=max_restarts,
        step_timeout=step_timeout,
    )


def make_policy(
    module: torch.nn.Module, action_space: gym.Space, num_envs: int, policy_latency_ms: float = 0.0
) -> BatchedPolicy:
    """A TorchPolicy, behind a LatencyModel playing a remote model server when latency > 0.

    The server takes batches of up to ``num_envs``, waits up to 2 ms to fill one, and serves
    several batches at once, as an inference engine with continuous batching does.
    """
    local = TorchPolicy(module, action_space, max_batch_size=num_envs, max_wait_ms=1.0)
    if policy_latency_ms <= 0:
        return local
    return LatencyModel(
        local, a_ms=policy_latency_ms, b_ms=0.0, max_batch_size=num_envs, max_wait_ms=2.0, max_inflight_batches=4
    )


def final_observations(next_obs: np.ndarray, done: np.ndarray, info: dict[str, Any]) -> np.ndarray:
    """The observation each step ended in: SAME_STEP autoreset puts it in ``info["final_obs"]``."""
    final = next_obs.copy()
    if done.any():
        final[done] = np.stack(info["final_obs"][done])
    return final


def layer_init(layer: torch.nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> torch.nn.Linear:
    """Orthogonal init, as in CleanRL."""
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def make_ray_collectors(
    env_id: str,
    num_envs: int,
    env_latency_ms: float = 0.0,
    distribution: str = "fixed",
    *,
    address: str | None = None,
    num_collectors: int = 2,
    normalize_obs: bool = False,
) -> RayCollectors:
    """``--backend ray``: collector actors on a Ray cluster hosting the envs (SAME_STEP autoreset)."""
    from asyncvec.distributed import RayCollectors

    check_env_id(env_id)
    env_fns = [
        make_env_fn(env_id, env_latency_ms, distribution, seed=i, normalize_obs=normalize_obs) for i in range(num_envs)
    ]
    return RayCollectors(
        env_fns, num_collectors=num_collectors, address=address, autoreset_mode=AutoresetMode.SAME_STEP
    )


def make_ray_collector(
    envs: RayCollectors,
    actor: torch.nn.Module,
    sink: Any,
    versions: VersionManager,
    *,
    policy_latency_ms: float = 0.0,
    policy_lag: int = 0,
    seed: int | None = None,
    pace: Callable[[int], None] | None = None,
) -> DistributedCollector:
    """A DistributedCollector whose actors each act with a copy of ``actor`` (as `make_policy`
    builds it), registered with ``versions`` so that every publication reaches them."""
    from asyncvec.distributed import DistributedCollector

    largest = max(stop - start for start, stop in envs.slices)
    policy_fn = functools.partial(
        make_policy, copy.deepcopy(actor), envs.single_action_space, largest, policy_latency_ms
    )
    collector = DistributedCollector(envs, policy_fn, sink, version_manager=versions, seed=seed, pace=pace)
    versions.register(LaggedWeights(collector, policy_lag))
    if versions.current_version > 0:  # resumed from a checkpoint: act with its weights and version
        collector.load_weights({k: v.detach().clone() for k, v in actor.state_dict().items()}, versions.current_version)
    return collector


def anneal(optimizer: torch.optim.Optimizer, learning_rate: float, clip_coef: float, frac: float) -> float:
    """Sets ``optimizer``'s learning rate to ``frac * learning_rate`` (``frac`` is the share of the
    run left) and returns PPO's clip coefficient annealed with it, floored at 5%.

    Example:
        >>> anneal(torch.optim.Adam([torch.zeros(1, requires_grad=True)]), 1e-3, 0.2, 0.5)
        0.1
    """
    frac = max(frac, 0.0)
    for group in optimizer.param_groups:
        group["lr"] = frac * learning_rate
    return clip_coef * max(frac, 0.05)


def final_return_text(final_return: float, last: int) -> str:
    """The summary's words for the mean return of the last ``last`` episodes (NaN: none finished).

    Example:
        >>> final_return_text(float("nan"), 20)
        'no episode finished yet'
    """
    if np.isnan(final_return):
        return "no episode finished yet"
    return f"final return (last {last} episodes) {final_return:.1f}"


@contextlib.contextmanager
def exit_on_missing_extra(name: str) -> Iterator[None]:
    """The agents' command lines: a missing optional library (`MissingExtraError`) ends the run with
    its one-line message, ``{name}: ... install it with: pip install 'asyncvec[...]'``, and exit code
    1, not a traceback."""
    try:
        yield
    except MissingExtraError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


@contextlib.contextmanager
def exit_on_setup_error(name: str) -> Iterator[None]:
    """The agents' command lines, around building the agent: what the settings or the env got wrong
    (an unknown env id, spaces the agent cannot take, an env whose library is missing) ends the run
    with its one-line message and exit code 2, not a traceback; a missing extra as in
    `exit_on_missing_extra`. Errors once training runs keep their traceback, and so do these with
    ``ASYNCVEC_TRACEBACK=1``."""
    with exit_on_missing_extra(name):
        try:
            yield
        except (ValueError, gym.error.Error) as exc:
            if os.environ.get("ASYNCVEC_TRACEBACK"):
                raise
            print(f"{name}: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None


def run_from_cli(build: Callable[[], Any], summary: Callable[[Any], str], log_path: Callable[[Any], Path],
                 checkpoint_path: Callable[[Any], Path | None], saves: str, track: bool, log_dir: str,
                 name: str) -> Any | None:  # fmt: skip
    """The agents' command line: builds the agent, trains it, prints ``summary(result)`` and where the
    logs and the checkpoint went. Ctrl-C stops the run cleanly (``train`` closes envs, workers and
    threads) and says at which step and where its checkpoint is. ``saves`` says when a checkpoint is
    written (e.g. "after every update"); a setup error ends it in one line (`exit_on_setup_error`)."""

    def checkpoint_line(agent: Any) -> str:
        path = checkpoint_path(agent) if agent is not None else None
        if path is None:
            return f"none (--checkpoint-dir DIR saves one {saves})"
        return str(path) if path.exists() else f"none yet ({path} is written {saves})"

    agent = None
    try:
        with exit_on_setup_error(name):
            agent = build()
        with exit_on_missing_extra(name):
            result = agent.train()
    except KeyboardInterrupt:
        step = agent.global_step if agent is not None else 0
        print(f"\nstopped at step {step}, checkpoint at {checkpoint_line(agent)}")
        return None
    print(summary(result))
    logs = f"{log_path(agent)} (TensorBoard)" if track else f"not written (--track writes them to {log_dir}/)"
    print(f"logs: {logs}; checkpoint: {checkpoint_line(agent)}")
    return result


def lm_cli(agent_cls: type[LMAgent], args_cls: type[LMArgs]) -> None:
    """The command line of a language-model agent: ``args_cls`` from ``sys.argv`` (tyro), the agent built
    (a wrong setting ends the run in one line), trained, its summary printed."""
    args = tyro.cli(args_cls)
    label = agent_cls.run_label(args)
    with exit_on_setup_error(label):
        agent = agent_cls(args)
    with exit_on_missing_extra(label):
        print(summary(label, agent.train()))
