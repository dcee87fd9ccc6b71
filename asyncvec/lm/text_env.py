"""Envs a language model can act in: observations and actions are text (``gymnasium.spaces.Text``).

* :class:`TextEnv` turns any env with ``Discrete`` actions into a text env: an instruction,
  an observation formatter, an action parser, and a rule for completions that name no action.
* :class:`StringEnv` gives an object with a plain ``reset() -> str`` / ``step(str) -> (str,
  reward, done...)`` interface (no gymnasium spaces) the ``Text`` spaces ``AsyncLLMVectorEnv``
  needs.
* :func:`check_text_env` says which wrapper to use when an env is not a text env.

No torch here: env workers import this module.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from typing import Any, Literal

import gymnasium as gym
from gymnasium import spaces

__all__ = ["TEXT_CHARSET", "StringEnv", "TextEnv", "check_text_env", "text_space"]

TEXT_CHARSET = string.printable
"""Characters of the text spaces built here: printable ASCII, including whitespace."""


def text_space(max_length: int = 4096) -> spaces.Text:
    """A ``Text`` space of up to ``max_length`` printable characters (``TEXT_CHARSET``)."""
    return spaces.Text(min_length=0, max_length=max_length, charset=TEXT_CHARSET)


def check_text_env(env: gym.Env | Any, where: str = "env") -> None:
    """Raises ``TypeError`` naming the wrapper to use unless ``env`` has ``Text`` observation and action spaces.

    Example:
        >>> check_text_env(gym.make("FrozenLake-v1"))
        Traceback (most recent call last):
        ...
        TypeError: env: the observation space is Discrete(16), not gymnasium.spaces.Text; wrap the env in asyncvec.lm.TextEnv (Discrete actions: an observation formatter and an action parser)
    """
    for role in ("observation", "action"):
        space = getattr(env, f"{role}_space", None)
        if space is None:
            raise TypeError(
                f"{where}: it has no gymnasium spaces (no {role}_space); a plain reset()/step(str) object "
                "that returns strings runs through asyncvec.lm.StringEnv"
            )
        if not isinstance(space, spaces.Text):
            action_space = getattr(env, "action_space", None)
            hint = (
                "wrap the env in asyncvec.lm.TextEnv (Discrete actions: an observation formatter and an action parser)"
                if isinstance(action_space, spaces.Discrete)
                else "wrap it in a gymnasium wrapper whose observation and action spaces are gymnasium.spaces.Text "
                "(asyncvec.lm.TextEnv handles Discrete actions)"
            )
            raise TypeError(f"{where}: the {role} space is {space}, not gymnasium.spaces.Text; {hint}")


def _default_parser(names: Sequence[str]) -> Callable[[str], int | None]:
    lowered = [name.lower() for name in names]

    def parse(completion: str) -> int | None:
        words = re.findall(r"[a-z]+|\d+", completion.lower())
        for word in words[:1]:  # the completion's first word decides
            if word.isdigit():
                return int(word) if int(word) < len(names) else None
            if word in lowered:
                return lowered.index(word)
        return None

    return parse


class TextEnv(gym.Wrapper):
    """Any env with ``Discrete`` actions as a text env: text observations in, completions out.

    The observation is ``format_observation(obs)`` (the first one of an episode after the
    ``instruction``). A completion becomes an action through ``parse_action``: by default its
    first word, an action name (case-insensitive) or an action index. A completion that names no
    action (empty, unparsable, out of range) follows ``invalid_action``:

    * ``"penalty"`` (default): the env does not step (a no-op), the reward is ``-invalid_penalty``,
      the observation repeats with ``"Invalid action. "`` before it, and the episode goes on;
      ``max_invalid`` such turns in a row end it (``truncated``);
    * ``"end"``: the episode ends at once (``truncated``), reward ``-invalid_penalty``.

    ``info["invalid_action"]`` is True on those turns.
    ``metadata["multi_turn"]`` is True: the LM agents play its episodes turn by turn.

    Args:
        env: the env (its ``action_space`` must be ``Discrete``).
        action_names: a name per action, shown in the default instruction (default: ``"0"``, ``"1"``...).
        format_observation: ``obs -> str`` (default ``str``).
        instruction: text before the first observation (default: lists the action names).
        parse_action: ``completion -> action index or None`` (default: see above).
        invalid_action, invalid_penalty, max_invalid: see above.
        max_length: ``max_length`` of the Text spaces.

    Example:
        >>> env = TextEnv(gym.make("FrozenLake-v1", is_slippery=False), action_names=["left", "down", "right", "up"])
        >>> obs, _ = env.reset(seed=0)
        >>> obs.splitlines()[0]
        'Actions: left, down, right, up.'
        >>> env.step("down")[1:3], env.step("jump")[1], env.step("jump")[4]["invalid_action"]
        ((0.0, False), -0.1, True)
    """

    def __init__(
        self,
        env: gym.Env,
        *,
        action_names: Sequence[str] | None = None,
        format_observation: Callable[[Any], str] = str,
        instruction: str | None = None,
        parse_action: Callable[[str], int | None] | None = None,
        invalid_action: Literal["penalty", "end"] = "penalty",
        invalid_penalty: float = 0.1,
        max_invalid: int = 3,
        max_length: int = 4096,
    ) -> None:
        super().__init__(env)
        if not isinstance(env.action_space, spaces.Discrete):
            raise TypeError(
                f"TextEnv: the env's action space must be Discrete (one action per name), got {env.action_space}; "
                "for other envs write a gymnasium wrapper with Text spaces"
            )
        count = int(env.action_space.n)
        names = [str(i) for i in range(count)] if action_names is None else [str(n) for n in action_names]
        if len(names) != count:
            raise ValueError(f"TextEnv: {len(names)} action_names for Discrete({count})")
        if invalid_action not in ("penalty", "end"):
            raise ValueError(f"TextEnv: invalid_action must be 'penalty' or 'end', got {invalid_action!r}")
        self.action_names = names
        self.format_observation = format_observation
        self.instruction = f"Actions: {', '.join(names)}." if instruction is None else instruction
        self.parse_action = parse_action or _default_parser(names)
        self.invalid_action = invalid_action
        self.invalid_penalty = float(invalid_penalty)
        self.max_invalid = int(max_invalid)
        self.observation_space = text_space(max_length)
        self.action_space = text_space(max_length)
        # its episodes go on turn after turn: the LM agents play them (asyncvec.lm.build.is_multi_turn)
        self.metadata = {**env.metadata, "multi_turn": True}
        self._last_text = ""
        self._invalid_in_row = 0

    def _action(self, completion: str) -> int | None:
        try:
            action = self.parse_action(completion)
        except (ValueError, TypeError, KeyError, IndexError):
            return None
        if action is None or not self.env.action_space.contains(action):
            return None
        return int(action)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        self._last_text = self.format_observation(obs)
        self._invalid_in_row = 0
        text = f"{self.instruction}\n{self._last_text}" if self.instruction else self._last_text
        return text, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(f"TextEnv: the action must be a str (a completion), got {type(action).__name__}")
        index = self._action(action)
        if index is None:
            self._invalid_in_row += 1
            end = self.invalid_action == "end" or self._invalid_in_row >= self.max_invalid
            return f"Invalid action. {self._last_text}", -self.invalid_penalty, False, end, {"invalid_action": True}
        self._invalid_in_row = 0
        obs, reward, terminated, truncated, info = self.env.step(index)
        self._last_text = self.format_observation(obs)
        return self._last_text, float(reward), bool(terminated), bool(truncated), {**info, "invalid_action": False}


class StringEnv(gym.Env[str, str]):
    """An object with a plain ``reset() -> str`` and ``step(str) -> (str, reward, done, ...)``
    (no gymnasium spaces) as a gymnasium env with ``Text`` spaces, so it runs in ``AsyncLLMVectorEnv``.

    ``reset`` may return ``obs`` or ``(obs, info)`` and may take a ``seed`` keyword (passed when it
    accepts one); ``step`` may return ``(obs, reward, done)``, ``(obs, reward, done, info)`` or
    gymnasium's five-tuple. ``done`` counts as ``terminated``. Observations must be ``str``:
    anything else raises ``TypeError``.
    ``multi_turn`` (True: episodes of several turns; False: one prompt, one completion) becomes
    ``metadata["multi_turn"]``; left None, the LM agents play its episodes turn by turn.

    Example:
        >>> class Echo:
        ...     def reset(self): return "say hi"
        ...     def step(self, text): return text, float(text == "hi"), True
        >>> env = StringEnv(Echo())
        >>> env.reset(seed=0)
        ('say hi', {})
        >>> env.step("hi")
        ('hi', 1.0, True, False, {})
    """

    metadata = {"render_modes": []}

    def __init__(self, env: Any, max_length: int = 4096, multi_turn: bool | None = None) -> None:
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise TypeError(f"StringEnv: {type(env).__name__} has no {method}() method")
        self.env = env
        if multi_turn is not None:  # what the LM agents read (asyncvec.lm.build.is_multi_turn)
            self.metadata = {**self.metadata, "multi_turn": bool(multi_turn)}
        self.observation_space = text_space(max_length)
        self.action_space = text_space(max_length)

    @staticmethod
    def _text(obs: Any, call: str) -> str:
        if not isinstance(obs, str):
            raise TypeError(f"StringEnv: {call} returned a {type(obs).__name__} observation, expected str")
        return obs

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        try:
            out = self.env.reset(seed=seed) if seed is not None else self.env.reset()
        except TypeError:  # a reset() that takes no seed
            out = self.env.reset()
        obs, info = out if isinstance(out, tuple) else (out, {})
        return self._text(obs, "reset()"), dict(info)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        out = self.env.step(action)
        if len(out) == 5:
            obs, reward, terminated, truncated, info = out
        elif len(out) in (3, 4):
            obs, reward, terminated = out[:3]
            truncated, info = False, (out[3] if len(out) == 4 else {})
        else:
            raise TypeError(f"StringEnv: step() returned {len(out)} values, expected 3, 4 or 5")
        return self._text(obs, "step()"), float(reward), bool(terminated), bool(truncated), dict(info)

    def close(self) -> None:
        if callable(getattr(self.env, "close", None)):
            self.env.close()
