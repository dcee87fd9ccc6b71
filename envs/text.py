"""Text tasks for language-model policies: the observation is a prompt, the action a completion.

Both envs use :class:`gymnasium.spaces.Text` spaces and need no downloads. Any ``str``
completion is accepted, also one outside ``action_space`` (longer, or with other characters),
because a model may emit it; only non-strings are rejected. Completions are parsed leniently
with :func:`asyncvec.lm.rewards.parse_leading_int` (strip whitespace, take the leading integer).

Example:
    >>> from asyncvec.envs.text import ArithmeticEnv
    >>> env = ArithmeticEnv(single_digit=True)
    >>> prompt, info = env.reset(seed=0)
    >>> prompt
    '8+6='
    >>> env.step("14")[1:4]
    (1.0, True, False)
"""

from __future__ import annotations

import re
import string
import time
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.error import ResetNeeded

from asyncvec.lm.rewards import ARITHMETIC_OPERATIONS, exact_answer, parse_leading_int

__all__ = [
    "COMPLETION_CHARSET",
    "ArithmeticEnv",
    "CalculatorToolEnv",
    "FROZEN_LAKE_ACTIONS",
    "GuessNumberEnv",
    "frozen_lake_board",
    "make_frozen_lake_text",
]

COMPLETION_CHARSET = string.printable
"""Characters of the completion (action) spaces: printable ASCII, including whitespace."""


def _check_action(action: object) -> str:
    if not isinstance(action, str):
        raise TypeError(f"action must be a str (the model's completion), got {type(action).__name__}: {action!r}")
    return action


