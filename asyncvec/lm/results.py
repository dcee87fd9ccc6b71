"""What a language-model agent's ``train`` returns (:class:`LMTrainResult`) and the summary its
command line prints.

Example:
    >>> from asyncvec.lm.results import eval_line
    >>> eval_line(0.25, 0.75)
    'eval reward before RL 0.250 -> after RL 0.750'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


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
    ``spanning_fraction``: the share of the samples trained on whose tokens came from more than
    one version (in-flight weight updates; docs/lm_agents.md, "Per-token versions").
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
    spanning_fraction: float = 0.0
    log_path: str | None = None
    """the run's TensorBoard folder (None with ``--no-track``)"""
    checkpoint_path: str | None = None
    """the checkpoint file (None without ``--checkpoint-dir``)"""
    output_path: str | None = None
    """where the trained model was saved (``--output-dir``; None: not saved)"""

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
            spanning_fraction=sum(row.get("spanning_samples", 0) for row in history)
            / max(sum(row.get("samples_used", 0) for row in history), 1),
        )


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


def reward_words(curve: list[float]) -> str:
    """The training reward of a run in a few words: the mean of its first and of its last updates (a tenth of
    them, at least one each); the whole curve is ``result.reward_curve`` and TensorBoard's ``charts/reward``.

    Example:
        >>> reward_words([0.1, 0.2, 0.5, 0.9])
        'training reward 0.10 -> 0.90 (first -> last update)'
        >>> reward_words([])
        'no update'
    """
    finite = [r for r in curve if not math.isnan(r)]
    if not finite:
        return "no update"
    k = max(1, len(finite) // 10)
    first, last = sum(finite[:k]) / k, sum(finite[-k:]) / k
    span = "first -> last update" if k == 1 else f"mean of the first {k} -> last {k} updates"
    return f"training reward {first:.2f} -> {last:.2f} ({span})"


def summary(name: str, result: LMTrainResult) -> str:
    """A short report of a run, printed by the agents' CLIs and the demo: a line of speed and rewards, a line of
    sample accounting (the curves are in TensorBoard)."""
    return (
        (
            f"{name}: {result.updates} updates, {result.samples} completions in {result.wall_time_s:.1f} s "
            f"({result.samples_per_s:.0f} completions/s), {reward_words(result.reward_curve)}; "
            f"{eval_line(result.eval_reward_before, result.eval_reward_after)}\n"
            f"  stale {result.stale_fraction:.1%}, IS-truncated {result.truncated_fraction:.1%}, "
            f"flagged {result.flagged_fraction:.1%}, unparsable {result.fallback_fraction:.1%}, "
            f"missed deadlines {result.missed_deadline_fraction:.1%}, "
            f"mean staleness {result.staleness_mean:.2f}, final version {result.final_version}"
            + (f", spanning versions {result.spanning_fraction:.1%}" if result.spanning_fraction else "")
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
