"""BatchedPolicy machinery through TorchPolicy and LatencyModel: batching under load,
deadlines and fallbacks, version propagation, retries, cache, validation, shutdown."""

import subprocess
import sys
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
import torch

from asyncvec.inference import (
    BackendError,
    LatencyModel,
    Policy,
    PolicyClosedError,
    PolicyOutput,
    ReentrantCallError,
    TorchPolicy,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def no_leftover_threads():
    """Fails the test if it leaves an asyncvec thread running (waits up to 5 s)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while True:
        left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("asyncvec-") and t.is_alive()]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"threads left alive: {left}"


def mlp(obs_dim=4, n_actions=3, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(obs_dim, 16), torch.nn.Tanh(), torch.nn.Linear(16, n_actions))


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


class FlakyNet(torch.nn.Module):
    """Raises `error` on its first `failures` calls (None: forever), then returns logits."""

    def __init__(self, failures, error=None):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.failures, self.calls = failures, 0
        self.error = error if error is not None else RuntimeError("transient backend hiccup")

    def forward(self, x):
        self.calls += 1
        if self.failures is None or self.calls <= self.failures:
            raise self.error
        return self.linear(x)


# --------------------------------------------------------------------------- batching
# 16: queueing while the backend is busy fills batches; 32 (= requesters): the batcher waits for stragglers
@pytest.mark.parametrize("max_batch_size, max_wait_ms", [(16, 20.0), (32, 500.0)])
def test_mean_batch_size_under_load(max_batch_size, max_wait_ms):
    policy = LatencyModel(
        TorchPolicy(mlp(), gym.spaces.Discrete(3)),
        a_ms=20,
        b_ms=1,
        max_batch_size=max_batch_size,
        max_wait_ms=max_wait_ms,
    )
    stop = threading.Event()
    errors = []

    def requester(env_id):
        rng = np.random.default_rng(env_id)
        try:
            while not stop.is_set():
                policy.submit(rng.normal(size=4), env_id=env_id).result(timeout=10)
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=requester, args=(i,)) for i in range(32)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: policy.stats()["batches"] >= 3)
        first = policy.stats()
        wait_until(lambda: policy.stats()["batches"] >= first["batches"] + 12, timeout=30)
        second = policy.stats()
    finally:
        stop.set()
        for thread in threads:
            thread.join(15)
        policy.close()
    assert not errors
    items = second["mean_batch_size"] * second["batches"] - first["mean_batch_size"] * first["batches"]
    mean = items / (second["batches"] - first["batches"])
    assert mean >= 0.8 * max_batch_size, mean


# -------------------------------------------------------------------------- deadlines
def test_deadline_delivers_flagged_fallback_and_drops_late_answer():
    policy = LatencyModel(
        TorchPolicy(mlp(), gym.spaces.Discrete(3)),
        a_ms=200,
        b_ms=0,
        deadline_ms=50,
        max_wait_ms=1,
        max_inflight_batches=3,
    )
    deliveries = []
    try:
        futures = []
        for env_id in range(3):
            future = policy.submit(np.zeros(4), env_id=env_id)
            future.add_done_callback(deliveries.append)
            futures.append(future)
            future.result(timeout=5)
        outputs = [future.result() for future in futures]
        for out in outputs:
            assert out.fallback and out.action == 0 and out.behavior_logp == 0.0 and out.policy_version == 0
            assert 0.05 <= out.latency_s <= 0.05 + 0.250, out.latency_s  # no gross delay, even on a loaded machine
        # Precision of the deadline: within 20 ms (best of three, so that one OS scheduling hiccup
        # of a shared 2-core machine does not decide the test).
        assert min(out.latency_s for out in outputs) <= 0.05 + 0.020, [out.latency_s for out in outputs]
        wait_until(lambda: policy.stats()["late_dropped"] == 3)  # the backend answers came back...
        assert len(deliveries) == 3 and [f.result() for f in futures] == outputs  # ...and were never delivered
        stats = policy.stats()
        assert stats["timeouts"] == 3 and stats["fallbacks"] == 3 and stats["answered"] == 3
    finally:
        policy.close()


def test_fallback_modes_repeat_function_and_box_zero():
    inner = TorchPolicy(mlp(), gym.spaces.Discrete(3))
    repeat = LatencyModel(inner, a_ms=0, b_ms=0, deadline_ms=100, fallback="repeat", max_wait_ms=1)
    try:
        for _ in range(10):  # a loaded machine may miss even a fast deadline: take the first real answer
            first = repeat.submit(np.ones(4), env_id=3).result(timeout=5)
            if not first.fallback:
                break
        assert not first.fallback
        repeat.a_ms = 600  # the backend turns slow
        again = repeat.submit(np.ones(4), env_id=3).result(timeout=5)
        assert again.fallback and again.action == first.action
        unknown = repeat.submit(np.ones(4), env_id=4).result(timeout=5)
        assert unknown.fallback and unknown.action == 0  # no previous action: zero
    finally:
        repeat.close()

    seen = []
    custom = LatencyModel(
        TorchPolicy(mlp(), gym.spaces.Discrete(3)),
        a_ms=400,
        b_ms=0,
        deadline_ms=30,
        fallback=lambda obs, env_id: seen.append((list(obs), env_id)) or 2,
    )
    try:
        out = custom.submit([1.0, 2.0, 3.0, 4.0], env_id=9).result(timeout=5)
        assert out.fallback and out.action == 2 and seen == [([1.0, 2.0, 3.0, 4.0], 9)]
    finally:
        custom.close()

    box = gym.spaces.Box(low=1.0, high=2.0, shape=(2,), dtype=np.float32)
    net = torch.nn.Linear(4, 2)
    slow_box = LatencyModel(TorchPolicy(lambda_net(net), box), a_ms=400, b_ms=0, deadline_ms=30)
    try:
        out = slow_box.submit(np.zeros(4)).result(timeout=5)
        assert out.fallback and out.action.tolist() == [1.0, 1.0]  # zeros clipped into the box
    finally:
        slow_box.close()


def lambda_net(net):
    """A Box head: (mean, log_std) with a state-independent log_std."""

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net
            self.log_std = torch.nn.Parameter(torch.full((2,), -0.5))

        def forward(self, x):
            return self.net(x), self.log_std

    return Head()


def test_fallback_needs_an_action_space_or_function():
    class Echo(TorchPolicy):
        pass

    with pytest.raises(ValueError, match="needs action_space"):
        LatencyModel(TorchPolicy(mlp(), gym.spaces.Discrete(3)), a_ms=0, b_ms=0, action_space=None, deadline_ms=10)
    with pytest.raises(ValueError, match="fallback must be one of"):
        TorchPolicy(mlp(), gym.spaces.Discrete(3), fallback="noop")
    with pytest.raises(ValueError, match="deadline_ms"):
        Echo(mlp(), gym.spaces.Discrete(3), deadline_ms=0)


# --------------------------------------------------------------------------- versions
def one_hot_weights(version, n=4):
    """Weights under which the deterministic policy always picks action == version."""
    return {"weight": torch.zeros(n, 4), "bias": torch.nn.functional.one_hot(torch.tensor(version), n).float() * 50.0}


def test_versions_propagate_and_never_mix():
    net = torch.nn.Linear(4, 4)
    net.load_state_dict(one_hot_weights(0))
    policy = LatencyModel(
        TorchPolicy(net, gym.spaces.Discrete(4), deterministic=True), a_ms=15, b_ms=0.5, max_batch_size=8, max_wait_ms=2
    )
    records, stop, lock = [], threading.Event(), threading.Lock()

    def requester(env_id):
        while not stop.is_set():
            future = policy.submit(np.full(4, env_id, dtype=np.float32), env_id=env_id)
            future.add_done_callback(lambda f: records.append((time.monotonic(), f.result())))
            future.result(timeout=10)

    threads = [threading.Thread(target=requester, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    returned = {}
    try:
        for version in (1, 2, 3):
            time.sleep(0.1)
            policy.load_weights(one_hot_weights(version), version)
            returned[version] = time.monotonic()
            assert policy.policy_version == version
        time.sleep(0.1)
    finally:
        stop.set()
        for thread in threads:
            thread.join(15)
        policy.close()
    with lock:
        outputs = list(records)
    assert {out.policy_version for _, out in outputs} == {0, 1, 2, 3}
    for delivered_at, out in outputs:
        assert out.action == out.policy_version  # computed with exactly the weights it claims
        for version, at in returned.items():
            if delivered_at > at:
                assert out.policy_version >= version


def test_load_weights_rejects_bad_versions_and_weights(tmp_path):
    net = torch.nn.Linear(4, 4)
    with TorchPolicy(net, gym.spaces.Discrete(4), deterministic=True) as policy:
        with pytest.raises(ValueError, match="greater than the current policy_version 0"):
            policy.load_weights(one_hot_weights(1), 0)
        with pytest.raises(ValueError, match="missing"):
            policy.load_weights({"weight": torch.zeros(4, 4)}, 1)
        with pytest.raises(ValueError, match="shape mismatch"):
            policy.load_weights({"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}, 1)
        assert policy.policy_version == 0
        torch.save(one_hot_weights(2), tmp_path / "v2.pt")
        policy.load_weights(tmp_path / "v2.pt", 2)
        out = policy.submit(np.zeros(4)).result(timeout=5)
        assert (out.action, out.policy_version) == (2, 2)
        with pytest.raises(FileNotFoundError):
            policy.load_weights(tmp_path / "missing.pt", 3)


def test_load_weights_from_a_done_callback_is_refused():
    with TorchPolicy(mlp(), gym.spaces.Discrete(3)) as policy:
        raised = []

        def callback(future):
            try:
                policy.load_weights(mlp().state_dict(), 1)
            except RuntimeError as exc:
                raised.append(exc)

        policy.submit(np.zeros(4)).add_done_callback(callback)
        wait_until(lambda: raised)
        assert "done-callback" in str(raised[0]) and isinstance(raised[0], ReentrantCallError)


# ---------------------------------------------------------------------------- retries
def test_transient_errors_are_retried():
    net = FlakyNet(failures=2)
    with TorchPolicy(net, gym.spaces.Discrete(3), max_attempts=3, retry_backoff_ms=5) as policy:
        out = policy.submit(np.zeros(4)).result(timeout=10)
        assert not out.fallback and net.calls == 3
        assert policy.stats()["retries"] == 2


def test_a_failing_backend_gives_a_clear_error_after_n_attempts():
    net = FlakyNet(failures=None, error=RuntimeError("GPU fell off the bus"))
    with TorchPolicy(net, gym.spaces.Discrete(3), max_attempts=3, retry_backoff_ms=5) as policy:
        started = time.monotonic()
        error = policy.submit(np.zeros(4)).exception(timeout=10)
        assert isinstance(error, BackendError)
        assert "after 3 attempt(s)" in str(error) and "GPU fell off the bus" in str(error)
        assert isinstance(error.__cause__, RuntimeError)
        assert time.monotonic() - started < 5
        assert net.calls == 3 and policy.stats()["errors"] == 1


def test_fallback_on_error_answers_with_the_fallback_after_the_retries():
    net = FlakyNet(failures=None, error=RuntimeError("server gone"))
    with TorchPolicy(
        net, gym.spaces.Discrete(3), max_attempts=2, retry_backoff_ms=5, fallback_on_error=True, fallback="repeat"
    ) as policy:
        out = policy.submit(np.zeros(4), env_id=1).result(timeout=10)
        assert out.fallback and out.action == 0 and out.behavior_logp == 0.0 and net.calls == 2
        stats = policy.stats()
        assert stats["error_fallbacks"] == 1 and stats["fallbacks"] == 1 and stats["errors"] == 0


def test_contract_violations_are_not_retried():
    wrong = torch.nn.Linear(4, 5)  # 5 logits for a Discrete(3) space
    with TorchPolicy(wrong, gym.spaces.Discrete(3), max_attempts=3) as policy:
        error = policy.submit(np.zeros(4)).exception(timeout=10)
        assert isinstance(error, BackendError) and "after 1 attempt(s)" in str(error)
        assert "logits of shape [1, 3]" in str(error)
        assert policy.stats()["retries"] == 0


# ------------------------------------------------------------------------------ cache
def test_cache_hits_are_keyed_by_observation_and_version():
    with TorchPolicy(mlp(), gym.spaces.Discrete(3), cache_size=8) as policy:
        obs = np.arange(4, dtype=np.float32)
        first = policy.submit(obs).result(timeout=5)
        hit = policy.submit(obs.copy()).result(timeout=5)
        assert (hit.action, hit.behavior_logp, hit.policy_version) == (first.action, first.behavior_logp, 0)
        policy.submit(obs + 1).result(timeout=5)
        stats = policy.stats()
        assert stats["cache_hits"] == 1 and stats["cache_misses"] == 2 and stats["batches"] == 2
        policy.load_weights(mlp(seed=1).state_dict(), 1)
        after = policy.submit(obs).result(timeout=5)
        assert after.policy_version == 1 and policy.stats()["cache_hits"] == 1


# ------------------------------------------------------------------ TorchPolicy heads
def test_discrete_logp_matches_the_categorical_distribution():
    net = mlp()
    with TorchPolicy(net, gym.spaces.Discrete(3, start=10)) as policy:
        obs = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
        outs = policy.act(obs, timeout=10)
    logits = net(torch.as_tensor(obs))
    for row, out in enumerate(outs):
        assert 10 <= out.action < 13
        expected = torch.log_softmax(logits[row], -1)[out.action - 10].item()
        assert out.behavior_logp == pytest.approx(expected, abs=1e-5)


def test_box_actions_are_unclipped_with_summed_normal_logp():
    box = gym.spaces.Box(low=-0.1, high=0.1, shape=(2,), dtype=np.float32)
    head = lambda_net(torch.nn.Linear(4, 2))
    with TorchPolicy(head, box) as policy:
        outs = policy.act(np.ones((64, 4), dtype=np.float32), timeout=10)
    mean, log_std = head(torch.ones(1, 4))
    normal = torch.distributions.Normal(mean[0], log_std.exp())
    for out in outs:
        assert out.action.shape == (2,) and out.action.dtype == np.float32
        expected = normal.log_prob(torch.as_tensor(out.action)).sum().item()
        assert out.behavior_logp == pytest.approx(expected, abs=1e-4)
    assert any(not box.contains(out.action) for out in outs)  # std 0.6 vs bounds ±0.1: not clipped


def test_module_may_return_a_distribution_and_deterministic_takes_the_mode():
    class DistNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, x):
            return torch.distributions.Categorical(logits=self.linear(x))

    net = DistNet()
    with TorchPolicy(net, gym.spaces.Discrete(3), deterministic=True) as policy:
        out = policy.submit(np.ones(4)).result(timeout=5)
    assert out.action == int(net.linear(torch.ones(1, 4)).argmax())


def test_dict_observations_are_flattened_with_the_space():
    space = gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,)), "mode": gym.spaces.Discrete(3)})
    net = torch.nn.Linear(gym.spaces.flatdim(space), 2)
    with TorchPolicy(net, gym.spaces.Discrete(2), observation_space=space) as policy:
        out = policy.submit({"pos": np.array([0.5, -0.5], dtype=np.float32), "mode": 2}, env_id=1).result(timeout=5)
        assert out.action in (0, 1)
        batch = policy.act({"pos": np.zeros((3, 2), dtype=np.float32), "mode": np.array([0, 1, 2])}, timeout=5)
        assert len(batch) == 3
        with pytest.raises(ValueError, match=r"env_id=4: observation keys \['pos'\] do not match"):
            policy.submit({"pos": np.zeros(2)}, env_id=4)
        with pytest.raises(ValueError, match="env_id=5: expected a dict observation for observation_space Dict"):
            policy.submit(np.zeros(5), env_id=5)


def test_wrong_observations_give_clear_errors():
    space = gym.spaces.Box(-1, 1, (4,))
    with TorchPolicy(mlp(), gym.spaces.Discrete(3), observation_space=space) as policy:
        with pytest.raises(
            ValueError, match=r"env_id=2: observation has shape \(3,\), expected \(4,\) for observation_space Box"
        ):
            policy.submit(np.zeros(3), env_id=2)
        with pytest.raises(ValueError, match="env_id=0: expected an array for Box"):
            policy.submit("not an array", env_id=0)
        with pytest.raises(TypeError, match="env_id must be an int"):
            policy.submit(np.zeros(4), env_id="a")
        with pytest.raises(TypeError, match="priority must be an int"):
            policy.submit(np.zeros(4), priority=0.5)
        assert policy.stats()["requests"] == 0
    with TorchPolicy(mlp(), gym.spaces.Discrete(3)) as policy:
        policy.submit(np.zeros(4)).result(timeout=5)
        with pytest.raises(ValueError, match=r"shape \(5,\), expected \(4,\)"):
            policy.submit(np.zeros(5), env_id=1)
        with pytest.raises(ValueError, match="dict observations need observation_space"):
            policy.submit({"a": np.zeros(4)})
    with pytest.raises(ValueError, match="Discrete or Box"):
        TorchPolicy(mlp(), gym.spaces.MultiDiscrete([2, 2]))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        TorchPolicy(lambda x: x, gym.spaces.Discrete(2))


# --------------------------------------------------------------------- API and shutdown
def test_protocol_stats_and_act():
    with TorchPolicy(mlp(), gym.spaces.Discrete(3), max_wait_ms=1) as policy:
        assert isinstance(policy, Policy)
        outs = policy.act(np.zeros((5, 4)), timeout=10)
        assert len(outs) == 5 and all(isinstance(out, PolicyOutput) for out in outs)
        with pytest.raises(ValueError, match="2 observations but 1 env_ids"):
            policy.act(np.zeros((2, 4)), env_ids=[0])
        with pytest.raises(TypeError, match="single str"):
            policy.act("abc")
        stats = policy.stats()
    for key in (
        "requests",
        "batches",
        "mean_batch_size",
        "timeouts",
        "fallbacks",
        "latency_p50_ms",
        "latency_p99_ms",
        "queue_depth",
    ):
        assert key in stats
    assert stats["requests"] == 5 and stats["answered"] == 5 and stats["latency_p99_ms"] >= stats["latency_p50_ms"] > 0


def test_close_fails_pending_requests_and_refuses_new_ones():
    policy = LatencyModel(TorchPolicy(mlp(), gym.spaces.Discrete(3)), a_ms=300, b_ms=0, max_batch_size=1, max_wait_ms=0)
    running = policy.submit(np.zeros(4))
    time.sleep(0.05)
    pending = [policy.submit(np.zeros(4)) for _ in range(3)]
    policy.close()
    assert running.result(timeout=5).policy_version == 0  # the in-flight batch finished
    for future in pending:
        assert isinstance(future.exception(timeout=5), PolicyClosedError)
    with pytest.raises(PolicyClosedError):
        policy.submit(np.zeros(4))
    assert policy.policy.closed  # the wrapped policy is closed too
    policy.close()  # idempotent


@pytest.mark.timeout(360)
def test_importing_the_package_stays_light():
    code = (
        "import sys, asyncvec.inference as inf\n"
        "from asyncvec.inference import DynamicBatcher, PolicyOutput, Policy, BatchedPolicy\n"
        "heavy = [m for m in ('torch', 'transformers', 'httpx', 'vllm', 'fastapi') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from asyncvec.inference import TorchPolicy\n"
        "heavy = [m for m in ('transformers', 'httpx', 'vllm', 'fastapi') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)  # importing torch: ~1 min under load
