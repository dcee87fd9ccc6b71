"""The reward-plugin registry and how plugins are called.

A reward plugin is a sync or async function ``f(prompt, completion, **info) -> float``
registered under a name; :class:`CombinedReward` sums plugins with weights.

Example:
    >>> from asyncvec.lm.rewards import score
    >>> score("exact_answer", "3+4=", " 7")
    1.0
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    pass


RewardFn = Callable[..., float | Awaitable[float]]
"""A reward plugin: ``f(prompt: str, completion: str, **info) -> float`` (or awaitable)."""

_F = TypeVar("_F", bound=Callable[..., Any])

_registry: dict[str, RewardFn] = {}
_registry_lock = threading.Lock()


class AsyncRewardInLoopError(RuntimeError):
    """An async reward was scored synchronously (``score``, a ``CombinedReward`` call) in a thread whose
    event loop is running, where it cannot be run to completion: ``await ascore(...)`` there instead."""


# ---------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------


def register(name: str, *, replace: bool = False) -> Callable[[_F], _F]:
    """Register a reward plugin under ``name`` (decorator); the function is returned unchanged.

    Args:
        name: Unique plugin name.
        replace: Allow overwriting a plugin already registered under ``name``.

    Raises:
        ValueError: ``name`` is taken (and ``replace`` is False) or empty.
        TypeError: the decorated object is not ``f(prompt, completion, **info)``.

    Example:
        >>> from asyncvec.lm import rewards
        >>> @rewards.register("says_hello")
        ... def says_hello(prompt, completion, **info):
        ...     return float("hello" in completion)
        >>> rewards.score("says_hello", "greet:", "hello there")
        1.0
        >>> rewards.unregister("says_hello")
    """
    if not isinstance(name, str):
        raise TypeError(f"reward plugin name must be a str, got {type(name).__name__}")
    if not name:
        raise ValueError("reward plugin name must be a non-empty str")

    def decorator(fn: _F) -> _F:
        _check_plugin_signature(name, fn)
        with _registry_lock:
            if name in _registry and not replace:
                raise ValueError(
                    f"reward plugin {name!r} is already registered "
                    f"({_describe(_registry[name])}); choose another name or pass replace=True"
                )
            _registry[name] = fn
        return fn

    return decorator


def unregister(name: str) -> None:
    """Remove the plugin registered under ``name``.

    Raises:
        KeyError: no plugin has that name.

    Example:
        >>> from asyncvec.lm import rewards
        >>> _ = rewards.register("tmp")(lambda prompt, completion, **info: 0.0)
        >>> rewards.unregister("tmp")
        >>> "tmp" in rewards.available()
        False
    """
    with _registry_lock:
        removed = _registry.pop(name, None)
    if removed is None:
        raise KeyError(_unknown_message(name))


def get(name: str) -> RewardFn:
    """Return the plugin registered under ``name``.

    Raises:
        KeyError: no plugin has that name (the message lists the available ones).

    Example:
        >>> from asyncvec.lm import rewards
        >>> rewards.get("exact_answer")("2+2=", "4")
        1.0
    """
    with _registry_lock:
        fn = _registry.get(name)
    if fn is None:
        raise KeyError(_unknown_message(name))
    return fn


def available() -> list[str]:
    """Names of all registered plugins, sorted.

    Example:
        >>> from asyncvec.lm import rewards
        >>> {"exact_answer", "length_penalty"} <= set(rewards.available())
        True
    """
    with _registry_lock:
        return sorted(_registry)


def _unknown_message(name: object) -> str:
    return f"no reward plugin named {name!r}; available: {available()}"


def _describe(fn: object) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(fn)


def _check_plugin_signature(name: str, fn: object) -> None:
    if not callable(fn):
        raise TypeError(
            f"reward plugin {name!r} must be a callable f(prompt, completion, **info), got {type(fn).__name__}"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature; trust them
        return
    takes_info = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    try:
        signature.bind("prompt", "completion")
    except TypeError:
        takes_info = False
    if not takes_info:
        raise TypeError(
            f"reward plugin {name!r} must have the signature f(prompt, completion, **info), "
            f"got {_describe(fn)}{signature}"
        )


# ---------------------------------------------------------------------------------------
# Calling plugins
# ---------------------------------------------------------------------------------------


def check_reward(value: object, source: str) -> float:
    """Return ``value`` as a float, or raise an error naming ``source`` and the value.

    Raises:
        TypeError: ``value`` is not a real number (e.g. a str, None or a tensor).
        ValueError: ``value`` is NaN or infinite.

    Example:
        >>> from asyncvec.lm.rewards import check_reward
        >>> check_reward(1, "my_plugin")
        1.0
        >>> check_reward(float("nan"), "my_plugin")
        Traceback (most recent call last):
        ...
        ValueError: reward 'my_plugin' returned nan; rewards must be finite
    """
    if not isinstance(value, numbers.Real):
        hint = " (call .item() on a tensor)" if hasattr(value, "item") else ""
        raise TypeError(
            f"reward {source!r} returned {value!r} of type {type(value).__name__}; expected a real number (float){hint}"
        )
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"reward {source!r} returned {value!r}; rewards must be finite")
    return result


def score(reward: str | RewardFn, prompt: str, completion: str, **info: Any) -> float:
    """Score one completion with a plugin (by name) or any reward callable.

    Async plugins are run to completion on a fresh event loop; inside a running loop use
    :func:`ascore` instead.

    Raises:
        KeyError: unknown plugin name.
        TypeError, ValueError: the plugin returned a non-numeric or non-finite value.
        AsyncRewardInLoopError: an async plugin, called in a running event loop (a ``RuntimeError``).

    Example:
        >>> from asyncvec.lm import rewards
        >>> rewards.score("exact_answer", "9-12=", "-3 is the answer")
        1.0
    """
    name, fn = _resolve(reward)
    return _call(name, fn, prompt, completion, info)


async def ascore(reward: str | RewardFn, prompt: str, completion: str, **info: Any) -> float:
    """Async :func:`score`: awaits async plugins, calls sync ones inline.

    Example:
        >>> import asyncio
        >>> from asyncvec.lm import rewards
        >>> asyncio.run(rewards.ascore("exact_answer", "3*3=", "9"))
        1.0
    """
    name, fn = _resolve(reward)
    return await _acall(name, fn, prompt, completion, info)


def _resolve(reward: str | RewardFn) -> tuple[str, RewardFn]:
    if isinstance(reward, str):
        return reward, get(reward)
    if not callable(reward):
        raise TypeError(
            f"reward must be a plugin name (str) or a callable f(prompt, completion, **info), "
            f"got {type(reward).__name__}"
        )
    if isinstance(reward, CombinedReward):
        return repr(reward), reward
    return getattr(reward, "__qualname__", None) or repr(reward), reward


def _is_async(fn: object) -> bool:
    if isinstance(fn, CombinedReward):
        return fn.is_async
    # an instance with an ``async def __call__`` is async too
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _call(name: str, fn: RewardFn, prompt: str, completion: str, info: Mapping[str, Any]) -> float:
    value = fn(prompt, completion, **info)
    if inspect.isawaitable(value):
        value = _run_to_completion(value, name)
    return check_reward(value, name)


async def _acall(name: str, fn: RewardFn, prompt: str, completion: str, info: Mapping[str, Any]) -> float:
    if isinstance(fn, CombinedReward):
        return await fn.ascore(prompt, completion, **info)
    value = fn(prompt, completion, **info)
    if inspect.isawaitable(value):
        value = await value
    return check_reward(value, name)


def _run_to_completion(awaitable: Awaitable[Any], name: str) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_await(awaitable))
    if inspect.iscoroutine(awaitable):
        awaitable.close()  # avoid a "never awaited" warning
    raise AsyncRewardInLoopError(
        f"reward {name!r} is async and an event loop is already running in this thread; "
        "use `await asyncvec.lm.rewards.ascore(...)` or a RewardService"
    )


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


class CombinedReward:
    """Weighted sum of registered plugins: ``sum(weight * plugin(prompt, completion, **info))``.

    Plugins are looked up once, at construction. Calling the object is synchronous (async
    plugins run together on a fresh event loop); :meth:`ascore` is the async form.

    Args:
        weights: ``{plugin name: weight}``, weights finite real numbers.

    Raises:
        KeyError: a name is not registered.
        TypeError, ValueError: a weight is not a finite real number, or ``weights`` is empty.

    Example:
        >>> from asyncvec.lm.rewards import CombinedReward
        >>> reward = CombinedReward({"exact_answer": 1.0, "length_penalty": 0.5})
        >>> reward("3+4=", "7")  # 1.0 - 0.5 * 0.01
        0.995
    """

    def __init__(self, weights: Mapping[str, float]) -> None:
        if not isinstance(weights, Mapping):
            raise TypeError(
                f"CombinedReward weights must be a mapping {{plugin name: weight}}, got {type(weights).__name__}"
            )
        if not weights:
            raise ValueError("CombinedReward weights must name at least one plugin")
        self.weights: dict[str, float] = {}
        self._plugins: dict[str, RewardFn] = {}
        for name, weight in weights.items():
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
                raise TypeError(
                    f"CombinedReward weight for {name!r} must be a real number, "
                    f"got {weight!r} of type {type(weight).__name__}"
                )
            if not math.isfinite(weight):
                raise ValueError(f"CombinedReward weight for {name!r} must be finite, got {weight!r}")
            self._plugins[name] = get(name)
            self.weights[name] = float(weight)
        self.is_async: bool = any(_is_async(fn) for fn in self._plugins.values())

    def __call__(self, prompt: str, completion: str, **info: Any) -> float:
        if self.is_async:
            return _run_to_completion(self.ascore(prompt, completion, **info), repr(self))
        values = [_call(name, fn, prompt, completion, info) for name, fn in self._plugins.items()]
        return self._total(values)

    async def ascore(self, prompt: str, completion: str, **info: Any) -> float:
        """Async form of calling the object: async plugins run concurrently."""
        values = await asyncio.gather(
            *(_acall(name, fn, prompt, completion, info) for name, fn in self._plugins.items())
        )
        return self._total(values)

    def _total(self, values: Sequence[float]) -> float:
        total = math.fsum(w * v for w, v in zip(self.weights.values(), values, strict=True))
        return check_reward(total, repr(self))

    def __repr__(self) -> str:
        return f"CombinedReward({self.weights!r})"
