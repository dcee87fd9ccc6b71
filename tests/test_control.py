"""asyncvec.control: the chunk executor (rules, records, episodes, bad chunks) and the safety layer.

Timing-dependent quantities are asserted with wide margins (a loaded 2-core machine may stretch
a 60 ms policy call several-fold); speed is measured in benchmarks/chunks.py, not here.
"""

from __future__ import annotations

import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import ResetNeeded

import asyncvec.envs  # noqa: F401  (registers the pixel envs)
from asyncvec import AsyncLLMVectorEnv
from asyncvec.control import (
    SOURCES,
    Chunk,
    ChunkExecutor,
    ChunkStream,
    SafetyFilter,
    SafetyWrapper,
    request_threshold,
    ticks_met_bound,
)
from asyncvec.control import chunks as chunks_module
from asyncvec.inference import BackendResult, BatchedPolicy
from asyncvec.metrics import RunLogger

PERIOD_S = 0.02


class ScriptedChunks(BatchedPolicy):
    """Answers after ``latency_s`` with a chunk whose action ``j`` is ``j / 100`` (a known pattern)."""

    def __init__(self, horizon: int, latency_s: float = 0.06, length: int | None = None, **kwargs) -> None:
        kwargs.setdefault("max_batch_size", 8)
        kwargs.setdefault("max_wait_ms", 1.0)
        kwargs.setdefault("max_inflight_batches", 8)
        super().__init__(**kwargs)
        self.horizon, self.latency_s, self.length = horizon, latency_s, length or horizon
        self.seen: list[dict] = []

    def _forward_batch(self, obs_list):
        time.sleep(self.latency_s)
        self.seen.extend(obs_list)
        chunk = (np.arange(self.length, dtype=np.float32) / 100.0).reshape(self.length, 1)
        return [BackendResult(action=chunk.copy(), logp=-1.5) for _ in obs_list]

    def _apply_weights(self, weights, version) -> None:
        pass


class FailingPolicy(ScriptedChunks):
    def _forward_batch(self, obs_list):
        raise ValueError("no weights loaded")


@pytest.fixture(scope="module")
def pixel_envs():
    with AsyncLLMVectorEnv([lambda: gym.make("asyncvec/PixelPendulum-v0")] * 2) as vector_env:
        yield vector_env


@pytest.fixture(scope="module")
def short_envs():
    """Episodes of 6 steps: the executor crosses episode boundaries (NEXT_STEP autoreset)."""
    with AsyncLLMVectorEnv([lambda: gym.make("asyncvec/PixelPendulum-v0", max_episode_steps=6)] * 2) as vector_env:
        yield vector_env


# ---------------------------------------------------------------------------- rules
def test_stream_newest_wins_and_drops_the_rest() -> None:
    stream = ChunkStream("newest")
    assert stream.action_at(0) is None and stream.remaining(0) == 0
    assert stream.install(Chunk(np.zeros((5, 1)), 0, -1.0, 0, start_tick=10)) == 0
    assert stream.remaining(10) == 4
    assert stream.install(Chunk(np.ones((5, 1)), 1, -2.0, 1, start_tick=12)) == 3  # ticks 12, 13, 14 of chunk 0
    action, chunk, index, blended = stream.action_at(12)
    assert action.tolist() == [1.0] and chunk.chunk_id == 1 and index == 0 and blended == 1
    assert stream.action_at(17) is None


def test_stream_ensembles_like_act() -> None:
    decay = 0.5
    stream = ChunkStream("ensemble", ensemble_decay=decay)
    stream.install(Chunk(np.full((4, 1), 2.0), 0, -1.0, 0, start_tick=0))
    assert stream.install(Chunk(np.full((4, 1), 4.0), 1, -1.0, 1, start_tick=2)) == 0
    assert stream.action_at(1)[3] == 1
    action, chunk, index, blended = stream.action_at(3)
    weights = np.exp(-decay * np.arange(2))  # w_0 for the oldest chunk (ACT)
    assert blended == 2 and chunk.chunk_id == 1 and index == 1
    assert action[0] == pytest.approx((weights[0] * 2.0 + weights[1] * 4.0) / weights.sum())
    assert stream.action_at(4)[0].tolist() == [4.0]  # the old chunk has run out


