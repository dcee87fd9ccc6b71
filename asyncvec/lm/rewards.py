"""Reward plugins and an asynchronous reward service for language-model policies.

A reward plugin is a sync or async function ``f(prompt, completion, **info) -> float``
registered under a name. :class:`CombinedReward` sums plugins with weights.
:class:`RewardService` scores ``(prompt, response)`` pairs on background threads while the
policy keeps generating: it batches requests for a reward model (:class:`HFRewardModel`),
caches results per reward-model version, and turns timeouts and scorer errors into
*flagged* results that stay out of training.

This module imports neither torch nor transformers until a reward model is built.

Example:
    >>> from asyncvec.lm import rewards
    >>> rewards.score("exact_answer", "3+4=", " 7")
    1.0
    >>> with rewards.RewardService("exact_answer", timeout_s=5.0) as service:
    ...     result = service.submit("12*3=", "36").result(timeout=5.0)
    >>> result.reward, result.usable
    (1.0, True)
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import inspect
import logging
import math
import numbers
import operator
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "ARITHMETIC_OPERATIONS",
    "BatchScorer",
    "CombinedReward",
    "HFRewardModel",
    "RewardFn",
    "RewardResult",
    "RewardService",
    "RewardServiceStats",
    "ascore",
    "available",
    "check_reward",
    "exact_answer",
    "get",
    "length_penalty",
    "parse_leading_int",
    "register",
    "score",
    "solve_arithmetic",
    "unregister",
]

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float | Awaitable[float]]
"""A reward plugin: ``f(prompt: str, completion: str, **info) -> float`` (or awaitable)."""

_F = TypeVar("_F", bound=Callable[..., Any])

_registry: dict[str, RewardFn] = {}
_registry_lock = threading.Lock()


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
    raise RuntimeError(
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


# ---------------------------------------------------------------------------------------
# Built-in plugins
# ---------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------
# Reward models
# ---------------------------------------------------------------------------------------


@runtime_checkable
class BatchScorer(Protocol):
    """A scorer that rates many ``(prompt, response)`` pairs in one call (e.g. a reward model)."""

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str]) -> Sequence[float]:
        """One score per pair, in order."""
        ...


class HFRewardModel:
    """A transformers sequence-classification model used as a reward model.

    The pair is encoded as ``tokenizer(prompt, response)`` (right-padded); the score is the
    single regression logit (``num_labels == 1``) or the logit of label 1.

    Args:
        model: A ``*ForSequenceClassification`` model; put it on its device beforehand.
        tokenizer: Its tokenizer; needs a pad token, and ``model.config.pad_token_id`` set.
        max_length: Truncate pairs to this many tokens (default: the model's context size).
        label: Which logit to use (default: 0 for one label, else 1).

    Example:
        >>> from tokenizers import Tokenizer, models
        >>> from transformers import (
        ...     GPT2Config, GPT2ForSequenceClassification, PreTrainedTokenizerFast)
        >>> from asyncvec.lm.rewards import HFRewardModel
        >>> vocab = {"<pad>": 0, **{c: i + 1 for i, c in enumerate("0123456789+-*= ")}}
        >>> # a BPE model without merges is a character-level tokenizer
        >>> chars = Tokenizer(models.BPE(vocab, merges=[], unk_token="<pad>"))
        >>> tok = PreTrainedTokenizerFast(tokenizer_object=chars, pad_token="<pad>")
        >>> config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(vocab),
        ...                     num_labels=1, pad_token_id=0)
        >>> rm = HFRewardModel(GPT2ForSequenceClassification(config), tok)
        >>> len(rm.score_batch(["3+4=", "1+1="], ["7", "2"]))
        2
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_length: int | None = None,
        label: int | None = None,
    ) -> None:
        config = model.config
        num_labels = int(config.num_labels)
        self.label = (0 if num_labels == 1 else 1) if label is None else label
        if not 0 <= self.label < num_labels:
            raise ValueError(f"label must be in [0, {num_labels}) for this model, got {label!r}")
        if tokenizer.pad_token_id is None:
            raise ValueError("tokenizer.pad_token is None; set one (e.g. tokenizer.pad_token = tokenizer.eos_token)")
        if config.pad_token_id is None:
            raise ValueError(
                "model.config.pad_token_id is None; set model.config.pad_token_id = "
                "tokenizer.pad_token_id so padded batches score like single pairs"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length or getattr(config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        self._lock = threading.Lock()  # weights never change during a forward pass

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> HFRewardModel:
        """Load model and tokenizer saved with ``save_pretrained`` in ``path``.

        ``kwargs`` go to :class:`HFRewardModel` (``max_length``, ``label``).
        """
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model = AutoModelForSequenceClassification.from_pretrained(path)
        if device is not None:
            model = model.to(device)
        return cls(model, AutoTokenizer.from_pretrained(path), **kwargs)

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """Score each ``(prompt, response)`` pair; returns one float per pair."""
        import torch

        encoded = self.tokenizer(
            list(prompts),
            list(responses),
            padding=True,
            padding_side="right",  # keeps absolute positions equal to unpadded scoring
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        ).to(self.device)
        with self._lock, torch.inference_mode():
            logits = self.model(**encoded).logits
        return logits[:, self.label].float().tolist()

    def load_weights(self, weights: Mapping[str, torch.Tensor] | str | os.PathLike[str]) -> None:
        """Replace the weights with a state dict or a ``save_pretrained`` folder (strict)."""
        if isinstance(weights, (str, os.PathLike)):
            weights = type(self.model).from_pretrained(weights).state_dict()
        with self._lock:
            self.model.load_state_dict(weights)


# ---------------------------------------------------------------------------------------
# Service
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """The outcome of one :meth:`RewardService.submit`.

    Attributes:
        reward: The score, or the service's ``timeout_reward`` when flagged.
        flagged: True when the score is a stand-in (timeout or scorer error).
        latency: Seconds from submit to result.
        rm_version: Reward-model version that produced (or would have produced) the score.
        cached: True when served from the cache.
        reason: Why the result is flagged (None otherwise).
    """

    reward: float
    flagged: bool
    latency: float
    rm_version: int
    cached: bool
    reason: str | None = None

    @property
    def usable(self) -> bool:
        """Whether the sample may be trained on (flagged samples must not be)."""
        return not self.flagged


@dataclasses.dataclass(frozen=True)
class RewardServiceStats:
    """Counters of a :class:`RewardService`.

    Every request ends in exactly one of ``cache_hits``, ``scored``, ``timeouts``, ``errors``
    (or is still pending). ``batches`` counts ``score_batch`` calls (batch scorers only);
    ``cache_size`` is the number of cached scores.
    """

    requests: int
    cache_hits: int
    scored: int
    timeouts: int
    errors: int
    batches: int
    cache_size: int


@dataclasses.dataclass(eq=False)
class _Request:
    prompt: str
    response: str
    info: dict[str, Any]
    cache_key: Hashable | None  # without the version; None when info is unhashable
    start: float
    future: concurrent.futures.Future[RewardResult]
    timer: asyncio.TimerHandle | None = None


class RewardService:
    """Scores ``(prompt, response)`` pairs in the background, in parallel with generation.

    Requests go to an asyncio loop on a worker thread. Batch scorers (:class:`HFRewardModel`)
    get batches of up to ``max_batch_size`` requests gathered for at most ``max_wait_s``; plugin
    callables score each request on its own (async ones on the loop, sync ones on a pool of
    ``num_workers`` threads). Results are cached (LRU) by prompt, response, info (for plugins)
    and reward-model version, so a new version never serves old scores.

    A request that is not scored within ``timeout_s`` of :meth:`submit`, or whose scorer
    raises or returns a non-finite/non-numeric value, resolves to ``timeout_reward`` with
    ``flagged=True`` (see :attr:`RewardResult.usable`); the service keeps running. A score
    that arrives after its request timed out still fills the cache.

    Args:
        scorer: A plugin name, a reward callable (sync/async plugin, :class:`CombinedReward`),
            or a :class:`BatchScorer` such as :class:`HFRewardModel`.
        timeout_s: Seconds from submit until a request is flagged as timed out.
        timeout_reward: Reward of flagged results (timeouts and scorer errors).
        cache_size: Most cached results (0 disables the cache).
        max_batch_size: Most requests per ``score_batch`` call.
        max_wait_s: Longest wait for a batch to fill after its first request.
        num_workers: Scorer calls (or batches) running at once.
        version: Initial reward-model version.

    Example:
        >>> from asyncvec.lm.rewards import RewardService
        >>> with RewardService("exact_answer", timeout_s=5.0) as service:
        ...     first = service.submit("2+3=", "5").result(timeout=5.0)
        ...     again = service.submit("2+3=", "5").result(timeout=5.0)
        >>> first.reward, first.cached, again.cached
        (1.0, False, True)
    """

    def __init__(
        self,
        scorer: str | RewardFn | BatchScorer,
        *,
        timeout_s: float = 30.0,
        timeout_reward: float = 0.0,
        cache_size: int = 4096,
        max_batch_size: int = 32,
        max_wait_s: float = 0.005,
        num_workers: int = 4,
        version: int = 0,
    ) -> None:
        if isinstance(scorer, BatchScorer):
            self._name, self._scorer = type(scorer).__name__, scorer
            self._batched = True
        elif isinstance(scorer, str) or callable(scorer):
            self._name, self._scorer = _resolve(scorer)
            self._batched = False
        else:
            raise TypeError(
                "scorer must be a plugin name, a callable f(prompt, completion, **info) or an "
                f"object with score_batch(prompts, responses), got {type(scorer).__name__}"
            )
        _check_positive("timeout_s", timeout_s)
        _check_positive("max_wait_s", max_wait_s, allow_zero=True)
        self.timeout_s = float(timeout_s)
        self.timeout_reward = check_reward(timeout_reward, "timeout_reward")
        self.cache_size = _check_count("cache_size", cache_size, minimum=0)
        self.max_batch_size = _check_count("max_batch_size", max_batch_size, minimum=1)
        self.max_wait_s = float(max_wait_s)
        self.num_workers = _check_count("num_workers", num_workers, minimum=1)
        self._version = _check_version(version)
        self._async = not self._batched and inspect.iscoroutinefunction(self._scorer)

        self._lock = threading.Lock()  # guards the fields below, the cache and the counters
        self._weights_lock = threading.Lock()  # version label matches the weights used
        self._cache: collections.OrderedDict[Hashable, float] = collections.OrderedDict()
        self._counts: collections.Counter[str] = collections.Counter()
        self._closed = False

        self._executor = concurrent.futures.ThreadPoolExecutor(self.num_workers, thread_name_prefix="asyncvec-reward")
        self._loop = asyncio.new_event_loop()
        self._queue: asyncio.Queue[_Request] = asyncio.Queue()
        self._pending: set[_Request] = set()  # touched on the loop thread only
        self._tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak references
        self._slots = asyncio.Semaphore(self.num_workers)
        self._thread = threading.Thread(target=self._loop.run_forever, name="asyncvec-reward-loop", daemon=True)
        self._thread.start()
        self._dispatcher = asyncio.run_coroutine_threadsafe(self._dispatch(), self._loop)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> RewardService:
        """A service over ``HFRewardModel.from_pretrained(path)``; kwargs go to the service."""
        return cls(HFRewardModel.from_pretrained(path, device=device), **kwargs)

    # -- public API -----------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The current reward-model version."""
        with self._lock:
            return self._version

    def submit(self, prompt: str, response: str, **info: Any) -> concurrent.futures.Future[RewardResult]:
        """Queue one pair for scoring; ``info`` is passed to plugin scorers.

        Returns:
            A future resolving to a :class:`RewardResult` (never to a scorer exception).

        Raises:
            TypeError: ``prompt`` or ``response`` is not a str.
            RuntimeError: the service is closed.
        """
        _check_text("prompt", prompt)
        _check_text("response", response)
        start = time.perf_counter()
        future: concurrent.futures.Future[RewardResult] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # only the service resolves it
        cache_key = self._cache_key(prompt, response, info)
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardService is closed; create a new one to submit requests")
            self._counts["requests"] += 1
            version = self._version
            cached = self._cache_get((version, cache_key)) if cache_key is not None else None
            if cached is None:
                request = _Request(prompt, response, dict(info), cache_key, start, future)
                self._loop.call_soon_threadsafe(self._admit, request)
                return future
            self._counts["cache_hits"] += 1
        future.set_result(RewardResult(cached, False, time.perf_counter() - start, version, cached=True))
        return future

    def set_version(self, version: int) -> None:
        """Switch to a new reward-model version; cached scores of older versions are dropped."""
        version = _check_version(version)
        with self._lock:
            self._version = version
            self._cache.clear()

    def load_weights(
        self,
        weights: Mapping[str, torch.Tensor] | str | os.PathLike[str],
        version: int | None = None,
    ) -> int:
        """Load new reward-model weights and switch version (default: current + 1).

        Batches already scoring finish with the old weights and are labelled with the old
        version; no cached score of the old version is served afterwards.

        Returns:
            The new version.

        Raises:
            TypeError: the scorer has no ``load_weights`` (plugins: use :meth:`set_version`).
            ValueError: ``version`` equals the current version.
        """
        load = getattr(self._scorer, "load_weights", None)
        if load is None:
            raise TypeError(f"scorer {self._name!r} has no load_weights(); use set_version() for plugin scorers")
        with self._weights_lock:
            new_version = self.version + 1 if version is None else _check_version(version)
            if new_version == self.version:
                raise ValueError(f"version must differ from the current version {new_version} after new weights")
            load(weights)
            self.set_version(new_version)
        return new_version

    def stats(self) -> RewardServiceStats:
        """A snapshot of the counters."""
        with self._lock:
            return RewardServiceStats(
                requests=self._counts["requests"],
                cache_hits=self._counts["cache_hits"],
                scored=self._counts["scored"],
                timeouts=self._counts["timeouts"],
                errors=self._counts["errors"],
                batches=self._counts["batches"],
                cache_size=len(self._cache),
            )

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the service; unfinished requests fail with RuntimeError.

        Waits for scorer calls already running on worker threads, then joins every thread.
        Calling it again does nothing.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._thread.is_alive():
            raise RuntimeError(f"RewardService loop thread did not stop within {timeout_s}s")
        self._loop.close()

    def __enter__(self) -> RewardService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RewardService({self._name!r}, version={self.version}, closed={self._closed})"

    # -- cache (call with self._lock held) --------------------------------------------------

    def _cache_key(self, prompt: str, response: str, info: Mapping[str, Any]) -> Hashable | None:
        if self.cache_size == 0:
            return None
        if self._batched:  # reward models see only the pair
            return (prompt, response)
        key = (prompt, response, tuple(sorted(info.items())))
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def _cache_get(self, key: Hashable) -> float | None:
        value = self._cache.get(key)
        if value is not None:
            self._cache.move_to_end(key)
        return value

    def _cache_put(self, key: Hashable, value: float) -> None:
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    # -- loop thread ------------------------------------------------------------------------

    def _admit(self, request: _Request) -> None:
        delay = self.timeout_s - (time.perf_counter() - request.start)
        request.timer = self._loop.call_later(max(delay, 0.0), self._expire, request)
        self._pending.add(request)
        self._queue.put_nowait(request)

    def _expire(self, request: _Request) -> None:
        with self._lock:
            version = self._version
        self._flag(request, "timeouts", version, f"timed out after {self.timeout_s:g}s")

    def _flag(self, request: _Request, outcome: str, version: int, reason: str) -> None:
        if request.future.done():
            return
        with self._lock:
            self._counts[outcome] += 1
        self._resolve(request, RewardResult(self.timeout_reward, True, 0.0, version, False, reason))

    def _resolve(self, request: _Request, result: RewardResult) -> None:
        if request.timer is not None:
            request.timer.cancel()
        self._pending.discard(request)
        latency = time.perf_counter() - request.start
        request.future.set_result(dataclasses.replace(result, latency=latency))

    async def _dispatch(self) -> None:
        while True:
            batch = [await self._queue.get()]
            if self._batched:
                deadline = self._loop.time() + self.max_wait_s
                while len(batch) < self.max_batch_size:
                    remaining = deadline - self._loop.time()
                    if remaining <= 0:
                        break
                    try:
                        batch.append(await asyncio.wait_for(self._queue.get(), remaining))
                    except asyncio.TimeoutError:
                        break
            batch = [request for request in batch if not request.future.done()]
            groups = [batch] if self._batched else [[request] for request in batch]
            for group in groups:
                if not group:
                    continue
                await self._slots.acquire()
                task = self._loop.create_task(self._score(group))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _score(self, batch: list[_Request]) -> None:
        try:
            if self._batched:
                version, values = await self._loop.run_in_executor(
                    self._executor,
                    self._score_batch,
                    [r.prompt for r in batch],
                    [r.response for r in batch],
                )
            else:
                (request,) = batch
                with self._lock:
                    version = self._version
                if self._async:
                    values = [await _acall(self._name, self._scorer, request.prompt, request.response, request.info)]
                else:
                    call = functools.partial(
                        _call,
                        self._name,
                        self._scorer,
                        request.prompt,
                        request.response,
                        request.info,
                    )
                    values = [await self._loop.run_in_executor(self._executor, call)]
        except Exception as exc:  # scorer failures flag the requests; the service keeps going
            logger.warning("reward scorer %r failed on %d request(s): %r", self._name, len(batch), exc)
            with self._lock:
                version = self._version
            for request in batch:
                self._flag(request, "errors", version, f"scorer error: {exc!r}")
        else:
            self._finish(batch, values, version)
        finally:
            self._slots.release()

    def _score_batch(self, prompts: list[str], responses: list[str]) -> tuple[int, list[float]]:
        with self._weights_lock:
            with self._lock:
                version = self._version
            values = list(self._scorer.score_batch(prompts, responses))
        with self._lock:
            self._counts["batches"] += 1
        if len(values) != len(prompts):
            raise ValueError(f"{self._name}.score_batch returned {len(values)} scores for {len(prompts)} pairs")
        return version, values

    def _finish(self, batch: list[_Request], values: list[Any], version: int) -> None:
        for request, value in zip(batch, values, strict=True):
            try:
                reward = check_reward(value, self._name)
            except (TypeError, ValueError) as exc:
                logger.warning("%s", exc)
                self._flag(request, "errors", version, f"scorer error: {exc}")
                continue
            with self._lock:
                if request.cache_key is not None and version == self._version:
                    self._cache_put((version, request.cache_key), reward)
                if not request.future.done():
                    self._counts["scored"] += 1
            if not request.future.done():
                self._resolve(request, RewardResult(reward, False, 0.0, version, False))

    async def _shutdown(self) -> None:
        tasks = [task for task in asyncio.all_tasks(self._loop) if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for request in list(self._pending):
            if request.timer is not None:
                request.timer.cancel()
            if not request.future.done():
                request.future.set_exception(RuntimeError("RewardService was closed before the request was scored"))
        self._pending.clear()


def _check_text(field: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, got {type(value).__name__}")


def _check_positive(field: str, value: object, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{field} must be a finite number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{field} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _check_count(field: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{field} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value!r}")
    return int(value)


def _check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, numbers.Integral):
        raise TypeError(f"version must be an int, got {version!r} of type {type(version).__name__}")
    return int(version)
