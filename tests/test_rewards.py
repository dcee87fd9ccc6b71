"""Reward plugins, CombinedReward, RewardService and the HF reward-model scorer."""

from __future__ import annotations

import asyncio
import functools
import math
import re
import string
import threading
import time
import uuid

import pytest

from asyncvec.lm import rewards
from asyncvec.lm.rewards import (
    AsyncRewardInLoopError,
    CombinedReward,
    HFRewardModel,
    RewardResult,
    RewardService,
    RewardServiceClosedError,
)

WAIT_S = 10.0  # generous bound on every wait in this file
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def name():
    """A fresh plugin name, unregistered after the test."""
    plugin_name = f"test-{uuid.uuid4().hex[:8]}"
    yield plugin_name
    if plugin_name in rewards.available():
        rewards.unregister(plugin_name)


def register_temp(request_name: str, fn):
    return rewards.register(request_name)(fn)


def wait_until(predicate, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def service_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncvec-reward")]


# --- registry --------------------------------------------------------------------------


def test_register_get_available_unregister(name):
    @rewards.register(name)
    def contains_yes(prompt, completion, **info):
        return 1.0 if "yes" in completion else 0.0

    assert rewards.get(name) is contains_yes
    assert name in rewards.available()
    assert rewards.score(name, "ok?", "yes") == 1.0
    assert rewards.score(name, "ok?", "no") == 0.0
    rewards.unregister(name)
    assert name not in rewards.available()
    with pytest.raises(KeyError, match=name):
        rewards.get(name)


def test_duplicate_name_is_a_clear_error(name):
    register_temp(name, lambda prompt, completion, **info: 0.0)
    with pytest.raises(ValueError, match=f"{name!r} is already registered"):
        rewards.register(name)(lambda prompt, completion, **info: 1.0)
    assert rewards.score(name, "p", "c") == 0.0  # the first one is kept
    rewards.register(name, replace=True)(lambda prompt, completion, **info: 1.0)
    assert rewards.score(name, "p", "c") == 1.0


def test_unknown_name_lists_available():
    with pytest.raises(KeyError, match="exact_answer"):
        rewards.get("no-such-plugin")
    with pytest.raises(KeyError, match="no-such-plugin"):
        rewards.unregister("no-such-plugin")


@pytest.mark.parametrize(
    "bad",
    [
        lambda prompt, completion: 0.0,  # no **info
        lambda prompt, **info: 0.0,  # no completion
        "not callable",
    ],
)
def test_register_rejects_wrong_signatures(name, bad):
    with pytest.raises(TypeError, match=name):
        rewards.register(name)(bad)
    assert name not in rewards.available()


def test_register_rejects_bad_names():
    with pytest.raises(TypeError, match="name must be a str"):
        rewards.register(3)
    with pytest.raises(ValueError, match="non-empty"):
        rewards.register("")


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("1.0", TypeError),
        (None, TypeError),
        ([1.0], TypeError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (-math.inf, ValueError),
    ],
)
def test_bad_reward_values_name_plugin_and_value(name, value, error):
    register_temp(name, lambda prompt, completion, **info: value)
    with pytest.raises(error, match=re.escape(f"reward {name!r} returned {value!r}")):
        rewards.score(name, "p", "c")


def test_tensor_reward_hints_item(name):
    torch = pytest.importorskip("torch")
    register_temp(name, lambda prompt, completion, **info: torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"\.item\(\)"):
        rewards.score(name, "p", "c")


def test_numpy_and_int_rewards_are_accepted(name):
    np = pytest.importorskip("numpy")
    register_temp(name, lambda prompt, completion, **info: np.float32(0.5) if info.get("np") else 2)
    assert rewards.score(name, "p", "c", np=True) == 0.5
    assert rewards.score(name, "p", "c") == 2.0


def test_async_plugin(name):
    @rewards.register(name)
    async def slow_len(prompt, completion, **info):
        await asyncio.sleep(0.001)
        return float(len(completion)) * info.get("scale", 1.0)

    assert rewards.score(name, "p", "abc", scale=2.0) == 6.0
    assert asyncio.run(rewards.ascore(name, "p", "ab")) == 2.0

    async def sync_call_inside_loop():
        return rewards.score(name, "p", "ab")

    with pytest.raises(AsyncRewardInLoopError, match="ascore"):
        asyncio.run(sync_call_inside_loop())
    assert issubclass(AsyncRewardInLoopError, RuntimeError)  # what it raised before it was typed


