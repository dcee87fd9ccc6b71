"""In-flight weight updates (`HFTextPolicy(inflight_updates=True)`): `load_weights` lands between
two decoding steps of a running batch, every token records the version that sampled it, and its
log-prob is the teacher-forced log-prob of that version's weights on the full prefix.

The swaps are driven deterministically: a forward hook on the policy's model, at chosen decoding
steps, starts `load_weights` on another thread and waits until it is queued (``updates_waiting``);
the swap then happens right after that step, before the next one.
"""

import threading
import time

import gymnasium as gym
import pytest
import torch
from test_inference_policy import no_leftover_threads  # noqa: F401  (autouse fixture)

from asyncvec.inference import HFTextPolicy, TorchPolicy, build_tiny_lm
from asyncvec.testing.checks import LOGP_TOLERANCE, VersionedReference, weight_sync_check

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["3+4=", "12+30=", "1+1=", "Hello, world! 7+2="]  # different lengths: left padding
NEW_TOKENS = 56
SWAP_AFTER_STEPS = (8, 20, 32)  # decoding steps (model calls) after which versions 1, 2, 3 land


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model_dir(request, tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp(request.param), arch=request.param, n_layer=2, n_embd=32, seed=0)


def perturbed(model, seed, scale=0.05):
    """The model's parameters plus seeded noise (a training step's worth of change); tied
    parameters appear once, under one name."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: param.detach() + scale * torch.randn(param.shape, generator=generator)
        for name, param in model.named_parameters()
    }


def new_policy(folder, **kwargs):
    """A policy whose batches wait (up to 2 s) until they hold all of `PROMPTS`: one batch, whatever the load."""
    options = {
        "action_space": gym.spaces.Text(NEW_TOKENS + 4),
        "max_new_tokens": NEW_TOKENS,
        "seed": 0,
        "max_batch_size": len(PROMPTS),
        "max_wait_ms": 2000,
    }
    return HFTextPolicy(folder, action_parser=str, **{**options, **kwargs})


class SwapAtSteps:
    """A forward hook on the policy's model (``module``, default ``policy.model``): after model
    call ``k`` in ``steps`` it starts ``policy.load_weights(*updates[i])`` on a thread and returns
    only once that call waits for the step to end, so the swap lands between call ``k`` and
    call ``k + 1``."""

    def __init__(self, policy, steps, updates, module=None):
        self.policy, self.steps, self.updates = policy, list(steps), list(updates)
        self.calls, self.threads, self.errors = 0, [], []
        self.handle = (policy.model if module is None else module).register_forward_hook(self.hook)

    def hook(self, module, args, output):
        call, self.calls = self.calls, self.calls + 1
        if call not in self.steps:
            return
        weights, version = self.updates[self.steps.index(call)]
        waiting = self.policy.updates_waiting
        thread = threading.Thread(target=self.load, args=(weights, version), daemon=True)
        thread.start()
        self.threads.append(thread)
        deadline = time.monotonic() + 60
        while self.policy.updates_waiting <= waiting and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)

    def load(self, weights, version):
        try:
            self.policy.load_weights(weights, version)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def finish(self):
        self.handle.remove()
        for thread in self.threads:
            thread.join(60)
        assert not self.errors, self.errors
        assert not any(thread.is_alive() for thread in self.threads)


def test_three_updates_land_mid_generation_and_every_token_matches_its_version(model_dir):
    reference = VersionedReference(model_dir)
    updates = []
    for version in (1, 2, 3):
        weights = perturbed(reference.models[0], seed=version)
        reference.add(version, weights)
        updates.append((weights, version))
    with new_policy(model_dir, inflight_updates=True) as policy:
        swaps = SwapAtSteps(policy, SWAP_AFTER_STEPS, updates)
        outputs = [future.result(timeout=120) for future in [policy.submit(prompt) for prompt in PROMPTS]]
        swaps.finish()
        stats = policy.stats()
        assert policy.policy_version == 3
        # an update with no batch running applies at once; the next answer has one version
        later = perturbed(reference.models[0], seed=4)
        reference.add(4, later)
        policy.load_weights(later, 4)
        after = policy.submit(PROMPTS[0]).result(timeout=120)

    for output in outputs:
        assert len(output.token_versions) == len(output.token_ids) == len(output.token_logps)
        assert output.policy_version == output.token_versions[0] == 0  # the oldest token
        assert list(output.token_versions) == sorted(output.token_versions)
    longest = max(outputs, key=lambda output: len(output.token_ids))
    assert len(longest.token_ids) > SWAP_AFTER_STEPS[-1] + 1, "the batch ended before the last swap"
    # the swap queued during call k lands before call k + 1: token k + 1 is the first of the new version
    assert [longest.token_versions.index(v) for v in (1, 2, 3)] == [k + 1 for k in SWAP_AFTER_STEPS]
    assert stats["inflight_swaps"] == 3 and stats["answered"] == len(PROMPTS)
    assert after.policy_version == 4 and set(after.token_versions) == {4}

    errors = [reference.error(prompt, output) for prompt, output in zip(PROMPTS, outputs, strict=True)]
    errors.append(reference.error(PROMPTS[0], after))
    print(f"max |logp - teacher-forced logp at the claimed version| = {max(errors):.2e}")
    assert max(errors) <= LOGP_TOLERANCE
    # the check is sharp: the same tokens all claimed at the start version do not match
    single = reference.logp_error(PROMPTS[3], longest_ids(outputs), longest.token_logps, 0)
    assert single > 100 * LOGP_TOLERANCE


def test_an_update_that_reaches_two_running_batches_counts_as_one_inflight_swap(model_dir):
    """``inflight_swaps`` counts updates that landed while generation ran (the meaning every backend
    shares), not the batches they reached."""
    reference = VersionedReference(model_dir)
    weights = perturbed(reference.models[0], seed=1)
    reference.add(1, weights)
    with new_policy(model_dir, inflight_updates=True, max_batch_size=2, max_inflight_batches=2) as policy:
        swaps = SwapAtSteps(policy, [8], [(weights, 1)])
        outputs = [future.result(timeout=120) for future in [policy.submit(prompt) for prompt in PROMPTS]]
        swaps.finish()
        stats = policy.stats()
    assert stats["batches"] == 2
    assert all(output.policy_version == 0 for output in outputs)
    # both batches (two prompts each) reached: a completion that ended before the swap keeps one version
    assert any(1 in output.token_versions for output in outputs[:2]), [o.token_versions for o in outputs]
    assert any(1 in output.token_versions for output in outputs[2:]), [o.token_versions for o in outputs]
    assert stats["inflight_swaps"] == 1
    assert max(reference.error(p, o) for p, o in zip(PROMPTS, outputs, strict=True)) <= LOGP_TOLERANCE


def test_inflight_log_probs_follow_temperature_and_top_p(model_dir):
    reference = VersionedReference(model_dir)
    weights = perturbed(reference.models[0], seed=1)
    reference.add(1, weights)
    sampling = {"temperature": 0.7, "top_p": 0.9}
    with new_policy(model_dir, inflight_updates=True, max_new_tokens=24, **sampling) as policy:
        swaps = SwapAtSteps(policy, [4], [(weights, 1)])
        outputs = [future.result(timeout=120) for future in [policy.submit(prompt) for prompt in PROMPTS]]
        swaps.finish()
    longest = max(outputs, key=lambda output: len(output.token_ids))
    assert longest.token_versions.index(1) == 5
    worst = max(reference.error(p, o, **sampling) for p, o in zip(PROMPTS, outputs, strict=True))
    assert worst <= LOGP_TOLERANCE


def longest_ids(outputs):
    return max(outputs, key=lambda output: len(output.token_ids)).token_ids


def test_without_inflight_updates_a_completion_keeps_one_version(model_dir):
    reference = VersionedReference(model_dir)
    weights = perturbed(reference.models[0], seed=1)
    reference.add(1, weights)
    with new_policy(model_dir) as policy:
        assert policy.inflight_updates is False
        swaps = SwapAtSteps(policy, [SWAP_AFTER_STEPS[0]], [(weights, 1)])
        outputs = [future.result(timeout=120) for future in [policy.submit(prompt) for prompt in PROMPTS]]
        swaps.finish()  # the update waited for the batch, then applied
        after = policy.submit(PROMPTS[0]).result(timeout=120)
        stats = policy.stats()
    assert max(len(output.token_ids) for output in outputs) > SWAP_AFTER_STEPS[0] + 1
    assert all(output.policy_version == 0 and output.token_versions is None for output in outputs)
    assert after.policy_version == 1 and after.token_versions is None
    assert stats["inflight_swaps"] == 0
    worst = max(reference.error(prompt, output) for prompt, output in zip(PROMPTS, outputs, strict=True))
    assert max(worst, reference.error(PROMPTS[0], after)) <= LOGP_TOLERANCE


def test_inflight_updates_under_load_never_claim_other_weights(model_dir):
    reference = VersionedReference(model_dir)
    publish = {version: perturbed(reference.models[0], seed=version) for version in (1, 2, 3)}
    for version, weights in publish.items():
        reference.add(version, weights)
    with new_policy(model_dir, inflight_updates=True, max_new_tokens=12) as policy:
        report = weight_sync_check(policy, reference, publish, submitters=4, answers_between=4, timeout_s=120)
    assert report.ok(), report
    assert report.versions_seen[-1] == 3


def test_inflight_updates_flag_is_checked():
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="inflight_updates=True is not supported by this backend"):
        TorchPolicy(net, gym.spaces.Discrete(2), inflight_updates=True)
    with pytest.raises(TypeError, match="inflight_updates must be a bool"):
        TorchPolicy(net, gym.spaces.Discrete(2), inflight_updates="yes")


def test_per_token_reference_check_validates_its_input(model_dir):
    reference = VersionedReference(model_dir)
    with pytest.raises(ValueError, match="token_versions has 1 entries for 2 tokens"):
        reference.logp_error("3+4=", [5, 6], [0.0, 0.0], 0, token_versions=[0])
    with pytest.raises(KeyError, match=r"no reference model for version\(s\) \[7\]"):
        reference.logp_error("3+4=", [5, 6], [0.0, 0.0], 0, token_versions=[0, 7])
