"""What the language-model agents (``agents/rloo.py``, ``agents/reinforce_pp.py``) build from
their options: ``LMArgs``, the prompt env, the model folder, the text policy, and the result
record. The loops live in the agent files; the machinery they drive lives in the library
(``asyncvec.lm``, ``asyncvec.inference``).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import itertools
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch

from asyncvec import VersionManager, inference
from asyncvec.agents.common import LaggedWeights, check_env_id, import_user_module, seed_everything
from asyncvec.buffers import GroupBatch
from asyncvec.extras import check_installed
from asyncvec.lm import load_causal_lm, minibatch_updates, quiet_model_libraries, rewards, sft_warm_start
from asyncvec.lm.chat import Conversation
from asyncvec.lm.episodes import EpisodeCollector, EpisodeGroups, make_text_vector_env
from asyncvec.lm.groups import GroupCollector, score_completions
from asyncvec.lm.learner import EpisodeBatch, LMBatch
from asyncvec.lm.rewards import RewardService
from asyncvec.lm.text_env import check_text_env, text_space
from asyncvec.losses import truncated_importance_weights
from asyncvec.metrics import RunLogger

TARGET_WINDOW = 10
"""``target_reward`` is met when the mean training reward of this many updates reaches it."""


@dataclass
class LMArgs:
    """Options shared by the language-model agents (each agent's ``Args`` adds its own)."""

    env: str = "asyncvec/SingleDigitSums-v0"
    """text env id, or module:EnvId (module, in the current folder or installed, registers EnvId when imported):
    a one-step env's reset() observations are the prompts; a multi-turn env (its episode goes on after a
    step, e.g. asyncvec/GuessNumber-v0) is played in an AsyncLLMVectorEnv"""
    env_kwargs: str = "{}"
    """keyword arguments of gym.make(--env) as JSON, e.g. '{"max_number": 8, "transcript": false}'"""
    num_envs: int = 8
    """multi-turn envs: envs stepping at once (their turns reach the policy batched)"""
    gamma: float = 1.0
    """multi-turn envs: discount of the episode return sum_t gamma^t r_t"""
    per_turn: bool = False
    """multi-turn envs: each turn's advantage is its discounted return-to-go normalized over the batch
    (for dense rewards) instead of the episode return with the agent's baseline; --kl-coef subtracts
    beta times the KL summed over a turn's tokens from that turn's reward"""
    system_prompt: str | None = None
    """multi-turn envs: the conversation's first message"""
    on_overflow: Literal["truncate", "drop_oldest"] = "truncate"
    """multi-turn envs: a prompt over the context ends the episode truncated, or drops the oldest whole
    turns from it (a new context segment, each turn trained in the context the engine saw)"""
    model: str | None = None
    """save_pretrained folder of the model (default: a fresh tiny GPT-2 from build_tiny_lm)"""
    sft_steps: int = 0
    """supervised warm start on the env's prompts and solved answers before RL (arithmetic envs)"""
    reward: str = "exact_answer"
    """reward plugin scoring (prompt, completion): a registered name (asyncvec.lm.rewards.register), or
    module:name to import module first and use its function name (or the plugin it registers as name)"""
    reward_timeout_s: float = 10.0
    """a reward not ready this long after its request is flagged and kept out of training"""
    reward_workers: int = 2
    """scorer calls running at once (raise it for a remote reward model or tool that waits)"""
    reward_cache_size: int = 4096
    """scores kept by (prompt, completion) and reused; 0 scores every completion afresh"""
    backend: Literal["hf", "openai", "vllm"] = "hf"
    """hf: HFTextPolicy in this process; vllm: an in-process vLLM engine; openai: a server at --base-url"""
    vllm_engine: str = "{}"
    """--backend vllm: vllm.LLM options as JSON, e.g. '{"dtype": "float32", "max_model_len": 128}'"""
    base_url: str | None = None
    """server root for --backend openai, e.g. http://127.0.0.1:8000"""
    server_kind: Literal["asyncvec", "vllm", "sglang"] = "asyncvec"
    """--backend openai: which server it is (how new weights reach it, see docs/lm_agents.md)"""
    served_model: str | None = None
    """model name the server expects (default: the one model the server lists at /v1/models)"""
    weights_dir: str | None = None
    """--backend openai: where published versions are written for the server to load (default: a scratch folder)"""
    update_token: str | None = None
    """bearer token of an asyncvec server's /update_weights (default: $ASYNCVEC_SERVE_TOKEN)"""
    mode: Literal["sync", "async"] = "async"
    """async: generation and scoring keep running in a thread while the learner trains; sync: alternate"""
    total_prompts: int = 6400
    """prompts to train on (each with group_size completions)"""
    prompts_per_update: int = 16
    """prompts (groups) per learner update"""
    group_size: int = 8
    """k: completions sampled per prompt"""
    prefetch_updates: int = 1
    """async mode: updates' worth of prompts generated ahead of the learner"""
    max_staleness: int = 2
    """groups with a completion more than this many versions older than the learner are dropped"""
    policy_lag: int = 0
    """the policy receives each new version this many updates late (a slow weight broadcast)"""
    is_cap: float = 2.0
    """truncation C of the importance weights min(pi/mu, C)"""
    is_level: Literal["token", "sequence"] = "token"
    """importance weights per token, or one per completion (product of the token ratios)"""
    kl_coef: float = 0.0
    """beta: weight of the KL penalty against the frozen initial model (0: no reference model)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """per-token KL estimator (asyncvec.losses.approx_kl)"""
    max_new_tokens: int = 4
    """completion length limit in tokens (eos included)"""
    temperature: float = 1.0
    """sampling temperature (the learner's log-probs use the same one)"""
    learning_rate: float = 1e-3
    """Adam learning rate"""
    update_epochs: int = 1
    """passes over each batch"""
    num_minibatches: int = 1
    """minibatches per pass"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    policy_batch_size: int = 128
    """largest batch the policy's DynamicBatcher sends to the model (multi-turn: at most --num-envs)"""
    policy_wait_ms: float = 20.0
    """longest the policy's batcher waits to fill a batch (over HTTP each batch is one request)"""
    deadline_ms: float | None = None
    """a completion not ready this long after its request gets the fallback and is never trained on"""
    eval_prompts: int = 200
    """completions sampled to measure the mean reward before and after training (0: skip)"""
    target_reward: float | None = None
    """stop once the mean training reward of the last 10 updates reaches this and a batch sampled
    entirely by the final weights confirms it (see --target-tolerance)"""
    target_tolerance: float = 0.1
    """a confirming batch (prompts_per_update groups, not trained on) must reach --target-reward less
    this; one that falls short is trained on and training goes on"""
    timeout_s: float = 120.0
    """longest wait for a batch of groups before the run fails (it never hangs)"""
    seed: int = 1
    """seed of torch, numpy, the prompt stream and the policy's sampling (HF: its own generator; vLLM: the engine)"""
    device: str = "cpu"
    """torch device of the learner, the reference model and the hf backend's model"""
    torch_threads: int = 1
    """torch CPU threads (generation and learning already run on two threads)"""
    output_dir: str | None = None
    """save the trained model (save_pretrained) here"""
    track: bool = False
    """write TensorBoard logs to runs/"""
    log_dir: str = "runs"
    """TensorBoard log root"""
    progress: bool = True
    """show a progress bar"""

    def __post_init__(self) -> None:
        for name in (
            "total_prompts",
            "prompts_per_update",
            "update_epochs",
            "num_minibatches",
            "max_new_tokens",
            "policy_batch_size",
            "torch_threads",
            "prefetch_updates",
            "num_envs",
        ):
            _check_int(name, getattr(self, name), 1)
        for name in ("sft_steps", "max_staleness", "policy_lag", "eval_prompts"):
            _check_int(name, getattr(self, name), 0)
        _check_int("group_size", self.group_size, 2)
        for name in ("is_cap", "reward_timeout_s", "timeout_s", "learning_rate", "max_grad_norm"):
            _check_number(name, getattr(self, name), positive=True)
        for name in ("kl_coef", "temperature", "policy_wait_ms", "target_tolerance"):
            _check_number(name, getattr(self, name), positive=False)
        if self.deadline_ms is not None:
            _check_number("deadline_ms", self.deadline_ms, positive=True)
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"--gamma must be in [0, 1], got {self.gamma!r}")
        try:
            env_kwargs = json.loads(self.env_kwargs)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--env-kwargs must be a JSON object, got {self.env_kwargs!r}: {exc}") from None
        if not isinstance(env_kwargs, dict):
            raise ValueError(
                f"--env-kwargs must be a JSON object of gym.make keyword arguments, got {self.env_kwargs!r}"
            )
        if self.temperature == 0:
            raise ValueError("--temperature must be > 0: policy-gradient learning needs sampled completions")
        if self.backend == "openai":
            if not self.base_url:
                raise ValueError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000)")
        elif self.base_url is not None:
            raise ValueError(f"--base-url is only used with --backend openai, got --backend {self.backend}")
        load_reward_plugin(self.reward)
        try:
            engine = json.loads(self.vllm_engine)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--vllm-engine must be a JSON object, got {self.vllm_engine!r}: {exc}") from None
        if not isinstance(engine, dict):
            raise ValueError(f"--vllm-engine must be a JSON object of vllm.LLM options, got {self.vllm_engine!r}")
        try:
            torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"--device: {exc}") from None


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"--{_flag(name)} must be an int >= {minimum}, got {value!r}")


