"""`asyncvec serve` as a real subprocess, driven by OpenAIPolicy and raw HTTP: completions with
log-probs, weight updates and their guards, bad input, a server that is down."""

import os
import socket
import subprocess
import sys
import time

import gymnasium as gym
import httpx
import pytest
import transformers
from test_inference_policy import no_leftover_threads  # noqa: F401  (autouse fixture)
from test_inference_text import teacher_forced_logps

from asyncvec.cli import main as cli_main
from asyncvec.inference import BackendError, OpenAIPolicy, build_tiny_lm

pytestmark = pytest.mark.timeout(180)

TOKEN = "test-token"
MODEL = "tiny"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model_dir = build_tiny_lm(root / MODEL, seed=0)
    weights_dir = root / "weights"
    build_tiny_lm(weights_dir / "v1", seed=1)
    port = free_port()
    log = open(root / "server.log", "w+")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncvec.cli",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--weights-dir",
            str(weights_dir),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "ASYNCVEC_SERVE_TOKEN": TOKEN},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, f"server exited: {(root / 'server.log').read_text()}"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server not healthy after 120 s"
            time.sleep(0.2)
        yield {"url": url, "model_dir": model_dir, "weights_dir": weights_dir, "root": root}
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        log.close()


def digit(text):
    return int(text.strip()[0])


def make_policy(server, **kwargs):
    kwargs.setdefault("action_space", gym.spaces.Discrete(10))
    kwargs.setdefault("max_new_tokens", 4)
    return OpenAIPolicy(server["url"], MODEL, digit, update_token=TOKEN, request_timeout_s=30, **kwargs)


def test_completions_with_logprobs_and_a_weight_update(server):
    tokenizer = transformers.AutoTokenizer.from_pretrained(server["model_dir"])
    models = {
        0: transformers.AutoModelForCausalLM.from_pretrained(server["model_dir"]),
        1: transformers.AutoModelForCausalLM.from_pretrained(server["weights_dir"] / "v1"),
    }
    prompts = ["3+4=", "12+30=", "9+9=", "1+2="]
    with make_policy(server, max_wait_ms=20) as policy:
        for version in (0, 1):
            if version:
                policy.load_weights("v1", 1)  # relative to the server's --weights-dir
                assert policy.policy_version == 1 and policy.server_version() == 1
            outputs = policy.act(prompts, timeout=60)
            for prompt, out in zip(prompts, outputs, strict=True):
                assert out.policy_version == version
                assert out.token_ids and len(out.token_ids) == len(out.token_logps) <= 4
                expected = teacher_forced_logps(models[version], tokenizer, prompt, out.token_ids)
                assert out.token_logps == pytest.approx(expected, abs=1e-4)
                assert out.behavior_logp == pytest.approx(sum(out.token_logps))
                assert out.fallback == (not out.text.strip() or not out.text.strip()[0].isdigit())
                assert out.fallback or out.action == int(out.text.strip()[0])
        assert policy.stats()["answered"] == 8
    metrics = httpx.get(server["url"] + "/metrics", timeout=10).text
    assert "asyncvec_requests " in metrics and "asyncvec_policy_version 1.0" in metrics


def test_weight_updates_are_guarded(server, tmp_path):
    outside = build_tiny_lm(tmp_path / "outside", n_layer=1, n_embd=32)
    with make_policy(server) as policy:
        current = policy.server_version()
        with pytest.raises(PermissionError, match="403.*outside --weights-dir"):
            policy.load_weights(outside, current + 1)
        with pytest.raises(PermissionError, match="403.*outside --weights-dir"):
            policy.load_weights("../weights/../../", current + 1)
        with pytest.raises(TypeError, match="takes a checkpoint folder path"):
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
    assert httpx.post(update, json={"path": "v1"}, headers=auth, timeout=10).status_code == 422
    assert httpx.get(server["url"] + "/version", timeout=10).json() == {
        "server": "asyncvec",
        "model": MODEL,
        "version": current,
    }


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b'{"model": "tiny", "prompt": ', 422, "not valid JSON"),
        (b'["a", "b"]', 422, "valid dictionary"),
        (b'{"model": "tiny"}', 422, "prompt: Field required"),
        (b'{"model": "tiny", "prompt": ""}', 422, "prompts must be non-empty"),
        (b'{"model": "tiny", "prompt": "1+1=", "max_tokens": 0}', 422, "max_tokens"),
        (b'{"model": "tiny", "prompt": "1+1=", "n": 2}', 422, "n: Input should be less than or equal to 1"),
        (b'{"model": "tiny", "prompt": "1+1=", "stream": true}', 422, "not supported"),
        (b'{"model": "tiny", "prompt": "1+1=", "bogus": 1}', 422, "bogus: Extra inputs are not permitted"),
        (b'{"model": "tiny", "prompt": "1+1=", "max_tokens": 100000}', 400, "max_tokens must be <= 256"),
        (b'{"model": "other", "prompt": "1+1="}', 404, "not served here"),
        ('{"model": "tiny", "prompt": "%s"}' % ("1+" * 70), 400, "exceeds the model's 128 positions"),
    ],
)
def test_bad_requests_get_readable_4xx(server, body, status, message):
    response = httpx.post(
        server["url"] + "/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=10
    )
    assert response.status_code == status, response.text
    assert message in response.json()["detail"]
    assert httpx.get(server["url"] + "/health", timeout=10).status_code == 200


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
    assert "port must be in 1..65535" in capsys.readouterr().err
