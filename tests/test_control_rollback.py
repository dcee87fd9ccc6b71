"""RollbackGuard: a forced bad update (a learning-rate spike) is rolled back, and learning recovers.

Real pieces: a TorchPolicy serving the weights, a VersionManager publishing them, a learner
whose samples carry the version that produced them. The task is a contextual regression
(the best action is ``target @ state``), so the score is exact and the test is fast.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from asyncvec.control.rollback import RollbackGuard
from asyncvec.inference import TorchPolicy
from asyncvec.versioning import VersionManager


class MeanNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mean = torch.nn.Linear(4, 2)

    def forward(self, obs):
        return self.mean(obs), torch.full((2,), -4.0)


def test_guard_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="margin must be"):
        RollbackGuard(lambda w: 1, lambda v: 0.0, margin=-1.0)
    with pytest.raises(ValueError, match="every must be"):
        RollbackGuard(lambda w: 1, lambda v: 0.0, margin=1.0, every=0)
    with pytest.raises(ValueError, match="sample_weight must be"):
        RollbackGuard(lambda w: 1, lambda v: 0.0, margin=1.0, sample_weight=2.0)


def test_checkpoints_keep_the_best_and_recent_ones() -> None:
    versions = iter(range(1, 100))
    scores = {1: 5.0, 2: 4.9, 3: 4.8, 4: 4.7, 5: 4.6}
    guard = RollbackGuard(lambda w: next(versions), lambda v: scores[v], margin=10.0, keep=2)
    for version in range(1, 6):
        assert guard.update(next(versions), f"w{version}") is None
    assert guard.best_version == 1 and list(guard.checkpoints) == [1, 4, 5]


def test_forced_bad_update_rolls_back_and_recovers() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    target = rng.normal(size=(2, 4)).astype(np.float32)
    learner = MeanNet()
    policy = TorchPolicy(MeanNet(), gym.spaces.Box(-100.0, 100.0, (2,)), deterministic=True, max_wait_ms=1)
    manager = VersionManager()
    manager.register(policy)
    eval_states = rng.normal(size=(64, 4)).astype(np.float32)
    calls: list[str] = []

    def evaluate(version: int) -> float:
        outputs = policy.act(eval_states, timeout=30)
        assert {out.policy_version for out in outputs} == {version}  # the published weights answer
        actions = np.stack([out.action for out in outputs])
        return -float(np.mean(np.sum((actions - eval_states @ target.T) ** 2, axis=1)))

    def publish(weights):
        calls.append("publish")
        return manager.publish(weights)

    guard = RollbackGuard(
        publish,
        evaluate,
        margin=0.5,
        every=2,
        restore=learner.load_state_dict,
        pause=lambda: calls.append("pause"),
        resume=lambda: calls.append("resume"),
    )
    optimizer = torch.optim.SGD(learner.parameters(), lr=0.05)
    states_seen: list[np.ndarray] = []
    versions_seen: list[np.ndarray] = []
    best_before_spike = None
    spike = 11  # evaluated only at the next update: the bad version acts for one round first
    for update in range(1, 41):
        states = rng.normal(size=(32, 4)).astype(np.float32)
        outputs = policy.act(states, timeout=30)
        states_seen.append(states)
        versions_seen.append(np.array([out.policy_version for out in outputs]))
        batch = torch.as_tensor(np.concatenate(states_seen[-3:]))
        weights = torch.as_tensor(guard.sample_weights(np.concatenate(versions_seen[-3:])), dtype=torch.float32)
        error = ((learner(batch)[0] - batch @ torch.as_tensor(target).T) ** 2).sum(dim=1)
        loss = (weights * error).sum() / weights.sum().clamp(min=1.0)
        for group in optimizer.param_groups:
            group["lr"] = 40.0 if update == spike else 0.05
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if update == spike:
            best_before_spike = guard.best_score
        version = publish(learner.state_dict())
        event = guard.update(version, learner.state_dict())
        if event is not None:
            optimizer = torch.optim.SGD(learner.parameters(), lr=0.05)  # fresh optimizer state
    final_score = evaluate(manager.current_version)
    policy.close()
    manager.close()

    assert len(guard.events) == 1, guard.events
    event = guard.events[0]
    assert event.bad_version == spike + 1 and event.restored_version == spike - 1
    assert event.rolled_back == (spike, spike + 1)
    assert event.new_version == spike + 2 and guard.lineage == {spike + 2: spike - 1}
    assert event.score < event.best_score - 0.5
    assert calls.count("pause") == calls.count("resume") == 1
    pause = calls.index("pause")
    assert calls[pause : pause + 3] == ["pause", "publish", "resume"]
    # the bad version acted for one round; its samples are dropped from then on
    bad_samples = np.concatenate(versions_seen) == spike
    assert bad_samples.sum() == 32
    assert (guard.sample_weights(np.concatenate(versions_seen))[bad_samples] == 0.0).all()
    # recovery: learning went on from the restored weights and beat the best before the spike
    assert final_score > best_before_spike, (final_score, best_before_spike)
    assert guard.best_score >= final_score - 1e-6