def _check_number(name: str, value: Any, positive: bool) -> None:
    in_range = isinstance(value, (int, float)) and (value > 0 if positive else value >= 0) and value < math.inf
    if isinstance(value, bool) or not in_range:
        raise ValueError(f"--{_flag(name)} must be a finite number {'>' if positive else '>='} 0, got {value!r}")


def load_reward_plugin(spec: str) -> str:
    """Makes ``--reward`` usable by name: ``module:name`` imports ``module``, then registers its
    attribute ``name`` (or the plugin the import registered as ``name``) under ``spec`` itself.
    A plain name is returned as is (an unknown one fails when it first scores). Returns ``spec``.

    Raises:
        ValueError: naming the module imported and what was missing in it.

    Example:
        >>> load_reward_plugin("asyncvec.lm.rewards:exact_answer")
        'asyncvec.lm.rewards:exact_answer'
        >>> rewards.score("asyncvec.lm.rewards:exact_answer", "1+1=", "2")
        1.0
    """
    module_name, _, name = spec.rpartition(":")
    if not module_name:
        return spec
    if not name:
        raise ValueError(f"--reward {spec!r}: expected module:name, the name of a reward function after the colon")
    module = import_user_module(module_name, f"--reward {spec!r}: importing {module_name!r}")
    if hasattr(module, name):
        plugin = getattr(module, name)
    elif name in rewards.available():
        plugin = rewards.get(name)
    else:
        raise ValueError(
            f"--reward {spec!r}: imported {module_name!r}, but it has no attribute {name!r} and registered no "
            f"reward plugin {name!r} (registered plugins: {', '.join(rewards.available())})"
        )
    if not callable(plugin):
        raise ValueError(
            f"--reward {spec!r}: {module_name}.{name} is a {type(plugin).__name__}, not a reward function "
            "f(prompt, completion, **info) -> float"
        )
    if spec not in rewards.available() or rewards.get(spec) is not plugin:
        rewards.register(spec, replace=True)(plugin)
    return spec


