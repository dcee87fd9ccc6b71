"""benchmarks/multiturn.py's bound: no mix of batch sizes beats it, and the best mixes come close."""

from __future__ import annotations

import doctest

import numpy as np

from asyncvec.benchmarks import multiturn


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


def test_expected_longest_is_the_mean_of_the_largest_of_b_draws() -> None:
    lengths = [1, 2, 3, 4, 5, 6]  # uniform: E[max of B] = sum_k P(max >= k) = sum_k 1 - ((k - 1) / 6)^B
    got = multiturn.expected_longest(lengths, range(1, 5), draws=40000)
    for b, mean in got.items():
        exact = sum(1 - ((k - 1) / 6) ** b for k in range(1, 7))
        assert abs(mean - exact) < 0.02 * exact, (b, mean, exact)


def test_call_costs_from_the_fit_recover_the_cost_of_calls_whose_draws_vary() -> None:
    """Calls cost 20 ms + 2 ms x their longest completion + 0.05 ms per prompt, with 0.3 ms of jitter;
    the longest completion is a heavy-tailed draw (9-11 ms of spread per call). From 60 calls of each
    size, the fit gives the cost function to a few microseconds, and at the longest completions of a
    large run, c(B) is within 0.2 ms of the true mean cost of B (the mean time of those 60 calls has
    a standard error of 1.2-1.4 ms). The bench's async run has about 1,100 completions: its c(2) is
    then within 0.43 ms (one standard deviation) of the expectation, without bias, and describes
    the draws that run had."""
    rng = np.random.default_rng(0)

    def completions(n: int) -> np.ndarray:
        return np.clip(np.round(4 * np.exp(0.8 * rng.standard_normal(n))), 1, 24)

    calls = []
    for size in range(1, 9):
        for _ in range(60):
            longest = completions(size).max()
            calls.append((size, int(longest), (20 + 2 * longest + 0.05 * size + rng.normal(0, 0.3)) / 1000))
    fit = multiturn.fit_call_cost(calls)
    assert np.allclose(fit * 1000, [20.0, 2.0, 0.05], atol=[0.3, 0.02, 0.02]), fit * 1000
    run = completions(200000).astype(int).tolist()  # the completions of a (large) run
    costs = multiturn.call_costs(fit, multiturn.expected_longest(run, range(1, 9)))
    for size, cost in costs.items():
        sample = completions(200000 * size).reshape(-1, size).max(axis=1)
        truth = (20 + 2 * sample.mean() + 0.05 * size) / 1000
        assert abs(cost - truth) < 0.0002, (size, cost * 1000, truth * 1000)
