"""``check_vector_env``: a conformance checker for any ``gymnasium.vector.VectorEnv``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np
from gymnasium import Space
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array

__all__ = ["VectorEnvCheckError", "check_vector_env", "first_difference"]


class VectorEnvCheckError(AssertionError):
    """The vector env breaks the Gymnasium (or EnvPool) contract; the message lists every finding."""


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The path and values of the first place where two nested results differ, or ``None``.

    Compares arrays (values and dtype), dicts, tuples/lists, object arrays and scalars.

    Example:
        >>> first_difference({"x": np.zeros(2)}, {"x": np.ones(2)})
        '.x: [0. 0.] != [1. 1.]'
    """
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return f"{path}: keys {sorted(a)} != {sorted(b) if isinstance(b, dict) else type(b).__name__}"
        for key in a:
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, (tuple, list)) or (isinstance(a, np.ndarray) and a.dtype == object):
        if not isinstance(b, type(a)) or len(a) != len(b):
            return f"{path}: {a!r} != {b!r}"
        for k, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{k}]")
            if found:
                return found
        return None
    if isinstance(a, np.ndarray):
        b_arr = np.asarray(b)
        if a.shape != b_arr.shape or a.dtype != b_arr.dtype or not np.array_equal(a, b_arr, equal_nan=True):
            return f"{path}: {a} != {b_arr}" + (
                f" (dtype {a.dtype} vs {b_arr.dtype})" if a.dtype != b_arr.dtype else ""
            )
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def _info_problems(info: Any, size: int, where: str) -> list[str]:
    """Gymnasium's info convention: every key ``k`` has a bool mask ``_k`` of shape (size,)."""
    if not isinstance(info, dict):
        return [f"{where}: info must be a dict, got {type(info).__name__}"]
    problems = []
    for key, value in info.items():
        if key.startswith("_") or key == "env_id":
            continue
        mask = info.get(f"_{key}")
        if mask is None:
            problems.append(f"{where}: info[{key!r}] has no mask info['_{key}']")
        elif not (isinstance(mask, np.ndarray) and mask.dtype == np.bool_ and mask.shape == (size,)):
            problems.append(f"{where}: info['_{key}'] must be a bool array of shape ({size},), got {mask!r}")
        if isinstance(value, dict):
            problems += _info_problems(value, size, f"{where} info[{key!r}]")
        elif isinstance(value, np.ndarray) and value.shape[:1] != (size,):
            problems.append(f"{where}: info[{key!r}] has shape {value.shape}, expected ({size}, ...)")
    return problems


def _step_problems(env: VectorEnv[Any, Any, Any], result: tuple[Any, ...], size: int, where: str) -> list[str]:
    if not (isinstance(result, tuple) and len(result) == 5):
        return [f"{where}: step must return (obs, rewards, terminations, truncations, infos)"]
    obs, rewards, terminations, truncations, info = result
    problems = []
    if size == env.num_envs and not env.observation_space.contains(obs):
        problems.append(f"{where}: observations are not in observation_space {env.observation_space}")
    for name, array, kind in (
        ("rewards", rewards, "f"),
        ("terminations", terminations, "b"),
        ("truncations", truncations, "b"),
    ):
        if not isinstance(array, np.ndarray) or array.shape != (size,):
            problems.append(f"{where}: {name} must be a numpy array of shape ({size},), got {array!r}")
        elif array.dtype.kind != kind and not (kind == "f" and array.dtype.kind in "iu"):
            problems.append(f"{where}: {name} has dtype {array.dtype}, expected {'float' if kind == 'f' else 'bool'}")
    return problems + _info_problems(info, size, where)