def test_async_plugin_non_finite_is_an_error(name):
    @rewards.register(name)
    async def broken(prompt, completion, **info):
        return math.nan

    with pytest.raises(ValueError, match=name):
        asyncio.run(rewards.ascore(name, "p", "c"))


# --- built-ins -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "completion", "info", "expected"),
    [
        ("3+4=", "7", {}, 1.0),
        ("3+4=", "  7 is my answer", {}, 1.0),
        ("3+4=", "8", {}, 0.0),
        ("3+4=", "seven", {}, 0.0),
        ("3+4=", "", {}, 0.0),
        ("10-12=", "-2", {}, 1.0),
        ("Compute 12 * 11 =", "132", {}, 1.0),
        ("anything", "42", {"answer": 42}, 1.0),
        ("3+4=", "7", {"answer": 8}, 0.0),  # info wins over the prompt
    ],
)
def test_exact_answer(prompt, completion, info, expected):
    assert rewards.score("exact_answer", prompt, completion, **info) == expected


def test_exact_answer_errors():
    with pytest.raises(ValueError, match="info\\['answer'\\]"):
        rewards.exact_answer("no problem here", "1")
    with pytest.raises(TypeError, match="info\\['answer'\\] must be an int"):
        rewards.exact_answer("3+4=", "7", answer="7")


def test_parse_leading_int_is_lenient_but_bounded():
    assert rewards.parse_leading_int("\n 12abc") == 12
    assert rewards.parse_leading_int("+5") == 5
    assert rewards.parse_leading_int("- 5") is None
    assert rewards.parse_leading_int("9" * 10_000) is None  # beyond int() limits, not a crash


def test_length_penalty():
    assert rewards.length_penalty("p", "") == 0.0
    assert rewards.length_penalty("p", "x" * 50) == -0.5
    assert rewards.length_penalty("p", "x" * 1000) == -1.0
    short = functools.partial(rewards.length_penalty, scale_chars=10)
    assert short("p", "x" * 5) == -0.5
    with pytest.raises(ValueError, match="scale_chars"):
        rewards.length_penalty("p", "x", scale_chars=0)


# --- CombinedReward ----------------------------------------------------------------------


def test_combined_reward_weighted_sum(name):
    register_temp(name, lambda prompt, completion, **info: 2.0)
    combined = CombinedReward({"exact_answer": 1.0, "length_penalty": 0.5, name: -0.25})
    # 1.0 * 1 + 0.5 * (-len("7 ok") / 100) - 0.25 * 2
    assert combined("3+4=", "7 ok") == pytest.approx(1.0 - 0.02 - 0.5)
    assert combined("3+4=", "8") == pytest.approx(0.0 - 0.005 - 0.5)
    assert rewards.score(combined, "3+4=", "7") == pytest.approx(0.495)
    assert not combined.is_async


def test_combined_reward_with_async_component(name):
    @rewards.register(name)
    async def half(prompt, completion, **info):
        await asyncio.sleep(0)
        return 0.5

    combined = CombinedReward({name: 2.0, "exact_answer": 3.0})
    assert combined.is_async
    assert combined("1+1=", "2") == 4.0
    assert asyncio.run(combined.ascore("1+1=", "3")) == 1.0


def test_combined_reward_validation(name):
    with pytest.raises(KeyError, match="missing-plugin"):
        CombinedReward({"missing-plugin": 1.0})
    with pytest.raises(TypeError, match="weight for 'exact_answer'"):
        CombinedReward({"exact_answer": "1"})
    with pytest.raises(ValueError, match="weight for 'exact_answer' must be finite"):
        CombinedReward({"exact_answer": math.inf})
    with pytest.raises(ValueError, match="at least one"):
        CombinedReward({})
    with pytest.raises(TypeError, match="mapping"):
        CombinedReward(["exact_answer"])
    register_temp(name, lambda prompt, completion, **info: "bad")
    with pytest.raises(TypeError, match=f"reward {name!r} returned 'bad'"):
        CombinedReward({name: 1.0})("p", "c")


