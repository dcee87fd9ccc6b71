"""`RoutedPolicy` over real replicas: torch policies in this process, and `asyncvec serve`
subprocesses over HTTP that are killed and restarted mid-run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import gymnasium as gym
import httpx
import numpy as np
import pytest
import torch
from test_inference_policy import no_leftover_threads  # noqa: F401  (autouse fixture)

from asyncvec.distributed import RoutedPolicy
from asyncvec.inference import BackendError, HFTextPolicy, LatencyModel, TorchPolicy, build_tiny_lm

pytestmark = pytest.mark.timeout(240)

N_ACTIONS = 8


class VersionNet(torch.nn.Module):
    """Logits that make action ``v % N_ACTIONS`` the mode once ``bias`` holds version v's weights;
    raises while ``broken`` is set (a backend that fails, e.g. a GPU error)."""

    def __init__(self, broken: threading.Event | None = None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, N_ACTIONS)
        self.broken = broken or threading.Event()
        with torch.no_grad():
            self.linear.weight.zero_()
            self.linear.bias.copy_(weights_of(0)["linear.bias"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.broken.is_set():
            raise RuntimeError("replica backend failure")
        return self.linear(x)


def weights_of(version: int) -> dict[str, torch.Tensor]:
    bias = torch.zeros(N_ACTIONS)
    bias[version % N_ACTIONS] = 10.0
    return {"linear.weight": torch.zeros(N_ACTIONS, 1), "linear.bias": bias}


def replica_factory(broken: threading.Event, latency_ms: float = 0.0):
    def build():
        policy = TorchPolicy(
            VersionNet(broken),
            gym.spaces.Discrete(N_ACTIONS),
            observation_space=gym.spaces.Box(-1.0, 1.0, (1,)),
            deterministic=True,
            max_attempts=1,
        )
        return LatencyModel(policy, a_ms=latency_ms, b_ms=0.0, max_attempts=1) if latency_ms else policy

    return build


def closed_loop(policy, seconds: float, threads: int = 3) -> list:
    """``threads`` env-like loops that submit, wait for the answer and submit again."""
    answers, errors = [], []
    stop = time.monotonic() + seconds

    def loop(env_id: int) -> None:
        while time.monotonic() < stop:
            try:
                answers.append(policy.submit(np.ones(1, np.float32), env_id=env_id).result(timeout=30))
            except Exception as exc:
                errors.append(exc)
                return

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, errors
    return answers


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {what}"
        time.sleep(0.05)


def test_least_outstanding_requests_favours_the_fast_replica():
    events = [threading.Event() for _ in range(3)]
    factories = [
        replica_factory(events[0], latency_ms=150),
        replica_factory(events[1], 2),
        replica_factory(events[2], 2),
    ]
    with RoutedPolicy(factories, names=["slow", "fast1", "fast2"]) as router:
        answers = closed_loop(router, seconds=1.5, threads=3)
        rows = {row.name: row for row in router.endpoints()}
    assert len(answers) == sum(row.answered for row in rows.values())
    assert rows["slow"].answered >= 1  # it took its share of the first three requests
    assert rows["fast1"].answered > 5 * rows["slow"].answered
    assert rows["fast2"].answered > 5 * rows["slow"].answered
    assert all(row.outstanding == 0 and row.healthy for row in rows.values())
    stats = router.stats()
    assert stats["answered"] == len(answers) and stats["endpoint0/answered"] == rows["slow"].answered
    assert stats["endpoint1/latency_p50_ms"] < stats["endpoint0/latency_p50_ms"]


def test_a_failing_replica_is_ejected_probed_back_and_given_the_latest_weights():
    events = [threading.Event() for _ in range(3)]
    router = RoutedPolicy([replica_factory(e) for e in events], probe_interval_s=0.2, probe_timeout_s=5)
    try:
        closed_loop(router, seconds=0.3)
        events[1].set()  # replica 1's backend starts failing
        answers = closed_loop(router, seconds=0.5)  # every request still gets an answer
        rows = router.endpoints()
        assert not rows[1].healthy and rows[1].ejections == 1 and "replica backend failure" in rows[1].last_error
        assert rows[0].healthy and rows[2].healthy
        assert router.stats()["retried"] >= 1
        answered_while_out = rows[1].answered
        router.load_weights(weights_of(3), version=3)  # replica 1 misses this publish
        assert [row.policy_version for row in router.endpoints()] == [3, 0, 3]
        assert router.policy_version == 3  # the oldest healthy replica
        time.sleep(0.5)
        assert not router.endpoints()[1].healthy  # probes fail while it is broken
        events[1].clear()
        wait_until(lambda: router.endpoints()[1].healthy, 10, "replica 1 readmitted")
        assert router.endpoints()[1].readmissions == 1 and router.endpoints()[1].policy_version == 3
        answers = closed_loop(router, seconds=0.5)
        assert router.endpoints()[1].answered > answered_while_out + 2  # it serves again
        assert {a.policy_version for a in answers} == {3}
        assert all(a.action == 3 for a in answers)  # honest: version 3's weights picked them
    finally:
        router.close()


def test_a_replica_whose_completions_the_parser_rejects_still_serves_probes(tmp_path):
    # An untrained model's completions may all fail the action parser: they are fallbacks, but
    # the model wrote them, so they are what a probe needs (it was "nothing to probe with yet").
    model_dir = build_tiny_lm(tmp_path / "tiny", seed=0)
    built = []

    def build():
        built.append(
            HFTextPolicy(
                model_dir, action_parser=lambda text: None, action_space=gym.spaces.Discrete(2), max_new_tokens=2
            )
        )
        return built[-1]

    router = RoutedPolicy([build, build], probe_interval_s=0.2, probe_timeout_s=20)
    try:
        answers = router.act(["1+2="] * 4, timeout=60)
        assert all(a.fallback and a.text is not None for a in answers)  # rejected, but written by the model
        built[1].close()  # replica 1 goes away
        assert len(router.act(["1+2="] * 4, timeout=60)) == 4  # replica 0 answers all
        assert router.endpoints()[1].ejections == 1
        wait_until(lambda: router.endpoints()[1].healthy, 30, "replica 1 rebuilt and probed back")
        assert router.endpoints()[1].readmissions == 1 and len(built) >= 3
    finally:
        router.close()


def test_every_answer_carries_the_version_of_the_weights_that_computed_it():
    events = [threading.Event() for _ in range(3)]
    router = RoutedPolicy([replica_factory(e, latency_ms=3) for e in events], probe_interval_s=0.05)
    answers = []
    stop = threading.Event()

    def publish() -> None:
        for version in range(1, 13):
            router.load_weights(weights_of(version), version)
            if version == 4:
                events[2].set()  # replica 2 fails and misses versions 5.. until readmitted
            if version == 8:
                events[2].clear()
            time.sleep(0.05)
        stop.set()

    try:
        publisher = threading.Thread(target=publish)
        publisher.start()
        while not stop.is_set():
            answers.extend(router.act(np.ones((6, 1), np.float32), timeout=30))
        publisher.join()
        wait_until(lambda: all(row.healthy for row in router.endpoints()), 10, "all replicas healthy")
        answers.extend(router.act(np.ones((12, 1), np.float32), timeout=30))
    finally:
        router.close()
    versions = [a.policy_version for a in answers]
    assert all(a.action == a.policy_version % N_ACTIONS for a in answers), "an answer claims a version it lacked"
    assert len(set(versions)) >= 4 and versions[-1] == 12
    assert router.endpoints()[2].readmissions >= 1


def test_bad_input_ejects_nothing_and_no_replica_left_is_a_clear_error():
    events = [threading.Event() for _ in range(2)]
    with RoutedPolicy([replica_factory(e) for e in events], names=["a", "b"], probe_interval_s=60) as router:
        with pytest.raises(ValueError, match="shape"):
            router.submit(np.ones(3, np.float32), env_id=0)
        router.submit(np.ones(1, np.float32), env_id=0).result(timeout=10)
        with pytest.raises(ValueError, match="must be greater"):
            router.load_weights(weights_of(0), version=0)
        with pytest.raises(ValueError, match="refused the weights"):
            router.load_weights({"linear.weight": torch.zeros(2, 2)}, version=1)
        assert all(row.healthy for row in router.endpoints())
        for event in events:
            event.set()
        error = router.submit(np.ones(1, np.float32), env_id=5).exception(timeout=30)
        assert isinstance(error, BackendError)
        assert "no healthy replica left for env_id=5" in str(error)
        assert "a: BackendError" in str(error) and "b: BackendError" in str(error)
        assert [row.healthy for row in router.endpoints()] == [False, False]
    with pytest.raises(Exception, match="closed"):
        router.submit(np.ones(1, np.float32))


# ------------------------------------------------------------------ real HTTP servers
TOKEN = "router-token"
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One ``asyncvec serve`` subprocess on a fixed port that can be killed and restarted."""

    def __init__(self, model_dir, weights_dir, log_path) -> None:
        self.model_dir, self.weights_dir, self.log_path = model_dir, weights_dir, log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        command = [sys.executable, "-m", "asyncvec.cli", "serve", "--model", str(self.model_dir), "--model-name", MODEL]
        command += ["--port", str(self.port), "--weights-dir", str(self.weights_dir), "--max-wait-ms", "2"]
        with open(self.log_path, "a") as log:
            env = {**os.environ, "ASYNCVEC_SERVE_TOKEN": TOKEN}
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, f"server exited: {self.log_path.read_text()}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"server not healthy after {timeout} s"
            time.sleep(0.2)

    def version(self) -> int:
        return httpx.get(self.url + "/version", timeout=10).json()["version"]

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("router")
    model_dir = build_tiny_lm(root / MODEL, seed=0)
    weights_dir = root / "weights"
    for version in (1, 2):
        build_tiny_lm(weights_dir / f"v{version}", seed=version)
    fleet = [Server(model_dir, weights_dir, root / f"server{i}.log") for i in range(2)]
    try:
        for server in fleet:
            server.start()
        for server in fleet:
            server.wait_healthy()
        yield fleet
    finally:
        for server in fleet:
            server.stop()


