"""`WeightPublisher` against recording routes (no server): what a publish sends, what a restart
republishes, and when the supervisor is asked."""

from __future__ import annotations

import asyncio

import pytest

from asyncvec.inference.backends.server_client import ServerClient, is_transient
from asyncvec.inference.backends.server_routes import ROUTES, SERVER_KINDS, ServerRoutes
from asyncvec.inference.backends.weight_publisher import WeightPublisher
from asyncvec.inference.types import BackendRejectedError, TransientBackendError


class RecordingClient:
    base_url = "http://server"
    update_timeout_s = 1.0

    def run(self, coroutine, timeout_s=None):
        return asyncio.run(coroutine)


class RecordingRoutes:
    kind = "asyncvec"  # checks paths itself: the publisher passes folders on unchecked
    label = "Policy"

    def __init__(self, fail=()):
        self.client = RecordingClient()
        self.sent: list[tuple[str, int]] = []
        self.checked: list[bool] = []  # per publish: was the version checked before (in prepare)?
        self.identified = 0
        self.fail = list(fail)  # errors the next publishes raise, in order

    async def identify(self):
        self.identified += 1
        return {"server": "asyncvec"}

    async def read_version(self):
        return self.sent[-1][1] if self.sent else None

    async def check_newer(self, version):
        if self.sent and version <= self.sent[-1][1]:
            raise ValueError(f"version must be newer than the server's current weight version {self.sent[-1][1]}")

    async def publish(self, path, version, *, checked=False):
        if self.fail:
            raise self.fail.pop(0)
        self.checked.append(checked)
        self.sent.append((path, version))
        return {"frozen_s": float(version), "reload_s": 0.5}  # what the route's steps took, as vLLM's reports them


class RestartingSupervisor:
    """Restarts at once and calls ``reload`` as `EngineSupervisor.recover` does."""

    def __init__(self, alive=True):
        self.generation = 0
        self.alive = alive
        self.recovered: list[BaseException] = []

    def check_alive(self):
        if not self.alive:
            raise TransientBackendError("server exited")

    def recover(self, error, generation, reload=None):
        self.recovered.append(error)
        self.alive = True
        self.generation += 1
        if reload is not None:
            reload()
        return True


def test_a_publish_identifies_once_sends_the_folder_and_remembers_it():
    routes = RecordingRoutes()
    publisher = WeightPublisher(routes, model="tiny")
    assert publisher.latest is None
    publisher.republish()  # nothing published yet: nothing sent
    publisher.publish("/ckpt/v1", 1)
    publisher.publish("/ckpt/v2", 2)
    assert routes.sent == [("/ckpt/v1", 1), ("/ckpt/v2", 2)] and routes.identified == 1
    assert publisher.latest == ("/ckpt/v2", 2) and publisher.server_version() == 2
    publisher.republish()
    assert routes.sent[-1] == ("/ckpt/v2", 2)
    # the version was checked by prepare, before the send paused anything; a republish checks it itself
    assert routes.checked == [True, True, False]
    assert publisher.recover(TransientBackendError("x"), 0) is False  # no supervisor: nothing restarted
    with pytest.raises(ValueError, match="must be newer"):
        publisher.prepare("/ckpt/v1", 1)


def test_a_publish_returns_its_timings_and_the_publisher_keeps_them():
    routes = RecordingRoutes()
    publisher = WeightPublisher(routes, model="tiny")
    timings = publisher.publish("/ckpt/v1", 1)
    assert timings["frozen_s"] == 1.0 and timings["reload_s"] == 0.5
    assert {"checkpoint_s", "check_s"} <= set(timings)  # prepare's steps, before anything was paused
    assert publisher.last_publish == timings and publisher.frozen_s == [1.0]
    publisher.republish()  # a republish holds generation still too
    assert publisher.frozen_s == [1.0, 1.0] and publisher.last_publish == timings
    assert not hasattr(routes, "last_publish")


def test_a_publish_that_meets_a_dead_server_restarts_it_republishes_then_publishes():
    routes = RecordingRoutes()
    supervisor = RestartingSupervisor()
    publisher = WeightPublisher(routes, model="tiny", supervisor=supervisor)
    publisher.publish("/ckpt/v1", 1)
    supervisor.alive = False  # killed
    publisher.publish("/ckpt/v2", 2)
    assert len(supervisor.recovered) == 1
    assert routes.sent == [("/ckpt/v1", 1), ("/ckpt/v1", 1), ("/ckpt/v2", 2)]  # the latest again, then the new
    assert publisher.latest == ("/ckpt/v2", 2)


def test_a_refused_publish_is_not_a_restart_and_changes_nothing():
    routes = RecordingRoutes(fail=[BackendRejectedError("no such folder")])
    supervisor = RestartingSupervisor()
    publisher = WeightPublisher(routes, model="tiny", supervisor=supervisor)
    with pytest.raises(BackendRejectedError, match="no such folder"):
        publisher.publish("/ckpt/v1", 1)
    assert supervisor.recovered == [] and publisher.latest is None and routes.sent == []


def test_a_state_dict_needs_a_checkpoint_dir():
    publisher = WeightPublisher(RecordingRoutes(), model="tiny")
    with pytest.raises(TypeError, match=r"Policy.load_weights got a dict: pass a checkpoint folder"):
        publisher.publish({}, 1)


def test_routes_talk_to_a_server_client():
    client = ServerClient("http://127.0.0.1:9", request_timeout_s=1, api_key="k")
    try:
        for kind in SERVER_KINDS:
            routes = ROUTES[kind](client, label="P", initial_version=3)
            assert isinstance(routes, ServerRoutes) and routes.kind == kind and routes.client is client
        with pytest.raises(TransientBackendError, match="cannot reach http://127.0.0.1:9/weight_info") as caught:
            client.run(ROUTES["vllm"](client).read_version())
        assert is_transient(caught.value) and not is_transient(PermissionError("403"))
    finally:
        client.close()