# --- RewardService with plugin scorers ---------------------------------------------------


def test_service_scores_caches_and_counts():
    with RewardService("exact_answer", timeout_s=WAIT_S) as service:
        first = service.submit("3+4=", "7").result(WAIT_S)
        assert isinstance(first, RewardResult)
        assert (first.reward, first.flagged, first.cached, first.rm_version) == (
            1.0,
            False,
            False,
            0,
        )
        assert first.usable and first.reason is None and first.latency >= 0.0
        second = service.submit("3+4=", "7").result(WAIT_S)
        assert (second.reward, second.cached) == (1.0, True)
        wrong = service.submit("3+4=", "8").result(WAIT_S)
        assert (wrong.reward, wrong.cached) == (0.0, False)
        # info is part of the cache key for plugin scorers
        other = service.submit("3+4=", "7", answer=8).result(WAIT_S)
        assert (other.reward, other.cached) == (0.0, False)
        stats = service.stats()
    assert (stats.requests, stats.cache_hits, stats.scored, stats.timeouts, stats.errors) == (
        4,
        1,
        3,
        0,
        0,
    )
    assert stats.cache_size == 3


def test_service_cache_is_lru_with_max_size():
    with RewardService("length_penalty", cache_size=2, timeout_s=WAIT_S) as service:
        for completion in ["a", "b", "a", "c"]:  # "a" used again, so "b" is the oldest
            service.submit("p", completion).result(WAIT_S)
        assert service.stats().cache_size == 2
        assert service.submit("p", "a").result(WAIT_S).cached
        assert service.submit("p", "c").result(WAIT_S).cached
        assert not service.submit("p", "b").result(WAIT_S).cached


def test_service_unhashable_info_is_scored_without_cache(name):
    register_temp(name, lambda prompt, completion, **info: float(sum(info["weights"])))
    with RewardService(name, timeout_s=WAIT_S) as service:
        assert service.submit("p", "c", weights=[1, 2]).result(WAIT_S).reward == 3.0
        again = service.submit("p", "c", weights=[1, 2]).result(WAIT_S)
        assert not again.cached and service.stats().cache_size == 0


def test_new_version_never_serves_old_cache():
    with RewardService("exact_answer", timeout_s=WAIT_S, version=3) as service:
        assert service.submit("2+2=", "4").result(WAIT_S).rm_version == 3
        assert service.submit("2+2=", "4").result(WAIT_S).cached
        service.set_version(4)
        fresh = service.submit("2+2=", "4").result(WAIT_S)
        assert (fresh.cached, fresh.rm_version) == (False, 4)
        assert service.submit("2+2=", "4").result(WAIT_S).cached
        with pytest.raises(TypeError, match="version must be an int"):
            service.set_version("5")
        with pytest.raises(TypeError, match="no load_weights"):
            service.load_weights({})


def test_slow_sync_scorer_times_out_flagged_then_late_score_fills_cache(name):
    release = threading.Event()

    @rewards.register(name)
    def slow(prompt, completion, **info):
        release.wait(WAIT_S)
        return 1.0

    with RewardService(name, timeout_s=0.05, timeout_reward=-1.0) as service:
        result = service.submit("p", "c").result(WAIT_S)
        assert (result.reward, result.flagged, result.usable, result.cached) == (
            -1.0,
            True,
            False,
            False,
        )
        assert "timed out" in result.reason
        assert result.latency >= 0.04  # timers may fire a clock tick early
        release.set()
        wait_until(lambda: service.stats().cache_size == 1)
        late = service.submit("p", "c").result(WAIT_S)
        assert (late.reward, late.flagged, late.cached) == (1.0, False, True)
        stats = service.stats()
    assert (stats.requests, stats.timeouts, stats.scored, stats.cache_hits) == (2, 1, 0, 1)


def test_slow_async_scorer_times_out(name):
    @rewards.register(name)
    async def slow(prompt, completion, **info):
        await asyncio.sleep(WAIT_S if completion == "slow" else 0.0)
        return 1.0

    with RewardService(name, timeout_s=1.0, timeout_reward=0.25) as service:
        slow_future = service.submit("p", "slow")
        fast = service.submit("p", "fast").result(WAIT_S)
        assert (fast.reward, fast.flagged) == (1.0, False)  # not stuck behind the slow one
        flagged = slow_future.result(WAIT_S)
        assert (flagged.reward, flagged.flagged) == (0.25, True)
        assert service.stats().timeouts == 1