def test_request_threshold_and_bound() -> None:
    assert request_threshold([], 0.02, horizon=16) == 16
    assert request_threshold([0.1] * 10, 0.02, horizon=16) == 6  # ceil(100 / 20) + 1
    assert request_threshold([0.1] * 10, 0.02, horizon=16, margin=3) == 8
    assert request_threshold([0.4] * 10, 0.02, horizon=16) == 16  # capped at H
    assert ticks_met_bound([0.3], 0.02, horizon=1) == pytest.approx(1 / 15)
    assert ticks_met_bound([0.1, 0.3], 0.02, horizon=5) == pytest.approx(0.5)
    assert ticks_met_bound([0.1], 0.02, horizon=8) == 1.0


def test_rejects_bad_arguments(pixel_envs) -> None:
    policy = ScriptedChunks(4)
    with pytest.raises(ValueError, match="horizon must be an int >= 1"):
        ChunkExecutor(pixel_envs, policy, period_s=PERIOD_S, horizon=0)
    with pytest.raises(ValueError, match="overlap must be one of"):
        ChunkExecutor(pixel_envs, policy, period_s=PERIOD_S, horizon=4, overlap="oldest")
    with pytest.raises(ValueError, match=r"request_at must be in \[0, horizon=4\]"):
        ChunkExecutor(pixel_envs, policy, period_s=PERIOD_S, horizon=4, request_at=5)
    with pytest.raises(ValueError, match="latency_ticks must be None"):
        ChunkExecutor(pixel_envs, policy, period_s=PERIOD_S, horizon=4, latency_ticks=0)
    with pytest.raises(ResetNeeded, match="call reset"):
        ChunkExecutor(pixel_envs, policy, period_s=PERIOD_S, horizon=4).run(1)
    disabled = gym.vector.SyncVectorEnv(
        [lambda: gym.make("Pendulum-v1")], autoreset_mode=gym.vector.AutoresetMode.DISABLED
    )
    with pytest.raises(ValueError, match="NEXT_STEP or SAME_STEP, got DISABLED"):
        ChunkExecutor(disabled, policy, period_s=PERIOD_S, horizon=4)
    with pytest.raises(TypeError, match="needs a Box single_action_space"):
        ChunkExecutor(gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")]), policy, period_s=PERIOD_S, horizon=4)
    policy.close()


# ---------------------------------------------------------------------------- executor
def test_executor_plays_chunks_and_records_each_action(pixel_envs) -> None:
    horizon = 8
    policy = ScriptedChunks(horizon, latency_s=0.06)
    executor = ChunkExecutor(pixel_envs, policy, period_s=PERIOD_S, horizon=horizon)
    executor.reset(seed=0)
    rollout = executor.run(60)
    stats = executor.stats()
    policy.close()
    assert stats["ticks"] == 60 and stats["env_ticks"] == 120
    assert stats["met"] + stats["missed"] + stats["reset_ticks"] == 120
    assert rollout.count("policy") == stats["met"] and rollout.count("fallback") == stats["missed"]
    assert stats["met"] >= 0.3 * 120, stats  # bound 1.0 once the first chunk is in; generous for load
    assert (rollout.source[0] == SOURCES.index("fallback")).all()  # nothing has arrived at tick 0
    played = rollout.source == SOURCES.index("policy")
    # each played action is its chunk's action at its index, with the chunk's version and log-prob
    np.testing.assert_allclose(rollout.proposed[played][:, 0], rollout.chunk_index[played] / 100.0, atol=1e-6)
    assert (rollout.policy_version[played] == 0).all() and (rollout.behavior_logp[played] == -1.5).all()
    assert (rollout.chunk_index[played] < horizon).all() and (rollout.chunk_id[played] >= 0).all()
    missed = rollout.source == SOURCES.index("fallback")
    assert (rollout.policy_version[missed] == -1).all() and (rollout.chunk_id[missed] == -1).all()
    np.testing.assert_array_equal(rollout.replaced, ~played)
    np.testing.assert_array_equal(rollout.actions, rollout.proposed)  # no safety filter
    assert np.isnan(rollout.action_logp).all()  # no per-action log-probs reported (token_logps=None)
    assert rollout.observations is None and set(rollout.chunk_obs) == set(rollout.chunk_id[played].tolist())
    # the policy saw image + instruction observations
    assert policy.seen[0]["image"].shape == (64, 64, 3) and isinstance(policy.seen[0]["instruction"], str)
    assert stats["requests"] >= stats["chunks"] >= 2 and stats["chunk_latency_p50_ms"] >= 55
    assert 1 <= stats["request_at"] <= horizon


def test_versions_follow_weight_updates(pixel_envs) -> None:
    policy = ScriptedChunks(6, latency_s=0.04)
    executor = ChunkExecutor(pixel_envs, policy, period_s=PERIOD_S, horizon=6)
    executor.reset(seed=1)
    first = executor.run(30)
    policy.load_weights(None, 1)
    second = executor.run(60)
    policy.close()
    versions = np.concatenate([first.policy_version, second.policy_version])
    for env_id in range(2):
        played = versions[:, env_id][versions[:, env_id] >= 0]
        assert (np.diff(played) >= 0).all()
        assert played[-1] == 1


class SingleAction(ScriptedChunks):
    """One action per call, of the action space's own shape (no chunk dimension)."""

    def _forward_batch(self, obs_list):
        time.sleep(self.latency_s)
        return [BackendResult(action=np.array([0.5], dtype=np.float32), logp=-0.1) for _ in obs_list]


def test_one_action_per_call(pixel_envs) -> None:
    policy = SingleAction(1, latency_s=0.06)
    executor = ChunkExecutor(pixel_envs, policy, period_s=PERIOD_S, horizon=1)
    executor.reset(seed=0)
    rollout = executor.run(40)
    stats = executor.stats()
    policy.close()
    assert stats["met"] >= 2 and stats["missed"] > stats["met"]  # at most one tick in ceil(60 / 20) = 3
    assert np.allclose(rollout.proposed[rollout.source == 0], 0.5)


def test_bad_chunk_is_a_clear_error(pixel_envs) -> None:
    policy = ScriptedChunks(8, latency_s=0.0, length=5)
    executor = ChunkExecutor(pixel_envs, policy, period_s=PERIOD_S, horizon=8)
    executor.reset(seed=0)
    with pytest.raises(ValueError, match=r"chunk for env \d has shape \(5, 1\) .*expected \(8, 1\): horizon=8"):
        executor.run(20)
    policy.close()


def test_bad_chunk_fallback_is_counted(pixel_envs) -> None:
    policy = ScriptedChunks(8, latency_s=0.0, length=5)
    executor = ChunkExecutor(pixel_envs, policy, period_s=PERIOD_S, horizon=8, on_bad_chunk="fallback")
    executor.reset(seed=0)
    rollout = executor.run(15)
    stats = executor.stats()
    policy.close()
    assert stats["bad_chunks"] >= 2 and stats["chunks"] == 0 and stats["met"] == 0
    assert rollout.count("fallback") == 30 and rollout.policy_choice.sum() == 0


def test_policy_error_names_the_env(pixel_envs) -> None:
    policy = FailingPolicy(4)
    executor = ChunkExecutor(pixel_envs, policy, period_s=PERIOD_S, horizon=4)
    executor.reset(seed=0)
    with pytest.raises(RuntimeError, match=r"policy failed on env \d's request"):
        executor.run(20)
    policy.close()


@pytest.mark.parametrize("fallback", ["zero", "hold", "function"])
def test_fallback_when_no_chunk_arrives(pixel_envs, fallback) -> None:
    policy = ScriptedChunks(4, latency_s=5.0)  # never in time
    rule = (
        (lambda obs, env_id: np.array([0.25 * (env_id + 1)], dtype=np.float32)) if fallback == "function" else fallback
    )
    executor = ChunkExecutor(pixel_envs, policy, period_s=PERIOD_S, horizon=4, fallback=rule)
    executor.reset(seed=0)
    rollout = executor.run(10)
    stats = executor.stats()
    assert stats["missed"] == 20 and stats["met"] == 0 and rollout.count("fallback") == 20
    expected = {"zero": [0.0, 0.0], "hold": [0.0, 0.0], "function": [0.25, 0.5]}[fallback]
    np.testing.assert_allclose(rollout.actions[:, :, 0], np.tile(expected, (10, 1)))
    assert stats["requests"] == 2  # one request in flight per env
    policy.close(timeout_s=0.1)


def _assert_chunks_stay_in_their_episode(rollout) -> None:
    done = rollout.terminated | rollout.truncated
    for env_id in range(done.shape[1]):
        episode = np.cumsum(np.concatenate([[0], done[:-1, env_id]]))
        ids = rollout.chunk_id[:, env_id]
        for number in range(int(episode.max())):
            before = set(ids[(episode == number) & (ids >= 0)])
            after = set(ids[(episode > number) & (ids >= 0)])
            assert not before & after, "a chunk requested in one episode was played in the next"


def test_chunks_never_cross_episodes(short_envs) -> None:
    policy = ScriptedChunks(8, latency_s=0.03)
    executor = ChunkExecutor(short_envs, policy, period_s=PERIOD_S, horizon=8)
    executor.reset(seed=0)
    rollout = executor.run(40)
    stats = executor.stats()
    policy.close()
    done = rollout.terminated | rollout.truncated
    assert done.sum() >= 4
    reset = rollout.source == SOURCES.index("reset")
    np.testing.assert_array_equal(reset[1:], done[:-1])  # NEXT_STEP: the step after the end resets
    assert stats["reset_ticks"] == reset.sum() and not rollout.policy_choice[reset].any()
    _assert_chunks_stay_in_their_episode(rollout)


def test_simulated_clock_replays_the_same_schedule_at_any_latency(short_envs) -> None:
    """latency_ticks=3: a chunk requested at tick t plays from tick t + 3, whether the policy takes
    0 or 50 ms (4 periods): which tick plays which chunk's action, and which falls back, is the same."""
    schedules = []
    for latency_s in (0.0, 0.05):
        policy = ScriptedChunks(8, latency_s=latency_s)
        executor = ChunkExecutor(short_envs, policy, period_s=0.01, horizon=8, latency_ticks=3)
        executor.reset(seed=0)
        rollout = executor.run(40)
        stats = executor.stats()
        assert all(future is None or future.done() for future in executor._pending)  # awaited in its tick
        policy.close()
        assert stats["late_ticks"] == 0 and stats["request_at"] == 4  # k = min(H, L + margin)
        assert (rollout.source[:3] == SOURCES.index("fallback")).all()  # the first chunk, asked at tick 0, plays at 3
        assert (rollout.source[3] == SOURCES.index("policy")).all() and (rollout.chunk_index[3] == 0).all()
        _assert_chunks_stay_in_their_episode(rollout)
        schedules.append((rollout.source, rollout.chunk_id, rollout.chunk_index, rollout.actions))
    for fast, slow in zip(*schedules, strict=True):
        np.testing.assert_array_equal(fast, slow)
    assert (schedules[0][0] == SOURCES.index("reset")).any()  # the schedule crossed episode ends


def test_simulated_clock_names_a_policy_that_never_answers(short_envs, monkeypatch) -> None:
    monkeypatch.setattr(chunks_module, "ANSWER_TIMEOUT_S", 0.05)
    policy = ScriptedChunks(4, latency_s=0.5)
    executor = ChunkExecutor(short_envs, policy, period_s=0.01, horizon=4, latency_ticks=1)
    executor.reset(seed=0)
    with pytest.raises(RuntimeError, match="did not answer env 0's request within"):
        executor.run(3)
    policy.close()


def test_same_step_autoreset_has_no_reset_ticks() -> None:
    make = lambda: gym.make("asyncvec/PixelPendulum-v0", max_episode_steps=6)  # noqa: E731  (a one-line env factory)
    with AsyncLLMVectorEnv([make] * 2, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP) as vector_env:
        policy = ScriptedChunks(8, latency_s=0.03)
        executor = ChunkExecutor(vector_env, policy, period_s=PERIOD_S, horizon=8)
        executor.reset(seed=0)
        rollout = executor.run(30)
        policy.close()
    done = rollout.terminated | rollout.truncated
    assert done.sum() >= 4 and rollout.count("reset") == 0
    _assert_chunks_stay_in_their_episode(rollout)


def test_ensemble_overlap_blends_and_marks(pixel_envs) -> None:
    policy = ScriptedChunks(8, latency_s=0.03)
    executor = ChunkExecutor(pixel_envs, policy, period_s=PERIOD_S, horizon=8, overlap="ensemble", request_at=8)
    executor.reset(seed=0)
    rollout = executor.run(40)
    stats = executor.stats()
    policy.close()
    blended = rollout.source == SOURCES.index("ensemble")
    assert stats["ensembled"] == blended.sum() >= 5
    assert rollout.replaced[blended].all() and (rollout.chunk_id[blended] >= 0).all()


def test_safety_filter_in_the_executor(pixel_envs) -> None:
    safety = SafetyFilter(pixel_envs.single_action_space, max_delta=0.005)
    policy = ScriptedChunks(8, latency_s=0.03)
    executor = ChunkExecutor(pixel_envs, policy, period_s=PERIOD_S, horizon=8, safety=safety)
    executor.reset(seed=0)
    rollout = executor.run(40)
    stats = executor.stats()
    policy.close()
    assert stats["safety_replaced"] == rollout.safety_replaced.sum() == safety.stats()["rate"] >= 5
    assert np.abs(np.diff(rollout.actions[:, :, 0], axis=0)).max() <= 0.005 + 1e-6
    assert not rollout.policy_choice[rollout.safety_replaced].any()


def test_executor_logs_to_tensorboard(pixel_envs, tmp_path: Path) -> None:
    policy = ScriptedChunks(4, latency_s=0.02)
    safety = SafetyFilter(pixel_envs.single_action_space, high=0.005)
    executor = ChunkExecutor(pixel_envs, policy, period_s=PERIOD_S, horizon=4, safety=safety)
    executor.reset(seed=0)
    executor.run(15)
    logger = RunLogger(tmp_path, track=True, progress=False)
    executor.log(logger, step=15)
    logger.close()
    policy.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "control/met_fraction" in tags and "safety/bounds" in tags and "safety/replaced" in tags
    assert events.Scalars("safety/bounds")[0].value >= 1


# ---------------------------------------------------------------------------- safety layer
def test_safety_filter_rules() -> None:
    space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    safety = SafetyFilter(space, max_delta=0.5, predicate=lambda obs, action: not (obs == "wall" and action[0] > 0))
    assert safety(None, [0.2, 0.0], env_id=0) == (pytest.approx(np.array([0.2, 0.0])), None)
    action, reason = safety(None, [5.0, 0.0], env_id=0)
    assert reason == "bounds+rate" and action.tolist() == pytest.approx([0.7, 0.0])
    action, reason = safety(None, [np.nan, 0.0], env_id=0)
    assert reason == "nonfinite" and action.tolist() == pytest.approx([0.7, 0.0])  # hold
    action, reason = safety("wall", [0.9, 0.0], env_id=0)
    assert reason == "predicate" and action.tolist() == pytest.approx([0.7, 0.0])  # the held action is returned
    assert safety(None, [1.0, 0.0], env_id=1)[1] is None  # envs are independent
    safety.reset(0)
    assert safety(None, [-0.9, 0.0], env_id=0)[1] is None  # no rate limit at an episode start
    stats = safety.stats()
    assert stats["checked"] == 6 and stats["replaced"] == 3 and stats["bounds"] == stats["rate"] == 1
    assert stats["nonfinite"] == stats["predicate"] == 1 and stats["replaced_fraction"] == pytest.approx(0.5)


def test_safety_filter_safe_actions_and_errors() -> None:
    space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    zero = SafetyFilter(space, predicate=lambda obs, action: action[0] < 0.5, safe_action="zero")
    zero(None, [0.1])
    assert zero(None, [0.8])[0].tolist() == [0.0]
    custom = SafetyFilter(space, predicate=lambda obs, action: False, safe_action=lambda obs, prev, env_id: [-0.25])
    assert custom(None, [0.3], env_id=4)[0].tolist() == [-0.25]
    with pytest.raises(ValueError, match=r"action for env 3 has shape \(3,\) .*expected \(1,\)"):
        zero(None, np.zeros(3), env_id=3)
    with pytest.raises(ValueError, match="safe_action must be"):
        SafetyFilter(space, safe_action="brake")
    with pytest.raises(ValueError, match="low must be <= high"):
        SafetyFilter(space, low=0.5, high=0.0)


def test_safety_wrapper_marks_samples_through_the_vector_env() -> None:
    def make():
        return SafetyWrapper(gym.make("asyncvec/PixelPendulum-v0"), max_delta=0.1)

    with AsyncLLMVectorEnv([make] * 2) as vector_env:
        vector_env.reset(seed=0)
        _, _, _, _, info = vector_env.step(np.array([[0.05], [2.0]], dtype=np.float32))
        assert info["safety_replaced"].tolist() == [False, False]  # first action of the episode: no rate limit
        _, _, _, _, info = vector_env.step(np.array([[0.1], [-2.0]], dtype=np.float32))
        assert info["safety_replaced"].tolist() == [False, True]
        assert info["safety_reason"][1] == "rate"
        assert info["executed_action"][1].tolist() == pytest.approx([1.9])


def test_chunks_benchmark_runs(tmp_path: Path) -> None:
    """benchmarks/chunks.py end to end at a tiny size: it writes its table and plot."""
    from asyncvec.benchmarks.chunks import Args, main

    results = main(
        Args(
            part="chunks",
            num_envs=2,
            latencies_ms=[60.0],
            horizons=[1, 4],
            ticks=15,
            warmup_ticks=5,
            out_dir=str(tmp_path),
        )
    )
    assert [row["horizon"] for row in results["chunks"]] == [1, 4]
    assert all(0.0 <= row["met"] <= 1.0 and 0.0 < row["bound"] <= 1.0 for row in results["chunks"])
    assert (tmp_path / "chunks.md").exists() and (tmp_path / "chunks.png").exists()