# ------------------------------------------------------------------------------------ prompts
def make_prompt_env(env_id: str) -> gym.Env:
    """Makes ``env_id`` after checking it is a one-step text task (a prompt in, a completion out).

    Raises:
        ValueError: unknown id (close matches named), observation or action space not
            ``gymnasium.spaces.Text``, or an episode that does not end after one step.

    Example:
        >>> make_prompt_env("asyncvec/SingleDigitSums-v0").reset(seed=0)[0]
        '8+6='
    """
    check_env_id(env_id)
    env = gym.make(env_id)
    try:
        for role, space in (("observation", env.observation_space), ("action", env.action_space)):
            if not isinstance(space, gym.spaces.Text):
                raise ValueError(
                    f"{env_id}: the LM agents need a gymnasium.spaces.Text {role} space (prompts in, "
                    f"completions out), got {space}"
                )
        env.reset(seed=0)
        _, _, terminated, truncated, _ = env.step("0")
        if not (terminated or truncated):
            raise ValueError(
                f"{env_id}: the LM agents train on one-step tasks (prompt -> completion -> reward), "
                "but its episode did not end after one step"
            )
    except BaseException:
        env.close()
        raise
    return env


def iter_prompts(env: gym.Env, seed: int) -> Iterator[str]:
    """Endless prompts: the env's reset observations, the first one seeded.

    Example:
        >>> prompts = iter_prompts(make_prompt_env("asyncvec/SingleDigitSums-v0"), seed=0)
        >>> next(prompts), next(prompts)
        ('8+6=', '5+2=')
    """
    obs, _ = env.reset(seed=seed)
    while True:
        yield obs
        obs, _ = env.reset()


def check_reward(reward: str, env_id: str, prompt: str) -> None:
    """Scores one completion of ``prompt`` so a plugin that cannot score the env fails at start."""
    try:
        rewards.score(reward, prompt, "0")
    except Exception as exc:
        raise ValueError(f"--reward {reward!r} cannot score {env_id} prompts like {prompt!r}: {exc}") from exc


def completion_with_answer(text: str) -> str | None:
    """The policy's action parser: the completion if it starts with an integer, else None (rejected).

    Example:
        >>> completion_with_answer(" 7"), completion_with_answer("x")
        (' 7', None)
    """
    return text if rewards.parse_leading_int(text) is not None else None


# ------------------------------------------------------------------------------ model, policy
def prepare_model(args: LMArgs, workdir: Path) -> Path:
    """The model folder to train: ``--model`` (or a fresh tiny GPT-2 in ``workdir``), after a
    supervised warm start of ``--sft-steps`` on the env's solved prompts (saved in ``workdir/sft``).

    Example:
        >>> import tempfile
        >>> prepare_model(LMArgs(sft_steps=2), Path(tempfile.mkdtemp())).name
        'sft'
    """
    model_dir = Path(args.model) if args.model else inference.build_tiny_lm(workdir / "tiny-lm", seed=args.seed)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"--model {model_dir}: no such folder (a save_pretrained model with its tokenizer)")
    if not args.sft_steps:
        return model_dir
    examples = solved_prompts(args.env, args.seed)
    return sft_warm_start(model_dir, workdir / "sft", examples, args.sft_steps, batch_size=32, seed=args.seed)


def solved_prompts(env_id: str, seed: int) -> Iterator[tuple[str, str]]:
    """Endless ``(prompt, answer)`` pairs of an arithmetic env, for :func:`asyncvec.lm.sft_warm_start`.

    Example:
        >>> next(solved_prompts("asyncvec/SingleDigitSums-v0", seed=0))
        ('8+6=', '14')
    """
    with make_prompt_env(env_id) as env:
        for prompt in iter_prompts(env, seed):
            answer = rewards.solve_arithmetic(prompt)
            if answer is None:
                raise ValueError(f"--sft-steps: {env_id} prompt {prompt!r} is not an arithmetic problem 'a+b='")
            yield prompt, str(answer)


def served_model_name(base_url: str, model_dir: Path) -> str:
    """The model name to ask ``base_url`` for when --served-model is not given.

    The server's one model at ``/v1/models`` (vLLM serves ``--model`` as given, a path, unless
    ``--served-model-name`` says otherwise); with several, the one named like ``model_dir``.
    A server that cannot be asked gets ``model_dir``'s name (the server check then says why).
    """
    import httpx

    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10.0)
        served = [entry["id"] for entry in response.json()["data"]]
    except Exception:
        return model_dir.name
    if len(served) == 1:
        return served[0]
    for name in served:
        if name in (model_dir.name, str(model_dir)) or Path(name).name == model_dir.name:
            return name
    raise ValueError(f"--base-url {base_url} serves {served}: pick one with --served-model")


def make_text_policy(
    args: LMArgs,
    model_dir: Path,
    action_space: gym.Space,
    weights_dir: Path | None = None,
    action_parser: Any = completion_with_answer,
) -> Any:
    """The policy sampling completions: HFTextPolicy, VLLMPolicy or OpenAIPolicy (``--backend``).

    ``--backend openai`` writes each published version to ``weights_dir`` (``--weights-dir``
    if given), a folder the server must be able to read, and has the server load it.

    Example:
        >>> import tempfile
        >>> from asyncvec.inference import build_tiny_lm
        >>> folder = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32)
        >>> env = make_prompt_env("asyncvec/SingleDigitSums-v0")
        >>> with make_text_policy(LMArgs(max_new_tokens=2), folder, env.action_space) as policy:
        ...     len(policy.submit("3+4=").result(timeout=30).token_ids) <= 2
        True
    """
    options = {
        "action_space": action_space,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "max_batch_size": args.policy_batch_size,
        "max_wait_ms": args.policy_wait_ms,
        "deadline_ms": args.deadline_ms,
    }
    if args.backend == "hf":
        from asyncvec.inference import HFTextPolicy

        return HFTextPolicy(*load_causal_lm(model_dir, args.device), action_parser, seed=args.seed, **options)
    if args.backend == "vllm":
        from asyncvec.inference import VLLMPolicy

        engine = {"seed": args.seed, **json.loads(args.vllm_engine)}
        return VLLMPolicy(model_dir, action_parser, engine_kwargs=engine, **options)
    from asyncvec.inference import OpenAIPolicy

    token = args.update_token if args.update_token is not None else os.environ.get("ASYNCVEC_SERVE_TOKEN")
    policy = OpenAIPolicy(
        args.base_url,
        args.served_model or served_model_name(args.base_url, model_dir),
        action_parser,
        server_kind=args.server_kind,
        update_token=token,
        checkpoint_dir=args.weights_dir or weights_dir,
        model_dir=model_dir,
        max_attempts=3,
        **options,
    )
    try:
        policy.check_server()
    except Exception as exc:
        policy.close()
        raise ValueError(f"--base-url {args.base_url} (--server-kind {args.server_kind}): {exc}") from exc
    return policy


