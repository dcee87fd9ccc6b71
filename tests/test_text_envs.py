"""Text envs: spaces hold every observation, rewards, seeding, multi-turn feedback, truncation."""

from __future__ import annotations

import re
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import ResetNeeded
from gymnasium.utils.env_checker import check_env

from asyncvec import AsyncLLMVectorEnv
from asyncvec.envs.text import ArithmeticEnv, GuessNumberEnv

pytestmark = pytest.mark.timeout(60)

ENV_CONFIGS = [
    (ArithmeticEnv, {}),
    (ArithmeticEnv, {"single_digit": True}),
    (ArithmeticEnv, {"min_operand": 100, "max_operand": 999, "operations": "*"}),
    (GuessNumberEnv, {}),
    (
        GuessNumberEnv,
        {"max_number": 1000, "max_turns": 3, "transcript": False, "step_penalty": 0.01},
    ),
]


@pytest.mark.parametrize(("env_cls", "kwargs"), ENV_CONFIGS)
def test_check_env(env_cls, kwargs):
    check_env(env_cls(**kwargs), skip_render_check=True)


# --- ArithmeticEnv -----------------------------------------------------------------------

PROBLEM = re.compile(r"(\d+)([-+*])(\d+)=")


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"single_digit": True},
        {"max_operand": 5, "operations": ["-"]},
        {"min_operand": 90, "max_operand": 120},
    ],
)
def test_arithmetic_prompts_are_in_space_and_answers_correct(kwargs):
    env = ArithmeticEnv(**kwargs)
    env.observation_space.seed(0)
    seen_ops = set()
    for seed in range(200):
        prompt, info = env.reset(seed=seed)
        assert prompt in env.observation_space and info == {}
        left, symbol, right = PROBLEM.fullmatch(prompt).groups()
        seen_ops.add(symbol)
        assert env.min_operand <= int(left) <= env.max_operand
        assert env.min_operand <= int(right) <= env.max_operand
        expected = {
            "+": int(left) + int(right),
            "-": int(left) - int(right),
            "*": int(left) * int(right),
        }[symbol]
        obs, reward, terminated, truncated, info = env.step(f" {expected} ")
        assert obs in env.observation_space
        assert (reward, terminated, truncated, info) == (
            1.0,
            True,
            False,
            {"answer": expected, "parsed": True},
        )
    assert seen_ops == set(env.operations)


def test_single_digit_mode_is_single_digit_sums():
    env = ArithmeticEnv(single_digit=True)
    prompts = {env.reset(seed=seed)[0] for seed in range(300)}
    assert all(re.fullmatch(r"\d\+\d=", p) for p in prompts)
    assert len(prompts) > 50  # covers most of the 100 problems
    env.reset(seed=0)
    assert env.step("14")[1] == 1.0  # the module docstring's "8+6=" problem


@pytest.mark.parametrize(
    ("completion", "reward", "parsed"),
    [
        ("14", 1.0, True),
        ("  14\n", 1.0, True),
        ("14 is the sum", 1.0, True),
        ("+14", 1.0, True),
        ("15", 0.0, True),
        ("-14", 0.0, True),
        ("fourteen", 0.0, False),
        ("", 0.0, False),
        ("= 14", 0.0, False),
        ("1 4", 0.0, True),
        ("é14", 0.0, False),
        ("14" + "!" * 500, 1.0, True),
    ],
)
def test_arithmetic_reward_parsing(completion, reward, parsed):
    env = ArithmeticEnv(single_digit=True)
    assert env.reset(seed=0)[0] == "8+6="
    _, got_reward, terminated, _, info = env.step(completion)
    assert (got_reward, info["parsed"], info["answer"], terminated) == (reward, parsed, 14, True)


def test_arithmetic_negative_answers():
    env = ArithmeticEnv(max_operand=9, operations="-")
    for seed in range(50):
        prompt, _ = env.reset(seed=seed)
        left, _, right = PROBLEM.fullmatch(prompt).groups()
        if int(left) < int(right):
            assert env.step(str(int(left) - int(right)))[1] == 1.0
            return
    pytest.fail("no negative problem in 50 seeds")


