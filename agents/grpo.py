"""GRPO (Group Relative Policy Optimization, Shao et al. 2024, DeepSeekMath) for language-model policies.

Run:    python agents/grpo.py --env asyncvec/SingleDigitSums-v0 --sft-steps 400 --target-reward 0.85
Installed: asyncvec-grpo (or python -m asyncvec.agents.grpo) with the same options
Import: from asyncvec.agents.grpo import GRPO, Args; result = GRPO(Args(sft_steps=400, target_reward=0.85)).train()

Each prompt gets ``k = --group-size`` completions from the policy: ``HFTextPolicy`` in process
(``--backend hf``, default), an in-process vLLM engine (``--backend vllm``) or a server
(``--backend openai --base-url ... --server-kind asyncvec|vllm|sglang``). A
``GroupCollector`` samples and scores them (in a background thread with ``--mode async``, while
the learner trains on the groups already complete). No critic; the objective:

* group-normalized advantages ``A_i = (r_i - mean_j r_j) / (std_j r_j + eps)`` over the trainable
  completions of the same prompt (``std``: the sample standard deviation; a group whose rewards
  are all equal teaches nothing), the same for every token of completion ``i`` (outcome
  supervision; multi-turn: each episode's return);
* per token, PPO-clip against ``pi_prox`` (the learner at the start of the update):
  ``min(rho_t A_i, clip(rho_t, 1 - eps, 1 + eps) A_i)``, ``rho = pi_theta / pi_prox``,
  ``eps = --clip-coef``;
* the KL to the frozen initial model as its own loss term, not in the reward: ``beta * KL_t``
  with the k3 estimator ``KL_t = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1`` per token
  (``beta = --kl-coef``, 0.04 as in the paper);
* loss ``-mean_i 1/|y_i| sum_t w_it * (min(...) - beta * KL_it)``: a mean over each completion's
  tokens, then over completions, each token weighted by the truncated importance weight
  ``w = min(pi_prox / mu, C)`` against the log-probs ``mu`` the engine reported (``--is-cap C``,
  ``--is-level``).

One update (``GRPO.update`` below): the trainable batch, ``pi_prox`` and the importance weights, the
advantages, ``--update-epochs`` passes of ``--num-minibatches`` minibatch steps on the loss, then a publish.
Not trained on (``asyncvec.lm.training.trainable_batch``): groups more than ``--max-staleness``
versions old (a completion's oldest token), flagged rewards (unknown), completions that missed
``--deadline-ms`` (the policy never sampled them), and groups left with one trainable completion
(no standard deviation). After each update that trained on something the weights are published:
``VersionManager.publish -> policy.load_weights``, and later completions carry the new version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from asyncvec.agents.common import lm_cli
from asyncvec.buffers import GroupBatch
from asyncvec.lm.episode_records import EpisodeGroups
from asyncvec.lm.learner import EpisodeBatch, LMBatch
from asyncvec.lm.options import LMArgs, check_clip_coef
from asyncvec.lm.results import LMTrainResult
from asyncvec.lm.training import LearnerStep, LMAgent, LossAndStats
from asyncvec.losses import approx_kl, clipped_fraction, grpo_advantages, masked_mean


@dataclass
class Args(LMArgs):
    """GRPO: group-normalized advantages, PPO-clip per token, KL to the reference as a loss term (the options of
    every LM agent: asyncvec.lm.options.LMArgs; its own below)."""

    learning_rate: float = 5e-4
    """Adam learning rate (the group-normalized advantages are about 1 in size, as REINFORCE++'s)"""
    update_epochs: int = 2
    """passes over each batch (the clipped objective keeps a second pass safe)"""
    kl_coef: float = 0.04
    """beta: weight of the KL term in the loss, against the frozen initial model (0: no reference model)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """the KL term's per-token estimator (asyncvec.losses.approx_kl): k3 (the paper's) or k2; k1 is refused (as a
    loss term its gradient has mean zero)"""
    clip_coef: float = 0.2
    """PPO clip coefficient eps"""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_clip_coef(self.clip_coef)
        if self.kl_estimator == "k1" and self.kl_coef > 0:
            raise ValueError(
                "--kl-estimator k1 does not regularize as a loss term (its gradient has mean zero): use k3"
            )


class GRPO(LMAgent):
    """GRPO learner over a text policy (see the module docstring). ``train()`` closes everything;
    otherwise use it as a context manager or call ``close()``. Its update, its advantages and its
    loss are below; its parts, its optimizer and its ``train`` loop (each update, then a publish)
    come from :class:`asyncvec.lm.training.LMAgent`.

    Example:
        >>> from asyncvec.agents.grpo import GRPO, Args
        >>> result = GRPO(Args(total_prompts=8, prompts_per_update=4, eval_prompts=0, progress=False)).train()
        >>> result.updates, result.final_version
        (2, 2)
    """

    name = "grpo"  # the run's TensorBoard folder: runs/<env>__grpo__...
    label = "GRPO"  # in messages and the summary
    min_group_samples = 2  # a group's standard deviation needs two samples
    args: Args

    # ------------------------------------------------------------------ one update
    def update(self, groups: GroupBatch | EpisodeGroups) -> dict[str, float]:
        """One GRPO update on ``--prompts-per-update`` complete groups; returns its statistics. ``train()``
        then publishes the new weights (``VersionManager.publish -> policy.load_weights``)."""
        # too stale groups, flagged rewards, deadline misses and groups left with one completion are out
        data = self.trainable_batch(groups)
        if not len(data):
            return dict(data.info)  # nothing to train on: no step, no new version
        # pi_prox (the learner now, detached), the reference's log-probs, the IS weights w = min(pi_prox / mu, C)
        step = LearnerStep(data, self.parts, self.args)
        advantages = self.compute_advantages(data, step.prox_logp, step.ref_logp)
        for rows in step.minibatches():  # --update-epochs passes of --num-minibatches shuffled minibatches
            logp = step.logps(rows)  # pi_theta, with gradients
            ref_logp = None if step.ref_logp is None else step.ref_logp[rows]
            loss, stats = self.policy_loss(
                logp, step.prox_logp[rows], advantages[rows], step.weights[rows], data.mask[rows], ref_logp
            )
            step.gradient_step(self.optimizer, loss, stats)  # gradient clipped to --max-grad-norm, Adam step
        return step.stats(advantages)

    # ------------------------------------------------------------------ the advantages
    def compute_advantages(
        self, data: LMBatch | EpisodeBatch, logp: torch.Tensor, ref_logp: torch.Tensor | None
    ) -> torch.Tensor:
        """``A_i`` of each completion (multi-turn: each episode, from its return), broadcast to its
        tokens: ``[N, L]`` (0 off the mask). ``--per-turn``: each turn's normalized return-to-go.
        No KL here: it is a term of the loss."""
        if isinstance(data, EpisodeBatch) and self.args.per_turn:
            return data.turn_advantages()
        # Flagged samples and deadline misses are out, so groups may be smaller than k: each is normalized alone.
        return grpo_advantages(data.rewards, data.group_ids).unsqueeze(-1) * data.mask

    # ------------------------------------------------------------------ the loss
    def policy_loss(self, logp, prox_logp, advantages, weights, mask, ref_logp=None) -> LossAndStats:
        """``-mean_i 1/|y_i| sum_t w_it (min(rho A, clip(rho) A) - beta KL_k3)``: token mean per completion,
        then the mean over completions (per token ``[rows, L]``; ``ref_logp``: the reference's, None without
        ``--kl-coef``)."""
        eps, beta = self.args.clip_coef, self.args.kl_coef
        ratio = torch.exp(logp - prox_logp)
        objective = torch.min(ratio * advantages, ratio.clamp(1 - eps, 1 + eps) * advantages)
        kl = approx_kl(logp, ref_logp, self.args.kl_estimator) if ref_logp is not None else torch.zeros_like(logp)
        per_token = weights * (objective - beta * kl) * mask
        loss = -(per_token.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
        stats = {
            "ratio_mean": masked_mean(ratio.detach(), mask),
            "clip_fraction": clipped_fraction(ratio.detach(), 1 - eps, 1 + eps, mask),
            "kl_loss_term": masked_mean(kl.detach(), mask),
        }
        return loss, {key: float(value) for key, value in stats.items()}


def train(args: Args) -> LMTrainResult:
    """Builds a GRPO learner from ``args``, trains it and returns the result."""
    return GRPO(args).train()


def cli() -> None:
    """``asyncvec-grpo``, ``python -m asyncvec.agents.grpo`` or, in a clone, ``python agents/grpo.py``."""
    lm_cli(GRPO, Args)


if __name__ == "__main__":
    cli()
