"""Pieces the agents share: env and policy construction, Ray collectors, command-line errors and summaries."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import json
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
from asyncvec.agents.run_errors import TRACEBACK_VARIABLE, first_line, report_run_error
from asyncvec.envs.slow import SlowEnv
from asyncvec.extras import MissingExtraError, missing_env_extra
from asyncvec.inference import BatchedPolicy, LatencyModel, TorchPolicy
from asyncvec.lifecycle import interrupts_outside_locks
from asyncvec.lm.results import LMTrainResult, summary
from asyncvec.runs import check_env_id
from asyncvec.versioning import with_lag

if TYPE_CHECKING:
    from asyncvec import VersionManager
    from asyncvec.distributed import DistributedCollector, RayCollectors
    from asyncvec.lm.options import LMArgs
    from asyncvec.lm.training import LMAgent


def env_spaces(env_id: str, env_kwargs: dict[str, Any] | None = None) -> tuple[gym.Space, gym.Space]:
    """The single-env observation and action spaces of ``env_id`` (made with ``env_kwargs``), from one env built
    and closed here (so an agent can refuse unsupported spaces before it starts any worker)."""
    check_env_id(env_id)
    try:
        env = flat_observations(gym.make(env_id, **(env_kwargs or {})))
    except gym.error.DependencyNotInstalled as exc:
        missing = missing_env_extra(env_id, exc)
        if missing is None:
            raise
        raise missing from exc
    except TypeError as exc:  # an env that takes none of --env-kwargs
        if not env_kwargs:
            raise
        raise ValueError(
            f"{env_id}: gym.make({env_id!r}, **{env_kwargs}) failed: {exc}; fix or leave out --env-kwargs"
        ) from exc
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


def registered_spec(env_id: str) -> tuple[gym.envs.registration.EnvSpec, ...]:
    """``env_id``'s registration, for a process started fresh (``spawn``) that has not run the code registering it
    (an env registered in the user's script); ``()`` for an id gymnasium resolves by itself."""
    try:
        return (gym.spec(env_id),)
    except gym.error.Error:
        return ()


def make_env_fn(
    env_id: str,
    env_latency_ms: float = 0.0,
    distribution: str = "fixed",
    seed: int | None = None,
    normalize_obs: bool = False,
    env_kwargs: dict[str, Any] | None = None,
) -> Callable[[], gym.Env]:
    """A picklable function building ``env_id`` (``gym.make(env_id, **env_kwargs)``), slowed by a sleeping
    SlowEnv when asked, its observations normalized by running statistics (gymnasium's NormalizeObservation)
    when asked."""
    kwargs = dict(env_kwargs or {})

    def make() -> gym.Env:
        env = flat_observations(gym.make(env_id, **kwargs))
        if normalize_obs:
            env = gym.wrappers.NormalizeObservation(env)
        if env_latency_ms > 0:
            env = SlowEnv(env, latency_ms=env_latency_ms, distribution=distribution, seed=seed)
        return env

    return make


NOT_REPLAYED = frozenset(  # options that do not change what PPO's learner computes from a segment (--replay)
    {
        "mode",
        "backend",
        "ray_address",
        "ray_collectors",
        "policy_latency_ms",
        "env_latency_ms",
        "env_latency_dist",
        "max_restarts",
        "step_timeout",
        "envs_per_worker",
        "target_return",
        "track",
        "log_dir",
        "progress",
        "checkpoint_dir",
        "resume",
        "record_schedule",
        "replay",
    }
)


@dataclass
class EnvAgentArgs:
    """The options PPO and SAC share (where the envs run, how they fail, seeds, logs, checkpoints); each agent's
    ``Args`` adds its algorithm's options below these and may change their defaults."""

    env: str = "CartPole-v1"
    """gymnasium env id, or module:EnvId for your own env: module (a file in the current folder or an installed
    package) is imported first and registers EnvId (mymod:MyEnv-v0)"""
    env_kwargs: str = "{}"
    """keyword arguments of gym.make(--env) as JSON, e.g. '{"g": 9.81}'"""
    num_envs: int = 8
    """number of parallel envs"""
    mode: Literal["sync", "async"] = "async"
    """sync: act then learn, in turn; async: a collector acts while the learner trains (PPO: in a process of its own)"""
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
    """times each env may be rebuilt after a crash or hang (episode truncated)"""
    step_timeout: float | None = None
    """seconds an env step may take before its worker counts as hung (killed; rebuilt with --max-restarts)"""
    envs_per_worker: int | None = None
    """envs each worker process hosts (default: one, as gymnasium's AsyncVectorEnv; cheap CPU-bound envs run faster
    shared, and the run's last line advises a value measured from the env's own first steps)"""
    total_timesteps: int = 100_000
    """env steps to train for"""
    target_return: float | None = None
    """stop once the mean return of the recent episodes reaches this"""
    seed: int = 1
    """seed of torch, numpy and the envs"""
    track: bool = True
    """write TensorBoard logs to --log-dir/<run> (as CleanRL; --no-track writes none)"""
    log_dir: str = "runs"
    """TensorBoard log root (a resumed run keeps writing to its own folder there)"""
    progress: bool = True
    """show a progress bar"""
    checkpoint_dir: str | None = None
    """save checkpoints here (weights, optimizers, version, RNG state, and what the agent keeps)"""
    resume: bool = False
    """continue from the checkpoint in --checkpoint-dir"""
    torch_threads: int = 1
    """torch CPU threads for the learner (small nets run faster on one)"""
    record_schedule: bool = False
    """write each update's data (the samples with their behaviour versions and log-probs, as timing gathered them)
    and the learner's version into <log-dir>/<run>/schedule, for --replay (PPO)"""
    replay: str | None = None
    """re-run the learner on the schedule recorded in this folder (--record-schedule): the same segments in the same
    order, no env stepped; ends with the recorded run's parameters, bit for bit (PPO; asyncvec docs agents)"""

    def __post_init__(self) -> None:
        """Refuses run options out of range with one line naming the flag."""
        if self.backend == "ray" and self.mode != "async":
            raise ValueError("--backend ray runs remote collectors: it needs --mode async")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.envs_per_worker is not None and self.envs_per_worker < 1:
            raise ValueError(
                f"--envs-per-worker must be >= 1 (or None: one env per worker), got {self.envs_per_worker}"
            )
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
        self.env_kwargs_dict()
        if self.replay and (self.resume or self.record_schedule or self.backend == "ray"):
            flag = "--resume" if self.resume else "--record-schedule" if self.record_schedule else "--backend ray"
            raise ValueError(f"--replay re-runs a recorded schedule from the start, here: leave out {flag}")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("--resume needs --checkpoint-dir DIR, the folder of the checkpoint to continue from")

    def env_kwargs_dict(self) -> dict[str, Any]:
        """``--env-kwargs`` as a dict (a ValueError naming the flag when it is not a JSON object)."""
        return parse_env_kwargs(self.env_kwargs)


def parse_env_kwargs(text: str) -> dict[str, Any]:
    """``--env-kwargs`` (JSON) as the keyword arguments of ``gym.make``.

    Example:
        >>> parse_env_kwargs('{"g": 9.81}')
        {'g': 9.81}
        >>> parse_env_kwargs("g=9.81")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: --env-kwargs must be a JSON object of gym.make keyword arguments, e.g. '{"g": 9.81}', got 'g=9.81'...
    """
    try:
        kwargs: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        kwargs = exc
    if not isinstance(kwargs, dict):
        reason = f" ({kwargs})" if isinstance(kwargs, Exception) else ""
        example = '{"g": 9.81}'
        raise ValueError(
            f"--env-kwargs must be a JSON object of gym.make keyword arguments, e.g. '{example}', got {text!r}{reason}"
        )
    return kwargs


def make_vector_env(
    env_id: str,
    num_envs: int,
    env_latency_ms: float = 0.0,
    batch_size: int | None = None,
    distribution: str = "fixed",
    normalize_obs: bool = False,
    max_restarts: int = 0,
    step_timeout: float | None = None,
    env_kwargs: dict[str, Any] | None = None,
    envs_per_worker: int | None = None,
) -> AsyncLLMVectorEnv:
    """Worker processes with SAME_STEP autoreset (no wasted reset steps), shared by both modes; ``max_restarts``,
    ``step_timeout`` and ``envs_per_worker`` as ``AsyncLLMVectorEnv`` takes them; ``env_kwargs`` reach ``gym.make``."""
    check_env_id(env_id)
    return AsyncLLMVectorEnv(
        [make_env_fn(env_id, env_latency_ms, distribution, i, normalize_obs, env_kwargs) for i in range(num_envs)],
        batch_size=batch_size,
        autoreset_mode=AutoresetMode.SAME_STEP,
        max_restarts=max_restarts,
        step_timeout=step_timeout,
        envs_per_worker=envs_per_worker,
    )


def vector_env_factory(args: EnvAgentArgs, batch_size: int | None) -> Callable[[], AsyncLLMVectorEnv]:
    """Builds the run's envs when called (``--backend local``): worker processes as ``args`` place them, ``batch_size``
    the size of a partial batch (None: lockstep). A ``functools.partial`` of plain values: a process of its own
    may build them."""
    return functools.partial(
        make_vector_env,
        args.env,
        args.num_envs,
        args.env_latency_ms,
        batch_size=batch_size,
        distribution=args.env_latency_dist,
        max_restarts=args.max_restarts,
        step_timeout=args.step_timeout,
        envs_per_worker=args.envs_per_worker,
        env_kwargs=args.env_kwargs_dict(),
    )


def make_policy(
    module: torch.nn.Module,
    action_space: gym.Space,
    num_envs: int,
    policy_latency_ms: float = 0.0,
    whole_steps: bool = False,
) -> BatchedPolicy:
    """A TorchPolicy, behind a LatencyModel playing a remote model server when latency > 0.

    The server takes batches of up to ``num_envs``, waits up to 2 ms to fill one, and serves
    several batches at once, as an inference engine with continuous batching does.
    ``whole_steps``: every call brings all ``num_envs`` observations together (a sync loop, a lockstep
    collector), so the policy waits up to 100 ms (not 1 or 2 ms) to fill its batch: a thread switch
    in the middle of the submissions never splits it, and a split batch may round differently (a
    ``Linear`` of one row takes another kernel than one of eight).
    """
    local = TorchPolicy(module, action_space, max_batch_size=num_envs, max_wait_ms=100.0 if whole_steps else 1.0)
    if policy_latency_ms <= 0:
        return local
    wait_ms = 100.0 if whole_steps else 2.0
    return LatencyModel(
        local, a_ms=policy_latency_ms, b_ms=0.0, max_batch_size=num_envs, max_wait_ms=wait_ms, max_inflight_batches=4
    )


def collector_charts(collector: Any) -> dict[str, float]:
    """The collector's numbers an env agent logs each row: policy latency p50/p99 (ms), the policy's mean batch
    size and queue depth (NaN where the policy keeps none), and the fallback rate."""
    m = collector.metrics()
    return {
        "charts/policy_latency_p50_ms": m["policy_latency_p50_ms"],
        "charts/policy_latency_p99_ms": m["policy_latency_p99_ms"],
        "charts/policy_batch_size": m.get("policy/mean_batch_size", float("nan")),
        "charts/policy_queue_depth": m.get("policy/queue_depth", float("nan")),
        "charts/fallback_rate": m["fallback_rate"],
    }


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
    env_kwargs: dict[str, Any] | None = None,
) -> RayCollectors:
    """``--backend ray``: collector actors on a Ray cluster hosting the envs (SAME_STEP autoreset)."""
    from asyncvec.distributed import RayCollectors

    check_env_id(env_id)
    env_fns = [
        make_env_fn(env_id, env_latency_ms, distribution, seed=i, normalize_obs=normalize_obs, env_kwargs=env_kwargs)
        for i in range(num_envs)
    ]
    return RayCollectors(
        env_fns, num_collectors=num_collectors, address=address, autoreset_mode=AutoresetMode.SAME_STEP
    )


