"""Small deterministic envs for the vector-env tests: one per observation-space family."""

from __future__ import annotations

import os
import signal
import time

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class CounterEnv(gym.Env):
    """Counts steps; the episode ends after a length drawn at reset (so envs finish at different times).

    ``obs_kind`` picks the observation space: "box", "discrete", "dict" or "text".
    """

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, obs_kind: str = "box", max_len: int = 6, render_mode: str | None = None):
        self.obs_kind = obs_kind
        self.max_len = max_len
        self.render_mode = render_mode
        self.action_space = spaces.Discrete(3)
        box = spaces.Box(-100.0, 100.0, shape=(3,), dtype=np.float32)
        self.observation_space = {
            "box": box,
            "discrete": spaces.Discrete(50),
            "dict": spaces.Dict({"pos": box, "count": spaces.Discrete(50)}),
            "text": spaces.Text(max_length=40, charset="0123456789abcdefghijklmnopqrstuvwxyz:,- "),
        }[obs_kind]
        self.t = 0
        self.length = max_len
        self.total = 0.0

    def _obs(self):
        pos = np.array([self.t, self.total, self.length], dtype=np.float32)
        if self.obs_kind == "box":
            return pos
        if self.obs_kind == "discrete":
            return int(self.t + 10 * (self.length % 5))
        if self.obs_kind == "dict":
            return {"pos": pos, "count": self.t}
        return f"t:{self.t},total:{int(self.total)},len:{self.length}"

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.total = 0.0
        self.length = int(self.np_random.integers(2, self.max_len + 1))
        return self._obs(), {"length": self.length}

    def step(self, action):
        assert self.action_space.contains(action), action
        self.t += 1
        reward = float(action) + float(self.np_random.random())
        self.total += float(action)
        terminated = self.t >= self.length and self.length % 2 == 0
        truncated = self.t >= self.length and not terminated
        info = {"t": self.t}
        if terminated or truncated:
            info["episode_total"] = self.total
        return self._obs(), reward, terminated, truncated, info

    def render(self):
        return np.full((2, 2, 3), self.t, dtype=np.uint8)


class FaultyEnv(CounterEnv):
    """Misbehaves at step ``fault_step`` of its first life: "raise", "kill" (SIGKILL itself) or "hang".

    A marker file makes the fault happen once, so a restarted worker behaves.
    """

    def __init__(self, fault: str, fault_step: int, marker: str, **kwargs):
        super().__init__(**kwargs)
        self.fault, self.fault_step, self.marker = fault, fault_step, marker
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps == self.fault_step and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            if self.fault == "raise":
                raise ZeroDivisionError("the simulator divided by zero")
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "hang":
                time.sleep(3600)
        return super().step(action)


class SleepyEnv(CounterEnv):
    """Each step sleeps ``delays[env_index]`` seconds, to test partial batches."""

    def __init__(self, delay: float, **kwargs):
        super().__init__(**kwargs)
        self.delay = delay

    def step(self, action):
        if self.delay:
            time.sleep(self.delay)
        return super().step(action)


class RecordingEnv(CounterEnv):
    """Records every action it is stepped with and appends them to ``log`` (one file per env) when
    closed, wherever it ran: the record of what reached the env (kept in memory while it runs, so that
    the env stays cheap; a copy moved to another process carries it along, the copy left behind is
    dropped without closing). ``kind``: "cheap", "cpu" (spins ``cost`` seconds), "sleep" (sleeps
    ``cost``), "crash" (its process exits at step ``crash_at`` of its first life, once per ``log``
    file: what that life recorded is lost)."""

    def __init__(self, log: str, kind: str = "cheap", cost: float = 0.0, crash_at: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.log, self.kind, self.cost, self.crash_at = log, kind, cost, crash_at
        self.steps = 0
        self.actions: list[int] = []

    def step(self, action):
        self.steps += 1
        if self.kind == "crash" and self.steps == self.crash_at and not os.path.exists(self.log + ".crashed"):
            open(self.log + ".crashed", "w").close()
            os._exit(3)
        self.actions.append(int(action))
        if self.kind == "sleep":
            time.sleep(self.cost)
        elif self.kind == "cpu":
            end = time.perf_counter() + self.cost
            while time.perf_counter() < end:
                pass
        return super().step(action)

    def close(self):
        with open(self.log, "a") as log:
            log.writelines(f"{action}\n" for action in self.actions)
        self.actions = []
        super().close()


def recorded_actions(log: str) -> list[int]:
    """The actions a :class:`RecordingEnv` was stepped with, in order."""
    if not os.path.exists(log):
        return []
    with open(log) as file:
        return [int(line) for line in file]
