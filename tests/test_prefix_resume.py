"""A completion whose engine fails mid-generation is continued from the tokens it had, never sampled
again: in process (`HFTextPolicy`, a failure injected into its model's forward pass) and through a
real ``asyncvec serve`` child process killed (SIGKILL) while it streams. The prefix keeps its
log-probs and versions, the continuation's tokens carry the version that sampled them, and every
token matches the teacher-forced log-prob of its own version (1e-4)."""

import threading

import pytest
from test_inference_policy import no_leftover_threads  # noqa: F401  (autouse fixture)
from test_supervisor import crash, wait_until

from asyncvec.inference import (
    AsyncvecServer,
    EngineSupervisor,
    GeneratedPrefix,
    HFTextPolicy,
    OpenAIPolicy,
    TextPrompt,
    build_tiny_lm,
    write_checkpoint,
)
from asyncvec.inference.text import join_prefixes
from asyncvec.testing.checks import LOGP_TOLERANCE, PROMPTS, VersionedReference

pytestmark = pytest.mark.timeout(240)

NEW_TOKENS = 12
FAIL_AT = 6  # the model call that fails: 5 tokens sampled before it


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = build_tiny_lm(tmp_path_factory.mktemp("resume") / "tiny", n_layer=1, n_embd=32, seed=0)
    return VersionedReference(folder)


class FailingForward:
    """Makes the model's ``fail_at``-th forward pass raise (an engine dying mid-batch); ``before_failing``
    runs just before. Counts every forward pass, so regenerated tokens show up as extra passes."""

    def __init__(self, model, fail_at, before_failing=None, failures=1):
        self.model, self.real = model, model.forward
        self.fail_at, self.before_failing, self.failures = fail_at, before_failing, failures
        self.calls = 0
        model.forward = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.fail_at <= self.calls < self.fail_at + self.failures:
            if self.before_failing is not None:
                self.before_failing()
            raise RuntimeError("the engine died")
        return self.real(*args, **kwargs)


def make_policy(reference, **kwargs):
    """The counts below assume one batch per `act`: it leaves once every prompt is in (a batch of
    all of them, or 1 s; with the default 5 ms a loaded machine once split it, and 1 prompt of 4
    was in the batch that failed)."""
    kwargs.setdefault("max_new_tokens", NEW_TOKENS)
    kwargs.setdefault("max_batch_size", len(PROMPTS))
    kwargs.setdefault("max_wait_ms", 1000)
    return HFTextPolicy(
        reference.model_dir, action_parser=str, fallback=lambda obs, env_id: "", seed=0, retry_backoff_ms=0, **kwargs
    )


def publish_when_the_batch_fails(policy, reference, version):
    """A `load_weights(version)` that waits for the failing attempt and lands before the retry."""
    weights = reference.weights(version)

    def start():
        threading.Thread(target=policy.load_weights, args=(weights, version), daemon=True).start()
        wait_until(lambda: policy.updates_waiting == 1)

    return start


def test_the_retry_continues_each_completion_under_the_new_version(reference):
    with make_policy(reference) as policy:
        injected = FailingForward(policy.model, FAIL_AT, publish_when_the_batch_fails(policy, reference, 1))
        outputs = policy.act(list(PROMPTS), timeout=120)
        stats = policy.stats()
    prefix = FAIL_AT - 1
    for output in outputs:
        assert output.token_versions[:prefix] == (0,) * prefix  # the prefix keeps the version that sampled it
        assert set(output.token_versions[prefix:]) == {1}  # the continuation has the version that sampled it
        assert output.policy_version == 0 and len(output.token_ids) == len(output.token_logps)
    error = reference.max_logp_error(list(PROMPTS), outputs)
    print(f"in-process resume: max |logp - teacher-forced at each token's version| = {error:.2e}")
    assert error <= LOGP_TOLERANCE
    assert stats["resumed_requests"] == len(PROMPTS) and stats["resumed_tokens"] == prefix * len(PROMPTS)
    assert stats["regenerated_tokens"] == 0 and stats["retries"] == 1
    longest = max(len(output.token_ids) for output in outputs)
    assert injected.calls == longest + 1  # one pass per token sampled, plus the one that failed: nothing again