def test_scorer_errors_are_flagged_counted_and_survived(name):
    @rewards.register(name)
    def picky(prompt, completion, **info):
        if completion == "boom":
            raise RuntimeError("scorer exploded")
        if completion == "nan":
            return math.nan
        return 1.0

    with RewardService(name, timeout_s=WAIT_S, timeout_reward=-2.0) as service:
        boom = service.submit("p", "boom").result(WAIT_S)
        assert (boom.reward, boom.flagged) == (-2.0, True)
        assert "scorer exploded" in boom.reason
        nan = service.submit("p", "nan").result(WAIT_S)
        assert nan.flagged and name in nan.reason and "nan" in nan.reason
        assert service.submit("p", "fine").result(WAIT_S).reward == 1.0
        # flagged results are not cached
        assert not service.submit("p", "boom").result(WAIT_S).cached
        stats = service.stats()
    assert (stats.errors, stats.scored, stats.requests) == (3, 1, 4)


def test_sync_scorers_run_in_parallel(name):
    barrier = threading.Barrier(4, timeout=WAIT_S)  # passes only if 4 calls run at once

    @rewards.register(name)
    def meet(prompt, completion, **info):
        barrier.wait()
        return 1.0

    with RewardService(name, num_workers=4, timeout_s=2 * WAIT_S) as service:
        futures = [service.submit("p", str(i)) for i in range(4)]
        assert [f.result(2 * WAIT_S).reward for f in futures] == [1.0] * 4


def test_combined_reward_as_scorer(name):
    @rewards.register(name)
    async def one(prompt, completion, **info):
        return 1.0

    with RewardService(CombinedReward({name: 1.0, "exact_answer": 1.0}), timeout_s=WAIT_S) as service:
        assert service.submit("1+2=", "3").result(WAIT_S).reward == 2.0


def test_service_input_errors_and_close():
    before = len(service_threads())
    service = RewardService("exact_answer", timeout_s=WAIT_S)
    with pytest.raises(TypeError, match="prompt must be a str"):
        service.submit(b"3+4=", "7")
    with pytest.raises(TypeError, match="response must be a str"):
        service.submit("3+4=", 7)
    service.close()
    service.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        service.submit("3+4=", "7")
    assert len(service_threads()) == before


def test_close_fails_pending_requests_and_joins_threads(name):
    release = threading.Event()

    @rewards.register(name)
    def blocked(prompt, completion, **info):
        release.wait(WAIT_S)
        return 1.0

    service = RewardService(name, num_workers=1, timeout_s=WAIT_S)
    futures = [service.submit("p", str(i)) for i in range(3)]
    releaser = threading.Timer(0.1, release.set)
    releaser.start()
    service.close()
    releaser.join(WAIT_S)
    for future in futures:
        with pytest.raises(RewardServiceClosedError, match="closed before the request was scored"):
            future.result(WAIT_S)
    assert not [t for t in service_threads() if t.is_alive()]


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"timeout_s": 0}, ValueError, "timeout_s"),
        ({"timeout_s": "1"}, TypeError, "timeout_s"),
        ({"cache_size": -1}, ValueError, "cache_size"),
        ({"max_batch_size": 0}, ValueError, "max_batch_size"),
        ({"num_workers": 1.5}, TypeError, "num_workers"),
        ({"max_wait_s": -0.1}, ValueError, "max_wait_s"),
        ({"timeout_reward": math.nan}, ValueError, "timeout_reward"),
        ({"version": None}, TypeError, "version"),
    ],
)
def test_service_argument_errors(kwargs, error, field):
    with pytest.raises(error, match=field):
        RewardService("exact_answer", **kwargs)


def test_service_rejects_bad_scorer():
    with pytest.raises(TypeError, match="scorer must be"):
        RewardService(42)
    with pytest.raises(KeyError, match="nope"):
        RewardService("nope")


# --- HF reward model ---------------------------------------------------------------------

CHARS = string.printable


