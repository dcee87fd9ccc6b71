"""Classic control seen by a camera: a small RGB image plus a task instruction, continuous actions.

Each env wraps a gymnasium classic-control task and replaces its state observation with
``Dict(image=Box(0, 255, (size, size, 3), uint8), instruction=Text(64))``, the observation
format of a vision-language-action policy (docs/robots.md). The image is drawn with numpy
from the simulator state (no pygame, under 1 ms for 64x64): the scene, plus a velocity
gauge along the bottom edge (one bar per velocity, centred, right = positive), so that a
single frame holds the whole state. The instruction is drawn per episode from a few
phrasings of the task (seeded by ``reset``), so a policy must read it rather than memorize it.

Registered ids (``import asyncvec``):

* ``asyncvec/PixelPendulum-v0``: Pendulum-v1, torque in [-2, 2], 200 steps.
* ``asyncvec/PixelMountainCarContinuous-v0``: MountainCarContinuous-v0, force in [-1, 1].
* ``asyncvec/PixelCartPole-v0``: CartPole-v1 with a continuous force in [-1, 1] (scaled to
  the original 10 N), 500 steps.
* ``asyncvec/PixelReach-v0``: not classic control: move a dot onto the coloured square that the
  instruction names (:class:`PixelReachEnv`); the only one whose instruction changes the task.

Example:
    >>> import gymnasium as gym
    >>> import asyncvec
    >>> env = gym.make("asyncvec/PixelPendulum-v0")
    >>> obs, info = env.reset(seed=0)
    >>> obs["image"].shape, obs["image"].dtype, isinstance(obs["instruction"], str)
    ((64, 64, 3), dtype('uint8'), True)
    >>> obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["INSTRUCTION_CHARSET", "TASKS", "Canvas", "PixelControlEnv", "PixelReachEnv", "make_pixel_env"]

#: characters an instruction may use (the ``Text`` space's charset)
INSTRUCTION_CHARSET = string.ascii_letters + string.digits + " .,'-"
INSTRUCTION_MAX_LENGTH = 64

_BACKGROUND = (235, 235, 235)
_GAUGE = (40, 110, 220)


class Canvas:
    """A square RGB image that draws discs, thick segments, rectangles and gauges with numpy.

    Coordinates are pixels, ``(x, y)`` with ``y`` pointing down. Shapes are anti-aliasing-free
    masks over a precomputed pixel grid, so drawing costs a few vectorized operations.

    Example:
        >>> canvas = Canvas(16)
        >>> canvas.disc((8, 8), 3, (255, 0, 0))
        >>> canvas.image[8, 8].tolist()
        [255, 0, 0]
    """

    def __init__(self, size: int) -> None:
        self.size = int(size)
        ys, xs = np.mgrid[0 : self.size, 0 : self.size].astype(np.float32) + 0.5
        self._xs, self._ys = xs, ys
        self.image = np.empty((self.size, self.size, 3), dtype=np.uint8)
        self.clear()

    def clear(self, color: tuple[int, int, int] = _BACKGROUND) -> None:
        self.image[:] = color

    def paint(self, mask: np.ndarray, color: tuple[int, int, int]) -> None:
        self.image[mask] = color

    def disc(self, center: tuple[float, float], radius: float, color: tuple[int, int, int]) -> None:
        cx, cy = center
        self.paint((self._xs - cx) ** 2 + (self._ys - cy) ** 2 <= radius**2, color)

    def segment(
        self, start: tuple[float, float], end: tuple[float, float], width: float, color: tuple[int, int, int]
    ) -> None:
        (x0, y0), (x1, y1) = start, end
        dx, dy = x1 - x0, y1 - y0
        length2 = dx * dx + dy * dy
        t = np.zeros_like(self._xs) if length2 == 0 else ((self._xs - x0) * dx + (self._ys - y0) * dy) / length2
        t = np.clip(t, 0.0, 1.0)
        distance2 = (self._xs - (x0 + t * dx)) ** 2 + (self._ys - (y0 + t * dy)) ** 2
        self.paint(distance2 <= (width / 2) ** 2, color)

    def rect(self, x0: float, y0: float, x1: float, y1: float, color: tuple[int, int, int]) -> None:
        self.paint((self._xs >= x0) & (self._xs <= x1) & (self._ys >= y0) & (self._ys <= y1), color)

    def gauges(self, values: tuple[float, ...]) -> None:
        """One horizontal bar per value in ``[-1, 1]`` along the bottom edge, from the centre."""
        height = max(1, self.size // 32)
        middle = self.size / 2
        for row, value in enumerate(values):
            y1 = self.size - row * (height + 1)
            x = middle + float(np.clip(value, -1.0, 1.0)) * (middle - 1)
            self.rect(min(middle, x), y1 - height, max(middle, x) + 0.5, y1, _GAUGE)


def _draw_pendulum(canvas: Canvas, env: Any) -> None:
    theta, theta_dot = (float(v) for v in env.unwrapped.state)
    size = canvas.size
    pivot = (size / 2, size * 0.45)
    length = size * 0.36
    tip = (pivot[0] + length * math.sin(theta), pivot[1] - length * math.cos(theta))
    canvas.segment(pivot, tip, max(2.0, size / 16), (200, 70, 60))
    canvas.disc(pivot, max(1.5, size / 32), (30, 30, 30))
    canvas.gauges((theta_dot / 8.0,))


def _mountain_height(position: np.ndarray | float) -> np.ndarray | float:
    return np.sin(3 * position) * 0.45 + 0.55


def _draw_mountain_car(canvas: Canvas, env: Any) -> None:
    position, velocity = (float(v) for v in env.unwrapped.state)
    size = canvas.size
    low, high = -1.2, 0.6

    def to_pixels(x: float, y: float) -> tuple[float, float]:
        return (x - low) / (high - low) * size, size * 0.95 - y * size * 0.6

    if not hasattr(canvas, "_hill"):
        xs = low + canvas._xs / size * (high - low)
        canvas._hill = canvas._ys >= size * 0.95 - _mountain_height(xs) * size * 0.6
    canvas.paint(canvas._hill, (150, 190, 120))
    flag_x, flag_y = to_pixels(0.45, float(_mountain_height(0.45)))
    canvas.segment((flag_x, flag_y), (flag_x, flag_y - size * 0.15), max(1.0, size / 64), (30, 30, 30))
    canvas.rect(flag_x, flag_y - size * 0.15, flag_x + size * 0.08, flag_y - size * 0.1, (230, 200, 40))
    car = to_pixels(position, float(_mountain_height(position)))
    canvas.disc((car[0], car[1] - size / 32), max(2.0, size / 14), (60, 60, 200))
    canvas.gauges((velocity / 0.07,))


def _draw_cartpole(canvas: Canvas, env: Any) -> None:
    x, x_dot, theta, theta_dot = (float(v) for v in env.unwrapped.state)
    size = canvas.size
    cart_x = size / 2 + x / 2.4 * (size / 2 - size / 8)
    cart_y = size * 0.7
    canvas.rect(0, cart_y + size / 16, size, cart_y + size / 16 + 1, (120, 120, 120))  # track
    canvas.rect(cart_x - size / 10, cart_y - size / 20, cart_x + size / 10, cart_y + size / 20, (40, 40, 40))
    length = size * 0.4
    tip = (cart_x + length * math.sin(theta), cart_y - length * math.cos(theta))
    canvas.segment((cart_x, cart_y), tip, max(2.0, size / 20), (200, 140, 60))
    canvas.gauges((x_dot / 2.0, theta_dot / 3.0))


class _ContinuousCartPole(gym.ActionWrapper):
    """CartPole with a continuous force ``a`` in [-1, 1]: push with ``|a| * 10`` N in the sign's direction."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self._force = float(env.unwrapped.force_mag)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def action(self, action: Any) -> int:
        value = float(np.clip(np.asarray(action, dtype=np.float64).reshape(-1)[0], -1.0, 1.0))
        self.env.unwrapped.force_mag = abs(value) * self._force
        return int(value > 0)


