"""Learner-side helpers for causal language models: loading, a supervised warm start, and
:class:`LMBatch`, the usable completions of a :class:`~asyncvec.buffers.GroupBatch` as tensors
with their teacher-forced log-probs.

The acting side (policies, engines, servers) lives in :mod:`asyncvec.inference`; the groups
come from :class:`asyncvec.lm.groups.GroupCollector`.
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncvec.buffers import GroupBatch
from asyncvec.versioning import per_token_versions

__all__ = [
    "EpisodeBatch",
    "LMBatch",
    "MinibatchSteps",
    "completion_logps",
    "load_causal_lm",
    "minibatch_updates",
    "quiet_model_libraries",
    "sequence_logps",
    "sft_warm_start",
]


def quiet_model_libraries() -> None:
    """Silences transformers' progress bars and advisory warnings, and vLLM's info log (errors
    and, for vLLM, warnings still show; ``VLLM_LOGGING_LEVEL`` set by the user wins).

    Training runs load and save models many times (and decode token by token); their bars and notices (e.g. the pad
    token chosen for ``generate``) would bury the run's own output. vLLM reads its level when
    it is first imported, so call this before.
    """
    import transformers

    # Some transformers releases warn (FutureWarning) on every forward pass of a decoding loop that hands back
    # the cache it returned (``past_key_values``); the backends pass the cache object the model returned, so the
    # notice says nothing to fix. That one deprecation notice is silenced (by its words: transformers attributes
    # it to the caller's module), no other FutureWarning.
    warnings.filterwarnings("ignore", message=r"(?s).*`?past_key_values`?.*deprecat", category=FutureWarning)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def load_causal_lm(folder: str | os.PathLike, device: str = "cpu") -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a save_pretrained folder, the model in eval mode (dropout off).

    Policy-gradient log-probs must match the sampler's, which has no dropout.

    Example:
        >>> import tempfile
        >>> from asyncvec.inference import build_tiny_lm
        >>> model, tokenizer = load_causal_lm(build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32))
        >>> model.training, tokenizer("3+4=").input_ids
        (False, [6, 13, 7, 17])
    """
    import transformers

    return (
        transformers.AutoModelForCausalLM.from_pretrained(folder).to(device).eval(),
        transformers.AutoTokenizer.from_pretrained(folder),
    )


