"""Collection: the background-loop base every collector stands on, and ``Collector``.

* :mod:`asyncvec.collection.base`: ``BackgroundCollector`` (start, stop, check, one error
  type) and ``CollectorError``;
* :mod:`asyncvec.collection.collector`: ``Collector`` (an ``AsyncLLMVectorEnv`` x a ``Policy``
  -> a buffer, writing :class:`asyncvec.buffers.Transitions` records) ``next_segment`` (a learner's wait
  for a segment) and ``publish_pace`` (a lockstep collector waiting for each publish).

The language-model collectors (:mod:`asyncvec.lm.episodes`, :mod:`asyncvec.lm.groups`) and the
distributed one (:mod:`asyncvec.distributed.collection`) subclass ``BackgroundCollector``.
Names are imported lazily.

Example:
    >>> from asyncvec.collection import BackgroundCollector, Collector, CollectorError
    >>> issubclass(Collector, BackgroundCollector), issubclass(CollectorError, RuntimeError)
    (True, True)
"""

from __future__ import annotations

from asyncvec.lazy import lazy_package

# public name -> module that defines it
_LAZY = {
    "BackgroundCollector": "asyncvec.collection.base",
    "CollectorError": "asyncvec.collection.base",
    "Collector": "asyncvec.collection.collector",
    "next_segment": "asyncvec.collection.collector",
    "publish_pace": "asyncvec.collection.collector",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_package(globals(), _LAZY)
