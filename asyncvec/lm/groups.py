"""``GroupCollector``: k scored completions per prompt from a text policy, in a background thread.

What the RLOO / GRPO / REINFORCE++ family needs from the acting side::

    prompts ──► k x policy.submit(prompt) ──► completion (token ids, log-probs, version)
                                                   │
                    RewardService.submit(prompt, text) ◄┘   (scores while generation goes on)
                                                   ▼
                            CompletionGroups (k per prompt) ──► learner: pop(num_groups)

Each completion keeps the policy version that sampled it (``GroupBatch.policy_version``: its
oldest token's) and, with in-flight weight updates, the version of each token
(``GroupBatch.token_versions``, from ``PolicyOutput.token_versions``), so the learner can
measure staleness and correct for it. A completion whose policy deadline
passed (``fallback=True`` and no text: the policy never sampled it) is not scored; it joins
its group marked :attr:`ScoredCompletion.missed_deadline`, and the learner must leave it out.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from asyncvec.buffers import CompletionGroups, GroupBatch
from asyncvec.collection.base import BackgroundCollector
from asyncvec.inference.types import PolicyOutput, TextPrompt
from asyncvec.lm.rewards import RewardService
from asyncvec.versioning import AdmissionControl

__all__ = ["GroupCollector", "ScoredCompletion", "score_completions"]


@dataclass(frozen=True)
class ScoredCompletion:
    """One completion and its reward, as :class:`GroupCollector` stores it in its groups.

    Attributes:
        prompt: the prompt it answers.
        output: the policy's answer (text, token ids, token log-probs, version, fallback flag;
            ``token_versions`` when in-flight weight updates changed the version mid-completion).
        reward: the scorer's reward (a stand-in when ``flagged``; 0.0 for a deadline miss).
        flagged: the reward is unknown (the RewardService timed out or the scorer raised).

    Example:
        >>> out = PolicyOutput(action=None, behavior_logp=0.0, policy_version=2, latency_s=1.0, fallback=True)
        >>> sample = ScoredCompletion("3+4=", out, reward=0.0, flagged=False)
        >>> sample.missed_deadline, sample.trainable
        (True, False)
    """

    prompt: str
    output: PolicyOutput
    reward: float
    flagged: bool

    @property
    def missed_deadline(self) -> bool:
        """The policy delivered its fallback action after the deadline: nothing was sampled."""
        return self.output.fallback and self.output.text is None

    @property
    def trainable(self) -> bool:
        """A sampled completion with a measured reward (neither flagged nor a deadline miss)."""
        return not self.flagged and not self.missed_deadline


class GroupCollector(BackgroundCollector):
    """Prompts -> ``group_size`` completions each (policy) -> rewards (RewardService) -> groups.

    Completions are requested from the policy as futures; each finished completion goes to
    the reward service at once, so scoring overlaps generation, and each scored one joins its
    prompt's group in a :class:`CompletionGroups`. Two ways to drive it:

    * **sync**: :meth:`collect` (or :meth:`submit` then :meth:`pop`) generates exactly the
      groups the learner takes next, in prompt order;
    * **async**: :meth:`start` runs a thread that keeps ``ahead`` prompts requested but not
      yet popped, so generation goes on while the learner trains; :meth:`pop` takes the
      first complete groups, or, under an ``admission`` control, the next groups in prompt order
      (the control starts a prompt only when it cannot be too stale by its turn).

    With a ``seed``, completion ``j`` of prompt ``i`` is sampled with its own seed (from ``seed``,
    ``i`` and ``j``), and each group lists its completions in request order: what is generated does
    not depend on how requests met in batches or which finished first, so a run repeats exactly.

    Errors of the policy, the reward service or the callbacks are re-raised (as
    :class:`~asyncvec.CollectorError` with the original chained) by :meth:`check`, :meth:`pop` and :meth:`collect`; a pop that
    waits longer than its timeout raises TimeoutError naming what is pending. It never hangs.

    Args:
        policy: a text policy (``HFTextPolicy``, ``VLLMPolicy``, ``OpenAIPolicy``) whose
            answers carry ``token_ids`` and ``token_logps``; each prompt's ``k`` completions are
            requested together with ``submit_group`` (one engine request with ``n = k``).
        reward_service: scores ``(prompt, completion text)``.
        prompts: the prompts, in order (an endless iterator is fine).
        group_size: ``k``, completions per prompt.
        seed: seeds each prompt's sampling (None: the policy's own random stream).
        first_prompt: the index of the first prompt (a resumed run's prompts done): prompt ids, and
            so the seeds, go on from there.

    Example:
        >>> import tempfile, gymnasium as gym
        >>> from asyncvec.inference import HFTextPolicy, build_tiny_lm
        >>> folder = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32)
        >>> with HFTextPolicy(folder, action_parser=str, action_space=gym.spaces.Text(8), max_new_tokens=3) as policy, \\
        ...         RewardService("exact_answer") as rewarder, \\
        ...         GroupCollector(policy, rewarder, ["1+2=", "3+4=", "5+1="], group_size=2) as collector:
        ...     batch = collector.collect(3, timeout=60)
        >>> batch.rewards.shape, batch.policy_version.tolist()
        ((3, 2), [[0, 0], [0, 0], [0, 0]])
    """

    thread_name = "asyncvec-group-collector"
    failure_message = "generation failed"
    stop_timeout_s = 10.0

    def __init__(
        self,
        policy: Any,
        reward_service: RewardService,
        prompts: Iterable[str],
        group_size: int,
        *,
        seed: int | None = None,
        first_prompt: int = 0,
    ) -> None:
        super().__init__()
        self.policy = policy
        self.reward_service = reward_service
        self.prompts: Iterator[str] = iter(prompts)
        self.groups = CompletionGroups(group_size)
        self.group_size = self.groups.group_size
        self.seed = seed
        self._ids = itertools.count(first_prompt)
        self._next_pop = first_prompt  # pops in prompt order take the groups from here on
        self._in_order = True
        self._lock = threading.Lock()
        self._slots: threading.Semaphore | None = None
        self._admission: AdmissionControl | None = None
        self.submitted_prompts = 0
        self.samples = 0
        """completions received (scored, flagged or missed)"""
        self.flagged = 0
        """completions whose reward is unknown (RewardService timeout or scorer error)"""
        self.rejected = 0
        """sampled completions the policy's action parser rejected (``fallback=True`` with text)"""
        self.missed_deadlines = 0
        """requests answered with the fallback action after the policy's deadline (not sampled)"""

    # ------------------------------------------------------------------ driving it
    def submit(self, num_prompts: int) -> None:
        """Requests ``group_size`` completions for each of the next ``num_prompts`` prompts."""
        for prompt in itertools.islice(self.prompts, num_prompts):
            prompt_id = next(self._ids)
            if self.seed is None:
                futures = self.policy.submit_group(prompt, self.group_size)  # one engine request with n = k
            else:  # each completion its own seed: what it samples does not depend on the batch it meets
                futures = [
                    self.policy.submit(_seeded(prompt, request_seed(self.seed, prompt_id, position)))
                    for position in range(self.group_size)
                ]
            for position, future in enumerate(futures):
                future.add_done_callback(partial(self._on_completion, prompt_id, prompt, position))
            with self._lock:
                self.submitted_prompts += 1

    def collect(self, num_prompts: int, timeout: float) -> GroupBatch:
        """Sync mode: ``num_prompts`` new prompts, ``group_size`` scored completions each."""
        self.submit(num_prompts)
        return self.pop(num_prompts, timeout)

    def start(self, total_prompts: int, ahead: int, admission: AdmissionControl | None = None) -> GroupCollector:
        """Async mode: a thread requests prompts (``total_prompts`` in all) while fewer than
        ``ahead`` are requested and not yet popped; with ``admission``, each once the control
        admits it (its index: prompts requested since the start), and :meth:`pop` then takes groups
        in prompt order. Without, :meth:`pop` takes the first complete groups."""
        self._refuse_second_start()
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1:
            raise ValueError(f"ahead: expected an int >= 1 (prompts generated ahead of the learner), got {ahead!r}")
        self._slots = threading.Semaphore(ahead)
        self._admission, self._in_order = admission, admission is not None
        self._start_thread(total_prompts)
        return self

    def _loop(self, total_prompts: int) -> None:
        while not self._stopping.is_set() and self.submitted_prompts < total_prompts:
            if not self._slots.acquire(timeout=0.1):
                continue
            while self._admission is not None and not self._admission.wait(self.submitted_prompts, timeout=0.1):
                if self._stopping.is_set():
                    return
            self.submit(1)

    def pop(self, num_groups: int, timeout: float) -> GroupBatch:
        """Waits (at most ``timeout`` seconds) for ``num_groups`` complete groups, oldest first."""
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            try:
                keys = list(range(self._next_pop, self._next_pop + num_groups)) if self._in_order else None
                batch = self.groups.pop(num_groups, timeout=min(0.25, max(deadline - time.monotonic(), 0.0)), keys=keys)
                self._next_pop += num_groups
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"no {num_groups} complete groups within {timeout} s ({self.groups.num_pending} prompts "
                        f"pending, policy stats {self.policy.stats()}, reward stats {self.reward_service.stats()})"
                    ) from None
        if self._slots is not None:
            for _ in range(num_groups):
                self._slots.release()
        return batch

    def stats(self) -> dict[str, float]:
        """Counters: prompts requested, completions received, flagged, rejected, missed deadlines."""
        with self._lock:
            return {
                "prompts": self.submitted_prompts,
                "samples": self.samples,
                "flagged": self.flagged,
                "rejected": self.rejected,
                "missed_deadlines": self.missed_deadlines,
            }

    close = BackgroundCollector.stop
    """Stops requesting; completions still in flight are ignored from now on (also :meth:`stop`)."""

    # Callbacks run on the policy's and the reward service's threads: quick, never raising (errors go to _fail).
    def _on_completion(self, prompt_id: int, prompt: str, position: int, future: Future) -> None:
        try:
            output: PolicyOutput = future.result()
            if output.fallback and output.text is None:  # deadline miss: nothing sampled, nothing to score
                self._add(prompt_id, position, ScoredCompletion(prompt, output, 0.0, False))
                return
            if not output.token_ids:
                raise ValueError(
                    f"{type(self.policy).__name__} returned no token ids for {prompt!r}; the learner needs them "
                    "(OpenAIPolicy: return_token_ids=True against vLLM or asyncvec serve)"
                )
            scored = self.reward_service.submit(prompt, output.text or "")
            scored.add_done_callback(partial(self._on_reward, prompt_id, prompt, position, output))
        except Exception as exc:
            self._fail(exc)

    def _on_reward(self, prompt_id: int, prompt: str, position: int, output: PolicyOutput, future: Future) -> None:
        try:
            result = future.result()
            self._add(prompt_id, position, ScoredCompletion(prompt, output, result.reward, result.flagged))
        except Exception as exc:
            self._fail(exc)

    def _add(self, prompt_id: int, position: int, sample: ScoredCompletion) -> None:
        with self._lock:
            self.samples += 1
            self.flagged += sample.flagged
            self.missed_deadlines += sample.missed_deadline
            self.rejected += sample.output.fallback and not sample.missed_deadline
        logps = np.asarray(sample.output.token_logps or (), dtype=np.float32)
        output = sample.output
        self.groups.add(prompt_id, sample, sample.reward, logps, output.policy_version, output.token_versions, position)


