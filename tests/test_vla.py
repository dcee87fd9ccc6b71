"""Action tokens and the tiny vision-language-action policy (a real model built from a config)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from asyncvec.inference.action_tokens import ActionTokenizer

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from asyncvec.inference.backends.vla import (  # noqa: E402  (after pytest.importorskip of torch and transformers)
    TinyVLAModel,
    TinyVLAPolicy,
    build_tiny_vla,
    load_tiny_vla,
    per_action_logps,
)

IMAGE = 32
SPACE = gym.spaces.Box(np.array([-1.0, 0.0], np.float32), np.array([1.0, 2.0], np.float32))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_vla(
        tmp_path_factory.mktemp("vla"), image_size=IMAGE, patch_size=8, n_layer=1, n_embd=32, vision_dim=32,
        max_positions=64, seed=0,
    )  # fmt: skip


def _obs(instruction: str = "push the red cube", seed: int = 0) -> dict:
    image = np.random.default_rng(seed).integers(0, 256, (IMAGE, IMAGE, 3), dtype=np.uint8)
    return {"image": image, "instruction": instruction}


# --------------------------------------------------------------------------- action tokens
def test_round_trip_within_half_a_bin():
    rng = np.random.default_rng(0)
    low, high = np.array([-2.0, 0.0, 10.0]), np.array([3.0, 0.5, 10.25])
    tok = ActionTokenizer(low, high, num_bins=256, first_token_id=1000)
    actions = rng.uniform(low, high, size=(500, 3))
    ids = tok.encode(actions)
    assert ids.shape == (500, 3) and ids.dtype == np.int64
    assert ids.min() >= 1000 and ids.max() < 1256
    decoded = tok.decode(ids)
    assert np.all(np.abs(decoded - actions) <= tok.bin_width / 2 + 1e-12)
    assert np.all((decoded >= low) & (decoded <= high))
    # a bin centre survives a second round trip unchanged
    np.testing.assert_array_equal(tok.encode(decoded), ids)


def test_bounds_clipping_and_chunks():
    tok = ActionTokenizer(SPACE, num_bins=256, first_token_id=7)
    assert tok.token_range == (7, 263) and tok.dim == 2
    ids = tok.encode([[-1.0, 0.0], [1.0, 2.0], [-50.0, 99.0], [np.inf, -np.inf]])
    assert ids.tolist() == [[7, 7], [262, 262], [7, 262], [262, 7]]
    chunk = tok.decode(np.array([7, 262, 100, 100]))  # a flat sequence of H * D tokens
    assert chunk.shape == (2, 2)
    np.testing.assert_allclose(chunk[0], [-1 + 1 / 256, 2 - 1 / 256])
    assert tok.encode(np.zeros((4, 5, 2))).shape == (4, 5, 2)  # any leading shape


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda t: t.encode([0.0, 0.0, 0.0]), r"shape \(\.\.\., 2\)"),
        (lambda t: t.encode([[0.0, np.nan]]), "NaN"),
        (lambda t: t.encode([["a", "b"]]), "numeric"),
        (lambda t: t.decode(np.array([0.5, 1.0])), "integer token ids"),
        (lambda t: t.decode(np.array([7, 8, 9])), "multiple of 2"),
        (lambda t: t.decode(np.array([[7, 263]])), r"token 263 at position \[0, 1\] is not an action token"),
        (lambda t: t.decode(np.array(7)), "scalar"),
    ],
)
def test_bad_input_names_the_problem(call, message):
    tok = ActionTokenizer(SPACE, first_token_id=7)
    with pytest.raises(ValueError, match=message):
        call(tok)


def test_bad_bounds():
    with pytest.raises(ValueError, match="finite"):
        ActionTokenizer(gym.spaces.Box(-np.inf, np.inf, (2,)))
    with pytest.raises(ValueError, match="dimension 1: high 0.0 must be greater than low 1.0"):
        ActionTokenizer([0.0, 1.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="num_bins"):
        ActionTokenizer([0.0], [1.0], num_bins=1)
    with pytest.raises(ValueError, match="same length"):
        ActionTokenizer([0.0, 0.0], [1.0])
    assert ActionTokenizer(0.0, 1.0, dim=3).dim == 3


# --------------------------------------------------------------------------- the model
def test_save_and_load_give_the_same_model(folder, tmp_path):
    model, tokenizer = load_tiny_vla(folder)
    assert isinstance(model, TinyVLAModel)
    assert model.action_token_range == (len(tokenizer), len(tokenizer) + 256)
    assert model.config.num_patches == 16
    model.save_pretrained(tmp_path)
    again = TinyVLAModel.from_pretrained(tmp_path)
    policy_inputs = _inputs(model, tokenizer, [_obs()])
    ids = torch.tensor([[len(tokenizer) + 3, len(tokenizer) + 200]])
    with torch.no_grad():
        torch.testing.assert_close(model.action_logits(*policy_inputs, ids), again.action_logits(*policy_inputs, ids))


def _inputs(model, tokenizer, observations):
    ids = [tokenizer(o["instruction"]).input_ids for o in observations]
    width = max(map(len, ids))
    input_ids = torch.tensor([[0] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    return torch.from_numpy(np.stack([o["image"] for o in observations])), input_ids, mask


def test_chunks_logps_and_batching(folder):
    with TinyVLAPolicy(folder, SPACE, chunk_size=3, max_wait_ms=200, seed=0) as policy:
        batch = {
            "image": np.stack([_obs(seed=i)["image"] for i in range(3)]),
            "instruction": ("go", "push the red cube left", "stack"),
        }
        outs = policy.act(batch, timeout=120)
        stats = policy.stats()
        chunks = np.stack([out.action for out in outs])
        scored = policy.score(batch, chunks)
        single = policy.act([_obs()], timeout=60)[0]
    assert stats["batches"] <= 2  # dynamic batching: one call for the batch (two under a slow start)
    assert chunks.shape == (3, 3, 2) and chunks.dtype == np.float32
    assert np.all((chunks >= SPACE.low) & (chunks <= SPACE.high))
    tokenizer = policy.action_tokenizer
    for out in outs:
        assert not out.fallback and out.policy_version == 0
        assert len(out.token_ids) == 6 and np.all(tokenizer.is_action_token(out.token_ids))
        np.testing.assert_allclose(tokenizer.decode(np.array(out.token_ids)), out.action, rtol=1e-6)
        assert out.behavior_logp == pytest.approx(sum(out.token_logps))
        per_action = policy.action_logps(out)
        assert per_action.shape == (3,) and per_action.sum() == pytest.approx(out.behavior_logp)
    # The behaviour log-probs are the model's: teacher forcing the emitted tokens gives them back
    # (left-padded instructions of different lengths in one batch).
    np.testing.assert_allclose(scored, [out.behavior_logp for out in outs], atol=1e-3)
    assert single.action.shape == (3, 2)
    assert per_action_logps([-1.0, -1.0, -2.0, -2.0], 2).tolist() == [-2.0, -4.0]


def test_single_action_and_greedy(folder):
    with TinyVLAPolicy(folder, SPACE, temperature=0.0, max_wait_ms=1) as policy:
        first = policy.submit(_obs(), env_id=0).result(timeout=60)
        second = policy.submit(_obs(), env_id=1).result(timeout=60)
    assert first.action.shape == (2,)
    np.testing.assert_array_equal(first.action, second.action)  # greedy is deterministic


@pytest.mark.parametrize(
    ("obs", "message"),
    [
        ({"image": np.zeros((16, 16, 3), np.uint8), "instruction": "go"}, r"env_id=4: .*shape \(16, 16, 3\)"),
        ({"image": np.zeros((IMAGE, IMAGE, 3), np.float32), "instruction": "go"}, "dtype float32"),
        ({"image": [[0]], "instruction": "go"}, "numpy uint8 array"),
        ({"image": np.zeros((IMAGE, IMAGE, 3), np.uint8)}, "keys 'image' and 'instruction'"),
        ({"image": np.zeros((IMAGE, IMAGE, 3), np.uint8), "instruction": 3}, r"\['instruction'\] must be a str"),
        (np.zeros((IMAGE, IMAGE, 3), np.uint8), "dict observation"),
        (
            {"image": np.zeros((IMAGE, IMAGE, 3), np.uint8), "instruction": "x" * 60},
            r"60 tokens is over the context: 16 image tokens \+ 60 instruction tokens \+ 4 action tokens = 80 > "
            r"the model's 64 positions",
        ),
    ],
)
def test_bad_observations_are_named(folder, obs, message):
    with TinyVLAPolicy(folder, SPACE, chunk_size=2) as policy:
        with pytest.raises(ValueError, match=message):
            policy.submit(obs, env_id=4)
        assert policy.stats()["requests"] == 0


def test_unconstrained_tokens_that_are_no_action_fall_back_and_are_counted(folder):
    model, tokenizer = load_tiny_vla(folder)
    with torch.no_grad():
        model.language_model.get_output_embeddings().weight.zero_()  # uniform logits: greedy picks id 0
    with TinyVLAPolicy(model, SPACE, tokenizer=tokenizer, chunk_size=2, temperature=0.0, constrained=False) as free:
        out = free.submit(_obs(), env_id=0).result(timeout=60)
        stats = free.stats()
    assert out.fallback and stats["parse_failures"] == 1 and stats["fallbacks"] == 1
    assert out.token_ids == (0, 0, 0, 0)  # kept for inspection, never decoded
    assert out.action.shape == (2, 2)  # the fallback of a chunked policy is a chunk (zeros clipped into bounds)
    np.testing.assert_array_equal(out.action, [[0.0, 0.0], [0.0, 0.0]])
    with TinyVLAPolicy(model, SPACE, tokenizer=tokenizer, chunk_size=2, temperature=0.0) as constrained:
        out = constrained.submit(_obs(), env_id=0).result(timeout=60)
    assert not out.fallback and np.all(constrained.action_tokenizer.is_action_token(out.token_ids))


def test_gradient_steps_move_the_policy_and_versions_tag_answers(folder, tmp_path):
    """A teacher-forced action-token loss trains the model; load_weights publishes it as a version."""
    learner, tokenizer = load_tiny_vla(folder)
    learner.train()
    obs = _obs("put the block on the plate")
    target = np.array([[0.6, 0.3], [-0.8, 1.7]], np.float32)  # a chunk of 2
    with TinyVLAPolicy(folder, SPACE, chunk_size=2, temperature=0.0, max_wait_ms=1) as policy:
        before = policy.score([obs], target[None])[0]
        assert policy.submit(obs).result(timeout=60).policy_version == 0
        target_ids = torch.as_tensor(policy.action_tokenizer.encode(target).reshape(1, -1))
        inputs = policy.model_inputs([obs])
        optimizer = torch.optim.Adam(learner.parameters(), lr=1e-2)
        for _ in range(40):
            loss = -learner.action_logprobs(*inputs, target_ids).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        policy.load_weights(learner.state_dict(), version=1)
        after = policy.score([obs], target[None])[0]
        out = policy.submit(obs).result(timeout=60)
        # a save_pretrained folder is a weights source too
        learner.save_pretrained(tmp_path / "v3")
        policy.load_weights(tmp_path / "v3", version=3)
        later = policy.submit(obs).result(timeout=60)
        with pytest.raises(ValueError, match="greater than the current policy_version 3"):
            policy.load_weights(learner.state_dict(), version=2)
        bad = {name: value[:1] if value.ndim else value for name, value in learner.state_dict().items()}
        with pytest.raises(ValueError, match="shape mismatch"):
            policy.load_weights(bad, version=4)
        assert policy.policy_version == 3
    assert before < -8.0  # an untrained model: about 4 tokens * log(1/256) = -22
    print(f"log-prob of the target chunk: {before:.2f} -> {after:.2f}")
    assert after > before + 8.0 and after > -2.0, (before, after)
    assert out.policy_version == 1 and later.policy_version == 3
    np.testing.assert_allclose(out.action, target, atol=policy.action_tokenizer.bin_width.max() / 2 + 1e-6)


# ------------------------------------------------------------------------- bad input (issue 19)
def test_score_refuses_a_chunk_of_the_wrong_length(folder):
    with TinyVLAPolicy(folder, SPACE, chunk_size=2) as policy:
        assert policy.score([_obs()], np.zeros((1, 2, 2), np.float32)).shape == (1,)
        with pytest.raises(
            ValueError,
            match=r"actions have shape \(1, 3, 2\), expected \(1, 2, 2\): a chunk of "
            r"chunk_size=2 actions of 2 dimensions per observation",
        ):
            policy.score([_obs()], np.zeros((1, 3, 2), np.float32))
    with TinyVLAPolicy(folder, SPACE) as single, pytest.raises(ValueError, match=r"expected \(2, 2\): one action"):
        single.score([_obs(), _obs(seed=1)], np.zeros((2, 1, 2), np.float32))


def test_too_few_action_tokens_fall_back_and_are_counted(folder):
    """A backend that emits fewer tokens than a chunk needs: no action, the fallback, counted."""
    with TinyVLAPolicy(folder, SPACE, chunk_size=2, fallback="zero") as policy:
        generate = policy.model.generate_actions
        policy.model.generate_actions = lambda *args, **kwargs: tuple(t[:, :-1] for t in generate(*args, **kwargs))
        out = policy.submit(_obs(), env_id=0).result(timeout=60)
        assert out.fallback and len(out.token_ids) == 3 and policy.stats()["parse_failures"] == 1
        np.testing.assert_array_equal(out.action, np.zeros((2, 2), np.float32))


def test_no_action_tokens_are_never_played_as_the_policys_choice():
    """End to end: a VLA whose every answer decodes to no action, on pixel envs at a control rate.
    Each answer is the policy's counted fallback, and the chunk executor marks every action it
    plays as replaced, so a learner on the rollout (policy_choice) trains on none of them."""
    import tempfile

    import asyncvec.envs  # noqa: F401  (registers the pixel envs)
    from asyncvec import AsyncLLMVectorEnv
    from asyncvec.control import ChunkExecutor

    model, tokenizer = load_tiny_vla(
        build_tiny_vla(tempfile.mkdtemp(), image_size=64, n_layer=1, n_embd=32, vision_dim=32, seed=0)
    )
    with torch.no_grad():
        model.language_model.get_output_embeddings().weight.zero_()  # greedy picks id 0: no action token
    with AsyncLLMVectorEnv([lambda: gym.make("asyncvec/PixelPendulum-v0")] * 2) as vector_env:
        space = vector_env.single_action_space
        with TinyVLAPolicy(
            model, space, tokenizer=tokenizer, chunk_size=4, temperature=0.0, constrained=False, max_wait_ms=1
        ) as policy:
            executor = ChunkExecutor(vector_env, policy, period_s=0.02, horizon=4)
            executor.reset(seed=0)
            rollouts = []
            for _ in range(20):  # until answers were played (a loaded machine may take a while)
                rollouts.append(executor.run(10))
                if executor.stats()["policy_fallbacks"] >= 2:
                    break
            stats, policy_stats = executor.stats(), policy.stats()
    assert 2 <= stats["policy_fallbacks"] <= policy_stats["parse_failures"], (stats, policy_stats)
    assert policy_stats["answered"] == policy_stats["fallbacks"]  # every answer was the fallback
    for rollout in rollouts:
        assert rollout.policy_choice.sum() == 0 and rollout.count("policy") == 0
    assert any((rollout.chunk_id >= 0).any() for rollout in rollouts)  # the policy's fallback chunks were played
