"""`asyncvec serve` as a real subprocess, driven by the official `openai` client, OpenAIPolicy and raw
HTTP: completions with log-probs, n > 1, stop, seed and token-id prompts, OpenAI error bodies,
weight updates and their guards, bad input, a port already in use, a server that is down."""

import json
import subprocess
import sys
import time

import gymnasium as gym
import httpx
import openai
import pytest
import transformers
from test_inference_policy import no_leftover_threads  # noqa: F401  (autouse fixture)

from asyncvec.cli import main as cli_main
from asyncvec.inference import (
    AsyncvecServer,
    BackendError,
    BackendRejectedError,
    OpenAIPolicy,
    build_tiny_lm,
    free_port,
)
from asyncvec.testing.checks import teacher_forced_logps

pytestmark = pytest.mark.timeout(180)

TOKEN = "test-token"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model_dir = build_tiny_lm(root / MODEL, seed=0)
    weights_dir = root / "weights"
    build_tiny_lm(weights_dir / "v1", seed=1)
    with AsyncvecServer(model_dir, model_name=MODEL, weights_dir=weights_dir, token=TOKEN) as process:
        yield {"url": process.url, "model_dir": model_dir, "weights_dir": weights_dir, "root": root}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=30)


def digit(text):
    return int(text.strip()[0])


def make_policy(server, **kwargs):
    kwargs.setdefault("action_space", gym.spaces.Discrete(10))
    kwargs.setdefault("max_new_tokens", 4)
    return OpenAIPolicy(
        server["url"], MODEL, digit, server_kind="asyncvec", update_token=TOKEN, request_timeout_s=30, **kwargs
    )


def test_completions_with_logprobs_and_a_weight_update(server):
    tokenizer = transformers.AutoTokenizer.from_pretrained(server["model_dir"])
    v1 = transformers.AutoModelForCausalLM.from_pretrained(server["weights_dir"] / "v1")
    prompts = ["3+4=", "12+30=", "9+9=", "1+2="]
    with make_policy(server, max_wait_ms=20) as policy:
        start = policy.server_version()
        policy.load_weights("v1", start + 1)  # relative to the server's --weights-dir
        assert policy.policy_version == start + 1 and policy.server_version() == start + 1
        outputs = policy.act(prompts, timeout=60)
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.policy_version == start + 1
            assert out.token_ids and len(out.token_ids) == len(out.token_logps) <= 4
            expected = teacher_forced_logps(v1, tokenizer, prompt, out.token_ids)
            assert out.token_logps == pytest.approx(expected, abs=1e-4)
            assert out.behavior_logp == pytest.approx(sum(out.token_logps))
            assert out.fallback == (not out.text.strip() or not out.text.strip()[0].isdigit())
            assert out.fallback or out.action == int(out.text.strip()[0])
        assert policy.stats()["answered"] == 4 and policy.stats()["http_requests"] == policy.stats()["batches"]
    metrics = httpx.get(server["url"] + "/metrics", timeout=10).text
    assert "asyncvec_requests " in metrics and f"asyncvec_policy_version {start + 1}.0" in metrics


def test_weight_updates_are_guarded(server, tmp_path):
    outside = build_tiny_lm(tmp_path / "outside", n_layer=1, n_embd=32)
    with make_policy(server) as policy:
        current = policy.server_version()
        with pytest.raises(PermissionError, match="403.*outside --weights-dir"):
            policy.load_weights(outside, current + 1)
        with pytest.raises(PermissionError, match="403.*outside --weights-dir"):
            policy.load_weights("../weights/../../", current + 1)
        with pytest.raises(TypeError, match="pass a checkpoint folder the server can read, or create the policy"):
            policy.load_weights({"w": 1}, current + 1)
    with OpenAIPolicy(
        server["url"], MODEL, digit, action_space=gym.spaces.Discrete(10), update_token="wrong"
    ) as policy:
        with pytest.raises(PermissionError, match="401.*bearer token"):
            policy.load_weights("v1", current + 1)
    update = server["url"] + "/update_weights"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(update, json={"path": "v1", "version": current}, headers=auth, timeout=10).status_code == 409
    assert (
        httpx.post(update, json={"path": "nope", "version": current + 1}, headers=auth, timeout=10).status_code == 404
    )
    assert httpx.post(update, json={"path": "v1"}, headers=auth, timeout=10).status_code == 400
    assert httpx.get(server["url"] + "/version", timeout=10).json() == {
        "server": "asyncvec",
        "model": MODEL,
        "version": current,
    }