def test_without_resume_the_prefix_is_sampled_again_and_counted(reference):
    with make_policy(reference, resume_from_prefix=False) as policy:
        injected = FailingForward(policy.model, FAIL_AT)
        outputs = policy.act(list(PROMPTS), timeout=120)
        stats = policy.stats()
    assert stats["regenerated_tokens"] == (FAIL_AT - 1) * len(PROMPTS) and stats["resumed_tokens"] == 0
    assert injected.calls == FAIL_AT + max(len(output.token_ids) for output in outputs)
    assert all(output.token_versions is None and output.policy_version == 0 for output in outputs)


def test_completions_that_ended_before_the_failure_are_delivered_as_they_were(reference):
    # two sampling groups: the short one is done when the long one's engine dies
    prompts = [TextPrompt(prompt, max_new_tokens=3) for prompt in PROMPTS[:2]] + list(PROMPTS[2:])
    with make_policy(reference) as policy:
        injected = FailingForward(policy.model, 3 + FAIL_AT)  # the short group's 3 passes, then the long one's
        outputs = policy.act(prompts, timeout=120)
        stats = policy.stats()
    assert [len(output.token_ids) for output in outputs[:2]] == [3, 3]
    assert stats["resumed_requests"] == len(prompts) and stats["regenerated_tokens"] == 0
    assert injected.calls == 3 + max(len(output.token_ids) for output in outputs[2:]) + 1
    for prompt, output in zip(prompts, outputs, strict=True):
        text = prompt if isinstance(prompt, str) else prompt.prompt
        assert reference.error(text, output) <= LOGP_TOLERANCE


def test_without_a_retry_the_finished_completions_are_delivered_and_the_rest_flagged(reference):
    prompts = [TextPrompt(prompt, max_new_tokens=3) for prompt in PROMPTS[:2]] + list(PROMPTS[2:])
    with make_policy(reference, max_attempts=1, fallback_on_error=True) as policy:
        FailingForward(policy.model, 3 + FAIL_AT)
        outputs = policy.act(prompts, timeout=120)
        stats = policy.stats()
    assert [len(output.token_ids) for output in outputs[:2]] == [3, 3] and not any(o.fallback for o in outputs[:2])
    assert all(output.fallback and output.token_ids is None for output in outputs[2:])
    assert stats["error_fallbacks"] == 2 and stats["late_dropped"] == 0 and stats["answered"] == len(prompts)


def test_a_request_that_keeps_failing_gets_the_flagged_fallback_not_its_prefix(reference):
    with make_policy(reference, max_attempts=2, fallback_on_error=True) as policy:
        FailingForward(policy.model, FAIL_AT, failures=100)
        outputs = policy.act(list(PROMPTS[:2]), timeout=120)
    assert all(output.fallback and output.text is None and output.token_ids is None for output in outputs)
    assert all(output.behavior_logp == 0.0 for output in outputs)


def test_prefixes_join_and_refuse_mismatched_fields(reference):
    first = GeneratedPrefix((1, 2), (-0.1, -0.2), (3, 3), "ab")
    joined = join_prefixes(first, GeneratedPrefix((4,), (-0.4,), (5,), "c", finished=True))
    assert joined == GeneratedPrefix((1, 2, 4), (-0.1, -0.2, -0.4), (3, 3, 5), "abc", None, True)
    with pytest.raises(ValueError, match=r"token_logps \(1\) and token_versions \(2\) must have one entry per token"):
        GeneratedPrefix((1, 2), (-0.1,), (3, 3))
    with pytest.raises(TypeError, match="resume_from_prefix must be a bool, got str"):
        HFTextPolicy(reference.model_dir, action_parser=str, resume_from_prefix="yes")


# ------------------------------------------------------------------------- asyncvec serve, killed
def test_asyncvec_serve_killed_mid_stream_is_continued_from_each_prefix(reference, tmp_path):
    model_dir = reference.model_dir
    weights_dir = tmp_path / "weights"
    write_checkpoint(reference.weights(1), weights_dir / "v1", config_from=model_dir)
    prompts = [prompt for prompt in PROMPTS for _ in range(2)]
    with AsyncvecServer(model_dir, model_name="tiny", weights_dir=weights_dir) as server:
        supervisor = EngineSupervisor(server)
        with OpenAIPolicy(
            server.url, "tiny", str, server_kind="asyncvec", fallback=lambda obs, env_id: "", max_new_tokens=100,
            request_timeout_s=120, model_dir=model_dir, supervisor=supervisor, max_batch_size=16, max_wait_ms=50,
        ) as policy:  # fmt: skip
            assert policy.streams
            policy.load_weights("v1", 1)
            futures = [policy.submit(prompt) for prompt in prompts]
            wait_until(lambda: policy.stats()["streamed_tokens"] >= len(prompts), timeout=120)
            old_pid = crash(server)
            outputs = [future.result(timeout=180) for future in futures]
            stats = policy.stats()
        assert server.running and server.process.pid != old_pid
    assert stats["engine_restarts"] == 1 and stats["failed_requests"] == 0
    assert stats["resumed_tokens"] >= len(prompts) and stats["regenerated_tokens"] == 0
    assert all(output.policy_version == 1 and not output.fallback and output.token_ids for output in outputs)
    error = reference.max_logp_error(prompts, outputs)
    print(
        f"asyncvec serve killed mid-stream: {stats['resumed_tokens']} prefix tokens kept over "
        f"{stats['resumed_requests']} completions, {stats['regenerated_tokens']} sampled again; "
        f"max |logp - teacher-forced| = {error:.2e}"
    )
    assert error <= LOGP_TOLERANCE