def test_arithmetic_seeding_is_deterministic():
    env_a, env_b = ArithmeticEnv(), ArithmeticEnv()
    first = [env_a.reset(seed=7)[0]] + [env_a.reset()[0] for _ in range(20)]
    second = [env_b.reset(seed=7)[0]] + [env_b.reset()[0] for _ in range(20)]
    other = [env_b.reset(seed=8)[0]] + [env_b.reset()[0] for _ in range(20)]
    assert first == second
    assert first != other


def test_arithmetic_errors():
    env = ArithmeticEnv()
    with pytest.raises(ResetNeeded, match="reset"):
        env.step("1")
    env.reset(seed=0)
    with pytest.raises(TypeError, match="action must be a str.*int"):
        env.step(3)
    env.step("1")
    with pytest.raises(ResetNeeded, match="reset"):
        env.step("1")  # one step per episode


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"operations": ["/"]}, ValueError, "operations"),
        ({"operations": []}, ValueError, "operations"),
        ({"max_operand": 3, "min_operand": 5}, ValueError, "max_operand"),
        ({"min_operand": -1}, ValueError, "min_operand"),
        ({"max_operand": 9.5}, TypeError, "max_operand"),
        ({"single_digit": True, "max_operand": 50}, ValueError, "single_digit"),
        ({"single_digit": True, "operations": "*"}, ValueError, "single_digit"),
        ({"max_completion_length": 0}, ValueError, "max_completion_length"),
    ],
)
def test_arithmetic_argument_errors(kwargs, error, field):
    with pytest.raises(error, match=field):
        ArithmeticEnv(**kwargs)


# --- GuessNumberEnv ----------------------------------------------------------------------


def play(env: GuessNumberEnv, guesses):
    steps = []
    for guess in guesses:
        steps.append(env.step(guess))
        if steps[-1][2] or steps[-1][3]:
            break
    return steps


def test_guess_feedback_leads_to_the_secret():
    env = GuessNumberEnv(max_number=16, max_turns=16)
    env.reset(seed=3)
    steps = play(env, [str(g) for g in range(1, 17)])
    *misses, (obs, reward, terminated, truncated, info) = steps
    secret = info["guess"]
    assert all(s[4]["feedback"] == "higher" and s[1] == 0.0 for s in misses)
    assert len(misses) == secret - 1
    assert (reward, terminated, truncated, info["feedback"], info["turn"]) == (
        1.0,
        True,
        False,
        "correct",
        secret,
    )

    env.reset(seed=3)  # same secret from the top: every miss is "lower"
    steps = play(env, [str(g) for g in range(16, 0, -1)])
    assert [s[4]["feedback"] for s in steps] == ["lower"] * (16 - secret) + ["correct"]


def test_binary_search_solves_every_secret_within_log2_turns():
    env = GuessNumberEnv(max_number=16, max_turns=5, transcript=False)
    secrets = set()
    for seed in range(40):
        obs, _ = env.reset(seed=seed)
        low, high = 1, 16
        while True:
            guess = (low + high) // 2
            obs, reward, terminated, truncated, info = env.step(f"{guess}")
            assert obs == info["feedback"] and obs in env.observation_space
            if terminated:
                secrets.add(guess)
                assert reward == 1.0
                break
            assert not truncated, f"binary search failed for seed {seed}"
            low, high = (guess + 1, high) if obs == "higher" else (low, guess - 1)
    assert len(secrets) > 8


def test_transcript_observation():
    env = GuessNumberEnv(max_number=16, max_turns=4)
    obs, info = env.reset(seed=3)
    assert obs == "Guess a number between 1 and 16." and info == {"turn": 0}
    obs, *_ = env.step("1")
    obs, *_ = env.step("banana")
    obs, *_ = env.step("17")
    assert obs == "Guess a number between 1 and 16.\n1: higher\n?: invalid\n?: invalid"


