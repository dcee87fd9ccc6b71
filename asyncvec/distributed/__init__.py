"""Scale-out on Ray: env workers as actors, routing over several inference replicas,
collectors on several nodes.

Names are imported lazily: ``import asyncvec.distributed`` imports neither Ray nor torch.

Example:
    >>> from asyncvec.distributed import RoutedPolicy
    >>> RoutedPolicy.__name__
    'RoutedPolicy'
"""

from __future__ import annotations

import importlib
from typing import Any

from asyncvec.extras import check_installed

# public name -> module that defines it
_LAZY = {
    "RoutedPolicy": "asyncvec.distributed.router",
    "EndpointStats": "asyncvec.distributed.router",
    "RayPolicy": "asyncvec.distributed.ray_policy",
    "connect": "asyncvec.distributed.runtime",
    "RayStateError": "asyncvec.distributed.runtime",
    "RayCollectors": "asyncvec.distributed.collection",
    "DistributedCollector": "asyncvec.distributed.collection",
    "RayBackend": "asyncvec.distributed.ray_env",
    "LocalCluster": "asyncvec.distributed.cluster",
    "local_cluster": "asyncvec.distributed.cluster",
}

__all__ = sorted(_LAZY)

# the names that run on Ray; the router runs without it
_NEEDS_RAY = set(_LAZY) - {"RoutedPolicy", "EndpointStats"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncvec.distributed' has no attribute {name!r}")
    if name in _NEEDS_RAY:
        check_installed("ray", extra="ray", feature=f"asyncvec.distributed.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