def test_a_prefix_that_ended_in_its_end_token_is_delivered_not_continued(reference):
    """A completion that sampled its end-of-sequence token before its stream broke off (its last event not yet
    sent) came back from the resume with up to 95 more tokens after the end; it is finished as it is."""
    from concurrent.futures import Future

    from asyncvec.inference.requests import Request
    from asyncvec.inference.types import PartialBatchError

    with make_policy(reference) as policy:
        eos = policy.tokenizer.eos_token_id
        prompt = TextPrompt("3+4=", max_new_tokens=NEW_TOKENS)
        ended = Request(prompt, prompt, None, 0.0, Future())
        going = Request(prompt, prompt, None, 0.0, Future())
        cut = PartialBatchError(
            "the stream broke off",
            [GeneratedPrefix((7, eos), (-1.0, -2.0), (0, 0)), GeneratedPrefix((7, 8), (-1.0, -2.0), (0, 0))],
        )
        ready = policy._keep_partial([ended, going], cut)
    assert [request for request, _ in ready] == [ended] and ended.prefix.finished
    assert list(ready[0][1].token_ids) == [7, eos]
    assert going.prefix is not None and not going.prefix.finished  # continued from its prefix by the retry


def test_asyncvec_serve_ends_each_completion_as_soon_as_it_is_done(reference):
    """Each choice's last event (finish_reason and the whole choice) is streamed when that choice is done, not
    once every choice of the request is: a client cut off mid-stream knows which completions had ended."""
    import json

    import httpx

    with AsyncvecServer(reference.model_dir, model_name="tiny", extra_args=["--max-batch-size", "1"]) as server:
        body = {"model": "tiny", "prompt": ["3+4=", "1+1="], "max_tokens": 6, "stream": True, "logprobs": 0, "seed": 0}
        events = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[len("data: ") :])["choices"][0]
                    events.append((choice["index"], "completion" in choice))
    first_final = events.index((0, True))
    later_tokens = [k for k, (index, final) in enumerate(events) if index == 1 and not final]
    # while the second choice still streams (its first token may be on its way as the first choice ends)
    assert len(later_tokens) >= 2 and first_final < later_tokens[-1], events


def test_when_the_supervisor_gives_up_the_completions_that_had_finished_are_delivered(reference):
    """The supervisor's give-up error is raised over the batch's PartialBatchError (OpenAIPolicy._forward_batch:
    recover raises inside the handler): the completions that had finished came back as fallbacks."""
    from concurrent.futures import Future

    from asyncvec.inference.requests import Request
    from asyncvec.inference.types import BackendError, PartialBatchError

    with make_policy(reference) as policy:
        prompt = TextPrompt("3+4=", max_new_tokens=NEW_TOKENS)
        done, cut_short = Request(prompt, prompt, None, 0.0, Future()), Request(prompt, prompt, None, 0.0, Future())
        try:
            try:
                raise PartialBatchError(
                    "the server died mid-stream",
                    [
                        GeneratedPrefix((7, 8), (-1.0, -2.0), (0, 0), finished=True),
                        GeneratedPrefix((7,), (-1.0,), (0,)),
                    ],
                )
            except PartialBatchError:
                raise BackendError("the supervisor gave up")  # noqa: B904  (as recover raises in _forward_batch)
        except BackendError as gave_up:
            ready = policy._keep_partial([done, cut_short], gave_up)
    assert [request for request, _ in ready] == [done] and list(ready[0][1].token_ids) == [7, 8]
