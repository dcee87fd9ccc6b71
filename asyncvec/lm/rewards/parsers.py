"""Answer parsers and the built-in reward plugins (``exact_answer``, ``length_penalty``) that use them.

Example:
    >>> from asyncvec.lm.rewards import parse_leading_int
    >>> parse_leading_int(" 7 apples")
    7
"""

from __future__ import annotations

import numbers
import operator
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

from asyncvec.lm.rewards.registry import register

ARITHMETIC_OPERATIONS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}
"""Operator symbol -> function, shared by the arithmetic env and the ``exact_answer`` plugin."""

_LEADING_INT = re.compile(r"[+-]?\d+")
_ARITHMETIC_PROBLEM = re.compile(r"(\d+)\s*([-+*])\s*(\d+)\s*=\s*\Z")


def parse_leading_int(text: str) -> int | None:
    """The integer at the start of ``text`` after stripping whitespace, or None.

    Example:
        >>> from asyncvec.lm.rewards import parse_leading_int
        >>> parse_leading_int("  42 because 6*7"), parse_leading_int("-3"), parse_leading_int("x1")
        (42, -3, None)
    """
    match = _LEADING_INT.match(text.strip())
    if match is None:
        return None
    try:
        return int(match.group())
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
        return None


def solve_arithmetic(prompt: str) -> int | None:
    """The answer to a prompt ending in ``"a+b="`` (``+``, ``-`` or ``*``), or None.

    Example:
        >>> from asyncvec.lm.rewards import solve_arithmetic
        >>> solve_arithmetic("12*3="), solve_arithmetic("What is 7-9 ="), solve_arithmetic("hi")
        (36, -2, None)
    """
    match = _ARITHMETIC_PROBLEM.search(prompt)
    if match is None:
        return None
    left, symbol, right = match.groups()
    try:
        return ARITHMETIC_OPERATIONS[symbol](int(left), int(right))
    except ValueError:
        return None


@register("exact_answer")
def exact_answer(prompt: str, completion: str, *, answer: int | None = None, **info: Any) -> float:
    """1.0 if the completion's leading integer equals the answer, else 0.0.

    The answer is ``info["answer"]`` when given (the arithmetic env puts it there), otherwise
    it is solved from a prompt ending in ``"a+b="``.

    Raises:
        TypeError: ``answer`` is not an integer.
        ValueError: no ``answer`` and the prompt holds no arithmetic problem.

    Example:
        >>> from asyncvec.lm.rewards import exact_answer
        >>> exact_answer("3+4=", " 7 "), exact_answer("Q", "8", answer=7)
        (1.0, 0.0)
    """
    if answer is None:
        answer = solve_arithmetic(prompt)
        if answer is None:
            raise ValueError(f"exact_answer needs info['answer'] or a prompt ending in 'a+b=', got prompt {prompt!r}")
    elif isinstance(answer, bool) or not isinstance(answer, numbers.Integral):
        raise TypeError(f"exact_answer: info['answer'] must be an int, got {answer!r} of type {type(answer).__name__}")
    return 1.0 if parse_leading_int(completion) == int(answer) else 0.0


@register("length_penalty")
def length_penalty(prompt: str, completion: str, *, scale_chars: int = 100, **info: Any) -> float:
    """``-len(completion) / scale_chars``, capped at -1.0: discourages rambling completions.

    Register a variant with :func:`functools.partial`, e.g.
    ``register("short")(partial(length_penalty, scale_chars=20))``.

    Example:
        >>> from asyncvec.lm.rewards import length_penalty
        >>> length_penalty("3+4=", "7"), length_penalty("3+4=", "x" * 500)
        (-0.01, -1.0)
    """
    if scale_chars <= 0:
        raise ValueError(f"length_penalty: scale_chars must be > 0, got {scale_chars!r}")
    return -min(1.0, len(completion) / scale_chars)