def starting_version(policy: Any) -> int:
    """The newest version the policy or its server holds: the learner publishes its starting
    weights as the next one when it sends them, so versions keep increasing across runs."""
    server_version = policy.server_version() if hasattr(policy, "server_version") else None
    return max(policy.policy_version, server_version or 0)


@dataclass
class LMParts:
    """What an LM agent trains with, built by :func:`build_parts`; ``resources.close()`` closes it all."""

    model_dir: Path
    """the model folder the learner started from (``--model``, or the scratch folder's after a warm start)"""
    learner: Any
    tokenizer: Any
    reference: Any | None
    """the frozen starting model, for the KL penalty (None when ``--kl-coef`` is 0)"""
    rewarder: RewardService | None
    """None for multi-turn envs (their rewards are the env's)"""
    policy: Any
    versions: VersionManager
    start_version: int
    """the version of the learner's starting weights on the policy"""
    collector: GroupCollector | EpisodeCollector
    eval_env: gym.Env | None
    resources: contextlib.ExitStack
    """closes the collector, the version manager, the policy (when built here), the reward
    service, the scratch folder and the envs, in that order"""
    multi_turn: bool = False
    """--env is multi-turn: the collector is an EpisodeCollector over ``envs``"""
    eval_envs: Any = None
    """multi-turn: the vector env evaluation episodes run in"""
    eval_log: list[dict[str, float]] = field(default_factory=list)
    """multi-turn: each evaluation's mean reward, success rate and mean turns"""


MULTI_TURN_PROBES = ("0", "?")
"""The one-step completions ``is_multi_turn`` tries, each from a fresh reset."""


def is_multi_turn(env_id: str, env_kwargs: dict[str, Any]) -> bool:
    """Whether ``env_id`` is a text env whose episode goes on after one step: its
    ``metadata["multi_turn"]`` when it says, else whether the episode goes on after one step of
    any of ``MULTI_TURN_PROBES`` (an env that ends on both is taken for a one-step env).

    Raises ``ValueError`` naming the wrapper to use when it is not a text env.

    Example:
        >>> is_multi_turn("asyncvec/GuessNumber-v0", {}), is_multi_turn("asyncvec/SingleDigitSums-v0", {})
        (True, False)
    """
    check_env_id(env_id)
    with contextlib.closing(gym.make(env_id, **env_kwargs)) as env:
        try:
            check_text_env(env, env_id)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        if "multi_turn" in env.metadata:
            return bool(env.metadata["multi_turn"])
        for probe in MULTI_TURN_PROBES:  # a one-step env ends on anything; "0" may be a multi-turn env's final answer
            env.reset(seed=0)
            _, _, terminated, truncated, _ = env.step(probe)
            if not (terminated or truncated):
                return True
        return False


def expert_conversations(
    args: LMArgs, tokenizer: Any, max_context_tokens: int | None = None
) -> Iterator[tuple[list[int], str]]:
    """Endless ``(prompt ids, answer)`` pairs of a multi-turn env played by its own expert
    (``env.unwrapped.expert_completion()``), rendered as the collector renders them, for
    :func:`asyncvec.lm.sft_warm_start`: a prompt over ``max_context_tokens - --max-new-tokens``
    ends the expert's episode there (``--on-overflow truncate``) or drops its oldest turns
    (``drop_oldest``), as ``EpisodeCollector`` does."""
    env = gym.make(args.env, **json.loads(args.env_kwargs))
    try:
        expert = env.get_wrapper_attr("expert_completion")
    except AttributeError:
        expert = None
    if not callable(expert):
        env.close()
        raise ValueError(f"--sft-steps: {args.env} has no expert_completion() to imitate (multi-turn warm start)")
    with contextlib.closing(env):
        for episode in itertools.count():
            obs, _ = env.reset(seed=args.seed * 1_000_003 + episode + 10**7)
            chat = Conversation(tokenizer, args.system_prompt)
            done = False
            while not done:
                chat.add_observation(obs)
                if max_context_tokens is not None and len(chat) > max_context_tokens - args.max_new_tokens:
                    shorter = (
                        chat.fit(max_context_tokens - args.max_new_tokens)
                        if args.on_overflow == "drop_oldest"
                        else None
                    )
                    if shorter is None and chat.num_turns == 0:
                        raise ValueError(
                            f"--sft-steps: the first prompt of {args.env} ({len(chat)} tokens) leaves no room for "
                            f"--max-new-tokens {args.max_new_tokens} in the model's {max_context_tokens} positions"
                        )
                    if shorter is None:
                        break  # the collector ends such an episode truncated
                    chat = shorter
                answer = expert()
                yield list(chat.ids), answer
                chat.add_completion(tokenizer(answer).input_ids + [tokenizer.eos_token_id], answer)
                obs, _, terminated, truncated, _ = env.step(answer)
                done = terminated or truncated


def check_given_policy(policy: Any, args: LMArgs) -> None:
    """A policy passed in must sample as the learner scores: at ``--temperature``, without top-p
    (the learner's log-probs, hence the importance weights, assume both).

    Example:
        >>> from asyncvec.inference.types import TextPrompt
        >>> class Given: defaults = TextPrompt("-", 8, 0.7, None)
        >>> check_given_policy(Given(), LMArgs(temperature=0.7))
        >>> check_given_policy(Given(), LMArgs())
        Traceback (most recent call last):
        ...
        ValueError: the given policy samples at temperature 0.7, but --temperature is 1.0: the learner's log-probs (and importance weights) would be those of another distribution; build the policy with temperature=1.0 or pass --temperature 0.7
    """
    defaults = getattr(policy, "defaults", None)
    if defaults is None:
        return  # not a TextPolicy: nothing to compare
    if defaults.temperature != args.temperature:
        raise ValueError(
            f"the given policy samples at temperature {defaults.temperature}, but --temperature is {args.temperature}: "
            "the learner's log-probs (and importance weights) would be those of another distribution; build the "
            f"policy with temperature={args.temperature} or pass --temperature {defaults.temperature}"
        )
    if defaults.top_p is not None and defaults.top_p < 1.0:
        raise ValueError(
            f"the given policy samples with top_p={defaults.top_p}, which the learner's log-probs do not model: "
            "build it without top_p"
        )


