"""What a training run needs around its algorithm: seeding and RNG state, atomic checkpoints, and
finding the env ids and modules a user names on the command line (``--env mymod:MyEnv-v0``).

The agents (``asyncvec.agents``) and the language-model room (``asyncvec.lm``) call these.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import os
import random
import re
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from asyncvec.metrics import RunLogger


def check_env_id(env_id: str) -> None:
    """Raises a ValueError when ``env_id`` is not registered, naming close matches.

    Gymnasium's ``module:EnvId`` form is accepted: ``module`` is imported first (its import
    registers ``EnvId``), as ``gymnasium.make`` does, so ``--env mymod:MyTask-v0`` works from
    the command line. ``module`` is looked up on ``sys.path`` and then in the current folder
    (as ``python -m`` would), so the folder that holds ``mymod.py`` needs no ``PYTHONPATH``; the
    error names the module imported and the id it did not register.

    Example:
        >>> check_env_id("gymnasium.envs.classic_control:CartPole-v1")
        >>> check_env_id("CartPol-v1")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: unknown env id 'CartPol-v1'; did you mean CartPole-v1, CartPole-v0, ...
    """
    module, _, name = env_id.rpartition(":")
    if module:
        import_user_module(module, f"env id {env_id!r}: importing {module!r} (which should register {name!r})")
    if name in gym.registry:
        return
    matches = difflib.get_close_matches(name, list(gym.registry), n=5, cutoff=0.5)
    hint = f"; did you mean {', '.join(matches)}?" if matches else "; see gymnasium.pprint_registry()"
    if module:
        raise ValueError(f"env id {env_id!r}: imported {module!r}, but it did not register {name!r}{hint}")
    raise ValueError(f"unknown env id {env_id!r}{hint}")


def import_user_module(module: str, what: str) -> ModuleType:
    """Imports a module the user named on the command line (``--env mymod:MyEnv-v0``, ``--reward
    mymod:score``), from ``sys.path`` and then from the current folder, as ``python -m`` would: the
    folder that holds ``mymod.py`` needs no ``PYTHONPATH``. A failure is a ValueError starting with
    ``what`` and naming the module that was not found and where it was looked for.

    Example:
        >>> import_user_module("json", "--reward 'json:loads'").__name__
        'json'
        >>> import_user_module("no_such_module", "--reward 'no_such_module:f'")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: --reward 'no_such_module:f' failed: module 'no_such_module' was not found (looked in the current folder ...
    """
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # last: a user's module never hides an installed one
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = (
            f"module {exc.name!r} was not found (looked in the current folder {cwd} and on sys.path)"
            if isinstance(exc, ModuleNotFoundError) and exc.name
            else str(exc)
        )
        raise ValueError(f"{what} failed: {missing}") from exc


def run_name(env_id: str, agent: str, mode: str, seed: int, started: float | None = None) -> str:
    """A run's folder name under ``--log-dir``: ``<env>__<agent>__<mode>__<seed>__<unix time>``, every character
    that a path or a shell would trip on (``/``, ``:``, spaces, ...) replaced by ``_``.

    Example:
        >>> run_name("mymod:Env-v0", "ppo", "async", 1, started=1700000000)
        'mymod_Env-v0__ppo__async__1__1700000000'
    """
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", env_id)
    return f"{safe}__{agent}__{mode}__{seed}__{int(time.time() if started is None else started)}"


class RunFolder:
    """Mixin of the agents: where a run writes. ``run_dir`` is ``<args.log_dir>/<run_name>`` (a resumed run keeps
    its first one), ``log_path`` the same folder when TensorBoard logs are written (``args.track``), else None."""

    args: Any
    run_name: str
    checkpoint_path: Path | None = None
    saved_position: str | None = None
    """where the run was when this process last wrote its checkpoint (None: not yet)"""

    def write_checkpoint(self, **state: Any) -> None:
        """:func:`save_checkpoint` of ``state`` to ``checkpoint_path``, remembering the run's ``position`` then (the
        command line's Ctrl-C message says which point the checkpoint holds)."""
        if self.checkpoint_path is None:
            raise ValueError("write_checkpoint: the run has no checkpoint_path (--checkpoint-dir)")
        position, before = getattr(self, "position", None), _file_identity(self.checkpoint_path)
        try:
            save_checkpoint(self.checkpoint_path, **state)
        finally:
            # a Ctrl-C may land anywhere in the save, also just after the file was replaced: what the file holds
            # decides (a replaced file is a new one), not whether the call returned
            if _file_identity(self.checkpoint_path) != before:
                self.saved_position = position

    @property
    def run_dir(self) -> Path:
        """The run's folder under ``--log-dir`` (its TensorBoard logs; a resumed run keeps its first one)."""
        return Path(self.args.log_dir) / self.run_name

    @property
    def log_path(self) -> Path | None:
        """Where the run's TensorBoard logs go (None with ``--no-track``)."""
        return self.run_dir if self.args.track else None


class EnvStepsRun(RunFolder):
    """Mixin of the agents whose length is ``--total-timesteps`` env steps (PPO, SAC): what the command line says of
    where a run is and how much is left."""

    global_step: int
    length_flag = "--total-timesteps"  # the option that sets the run's length (the command line names it)

    @property
    def position(self) -> str:
        """Where the run is, in words (the command line's Ctrl-C message)."""
        return f"step {self.global_step}"

    @property
    def work_left(self) -> int:
        """Env steps still to train for (0: a resumed run that had already finished)."""
        return max(0, self.args.total_timesteps - self.global_step)

    def run_logger(self) -> RunLogger:
        """The run's TensorBoard writer and progress bar, counting env steps from where the run starts."""
        args = self.args
        return RunLogger(
            self.run_dir,
            track=args.track,
            total_steps=args.total_timesteps,
            progress=args.progress,
            hparams=dataclasses.asdict(args),
            initial_step=self.global_step,
        )


class CheckpointError(ValueError):
    """A checkpoint that ``--resume`` cannot continue from: written for another env or agent, or unreadable;
    the message names the cause and the fix."""


class CheckpointNotFoundError(FileNotFoundError, CheckpointError):
    """``--resume`` with no checkpoint where it looks (a FileNotFoundError, as before, and a ValueError: a
    setting to fix)."""


def check_resumable(state: dict[str, Any], path: Path, **expected: Any) -> None:
    """Raises :class:`CheckpointError` when ``state["args"]`` (a checkpoint's options) differs from ``expected`` in
    one of its keys (e.g. ``env``), naming both values and the two ways on: the checkpoint's value, or another
    ``--checkpoint-dir``.

    Example:
        >>> check_resumable({"args": {"env": "CartPole-v1"}}, Path("ckpt/ppo.pt"), env="Acrobot-v1")
        Traceback (most recent call last):
        ...
        asyncvec.runs.CheckpointError: --resume: ckpt/ppo.pt was written by a run with --env CartPole-v1, not Acrobot-v1: pass --env CartPole-v1 to continue it, or another --checkpoint-dir to start a new run
    """
    saved = state.get("args") or {}
    for key, value in expected.items():
        if key in saved and _settings_differ(saved[key], value):
            flag = "--" + key.replace("_", "-")
            raise CheckpointError(
                f"--resume: {path} was written by a run with {flag} {saved[key]}, not {value}: pass {flag} "
                f"{saved[key]} to continue it, or another --checkpoint-dir to start a new run"
            )


def _settings_differ(saved: Any, given: Any) -> bool:
    """Whether two values of a run option differ; JSON options (``--env-kwargs``) compare as what they parse to."""
    if isinstance(saved, str) and isinstance(given, str) and saved != given:
        try:
            return bool(json.loads(saved or "{}") != json.loads(given or "{}"))
        except ValueError:
            return True
    return bool(saved != given)


def seed_everything(seed: int) -> None:
    """Seeds Python's, NumPy's and torch's global random generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """The global random generators' states, for a checkpoint."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores the states :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _file_identity(path: str | Path) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``, or None: a file put in place by a rename is another file."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def save_checkpoint(path: str | Path, **state: Any) -> Path:
    """``torch.save`` of ``state`` plus the RNG states, written atomically (tmp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({**state, "rng": rng_state()}, tmp)
    tmp.replace(path)
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Loads a checkpoint written by :func:`save_checkpoint` and restores the RNG states."""
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(
            f"--resume: no checkpoint at {path}: pass the --checkpoint-dir of an earlier run, or leave out --resume "
            "to start a new one"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated or foreign file
        raise CheckpointError(
            f"--resume: {path} is not a readable checkpoint ({exc}): pass another --checkpoint-dir"
        ) from exc
    set_rng_state(state["rng"])
    return state
