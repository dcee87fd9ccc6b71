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

One update (``ReinforcePP.update`` below): the trainable batch, ``pi_prox`` and the importance weights,
the advantages, ``--update-epochs`` passes of ``--num-minibatches`` minibatch steps on the loss, then a publish.
Not trained on (``asyncvec.lm.training.trainable_batch``): groups more than ``--max-staleness``
versions old (a completion's oldest token: with in-flight weight updates its tokens may span
versions, and each token's ``mu`` is under its own version), flagged rewards (unknown), completions that missed ``--deadline-ms`` (the policy
never sampled them). After each update that trained on something the weights are published:
``VersionManager.publish -> policy.load_weights``, and later completions carry the new version.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncvec.agents.common import lm_cli
from asyncvec.buffers import GroupBatch
from asyncvec.lm.episode_records import EpisodeGroups
from asyncvec.lm.learner import EpisodeBatch, LMBatch
from asyncvec.lm.options import LMArgs, check_clip_coef
from asyncvec.lm.results import LMTrainResult
from asyncvec.lm.training import LearnerStep, LMAgent, LossAndStats
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
        check_clip_coef(self.clip_coef)


class ReinforcePP(LMAgent):
    """REINFORCE++ learner over a text policy (see the module docstring). ``train()`` closes everything;
    otherwise use it as a context manager or call ``close()``. Its update, its advantages and its
    loss are below; its parts (the learner, the policy, the collector, the version manager), its
    optimizer and its ``train`` loop (each update, then a publish) come from
    :class:`asyncvec.lm.training.LMAgent`.

    Example:
        >>> from asyncvec.agents.reinforce_pp import ReinforcePP, Args
        >>> args = Args(total_prompts=8, prompts_per_update=4, baseline=True, eval_prompts=0, progress=False)
        >>> ReinforcePP(args).train().final_version
        2
    """

    name = "reinforce_pp"  # the run's TensorBoard folder: runs/<env>__reinforce_pp__...
    label = "REINFORCE++"  # in messages and the summary
    min_group_samples = 1  # the advantages are normalized over the whole batch
    args: Args

    @classmethod
    def run_label(cls, args: LMArgs) -> str:
        """REINFORCE++, or REINFORCE++-baseline with ``--baseline``."""
        return cls.label + ("-baseline" if isinstance(args, Args) and args.baseline else "")

    # ------------------------------------------------------------------ one update
    def update(self, groups: GroupBatch | EpisodeGroups) -> dict[str, float]:
        """One REINFORCE++ update on ``--prompts-per-update`` complete groups; returns its statistics. ``train()``
        then publishes the new weights (``VersionManager.publish -> policy.load_weights``)."""
        # too stale groups, flagged rewards and deadline misses are out
        data = self.trainable_batch(groups)
        if not len(data):
            return dict(data.info)  # nothing to train on: no step, no new version
        # pi_prox (the learner now, detached), the reference's log-probs, the IS weights w = min(pi_prox / mu, C)
        step = LearnerStep(data, self.parts, self.args)
        advantages = self.compute_advantages(
            data, step.prox_logp, step.ref_logp
        )  # returns-to-go, normalized over the batch
        for rows in step.minibatches():  # --update-epochs passes of --num-minibatches shuffled minibatches
            logp = step.logps(rows)  # pi_theta, with gradients
            loss, stats = self.policy_loss(
                logp, step.prox_logp[rows], advantages[rows], step.weights[rows], data.mask[rows]
            )
            step.gradient_step(self.optimizer, loss, stats)  # gradient clipped to --max-grad-norm, Adam step
        return step.stats(advantages)

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

    # ------------------------------------------------------------------ the loss
    def policy_loss(self, logp, prox_logp, advantages, weights, mask, ref_logp=None) -> LossAndStats:
        """PPO-clip against ``pi_prox``, each token weighted by its truncated IS weight; mean over tokens
        (per token ``[rows, L]``; ``ref_logp`` unused: the KL penalty is in the token rewards)."""
        return ppo_clip_loss(logp, prox_logp, advantages, self.args.clip_coef, mask=mask, weights=weights)


def train(args: Args) -> LMTrainResult:
    """Builds a REINFORCE++ learner from ``args``, trains it and returns the result."""
    return ReinforcePP(args).train()


def cli() -> None:
    """``asyncvec-reinforce-pp``, ``python -m asyncvec.agents.reinforce_pp`` or, in a clone, ``python agents/reinforce_pp.py``."""
    lm_cli(ReinforcePP, Args)


if __name__ == "__main__":
    cli()