def build_episode_parts(args: LMArgs, run_name: str, policy: Any | None = None) -> LMParts:
    """:func:`build_parts` for a multi-turn env: an ``AsyncLLMVectorEnv`` of ``--num-envs`` envs
    and an ``EpisodeCollector`` (``--group-size`` episodes per reset seed) instead of prompts,
    a reward service and a ``GroupCollector``. The rewards are the env's."""
    if args.is_level == "sequence":
        raise ValueError("--is-level sequence weighs whole completions; multi-turn episodes use --is-level token")
    env_kwargs = json.loads(args.env_kwargs)
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"asyncvec-{run_name}-")))
        if args.model:
            model_dir = Path(args.model)
            if not model_dir.is_dir():
                raise FileNotFoundError(
                    f"--model {model_dir}: no such folder (a save_pretrained model with its tokenizer)"
                )
        else:  # conversations need a longer context than one-step prompts
            model_dir = inference.build_tiny_lm(workdir / "tiny-lm", seed=args.seed, max_positions=512)
        if args.sft_steps:
            model, tokenizer = load_causal_lm(model_dir)  # the context as HFTextPolicy reads it
            examples = expert_conversations(args, tokenizer, getattr(model.config, "max_position_embeddings", None))
            model_dir = sft_warm_start(
                model_dir, workdir / "sft", examples, args.sft_steps, batch_size=32, seed=args.seed
            )
        learner, tokenizer = load_causal_lm(model_dir, args.device)
        reference = load_causal_lm(model_dir, args.device)[0].requires_grad_(False) if args.kl_coef > 0 else None
        envs = stack.enter_context(make_text_vector_env(args.env, args.num_envs, env_kwargs=env_kwargs))
        eval_envs = stack.enter_context(make_text_vector_env(args.env, min(args.num_envs, 8), env_kwargs=env_kwargs))
        sync = policy is not None or args.backend == "openai"
        if policy is not None:
            check_given_policy(policy, args)
        else:
            # Each env waits for one turn at a time, so at most --num-envs requests queue: a larger
            # batch threshold would only add --policy-wait-ms to every turn.
            batching = dataclasses.replace(args, policy_batch_size=min(args.policy_batch_size, args.num_envs))
            policy = stack.enter_context(
                make_text_policy(batching, model_dir, text_space(), workdir / "weights", action_parser=str)
            )
        versions = stack.enter_context(
            VersionManager(initial_version=starting_version(policy) + sync, max_lag=args.max_staleness)
        )
        if sync:
            policy.load_weights(
                {k: v.detach().clone() for k, v in learner.state_dict().items()}, versions.current_version
            )
        versions.register(LaggedWeights(policy, args.policy_lag))
        collector = stack.enter_context(
            EpisodeCollector(
                envs, policy, args.group_size, tokenizer=tokenizer, system_prompt=args.system_prompt,
                max_new_tokens=args.max_new_tokens, seed=args.seed * 1_000_003,
                on_overflow=args.on_overflow,
            )
        )  # fmt: skip
        return LMParts(
            model_dir, learner, tokenizer, reference, None, policy, versions, versions.current_version,
            collector, None, stack.pop_all(), multi_turn=True, eval_envs=eval_envs,
        )  # fmt: skip


def build_parts(args: LMArgs, run_name: str, policy: Any | None = None) -> LMParts:
    """Prompts (``--env``), the model (``--model``, ``--sft-steps``), the learner and its reference,
    the reward service, the policy (``--backend``, unless ``policy`` is given), the version
    manager and the group collector. What fails on the way closes what was built before it.

    A server (``--backend openai``) or a given policy may hold other weights than the learner's
    (another run's, or the model before the warm start), so the learner's starting weights are
    sent to it first, as its newest version + 1.
    """
    if is_multi_turn(args.env, json.loads(args.env_kwargs)):
        return build_episode_parts(args, run_name, policy)
    with contextlib.ExitStack() as stack:
        env = stack.enter_context(make_prompt_env(args.env))
        eval_env = stack.enter_context(make_prompt_env(args.env))
        check_reward(args.reward, args.env, env.reset(seed=args.seed)[0])
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"asyncvec-{run_name}-")))
        model_dir = prepare_model(args, workdir)
        learner, tokenizer = load_causal_lm(model_dir, args.device)
        reference = load_causal_lm(model_dir, args.device)[0].requires_grad_(False) if args.kl_coef > 0 else None
        rewarder = stack.enter_context(
            RewardService(
                args.reward,
                timeout_s=args.reward_timeout_s,
                num_workers=args.reward_workers,
                cache_size=args.reward_cache_size,
            )
        )
        sync = policy is not None or args.backend == "openai"
        if policy is not None:
            check_given_policy(policy, args)
        else:
            policy = stack.enter_context(make_text_policy(args, model_dir, env.action_space, workdir / "weights"))
        versions = stack.enter_context(
            VersionManager(initial_version=starting_version(policy) + sync, max_lag=args.max_staleness)
        )
        if sync:
            policy.load_weights(
                {k: v.detach().clone() for k, v in learner.state_dict().items()}, versions.current_version
            )
        versions.register(LaggedWeights(policy, args.policy_lag))
        collector = stack.enter_context(GroupCollector(policy, rewarder, iter_prompts(env, args.seed), args.group_size))
        return LMParts(
            model_dir,
            learner,
            tokenizer,
            reference,
            rewarder,
            policy,
            versions,
            versions.current_version,
            collector,
            eval_env,
            stack.pop_all(),
        )


