"""REINFORCE++ (Hu 2025) for language-model policies, with the ``--baseline`` variant.

Run:    python agents/reinforce_pp.py --env asyncvec/SingleDigitSums-v0 --sft-steps 400 --target-reward 0.85
Installed: asyncvec-reinforce-pp (or python -m asyncvec.agents.reinforce_pp) with the same options
Import: from asyncvec.agents.reinforce_pp import ReinforcePP, Args; result = ReinforcePP(Args(sft_steps=400)).train()

Each prompt gets ``k = --group-size`` completions from the policy: ``HFTextPolicy`` in process
(``--backend hf``, default), an in-process vLLM engine (``--backend vllm``) or a server
(``--backend openai --base-url ... --server-kind asyncvec|vllm|sglang``). A
``GroupCollector`` samples and scores them (in a background thread with ``--mode async``, while
the learner trains on the groups already complete). No critic:

* token rewards ``r_t = 1[t = T] * R - beta * KL_t`` (``T``: the completion's last token,
  ``beta = --kl-coef``, KL against the frozen initial model, ``--kl-estimator``);
  ``--baseline`` (REINFORCE++-baseline) first subtracts from ``R`` the mean reward of the
  prompt's trainable completions;
* returns ``G_t = sum_{i >= t} r_i``, advantages ``(G_t - mean G) / std G`` over all valid
  tokens of the batch;
* PPO-clip loss ``-mean_t w_t * min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t)`` with
  ``rho = pi_theta / pi_prox`` (``pi_prox``: the learner at the start of the update,
  ``eps = --clip-coef``) and the truncated importance weight ``w = min(pi_prox / mu, C)``
  against the log-probs ``mu`` the engine reported (``--is-cap C``, ``--is-level``).

Not trained on (``asyncvec.lm.training.trainable_batch``): groups more than ``--max-staleness``
versions old (a completion's oldest token: with in-flight weight updates its tokens may span
versions, and each token's ``mu`` is under its own version), flagged rewards (unknown), completions that missed ``--deadline-ms`` (the policy
never sampled them). After each update that trained on something the weights are published:
``VersionManager.publish -> policy.load_weights``, and later completions carry the new version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import tyro

from asyncvec.agents.common import exit_on_missing_extra, exit_on_setup_error
from asyncvec.buffers import GroupBatch
from asyncvec.lm.episodes import EpisodeGroups
from asyncvec.lm.learner import EpisodeBatch, LMBatch
from asyncvec.lm.options import LMArgs
from asyncvec.lm.results import LMTrainResult, summary
from asyncvec.lm.training import LearnerStep, LMAgent, TrainingRun, trainable_batch
from asyncvec.losses import approx_kl, ppo_clip_loss, reinforce_pp_advantages


@dataclass
class Args(LMArgs):
    """REINFORCE++: token-level returns normalized over the batch, PPO-clip loss, no critic (the options of every
    LM agent: asyncvec.lm.options.LMArgs; its own below)."""

    learning_rate: float = 5e-4
    """Adam learning rate (lower than RLOO's: the globally normalized advantages are larger)"""
    update_epochs: int = 2
    """passes over each batch (the clipped objective keeps a second pass safe)"""
    baseline: bool = False
    """REINFORCE++-baseline: subtract each prompt's mean reward before the returns"""
    clip_coef: float = 0.2
    """PPO clip coefficient eps"""

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            isinstance(self.clip_coef, bool)
            or not isinstance(self.clip_coef, (int, float))
            or not 0 < self.clip_coef < 1
        ):
            raise ValueError(f"--clip-coef must be a number in (0, 1), got {self.clip_coef!r}")


class ReinforcePP(LMAgent):
    """REINFORCE++ learner over a text policy (see the module docstring). ``train()`` closes
    everything; otherwise use it as a context manager or call ``close()``. Its parts (the
    learner, the policy, the collector, the version manager) come from
    :class:`asyncvec.lm.training.LMAgent`.

    Example:
        >>> from asyncvec.agents.reinforce_pp import ReinforcePP, Args
        >>> args = Args(total_prompts=8, prompts_per_update=4, baseline=True, eval_prompts=0, progress=False)
        >>> ReinforcePP(args).train().final_version
        2
    """

    name = "reinforce_pp"

    def __init__(self, args: Args, policy: Any | None = None) -> None:
        super().__init__(args, policy)
        self.optimizer = torch.optim.Adam(self.learner.parameters(), lr=args.learning_rate)

    # ------------------------------------------------------------------ the advantages
    def compute_advantages(
        self, data: LMBatch | EpisodeBatch, logp: torch.Tensor, ref_logp: torch.Tensor | None
    ) -> torch.Tensor:
        """Globally normalized returns-to-go ``[N, L]`` (0 off the mask); multi-turn: the episode
        return at its last trained token. ``--per-turn``: each turn's normalized return-to-go, its reward
        less ``beta`` times its tokens' KL."""
        args = self.args
        kl = approx_kl(logp, ref_logp, args.kl_estimator) if ref_logp is not None else None
        if isinstance(data, EpisodeBatch) and args.per_turn:
            return data.turn_advantages(kl, args.kl_coef)
        return reinforce_pp_advantages(
            data.rewards, data.mask, kl, args.kl_coef, baseline=args.baseline, group_ids=data.group_ids
        )

    # ------------------------------------------------------------------ one update
    def update(self, groups: GroupBatch | EpisodeGroups) -> dict[str, float]:
        """One learner update on complete groups (no publish): the clipped objective over
        ``--update-epochs`` passes, all against ``pi_prox``; returns its statistics."""
        # min_group_samples: the advantages are normalized over the whole batch
        data = trainable_batch(groups, self.parts, self.args, min_group_samples=1)
        if not len(data):
            return dict(data.info)  # nothing is trainable: no step
        step = LearnerStep(data, self.parts, self.args)  # pi_prox, the reference's log-probs, truncated IS weights
        advantages = self.compute_advantages(data, step.prox_logp, step.ref_logp)
        return {**data.info, **step.minimize(self.optimizer, self.policy_loss, advantages)}

    # ------------------------------------------------------------------ the loss
    def policy_loss(
        self,
        logp: torch.Tensor,
        prox_logp: torch.Tensor,
        advantages: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """PPO-clip against ``pi_prox``, each token weighted by its truncated IS weight; mean over tokens."""
        return ppo_clip_loss(logp, prox_logp, advantages, self.args.clip_coef, mask=mask, weights=weights)

    # ------------------------------------------------------------------ the loop
    def train(self) -> LMTrainResult:
        """Trains on ``total_prompts`` prompts (or until ``target_reward``) and closes everything."""
        # TrainingRun: evaluation before and after, logging, generation started (--mode async) and stopped.
        with TrainingRun(self.parts, self.args, self.run_name) as run:
            for groups in run.batches():  # --prompts-per-update complete groups at a time
                run.record(self.update(groups), publish=self.publish)  # publishes, checks --target-reward
        return run.result()


def train(args: Args) -> LMTrainResult:
    """Builds a REINFORCE++ learner from ``args``, trains it and returns the result."""
    return ReinforcePP(args).train()


def cli() -> None:
    """``asyncvec-reinforce-pp``, ``python -m asyncvec.agents.reinforce_pp`` or, in a clone, ``python agents/reinforce_pp.py``."""
    args = tyro.cli(Args)
    name = "REINFORCE++" + ("-baseline" if args.baseline else "")
    with exit_on_setup_error(name):
        agent = ReinforcePP(args)
    with exit_on_missing_extra(name):
        print(summary(name, agent.train()))


if __name__ == "__main__":
    cli()
