"""A multi-node Ray cluster on one machine, for tests and benchmarks.

``LocalCluster`` wraps ``ray.cluster_utils.Cluster``: a head raylet and more raylets, each its
own Ray node (``num_cpus=1`` by default), so that placement, node affinity and node failures
behave as on a real cluster. Node ``i`` (0 is the head) carries the custom resource
``node_<i>`` with :data:`NODE_UNITS` units, so an actor that asks for one unit
(``LocalCluster.pin(i)``) runs there. Every figure measured on it is relative: the raylets
share one host.

Example:
    >>> from asyncvec.distributed.cluster import local_cluster
    >>> with local_cluster(num_nodes=3) as cluster:  # doctest: +SKIP
    ...     print(len(cluster.node_ids), cluster.pin(2))
    3 {'resources': {'node_2': 1}}
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from asyncvec.distributed.runtime import RayStateError
from asyncvec.extras import check_installed

__all__ = ["NODE_UNITS", "LocalCluster", "local_cluster"]

#: Units of ``node_<i>`` each node carries: up to this many actors can be pinned to one node.
NODE_UNITS = 1000


def _forget_as_default(address: str) -> None:
    """Keeps a bare ``ray.init()`` elsewhere on this machine from joining this cluster.

    ``Cluster`` records its address as the machine's "current cluster", which every later
    ``ray.init()`` without an address joins: other test modules (or pytest-xdist workers)
    would share this cluster by accident.
    """
    from ray._private.utils import get_ray_address_file

    path = get_ray_address_file(None)
    try:
        with open(path) as f:
            if f.read().strip() == address:
                os.remove(path)
    except OSError:
        pass


class LocalCluster:
    """A head and ``num_nodes - 1`` more raylets on this machine; the driver connects to it.

    Args:
        num_nodes: raylets in all, head included (node 0).
        num_cpus: CPUs each raylet advertises.
        resources: more custom resources for every node (each node also has ``node_<i>``).
        connect: call ``ray.init(address=...)`` in this process once the nodes are up.
        runtime_env: passed to ``ray.init`` (e.g. ``{"env_vars": {"PYTHONPATH": ...}}`` so
            that workers import modules only the driver has on its path).
        object_store_memory: bytes of object store per node.
        system_config: Ray's internal ``_system_config`` for the head (e.g. faster failure
            detection).

    Attributes:
        address: the GCS address to pass as ``ray.init(address=...)`` or ``RAY_ADDRESS``.
    """

    def __init__(
        self,
        num_nodes: int = 3,
        *,
        num_cpus: float = 1,
        resources: Mapping[str, float] | None = None,
        connect: bool = True,
        runtime_env: dict[str, Any] | None = None,
        object_store_memory: int = 100 * 1024 * 1024,
        system_config: Mapping[str, Any] | None = None,
    ) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1 (the head counts), got {num_nodes}")
        check_installed("ray", extra="ray", feature="LocalCluster")
        import ray
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            raise RayStateError("Ray is already initialized in this process: call ray.shutdown() before LocalCluster")
        self._num_cpus = num_cpus
        self._resources = dict(resources or {})
        self._object_store_memory = object_store_memory
        self._nodes: dict[int, Any] = {}
        head_args = self._node_args(0)
        # Lighter head: no dashboard modules, no autoscaler monitor, no log monitor (the driver
        # connects with log_to_driver=False).
        head_args.update(include_dashboard=False, no_monitor=True, include_log_monitor=False)
        if system_config:
            head_args["_system_config"] = dict(system_config)
        self._cluster = Cluster(initialize_head=True, connect=False, head_node_args=head_args)
        _forget_as_default(self._cluster.address)
        self._nodes[0] = self._cluster.head_node
        self._next_index = 1
        try:
            for _ in range(num_nodes - 1):
                self.add_node()
            self._cluster.wait_for_nodes()
            if connect:
                ray.init(address=self.address, runtime_env=runtime_env, log_to_driver=False, configure_logging=False)
        except BaseException:
            self.shutdown()
            raise

    def _node_args(
        self, index: int, num_cpus: float | None = None, resources: Mapping[str, float] | None = None
    ) -> dict:
        return {
            "num_cpus": self._num_cpus if num_cpus is None else num_cpus,
            "resources": {**self._resources, **(resources or {}), f"node_{index}": NODE_UNITS},
            "object_store_memory": self._object_store_memory,
        }

    @property
    def address(self) -> str | None:
        return None if self._cluster is None else self._cluster.address

    @property
    def node_indices(self) -> list[int]:
        """Indices of the nodes alive in this cluster (0 is the head)."""
        return sorted(self._nodes)

    @property
    def node_ids(self) -> list[str]:
        """Ray node ids (hex) of the alive nodes, in :attr:`node_indices` order."""
        return [self._nodes[i].node_id for i in self.node_indices]

    def node_id(self, index: int) -> str:
        """The Ray node id of node ``index``."""
        return self._nodes[index].node_id

    def index_of(self, node_id: str) -> int:
        """The index of the node with Ray node id ``node_id``."""
        for index, node in self._nodes.items():
            if node.node_id == node_id:
                return index
        raise KeyError(f"no alive node of this cluster has id {node_id}")

    @staticmethod
    def pin(index: int, units: float = 1) -> dict[str, Any]:
        """Actor options that place an actor on node ``index`` (merge into ``.options(...)``)."""
        return {"resources": {f"node_{index}": units}}

    def add_node(self, *, num_cpus: float | None = None, resources: Mapping[str, float] | None = None) -> int:
        """Starts one more raylet and waits until it joined; returns its index."""
        index = self._next_index
        self._next_index += 1
        self._nodes[index] = self._cluster.add_node(**self._node_args(index, num_cpus, resources))
        return index

    def remove_node(self, index: int, *, graceful: bool = True) -> float:
        """Stops node ``index`` (not the head) and every process on it; returns the seconds it took.

        ``graceful=False`` kills the raylet outright, as a machine crash would; Ray then notices
        the loss only through its health checks.
        """
        if index == 0:
            raise ValueError("the head node cannot be removed: the driver is connected to it")
        node = self._nodes.pop(index)
        start = time.monotonic()
        self._cluster.remove_node(node, allow_graceful=graceful)
        return time.monotonic() - start

    def shutdown(self) -> None:
        """Disconnects this process (if it connected) and stops every raylet; safe to call twice."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None
            self._nodes.clear()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"LocalCluster(nodes={self.node_indices}, address={self.address!r})"


@contextmanager
def local_cluster(num_nodes: int = 3, **kwargs: Any) -> Iterator[LocalCluster]:
    """A :class:`LocalCluster` that is shut down on exit (see its arguments).

    Example (a module-scoped pytest fixture):

    .. code-block:: python

        @pytest.fixture(scope="module")
        def cluster():
            with local_cluster(num_nodes=3) as cluster:
                yield cluster
    """
    cluster = LocalCluster(num_nodes, **kwargs)
    try:
        yield cluster
    finally:
        cluster.shutdown()