def completion_logps(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    length: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Teacher-forced log-probs ``[N, length]`` of each completion token after its prompt.

    Sequences are right-padded, so positions count from 0 as in left-padded generation;
    entries past a completion's end are 0. The logits are divided by ``temperature``: the
    distribution the policy sampled from.

    Example:
        >>> import tempfile
        >>> from asyncvec.inference import build_tiny_lm
        >>> model, tok = load_causal_lm(build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32))
        >>> completion_logps(model, [tok("3+4=").input_ids], [[10, 1]], length=3).shape
        torch.Size([1, 3])
    """
    rows = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width = max(len(row) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), length, dtype=torch.long)  # logits index predicting each token
    targets = torch.zeros(len(rows), length, dtype=torch.long)
    valid = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[i, : len(rows[i])] = torch.tensor(rows[i])
        attention[i, : len(rows[i])] = 1
        n = min(len(c), length)
        positions[i, :n] = torch.arange(len(p) - 1, len(p) - 1 + n)
        targets[i, :n] = torch.tensor(list(c[:n]))
        valid[i, :n] = True
    device = next(model.parameters()).device
    input_ids, attention, positions, targets, valid = (
        t.to(device) for t in (input_ids, attention, positions, targets, valid)
    )
    logits = model(input_ids=input_ids, attention_mask=attention).logits
    picked = logits.gather(1, positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float() / temperature
    logps = torch.log_softmax(picked, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, logps, torch.zeros_like(logps))


def sft_warm_start(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    examples: Iterable[tuple[str, str]],
    steps: int = 150,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    seed: int = 0,
    torch_threads: int = 1,
) -> Path:
    """Supervised warm start: teaches ``prompt -> answer<eos>`` on ``(prompt, answer)`` pairs.

    A prompt is a str or its token ids (e.g. a rendered multi-turn conversation,
    :class:`asyncvec.lm.chat.Conversation`'s ``ids``).

    The model in ``model_dir`` is left untouched; the trained one is saved to ``out_dir``.
    The loss covers the answer tokens only. Training uses ``torch_threads`` CPU threads (a
    tiny model is no faster on two, and a second thread spins against other work on a small
    machine); the previous setting is restored.

    Example:
        >>> import tempfile
        >>> from asyncvec.inference import build_tiny_lm
        >>> base = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32)
        >>> pairs = itertools.cycle([("3+4=", "7"), ("1+1=", "2")])
        >>> sft_warm_start(base, tempfile.mkdtemp(), pairs, steps=2, batch_size=4).joinpath("config.json").exists()
        True
    """
    examples = iter(examples)
    model, tokenizer = load_causal_lm(model_dir)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for step in range(steps):
                sequences, starts = [], []
                for prompt, answer in itertools.islice(examples, batch_size):
                    prompt_ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
                    sequences.append(prompt_ids + tokenizer(answer).input_ids + [tokenizer.eos_token_id])
                    starts.append(len(prompt_ids))
                if not sequences:
                    raise ValueError(f"sft_warm_start: the examples ran out after {step} of {steps} steps")
                width = max(map(len, sequences))
                input_ids = torch.full((len(sequences), width), tokenizer.pad_token_id)
                labels = torch.full((len(sequences), width), -100)  # loss on the answer tokens only
                attention = torch.zeros((len(sequences), width), dtype=torch.long)
                for i, (sequence, start) in enumerate(zip(sequences, starts)):
                    input_ids[i, : len(sequence)] = torch.tensor(sequence)
                    labels[i, start : len(sequence)] = torch.tensor(sequence[start:])
                    attention[i, : len(sequence)] = 1
                loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@dataclass
class LMBatch:
    """The trainable completions of a :class:`GroupBatch` as learner tensors (``N`` rows, ``L`` tokens).

    Built by :meth:`from_groups`, which decides what is trained on:

    * a group with a completion more than ``max_staleness`` versions older than the learner
      is dropped whole (counted in ``stale_groups`` / ``stale_samples``); a completion's age is
      its oldest token's (with in-flight weight updates its tokens may span versions);
    * a completion with a flagged reward (unknown) or one that missed the policy's deadline
      (nothing was sampled) is left out of the rows, so it enters neither the loss nor any
      baseline; the rest of its group stays;
    * a group left with fewer than ``min_group_samples`` trainable completions is skipped
      (a leave-one-out baseline needs 2).

    Attributes:
        prompt_ids: ``N`` tokenized prompts.
        completion_ids: ``N`` sampled token-id sequences.
        rewards: ``[N]`` rewards.
        group_ids: ``[N]`` index of each row's group in the GroupBatch.
        behavior_logp: ``[N, L]`` log-probs the engine reported for the sampled tokens, each
            under the version that sampled it.
        mask: ``[N, L]`` True on completion tokens.
        token_versions: ``[N, L]`` int64 version that sampled each token (the completion's
            ``policy_version`` where the policy reported no ``token_versions``); -1 off the mask.
        info: per-batch counts: ``reward`` (mean known reward of the batch, before any drop),
            ``stale_groups``, ``stale_samples``, ``flagged``, ``missed_deadlines``,
            ``samples_used``, ``staleness_mean`` (per completion: its oldest token), and per
            token over the tokens trained on: ``token_staleness_mean``, ``token_staleness_max``,
            ``spanning_samples`` (rows whose tokens come from more than one version).
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    rewards: torch.Tensor
    group_ids: torch.Tensor
    behavior_logp: torch.Tensor
    mask: torch.Tensor
    token_versions: torch.Tensor
    info: dict[str, float]

    @classmethod
    def from_groups(
        cls,
        batch: GroupBatch,
        tokenizer: Any,
        current_version: int,
        max_staleness: int,
        min_group_samples: int = 1,
        device: str | torch.device = "cpu",
    ) -> LMBatch:
        """Selects the trainable completions of ``batch`` (see the class docstring) as tensors.

        ``batch.completions`` holds :class:`~asyncvec.lm.groups.ScoredCompletion`\\ s.
        The result may have no rows (``len(batch) == 0``): then there is nothing to train on.

        Example:
            >>> import tempfile
            >>> from asyncvec.buffers import CompletionGroups
            >>> from asyncvec.lm.groups import ScoredCompletion
            >>> from asyncvec.inference import PolicyOutput, build_tiny_lm
            >>> _, tokenizer = load_causal_lm(build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32))
            >>> groups = CompletionGroups(group_size=2)
            >>> for reward, flagged in [(1.0, False), (0.0, True)]:
            ...     out = PolicyOutput("7", -0.5, 1, 0.0, text="7", token_ids=(13, 1), token_logps=(-0.3, -0.2))
            ...     _ = groups.add(0, ScoredCompletion("3+4=", out, reward, flagged), reward, [-0.3, -0.2], 1)
            >>> data = LMBatch.from_groups(groups.pop(timeout=0), tokenizer, current_version=1, max_staleness=0)
            >>> len(data), data.rewards.tolist(), data.info["flagged"]
            (1, [1.0], 1.0)
        """
        staleness = batch.staleness(current_version)
        stale_groups = staleness.max(axis=1) > max_staleness
        samples = [s for group in batch.completions for s in group]
        rows: list[tuple[int, Any]] = []
        for g, group in enumerate(batch.completions):
            usable = [s for s in group if s.trainable]
            if not stale_groups[g] and len(usable) >= min_group_samples:
                rows.extend((g, s) for s in usable)
        known = [s.reward for s in samples if s.trainable]
        info = {
            "reward": float(np.mean(known)) if known else float("nan"),
            "stale_groups": float(stale_groups.sum()),
            "stale_samples": float(stale_groups.sum() * batch.rewards.shape[1]),
            "flagged": float(sum(s.flagged for s in samples)),
            "missed_deadlines": float(sum(s.missed_deadline for s in samples)),
            "samples_used": float(len(rows)),
            "staleness_mean": float(staleness.mean()),
        }
        length = max((len(s.output.token_ids) for _, s in rows), default=0)
        behavior = torch.zeros(len(rows), length)
        mask = torch.zeros(len(rows), length, dtype=torch.bool)
        token_versions = torch.full((len(rows), length), -1, dtype=torch.long)
        spanning = 0
        for i, (_, s) in enumerate(rows):
            versions = per_token_versions(s.output.policy_version, s.output.token_versions, len(s.output.token_ids))
            behavior[i, : len(s.output.token_logps)] = torch.tensor(s.output.token_logps)
            mask[i, : len(s.output.token_ids)] = True
            token_versions[i, : len(versions)] = torch.tensor(versions, dtype=torch.long)
            spanning += len(set(versions)) > 1
        info.update(_token_staleness(token_versions, mask, current_version, spanning))
        generated = [len(s.output.token_ids or ()) for s in samples if not s.missed_deadline]
        info.update(length_stats(generated, [len(s.output.token_ids) for _, s in rows]))
        encoded = {prompt: tokenizer(prompt).input_ids for prompt in {s.prompt for _, s in rows}}
        return cls(
            prompt_ids=[encoded[s.prompt] for _, s in rows],
            completion_ids=[list(s.output.token_ids) for _, s in rows],
            rewards=torch.tensor([s.reward for _, s in rows], dtype=torch.float32, device=device),
            group_ids=torch.tensor([g for g, _ in rows], dtype=torch.long, device=device),
            behavior_logp=behavior.to(device),
            mask=mask.to(device),
            token_versions=token_versions.to(device),
            info=info,
        )

    def __len__(self) -> int:
        return len(self.completion_ids)

    def logps(self, model: torch.nn.Module, temperature: float, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced log-probs ``[n, L]`` of the completions (all, or ``rows``) under ``model``."""
        index = range(len(self)) if rows is None else rows.tolist()
        return completion_logps(
            model,
            [self.prompt_ids[i] for i in index],
            [self.completion_ids[i] for i in index],
            self.mask.shape[1],
            temperature,
        )


def sequence_logps(
    model: torch.nn.Module, sequences: Sequence[Sequence[int]], mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Teacher-forced log-probs ``[N, W]`` of each token of ``sequences`` given the tokens before it,
    where ``mask`` (``[N, W]`` bool) is True; 0 elsewhere (and always at position 0).

    Example:
        >>> import tempfile
        >>> from asyncvec.inference import build_tiny_lm
        >>> model, tok = load_causal_lm(build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32))
        >>> mask = torch.tensor([[False, False, True, True]])
        >>> (sequence_logps(model, [[6, 13, 7, 17]], mask)[0, :2] == 0).all().item()
        True
    """
    width = mask.shape[1]
    device = next(model.parameters()).device
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attention = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, sequence in enumerate(sequences):
        input_ids[i, : len(sequence)] = torch.tensor(list(sequence), dtype=torch.long)
        attention[i, : len(sequence)] = 1
    input_ids, attention, mask = input_ids.to(device), attention.to(device), mask.to(device)
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float() / temperature
    picked = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    logps = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
    return torch.where(mask, logps, torch.zeros_like(logps))


@dataclass
class EpisodeBatch:
    """Multi-turn episodes (:class:`~asyncvec.lm.episodes.EpisodeGroups`) as learner tensors: a row per
    episode, its whole conversation as one sequence of ``W`` tokens, the loss on model tokens only.

    The conversation is prefix-stable, so the last turn's prompt plus its completion holds every
    turn (with dropped turns: of each context segment, the segments one after another, each
    scored on its own; returns and advantages stay per episode); ``mask`` is True on the completion tokens of the turns that are trained on, False on
    the system prompt, the observations (user turns) and the template's text around turns.
    Each token keeps its own behavior log-prob and version (a turn may span versions with
    in-flight weight updates), so importance weights and staleness are per token.
    :meth:`from_episodes` decides what is trained on:

    * an episode whose env raised (``env_error``) is left out, also of its group's baseline;
    * a turn more than ``max_staleness`` versions older than the learner (its oldest token) is
      masked out whole (``stale_samples`` counts them); its reward still counts in the episode's return;
    * a turn that missed the policy's deadline (nothing sampled) is masked out;
    * a group left with fewer than ``min_group_samples`` episodes is skipped.

    Attributes:
        sequences: ``N`` token-id sequences: the conversation, or with dropped turns (the
            collector's ``on_overflow="drop_oldest"``) each context segment's conversation one after
            another; each segment is scored as its own sequence (:meth:`logps`), so every turn's
            tokens are scored in the context the engine saw.
        rewards: ``[N]`` episode returns ``sum_t gamma^t r_t``.
        group_ids: ``[N]`` index of each row's group.
        behavior_logp: ``[N, W]`` the engine's log-prob of each completion token.
        mask: ``[N, W]`` True on the trained completion tokens.
        turn_ids: ``[N, W]`` the turn index of each completion token (-1 elsewhere).
        token_versions: ``[N, W]`` int64 version that sampled each trained token (-1 off the mask).
        turn_rewards: ``[N, T]`` each turn's reward; ``turn_mask`` ``[N, T]`` True where the turn exists.
        gamma: the discount of ``rewards``.
        segment_starts: where each row's segments start in its sequence (``(0,)`` for one segment).
        info: ``reward`` (mean undiscounted return), ``turns_mean``, ``success`` (share of
            episodes terminated with a positive last reward), ``stale_samples`` (turns),
            ``stale_groups`` (0: turns are dropped one by one), ``flagged`` (0), ``missed_deadlines``,
            ``env_errors``, ``context_overflows``, ``dropped_turns``, ``samples_used`` (turns trained on),
            ``staleness_mean`` (per sampled turn: its oldest token), and per token over the tokens trained on:
            ``token_staleness_mean``, ``token_staleness_max``, ``spanning_samples`` (turns spanning versions).
    """

    sequences: list[list[int]]
    rewards: torch.Tensor
    group_ids: torch.Tensor
    behavior_logp: torch.Tensor
    mask: torch.Tensor
    turn_ids: torch.Tensor
    token_versions: torch.Tensor
    turn_rewards: torch.Tensor
    turn_mask: torch.Tensor
    gamma: float
    info: dict[str, float]
    segment_starts: list[tuple[int, ...]] = field(default_factory=list)

    @classmethod
    def from_episodes(
        cls,
        batch: Any,
        current_version: int,
        max_staleness: int,
        gamma: float = 1.0,
        min_group_samples: int = 1,
        device: str | torch.device = "cpu",
    ) -> EpisodeBatch:
        """Selects what is trained on in ``batch`` (see the class docstring) as tensors.

        Example:
            >>> from asyncvec.lm.episodes import Episode, EpisodeGroups, Turn
            >>> turns = [Turn((5, 6), (7, 1), (-0.1, -0.2), "7", 0, 0.0, reward=0.0),
            ...          Turn((5, 6, 7, 1, 8), (9, 1), (-0.3, -0.4), "9", 1, 0.0, reward=1.0)]
            >>> data = EpisodeBatch.from_episodes(EpisodeGroups([[Episode(0, 0, 0, turns, terminated=True)]], [0]),
            ...                                   current_version=1, max_staleness=0, gamma=0.5)
            >>> data.mask.int().tolist(), data.rewards.tolist(), data.info["stale_samples"]
            ([[0, 0, 0, 0, 0, 1, 1]], [0.5], 1.0)
        """
        episodes = [e for group in batch.episodes for e in group]
        rows: list[tuple[int, Any]] = []
        for g, group in enumerate(batch.episodes):
            usable = [e for e in group if e.trainable]
            if len(usable) >= min_group_samples:
                rows.extend((g, e) for e in usable)
        sequences, segment_starts, turn_offsets = [], [], []  # a row: its segments' last turns, one after another
        for _, episode in rows:
            last = {turn.segment: turn for turn in episode.turns}
            sequence, offset_of = [], {}
            for segment, turn in last.items():
                offset_of[segment] = len(sequence)
                sequence += list(turn.prompt_ids) + list(turn.completion_ids)
            sequences.append(sequence)
            segment_starts.append(tuple(offset_of.values()))
            turn_offsets.append([offset_of[turn.segment] for turn in episode.turns])
        width = max(map(len, sequences), default=0)
        max_turns = max((e.num_turns for _, e in rows), default=0)
        behavior = torch.zeros(len(rows), width)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        turn_ids = torch.full((len(rows), width), -1, dtype=torch.long)
        token_versions = torch.full((len(rows), width), -1, dtype=torch.long)
        turn_rewards = torch.zeros(len(rows), max_turns)
        turn_mask = torch.zeros(len(rows), max_turns, dtype=torch.bool)
        stale = used = spanning = 0
        for i, (_, episode) in enumerate(rows):
            for t, turn in enumerate(episode.turns):
                turn_rewards[i, t] = turn.reward
                turn_mask[i, t] = True
                start = turn_offsets[i][t] + len(turn.prompt_ids)
                stop = start + len(turn.completion_ids)
                if not turn.trainable:
                    continue
                if current_version - turn.policy_version > max_staleness:
                    stale += 1
                    continue
                used += 1
                versions = turn.versions
                spanning += len(set(versions)) > 1
                behavior[i, start:stop] = torch.tensor(turn.completion_logps, dtype=torch.float32)
                mask[i, start:stop] = True
                turn_ids[i, start:stop] = t
                token_versions[i, start:stop] = torch.tensor(versions, dtype=torch.long)
        sampled = [t for e in episodes for t in e.turns if t.trainable]
        finished = [e for e in episodes if not e.env_error]
        info = {
            "reward": float(np.mean([e.total_reward for e in finished])) if finished else float("nan"),
            "turns_mean": float(np.mean([e.num_turns for e in finished])) if finished else float("nan"),
            "success": float(np.mean([_succeeded(e) for e in finished])) if finished else float("nan"),
            "stale_groups": 0.0,
            "stale_samples": float(stale),
            "flagged": 0.0,
            "missed_deadlines": float(sum(t.missed_deadline for e in episodes for t in e.turns)),
            "env_errors": float(sum(e.env_error for e in episodes)),
            "context_overflows": float(sum(e.context_overflow for e in episodes)),
            "dropped_turns": float(sum(e.dropped_turns for e in episodes)),
            "samples_used": float(used),
            "staleness_mean": float(np.mean([current_version - t.policy_version for t in sampled])) if sampled else 0.0,
            **_token_staleness(token_versions, mask, current_version, spanning),
            **length_stats(
                [len(t.completion_ids) for t in sampled],
                [
                    len(turn.completion_ids)
                    for _, e in rows
                    for turn in e.turns
                    if turn.trainable and current_version - turn.policy_version <= max_staleness
                ],
            ),
        }
        return cls(
            sequences=sequences,
            rewards=torch.tensor([e.discounted_return(gamma) for _, e in rows], dtype=torch.float32, device=device),
            group_ids=torch.tensor([g for g, _ in rows], dtype=torch.long, device=device),
            behavior_logp=behavior.to(device),
            mask=mask.to(device),
            turn_ids=turn_ids.to(device),
            token_versions=token_versions.to(device),
            turn_rewards=turn_rewards.to(device),
            turn_mask=turn_mask.to(device),
            gamma=gamma,
            info=info,
            segment_starts=segment_starts,
        )

    def __len__(self) -> int:
        return len(self.sequences)

    def logps(self, model: torch.nn.Module, temperature: float, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced log-probs ``[n, W]`` of the trained tokens (all rows, or ``rows``) under ``model``."""
        index = range(len(self)) if rows is None else rows.tolist()
        mask = self.mask if rows is None else self.mask[rows]
        pieces = []  # (row, start, stop) of each segment
        for k, i in enumerate(index):
            bounds = [*(self.segment_starts[i] if self.segment_starts else (0,)), len(self.sequences[i])]
            pieces += [(k, start, stop) for start, stop in zip(bounds, bounds[1:])]
        if len(pieces) == len(index):  # one segment per row
            return sequence_logps(model, [self.sequences[i] for i in index], mask, temperature)
        width = max(stop - start for _, start, stop in pieces)
        piece_mask = torch.zeros(len(pieces), width, dtype=torch.bool)
        source = torch.zeros(mask.shape, dtype=torch.long)  # where each row position is in the pieces' logps
        row_mask = mask.cpu()
        for j, (k, start, stop) in enumerate(pieces):
            piece_mask[j, : stop - start] = row_mask[k, start:stop]
            source[k, start:stop] = torch.arange(j * width, j * width + stop - start)
        scored = sequence_logps(
            model, [self.sequences[index[k]][start:stop] for k, start, stop in pieces], piece_mask, temperature
        )
        gathered = scored.reshape(-1)[source.to(scored.device)]
        return torch.where(mask.to(scored.device), gathered, torch.zeros_like(gathered))

    def turn_advantages(self, kl: torch.Tensor | None = None, beta: float = 0.0) -> torch.Tensor:
        """Per-turn advantages ``[N, W]`` on the trained tokens: each turn's discounted return-to-go
        ``G_t = sum_{i >= t} gamma^(i-t) r'_i``, normalized over the trained turns of the batch.

        ``r'_t = r_t - beta * sum_{tokens of turn t} kl``: ``kl`` ``[N, W]`` per-token KL estimates
        against a reference (:func:`asyncvec.losses.approx_kl`), summed over the turn's trained tokens.
        """
        from asyncvec.losses import discounted_returns, masked_normalize

        rewards = self.turn_rewards
        if kl is not None and beta:
            if kl.shape != self.mask.shape:
                raise ValueError(f"kl: expected shape {tuple(self.mask.shape)}, got {tuple(kl.shape)}")
            token_kl = torch.where(self.mask, kl.detach().to(rewards.dtype), torch.zeros_like(rewards[:, :1]))
            turn_kl = torch.zeros_like(rewards).scatter_add_(1, self.turn_ids.clamp(min=0), token_kl)
            rewards = rewards - beta * turn_kl
        returns = discounted_returns(rewards, self.turn_mask, self.gamma)
        trained = torch.zeros_like(self.turn_mask)
        rows, columns = (self.turn_ids >= 0).nonzero(as_tuple=True)
        trained[rows, self.turn_ids[rows, columns]] = True
        per_turn = masked_normalize(returns, trained)
        gathered = (
            per_turn.gather(1, self.turn_ids.clamp(min=0)) if per_turn.numel() else torch.zeros_like(self.behavior_logp)
        )
        return torch.where(self.mask, gathered, torch.zeros_like(gathered))


def length_stats(generated: list[int], trained: list[int]) -> dict[str, float]:
    """Completion lengths (tokens) of what was generated and of what was trained on: sums, counts and
    90th percentiles, the ``length/`` curves in TensorBoard. Dropping stale samples trains on fewer
    long ones when long completions finish late (``--staleness-control drop``); the two then part.

    Example:
        >>> stats = length_stats([2, 4, 30], [2, 4])
        >>> stats["length/generated_mean"], stats["length/trained_mean"], stats["length/trained_samples"]
        (12.0, 3.0, 2.0)
    """
    stats = {}
    for name, lengths in (("generated", generated), ("trained", trained)):
        stats[f"length/{name}_mean"] = float(np.mean(lengths)) if lengths else float("nan")
        stats[f"length/{name}_p90"] = float(np.percentile(lengths, 90)) if lengths else float("nan")
        stats[f"length/{name}_tokens"] = float(sum(lengths))
        stats[f"length/{name}_samples"] = float(len(lengths))
    return stats


def _token_staleness(token_versions: torch.Tensor, mask: torch.Tensor, current: int, spanning: int) -> dict[str, float]:
    """Per-token staleness ``current - v_t`` over the tokens trained on (``mask``): its mean and max,
    and ``spanning_samples``, how many samples span more than one version."""
    staleness = (current - token_versions[mask]).float()
    return {
        "token_staleness_mean": float(staleness.mean()) if staleness.numel() else 0.0,
        "token_staleness_max": float(staleness.max()) if staleness.numel() else 0.0,
        "spanning_samples": float(spanning),
    }


def _succeeded(episode: Any) -> bool:
    """Terminated with a positive last reward (GuessNumber's correct guess, FrozenLake's goal)."""
    return bool(episode.terminated and episode.turns and episode.turns[-1].reward > 0)


def minibatch_updates(
    data: LMBatch,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]],
    *,
    epochs: int = 1,
    minibatches: int = 1,
    max_grad_norm: float = 1.0,
    temperature: float = 1.0,
    logp: torch.Tensor | None = None,
) -> dict[str, float]:
    """``epochs`` passes over ``data`` in ``minibatches`` shuffled minibatches, one clipped gradient step each.

    The loss of a minibatch is ``loss_fn(logp_rows, rows)``: the model's log-probs of those rows
    ``[n, L]`` (with gradients) and their indices, so the caller can pick its advantages and
    weights. ``logp``: the whole batch's log-probs, already computed with gradients, used as they
    are for a single pass over a single minibatch (no second forward pass). Returns the mean over
    steps of ``loss``, ``grad_norm`` and each stat ``loss_fn`` reports.

    Example:
        >>> import tempfile
        >>> from asyncvec.buffers import CompletionGroups
        >>> from asyncvec.lm.groups import ScoredCompletion
        >>> from asyncvec.inference import PolicyOutput, build_tiny_lm
        >>> model, tokenizer = load_causal_lm(build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32))
        >>> groups = CompletionGroups(group_size=2)
        >>> for reward in (1.0, 0.0):
        ...     out = PolicyOutput("7", -0.5, 0, 0.0, text="7", token_ids=(13, 1), token_logps=(-0.3, -0.2))
        ...     _ = groups.add(0, ScoredCompletion("3+4=", out, reward, False), reward, [-0.3, -0.2], 0)
        >>> data = LMBatch.from_groups(groups.pop(timeout=0), tokenizer, current_version=0, max_staleness=0)
        >>> def loss_fn(logp_rows, rows):  # REINFORCE with the reward as the advantage
        ...     return -(data.rewards[rows].unsqueeze(-1) * logp_rows * data.mask[rows]).sum(-1).mean(), {}
        >>> stats = minibatch_updates(data, model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, epochs=2)
        >>> sorted(stats)
        ['grad_norm', 'loss']
    """
    steps = MinibatchSteps(model, len(data), epochs, minibatches, max_grad_norm, in_order=logp is not None)
    for rows in steps.minibatches(data.mask.device):
        logp_rows = logp if steps.single_pass and logp is not None else data.logps(model, temperature, rows)
        loss, loss_stats = loss_fn(logp_rows, rows)
        steps.gradient_step(optimizer, loss, loss_stats)
    return steps.means()


class MinibatchSteps:
    """The minibatch steps of one update: ``epochs`` passes over ``rows`` rows in ``minibatches``
    shuffled minibatches (:meth:`minibatches`), one clipped gradient step each
    (:meth:`gradient_step`), and the mean of each statistic over the steps (:meth:`means`).

    ``single_pass``: one pass over one minibatch, whose rows come in order when ``in_order``
    (the caller then reuses the log-probs it already computed with gradients).

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> steps = MinibatchSteps(model, rows=4, epochs=2, minibatches=2, max_grad_norm=1.0)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> for rows in steps.minibatches():
        ...     steps.gradient_step(optimizer, model(torch.ones(len(rows), 2)).sum(), {"rows": len(rows)})
        >>> steps.means()["rows"]
        2.0
    """

    def __init__(
        self,
        model: torch.nn.Module,
        rows: int,
        epochs: int,
        minibatches: int,
        max_grad_norm: float,
        in_order: bool = False,
    ) -> None:
        self.model, self.rows, self.epochs, self.max_grad_norm = model, rows, epochs, max_grad_norm
        self.per_minibatch = -(-rows // minibatches)
        self.single_pass = epochs == 1 and minibatches == 1 and in_order
        self._stats: dict[str, list[float]] = {}

    def minibatches(self, device: torch.device | str = "cpu") -> Iterable[torch.Tensor]:
        """The row indices of each step: a fresh shuffle per pass (in order for a single pass)."""
        for _ in range(self.epochs):
            order = torch.arange(self.rows) if self.single_pass else torch.randperm(self.rows)
            for start in range(0, self.rows, self.per_minibatch):
                yield order[start : start + self.per_minibatch].to(device)

    def gradient_step(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor, stats: dict[str, Any]) -> None:
        """``zero_grad``, ``backward``, the gradient clipped to ``max_grad_norm``, ``optimizer.step()``;
        ``loss``, ``grad_norm`` and ``stats`` kept for :meth:`means`."""
        optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        optimizer.step()
        for key, value in {"loss": loss.detach(), "grad_norm": grad_norm, **stats}.items():
            self._stats.setdefault(key, []).append(float(value))

    def means(self) -> dict[str, float]:
        """The mean over the steps taken of ``loss``, ``grad_norm`` and each statistic given."""
        return {key: float(np.mean(values)) for key, values in self._stats.items()}
