"""benchmarks/multiturn.py's bound: no mix of batch sizes beats it, and the best mixes come close."""

from __future__ import annotations

import doctest

import numpy as np

from benchmarks import multiturn


def test_docstring_examples_run() -> None:
    assert doctest.testmod(multiturn).failed == 0


def test_fluid_bound_is_the_best_mix_of_batch_sizes() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        num_envs, inflight = int(rng.integers(2, 17)), int(rng.integers(1, 5))
        steps = rng.uniform(0.0005, 0.01, num_envs)
        call_s = dict(zip(range(1, num_envs + 1), (0.02 + np.cumsum(steps)).tolist()))  # grows with the batch
        env_s = float(rng.uniform(0.005, 0.1))
        bound, _ = multiturn.fluid_bound(call_s, env_s, num_envs, inflight)
        sizes = np.arange(1, num_envs + 1)
        cost = np.array([call_s[b] for b in sizes])
        best = 0.0
        for share in rng.dirichlet(np.full(num_envs, 0.3), 4000):  # share of turns in calls of each size
            turns = min(inflight / float(share @ (cost / sizes)), num_envs / float(share @ (cost + env_s)))
            assert turns <= bound * (1 + 1e-9)
            best = max(best, turns)
        for b1 in sizes:  # two-size mixes on a grid (an optimum uses at most two sizes)
            for b2 in sizes[b1 - 1 :]:
                for w in np.linspace(0, 1, 21):
                    g = w * cost[b1 - 1] / b1 + (1 - w) * cost[b2 - 1] / b2
                    h = w * cost[b1 - 1] + (1 - w) * cost[b2 - 1] + env_s
                    turns = min(inflight / g, num_envs / h)
                    assert turns <= bound * (1 + 1e-9)
                    best = max(best, turns)
        assert best >= 0.98 * bound