def _autoreset_problems(
    mode: AutoresetMode, env: VectorEnv[Any, Any, Any], previous_done: np.ndarray, result: tuple[Any, ...], t: int
) -> list[str]:
    obs, rewards, terminations, truncations, info = result
    where = f"step {t}"
    problems = []
    done = np.logical_or(terminations, truncations)
    if mode == AutoresetMode.NEXT_STEP:
        for i in np.flatnonzero(previous_done):
            if rewards[i] != 0 or terminations[i] or truncations[i]:
                problems.append(
                    f"{where}: NEXT_STEP autoreset: env {i} ended its episode on the previous step, so this "
                    f"step must be its reset (reward 0, not terminated/truncated), got reward={rewards[i]}, "
                    f"terminated={terminations[i]}, truncated={truncations[i]}"
                )
        if "final_obs" in info:
            problems.append(f"{where}: NEXT_STEP autoreset must not put final_obs in info")
    elif mode == AutoresetMode.SAME_STEP:
        mask = info.get("_final_obs")
        for i in np.flatnonzero(done):
            if mask is None or not mask[i]:
                problems.append(f"{where}: SAME_STEP autoreset: env {i} ended but info['_final_obs'][{i}] is not set")
            elif not env.single_observation_space.contains(info["final_obs"][i]):
                problems.append(f"{where}: info['final_obs'][{i}] is not in single_observation_space")
        if mask is not None and np.any(mask & ~done):
            problems.append(
                f"{where}: info['_final_obs'] is set for envs that did not end: {np.flatnonzero(mask & ~done)}"
            )
    return problems


def _space_problems(env: VectorEnv[Any, Any, Any]) -> list[str]:
    problems = []
    if not isinstance(env.num_envs, (int, np.integer)) or env.num_envs < 1:
        return [f"num_envs must be a positive int, got {env.num_envs!r}"]
    for name in ("single_observation_space", "single_action_space", "observation_space", "action_space"):
        if not isinstance(getattr(env, name, None), Space):
            problems.append(f"{name} must be a gymnasium Space, got {getattr(env, name, None)!r}")
    if problems:
        return problems
    for batched, single in (("observation_space", "single_observation_space"), ("action_space", "single_action_space")):
        expected = batch_space(getattr(env, single), env.num_envs)
        if getattr(env, batched) != expected:
            problems.append(
                f"{batched} is {getattr(env, batched)}, expected batch_space({single}, {env.num_envs}) = {expected}"
            )
    mode = env.metadata.get("autoreset_mode")
    if not isinstance(mode, AutoresetMode):
        problems.append(f"metadata['autoreset_mode'] must be an AutoresetMode, got {mode!r}")
    elif getattr(env, "autoreset_mode", mode) != mode:
        problems.append(
            f"autoreset_mode attribute {getattr(env, 'autoreset_mode')} != metadata['autoreset_mode'] {mode}"
        )
    return problems


def _partial_batch_problems(env: Any, rounds: int, seed: int) -> list[str]:
    """EnvPool invariants: non-empty batches of at most batch_size, each env once per send."""
    problems: list[str] = []
    batch_size = getattr(env, "batch_size", env.num_envs)
    env.async_reset(seed=seed)
    in_flight = set(range(env.num_envs))
    rng = np.random.default_rng(seed)
    env.single_action_space.seed(seed)
    for r in range(rounds):
        obs, rewards, terminations, truncations, info = env.recv(timeout=60)
        ids = np.asarray(info.get("env_id", []))
        where = f"recv {r}"
        if ids.size == 0:
            return problems + [f"{where}: returned an empty batch (or no info['env_id'])"]
        if ids.size > batch_size:
            problems.append(f"{where}: returned {ids.size} envs, more than batch_size={batch_size}")
        problems += _step_problems(env, (obs, rewards, terminations, truncations, info), ids.size, where)
        for i in ids.tolist():
            if i not in in_flight:
                problems.append(f"{where}: env {i} returned without a send in flight (returned twice?)")
            in_flight.discard(i)
        for k, i in enumerate(ids.tolist()):
            row = {key: value[k] for key, value in obs.items()} if isinstance(obs, dict) else obs[k]
            if not env.single_observation_space.contains(row):
                problems.append(f"{where}: the observation of env {i} is not in single_observation_space")
        if problems:
            return problems
        # Send back a random subset (at least one) so partial sends are exercised too.
        keep = ids[rng.random(ids.size) < 0.8] if ids.size > 1 else ids
        keep = keep if keep.size else ids[:1]
        actions = [env.single_action_space.sample() for _ in range(keep.size)]
        batch = concatenate(env.single_action_space, actions, create_empty_array(env.single_action_space, keep.size))
        env.send(batch, keep)
        in_flight.update(keep.tolist())
    while in_flight:  # drain, so the env is left idle
        _, _, _, _, info = env.recv(timeout=60)
        in_flight.difference_update(np.asarray(info["env_id"]).tolist())
    return problems


