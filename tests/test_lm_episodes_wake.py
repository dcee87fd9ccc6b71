"""``AsyncLLMVectorEnv.wake`` and the ``EpisodeCollector`` that uses it: a policy's answer goes to its
env at once, not when the wait for other envs' results ends (real worker processes, a simulated LM)."""

from __future__ import annotations

import multiprocessing
import threading
import time

import gymnasium as gym
import pytest

import asyncvec.envs  # noqa: F401  (registers asyncvec/GuessNumber-v0)
from asyncvec.benchmarks.multiturn import SimulatedLM
from asyncvec.envs.slow import SlowEnv
from asyncvec.lm import EpisodeCollector, make_text_vector_env
from asyncvec.vector import AsyncLLMVectorEnv


def _slow_cartpole() -> gym.Env:
    return SlowEnv(gym.make("CartPole-v1"), latency_ms=3000)


def test_wake_ends_a_waiting_recv_and_the_result_still_comes() -> None:
    vec = AsyncLLMVectorEnv([_slow_cartpole], batch_size=1)
    try:
        assert vec.wakeable
        vec.send_reset([0], [0])
        vec.recv(timeout=60)
        vec.send([0], [0])  # a step of 3 s
        threading.Timer(0.2, vec.wake).start()
        start = time.monotonic()
        with pytest.raises(multiprocessing.TimeoutError, match="wake"):
            vec.recv(timeout=60)
        assert time.monotonic() - start < 2.5  # woken, not the step's end
        vec.wake()  # a wake with no recv waiting ends the next wait at once
        with pytest.raises(multiprocessing.TimeoutError, match="wake"):
            vec.recv(timeout=60)
        _, _, _, _, info = vec.recv(timeout=60)  # the step's result was never lost
        assert list(info["env_id"]) == [0]
    finally:
        vec.close(terminate=True)
    vec.wake()  # after close: nothing to wake, no error


def _guess(latency_ms: float):
    def make() -> gym.Env:
        env = gym.make(
            "asyncvec/GuessNumber-v0", max_number=16, max_turns=6, transcript=False, max_completion_length=64
        )
        return SlowEnv(env, latency_ms=latency_ms)

    return make


def test_an_answer_reaches_its_env_while_another_env_steps() -> None:
    """Env 0 steps in 10 ms, env 1 in 400 ms. With a poll of 5 s, env 0's answers would wait for env
    1's results (about one turn of env 0 per 400 ms); woken by each answer, env 0 runs its own pace."""
    vec = make_text_vector_env([_guess(10), _guess(400)])
    policy = SimulatedLM(a_ms=2, per_token_ms=0, median_tokens=2, max_new_tokens=4, max_wait_ms=0.0)
    try:
        with policy, EpisodeCollector(vec, policy, group_size=1, poll_s=5.0) as collector:
            collector.start(1000, ahead=100)
            collector.pop(1, timeout=60)  # workers up, first episode done
            turns_before = collector.stats()["turns"]
            time.sleep(2.0)
            turns = collector.stats()["turns"] - turns_before
    finally:
        vec.close(terminate=True)
    # woken: about 2 s / (10 ms + a call) turns of env 0 (133 here at load 8); polling: about 2 s / 400 ms = 5 per env
    assert turns >= 30, f"{turns} turns in 2 s"


def test_a_send_from_another_thread_is_watched_by_the_recv_waiting_in_this_one() -> None:
    """Env 0 steps for 3 s; a send to env 1 from another thread while ``recv`` waits: ``recv``
    returns env 1's result, not env 0's 3 s later."""
    vec = AsyncLLMVectorEnv([_slow_cartpole, lambda: gym.make("CartPole-v1")], batch_size=1)
    try:
        vec.send_reset([0, 1], [0, 1])
        vec.recv(timeout=60), vec.recv(timeout=60)
        vec.send([0], [0])  # a step of 3 s
        threading.Timer(0.2, vec.send, args=([1], [1])).start()
        start = time.monotonic()
        _, _, _, _, info = vec.recv(timeout=60)
        assert list(info["env_id"]) == [1] and time.monotonic() - start < 2.5
        _, _, _, _, info = vec.recv(timeout=60)
        assert list(info["env_id"]) == [0]
    finally:
        vec.close(terminate=True)


def test_answers_go_to_their_envs_from_the_policys_thread() -> None:
    """The policy's callback sends the action itself when the collection thread is free; the
    episodes are whole either way (every turn recorded, its reward and env latency filled in)."""
    vec = make_text_vector_env([_guess(5)] * 4)
    senders: list[str] = []
    send = vec.send

    def recording_send(actions, env_ids=None):
        senders.append(threading.current_thread().name)
        return send(actions, env_ids)

    vec.send = recording_send
    policy = SimulatedLM(a_ms=2, per_token_ms=0, median_tokens=2, max_new_tokens=4, max_wait_ms=0.0)
    try:
        with policy, EpisodeCollector(vec, policy, group_size=2) as collector:
            collector.start(40, ahead=10)
            batch = collector.pop(10, timeout=120)
            stats = collector.stats()
    finally:
        vec.close(terminate=True)
    assert any(name != "asyncvec-episodes" for name in senders), set(senders)
    for group in batch.episodes:
        for episode in group:
            assert episode.terminated or episode.truncated
            assert all(turn.env_latency_s > 0 and turn.completion_ids for turn in episode.turns)
            assert sum(turn.reward for turn in episode.turns) == episode.total_reward
    assert stats["turns"] >= batch.num_turns


class _NoTokenIds(SimulatedLM):
    def _text_result(self, text, ids, logps):
        return super()._text_result(text, [], [])


def test_an_answer_without_token_ids_fails_the_run_from_either_thread() -> None:
    vec = make_text_vector_env([_guess(5)] * 2)
    policy = _NoTokenIds(a_ms=2, per_token_ms=0, median_tokens=2, max_new_tokens=4, max_wait_ms=0.0)
    try:
        with policy, EpisodeCollector(vec, policy, group_size=1) as collector:
            collector.start(10, ahead=2)
            with pytest.raises(RuntimeError, match="no token ids"):
                collector.pop(1, timeout=60)
    finally:
        vec.close(terminate=True)
