"""``--resume`` of the language-model agents goes on with what the first run had: the KL reference of
its warm start, its version in one weight load, and reset seeds and sampling it had not used yet."""

from __future__ import annotations

import pytest
import torch

from asyncvec.agents import grpo, rloo
from asyncvec.inference import HFTextPolicy, build_tiny_lm
from asyncvec.lm import load_causal_lm
from asyncvec.runs import CheckpointError, load_checkpoint

SHORT = {"progress": False, "eval_prompts": 0, "mode": "sync", "prompts_per_update": 2, "group_size": 2}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("tiny"), n_layer=1, n_embd=32, seed=0)


@pytest.fixture
def weight_loads(monkeypatch):
    """The versions the HF policy loads weights as, in order (the real load happens too)."""
    loads: list[int] = []
    load_weights = HFTextPolicy.load_weights

    def counted(self, weights, version):
        loads.append(version)
        return load_weights(self, weights, version)

    monkeypatch.setattr(HFTextPolicy, "load_weights", counted)
    return loads


def _parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_resume_keeps_the_warm_started_kl_reference_and_publishes_once(tiny_dir, tmp_path, weight_loads):
    common = {**SHORT, "model": str(tiny_dir), "sft_steps": 3, "kl_coef": 0.04, "checkpoint_dir": str(tmp_path)}
    with grpo.GRPO(grpo.Args(**common, total_prompts=6)) as first:
        reference = _parameters(first.reference)
        first.train()
        version = first.versions.current_version
    base = _parameters(load_causal_lm(tiny_dir)[0])
    assert any(not torch.equal(reference[name], base[name]) for name in base), "the warm start changed nothing"
    assert load_checkpoint(tmp_path / "grpo.pt")["reference"] is not None

    weight_loads.clear()
    with grpo.GRPO(grpo.Args(**common, total_prompts=10, resume=True)) as resumed:
        # one load of the restored weights as the checkpoint's version, not one per version it had reached
        assert weight_loads == [version] and resumed.versions.current_version == version
        assert all(torch.equal(value, reference[name]) for name, value in resumed.reference.state_dict().items())
        resumed.train()
        assert resumed.prompts_done == 10
    # the resumed run's checkpoint keeps the reference for the next resume
    again = load_checkpoint(tmp_path / "grpo.pt")["reference"]
    assert all(torch.equal(again[name], reference[name]) for name in reference)


def test_a_checkpoint_without_its_warm_started_reference_is_one_clear_error(tiny_dir, tmp_path):
    common = {**SHORT, "model": str(tiny_dir), "sft_steps": 3, "checkpoint_dir": str(tmp_path)}
    with rloo.RLOO(rloo.Args(**common, kl_coef=0.0, total_prompts=2)) as first:
        first.train()
    with pytest.raises(CheckpointError, match="written without its KL reference .* pass --kl-coef 0"):
        rloo.RLOO(rloo.Args(**common, kl_coef=0.04, total_prompts=4, resume=True))


def test_a_resumed_multi_turn_run_plays_reset_seeds_the_first_run_did_not(tiny_dir, tmp_path):
    common = {
        **SHORT,
        "model": str(tiny_dir),
        "env": "asyncvec/GuessNumber-v0",
        "env_kwargs": '{"max_number": 8, "max_turns": 2, "transcript": false}',
        "num_envs": 2,
        "max_new_tokens": 4,
        "checkpoint_dir": str(tmp_path),
    }
    with rloo.RLOO(rloo.Args(**common, total_prompts=2)) as first:
        first.collector.submit(2)
        first_seeds = first.collector.pop(2, 120).seeds
    with rloo.RLOO(rloo.Args(**common, total_prompts=4)) as first:
        first.train()
    with rloo.RLOO(rloo.Args(**common, total_prompts=6, resume=True)) as resumed:
        resumed.collector.submit(2)
        resumed_seeds = resumed.collector.pop(2, 120).seeds
    assert len(set(first_seeds)) == 2
    # the first run played groups 0 to 3; the resumed one starts at group 4
    assert sorted(resumed_seeds) == [seed + 4 for seed in sorted(first_seeds)]
