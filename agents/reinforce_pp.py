"""REINFORCE++ (Hu 2025) for language-model policies, with the ``--baseline`` variant.

Run:    python agents/reinforce_pp.py --env asyncvec/SingleDigitSums-v0 --sft-steps 400 --target-reward 0.85
Import: from agents.reinforce_pp import ReinforcePP, Args; result = ReinforcePP(Args(sft_steps=400)).train()

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

Not trained on (``asyncvec.lm.LMBatch.from_groups``): groups more than ``--max-staleness``
versions old, flagged rewards (unknown), completions that missed ``--deadline-ms`` (the policy
never sampled them). After each update that trained on something the weights are published:
``VersionManager.publish -> policy.load_weights``, and later completions carry the new version.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import tyro

from agents.common import seed_everything
from agents.lm_setup import (
    LMArgs,
    LMTrainResult,
    batch_sizes,
    build_parts,
    confirm_target,
    mean_reward,
    summary,
    target_reached,
)
from asyncvec.buffers import GroupBatch
from asyncvec.lm import EpisodeBatch, EpisodeGroups, LMBatch, minibatch_updates, quiet_model_libraries
from asyncvec.losses import approx_kl, ppo_clip_loss, reinforce_pp_advantages, truncated_importance_weights
from asyncvec.metrics import RunLogger


@dataclass
class Args(LMArgs):
    """REINFORCE++: token-level returns normalized over the batch, PPO-clip loss, no critic."""

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


class ReinforcePP:
    """REINFORCE++ learner over a text policy (see the module docstring). ``train()`` closes
    everything; otherwise use it as a context manager or call ``close()``.

    Example:
        >>> from agents.reinforce_pp import ReinforcePP, Args
        >>> args = Args(total_prompts=8, prompts_per_update=4, baseline=True, eval_prompts=0, progress=False)
        >>> ReinforcePP(args).train().final_version
        2
    """

    def __init__(self, args: Args, policy: Any | None = None) -> None:
        """``policy``: a text policy to sample from instead of one built from ``--backend`` (it
        stays open after the run); the learner's starting weights are published to it first."""
        self.args = args
        seed_everything(args.seed)
        if args.backend != "vllm":  # an in-process vLLM engine on the CPU binds the torch threads itself
            torch.set_num_threads(args.torch_threads)
        quiet_model_libraries()
        self.run_name = f"{args.env.replace('/', '_')}__reinforce_pp__{args.mode}__{args.seed}__{int(time.time())}"
        # the prompts, the (warm-started) model, the learner and its frozen reference, the reward
        # service, the policy, the version manager and the group collector (see agents/lm_setup.py)
        self.parts = build_parts(args, self.run_name, policy)
        self.learner, self.tokenizer, self.reference = self.parts.learner, self.parts.tokenizer, self.parts.reference
        self.policy, self.versions, self.collector = self.parts.policy, self.parts.versions, self.parts.collector
        self.optimizer = torch.optim.Adam(self.learner.parameters(), lr=args.learning_rate)

    # ------------------------------------------------------------------ the objective
    def compute_advantages(self, data: LMBatch, logp: torch.Tensor, ref_logp: torch.Tensor | None) -> torch.Tensor:
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

    def policy_loss(self, logp, prox_logp, advantages, weights, mask):
        """PPO-clip against ``pi_prox``, each token weighted by its truncated IS weight; mean over tokens."""
        return ppo_clip_loss(logp, prox_logp, advantages, self.args.clip_coef, mask=mask, weights=weights)

    # ------------------------------------------------------------------ one update
    def prepare(self, groups: GroupBatch | EpisodeGroups) -> LMBatch | EpisodeBatch:
        """The trainable completions (or episode turns) of ``groups`` as tensors; records their staleness and the drops."""
        current = self.versions.current_version
        self.versions.record_staleness(groups.staleness(current).ravel().tolist())
        if isinstance(groups, EpisodeGroups):  # multi-turn: a row per episode, stale turns masked one by one
            data = EpisodeBatch.from_episodes(
                groups, current, self.args.max_staleness, self.args.gamma, min_group_samples=1,
                device=self.args.device,
            )  # fmt: skip
            self.versions.record_dropped(int(data.info["stale_samples"]))
            return data
        data = LMBatch.from_groups(
            groups, self.tokenizer, current, self.args.max_staleness, min_group_samples=1, device=self.args.device
        )
        self.versions.record_dropped(int(data.info["stale_samples"]))
        return data

    def update(self, groups: GroupBatch | EpisodeGroups) -> dict[str, float]:
        """One learner update on complete groups; returns its statistics (no publish)."""
        args = self.args
        data = self.prepare(groups)
        num_groups, received = batch_sizes(groups)
        stats = {**data.info, "groups": num_groups, "samples_received": received}
        if not len(data):
            return stats
        # pi_prox: the learner at update start. One pass over one minibatch reuses its graph.
        single_pass = args.update_epochs == 1 and args.num_minibatches == 1
        with torch.set_grad_enabled(single_pass):
            logp = data.logps(self.learner, args.temperature)
        prox = logp.detach()
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = data.logps(self.reference, args.temperature)
        advantages = self.compute_advantages(data, prox, ref)
        # Truncated IS of pi_prox against the engine's behavior log-probs mu.
        weights, is_stats = truncated_importance_weights(
            prox, data.behavior_logp, args.is_cap, level=args.is_level, mask=data.mask
        )
        if args.is_level == "sequence":
            weights = weights.unsqueeze(-1) * data.mask
        losses = minibatch_updates(
            data,
            self.learner,
            self.optimizer,
            lambda logp_rows, rows: self.policy_loss(
                logp_rows, prox[rows], advantages[rows], weights[rows], data.mask[rows]
            ),
            epochs=args.update_epochs,
            minibatches=args.num_minibatches,
            max_grad_norm=args.max_grad_norm,
            temperature=args.temperature,
            logp=logp if single_pass else None,
        )
        entries = len(data) if args.is_level == "sequence" else int(data.mask.sum())
        stats.update({f"losses/{k}": v for k, v in losses.items()})
        stats.update({f"is/{k}": float(v) for k, v in is_stats.items()})
        stats.update({"is/entries": entries, "is/clipped": round(float(is_stats["clipped_fraction"]) * entries)})
        stats["advantage_abs_mean"] = float(advantages.abs()[data.mask].mean())
        if ref is not None:
            stats["kl_ref"] = float(((prox - ref) * data.mask).sum(-1).mean())
        return stats

    def learner_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.learner.state_dict().items()}

    def publish(self) -> int:
        """Sends the learner's weights to the policy (``policy.load_weights``); returns the new version."""
        return self.versions.publish(self.learner_weights())

    def evaluate(self, num_prompts: int) -> float:
        """Mean reward of one sampled completion for each of ``num_prompts`` held-out prompts."""
        return mean_reward(self.parts, num_prompts, self.args.seed + 1, self.args.timeout_s)

    # ------------------------------------------------------------------ the loop
    def train(self) -> LMTrainResult:
        """Trains on ``total_prompts`` prompts (or until ``target_reward``) and closes everything."""
        args = self.args
        logger = RunLogger(
            Path(args.log_dir) / self.run_name,
            track=args.track,
            total_steps=args.total_prompts,
            progress=args.progress,
            hparams=asdict(args),
        )
        history: list[dict] = []
        confirmations: list[float] = []
        reached = False
        try:
            eval_before = self.evaluate(args.eval_prompts)
            start = time.monotonic()
            if args.mode == "async":  # generation runs ahead while the learner trains
                self.collector.start(args.total_prompts, ahead=args.prefetch_updates * args.prompts_per_update)
            prompts_done = 0
            pending = None  # a batch that failed to confirm the target, trained on next
            while prompts_done < args.total_prompts or pending is not None:
                waited = time.monotonic()
                if pending is None:
                    num = min(args.prompts_per_update, args.total_prompts - prompts_done)
                    if args.mode == "sync":
                        self.collector.submit(num)
                    groups = self.collector.pop(num, args.timeout_s)
                    prompts_done += num
                else:
                    groups, pending = pending, None
                learned = time.monotonic()
                stats = self.update(groups)
                published = time.monotonic()
                if stats["samples_used"]:  # no step, no new version
                    self.publish()
                elapsed = time.monotonic() - start
                row = {
                    **stats,
                    "time/wait_s": learned - waited,
                    "time/learn_s": published - learned,
                    "time/publish_s": elapsed + start - published,
                    "charts/reward": stats["reward"],
                    "charts/version": self.versions.current_version,
                    "charts/completions_per_s": self.collector.samples / elapsed,
                    "time/wall_s": elapsed,
                    "charts/policy_latency_p50_ms": self.policy.stats()["latency_p50_ms"],
                }
                history.append(row)
                logger.log(row, prompts_done)
                if target_reached([r["reward"] for r in history], args.target_reward):
                    check = confirm_target(self.parts, args, args.total_prompts - prompts_done)
                    prompts_done += check.popped
                    confirmations.append(check.reward)
                    logger.log({"charts/target_confirm_reward": check.reward}, prompts_done)
                    if check.confirmed or check.batch is None:
                        reached = check.confirmed
                        break
                    pending = check.batch
            wall = time.monotonic() - start
            self.collector.stop()
            eval_after = self.evaluate(args.eval_prompts)
            eval_details = list(self.parts.eval_log)
            if args.output_dir:
                self.learner.save_pretrained(args.output_dir)
                self.tokenizer.save_pretrained(args.output_dir)
        finally:
            logger.close()
            self.close()
        result = LMTrainResult.from_run(
            history,
            self.collector.stats(),
            wall,
            (eval_before, eval_after),
            self.versions.staleness_stats().mean,
            (self.parts.start_version, self.versions.current_version),
            reached,
        )
        result.eval_details, result.target_confirmations = eval_details, confirmations
        return result

    def close(self) -> None:
        """Stops generation; closes the policy, the reward service and the envs (reverse order)."""
        self.parts.resources.close()

    def __enter__(self) -> ReinforcePP:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def train(args: Args) -> LMTrainResult:
    """Builds a REINFORCE++ learner from ``args``, trains it and returns the result."""
    return ReinforcePP(args).train()


if __name__ == "__main__":
    args = tyro.cli(Args)
    print(summary("REINFORCE++" + ("-baseline" if args.baseline else ""), train(args)))
