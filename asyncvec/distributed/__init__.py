"""Scale-out on Ray: env workers as actors, routing over several inference replicas,
collectors on several nodes.

Names are imported lazily: ``import asyncvec.distributed`` imports neither Ray nor torch.

Example:
    >>> from asyncvec.distributed import RoutedPolicy
    >>> RoutedPolicy.__name__
    'RoutedPolicy'
"""

from __future__ import annotations

from asyncvec.lazy import LazyName, lazy_package


def _on_ray(module: str) -> LazyName:
    return LazyName(f"asyncvec.distributed.{module}", "ray", "ray")


# public name -> where it lives (the router runs without Ray; the rest check that it is installed)
_LAZY: dict[str, str | LazyName] = {
    "RoutedPolicy": "asyncvec.distributed.router",
    "EndpointStats": "asyncvec.distributed.router",
    "RayPolicy": _on_ray("ray_policy"),
    "connect": _on_ray("runtime"),
    "RayStateError": _on_ray("runtime"),
    "RayCollectors": _on_ray("collection"),
    "DistributedCollector": _on_ray("collection"),
    "RayBackend": _on_ray("ray_env"),
    "LocalCluster": _on_ray("cluster"),
    "local_cluster": _on_ray("cluster"),
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_package(globals(), _LAZY)