def build_reward_model(num_labels: int = 1, seed: int = 0):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<pad>": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    # A BPE model without merges is a character-level tokenizer.
    core = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges=[], unk_token="<pad>"))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", model_input_names=["input_ids", "attention_mask"]
    )
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        n_positions=64,
        vocab_size=len(vocab),
        num_labels=num_labels,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return transformers.GPT2ForSequenceClassification(config), tokenizer


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    model, tokenizer = build_reward_model()
    path = tmp_path_factory.mktemp("tiny_rm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


PAIRS = [("3+4=", "7"), ("12+7=", " 19 because"), ("Guess a number", "8"), ("x" * 80, "y" * 40)]


def test_hf_batch_scores_equal_single_scores(rm_path):
    scorer = HFRewardModel.from_pretrained(rm_path)
    prompts, responses = zip(*PAIRS, strict=True)
    batch = scorer.score_batch(prompts, responses)
    single = [scorer.score_batch([p], [r])[0] for p, r in PAIRS]
    assert batch == pytest.approx(single, abs=1e-5)
    assert len(set(round(s, 6) for s in batch)) == len(PAIRS)  # really depends on the text


def test_hf_label_selection():
    torch = pytest.importorskip("torch")
    model, tokenizer = build_reward_model(num_labels=3)
    scorer = HFRewardModel(model, tokenizer)
    encoded = tokenizer(["3+4="], ["7"], return_tensors="pt")
    with torch.no_grad():
        logits = model(**encoded).logits[0]
    assert scorer.score_batch(["3+4="], ["7"])[0] == pytest.approx(logits[1].item(), abs=1e-6)
    assert HFRewardModel(model, tokenizer, label=2).score_batch(["3+4="], ["7"])[0] == pytest.approx(
        logits[2].item(), abs=1e-6
    )
    with pytest.raises(ValueError, match="label must be in"):
        HFRewardModel(model, tokenizer, label=3)


def test_hf_requires_pad_tokens():
    model, tokenizer = build_reward_model()
    model.config.pad_token_id = None
    with pytest.raises(ValueError, match="pad_token_id"):
        HFRewardModel(model, tokenizer)


def test_service_batches_hf_model_and_matches_direct_scores(rm_path):
    direct = HFRewardModel.from_pretrained(rm_path)
    expected = [direct.score_batch([p], [r])[0] for p, r in PAIRS]
    with RewardService.from_pretrained(rm_path, max_batch_size=8, max_wait_s=0.2, timeout_s=WAIT_S) as service:
        futures = [service.submit(p, r, ignored_info=1) for p, r in PAIRS]
        results = [f.result(WAIT_S) for f in futures]
        stats = service.stats()
        assert [r.reward for r in results] == pytest.approx(expected, abs=1e-5)
        assert not any(r.flagged for r in results)
        assert 1 <= stats.batches < len(PAIRS)  # gathered into batches, not one by one
        # reward models ignore info, so it is not part of the cache key
        assert service.submit(*PAIRS[0], other_info=2).result(WAIT_S).cached


def test_load_weights_bumps_version_and_invalidates_cache(rm_path, tmp_path):
    torch = pytest.importorskip("torch")
    with RewardService.from_pretrained(rm_path, timeout_s=WAIT_S) as service:
        before = service.submit("3+4=", "7").result(WAIT_S)
        assert service.submit("3+4=", "7").result(WAIT_S).cached

        other, tokenizer = build_reward_model(seed=1)
        other.eval()  # no dropout, like the service
        assert service.load_weights(other.state_dict()) == 1
        after = service.submit("3+4=", "7").result(WAIT_S)
        assert (after.cached, after.rm_version) == (False, 1)
        with torch.no_grad():
            expected = other(**tokenizer(["3+4="], ["7"], return_tensors="pt")).logits[0, 0].item()
        assert after.reward == pytest.approx(expected, abs=1e-5)
        assert after.reward != pytest.approx(before.reward, abs=1e-4)

        # back to the saved weights, from the folder, under an explicit version
        assert service.load_weights(rm_path, version=7) == 7
        restored = service.submit("3+4=", "7").result(WAIT_S)
        assert (restored.cached, restored.rm_version) == (False, 7)
        assert restored.reward == pytest.approx(before.reward, abs=1e-5)
        with pytest.raises(ValueError, match="must differ"):
            service.load_weights(rm_path, version=7)
