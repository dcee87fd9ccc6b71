"""Connecting to Ray and asking it where things run (shared by the distributed classes)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["RayStateError", "connect", "feasible_nodes", "placement_problem", "required_resources"]


class RayStateError(RuntimeError):
    """Ray is not in the state a call needs (not started yet, or already started by someone else)."""


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


def required_resources(options: Mapping[str, Any], *, placement: bool = False) -> dict[str, float]:
    """The resources an actor created with these ``.options(...)`` holds on its node for its life
    (``placement=True``: what a node must have free to place it), as Ray counts them.

    Ray's actor default (no ``num_cpus``, no other resource) is 1 CPU to place and 0 while it
    runs; with any resource but no ``num_cpus``, Ray holds 1 CPU for the actor's life.

    Example:
        >>> required_resources({"num_cpus": 1, "resources": {"node_2": 1}})
        {'CPU': 1.0, 'node_2': 1.0}
        >>> required_resources({"resources": {"node_2": 1}})
        {'node_2': 1.0, 'CPU': 1.0}
        >>> required_resources({}), required_resources({}, placement=True)
        ({}, {'CPU': 1.0})
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
    if options.get("num_cpus") is None:
        if set(need) - {"memory"}:
            need["CPU"] = 1.0  # Ray's default once anything else is asked for
        elif placement:
            need["CPU"] = 1.0  # Ray's actor default: 1 CPU to place, 0 while running
    return need


def _fits(need: Mapping[str, float], offer: Mapping[str, float]) -> bool:
    return all(offer.get(name, 0.0) >= amount - 1e-9 for name, amount in need.items())


def _pinned_node(options: Mapping[str, Any]) -> str | None:
    strategy = options.get("scheduling_strategy")
    return getattr(strategy, "node_id", None) if not getattr(strategy, "soft", True) else None


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [node for node in ray.nodes() if node.get("Alive")]


def feasible_nodes(options: Mapping[str, Any]) -> list[str]:
    """Ids of the alive nodes that could ever host an actor with these options (by total
    resources and a hard node-affinity strategy, ignoring what is in use now)."""
    need = required_resources(options, placement=True)
    pinned = _pinned_node(options)
    return [
        node["NodeID"]
        for node in _alive_nodes()
        if (pinned is None or node["NodeID"] == pinned) and _fits(need, node.get("Resources", {}))
    ]


def _offers(node: Mapping[str, Any]) -> dict[str, float]:
    """A node's resources without Ray's bookkeeping entries (``node:<ip>``, object store)."""
    skip = ("node:", "object_store_memory", "memory")
    return {k: v for k, v in node.get("Resources", {}).items() if not k.startswith(skip)}


def placement_problem(
    options: Mapping[str, Any], placed: Sequence[tuple[str, str, Mapping[str, Any]]] = ()
) -> str | None:
    """Why an actor with these options cannot be placed, or ``None`` if some alive node could
    host it now or later.

    It cannot when no alive node has the resources at all, or when every node that has them
    is filled by ``placed``: actors of the same owner, as ``(label, node_id, options)``, that
    hold their resources for life (so it would wait for ever while they run). What other jobs
    use is not counted: they may end.

    Example:
        >>> placement_problem({"resources": {"nowhere": 1}})  # doctest: +SKIP
        "no alive node of the Ray cluster can host it: it needs {'nowhere': 1.0, 'CPU': 1.0}; ..."
    """
    need = required_resources(options, placement=True)
    pinned = _pinned_node(options)
    nodes = _alive_nodes()
    feasible = [
        node
        for node in nodes
        if (pinned is None or node["NodeID"] == pinned) and _fits(need, node.get("Resources", {}))
    ]
    if not feasible:
        where = f" on node {pinned} (hard node affinity)" if pinned is not None else ""
        offers = {node["NodeID"][:8]: _offers(node) for node in nodes}
        return f"no alive node of the Ray cluster can host it: it needs {need}{where}; alive nodes offer {offers}"
    reasons = []
    for node in feasible:
        free = dict(node.get("Resources", {}))
        holders = []
        for label, node_id, other in placed:
            if node_id == node["NodeID"]:
                holders.append(label)
                for name, amount in required_resources(other).items():
                    free[name] = free.get(name, 0.0) - amount
        if _fits(need, free):
            return None
        short = {
            name: round(free.get(name, 0.0), 6) for name, amount in need.items() if free.get(name, 0.0) < amount - 1e-9
        }
        reasons.append(f"node {node['NodeID'][:8]} has {short} left beside {', '.join(holders)}")
    return (
        f"it needs {need}, and on every node that could host it the actors started with it hold what it "
        f"lacks, for as long as they run: {'; '.join(reasons)}"
    )