def ray_collectors_for(args: EnvAgentArgs) -> RayCollectors:
    """The run's envs with ``--backend ray``: `make_ray_collectors` as ``args`` set them."""
    return make_ray_collectors(
        args.env,
        args.num_envs,
        args.env_latency_ms,
        args.env_latency_dist,
        address=args.ray_address,
        num_collectors=args.ray_collectors,
        env_kwargs=args.env_kwargs_dict(),
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
    versions.register(with_lag(collector, policy_lag))
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


def exit_on_version_flag(argv: list[str] | None = None) -> None:
    """``--version`` anywhere on an agent's command line prints asyncvec's version and exits 0 (checked before tyro
    parses, so it works whatever else is given)."""
    import asyncvec

    if "--version" in (sys.argv[1:] if argv is None else argv):
        print(f"asyncvec {asyncvec.__version__}")
        raise SystemExit(0)


def parse_cli(args_cls: type[Any], argv: list[str] | None = None) -> Any:
    """An agent's options from the command line: ``--version`` first (`exit_on_version_flag`), then tyro (which
    prints its own one-line argument errors, exit 2); a value a field's check refuses (``__post_init__``'s
    ValueError) ends the run in one line, exit 2."""
    exit_on_version_flag(argv)
    name = getattr(args_cls, "__module__", "agent").rpartition(".")[2]
    with exit_on_setup_error(name), one_line_parse_errors(args_cls):
        return tyro.cli(args_cls, args=argv)


def one_line_parse_errors(args_cls: type[Any]) -> contextlib.AbstractContextManager[None]:
    """While tyro parses: a value a field's check refuses and an unknown option become a ``ValueError`` of one line
    (`exit_on_setup_error` prints it, exit 2) instead of tyro's boxed message; an unknown option names the one
    meant (``--lr``: ``--learning-rate``). Uses tyro's parse-error hook where this tyro has it (1.0 and later)."""
    errors = getattr(tyro, "_errors", None)
    hook = getattr(errors, "on_parse_error", None)
    if errors is None or hook is None:
        return contextlib.nullcontext()

    def handle(event: Any) -> None:
        if isinstance(event, getattr(errors, "InstantiationFailure", ())):
            raise ValueError(str(event.message))
        if isinstance(event, getattr(errors, "UnrecognizedArgs", ())):
            raise ValueError(unrecognized_options(list(event.tokens), args_cls))

    manager: contextlib.AbstractContextManager[None] = hook(handle)
    return manager


def _option_names(args_cls: type[Any]) -> list[str]:
    """The fields of ``args_cls`` a command line sets, a section's (a nested dataclass, as ``LMArgs``'s) by name."""
    names: list[str] = []
    for option in dataclasses.fields(args_cls):
        factory = option.default_factory
        nested = dataclasses.is_dataclass(factory) and isinstance(factory, type)
        names += _option_names(factory) if nested else [option.name]
    return names


def unrecognized_options(tokens: list[str], args_cls: type[Any]) -> str:
    """What an agent's command line could not read, with the option meant where one is near.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Args:
        ...     learning_rate: float = 3e-4
        ...     anneal_lr: bool = True
        >>> unrecognized_options(["--lr", "0.001"], Args)
        'unrecognized option --lr (did you mean --learning-rate?); see --help'
    """
    flags = ["--" + name.replace("_", "-") for name in _option_names(args_cls)]
    words = []
    for token in tokens:
        if not token.startswith("--"):
            continue
        given = token.split("=", 1)[0]
        initials = [flag for flag in flags if "".join(part[0] for part in flag[2:].split("-")) == given[2:]]
        near = initials or difflib.get_close_matches(given, flags, n=1, cutoff=0.6)
        words.append(f"{given} (did you mean {near[0]}?)" if near else given)
    if not words:
        return f"unrecognized argument(s) {' '.join(tokens)}; see --help"
    return f"unrecognized option{'s' if len(words) > 1 else ''} {', '.join(words)}; see --help"


@contextlib.contextmanager
def exit_on_missing_extra(name: str) -> Iterator[None]:
    """The agents' command lines: a missing optional library (`MissingExtraError`) ends the run with
    its one-line message, ``{name}: ... install it with: pip install 'asyncvec[...]'``, and exit code
    2 (a setting to fix, as every other setup error), not a traceback."""
    try:
        yield
    except MissingExtraError as exc:
        if os.environ.get(TRACEBACK_VARIABLE):
            raise
        print(f"{name}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


@contextlib.contextmanager
def exit_on_setup_error(name: str) -> Iterator[None]:
    """The agents' command lines, around building the agent: what the settings or the env got wrong
    (an unknown env id, spaces the agent cannot take, an env whose library is missing, a checkpoint
    ``--resume`` cannot continue) ends the run with its one-line message and exit code 2, not a
    traceback; a missing extra as in `exit_on_missing_extra`. ``ASYNCVEC_TRACEBACK=1`` keeps the
    traceback."""
    with exit_on_missing_extra(name):
        try:
            yield
        except (ValueError, gym.error.Error) as exc:
            if os.environ.get(TRACEBACK_VARIABLE):
                raise
            print(f"{name}: error: {first_line(exc)}", file=sys.stderr)
            raise SystemExit(2) from None


def _checkpoint_words(agent: Any, saves: str, stopped: bool = False) -> str:
    path = getattr(agent, "checkpoint_path", None)
    if path is None:
        return f"none (--checkpoint-dir DIR saves one {saves})" if saves else "none (this agent keeps none)"
    if not Path(path).exists():
        return f"none yet ({path} is written {saves})"
    saved = getattr(agent, "saved_position", None)
    # stopped mid-update: the checkpoint holds an earlier point than where the run stopped
    return f"{path} (at {saved}, the last complete update)" if stopped and saved is not None else str(path)


def where_line(agent: Any, saves: str, *, start: bool = False) -> str:
    """Where a run writes (``start``) or wrote its results: TensorBoard logs (or how to have them), the model
    (``output_path``, when the agent saves one) and the checkpoint."""
    log_path = getattr(agent, "log_path", None)
    if log_path is None:
        logs = "not written (--track, the default, writes them; --no-track turned it off)"
    else:
        logs = f"{log_path} (TensorBoard{': tensorboard --logdir ' + str(Path(log_path).parent) if start else ''})"
    parts = [f"logs: {logs}"]
    output = getattr(agent, "output_path", None)
    if output is not None:
        parts.append(f"model: {output}")
    if start:
        path = getattr(agent, "checkpoint_path", None)
        checkpoint = (
            f"{path} (written {saves})"
            if path is not None
            else (f"none (--checkpoint-dir DIR saves one {saves})" if saves else "none (this agent keeps none)")
        )
    else:
        checkpoint = _checkpoint_words(agent, saves)
    parts.append(f"checkpoint: {checkpoint}")
    return "; ".join(parts)


def run_from_cli(build: Callable[[], Any], summary: Callable[[Any], str], *, name: str,
                 saves: str = "after every update") -> Any | None:  # fmt: skip
    """Every agent's command line: builds the agent (a setup error ends the run in one line, exit 2:
    `exit_on_setup_error`), says where its logs, model and checkpoint go, trains it, prints
    ``summary(result)`` and where they went.

    The agent tells the runner what it needs by attributes: ``log_path`` (its TensorBoard folder, None when
    not written), ``checkpoint_path`` (None without one), ``output_path`` (optional: the model it saves),
    ``position`` (where it is, e.g. ``"step 640"``), ``work_left`` (steps or prompts still to do: 0 after
    ``--resume`` of a finished run, which then says so and exits 0 without training) and ``length_flag`` (the
    option that sets the run's length, named in that message). ``saves`` says when
    its checkpoint is written ('' for an agent without one).

    Ctrl-C stops the run within a second (``train`` closes envs, workers and threads), says where it stopped
    and where its checkpoint is (written after the last complete update), and exits 130; it never lands where it
    would leave a lock held, and a stop still running after 20 s prints where each thread waits
    (`asyncvec.lifecycle.interrupts_outside_locks`). An error while
    training is one line naming what failed, with where its full traceback was written (`report_run_error`;
    ``ASYNCVEC_TRACEBACK=1`` raises it instead): exit 2 for an env failing in its worker, 1 otherwise."""
    with interrupts_outside_locks():  # a Ctrl-C never leaves a lock held (the stop would wait out timeouts)
        return _run_agent(build, summary, name, saves)


def _run_agent(build: Callable[[], Any], summary: Callable[[Any], str], name: str, saves: str) -> Any | None:
    agent = None
    try:
        with exit_on_setup_error(name):
            try:
                agent = build()
            except (KeyboardInterrupt, SystemExit, ValueError, gym.error.Error, MissingExtraError):
                raise
            except FileNotFoundError as exc:  # e.g. --model DIR that is not there: a setting to fix
                raise ValueError(str(exc)) from exc
            except Exception as exc:  # the env's or the model's own code failed while being built
                if os.environ.get(TRACEBACK_VARIABLE):
                    raise
                raise SystemExit(report_run_error(name, exc, None, setup=True)) from None
        if getattr(agent, "work_left", 1) <= 0:
            agent.close()
            print(
                f"{name}: nothing left to do: the checkpoint {agent.checkpoint_path} is already at {agent.position}, "
                f"the end of this run; raise {getattr(agent, 'length_flag', 'the run length')} to train on"
            )
            return None
        print(f"{name}: {where_line(agent, saves, start=True)}", flush=True)
        with exit_on_missing_extra(name):
            try:
                result = agent.train()
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as exc:
                if os.environ.get(TRACEBACK_VARIABLE):
                    raise
                raise SystemExit(report_run_error(name, exc, getattr(agent, "run_dir", None))) from None
    except KeyboardInterrupt:
        if agent is None:
            print(f"\n{name}: stopped before training started", flush=True)
        else:
            print(
                f"\n{name}: stopped at {agent.position}, checkpoint at {_checkpoint_words(agent, saves, stopped=True)}",
                flush=True,
            )
        raise SystemExit(130) from None
    print(summary(result))
    print(where_line(agent, saves))
    advice = placement_advice(agent)
    if advice:
        print(f"{name}: {advice}")
    return result


def placement_advice(agent: Any) -> str | None:
    """The env placement advice of the agent's vector env (``envs.placement.advice``) when it names a faster
    setting, as one line naming the flag that sets it; ``None`` otherwise."""
    placement = getattr(agent, "acting_placement", None) or getattr(getattr(agent, "envs", None), "placement", None)
    advised = getattr(placement, "advised", None)
    if not advised or "envs_per_worker" not in advised:
        return None  # the agents' envs run in workers: in_process=True is not theirs to take
    return f"env placement advice: {placement.advice} (--envs-per-worker {advised['envs_per_worker']})"


def lm_cli(agent_cls: type[LMAgent], args_cls: type[LMArgs], argv: list[str] | None = None) -> LMTrainResult | None:
    """The command line of a language-model agent: ``args_cls`` from ``sys.argv`` (`parse_cli`), then
    `run_from_cli` (the same runner as PPO's and SAC's: Ctrl-C, errors, where the results went)."""
    args = parse_cli(args_cls, argv)
    label = agent_cls.run_label(args)
    return run_from_cli(lambda: agent_cls(args), lambda result: summary(label, result), name=label)
