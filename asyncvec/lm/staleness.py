"""``--max-staleness`` and the options beside it as one object, :class:`Staleness`, with a method for
each place the bound is used.

A sample (a completion, or a turn of a multi-turn episode) is as old as its oldest token: the
learner's version less the version that sampled that token. ``--max-staleness`` bounds that age in
three places:

* :meth:`Staleness.version_manager`: the ``VersionManager``'s ``max_lag`` (its staleness statistics
  count the samples over it);
* :meth:`Staleness.learner_bound`: the learner's filter, the age over which ``trainable_batch`` drops a
  sample (``LMBatch.from_groups``, ``EpisodeBatch.from_episodes``);
* :meth:`Staleness.admission`: with ``--mode async --staleness-control admission``, the gate that starts
  a prompt only once it cannot be older than the bound when trained on.

Beside it: ``--policy-lag`` (the policy receives each version that many updates late,
:meth:`Staleness.lagged`), ``--staleness-control`` and ``--prefetch-updates`` (generation ahead of the
learner, :meth:`Staleness.prompts_ahead`).

Example:
    >>> staleness = Staleness(max_staleness=1, staleness_control="admission", policy_lag=0)
    >>> staleness.version_manager(initial_version=0).max_lag
    1
    >>> staleness.admission("async", prompts_per_update=2)
    AdmissionControl(per_update=2, max_staleness=1, lag=0, updates_done=0)
    >>> staleness.admission("sync", prompts_per_update=2) is None
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from asyncvec.versioning import AdmissionControl, VersionManager, with_lag


@dataclass(frozen=True)
class Staleness:
    """How old a sample may be when trained on, and how generation keeps within it: the ``staleness`` section
    of ``asyncvec.lm.options.LMArgs`` (``--max-staleness``, ``--staleness-control``, ``--policy-lag``,
    ``--prefetch-updates``)."""

    max_staleness: int = 2
    """groups with a completion more than this many versions older than the learner are dropped (its oldest token's
    version: with in-flight weight updates a completion may span versions; multi-turn: such turns are masked out)"""
    staleness_control: Literal["admission", "drop"] = "admission"
    """async mode: "admission" starts a prompt (a multi-turn group) only once it cannot be more than --max-staleness
    versions old when trained on, and trains on groups in the order they started (AReaL's rule: nothing is generated
    to be dropped, long completions included; at --max-staleness 0 async is sync); "drop" generates
    --prefetch-updates ahead, trains on groups as they complete and drops the too stale (biased toward short
    completions, asyncvec docs lm_agents)"""
    policy_lag: int = 0
    """the policy receives each new version this many updates late (a slow weight broadcast)"""
    prefetch_updates: int = 1
    """async mode: updates' worth of prompts generated ahead of the learner"""

    def check(self, mode: str) -> None:
        """Raises ValueError when no prompt could ever start: ``--policy-lag`` over ``--max-staleness``
        under async admission."""
        if mode == "async" and self.staleness_control == "admission" and self.policy_lag > self.max_staleness:
            raise ValueError(
                f"--policy-lag {self.policy_lag} exceeds --max-staleness {self.max_staleness}: under --staleness-control "
                "admission no prompt could start; raise --max-staleness, or pass --staleness-control drop to generate "
                "anyway and count what is dropped"
            )

    # ------------------------------------------------------------------ the bound's three uses
    def version_manager(self, initial_version: int) -> VersionManager:
        """Use 1: the run's ``VersionManager``, whose ``max_lag`` is the bound."""
        return VersionManager(initial_version=initial_version, max_lag=self.max_staleness)

    def learner_bound(self) -> int:
        """Use 2: the age over which the learner drops a sample (``trainable_batch``)."""
        return self.max_staleness

    def admission(self, mode: str, prompts_per_update: int) -> AdmissionControl | None:
        """Use 3: the admission gate of ``--mode async --staleness-control admission`` (None otherwise:
        nothing gates the prompts' start)."""
        if mode != "async" or self.staleness_control != "admission":
            return None
        return AdmissionControl(prompts_per_update, self.max_staleness, self.policy_lag)

    # ------------------------------------------------------------------ the options beside it
    def lagged(self, policy: Any) -> Any:
        """What the ``VersionManager`` publishes to: ``policy``, receiving each version ``--policy-lag`` late
        (``policy`` itself at lag 0: a publish goes straight through, ``asyncvec.versioning.with_lag``)."""
        return with_lag(policy, self.policy_lag)

    def prompts_ahead(self, prompts_per_update: int) -> int:
        """Prompts an async collector may generate ahead of the learner (``--prefetch-updates`` updates' worth)."""
        return self.prefetch_updates * prompts_per_update