@pytest.mark.parametrize(
    "body, status, message, param",
    [
        (b'{"model": "tiny", "prompt": ', 400, "not valid JSON", None),
        (b'["a", "b"]', 400, "valid dictionary", None),
        (b'{"model": "tiny"}', 400, "prompt: Field required", "prompt"),
        (b'{"model": "tiny", "prompt": ""}', 400, "prompts must be non-empty", "prompt"),
        (b'{"model": "tiny", "prompt": "1+1=", "max_tokens": 0}', 400, "max_tokens", "max_tokens"),
        (b'{"model": "tiny", "prompt": "1+1=", "n": 65}', 400, "n: Input should be less than or equal to 64", "n"),
        (b'{"model": "tiny", "prompt": "1+1=", "echo": true}', 400, "not supported", "echo"),
        (b'{"model": "tiny", "prompt": "1+1=", "bogus": 1}', 400, "bogus: Extra inputs are not permitted", "bogus"),
        (b'{"model": "tiny", "prompt": "1+1=", "stop": ["a","b","c","d","e"]}', 400, "at most 4", "stop"),
        (b'{"model": "tiny", "prompt": "1+1=", "max_tokens": 100000}', 400, "max_tokens must be <= 256", "max_tokens"),
        (b'{"model": "other", "prompt": "1+1="}', 404, "not served here", "model"),
        (b'{"model": "tiny", "prompt": [5, 1000]}', 400, "token ids must be in [0, 92)", "prompt"),
        ('{"model": "tiny", "prompt": "%s"}' % ("1+" * 70), 400, "exceeds the model's context of 128 tokens", "prompt"),
    ],
)
def test_bad_requests_get_openai_error_bodies(server, body, status, message, param):
    response = httpx.post(
        server["url"] + "/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=10
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"] and error["param"] == param
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert httpx.get(server["url"] + "/health", timeout=10).status_code == 200


def test_the_openai_client_sees_n_stop_seed_token_prompts_models_and_errors(server, client):
    completion = client.completions.create(model=MODEL, prompt=["3+4=", "5+5="], n=3, max_tokens=4, logprobs=0, seed=5)
    assert [choice.index for choice in completion.choices] == list(range(6))
    assert len({choice.text for choice in completion.choices[:3]}) > 1  # n samples of one prompt
    again = client.completions.create(model=MODEL, prompt=["3+4=", "5+5="], n=3, max_tokens=4, logprobs=0, seed=5)
    assert [c.text for c in again.choices] == [c.text for c in completion.choices]  # seeded
    tokenizer = transformers.AutoTokenizer.from_pretrained(server["model_dir"])
    by_ids = client.completions.create(model=MODEL, prompt=tokenizer("3+4=").input_ids, max_tokens=4, seed=5)
    by_text = client.completions.create(model=MODEL, prompt="3+4=", max_tokens=4, seed=5)
    assert by_ids.choices[0].text == by_text.choices[0].text
    unstopped = client.completions.create(model=MODEL, prompt="3+4=", max_tokens=8, seed=9, temperature=0)
    stop = unstopped.choices[0].text[2:4]
    stopped = client.completions.create(model=MODEL, prompt="3+4=", max_tokens=8, seed=9, temperature=0, stop=[stop])
    assert stopped.choices[0].text == unstopped.choices[0].text.split(stop)[0]
    assert stopped.choices[0].finish_reason == "stop"
    assert client.models.retrieve(MODEL).id == MODEL
    assert [model.id for model in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError, match="model 'other' is not served here"):
        client.models.retrieve("other")
    with pytest.raises(openai.BadRequestError, match="max_tokens: Input should be greater than or equal to 1") as info:
        client.completions.create(model=MODEL, prompt="3+4=", max_tokens=0)
    assert info.value.param == "max_tokens" and info.value.type == "invalid_request_error"


def test_raw_completion_response_shape(server):
    body = {"model": MODEL, "prompt": ["3+4=", "5+5="], "max_tokens": 3, "logprobs": 2, "temperature": 0}
    data = httpx.post(server["url"] + "/v1/completions", json=body, timeout=30).json()
    assert data["object"] == "text_completion" and len(data["choices"]) == 2
    for choice in data["choices"]:
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"])
        assert "".join(logprobs["tokens"]) == choice["text"] or choice["finish_reason"] == "stop"
        assert choice["finish_reason"] in ("stop", "length")
        for logp, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
            assert len(top) == 2 and max(top.values()) == pytest.approx(logp)  # greedy: the top token
    assert data["usage"]["prompt_tokens"] == 8


def test_a_streamed_completion_sends_each_token_then_the_whole_choice(server, client):
    """``"stream": true``: one event per sampled token (id, log-prob, version), then each choice
    whole; the tokens streamed start the choice (a stop string may cut the last ones)."""
    body = {"model": MODEL, "prompt": ["3+4=", "5+5="], "n": 2, "max_tokens": 6, "logprobs": 0,
            "return_tokens_as_token_ids": True, "stream": True}  # fmt: skip
    streamed, finals = {}, {}
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        (choice,) = json.loads(line[len("data:") :])["choices"]
        if "completion" in choice:
            finals[choice["index"]] = choice["completion"]
            continue
        assert choice["finish_reason"] is None and choice["policy_version"] >= 0
        tokens, logps = choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
        streamed.setdefault(choice["index"], []).extend(zip(tokens, logps, strict=True))
    assert sorted(finals) == sorted(streamed) == [0, 1, 2, 3]
    for index, final in finals.items():
        whole = list(zip(final["logprobs"]["tokens"], final["logprobs"]["token_logprobs"], strict=True))
        assert whole and streamed[index][: len(whole)] == whole
    # the openai client reads the stream too; a seeded stream (through the batcher) samples what the seeded request does
    chunks = list(client.completions.create(model=MODEL, prompt="3+4=", max_tokens=4, stream=True, seed=3))
    assert chunks and all(len(chunk.choices) == 1 for chunk in chunks)
    seeded = client.completions.create(model=MODEL, prompt="3+4=", max_tokens=4, seed=3)
    assert chunks[-1].choices[0].model_extra["completion"]["text"] == seeded.choices[0].text
    assert "".join(chunk.choices[0].text for chunk in chunks) == seeded.choices[0].text


def test_server_down_gives_an_error_not_a_hang():
    with OpenAIPolicy(
        f"http://127.0.0.1:{free_port()}",
        MODEL,
        digit,
        action_space=gym.spaces.Discrete(10),
        max_attempts=2,
        retry_backoff_ms=10,
    ) as policy:
        started = time.monotonic()
        error = policy.submit("3+4=").exception(timeout=30)
        assert isinstance(error, BackendError) and "cannot reach" in str(error) and "after 2 attempt(s)" in str(error)
        assert time.monotonic() - started < 10
        assert policy.stats()["retries"] == 1
        with pytest.raises(Exception, match="cannot reach"):
            policy.load_weights("v1", 1)


def test_deadline_fallback_over_http(server):
    with make_policy(server, deadline_ms=1, max_wait_ms=0) as policy:
        out = policy.submit("3+4=", env_id=0).result(timeout=30)
        assert out.fallback and out.action == 0 and out.text is None


def test_cli_validates_its_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", "--model", str(tmp_path / "missing"), "--port", "8000"])
    assert exit_info.value.code == 2 and "is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["serve", "--model", str(tmp_path), "--port", "70000"])
    assert "port must be in 0..65535" in capsys.readouterr().err
    assert cli_main(["wait-ready", f"http://127.0.0.1:{free_port()}", "--timeout", "0.5"]) == 1
    assert "did not answer 200 within 0.5 s" in capsys.readouterr().err


def test_a_port_in_use_is_reported_before_the_model_loads(server):
    port = int(server["url"].rsplit(":", 1)[1])
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "asyncvec.cli", "serve", "--model", str(server["model_dir"]), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "loading the model" not in result.stderr
    print(f"port-in-use reported after {time.monotonic() - started:.1f} s")
    assert cli_main(["wait-ready", server["url"], "--timeout", "30"]) == 0


def test_weight_sync_uses_the_same_client_path_as_vllm(server, tmp_path):
    # a state dict goes through OpenAIPolicy's checkpoint writer, like for vLLM, into --weights-dir
    weights = transformers.AutoModelForCausalLM.from_pretrained(server["weights_dir"] / "v1").state_dict()
    with make_policy(server, checkpoint_dir=server["weights_dir"] / "written", model_dir=server["model_dir"]) as policy:
        version = policy.server_version() + 1
        policy.load_weights(weights, version)
        assert policy.server_version() == version
        assert httpx.get(server["url"] + "/weight_info", timeout=10).json() == {"weight_version": str(version)}
        out = policy.submit("3+4=").result(timeout=30)
        assert out.policy_version == version
        with (
            make_policy(server) as stale,
            pytest.raises(ValueError, match=f"server's current weight version {version}"),
        ):
            stale.load_weights("v1", 1)
    with OpenAIPolicy(server["url"], MODEL, digit, server_kind="vllm", action_space=gym.spaces.Discrete(10)) as wrong:
        with pytest.raises(BackendRejectedError, match="is not a server of kind 'vllm'"):
            wrong.load_weights(weights, 99)
