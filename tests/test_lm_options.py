"""LMArgs in sections (issue 51): the flags users type and the flat names Python code uses stay as they were,
runs record the flat names; Staleness owns --max-staleness's three uses; an agent's minibatch steps draw the
same shuffles as minibatch_updates."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import tyro

from asyncvec.agents import grpo, reinforce_pp, rloo
from asyncvec.lm.learner import MinibatchSteps
from asyncvec.lm.options import NOT_REPLAYED, SECTION_OF, EngineOptions, LMArgs
from asyncvec.lm.staleness import Staleness

# The 59 options LMArgs had before it had sections: each is still a flag and a name (flat()).
FLAT_NAMES = {
    "env", "env_kwargs", "num_envs", "gamma", "per_turn", "system_prompt", "on_overflow", "model", "sft_steps",
    "reward", "reward_timeout_s", "reward_workers", "reward_cache_size", "backend", "inflight_updates", "vllm_engine",
    "base_url", "server_kind", "served_model", "weights_dir", "update_token", "mode", "total_prompts",
    "prompts_per_update", "group_size", "prefetch_updates", "max_staleness", "staleness_control", "policy_lag",
    "bitwise_sampling", "record_schedule", "replay", "is_cap", "is_level", "kl_coef", "kl_estimator",
    "max_new_tokens", "temperature", "learning_rate", "update_epochs", "num_minibatches", "max_grad_norm",
    "policy_batch_size", "policy_wait_ms", "policy_inflight_batches", "deadline_ms", "eval_prompts", "target_reward",
    "target_tolerance", "timeout_s", "seed", "device", "torch_threads", "output_dir", "checkpoint_dir", "resume",
    "track", "log_dir", "progress",
}  # fmt: skip


def test_the_flat_names_are_the_options_runs_record():
    assert len(FLAT_NAMES) == 59
    assert set(dataclasses.asdict(LMArgs().flat())) == FLAT_NAMES
    assert NOT_REPLAYED <= FLAT_NAMES and set(SECTION_OF) <= FLAT_NAMES
    assert set(dataclasses.asdict(grpo.Args().flat())) == FLAT_NAMES | {"clip_coef"}


def test_a_sectioned_option_constructs_reads_and_sets_by_its_flat_name():
    args = rloo.Args(max_staleness=1, policy_lag=1, deadline_ms=5.0, num_envs=3, track=False)
    assert args.staleness == Staleness(max_staleness=1, policy_lag=1)
    assert (args.max_staleness, args.deadline_ms, args.engine.deadline_ms, args.num_envs, args.track) == (
        1, 5.0, 5.0, 3, False
    )  # fmt: skip
    assert args == rloo.Args(
        staleness=Staleness(max_staleness=1, policy_lag=1), deadline_ms=5.0, num_envs=3, track=False
    )
    # a flat name given beside its section changes a copy of that section
    given = EngineOptions(backend="hf", policy_wait_ms=3.0)
    both = LMArgs(engine=given, deadline_ms=7.0)
    assert (both.policy_wait_ms, both.deadline_ms, given.deadline_ms) == (3.0, 7.0, None)
    replaced = dataclasses.replace(args, sft_steps=0, max_staleness=2)
    assert (replaced.max_staleness, replaced.policy_lag, args.max_staleness) == (2, 1, 1)
    args.max_staleness = 4  # sections are frozen: the args get a changed copy
    assert args.staleness.max_staleness == 4 and replaced.max_staleness == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_staleness": -1}, "--max-staleness must be an int >= 0"),
        ({"policy_lag": 3, "max_staleness": 1}, "--policy-lag 3 exceeds --max-staleness 1"),
        ({"num_envs": 0}, "--num-envs must be an int >= 1"),
        ({"bitwise_sampling": True, "backend": "vllm"}, "--bitwise-sampling needs --backend hf"),
    ],
)
def test_sectioned_options_are_checked_as_before(options, message):
    with pytest.raises(ValueError, match=message):
        rloo.Args(**options)


@pytest.mark.parametrize("agent", [rloo, reinforce_pp, grpo])
def test_the_flags_users_type_are_unchanged(agent):
    argv = [
        "--max-staleness", "0", "--staleness-control", "drop", "--policy-lag", "0", "--prefetch-updates", "2",
        "--backend", "hf", "--policy-wait-ms", "5", "--deadline-ms", "900", "--server-kind", "vllm",
        "--num-envs", "2", "--gamma", "0.5", "--reward-workers", "3", "--no-track", "--log-dir", "elsewhere",
        "--learning-rate", "0.01", "--group-size", "4",
    ]  # fmt: skip
    args = tyro.cli(agent.Args, args=argv)
    assert args.staleness == Staleness(max_staleness=0, staleness_control="drop", policy_lag=0, prefetch_updates=2)
    assert (args.policy_wait_ms, args.deadline_ms, args.server_kind) == (5.0, 900.0, "vllm")
    assert (args.num_envs, args.gamma, args.reward_workers, args.track, args.log_dir) == (2, 0.5, 3, False, "elsewhere")
    assert (args.learning_rate, args.group_size) == (0.01, 4)


def test_help_lists_every_flag_once_in_its_section(capsys):
    with pytest.raises(SystemExit):
        tyro.cli(grpo.Args, args=["--help"])
    text = capsys.readouterr().out
    for name in FLAT_NAMES:
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
    for section in ("engine options", "staleness options", "multi-turn options", "reward-service options", "logging"):
        assert section in text, section
    assert "--staleness.max-staleness" not in text and "--engine.backend" not in text


def test_staleness_owns_the_bound_and_its_three_uses():
    staleness = Staleness(max_staleness=2, staleness_control="admission", policy_lag=1, prefetch_updates=3)
    assert staleness.version_manager(initial_version=5).max_lag == 2
    assert staleness.learner_bound() == 2
    gate = staleness.admission("async", prompts_per_update=4)
    assert (gate.per_update, gate.max_staleness, gate.lag) == (4, 2, 1)
    assert staleness.admission("sync", 4) is None
    assert dataclasses.replace(staleness, staleness_control="drop").admission("async", 4) is None
    assert staleness.prompts_ahead(4) == 12

    class Backend:
        def load_weights(self, weights, version):
            self.version = version

    backend = Backend()
    assert dataclasses.replace(staleness, policy_lag=0).lagged(backend) is backend  # lag 0: straight through
    lagged = staleness.lagged(backend)
    lagged.load_weights({}, 1)
    lagged.load_weights({}, 2)
    assert backend.version == 1


@pytest.mark.parametrize(("epochs", "minibatches", "in_order"), [(1, 1, True), (1, 1, False), (2, 3, True)])
def test_minibatch_steps_draw_the_shuffles_the_old_loop_drew(epochs, minibatches, in_order):
    """The rows of each step, as minibatch_updates drew them before MinibatchSteps (one randperm per pass)."""
    rows = 7
    torch.manual_seed(3)
    expected = []
    single_pass = epochs == 1 and minibatches == 1 and in_order
    per_minibatch = -(-rows // minibatches)
    for _ in range(epochs):
        order = torch.arange(rows) if single_pass else torch.randperm(rows)
        expected += [order[start : start + per_minibatch] for start in range(0, rows, per_minibatch)]
    model = torch.nn.Linear(1, 1)  # built before the seed: its initialization draws too
    torch.manual_seed(3)
    steps = MinibatchSteps(model, rows, epochs, minibatches, max_grad_norm=1.0, in_order=in_order)
    got = list(steps.minibatches())
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_mistyped_sectioned_flag_is_suggested_and_schedules_record_flat_names():
    from asyncvec.agents.common import unrecognized_options
    from asyncvec.schedule import recorded_options

    # --max-staleness lives in the staleness section; the hint must name it, not the section
    hint = unrecognized_options(["--max-stalenes", "1"], LMArgs)
    assert "did you mean --max-staleness?" in hint
    recorded = recorded_options(LMArgs(max_staleness=1))
    assert recorded["max_staleness"] == 1 and "staleness" not in recorded
