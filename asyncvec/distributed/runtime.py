"""Connecting to Ray and asking it where things run (shared by the distributed classes)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["connect", "feasible_nodes", "required_resources"]


def connect(address: str | None = None) -> bool:
    """Join the Ray cluster at ``address`` (``"auto"``, ``"host:6379"``, ``"ray://host:10001"``),
    else at ``$RAY_ADDRESS``, else start a new local Ray (never a cluster that merely happens
    to run on this machine).

    Returns whether this call started Ray, so the caller that started it also shuts it down.
    If Ray is already initialized in this process it is used as it is.

    Example:
        >>> started = connect()  # doctest: +SKIP
    """
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    ray.init(address=address, log_to_driver=False, configure_logging=False)
    return True


def required_resources(options: Mapping[str, Any]) -> dict[str, float]:
    """The resources an actor created with these ``.options(...)`` needs from one node.

    Example:
        >>> required_resources({"num_cpus": 1, "resources": {"node_2": 1}})
        {'CPU': 1.0, 'node_2': 1.0}
    """
    need: dict[str, float] = {}
    if options.get("num_cpus"):
        need["CPU"] = float(options["num_cpus"])
    if options.get("num_gpus"):
        need["GPU"] = float(options["num_gpus"])
    if options.get("memory"):
        need["memory"] = float(options["memory"])
    for name, amount in (options.get("resources") or {}).items():
        need[name] = float(amount)
    return need


def feasible_nodes(options: Mapping[str, Any]) -> list[str]:
    """Ids of the alive nodes that could ever host an actor with these options (by total
    resources and a hard node-affinity strategy, ignoring what is in use now)."""
    import ray

    need = required_resources(options)
    strategy = options.get("scheduling_strategy")
    pinned = getattr(strategy, "node_id", None) if not getattr(strategy, "soft", True) else None
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        if pinned is not None and node["NodeID"] != pinned:
            continue
        total = node.get("Resources", {})
        if all(total.get(name, 0.0) >= amount for name, amount in need.items()):
            nodes.append(node["NodeID"])
    return nodes