def check_vector_env(
    env: VectorEnv[Any, Any, Any],
    *,
    num_steps: int = 100,
    seed: int = 0,
    check_determinism: bool = True,
    check_partial_batches: bool = True,
) -> None:
    """Checks that ``env`` follows the Gymnasium VectorEnv contract (and EnvPool's where it has it).

    Checks: batched spaces, ``metadata["autoreset_mode"]``, reset/step return types and shapes,
    the ``key``/``_key`` info masks, the autoreset semantics of the env's mode, that ``env_fns``
    (when the env has them) can be pickled and reproduce the env's results in a
    ``SyncVectorEnv`` with the same seeds and actions, and, where the env has
    ``async_reset/send/recv``, the partial-batch invariants (never an empty batch, at most
    ``batch_size`` envs, each env id returned once per send).

    Raises:
        VectorEnvCheckError: listing every problem found.

    Example:
        >>> import gymnasium as gym
        >>> from asyncvec import AsyncLLMVectorEnv, check_vector_env
        >>> envs = AsyncLLMVectorEnv([lambda: gym.make("CartPole-v1")] * 2, batch_size=1)
        >>> check_vector_env(envs)
        >>> envs.close()
    """
    problems = _space_problems(env)
    if problems:
        raise VectorEnvCheckError(_report(env, problems))
    mode = env.metadata["autoreset_mode"]

    env_fns: list[Callable[..., Any]] | None = getattr(env, "env_fns", None)
    if env_fns is not None:
        for i, fn in enumerate(env_fns):
            try:
                cloudpickle.dumps(fn)
            except Exception as exc:
                problems.append(f"env_fns[{i}] cannot be pickled with cloudpickle: {exc}")

    reference = None
    if check_determinism and env_fns is not None and not problems:
        reference = SyncVectorEnv(env_fns, autoreset_mode=mode)
    compare = reference is not None
    try:
        obs, info = env.reset(seed=seed)
        if not env.observation_space.contains(obs):
            problems.append(f"reset: observations are not in observation_space {env.observation_space}")
        problems += _info_problems(info, env.num_envs, "reset")
        if compare:
            assert reference is not None
            found = first_difference((obs, info), reference.reset(seed=seed), "reset")
            if found:
                problems.append(f"not reproducible by SyncVectorEnv(env_fns) with the same seed: {found}")
        env.action_space.seed(seed)
        previous_done = np.zeros(env.num_envs, dtype=np.bool_)
        for t in range(num_steps):
            if problems:
                break
            actions = env.action_space.sample()
            result = env.step(actions)
            problems += _step_problems(env, result, env.num_envs, f"step {t}")
            if problems:
                break
            problems += _autoreset_problems(mode, env, previous_done, result, t)
            if compare:
                assert reference is not None
                found = first_difference(result, reference.step(actions), f"step {t}")
                if found:
                    problems.append(
                        f"not reproducible by SyncVectorEnv(env_fns) with the same seeds and actions: {found}"
                    )
            previous_done = np.logical_or(result[2], result[3])
            if mode == AutoresetMode.DISABLED and previous_done.any():
                options = {"reset_mask": previous_done.copy()}
                obs, info = env.reset(options=dict(options))
                if not env.observation_space.contains(obs):
                    problems.append(f"step {t}: masked reset returned observations outside observation_space")
                problems += _info_problems(info, env.num_envs, f"step {t} masked reset")
                compare = False  # unseeded resets differ by design; stop comparing
                previous_done[:] = False
        if not problems and check_partial_batches and all(hasattr(env, m) for m in ("async_reset", "send", "recv")):
            problems += _partial_batch_problems(env, rounds=max(10, num_steps // 2), seed=seed)
    finally:
        if reference is not None:
            reference.close()
    if problems:
        raise VectorEnvCheckError(_report(env, problems))


def _report(env: VectorEnv[Any, Any, Any], problems: list[str]) -> str:
    lines = "\n".join(f"  - {p}" for p in problems)
    return f"{type(env).__name__} fails the vector env contract ({len(problems)} problem(s)):\n{lines}"
