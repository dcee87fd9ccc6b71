"""``EpisodeCollector``: multi-turn episodes of a text policy in an ``AsyncLLMVectorEnv``.

::

    env i: reset(seed of its group) ─► obs ─► Conversation.add_observation ─► policy.submit(prompt ids)
              ▲                                                                   │ (batched with the
              │   reward, done                                                    ▼  other envs' turns)
    env i: step(completion text) ◄── Turn(prompt ids, completion ids, log-probs, version, ...) ◄┘

**Async** (default): each env asks for its next turn the moment its step returns; the turns of
all envs waiting on the model reach the engine batched by the policy's ``DynamicBatcher``; an env
whose episode ends starts the next one at once. **Lockstep** (``lockstep=True``, what
batch-rollout trainers do): all envs generate turn ``t``, then all step, and a round of episodes
ends when its last episode ends.

Groups: ``group_size`` episodes from the same reset seed (one seed per group), for group
baselines. A group is handed out (:meth:`EpisodeCollector.pop`) once all its episodes ended.

Outcomes that are counted in :meth:`EpisodeCollector.stats` and never crash the run:

* context overflow (prompt + ``max_new_tokens`` over ``max_context_tokens``): by default
  (``on_overflow="truncate"``) the episode ends ``truncated`` with ``context_overflow=True`` (its
  turns so far are kept and trained on); with ``on_overflow="drop_oldest"`` the prompt is
  rendered again as the system prompt and the most recent whole turns that fit
  (:meth:`Conversation.fit <asyncvec.lm.chat.Conversation.fit>`), a new context segment
  (``Turn.segment``; ``dropped_turns`` counts the turns left out), and the episode goes on
  (it still ends truncated when not even the last observation fits);
* an empty completion, or a deadline miss (``missed_deadline``: the policy never sampled,
  the turn is never trained on): the env receives ``""`` and its own rule applies (``TextEnv``:
  penalty and no-op);
* a completion outside the env's ``Text`` action space is cut to its length and charset
  (``actions_clipped``);
* an env that raises mid-episode, with ``max_restarts > 0`` on the vector env: the episode ends
  truncated with ``env_error=True`` and is never trained on (nor counted in its group's baseline).
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Literal

import gymnasium as gym
import numpy as np

from asyncvec.collection.base import BackgroundCollector
from asyncvec.inference.types import PolicyOutput, TextPrompt
from asyncvec.lm.chat import Conversation, PlainChatFormat
from asyncvec.lm.episode_records import Episode, EpisodeGroups, Turn
from asyncvec.lm.groups import request_seed
from asyncvec.lm.text_env import check_text_env
from asyncvec.versioning import AdmissionControl, per_token_versions

__all__ = ["Episode", "EpisodeCollector", "EpisodeGroups", "Turn", "make_text_vector_env"]

# After a result, ``recv`` is called again with this timeout to take the results already there
# (one wait on the workers' pipes reads every ready one) without waiting for more.
_DRAIN_S = 1e-4


def make_text_vector_env(
    env: str | Callable[[], gym.Env] | Sequence[Callable[[], gym.Env]],
    num_envs: int | None = None,
    *,
    env_kwargs: dict[str, Any] | None = None,
    max_restarts: int = 100,
    **kwargs: Any,
) -> Any:
    """An ``AsyncLLMVectorEnv`` for :class:`EpisodeCollector`: ``batch_size=1`` (every env is
    received the moment it is done) and ``max_restarts`` (an env that raises is rebuilt and its
    episode ends truncated instead of failing the run).

    ``env``: a registered id (made with ``env_kwargs``), an env function (``num_envs`` copies), or
    a list of env functions.

    Example:
        >>> import asyncvec.envs  # registers asyncvec/GuessNumber-v0
        >>> vec = make_text_vector_env("asyncvec/GuessNumber-v0", 2)
        >>> vec.num_envs, vec.batch_size
        (2, 1)
        >>> vec.close()
    """
    from asyncvec.vector.async_llm_vector_env import AsyncLLMVectorEnv

    if isinstance(env, str):
        env_id, options = env, dict(env_kwargs or {})
        fns = [lambda: gym.make(env_id, **options)] * (num_envs or 1)
    elif callable(env):
        fns = [env] * (num_envs or 1)
    else:
        fns = list(env)
    kwargs.setdefault("batch_size", 1)
    return AsyncLLMVectorEnv(fns, max_restarts=max_restarts, **kwargs)


def _clip_to_space(text: str, space: gym.Space) -> tuple[str, bool]:
    if not isinstance(space, gym.spaces.Text) or space.contains(text):
        return text, False
    kept = "".join(ch for ch in text if ch in space.character_set)[: space.max_length]
    return kept + " " * max(space.min_length - len(kept), 0), True


class _Group:
    def __init__(self, index: int, seed: int, size: int) -> None:
        self.index, self.seed = index, seed
        self.unassigned = size
        self.episodes: list[Episode] = []


class EpisodeCollector(BackgroundCollector):
    """Episodes of a text policy in a vector env of text envs, ``group_size`` per reset seed.

    It runs in a background thread (started by :meth:`submit` or :meth:`start`) and drives
    ``envs`` through ``send_reset``/``send``/``recv``. Two ways for the learner to drive it,
    as :class:`~asyncvec.lm.groups.GroupCollector`:

    * :meth:`collect` (or :meth:`submit` then :meth:`pop`): exactly the groups taken next;
    * :meth:`start` ``(total_groups, ahead)``: keeps ``ahead`` groups started but not yet popped.

    Args:
        envs: an ``AsyncLLMVectorEnv`` of text envs (``gymnasium.spaces.Text`` observations
            and actions; :func:`make_text_vector_env` builds one with ``batch_size=1``).
        policy: a text policy (``HFTextPolicy``, ``VLLMPolicy``, ``OpenAIPolicy``) whose
            answers carry token ids and log-probs; it receives token-id prompts.
        group_size: ``k``, episodes per reset seed.
        tokenizer: the model's tokenizer (default: ``policy.tokenizer``).
        system_prompt: the conversation's first message (None: none).
        max_new_tokens: completion limit per turn (default: the policy's).
        max_context_tokens: prompt + ``max_new_tokens`` must fit (default: the policy's
            ``max_positions``/``max_model_len`` when it has one).
        seed: group ``g``'s episodes reset with seed ``seed + g``.
        sampling_seed: each turn is sampled with its own seed (from this one, the episode's reset seed,
            its place in its group and the turn's number): what it samples does not depend on the
            batch it meets, and a group lists its episodes in place order (None: the policy's stream).
        lockstep: turn-level lockstep instead of per-env turns (see the module docstring).
        on_overflow: a prompt over the context: ``"truncate"`` (default) ends the episode,
            ``"drop_oldest"`` drops the oldest whole turns from the prompt (see the module docstring).
        poll_s: while turns are with the policy and the vector env cannot be woken (``envs.wakeable``
            false, e.g. Ray actors), how long one wait for env results lasts before the answers that
            came in meanwhile are sent. With worker processes an answer goes to its env at once:
            sent from the policy's callback thread when the collection thread is free
            (``AsyncLLMVectorEnv.send`` is safe during a ``recv`` in another thread), otherwise the
            answer wakes the collection thread (``AsyncLLMVectorEnv.wake``).
        use_chat_template, plain_format: how turns are rendered (:class:`~asyncvec.lm.chat.Conversation`).

    Example:
        >>> import tempfile, gymnasium as gym, envs
        >>> from asyncvec.inference import HFTextPolicy, build_tiny_lm
        >>> folder = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32, max_positions=256)
        >>> vec = make_text_vector_env("asyncvec/GuessNumber-v0", 2, env_kwargs={"max_turns": 2, "transcript": False})
        >>> with HFTextPolicy(folder, action_parser=str, action_space=gym.spaces.Text(16), max_new_tokens=3) as policy, \\
        ...         EpisodeCollector(vec, policy, group_size=2) as collector:
        ...     batch = collector.collect(1, timeout=60)
        >>> [len(e.turns) for e in batch.episodes[0]], batch.episodes[0][0].seed == batch.episodes[0][1].seed
        ([2, 2], True)
        >>> vec.close()
    """

    thread_name = "asyncvec-episodes"
    failure_message = "episode collection failed"
    stop_timeout_s = 10.0

    def __init__(
        self,
        envs: Any,
        policy: Any,
        group_size: int,
        *,
        tokenizer: Any = None,
        system_prompt: str | None = None,
        max_new_tokens: int | None = None,
        max_context_tokens: int | None = None,
        seed: int = 0,
        sampling_seed: int | None = None,
        lockstep: bool = False,
        on_overflow: Literal["truncate", "drop_oldest"] = "truncate",
        use_chat_template: bool | None = None,
        plain_format: PlainChatFormat = PlainChatFormat(),
        poll_s: float = 0.002,
    ) -> None:
        check_text_env(_Spaces(envs), "EpisodeCollector: envs")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size: expected an int >= 1, got {group_size!r}")
        super().__init__()
        self.envs = envs
        self.policy = policy
        self.group_size = group_size
        self.tokenizer = tokenizer if tokenizer is not None else getattr(policy, "tokenizer", None)
        if self.tokenizer is None:
            raise TypeError("EpisodeCollector: pass tokenizer= (the policy has no .tokenizer)")
        self.system_prompt = system_prompt
        self.max_new_tokens = max_new_tokens or getattr(getattr(policy, "defaults", None), "max_new_tokens", None)
        if not self.max_new_tokens:
            raise TypeError("EpisodeCollector: pass max_new_tokens= (the policy has no sampling defaults)")
        self.max_context_tokens = (
            max_context_tokens or getattr(policy, "max_positions", None) or getattr(policy, "max_model_len", None)
        )
        self.seed = int(seed)
        self.sampling_seed = sampling_seed
        self.lockstep = bool(lockstep)
        if on_overflow not in ("truncate", "drop_oldest"):
            raise ValueError(f"on_overflow: expected 'truncate' or 'drop_oldest', got {on_overflow!r}")
        self.on_overflow = on_overflow
        self.use_chat_template = use_chat_template
        self.plain_format = plain_format
        self.poll_s = float(poll_s)
        # async: each policy answer ends the wait for env results at once (no polling)
        self._wakeable = not self.lockstep and bool(getattr(envs, "wakeable", False))
        # ... and goes to its env from the policy's callback thread, when the collection thread is
        # not busy (a wakeable AsyncLLMVectorEnv's send is safe during a recv in another thread): the
        # env steps without waiting for the collection thread to wake (see _answer_ready)
        self._direct = self._wakeable and callable(getattr(envs, "send", None))
        self._lock = threading.RLock()  # the episodes' state: the collection thread and the policy's callbacks
        n = envs.num_envs
        self._conversations: list[Conversation | None] = [None] * n
        self._encoded: dict[tuple[str, bool], tuple[int, ...]] = {}  # the conversations' encode_cache
        self._episodes: list[Episode | None] = [None] * n
        self._env_group: list[_Group | None] = [None] * n
        self._sent_at = [0.0] * n
        self._prompts: list[tuple[int, ...]] = [()] * n  # each env's prompt with the policy
        self._segments = [0] * n  # each env's context segment in its episode
        self._idle: list[int] = list(range(n))
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting_policy = 0
        self._open: deque[_Group] = deque()
        self._next_group = 0
        self._complete: deque[_Group] = deque()  # guarded by self._cond (the base's), as the quota below
        self._quota = 0
        self._admission: AdmissionControl | None = None
        self._in_order = True  # pop the groups in the order they started (see pop)
        self._next_pop = 0
        self._total: int | None = None
        self._refill = False
        self._ahead = 0
        self._counts = dict.fromkeys(
            (
                "groups", "episodes", "turns", "terminated", "truncated", "context_overflows", "dropped_turns",
                "env_errors", "missed_deadlines", "rejected", "empty_completions", "actions_clipped",
            ),
            0,
        )  # fmt: skip

    # ------------------------------------------------------------------ the learner's side
    @property
    def samples(self) -> int:
        """Turns sampled so far (completions)."""
        return self._counts["turns"]

    def submit(self, num_groups: int) -> None:
        """Allows ``num_groups`` more groups to start (the thread starts on the first call)."""
        with self._cond:
            self._quota += num_groups
            self._cond.notify_all()
        self._wake()
        self._ensure_thread()

    def collect(self, num_groups: int, timeout: float) -> EpisodeGroups:
        """Sync mode: ``num_groups`` new groups of complete episodes."""
        self.submit(num_groups)
        return self.pop(num_groups, timeout)

    def start(self, total_groups: int, ahead: int, admission: AdmissionControl | None = None) -> EpisodeCollector:
        """Async mode: keeps ``ahead`` groups started but not popped, ``total_groups`` in all; with
        ``admission``, a group starts once the control admits it (its index: groups started since the
        start), and :meth:`pop` then takes groups in the order they started."""
        self._refuse_second_start()  # also after submit(), which started the thread
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1:
            raise ValueError(f"ahead: expected an int >= 1 (groups collected ahead of the learner), got {ahead!r}")
        with self._cond:
            self._total, self._refill, self._ahead = total_groups, True, ahead
            self._quota = min(ahead, total_groups)
            self._admission, self._in_order = admission, admission is not None
        self._start_thread()
        return self

    def pop(self, num_groups: int, timeout: float) -> EpisodeGroups:
        """Waits (at most ``timeout`` s) for ``num_groups`` complete groups: the next ones in the order
        they started (sync mode, or async under an admission control), else the first to complete."""
        if self._refill and num_groups > self._ahead:
            raise ValueError(
                f"pop({num_groups}): at most ahead={self._ahead} groups run before a pop returns; "
                "pop fewer at a time or start with a larger ahead"
            )
        deadline = time.monotonic() + timeout
        with self._cond:
            wanted = range(self._next_pop, self._next_pop + num_groups)
            while not self._poppable(wanted):
                self.check()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"no {num_groups} complete groups within {timeout} s ({len(self._complete)} complete, "
                        f"{len(self._open)} open; collector stats {self.stats()}, policy stats {self.policy.stats()})"
                    )
                self._cond.wait(min(remaining, 0.25))
            if self._in_order:
                by_index = {group.index: group for group in self._complete}
                groups = [by_index[index] for index in wanted]
                self._complete = deque(group for group in self._complete if group.index not in wanted)
                self._next_pop += num_groups
            else:
                groups = [self._complete.popleft() for _ in range(num_groups)]
            if self._refill:
                started = self._next_group + self._quota
                self._quota += max(0, min(num_groups, self._total - started))
                self._cond.notify_all()
            self._wake()  # idle envs may start their next groups now
        return EpisodeGroups([g.episodes for g in groups], [g.seed for g in groups])

    def _poppable(self, wanted: range) -> bool:
        if not self._in_order:
            return len(self._complete) >= len(wanted)
        return {group.index for group in self._complete} >= set(wanted)

    def stats(self) -> dict[str, float]:
        """Counters: groups, episodes, turns, terminated, truncated, context_overflows, dropped_turns, env_errors,
        missed_deadlines, rejected (the policy's parser), empty_completions, actions_clipped; ``samples``
        (= turns) and ``flagged`` (0: rewards come from the env) as in ``GroupCollector.stats``."""
        return {**self._counts, "samples": self._counts["turns"], "flagged": 0}

    close = BackgroundCollector.stop
    """Stops collecting; turns and steps in flight are abandoned (also :meth:`stop`)."""

    # ------------------------------------------------------------------ the thread
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._start_thread()

    def _loop(self) -> None:
        if self.lockstep:
            self._run_lockstep()
        else:
            self._run_async()

    def _assign(self, env_ids: list[int]) -> list[int]:
        """Gives each env the next episode slot (opening groups while the quota allows); resets them."""
        assigned, seeds, members = [], [], []
        with self._cond:
            for env_id in env_ids:
                while self._open and self._open[0].unassigned == 0:
                    self._open.popleft()
                if not self._open:
                    if self._quota <= 0 or not (self._admission is None or self._admission.admitted(self._next_group)):
                        break
                    self._quota -= 1
                    self._open.append(_Group(self._next_group, self.seed + self._next_group, self.group_size))
                    self._next_group += 1
                    self._counts["groups"] += 1
                group = self._open[0]
                members.append(self.group_size - group.unassigned)
                group.unassigned -= 1
                self._env_group[env_id] = group
                assigned.append(env_id)
                seeds.append(group.seed)
        if assigned:
            now = time.monotonic()
            for env_id, seed, member in zip(assigned, seeds, members):
                self._episodes[env_id] = Episode(env_id, seed, self._env_group[env_id].index, member=member)
                self._conversations[env_id] = None
                self._segments[env_id] = 0
                self._sent_at[env_id] = now
            self.envs.send_reset(assigned, seeds)
        return assigned

    def _ask(self, env_id: int, observation: str) -> bool:
        """Renders the observation and requests the next turn; False when the context would overflow."""
        conversation = self._conversations[env_id]
        if conversation is None:
            conversation = self._conversations[env_id] = Conversation(
                self.tokenizer, self.system_prompt, self.plain_format, self.use_chat_template, self._encoded
            )
        conversation.add_observation(observation)
        limit = None if self.max_context_tokens is None else self.max_context_tokens - self.max_new_tokens
        if limit is not None and len(conversation) > limit:
            episode = self._episodes[env_id]
            shorter = conversation.fit(limit) if self.on_overflow == "drop_oldest" else None
            if shorter is None:
                episode.truncated = episode.context_overflow = True
                self._counts["context_overflows"] += 1
                self._finish(env_id)
                return False
            dropped = conversation.num_turns - shorter.num_turns
            episode.dropped_turns += dropped
            self._counts["dropped_turns"] += dropped
            self._segments[env_id] += 1
            conversation = self._conversations[env_id] = shorter
        prompt_ids = self._prompts[env_id] = tuple(conversation.ids)
        episode = self._episodes[env_id]
        seed = None
        if self.sampling_seed is not None:  # the turn's own seed: its sample does not depend on the batch it meets
            seed = request_seed(self.sampling_seed, episode.seed, episode.member, len(episode.turns))
        request = TextPrompt(prompt_ids, max_new_tokens=self.max_new_tokens, seed=seed)
        future = self.policy.submit(request, env_id=env_id)
        self._waiting_policy += 1
        future.add_done_callback(lambda f, e=env_id: self._answer_ready(e, f))
        return True

    def _answer_ready(self, env_id: int, future: Future) -> None:
        """The policy's callback (its thread). When the collection thread is not busy, records the
        turn and sends the action to the env from here (the env steps at once: waking the collection
        thread first cost ~0.4 ms per turn); otherwise (or for a failed call, which fails the run in
        the collection thread) files the answer and wakes that thread."""
        if (
            self._direct
            and not self._stopping.is_set()
            and not future.cancelled()
            and future.exception() is None
            and self._lock.acquire(blocking=False)  # never waits: no lock order with the policy's locks
        ):
            try:
                self._send([env_id], [self._on_answer(env_id, future)])
            except BaseException as exc:  # fails the run, as in the collection thread
                self._fail(exc)
            finally:
                self._lock.release()
            self._answers.put(None)  # ends a wait for answers in the collection thread
            return
        self._answers.put((env_id, future))
        self._wake()

    def _wake(self) -> None:
        if self._wakeable:
            self.envs.wake()

    def _on_answer(self, env_id: int, future: Future) -> str:
        """Records the turn; returns the action text for the env."""
        self._waiting_policy -= 1
        output: PolicyOutput = future.result()  # a backend failure fails the run
        conversation = self._conversations[env_id]
        missed = output.fallback and output.text is None
        ids = () if missed else tuple(output.token_ids or ())
        if not missed and not ids and output.text:
            raise ValueError(
                f"{type(self.policy).__name__} returned no token ids; the learner needs them "
                "(OpenAIPolicy: return_token_ids=True against vLLM or asyncvec serve)"
            )
        text = "" if missed else (output.text or "")
        turn = Turn(
            prompt_ids=self._prompts[env_id],
            completion_ids=ids,
            completion_logps=() if missed else tuple(output.token_logps or ()),
            text=text,
            policy_version=output.policy_version,
            policy_latency_s=output.latency_s,
            fallback=output.fallback,
            missed_deadline=missed,
            segment=self._segments[env_id],
            token_versions=None if missed or output.token_versions is None else tuple(output.token_versions),
        )
        per_token_versions(turn.policy_version, turn.token_versions, len(ids))  # a bad answer fails the run here
        conversation.add_completion(ids, text)
        self._episodes[env_id].turns.append(turn)
        counts = self._counts
        counts["turns"] += 1
        counts["missed_deadlines"] += missed
        counts["rejected"] += output.fallback and not missed
        counts["empty_completions"] += not text.strip() and not missed
        action, clipped = _clip_to_space(text, self.envs.single_action_space)
        counts["actions_clipped"] += clipped
        return action

    def _send(self, env_ids: list[int], actions: list[str]) -> None:
        now = time.monotonic()
        for env_id in env_ids:
            self._sent_at[env_id] = now
        self.envs.send(tuple(actions), env_ids)

    def _on_env(self, env_id: int, observation: str, reward: float, terminated: bool, truncated: bool,
                restarted: bool) -> bool:  # fmt: skip
        """Files a reset or step result; True when the env needs a turn from the policy next."""
        episode = self._episodes[env_id]
        if episode.turns:  # a step's result (a reset's has no turn before it)
            turn = episode.turns[-1]
            turn.reward = float(reward)
            turn.env_latency_s = time.monotonic() - self._sent_at[env_id]
        if restarted:
            episode.env_error = episode.truncated = True
            self._counts["env_errors"] += 1
            self._finish(env_id)
            return False
        if terminated or truncated:
            episode.terminated, episode.truncated = bool(terminated), bool(truncated)
            self._finish(env_id)
            return False
        return True

    def _finish(self, env_id: int) -> None:
        episode, group = self._episodes[env_id], self._env_group[env_id]
        self._episodes[env_id] = self._conversations[env_id] = self._env_group[env_id] = None
        self._idle.append(env_id)
        counts = self._counts
        counts["episodes"] += 1
        counts["terminated"] += episode.terminated
        counts["truncated"] += episode.truncated
        with self._cond:
            group.episodes.append(episode)
            if len(group.episodes) == self.group_size:
                group.episodes.sort(key=lambda done: done.member)  # in member order, whichever ended first
                self._complete.append(group)
                self._cond.notify_all()

    def _rows(self, batch: tuple) -> list[tuple[int, Any, float, bool, bool, bool]]:
        """The rows of one ``recv`` result: ``(env_id, observation, reward, terminated, truncated, restarted)``."""
        obs, rewards, terminations, truncations, info = batch
        restarted = np.asarray(info.get("env_restarted", np.zeros(len(rewards), bool)), dtype=bool)
        if "_env_restarted" in info:
            restarted &= np.asarray(info["_env_restarted"], dtype=bool)
        return [
            (int(env_id), obs[k], float(rewards[k]), bool(terminations[k]), bool(truncations[k]), bool(restarted[k]))
            for k, env_id in enumerate(info["env_id"])
        ]

    def _on_results(self, rows: list[tuple[int, Any, float, bool, bool, bool]]) -> list[int]:
        """The step both run modes share: files each env result and asks the policy for the next
        turn of each env whose episode goes on; returns those envs."""
        asked = []
        for env_id, observation, reward, terminated, truncated, restarted in rows:
            if self._on_env(env_id, observation, reward, terminated, truncated, restarted) and self._ask(
                env_id, observation
            ):
                asked.append(env_id)
        return asked

    def _receive(self, timeout: float) -> list[tuple[int, Any, float, bool, bool, bool]]:
        """Whatever envs finished within ``timeout`` (then whatever else is already there)."""
        results = []
        while self.envs.in_flight:
            try:
                results += self._rows(self.envs.recv(timeout=timeout))
            except multiprocessing.TimeoutError:
                break
            timeout = _DRAIN_S
        return results

    def _send_answers(self) -> None:
        """Sends every env whose turn the policy answered its action (one ``send``)."""
        ready_ids, actions = [], []
        while True:
            try:
                answer = self._answers.get_nowait()
            except queue.Empty:
                break
            if answer is None:  # an answer sent from the policy's callback (see _answer_ready)
                continue
            env_id, future = answer
            actions.append(self._on_answer(env_id, future))
            ready_ids.append(env_id)
        if ready_ids:
            self._send(ready_ids, actions)

    def _step_results(self, timeout: float) -> None:
        """Async: each env result that arrives within ``timeout`` (then each already there) asks for
        its next turn at once, and the answers that came in meanwhile go to their envs at once."""
        while self.envs.in_flight:  # only this thread receives: an env in flight stays so until recv
            try:
                rows = self._rows(self.envs.recv(timeout=timeout))  # without the lock: answers go out meanwhile
            except multiprocessing.TimeoutError:
                return
            with self._lock:
                self._on_results(rows)
                self._send_answers()
                if self._idle or self._stopping.is_set():  # an episode ended: start the next one first
                    return
            timeout = _DRAIN_S

    def _run_async(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                if self._idle:
                    assigned = set(self._assign(list(self._idle)))
                    self._idle = [e for e in self._idle if e not in assigned]
                self._send_answers()
                in_flight, waiting_policy = bool(self.envs.in_flight), self._waiting_policy
            if in_flight:
                self._step_results(self.poll_s if waiting_policy and not self._wakeable else 0.05)
            elif waiting_policy:
                try:
                    self._answers.put(self._answers.get(timeout=0.05))  # wait for an answer, handle it next loop
                except queue.Empty:
                    pass
            else:
                with self._cond:
                    self._cond.wait(0.05)

    def _run_lockstep(self) -> None:
        per_round = max(self.envs.num_envs // self.group_size, 1)
        while not self._stopping.is_set():
            with self._cond:
                if self._quota <= 0:
                    self._cond.wait(0.05)
                    continue
            live = self._assign(list(range(min(per_round * self.group_size, self.envs.num_envs))))
            self._idle = []
            while live and not self._stopping.is_set():  # each pass: every live env steps, then all generate
                live = self._on_results(self._receive_all(len(live)))
                actions = self._await_answers(live) if live else None
                if actions is not None:
                    self._send(live, actions)
            self._idle = list(range(self.envs.num_envs))

    def _receive_all(self, count: int) -> list[tuple[int, Any, float, bool, bool, bool]]:
        """Lockstep: the results of ``count`` envs (fewer if the collector stops first)."""
        results: list[tuple[int, Any, float, bool, bool, bool]] = []
        while len(results) < count and not self._stopping.is_set():
            results += self._receive(0.05)
        return results

    def _await_answers(self, env_ids: list[int]) -> list[str] | None:
        """Lockstep: the action of each of ``env_ids`` once the policy answered all (None if the collector stops first)."""
        answers: dict[int, str] = {}
        while len(answers) < len(env_ids):
            if self._stopping.is_set():
                return None
            try:
                env_id, future = self._answers.get(timeout=0.05)
            except queue.Empty:
                continue
            answers[env_id] = self._on_answer(env_id, future)
        return [answers[env_id] for env_id in env_ids]


class _Spaces:
    """The single spaces of a vector env, for :func:`check_text_env`."""

    def __init__(self, envs: Any) -> None:
        self.observation_space = getattr(envs, "single_observation_space", None)
        self.action_space = getattr(envs, "single_action_space", None)