def digit(text: str) -> int:
    return int(text.strip()[0])


def test_http_server_killed_mid_run_is_ejected_then_restarted_and_probed_back(servers):
    prompts = ["3+4=", "1+2=", "5+5=", "2+6="] * 2
    router = RoutedPolicy.from_urls(
        [s.url for s in servers],
        MODEL,
        digit,
        action_space=gym.spaces.Discrete(10),
        max_new_tokens=3,
        update_token=TOKEN,
        request_timeout_s=20,
        router_options={"probe_interval_s": 0.5, "probe_timeout_s": 20},
    )
    try:
        assert {a.policy_version for a in router.act(prompts, timeout=60)} == {0}
        assert [row.answered > 0 for row in router.endpoints()] == [True, True]  # both serve
        router.load_weights("v1", 1)  # a folder under each server's --weights-dir
        assert [s.version() for s in servers] == [1, 1]
        assert {a.policy_version for a in router.act(prompts, timeout=60)} == {1}

        servers[1].kill()
        answers = router.act(prompts * 2, timeout=60)  # nothing is lost: server 0 answers all
        assert len(answers) == 16 and {a.policy_version for a in answers} == {1}
        rows = router.endpoints()
        assert rows[0].healthy and not rows[1].healthy and rows[1].ejections == 1
        assert "cannot reach" in rows[1].last_error
        router.load_weights("v2", 2)  # the dead server misses version 2
        assert servers[0].version() == 2 and router.endpoints()[1].policy_version == 1

        servers[1].start()  # back on the same port, with its initial weights (version 0)
        servers[1].wait_healthy()
        wait_until(lambda: router.endpoints()[1].healthy, 60, "the restarted server readmitted")
        assert servers[1].version() == 2  # brought to the latest weights before serving
        before = router.endpoints()[1].answered
        answers = router.act(prompts * 2, timeout=60)
        assert {a.policy_version for a in answers} == {2}
        rows = router.endpoints()
        assert rows[1].answered > before and rows[1].readmissions == 1 and rows[1].policy_version == 2
    finally:
        router.close()