def _check_int(field: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int, got {value!r} of type {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value}")
    return value


class ArithmeticEnv(gym.Env[str, str]):
    """One-step arithmetic: the prompt is ``"12+7="``, reward 1.0 for the exact answer.

    The completion's leading integer is the answer (``" 19 because..."`` counts as 19).
    Episodes end (``terminated``) after one step. ``info`` of ``step`` holds ``answer`` (int)
    and ``parsed`` (whether the completion started with an integer).

    Args:
        min_operand: Smallest operand (>= 0).
        max_operand: Largest operand (default 99; 9 in ``single_digit`` mode).
        operations: Operators to draw from, a subset of ``"+"``, ``"-"``, ``"*"`` (default all;
            ``("+",)`` in ``single_digit`` mode). Subtraction may give negative answers.
        single_digit: The simplified task for a tiny model: single-digit sums
            (``"3+4="`` -> ``"7"``).
        max_completion_length: ``max_length`` of the action space.

    Example:
        >>> from asyncvec.envs.text import ArithmeticEnv
        >>> env = ArithmeticEnv(max_operand=20, operations="*")
        >>> prompt, _ = env.reset(seed=3)
        >>> _, reward, terminated, truncated, info = env.step("no idea")
        >>> reward, terminated, truncated, info["parsed"]
        (0.0, True, False, False)
    """

    # one step per episode: the LM agents score its completions with their --reward plugin
    metadata = {"render_modes": [], "multi_turn": False}

    def __init__(
        self,
        *,
        min_operand: int = 0,
        max_operand: int | None = None,
        operations: Sequence[str] | None = None,
        single_digit: bool = False,
        max_completion_length: int = 32,
    ) -> None:
        if single_digit:
            if max_operand not in (None, 9) or (operations is not None and tuple(operations) != ("+",)):
                raise ValueError(
                    "single_digit=True fixes max_operand=9 and operations=('+',); "
                    f"got max_operand={max_operand!r}, operations={operations!r}"
                )
            max_operand, operations = 9, ("+",)
        self.min_operand = _check_int("min_operand", min_operand, 0)
        self.max_operand = _check_int("max_operand", 99 if max_operand is None else max_operand, self.min_operand)
        self.operations = tuple(ARITHMETIC_OPERATIONS if operations is None else operations)
        unknown = [op for op in self.operations if op not in ARITHMETIC_OPERATIONS]
        if unknown or not self.operations:
            raise ValueError(
                f"operations must be a non-empty subset of {tuple(ARITHMETIC_OPERATIONS)}, got {operations!r}"
            )
        _check_int("max_completion_length", max_completion_length, 1)

        operand_digits = len(str(self.max_operand))
        self.observation_space = spaces.Text(
            min_length=4,
            max_length=2 * operand_digits + 2,
            charset=string.digits + "".join(self.operations) + "=",
        )
        self.action_space = spaces.Text(min_length=0, max_length=max_completion_length, charset=COMPLETION_CHARSET)
        self._prompt: str | None = None
        self._answer = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Draw a new problem; ``info`` is empty (the answer comes with ``step``)."""
        super().reset(seed=seed)
        left, right = (int(x) for x in self.np_random.integers(self.min_operand, self.max_operand + 1, size=2))
        symbol = self.operations[int(self.np_random.integers(len(self.operations)))]
        self._prompt = f"{left}{symbol}{right}="
        self._answer = ARITHMETIC_OPERATIONS[symbol](left, right)
        return self._prompt, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Score the completion; the returned observation is the answered prompt."""
        completion = _check_action(action)
        if self._prompt is None:
            raise ResetNeeded("ArithmeticEnv: call reset() before step() (episodes last one step)")
        prompt, self._prompt = self._prompt, None
        reward = exact_answer(prompt, completion, answer=self._answer)
        info = {"answer": self._answer, "parsed": parse_leading_int(completion) is not None}
        return prompt, reward, True, False, info


_FEEDBACK = ("higher", "lower", "correct", "invalid")


class GuessNumberEnv(gym.Env[str, str]):
    """Multi-turn guess-the-number in ``[1, max_number]``.

    The first observation is ``"Guess a number between 1 and 16."``; after each guess the
    feedback is ``"higher"``, ``"lower"``, ``"correct"`` or ``"invalid"`` (no leading integer,
    or one outside the range; it still uses a turn). With ``transcript=True`` the observation
    is the whole game so far, one ``"<guess>: <feedback>"`` line per turn (``"?"`` for an
    invalid guess); otherwise it is the last feedback only.

    The reward is 1.0 for the correct guess, minus ``step_penalty`` on every step.
    ``terminated`` on the correct guess, ``truncated`` after ``max_turns`` guesses.
    ``info`` holds ``turn``, ``guess`` (int or None) and ``feedback``.

    Args:
        max_number: Upper end of the range (the secret is uniform in ``[1, max_number]``).
        max_turns: Guesses per episode.
        step_penalty: Subtracted from the reward on every step (>= 0).
        transcript: Observe the running transcript instead of the last feedback.
        max_completion_length: ``max_length`` of the action space.

    Example:
        >>> from asyncvec.envs.text import GuessNumberEnv
        >>> env = GuessNumberEnv(max_number=16, max_turns=4)
        >>> obs, _ = env.reset(seed=0)
        >>> obs
        'Guess a number between 1 and 16.'
        >>> obs, reward, terminated, truncated, info = env.step("8")
        >>> print(obs)
        Guess a number between 1 and 16.
        8: higher
    """

    metadata = {"render_modes": [], "multi_turn": True}

    def __init__(
        self,
        *,
        max_number: int = 16,
        max_turns: int = 8,
        step_penalty: float = 0.0,
        transcript: bool = True,
        max_completion_length: int = 16,
    ) -> None:
        self.max_number = _check_int("max_number", max_number, 1)
        self.max_turns = _check_int("max_turns", max_turns, 1)
        if (
            isinstance(step_penalty, bool)
            or not isinstance(step_penalty, (int, float))
            or not (0 <= step_penalty < float("inf"))
        ):
            raise ValueError(f"step_penalty must be a finite number >= 0, got {step_penalty!r}")
        self.step_penalty = float(step_penalty)
        self.transcript = bool(transcript)
        _check_int("max_completion_length", max_completion_length, 1)

        self.intro = f"Guess a number between 1 and {self.max_number}."
        longest_line = len("\n") + len(str(self.max_number)) + len(": ") + max(map(len, _FEEDBACK))
        max_length = len(self.intro) + (self.max_turns * longest_line if self.transcript else 0)
        self.observation_space = spaces.Text(
            min_length=1,
            max_length=max_length,
            charset=string.ascii_letters + string.digits + " .:?\n",
        )
        self.action_space = spaces.Text(min_length=0, max_length=max_completion_length, charset=COMPLETION_CHARSET)
        self._secret = 0
        self._turn = 0
        self._lines: list[str] = []
        self._done = True

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Draw a new secret number and return the intro."""
        super().reset(seed=seed)
        self._secret = int(self.np_random.integers(1, self.max_number + 1))
        self._low, self._high = 1, self.max_number  # what the feedback so far allows
        self._turn = 0
        self._lines = [self.intro]
        self._done = False
        return self.intro, {"turn": 0}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Take one guess (the completion's leading integer)."""
        completion = _check_action(action)
        if self._done:
            raise ResetNeeded("GuessNumberEnv: the episode is over (or not started); call reset()")
        self._turn += 1
        guess = parse_leading_int(completion)
        if guess is None or not 1 <= guess <= self.max_number:
            feedback, shown = "invalid", "?"
        else:
            shown = str(guess)
            feedback = "correct" if guess == self._secret else "higher" if guess < self._secret else "lower"
        if feedback == "higher":
            self._low = max(self._low, guess + 1)
        elif feedback == "lower":
            self._high = min(self._high, guess - 1)
        self._lines.append(f"{shown}: {feedback}")
        terminated = feedback == "correct"
        truncated = not terminated and self._turn >= self.max_turns
        self._done = terminated or truncated
        reward = (1.0 if terminated else 0.0) - self.step_penalty
        observation = "\n".join(self._lines) if self.transcript else feedback
        info: dict[str, Any] = {"turn": self._turn, "feedback": feedback}
        if guess is not None:  # absent, not None: a vector env batches each info key into one typed array
            info["guess"] = guess
        return observation, reward, terminated, truncated, info

    def expert_completion(self) -> str:
        """Binary search: the middle of the range the feedback so far allows (a warm start's teacher)."""
        return str((self._low + self._high) // 2)


# ----------------------------------------------------------------------------- FrozenLake as text
FROZEN_LAKE_ACTIONS = ("left", "down", "right", "up")
"""FrozenLake's actions 0-3 by name."""


def frozen_lake_board(env: gym.Env, state: int) -> str:
    """The map, one row per line, the player's cell shown as ``P``.

    Example:
        >>> print(frozen_lake_board(gym.make("FrozenLake-v1", is_slippery=False), 5))
        SFFF
        FPFH
        FFFH
        HFFG
    """
    rows = [[cell.decode() for cell in row] for row in env.unwrapped.desc]
    width = len(rows[0])
    rows[state // width][state % width] = "P"
    return "\n".join("".join(row) for row in rows)


class _FrozenLakeExpert(gym.Wrapper):
    """Adds ``expert_completion()``: the first move of a shortest path to the goal (a warm start's teacher)."""

    def expert_completion(self) -> str:
        lake = self.env.unwrapped
        desc, (rows, cols) = lake.desc, lake.desc.shape
        goal = next(r * cols + c for r in range(rows) for c in range(cols) if desc[r, c] == b"G")
        start = int(lake.s)
        first_move: dict[int, int] = {start: -1}
        frontier = [start]
        while frontier:  # breadth-first search over the deterministic moves
            nxt = []
            for state in frontier:
                for action in range(4):
                    target = lake.P[state][action][0][1]
                    r, c = divmod(target, cols)
                    if target in first_move or desc[r, c] == b"H":
                        continue
                    first_move[target] = action if state == start else first_move[state]
                    if target == goal:
                        return FROZEN_LAKE_ACTIONS[first_move[target]]
                    nxt.append(target)
            frontier = nxt
        return FROZEN_LAKE_ACTIONS[0]


def make_frozen_lake_text(max_turns: int = 12, **kwargs: Any) -> gym.Env:
    """Deterministic 4x4 FrozenLake (``is_slippery=False``) as a text env: the map with ``P`` for
    the player, one of ``left/down/right/up`` per turn, reward 1 at the goal, an episode ends
    in a hole, at the goal or after ``max_turns`` turns. ``kwargs`` go to
    :class:`asyncvec.lm.TextEnv` (e.g. ``invalid_action="end"``).

    Example:
        >>> env = make_frozen_lake_text()
        >>> obs, _ = env.reset(seed=0)
        >>> print(obs)
        Actions: left, down, right, up.
        PFFF
        FHFH
        FFFH
        HFFG
        >>> env.expert_completion()
        'down'
    """
    from gymnasium.wrappers import TimeLimit

    from asyncvec.lm.text_env import TextEnv

    lake = gym.make("FrozenLake-v1", is_slippery=False, map_name="4x4").unwrapped
    text = TextEnv(
        lake,
        action_names=FROZEN_LAKE_ACTIONS,
        format_observation=lambda state: frozen_lake_board(lake, int(state)),
        **kwargs,
    )
    return _FrozenLakeExpert(TimeLimit(text, max_episode_steps=max_turns))


# ---------------------------------------------------------------------------------- a tool env
class CalculatorToolEnv(gym.Env[str, str]):
    """Arithmetic with a calculator tool: the model may call it before it answers.

    The first observation asks e.g. ``"What is 12*7+5? Reply 'call: <expr>' to use the
    calculator, or 'answer: <n>'."``. A completion ``"call: 12*7"`` runs the calculator: after
    a heavy-tailed latency (lognormal, median ``tool_median_ms``, ``tool_sigma``; the step
    sleeps, as a remote tool would) the next observation is ``"result: 84"``. Outcomes:

    * an expression the calculator cannot evaluate: ``"error: cannot evaluate"``;
    * a call slower than ``tool_timeout_ms``: the step returns after the timeout with
      ``"error: timeout"`` (``info["tool_timeout"]``);
    * ``"answer: <n>"`` (or a completion starting with an integer): reward 1.0 if right, 0.0
      otherwise, ``terminated``;
    * anything else: ``"error: say 'call: <expr>' or 'answer: <n>'"``, reward 0.

    After ``max_turns`` turns the episode is ``truncated``. ``info`` counts ``tool_calls``.

    Example:
        >>> env = CalculatorToolEnv(tool_median_ms=1.0)
        >>> obs, _ = env.reset(seed=0)
        >>> obs.split("?")[0]
        'What is 18*13+11'
        >>> env.step("call: 18*13")[0], env.step("answer: 245")[1:3]
        ('result: 234', (1.0, True))
    """

    metadata = {"render_modes": [], "multi_turn": True}
    _CALL = re.compile(r"^\s*call:\s*(.*)$", re.S)
    _ANSWER = re.compile(r"^\s*(?:answer:)?\s*(-?\d+)")
    _SAFE = re.compile(r"^[\d\s+\-*()]{1,40}$")

    def __init__(
        self,
        *,
        max_operand: int = 20,
        max_turns: int = 4,
        tool_median_ms: float = 20.0,
        tool_sigma: float = 1.0,
        tool_timeout_ms: float = 1000.0,
    ) -> None:
        self.max_operand = _check_int("max_operand", max_operand, 1)
        self.max_turns = _check_int("max_turns", max_turns, 1)
        self.tool_median_ms, self.tool_sigma, self.tool_timeout_ms = tool_median_ms, tool_sigma, tool_timeout_ms
        self.observation_space = spaces.Text(min_length=0, max_length=256, charset=COMPLETION_CHARSET)
        self.action_space = spaces.Text(min_length=0, max_length=256, charset=COMPLETION_CHARSET)
        self._answer = 0
        self._turn = 0
        self.tool_calls = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        a, b, c = (int(x) for x in self.np_random.integers(1, self.max_operand + 1, size=3))
        self._answer, self._turn = a * b + c, 0
        return f"What is {a}*{b}+{c}? Reply 'call: <expr>' to use the calculator, or 'answer: <n>'.", {}

    def _calculate(self, expression: str) -> tuple[str, bool]:
        latency = self.tool_median_ms * float(np.exp(self.tool_sigma * self.np_random.standard_normal()))
        timed_out = latency > self.tool_timeout_ms
        time.sleep(min(latency, self.tool_timeout_ms) / 1000.0)
        if timed_out:
            return "error: timeout", True
        if not self._SAFE.match(expression):
            return "error: cannot evaluate", False
        try:
            return f"result: {eval(expression, {'__builtins__': {}}, {})}", False  # digits and + - * ( ) only
        except Exception:
            return "error: cannot evaluate", False

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        completion = _check_action(action)
        self._turn += 1
        info: dict[str, Any] = {"tool_timeout": False}
        call = self._CALL.match(completion)
        reward, terminated = 0.0, False
        if call:
            self.tool_calls += 1
            observation, info["tool_timeout"] = self._calculate(call.group(1).strip())
        elif (answer := self._ANSWER.match(completion)) is not None:
            reward, terminated = float(int(answer.group(1)) == self._answer), True
            observation = "correct" if reward else "wrong"
        else:
            observation = "error: say 'call: <expr>' or 'answer: <n>'"
        info["tool_calls"] = self.tool_calls
        truncated = not terminated and self._turn >= self.max_turns
        return observation, reward, terminated, truncated, info
