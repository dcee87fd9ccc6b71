"""Where the language-model agents' training text comes from: a one-step env's prompts (and their
solved answers for a warm start), the answer check of the policy's completions, and a multi-turn
env's conversations played by its own expert.

Example:
    >>> from asyncvec.lm.prompts import iter_prompts, make_prompt_env
    >>> prompts = iter_prompts(make_prompt_env("asyncvec/SingleDigitSums-v0"), seed=0)
    >>> next(prompts)
    '8+6='
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium as gym

from asyncvec.lm import rewards
from asyncvec.lm.chat import Conversation
from asyncvec.lm.options import LMArgs
from asyncvec.runs import check_env_id


def make_prompt_env(env_id: str, env_kwargs: dict[str, Any] | None = None) -> gym.Env:
    """Makes ``env_id`` after checking it is a text task: ``gymnasium.spaces.Text`` observations
    (prompts) and actions (completions), and not declared multi-turn (``metadata["multi_turn"]``).
    The env is never stepped here: its reset observations are the prompts.

    Raises:
        ValueError: unknown id (close matches named), a space that is not ``Text``, or an env that
            declares ``metadata["multi_turn"] = True`` (its episodes are played, not prompted).

    Example:
        >>> make_prompt_env("asyncvec/SingleDigitSums-v0").reset(seed=0)[0]
        '8+6='
    """
    check_env_id(env_id)
    env = gym.make(env_id, **(env_kwargs or {}))
    try:
        for role, space in (("observation", env.observation_space), ("action", env.action_space)):
            if not isinstance(space, gym.spaces.Text):
                raise ValueError(
                    f"{env_id}: the LM agents need a gymnasium.spaces.Text {role} space (prompts in, "
                    f"completions out), got {space}"
                )
        if env.metadata.get("multi_turn"):
            raise ValueError(
                f"{env_id} declares metadata['multi_turn'] = True: its episodes go on after a step, so they "
                "are played in a vector env (asyncvec.lm.EpisodeCollector), not taken as one-step prompts"
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


def check_reward_scores(reward: str, env_id: str, prompt: str) -> None:
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


def expert_conversations(
    args: LMArgs,
    tokenizer: Any,
    max_context_tokens: int | None = None,
    render_answer: Callable[[str], str] | None = None,
) -> Iterator[tuple[list[int], str]]:
    """Endless ``(prompt ids, answer)`` pairs of a multi-turn env played by its own expert
    (``env.unwrapped.expert_completion()``), rendered as the collector renders them, for
    :func:`asyncvec.lm.sft_warm_start`: a prompt over ``max_context_tokens - --max-new-tokens``
    ends the expert's episode there (``--on-overflow truncate``) or drops its oldest turns
    (``drop_oldest``), as ``EpisodeCollector`` does. ``render_answer`` rewrites each expert answer
    before it is taught and played (e.g. a reasoning prefix; the env must still parse it)."""
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
                answer = expert() if render_answer is None else render_answer(expert())
                yield list(chat.ids), answer
                chat.add_completion(tokenizer(answer).input_ids + [tokenizer.eos_token_id], answer)
                obs, _, terminated, truncated, _ = env.step(answer)
                done = terminated or truncated
