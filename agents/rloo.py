"""RLOO (REINFORCE leave-one-out, Ahmadian et al. 2024) for language-model policies.

Run:    python agents/rloo.py --env asyncvec/SingleDigitSums-v0 --sft-steps 400 --target-reward 0.85
Installed: asyncvec-rloo (or python -m asyncvec.agents.rloo) with the same options
Import: from asyncvec.agents.rloo import RLOO, Args; result = RLOO(Args(sft_steps=400, target_reward=0.85)).train()

Each prompt gets ``k = --group-size`` completions from the policy: ``HFTextPolicy`` in process
(``--backend hf``, default), an in-process vLLM engine (``--backend vllm``) or a server
(``--backend openai --base-url ... --server-kind asyncvec|vllm|sglang``). A
``GroupCollector`` samples and scores them (in a background thread with ``--mode async``, while
the learner trains on the groups already complete). The objective:

* reward with the KL penalty inside: ``R_i = r_i - beta * sum_t KL_t`` (``beta = --kl-coef``,
  KL of the learner against the frozen initial model, ``--kl-estimator``);
* leave-one-out baseline: ``A_i = R_i - mean_{j != i} R_j`` over the trainable completions of
  the same prompt; no division by a standard deviation;
* loss ``-mean_i sum_t w_it * A_i * pi_theta(y_it) / pi_prox(y_it)``: REINFORCE on the
  completion's log-likelihood (``pi_prox``: the learner at the start of the update), with the
  truncated importance weight ``w = min(pi_prox / mu, C)`` against the log-probs ``mu`` the
  engine reported (``--is-cap C``, ``--is-level token|sequence``).

One update (``RLOO.update`` below): the trainable batch, ``pi_prox`` and the importance weights,
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
from asyncvec.lm.options import LMArgs
from asyncvec.lm.results import LMTrainResult
from asyncvec.lm.training import LearnerStep, LMAgent, LossAndStats
from asyncvec.losses import approx_kl, kl_penalized_rewards, masked_mean, rloo_advantages


@dataclass
class Args(LMArgs):
    """RLOO: k completions per prompt, leave-one-out baseline, KL penalty in the reward (the options of every LM agent: asyncvec.lm.options.LMArgs)."""


class RLOO(LMAgent):
    """RLOO learner over a text policy (see the module docstring). ``train()`` closes everything;
    otherwise use it as a context manager or call ``close()``. Its update, its advantages and its
    loss are below; its parts (the learner, the policy, the collector, the version manager), its
    optimizer and its ``train`` loop (each update, then a publish) come from
    :class:`asyncvec.lm.training.LMAgent`.

    Example:
        >>> from asyncvec.agents.rloo import RLOO, Args
        >>> result = RLOO(Args(total_prompts=8, prompts_per_update=4, eval_prompts=0, progress=False)).train()
        >>> result.updates, result.final_version
        (2, 2)
    """

    name = "rloo"  # the run's TensorBoard folder: runs/<env>__rloo__...
    label = "RLOO"  # in messages and the summary
    min_group_samples = 2  # the leave-one-out baseline needs another sample of the group

    # ------------------------------------------------------------------ one update
    def update(self, groups: GroupBatch | EpisodeGroups) -> dict[str, float]:
        """One RLOO update on ``--prompts-per-update`` complete groups; returns its statistics. ``train()``
        then publishes the new weights (``VersionManager.publish -> policy.load_weights``)."""
        # too stale groups, flagged rewards, deadline misses and groups left with one completion are out
        data = self.trainable_batch(groups)
        if not len(data):
            return dict(data.info)  # nothing to train on: no step, no new version
        # pi_prox (the learner now, detached), the reference's log-probs, the IS weights w = min(pi_prox / mu, C)
        step = LearnerStep(data, self.parts, self.args)
        advantages = self.compute_advantages(
            data, step.prox_logp, step.ref_logp
        )  # KL-penalized rewards less the leave-one-out mean
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
        """``A_i`` of each completion (multi-turn: each episode, from its return), broadcast to its
        tokens: ``[N, L]`` (0 off the mask). ``--per-turn``: each turn's normalized return-to-go, its reward
        less ``beta`` times its tokens' KL."""
        if isinstance(data, EpisodeBatch) and self.args.per_turn:
            kl = approx_kl(logp, ref_logp, self.args.kl_estimator) if ref_logp is not None else None
            return data.turn_advantages(kl, self.args.kl_coef)
        rewards = data.rewards
        if ref_logp is not None:
            rewards = kl_penalized_rewards(
                rewards, logp, ref_logp, self.args.kl_coef, data.mask, self.args.kl_estimator
            )
        advantages = torch.zeros_like(rewards)
        # Flagged samples and deadline misses are out, so groups may be smaller than k: one baseline per group.
        for group in data.group_ids.unique():
            rows = (data.group_ids == group).nonzero().squeeze(-1)
            advantages[rows] = rloo_advantages(rewards[rows].unsqueeze(0)).squeeze(0)
        return advantages.unsqueeze(-1) * data.mask

    # ------------------------------------------------------------------ the loss
    def policy_loss(self, logp, prox_logp, advantages, weights, mask, ref_logp=None) -> LossAndStats:
        """``-mean_i sum_t w_it A_i pi/pi_prox``: sum over a completion's tokens, mean over completions
        (per token ``[rows, L]``; ``ref_logp`` unused: RLOO's KL penalty is in the reward)."""
        ratio = torch.exp(logp - prox_logp)
        loss = -(weights * advantages * ratio * mask).sum(-1).mean()
        return loss, {"ratio_mean": masked_mean(ratio.detach(), mask)}


def train(args: Args) -> LMTrainResult:
    """Builds an RLOO learner from ``args``, trains it and returns the result."""
    return RLOO(args).train()


def cli() -> None:
    """``asyncvec-rloo``, ``python -m asyncvec.agents.rloo`` or, in a clone, ``python agents/rloo.py``."""
    lm_cli(RLOO, Args)


if __name__ == "__main__":
    cli()
