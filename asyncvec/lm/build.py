"""What a language-model agent trains with, built from its options (:class:`~asyncvec.lm.options.LMArgs`):
the model folder (``--model`` or a tiny GPT-2, ``--sft-steps`` warm start), the learner and its frozen
reference, the text policy of ``--backend``, the version manager, and the collector: a
``GroupCollector`` over a one-step env's prompts, or an ``EpisodeCollector`` over a multi-turn env
(:func:`is_multi_turn`). :func:`build_parts` returns them as :class:`LMParts`.

Example:
    >>> from asyncvec.lm.build import is_multi_turn
    >>> is_multi_turn("asyncvec/GuessNumber-v0", {}), is_multi_turn("asyncvec/SingleDigitSums-v0", {})
    (True, False)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gymnasium as gym

from asyncvec import VersionManager, inference
from asyncvec.lm.backends import LM_BACKENDS
from asyncvec.lm.backends import served_model_name as served_model_name  # its old home: asyncvec.lm.build
from asyncvec.lm.episodes import EpisodeCollector, make_text_vector_env
from asyncvec.lm.groups import GroupCollector
from asyncvec.lm.learner import load_causal_lm, sft_warm_start
from asyncvec.lm.options import LMArgs
from asyncvec.lm.prompts import (
    check_reward_scores,
    completion_with_answer,
    expert_conversations,
    iter_prompts,
    make_prompt_env,
    solved_prompts,
)
from asyncvec.lm.rewards import RewardService
from asyncvec.lm.text_env import check_text_env, text_space
from asyncvec.runs import check_env_id

if TYPE_CHECKING:
    import torch


def is_multi_turn(env_id: str, env_kwargs: dict[str, Any]) -> bool:
    """Whether the agents play ``env_id``'s episodes turn by turn in a vector env
    (``EpisodeCollector``, the env's rewards) rather than take its reset observations as one-step
    prompts scored by ``--reward`` (``GroupCollector``).

    The env says so in ``metadata["multi_turn"]`` (``asyncvec.lm.TextEnv`` and the example envs of
    ``asyncvec.envs.text`` do). An env that declares nothing is played: an episode of one turn is
    an episode too, rewarded by the env. The env is made and closed, never reset or stepped.

    Raises:
        ValueError: unknown id, or not a text env (naming the wrapper to use).

    Example:
        >>> is_multi_turn("asyncvec/CalculatorTool-v0", {}), is_multi_turn("asyncvec/Arithmetic-v0", {})
        (True, False)
    """
    return declared_multi_turn(env_id, env_kwargs) is not False


def declared_multi_turn(env_id: str, env_kwargs: dict[str, Any]) -> bool | None:
    """``env_id``'s ``metadata["multi_turn"]`` (None when it declares nothing), after checking it is a text env.

    Example:
        >>> declared_multi_turn("asyncvec/GuessNumber-v0", {})
        True
    """
    check_env_id(env_id)
    with contextlib.closing(make_text_env(env_id, env_kwargs)) as env:
        try:
            check_text_env(env, env_id)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        declared = env.metadata.get("multi_turn")
    return None if declared is None else bool(declared)


def make_text_env(env_id: str, env_kwargs: dict[str, Any]) -> gym.Env:
    """``gym.make(env_id, **env_kwargs)``, with a ValueError naming the fix when the id's entry point is not a
    gymnasium env (a plain ``reset()``/``step(str)`` object: the StringEnv wrapper) or takes none of
    ``env_kwargs`` (``--env-kwargs``)."""
    try:
        return gym.make(env_id, **env_kwargs)
    except (TypeError, AttributeError) as exc:
        entry = gym.spec(env_id.rpartition(":")[2]).entry_point
        if isinstance(entry, str):
            try:
                entry = gym.envs.registration.load_env_creator(entry)
            except Exception:
                entry = None
        if isinstance(entry, type) and not issubclass(entry, gym.Env):
            name = entry.__name__
            raise ValueError(
                f"{env_id} is registered as {entry.__module__}.{name}, which is not a gymnasium env (no "
                f"observation_space and action_space); a plain reset()/step(str) object that returns strings runs "
                f"wrapped: register it with entry_point=lambda **kwargs: asyncvec.lm.StringEnv({name}(**kwargs))"
            ) from None
        if env_kwargs and isinstance(exc, TypeError):
            raise ValueError(
                f"{env_id}: gym.make({env_id!r}, **{env_kwargs}) failed: {exc}; fix or leave out --env-kwargs"
            ) from None
        raise


def prepare_model(args: LMArgs, workdir: Path, multi_turn: bool = False) -> Path:
    """The model folder to train: ``--model`` (or a fresh tiny GPT-2 in ``workdir``, with a 512-token
    context for ``multi_turn`` conversations), after a supervised warm start of ``--sft-steps``
    (saved in ``workdir/sft``) on the env's solved prompts, or on a multi-turn env's expert
    conversations (:func:`~asyncvec.lm.prompts.expert_conversations`).

    Example:
        >>> import tempfile
        >>> prepare_model(LMArgs(sft_steps=2), Path(tempfile.mkdtemp())).name
        'sft'
    """
    if args.model:
        model_dir = Path(args.model)
    else:  # conversations need a longer context than one-step prompts
        context = {"max_positions": 512} if multi_turn else {}
        model_dir = inference.build_tiny_lm(workdir / "tiny-lm", seed=args.seed, **context)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"--model {model_dir}: no such folder (a save_pretrained model with its tokenizer)")
    if not args.sft_steps:
        return model_dir
    if multi_turn:
        model, tokenizer = load_causal_lm(model_dir)  # the context as HFTextPolicy reads it
        examples: Any = expert_conversations(args, tokenizer, getattr(model.config, "max_position_embeddings", None))
    else:
        examples = solved_prompts(args.env, args.seed)
    return sft_warm_start(model_dir, workdir / "sft", examples, args.sft_steps, batch_size=32, seed=args.seed)


def make_text_policy(
    args: LMArgs,
    model_dir: Path,
    action_space: gym.Space,
    weights_dir: Path | None = None,
    action_parser: Any = completion_with_answer,
) -> Any:
    """The policy sampling completions: HFTextPolicy, VLLMPolicy or OpenAIPolicy (``--backend``, made by
    its entry in :data:`asyncvec.lm.backends.LM_BACKENDS`).

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
    if args.policy_inflight_batches is not None:
        options["max_inflight_batches"] = args.policy_inflight_batches
    return LM_BACKENDS[args.backend].make_policy(args, model_dir, action_parser, options, weights_dir)


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
    """closes the collector, the version manager, the policy (when built here), the scratch folder,
    the reward service and the envs, in that order"""
    multi_turn: bool = False
    """--env is multi-turn: the collector is an EpisodeCollector over ``envs``"""
    eval_envs: Any = None
    """multi-turn: the vector env evaluation episodes run in"""
    eval_log: list[dict[str, float]] = field(default_factory=list)
    """multi-turn: each evaluation's mean reward, success rate and mean turns"""


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


def version_manager(policy: Any, learner: torch.nn.Module, args: LMArgs, sync: bool) -> VersionManager:
    """The run's `VersionManager`, publishing to ``policy`` ``--policy-lag`` versions late. ``sync`` (a given
    policy or a server, whose weights may not be the learner's): the learner's weights are loaded first, as
    version ``starting_version(policy) + 1``."""
    versions = args.staleness.version_manager(initial_version=starting_version(policy) + sync)  # max_lag
    if sync:
        policy.load_weights({k: v.detach().clone() for k, v in learner.state_dict().items()}, versions.current_version)
    versions.register(args.staleness.lagged(policy))
    return versions


def build_parts(args: LMArgs, run_name: str, policy: Any | None = None, start_prompts: int = 0) -> LMParts:
    """Prompts (``--env``), the model (``--model``, ``--sft-steps``), the learner and its reference,
    the reward service, the policy (``--backend``, unless ``policy`` is given), the version
    manager and the group collector; for a multi-turn env (:func:`is_multi_turn`) what
    :func:`build_episode_parts` builds. What fails on the way closes what was built before it.

    A server (``--backend openai``) or a given policy may hold other weights than the learner's
    (another run's, or the model before the warm start), so the learner's starting weights are
    sent to it first, as its newest version + 1.

    ``start_prompts`` (a resumed run's prompts done): a one-step env's prompt stream starts after them, so a
    resumed run goes on with the prompts it had not reached.
    """
    env_kwargs = json.loads(args.env_kwargs)
    declared = declared_multi_turn(args.env, env_kwargs)
    if declared is not False:  # an env that declares nothing is played: see is_multi_turn
        if args.reward != LMArgs.reward:
            raise ValueError(
                f"--reward {args.reward} scores one-step prompts, but {args.env} is played turn by turn and "
                "rewarded by the env ("
                + ("it declares metadata['multi_turn'] = True" if declared else "it declares no metadata['multi_turn']")
                + "); a one-step env declares metadata['multi_turn'] = False to be scored by --reward"
            )
        return build_episode_parts(args, run_name, policy, start_prompts)
    return _build(args, run_name, policy, functools.partial(_prompt_side, skip=start_prompts), start_prompts)


def build_episode_parts(args: LMArgs, run_name: str, policy: Any | None = None, start_groups: int = 0) -> LMParts:
    """:func:`build_parts` for a multi-turn env: an ``AsyncLLMVectorEnv`` of ``--num-envs`` envs
    and an ``EpisodeCollector`` (``--group-size`` episodes per reset seed) instead of prompts,
    a reward service and a ``GroupCollector``. The rewards are the env's. ``start_groups`` (a resumed
    run's groups done): the reset seeds go on after the ones they used."""
    if args.is_level == "sequence":
        raise ValueError("--is-level sequence weighs whole completions; multi-turn episodes use --is-level token")
    return _build(args, run_name, policy, functools.partial(_episode_side, skip=start_groups), start_groups)


def sampling_seed(seed: int, prompts_done: int) -> int:
    """The seed of the policy's sampling: ``--seed``, and another one for a run resumed after
    ``prompts_done`` prompts, so that it does not draw the first run's samples again.

    Example:
        >>> sampling_seed(3, 0), sampling_seed(3, 0) == sampling_seed(3, 64)
        (3, False)
    """
    return seed if not prompts_done else (seed * 1_000_003 + prompts_done) % 2**31


@dataclass
class _EnvSide:
    """What one kind of env adds to the parts every agent builds the same way."""

    multi_turn: bool
    action_space: gym.Space
    action_parser: Any
    policy_args: LMArgs
    """the options the policy is made with"""
    make_collector: Callable[[Any, Any], Any]
    """``(policy, tokenizer) -> the collector``"""
    rewarder: RewardService | None = None
    eval_env: gym.Env | None = None
    eval_envs: Any = None


def _prompt_side(args: LMArgs, env_kwargs: dict[str, Any], stack: contextlib.ExitStack, skip: int = 0) -> _EnvSide:
    """A one-step env: its reset observations are the prompts (the reward plugin is tried on the
    first), scored on a reward service, k completions each by a ``GroupCollector``; the first ``skip``
    prompts of the stream left out (a resumed run's)."""
    env = stack.enter_context(make_prompt_env(args.env, env_kwargs))
    eval_env = stack.enter_context(make_prompt_env(args.env, env_kwargs))
    check_reward_scores(args.reward, args.env, env.reset(seed=args.seed)[0])
    rewarder = stack.enter_context(
        RewardService(
            args.reward,
            timeout_s=args.reward_timeout_s,
            num_workers=args.reward_workers,
            cache_size=args.reward_cache_size,
        )
    )

    def make_collector(policy: Any, tokenizer: Any) -> GroupCollector:
        prompts = itertools.islice(iter_prompts(env, args.seed), skip, None)
        seed = args.seed if LM_BACKENDS[args.backend].seeds_requests(args) else None
        return GroupCollector(policy, rewarder, prompts, args.group_size, seed=seed, first_prompt=skip)

    return _EnvSide(False, env.action_space, completion_with_answer, args, make_collector, rewarder, eval_env)


def _episode_side(args: LMArgs, env_kwargs: dict[str, Any], stack: contextlib.ExitStack, skip: int = 0) -> _EnvSide:
    """A multi-turn env: ``--num-envs`` of them (and up to 8 for evaluation) in vector envs, played
    by an ``EpisodeCollector``, k episodes per reset seed, rewarded by the env; the first ``skip``
    groups' reset seeds left out (a resumed run's)."""
    envs = stack.enter_context(make_text_vector_env(args.env, args.num_envs, env_kwargs=env_kwargs))
    eval_envs = stack.enter_context(make_text_vector_env(args.env, min(args.num_envs, 8), env_kwargs=env_kwargs))
    # Each env waits for one turn at a time, so at most --num-envs requests queue: a larger
    # batch threshold would only add --policy-wait-ms to every turn.
    batching = dataclasses.replace(args, policy_batch_size=min(args.policy_batch_size, args.num_envs))

    def make_collector(policy: Any, tokenizer: Any) -> EpisodeCollector:
        return EpisodeCollector(
            envs, policy, args.group_size, tokenizer=tokenizer, system_prompt=args.system_prompt,
            max_new_tokens=args.max_new_tokens, seed=args.seed * 1_000_003 + skip,
            sampling_seed=args.seed if LM_BACKENDS[args.backend].seeds_requests(args) else None,
            on_overflow=args.on_overflow,
        )  # fmt: skip

    return _EnvSide(True, text_space(), str, batching, make_collector, eval_envs=eval_envs)


def _build(
    args: LMArgs,
    run_name: str,
    policy: Any | None,
    env_side: Callable[[LMArgs, dict[str, Any], contextlib.ExitStack], _EnvSide],
    start_prompts: int,
) -> LMParts:
    """The one path of :func:`build_parts` and :func:`build_episode_parts`: the env's side, the model,
    the learner and its reference, the policy (sampling with :func:`sampling_seed`), the version manager,
    the collector."""
    with contextlib.ExitStack() as stack:
        side = env_side(args, json.loads(args.env_kwargs), stack)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"asyncvec-{run_name}-")))
        model_dir = prepare_model(args, workdir, side.multi_turn)
        learner, tokenizer = load_causal_lm(model_dir, args.device)
        reference = load_causal_lm(model_dir, args.device)[0].requires_grad_(False) if args.kl_coef > 0 else None
        sync = policy is not None or LM_BACKENDS[args.backend].needs_sync
        if policy is not None:
            check_given_policy(policy, args)
        else:
            policy = stack.enter_context(
                make_text_policy(
                    dataclasses.replace(side.policy_args, seed=sampling_seed(args.seed, start_prompts)),
                    model_dir,
                    side.action_space,
                    workdir / "weights",
                    side.action_parser,
                )
            )
        versions = stack.enter_context(version_manager(policy, learner, args, sync))
        collector = stack.enter_context(side.make_collector(policy, tokenizer))
        return LMParts(
            model_dir, learner, tokenizer, reference, side.rewarder, policy, versions, versions.current_version,
            collector, side.eval_env, stack.pop_all(), multi_turn=side.multi_turn, eval_envs=side.eval_envs,
        )  # fmt: skip