def test_invalid_guesses_count_and_truncate_with_penalty():
    env = GuessNumberEnv(max_number=8, max_turns=3, step_penalty=0.1)
    env.reset(seed=0)
    steps = play(env, ["", "zero", "0", "9", "-1"])
    assert len(steps) == 3
    assert [s[4]["feedback"] for s in steps] == ["invalid"] * 3
    assert [s[4].get("guess") for s in steps] == [None, None, 0]  # no integer read: no "guess"
    assert all(s[1] == pytest.approx(-0.1) for s in steps)
    assert [s[3] for s in steps] == [False, False, True]  # truncated on the last turn
    assert not any(s[2] for s in steps)
    with pytest.raises(ResetNeeded, match="reset"):
        env.step("1")


def test_winning_reward_includes_step_penalty():
    env = GuessNumberEnv(max_number=1, step_penalty=0.25)
    env.reset(seed=0)
    _, reward, terminated, _, _ = env.step("1")
    assert (reward, terminated) == (0.75, True)


@pytest.mark.parametrize("transcript", [True, False])
def test_longest_observations_fit_the_space(transcript):
    env = GuessNumberEnv(max_number=1000, max_turns=6, transcript=transcript)
    for seed, guess in [(0, "1000"), (1, "nope"), (2, "1")]:
        obs, _ = env.reset(seed=seed)
        assert obs in env.observation_space
        for _ in range(env.max_turns):
            obs, _, terminated, truncated, _ = env.step(guess)
            assert obs in env.observation_space, obs
            if terminated or truncated:
                break
    assert len(obs) <= env.observation_space.max_length


def test_guess_seeding_is_deterministic():
    def secrets(seed):
        env = GuessNumberEnv(max_number=100, max_turns=100)
        result = []
        for i in range(10):
            env.reset(seed=seed if i == 0 else None)
            result.append(play(env, [str(g) for g in range(1, 101)])[-1][4]["guess"])
        return result

    assert secrets(5) == secrets(5)
    assert secrets(5) != secrets(6)


def test_guess_errors():
    env = GuessNumberEnv()
    with pytest.raises(ResetNeeded, match="reset"):
        env.step("1")
    env.reset(seed=0)
    with pytest.raises(TypeError, match="action must be a str"):
        env.step(None)
    for kwargs, field in [
        ({"max_number": 0}, "max_number"),
        ({"max_turns": 0}, "max_turns"),
        ({"step_penalty": -1}, "step_penalty"),
        ({"step_penalty": "0"}, "step_penalty"),
    ]:
        with pytest.raises((TypeError, ValueError), match=field):
            GuessNumberEnv(**kwargs)


def test_guess_number_runs_in_vector_envs_like_gymnasiums():
    """Invalid guesses beside valid ones in one vector step: the info keys must batch (a None beside ints did not)."""
    fns = [partial(GuessNumberEnv, max_number=8, max_turns=4)] * 3
    ours, theirs = AsyncLLMVectorEnv(fns), gym.vector.SyncVectorEnv(fns)
    with ours:
        assert ours.reset(seed=0)[0] == theirs.reset(seed=0)[0]
        rng = np.random.default_rng(0)
        for _ in range(40):
            actions = tuple(rng.choice(["3", "x", "5", "", "8 or so"], size=3))
            got, want = ours.step(actions), theirs.step(actions)
            assert got[0] == want[0]
            for a, b in zip(got[1:4], want[1:4]):
                np.testing.assert_array_equal(a, b)
            guessed = want[4].get("_guess", np.zeros(3, dtype=bool))  # a key is absent when no env has it
            np.testing.assert_array_equal(got[4].get("_guess", np.zeros(3, dtype=bool)), guessed)
            if guessed.any():
                np.testing.assert_array_equal(got[4]["guess"][guessed], want[4]["guess"][guessed])
