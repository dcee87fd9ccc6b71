"""`EngineSupervisor` with a real `asyncvec serve` child process: killed (SIGKILL) while a batch
is in flight, frozen (SIGSTOP), unable to restart; an RLOO run whose server is killed once.
Every request ends as an honest completion of the last published weights (teacher-forced
log-probs) or as a flagged fallback; nothing hangs, no server process is left behind."""

import os
import signal
import socket
import sys
import time

import gymnasium as gym
import httpx
import psutil
import pytest
import transformers
from test_inference_policy import no_leftover_threads  # noqa: F401  (autouse fixture)

from asyncvec.agents import rloo
from asyncvec.inference import (
    AsyncvecServer,
    BackendError,
    EngineSupervisor,
    OpenAIPolicy,
    ServerProcess,
    ServerStartError,
    TransientBackendError,
    build_tiny_lm,
)
from asyncvec.lm import training
from asyncvec.lm.prompts import completion_with_answer, make_prompt_env
from asyncvec.testing.checks import teacher_forced_logps

pytestmark = pytest.mark.timeout(240)

TOKEN = "test-token"
MODEL = "tiny"
PROMPTS = ["3+4=", "12+30=", "9+9=", "1+2=", "5+0=", "7+7="]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`asyncvec serve` holding each batch up to 1 s (so a kill lands while requests are in flight)."""
    root = tmp_path_factory.mktemp("supervised")
    model_dir = build_tiny_lm(root / MODEL, n_layer=1, n_embd=32, seed=0)
    weights_dir = root / "weights"
    build_tiny_lm(weights_dir / "v1", n_layer=1, n_embd=32, seed=1)
    process = AsyncvecServer(
        model_dir, model_name=MODEL, weights_dir=weights_dir, token=TOKEN, extra_args=["--max-wait-ms", "1000"]
    )
    with process:
        yield {"process": process, "model_dir": model_dir, "weights_dir": weights_dir}
    assert not process.running


def digit(text):
    return int(text.strip()[0])


def make_policy(server, supervisor, parser=digit, **kwargs):
    kwargs.setdefault("action_space", gym.spaces.Discrete(10))
    kwargs.setdefault("max_new_tokens", 4)
    return OpenAIPolicy(
        server["process"].url,
        MODEL,
        parser,
        server_kind="asyncvec",
        update_token=TOKEN,
        supervisor=supervisor,
        **kwargs,
    )


def crash(process):
    """SIGKILL the server's process group from outside (as the OOM killer would); wait until it is gone."""
    popen = process.process  # the supervisor may replace it with the restarted one meanwhile
    pid = popen.pid
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while popen.poll() is None:
        assert time.monotonic() < deadline, "the killed server did not exit"
        time.sleep(0.05)
    return pid