def request_seed(seed: int, *index: int) -> int:
    """The sampling seed of the request at ``index`` (e.g. prompt, completion) of a run seeded with
    ``seed``: well mixed, so runs with neighbouring seeds share no request seeds.

    Example:
        >>> request_seed(0, 1, 0) == request_seed(0, 1, 0), request_seed(0, 1, 0) == request_seed(1, 0, 0)
        (True, False)
    """
    return int(np.random.SeedSequence([seed, *index]).generate_state(1)[0] >> 1)


def _seeded(prompt: Any, seed: int) -> TextPrompt:
    return dataclasses.replace(prompt, seed=seed) if isinstance(prompt, TextPrompt) else TextPrompt(prompt, seed=seed)


def score_completions(policy: Any, reward_service: RewardService, prompts: list[str], timeout: float) -> list[float]:
    """One completion per prompt, scored: the rewards that are known (flagged ones and deadline
    misses left out). Their mean is the usual evaluation of a text policy.

    Example:
        >>> import tempfile, gymnasium as gym
        >>> from asyncvec.inference import HFTextPolicy, build_tiny_lm
        >>> folder = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32)
        >>> with HFTextPolicy(folder, action_parser=str, action_space=gym.spaces.Text(8), max_new_tokens=2) as policy, \\
        ...         RewardService("exact_answer") as rewarder:
        ...     len(score_completions(policy, rewarder, ["1+2=", "3+4="], timeout=60))
        2
    """
    outputs = policy.act(prompts, timeout=timeout)
    sampled = [(p, o) for p, o in zip(prompts, outputs, strict=True) if not (o.fallback and o.text is None)]
    futures = [reward_service.submit(p, o.text or "") for p, o in sampled]
    results = [f.result(timeout=reward_service.timeout_s + 5.0) for f in futures]
    return [r.reward for r in results if not r.flagged]