#: task name -> (gymnasium id, drawing function, instructions, wrapper of the base env or None)
TASKS: dict[str, tuple[str, Callable[[Canvas, Any], None], tuple[str, ...], Callable[[gym.Env], gym.Env] | None]] = {
    "pendulum": (
        "Pendulum-v1",
        _draw_pendulum,
        (
            "swing the pendulum up and balance it upright",
            "keep the red rod pointing straight up",
            "raise the pendulum to the top and hold it there",
        ),
        None,
    ),
    "mountain_car": (
        "MountainCarContinuous-v0",
        _draw_mountain_car,
        (
            "drive the car up the right hill to the yellow flag",
            "reach the flag on the right hilltop",
            "rock the car back and forth, then climb to the flag",
        ),
        None,
    ),
    "cartpole": (
        "CartPole-v1",
        _draw_cartpole,
        (
            "keep the pole balanced on the cart",
            "push the cart so that the pole stays upright",
            "balance the orange pole, do not let it fall",
        ),
        _ContinuousCartPole,
    ),
}


class PixelControlEnv(gym.Wrapper):
    """Replaces a control task's state observation with ``{"image", "instruction"}``.

    Args:
        env: the task (its ``unwrapped.state`` is what ``draw`` reads).
        draw: ``draw(canvas, env)`` paints the current state on a cleared :class:`Canvas`.
        instructions: phrasings of the task; one is drawn per episode from the env's RNG.
        size: image height and width in pixels.

    The reward, termination and action space are the task's. ``render()`` with
    ``render_mode="rgb_array"`` returns the observation image.
    """

    def __init__(
        self,
        env: gym.Env,
        draw: Callable[[Canvas, Any], None],
        instructions: tuple[str, ...],
        size: int = 64,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(env)
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
        self._render_mode = render_mode
        if not isinstance(size, int) or size < 8:
            raise ValueError(f"size must be an int >= 8 pixels, got {size!r}")
        if not instructions:
            raise ValueError("instructions is empty: give at least one phrasing of the task")
        text = gym.spaces.Text(INSTRUCTION_MAX_LENGTH, min_length=1, charset=INSTRUCTION_CHARSET)
        for phrase in instructions:
            if not text.contains(phrase):
                raise ValueError(f"instruction {phrase!r} does not fit {text}")
        self.observation_space = gym.spaces.Dict(
            {"image": gym.spaces.Box(0, 255, (size, size, 3), np.uint8), "instruction": text}
        )
        self._draw = draw
        self.instructions = tuple(instructions)
        self._canvas = Canvas(size)
        self._instruction = self.instructions[0]

    @property
    def render_mode(self) -> str | None:
        return self._render_mode

    def _observe(self) -> dict[str, Any]:
        self._canvas.clear()
        self._draw(self._canvas, self.env)
        return {"image": self._canvas.image.copy(), "instruction": self._instruction}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        _, info = self.env.reset(seed=seed, options=options)
        self._instruction = self.instructions[int(self.env.np_random.integers(len(self.instructions)))]
        return self._observe(), info

    def step(self, action: Any):
        _, reward, terminated, truncated, info = self.env.step(action)
        return self._observe(), reward, terminated, truncated, info

    def render(self) -> np.ndarray | None:
        return self._canvas.image.copy() if self.render_mode == "rgb_array" else None


class PixelReachEnv(gym.Env):
    """Move a dot onto the coloured square that the instruction names: the instruction matters.

    Three squares (red, green, blue) and a black dot are drawn at random places each episode; the
    instruction names one square (``"move the dot onto the green square"``, a few phrasings). The
    action is the dot's velocity, ``Box(-1, 1, (2,))``, a tenth of the field per step at most. The
    reward per step is minus the distance from the dot to the named square's centre (the field is
    the unit square); an episode is ``max_steps`` steps (truncated). A policy that ignores the
    instruction heads for the wrong square two times in three.

    Example:
        >>> env = PixelReachEnv(size=16)
        >>> obs, _ = env.reset(seed=0)
        >>> obs["image"].shape, obs["instruction"].split()[-2] in PixelReachEnv.COLORS
        ((16, 16, 3), True)
    """

    COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220)}
    PHRASES = ("move the dot onto the {} square", "put the dot on the {} square", "go to the {} square")
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, size: int = 64, max_steps: int = 40, render_mode: str | None = None) -> None:
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
        if not isinstance(size, int) or size < 8:
            raise ValueError(f"size must be an int >= 8 pixels, got {size!r}")
        self.render_mode, self.size, self.max_steps = render_mode, size, int(max_steps)
        text = gym.spaces.Text(INSTRUCTION_MAX_LENGTH, min_length=1, charset=INSTRUCTION_CHARSET)
        self.observation_space = gym.spaces.Dict(
            {"image": gym.spaces.Box(0, 255, (size, size, 3), np.uint8), "instruction": text}
        )
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self._canvas = Canvas(size)
        self._half = 0.1  # half the side of a square, in field units

    def _observe(self) -> dict[str, Any]:
        canvas, scale = self._canvas, self.size
        canvas.clear()
        for color, (x, y) in zip(self.COLORS.values(), self._squares, strict=True):
            canvas.rect((x - self._half) * scale, (y - self._half) * scale, (x + self._half) * scale,
                        (y + self._half) * scale, color)  # fmt: skip
        canvas.disc((self._dot[0] * scale, self._dot[1] * scale), max(1.0, 0.06 * scale), (0, 0, 0))
        return {"image": canvas.image.copy(), "instruction": self._instruction}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        rng = self.np_random
        while True:  # squares apart, so each is seen whole
            squares = rng.uniform(0.15, 0.85, size=(3, 2))
            if min(np.abs(squares[i] - squares[j]).max() for i in range(3) for j in range(i)) > 2.5 * self._half:
                break
        self._squares = squares
        self._dot = rng.uniform(0.1, 0.9, size=2)
        self._target = int(rng.integers(3))
        phrase = self.PHRASES[int(rng.integers(len(self.PHRASES)))]
        self._instruction = phrase.format(list(self.COLORS)[self._target])
        self._steps = 0
        return self._observe(), {"target": self._target}

    def step(self, action: Any):
        move = np.clip(np.asarray(action, dtype=np.float64).reshape(2), -1.0, 1.0) * 0.1
        self._dot = np.clip(self._dot + move, 0.0, 1.0)
        self._steps += 1
        reward = -float(np.linalg.norm(self._dot - self._squares[self._target]))
        return self._observe(), reward, False, self._steps >= self.max_steps, {"target": self._target}

    def render(self) -> np.ndarray | None:
        return self._canvas.image.copy() if self.render_mode == "rgb_array" else None


def make_pixel_env(task: str = "pendulum", size: int = 64, render_mode: str | None = None, **kwargs: Any) -> gym.Env:
    """A registered pixel task by name (``"pendulum"``, ``"mountain_car"``, ``"cartpole"``); ``kwargs`` go to ``gym.make``.

    Example:
        >>> env = make_pixel_env("cartpole", size=32)
        >>> env.observation_space["image"].shape, env.action_space.shape
        ((32, 32, 3), (1,))
    """
    if task not in TASKS:
        raise ValueError(f"unknown pixel task {task!r}; choose one of {sorted(TASKS)}")
    env_id, draw, instructions, wrap = TASKS[task]
    env = gym.make(env_id, **kwargs)
    if wrap is not None:
        env = wrap(env)
    return PixelControlEnv(env, draw, instructions, size=size, render_mode=render_mode)