def wait_until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def check_honest(outputs, prompts, version, model_dir, weights):
    """Each output is a completion at ``version`` whose token log-probs are those of ``weights``."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(weights)
    gap = 0.0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.text is not None and out.token_ids, out  # sampled, not a fallback for a lost request
        assert out.policy_version == version
        expected = teacher_forced_logps(model, tokenizer, prompt, out.token_ids)
        gap = max(gap, max(abs(a - b) for a, b in zip(out.token_logps, expected, strict=True)))
    assert gap <= 1e-4
    return gap


def test_a_server_killed_mid_batch_is_restarted_with_the_last_published_weights(server):
    process = server["process"]
    supervisor = EngineSupervisor(process)
    with make_policy(server, supervisor, max_wait_ms=50, request_timeout_s=60) as policy:
        version = policy.server_version() + 1
        policy.load_weights("v1", version)  # the last published weights: a restarted server must serve them
        check_honest(
            policy.act(PROMPTS, timeout=60), PROMPTS, version, server["model_dir"], server["weights_dir"] / "v1"
        )

        sent = policy.stats()["http_requests"]
        futures = [policy.submit(prompt, env_id=i) for i, prompt in enumerate(PROMPTS)]
        wait_until(lambda: policy.stats()["http_requests"] > sent and policy.stats()["queue_depth"] == 0)
        time.sleep(0.2)  # the batch is at the server, which holds it up to 1 s
        old_pid = crash(process)
        outputs = [future.result(timeout=120) for future in futures]

        # the lost batch was sent again to the restarted server, which serves the published version
        assert process.running and process.process.pid != old_pid and not psutil.pid_exists(old_pid)
        gap = check_honest(outputs, PROMPTS, version, server["model_dir"], server["weights_dir"] / "v1")
        print(f"after the restart: max |logp - teacher-forced at v{version}| = {gap:.2e}")
        stats = policy.stats()
        assert stats["engine_restarts"] == 1 and stats["engine_failures"] == 1
        assert supervisor.last_failure in ("exited", "unreachable")  # refused before the parent saw the exit
        assert stats["resubmitted_requests"] == len(PROMPTS) and stats["failed_requests"] == 0
        assert stats["error_fallbacks"] == 0 and stats["errors"] == 0
        assert httpx.get(process.url + "/weight_info", timeout=10).json()["weight_version"] == str(version)
        # the run goes on
        check_honest(
            policy.act(PROMPTS[:2], timeout=60), PROMPTS[:2], version, server["model_dir"], server["weights_dir"] / "v1"
        )


def test_requests_that_cannot_be_answered_come_back_as_flagged_fallbacks(server):
    process = server["process"]
    supervisor = EngineSupervisor(process, startup_timeout_s=60)
    with make_policy(server, supervisor, max_wait_ms=20, request_timeout_s=30) as policy:
        version = policy.server_version() + 1
        policy.load_weights("v1", version)
        crash(process)
        with socket.socket() as squatter:  # the port is taken while the server is down: it cannot restart
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind((process.host, process.port))
            squatter.listen()
            outputs = policy.act(PROMPTS, timeout=60)
        assert all(out.fallback and out.text is None and out.token_ids is None for out in outputs)
        assert all(out.behavior_logp == 0.0 and out.action == 0 for out in outputs)
        stats = policy.stats()
        assert stats["engine_restart_failures"] == 1 and stats["failed_requests"] == len(PROMPTS)
        assert stats["error_fallbacks"] == len(PROMPTS) and not process.running
        # the port is free again: the next request restarts the server, with the published weights
        outputs = policy.act(PROMPTS[:3], timeout=120)
        check_honest(outputs, PROMPTS[:3], version, server["model_dir"], server["weights_dir"] / "v1")
        assert policy.stats()["engine_restarts"] == 1 and policy.stats()["failed_requests"] == len(PROMPTS)


def test_a_hung_server_is_restarted(server):
    # SIGSTOP: the process lives, its port accepts connections, nothing answers
    process = server["process"]
    supervisor = EngineSupervisor(process, health_timeout_s=2)
    with make_policy(server, supervisor, max_wait_ms=20, request_timeout_s=5) as policy:
        version = policy.server_version() + 1
        policy.load_weights("v1", version)
        old_pid = process.process.pid
        os.killpg(old_pid, signal.SIGSTOP)
        outputs = policy.act(PROMPTS[:3], timeout=120)
        assert supervisor.last_failure == "hung" and policy.stats()["engine_restarts"] == 1
        assert process.process.pid != old_pid and not psutil.pid_exists(old_pid)
        check_honest(outputs, PROMPTS[:3], version, server["model_dir"], server["weights_dir"] / "v1")


def test_an_rloo_run_goes_on_when_its_server_is_killed(server, tmp_path, monkeypatch):
    process = server["process"]
    supervisor = EngineSupervisor(process)
    args = rloo.Args(
        model=str(server["model_dir"]),
        total_prompts=8,
        prompts_per_update=2,
        group_size=2,
        mode="async",
        progress=False,
        eval_prompts=0,
    )
    kept, received, failed_seen, from_failed = [], [], [], []
    real = training.trainable_batch  # what LMAgent.update calls

    def recording(groups, parts, options, min_group_samples):
        data = real(groups, parts, options, min_group_samples)
        samples = [s for group in groups.completions for s in group]
        failed_seen.append(sum(s.missed_deadline for s in samples))
        received.append(len(samples))
        # every row trainable_batch kept must be a sampled completion, none a failed request's stand-in
        trainable_ids = [list(s.output.token_ids) for s in samples if s.trainable]
        from_failed.append(sum(ids not in trainable_ids for ids in data.completion_ids))
        kept.append(len(data))
        return data

    monkeypatch.setattr(training, "trainable_batch", recording)
    env = make_prompt_env(args.env)
    with make_policy(
        server,
        supervisor,
        completion_with_answer,
        action_space=env.action_space,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        checkpoint_dir=server["weights_dir"],
        model_dir=server["model_dir"],
        request_timeout_s=60,
    ) as policy:
        agent = rloo.RLOO(args, policy=policy)
        update = agent.update
        pids = []

        def update_after_a_crash(groups):
            if not pids:  # the first update: generation for the next ones is in flight meanwhile
                pids.append(crash(process))
            return update(groups)

        agent.update = update_after_a_crash
        result = agent.train()
        stats = policy.stats()
    env.close()
    assert result.updates == 4 and sum(received) == 16
    assert stats["engine_restarts"] >= 1 and process.running and not psutil.pid_exists(pids[0])
    assert httpx.get(process.url + "/weight_info", timeout=10).json()["weight_version"] == str(result.final_version)
    assert sum(from_failed) == 0 and sum(kept) <= sum(received) - sum(failed_seen)
    assert sum(failed_seen) <= stats["failed_requests"]
    counts = {key: stats[key] for key in ("engine_restarts", "resubmitted_requests", "failed_requests")}
    print(
        f"supervised RLOO: {counts}; trained on {sum(kept)} of {sum(received)} samples received, "
        f"{sum(failed_seen)} of them failed requests (flagged), {sum(from_failed)} trained on from failed requests"
    )


# ---------------------------------------------------------------------------------- logic, fast
def http_server():
    return ServerProcess([sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"], health_path="/")


def test_the_supervisor_gives_up_after_max_restarts():
    with http_server() as process:
        supervisor = EngineSupervisor(process, max_restarts=1, health_timeout_s=5)
        assert supervisor.diagnose(TransientBackendError("a 503")) is None  # alive: a retry, not a restart
        generation = supervisor.generation
        crash(process)
        with pytest.raises(TransientBackendError, match="exited"):
            supervisor.check_alive()
        assert supervisor.recover(TransientBackendError("refused"), generation) and process.running
        assert supervisor.recover(TransientBackendError("refused"), generation)  # already restarted since
        crash(process)
        with pytest.raises(BackendError, match="after 1 restarts within 600 s; the supervisor gave up"):
            supervisor.recover(TransientBackendError("refused"), supervisor.generation)
        with pytest.raises(BackendError, match="gave up"):
            supervisor.check_alive()
        assert supervisor.stats() == {
            "engine_failures": 2,
            "engine_restarts": 1,
            "engine_restart_failures": 0,
            "engine_gave_up": 1,
        }
        assert not process.running


def test_a_server_waited_on_before_its_start_or_started_twice_raises_server_start_error():
    process = http_server()
    with pytest.raises(ServerStartError, match="was not started"):
        process.wait_ready()
    with process, pytest.raises(ServerStartError, match=r"is already running \(pid"):
        process.start()


def test_timeouts_in_a_row_with_a_live_health_route_count_as_hung():
    with http_server() as process:
        supervisor = EngineSupervisor(process, hung_after_timeouts=2, health_timeout_s=5)
        timeout = TransientBackendError("http://127.0.0.1:1/v1/completions: timed out after 30 s")
        assert supervisor.diagnose(timeout) is None  # one slow answer: a retry
        supervisor.request_succeeded()
        assert supervisor.diagnose(timeout) is None  # not in a row
        assert supervisor.diagnose(timeout) == "hung"
        generation = supervisor.generation
        assert supervisor.recover(timeout, generation) is True and supervisor.last_failure == "hung"
        assert supervisor.generation == generation + 1 and process.running
        assert supervisor.recover(timeout, generation + 1) is False  # restarted: the count started again


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"server": "http://127.0.0.1:8000"}, TypeError, "server must be a ServerProcess, got str"),
        ({"health_timeout_s": 0}, ValueError, "health_timeout_s must be a number > 0"),
        ({"max_restarts": 0}, ValueError, "max_restarts must be an int >= 1"),
        ({"hung_after_timeouts": 1.5}, ValueError, "hung_after_timeouts must be an int >= 1"),
        ({"startup_timeout_s": -1}, ValueError, "startup_timeout_s must be a number > 0 or None"),
    ],
)
def test_bad_supervisor_options_name_the_field(options, error, message):
    options = {"server": http_server(), **options}
    with pytest.raises(error, match=message):
        EngineSupervisor(**options)


def test_a_supervised_policy_needs_its_server_and_a_retry():
    process = http_server()
    supervisor = EngineSupervisor(process)
    space = gym.spaces.Discrete(10)
    with pytest.raises(ValueError, match="base_url 'http://127.0.0.1:9' is not the supervised server's url"):
        OpenAIPolicy("http://127.0.0.1:9", "m", int, action_space=space, supervisor=supervisor)
    with pytest.raises(ValueError, match="max_attempts must be >= 2 with a supervisor"):
        OpenAIPolicy(process.url + "/v1", "m", int, action_space=space, supervisor=supervisor, max_attempts=1)
    with pytest.raises(TypeError, match="supervisor must be an EngineSupervisor or None, got ServerProcess"):
        OpenAIPolicy(process.url, "m", int, action_space=space, supervisor=process)


# ---------------------------------------------------------------------------------- a vLLM server
@pytest.mark.slow
@pytest.mark.timeout(1200)  # three vLLM server starts: about a minute each on a loaded 2-core machine
def test_a_vllm_server_killed_mid_stream_is_restarted_and_continues_each_completion(tmp_path):
    """Killed while it streams, through /v1/completions and then through the in-flight route
    (/inference/v1/generate): the restarted server reloads the published weights and continues
    every completion from the tokens it had (none sampled again), each token honest."""
    from asyncvec.inference import VLLMServer
    from asyncvec.testing.checks import LOGP_TOLERANCE, VersionedReference

    # 400-token completions: the kill must land while they stream (with 100, a loaded machine once let
    # all of them finish between the first streamed tokens and the kill, and nothing was resumed)
    model_dir = build_tiny_lm(tmp_path / MODEL, arch="gpt2", seed=0, max_positions=512)
    reference = VersionedReference(model_dir)
    with VLLMServer(
        model_dir, served_model_name=MODEL, max_model_len=512, enable_scale_out=True, startup_timeout_s=600
    ) as process:
        for inflight in (False, True):
            with OpenAIPolicy(
                process.url, MODEL, str, server_kind="vllm", fallback=lambda obs, env_id: "", max_new_tokens=400,
                request_timeout_s=120, checkpoint_dir=tmp_path / "checkpoints", model_dir=model_dir,
                supervisor=EngineSupervisor(process), inflight_updates=inflight,
            ) as policy:  # fmt: skip
                version = max(policy.server_version() or 0, policy.policy_version) + 1
                policy.load_weights(reference.weights(version), version)
                futures = [policy.submit(prompt) for prompt in PROMPTS]
                wait_until(lambda: policy.stats()["streamed_tokens"] >= len(PROMPTS), timeout=300)
                old_pid = crash(process)  # mid-stream: the dead server is found, restarted, given version's weights
                outputs = [future.result(timeout=900) for future in futures]
                error = reference.max_logp_error(PROMPTS, outputs)
                stats = policy.stats()
                print(
                    f"vLLM server killed mid-stream (inflight_updates={inflight}): {stats['resumed_tokens']} prefix "
                    f"tokens kept over {stats['resumed_requests']} completions, {stats['regenerated_tokens']} sampled "
                    f"again; max |logp - teacher-forced at v{version}| = {error:.2e}"
                )
                assert all(out.policy_version == version and out.token_ids and not out.fallback for out in outputs)
                assert error <= LOGP_TOLERANCE and stats["engine_restarts"] == 1 and stats["failed_requests"] == 0
                assert stats["resumed_tokens"] >= len(PROMPTS) and stats["regenerated_tokens"] == 0
                assert process.running and not psutil.pid_exists(old_pid)
                assert policy.server_version() == version
    assert not process.running