def mean_reward(parts: LMParts, num_prompts: int, seed: int, timeout_s: float) -> float:
    """Mean reward of one sampled completion for each of ``num_prompts`` prompts of ``eval_env``
    (the same prompts for a given ``seed``); nan when ``num_prompts`` is 0."""
    if num_prompts == 0:
        return float("nan")
    if parts.multi_turn:
        return evaluate_episodes(parts, num_prompts, seed, timeout_s)["reward"]
    prompts = list(itertools.islice(iter_prompts(parts.eval_env, seed), num_prompts))
    scored = score_completions(parts.policy, parts.rewarder, prompts, timeout_s)
    return float(np.mean(scored)) if scored else float("nan")


def evaluate_episodes(parts: LMParts, num_episodes: int, seed: int, timeout_s: float) -> dict[str, float]:
    """Multi-turn: ``num_episodes`` held-out episodes (the same for a given ``seed``) played by the
    policy; their mean return, success rate (terminated with a positive last reward) and mean
    turns, also appended to ``parts.eval_log``."""
    collector = EpisodeCollector(
        parts.eval_envs, parts.policy, 1, tokenizer=parts.tokenizer, system_prompt=parts.collector.system_prompt,
        max_new_tokens=parts.collector.max_new_tokens, seed=10**9 + seed * 10_007,
        on_overflow=parts.collector.on_overflow,
    )  # fmt: skip
    with collector:
        batch = collector.collect(num_episodes, timeout=timeout_s * max(1, num_episodes // 8))
    data = EpisodeBatch.from_episodes(batch, parts.policy.policy_version, max_staleness=10**9)
    stats = {key: data.info[key] for key in ("reward", "success", "turns_mean")}
    parts.eval_log.append(stats)
    return stats


def batch_sizes(groups: Any) -> tuple[int, int]:
    """``(groups, samples)`` of a popped batch: completions, or turns of multi-turn episodes."""
    if isinstance(groups, EpisodeGroups):
        return len(groups), groups.num_turns
    return len(groups.prompt_ids), int(groups.rewards.size)


# ------------------------------------------------------------------------------------ results
@dataclass
class LMTrainResult:
    """What an LM agent's ``train`` returns: the reward curve, speed and sample accounting.

    Fractions are over all completions received: ``stale_fraction`` dropped for staleness,
    ``flagged_fraction`` with a flagged reward, ``fallback_fraction`` rejected by the action
    parser (unparsable, still trained on), ``missed_deadline_fraction`` answered by the
    deadline fallback (never trained on); ``truncated_fraction`` is the share of importance
    weights (tokens or sequences, per ``is_level``) clipped at ``is_cap``. ``start_version`` is
    the version of the learner's starting weights on the policy (0 for a policy built from the
    model; a server's version + 1 after they were sent to it), ``final_version`` the last one.
    """

    updates: int
    prompts: int
    samples: int
    wall_time_s: float
    samples_per_s: float
    reward_curve: list[float]
    eval_reward_before: float
    eval_reward_after: float
    stale_fraction: float
    truncated_fraction: float
    flagged_fraction: float
    fallback_fraction: float
    missed_deadline_fraction: float
    staleness_mean: float
    start_version: int
    final_version: int
    reached_target: bool
    history: list[dict] = field(default_factory=list)
    eval_details: list[dict[str, float]] = field(default_factory=list)
    """multi-turn envs: each evaluation's reward, success rate and mean turns (before, after)"""
    target_confirmations: list[float] = field(default_factory=list)
    """``--target-reward``: the mean reward of each batch sampled by the final weights of the
    moment to confirm it (the last one confirmed it when ``reached_target``)"""

    @classmethod
    def from_run(
        cls,
        history: list[dict],
        collector_stats: dict[str, float],
        wall_time_s: float,
        evals: tuple[float, float],
        staleness_mean: float,
        versions: tuple[int, int],
        reached_target: bool,
    ) -> LMTrainResult:
        """Totals of a run from its per-update rows (``history``) and the collector's counters."""
        samples = int(collector_stats["samples"])
        received = max(sum(row["samples_received"] for row in history), 1)
        is_entries = max(sum(row["is/entries"] for row in history if "is/entries" in row), 1)
        return cls(
            updates=len(history),
            prompts=int(sum(row["groups"] for row in history)),
            samples=samples,
            wall_time_s=wall_time_s,
            samples_per_s=samples / wall_time_s,
            reward_curve=[row["reward"] for row in history],
            eval_reward_before=evals[0],
            eval_reward_after=evals[1],
            stale_fraction=sum(row["stale_samples"] for row in history) / received,
            truncated_fraction=sum(row.get("is/clipped", 0) for row in history) / is_entries,
            flagged_fraction=collector_stats["flagged"] / max(samples, 1),
            fallback_fraction=collector_stats["rejected"] / max(samples, 1),
            missed_deadline_fraction=collector_stats["missed_deadlines"] / max(samples, 1),
            staleness_mean=staleness_mean,
            start_version=versions[0],
            final_version=versions[1],
            reached_target=reached_target,
            history=history,
        )


def target_reached(reward_curve: list[float], target: float | None) -> bool:
    """Whether the mean training reward of the last ``TARGET_WINDOW`` updates reaches ``target``."""
    recent = [r for r in reward_curve[-TARGET_WINDOW:] if not math.isnan(r)]
    return target is not None and len(recent) == TARGET_WINDOW and float(np.mean(recent)) >= target


@dataclass
class TargetCheck:
    """What :func:`confirm_target` found: ``batch`` (None once the budget ran out) is the batch
    sampled entirely by the current weights, ``reward`` its mean reward, ``popped`` the prompts
    (groups) it took, older batches dropped on the way included."""

    confirmed: bool
    batch: Any | None
    reward: float
    popped: int


def confirm_target(parts: LMParts, args: LMArgs, prompts_left: int) -> TargetCheck:
    """After :func:`target_reached`: whether a batch sampled entirely by the current weights (no
    update in between) reaches ``args.target_reward - args.target_tolerance``.

    Why: the training reward of an update is that of weights an update or two older (async mode
    samples ahead of the learner), so one bad last update would go unseen. Batches holding older
    samples (in flight when the weights changed) are popped and dropped on the way; the run trains
    on a batch that falls short.
    """
    current = parts.versions.current_version
    popped = 0
    while prompts_left - popped >= args.prompts_per_update:
        if args.mode == "sync":
            parts.collector.submit(args.prompts_per_update)
        batch = parts.collector.pop(args.prompts_per_update, args.timeout_s)
        popped += args.prompts_per_update
        if int(np.max(batch.staleness(current), initial=0)) == 0:
            if parts.multi_turn:
                reward = EpisodeBatch.from_episodes(batch, current, max_staleness=0).info["reward"]
            else:
                reward = LMBatch.from_groups(batch, parts.tokenizer, current, max_staleness=0).info["reward"]
            return TargetCheck(reward >= args.target_reward - args.target_tolerance, batch, reward, popped)
    return TargetCheck(False, None, float("nan"), popped)


# ------------------------------------------------------------------------------------ the agents' loop
class LMAgent(abc.ABC):
    """What RLOO and REINFORCE++ share: the parts (:func:`build_parts`), one update on complete
    groups (truncated importance weights against the behavior log-probs, then the agent's loss),
    publishing, evaluation and the training loop. An agent sets ``name`` and ``min_group_samples``
    and defines ``compute_advantages`` and ``policy_loss``. ``train()`` closes everything;
    otherwise use it as a context manager or call ``close()``."""

    name = "lm"
    """in the run's name (its TensorBoard folder)"""
    min_group_samples = 1
    """trainable samples a group needs to be trained on (RLOO's leave-one-out baseline needs 2)"""

    def __init__(self, args: LMArgs, policy: Any | None = None) -> None:
        """``policy``: a text policy to sample from instead of one built from ``--backend`` (it
        stays open after the run); the learner's starting weights are published to it first."""
        self.args = args
        check_installed(
            "transformers", extra="hf", feature=f"agents/{self.name}.py (its learner is a transformers model)"
        )
        seed_everything(args.seed)
        if args.backend != "vllm":  # an in-process vLLM engine on the CPU binds the torch threads itself
            torch.set_num_threads(args.torch_threads)
        quiet_model_libraries()
        self.run_name = f"{args.env.replace('/', '_')}__{self.name}__{args.mode}__{args.seed}__{int(time.time())}"
        # the prompts, the (warm-started) model, the learner and its frozen reference, the reward
        # service, the policy, the version manager and the group collector (see agents/lm_setup.py)
        self.parts = build_parts(args, self.run_name, policy)
        self.learner, self.tokenizer, self.reference = self.parts.learner, self.parts.tokenizer, self.parts.reference
        self.policy, self.versions, self.collector = self.parts.policy, self.parts.versions, self.parts.collector
        self.optimizer = torch.optim.Adam(self.learner.parameters(), lr=args.learning_rate)

    @abc.abstractmethod
    def compute_advantages(self, data: LMBatch, logp: torch.Tensor, ref_logp: torch.Tensor | None) -> torch.Tensor:
        """``[N, L]`` advantages of ``data``'s tokens (0 off the mask)."""

    @abc.abstractmethod
    def policy_loss(self, logp, prox_logp, advantages, weights, mask):
        """``(loss, stats)`` of a minibatch's rows."""

    # ------------------------------------------------------------------ one update
    def prepare(self, groups: GroupBatch | EpisodeGroups) -> LMBatch | EpisodeBatch:
        """The trainable completions (or episode turns) of ``groups`` as tensors; records their staleness and the drops."""
        current = self.versions.current_version
        self.versions.record_staleness(groups.staleness(current).ravel().tolist())
        if isinstance(groups, EpisodeGroups):  # multi-turn: a row per episode, stale turns masked one by one
            data = EpisodeBatch.from_episodes(
                groups, current, self.args.max_staleness, self.args.gamma, self.min_group_samples, self.args.device
            )
            self.versions.record_dropped(int(data.info["stale_samples"]))
            return data
        data = LMBatch.from_groups(
            groups, self.tokenizer, current, self.args.max_staleness, self.min_group_samples, self.args.device
        )
        self.versions.record_dropped(int(data.info["stale_samples"]))
        return data

    def update(self, groups: GroupBatch | EpisodeGroups) -> dict[str, float]:
        """One learner update on complete groups; returns its statistics (no publish)."""
        args = self.args
        data = self.prepare(groups)
        num_groups, received = batch_sizes(groups)
        stats = {**data.info, "groups": num_groups, "samples_received": received}
        if not len(data):
            return stats
        # pi_prox: the learner at update start. One pass over one minibatch reuses its graph.
        single_pass = args.update_epochs == 1 and args.num_minibatches == 1
        with torch.set_grad_enabled(single_pass):
            logp = data.logps(self.learner, args.temperature)
        prox = logp.detach()
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = data.logps(self.reference, args.temperature)
        advantages = self.compute_advantages(data, prox, ref)
        # Truncated IS of pi_prox against the engine's behavior log-probs mu.
        weights, is_stats = truncated_importance_weights(
            prox, data.behavior_logp, args.is_cap, level=args.is_level, mask=data.mask
        )
        if args.is_level == "sequence":
            weights = weights.unsqueeze(-1) * data.mask
        losses = minibatch_updates(
            data,
            self.learner,
            self.optimizer,
            lambda logp_rows, rows: self.policy_loss(
                logp_rows, prox[rows], advantages[rows], weights[rows], data.mask[rows]
            ),
            epochs=args.update_epochs,
            minibatches=args.num_minibatches,
            max_grad_norm=args.max_grad_norm,
            temperature=args.temperature,
            logp=logp if single_pass else None,
        )
        entries = len(data) if args.is_level == "sequence" else int(data.mask.sum())
        stats.update({f"losses/{k}": v for k, v in losses.items()})
        stats.update({f"is/{k}": float(v) for k, v in is_stats.items()})
        stats.update({"is/entries": entries, "is/clipped": round(float(is_stats["clipped_fraction"]) * entries)})
        stats["advantage_abs_mean"] = float(advantages.abs()[data.mask].mean())
        if ref is not None:
            stats["kl_ref"] = float(((prox - ref) * data.mask).sum(-1).mean())
        return stats

    def learner_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.learner.state_dict().items()}

    def publish(self) -> int:
        """Sends the learner's weights to the policy (``policy.load_weights``); returns the new version."""
        return self.versions.publish(self.learner_weights())

    def evaluate(self, num_prompts: int) -> float:
        """Mean reward of one sampled completion for each of ``num_prompts`` held-out prompts."""
        return mean_reward(self.parts, num_prompts, self.args.seed + 1, self.args.timeout_s)

    # ------------------------------------------------------------------ the loop
    def train(self) -> LMTrainResult:
        """Trains on ``total_prompts`` prompts (or until ``target_reward``) and closes everything."""
        args = self.args
        logger = RunLogger(
            Path(args.log_dir) / self.run_name,
            track=args.track,
            total_steps=args.total_prompts,
            progress=args.progress,
            hparams=asdict(args),
        )
        history: list[dict] = []
        confirmations: list[float] = []
        reached = False
        try:
            eval_before = self.evaluate(args.eval_prompts)
            start = time.monotonic()
            if args.mode == "async":  # generation runs ahead while the learner trains
                self.collector.start(args.total_prompts, ahead=args.prefetch_updates * args.prompts_per_update)
            prompts_done = 0
            pending = None  # a batch that failed to confirm the target, trained on next
            while prompts_done < args.total_prompts or pending is not None:
                waited = time.monotonic()
                if pending is None:
                    num = min(args.prompts_per_update, args.total_prompts - prompts_done)
                    if args.mode == "sync":
                        self.collector.submit(num)
                    groups = self.collector.pop(num, args.timeout_s)
                    prompts_done += num
                else:
                    groups, pending = pending, None
                learned = time.monotonic()
                stats = self.update(groups)
                published = time.monotonic()
                if stats["samples_used"]:  # no step, no new version
                    self.publish()
                elapsed = time.monotonic() - start
                row = {
                    **stats,
                    "time/wait_s": learned - waited,
                    "time/learn_s": published - learned,
                    "time/publish_s": elapsed + start - published,
                    "charts/reward": stats["reward"],
                    "charts/version": self.versions.current_version,
                    "charts/completions_per_s": self.collector.samples / elapsed,
                    "time/wall_s": elapsed,
                    "charts/policy_latency_p50_ms": self.policy.stats()["latency_p50_ms"],
                }
                history.append(row)
                logger.log(row, prompts_done)
                if target_reached([r["reward"] for r in history], args.target_reward):
                    check = confirm_target(self.parts, args, args.total_prompts - prompts_done)
                    prompts_done += check.popped
                    confirmations.append(check.reward)
                    logger.log({"charts/target_confirm_reward": check.reward}, prompts_done)
                    if check.confirmed or check.batch is None:
                        reached = check.confirmed
                        break
                    pending = check.batch
            wall = time.monotonic() - start
            self.collector.stop()
            eval_after = self.evaluate(args.eval_prompts)
            eval_details = list(self.parts.eval_log)
            if args.output_dir:
                self.learner.save_pretrained(args.output_dir)
                self.tokenizer.save_pretrained(args.output_dir)
        finally:
            logger.close()
            self.close()
        result = LMTrainResult.from_run(
            history,
            self.collector.stats(),
            wall,
            (eval_before, eval_after),
            self.versions.staleness_stats().mean,
            (self.parts.start_version, self.versions.current_version),
            reached,
        )
        result.eval_details, result.target_confirmations = eval_details, confirmations
        return result

    def close(self) -> None:
        """Stops generation; closes the policy, the reward service and the envs (reverse order)."""
        self.parts.resources.close()

    def __enter__(self) -> LMAgent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def eval_line(before: float, after: float) -> str:
    """The summary's eval line; an evaluation that was not run (nan: ``--eval-prompts 0``) says so.

    Example:
        >>> eval_line(float("nan"), float("nan"))
        'eval reward: not measured (no eval completion was scored; --eval-prompts 0 skips it)'
    """
    if math.isnan(before) and math.isnan(after):
        return "eval reward: not measured (no eval completion was scored; --eval-prompts 0 skips it)"
    shown = ["not measured" if math.isnan(r) else f"{r:.3f}" for r in (before, after)]
    return f"eval reward before RL {shown[0]} -> after RL {shown[1]}"


def summary(name: str, result: LMTrainResult) -> str:
    """A one-paragraph report of a run, printed by the agents' CLIs and the demo."""
    curve = ", ".join(f"{r:.2f}" for r in result.reward_curve)
    return (
        (
            f"{name}: {result.updates} updates, {result.samples} completions in {result.wall_time_s:.1f} s "
            f"({result.samples_per_s:.0f} completions/s)\n"
            f"  reward curve (per update): [{curve}]\n"
            f"  {eval_line(result.eval_reward_before, result.eval_reward_after)}\n"
            f"  stale {result.stale_fraction:.1%}, IS-truncated {result.truncated_fraction:.1%}, "
            f"flagged {result.flagged_fraction:.1%}, unparsable {result.fallback_fraction:.1%}, "
            f"missed deadlines {result.missed_deadline_fraction:.1%}, "
            f"mean staleness {result.staleness_mean:.2f}, final version {result.final_version}"
        )
        + "".join(
            f"\n  eval {when}: success {d['success']:.3f}, mean turns {d['turns_mean']:.2f}"
            for when, d in zip(("before RL", "after RL"), result.eval_details)
        )
        + (
            f"\n  target {'reached' if result.reached_target else 'not confirmed'} (checked on batches sampled by the "
            f"weights of the moment: [{', '.join(f'{r:.2f}' for r in result.target_confirmations)}])"
            if result.target_confirmations
            else ""
        )
    )
