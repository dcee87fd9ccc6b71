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

import contextlib
import itertools
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import tyro

from agents.common import LaggedWeights, seed_everything
from agents.lm_setup import (
    LMArgs,
    LMTrainResult,
    check_reward,
    iter_prompts,
    make_prompt_env,
    make_text_policy,
    prepare_model,
    starting_version,
    summary,
    target_reached,
)
from asyncvec import VersionManager
from asyncvec.buffers import GroupBatch
from asyncvec.group_collector import GroupCollector, score_completions
from asyncvec.lm import LMBatch, load_causal_lm, quiet_model_libraries
from asyncvec.losses import approx_kl, ppo_clip_loss, reinforce_pp_advantages, truncated_importance_weights
from asyncvec.metrics import RunLogger
from asyncvec.rewards import RewardService


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
        self.resources = contextlib.ExitStack()  # closed in reverse order by close()
        with self.resources as stack:  # on an error, close what was built so far
            env = stack.enter_context(make_prompt_env(args.env))
            self.eval_env = stack.enter_context(make_prompt_env(args.env))
            check_reward(args.reward, args.env, env.reset(seed=args.seed)[0])
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="asyncvec-reinforce-pp-")))
            self.model_dir = prepare_model(args, workdir)
            self.learner, self.tokenizer = load_causal_lm(self.model_dir, args.device)
            self.reference = None  # the frozen initial model, for the KL penalty
            if args.kl_coef > 0:
                self.reference = load_causal_lm(self.model_dir, args.device)[0].requires_grad_(False)
            self.optimizer = torch.optim.Adam(self.learner.parameters(), lr=args.learning_rate)
            self.rewarder = stack.enter_context(
                RewardService(args.reward, timeout_s=args.reward_timeout_s, num_workers=2)
            )
            # A server, or a policy given by the caller, may hold other weights than the learner's: send them first.
            sync = policy is not None or args.backend == "openai"
            if policy is None:
                policy = stack.enter_context(
                    make_text_policy(args, self.model_dir, env.action_space, workdir / "weights")
                )
            self.policy = policy
            self.versions = stack.enter_context(
                VersionManager(initial_version=starting_version(self.policy) + sync, max_lag=args.max_staleness)
            )
            if sync:
                self.policy.load_weights(self.learner_weights(), self.versions.current_version)
            self.start_version = self.versions.current_version
            self.versions.register(LaggedWeights(self.policy, args.policy_lag))
            self.collector = stack.enter_context(
                GroupCollector(self.policy, self.rewarder, iter_prompts(env, args.seed), args.group_size)
            )
            self.resources = stack.pop_all()

    # ------------------------------------------------------------------ the objective
    def compute_advantages(self, data: LMBatch, logp: torch.Tensor, ref_logp: torch.Tensor | None) -> torch.Tensor:
        """Globally normalized returns-to-go ``[N, L]`` (0 off the mask)."""
        args = self.args
        kl = approx_kl(logp, ref_logp, args.kl_estimator) if ref_logp is not None else None
        return reinforce_pp_advantages(
            data.rewards, data.mask, kl, args.kl_coef, baseline=args.baseline, group_ids=data.group_ids
        )

    def policy_loss(self, logp, prox_logp, advantages, weights, mask):
        """PPO-clip against ``pi_prox``, each token weighted by its truncated IS weight; mean over tokens."""
        return ppo_clip_loss(logp, prox_logp, advantages, self.args.clip_coef, mask=mask, weights=weights)

    # ------------------------------------------------------------------ one update
    def prepare(self, groups: GroupBatch) -> LMBatch:
        """The trainable completions of ``groups`` as tensors; records their staleness and the drops."""
        current = self.versions.current_version
        self.versions.record_staleness(groups.staleness(current).ravel().tolist())
        data = LMBatch.from_groups(
            groups, self.tokenizer, current, self.args.max_staleness, min_group_samples=1, device=self.args.device
        )
        if data.info["stale_samples"]:
            self.versions.record_dropped(int(data.info["stale_samples"]))
        return data

    def update(self, groups: GroupBatch) -> dict[str, float]:
        """One learner update on complete groups; returns its statistics (no publish)."""
        args = self.args
        data = self.prepare(groups)
        stats = {**data.info, "groups": len(groups.prompt_ids), "samples_received": groups.rewards.size}
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
        entries = len(data) if args.is_level == "sequence" else int(data.mask.sum())
        losses: dict[str, list[float]] = {}
        per_minibatch = -(-len(data) // args.num_minibatches)
        for _ in range(args.update_epochs):
            order = torch.arange(len(data)) if single_pass else torch.randperm(len(data))
            for start in range(0, len(data), per_minibatch):
                rows = order[start : start + per_minibatch].to(data.mask.device)
                current_logp = logp if single_pass else data.logps(self.learner, args.temperature, rows)
                loss, loss_stats = self.policy_loss(
                    current_logp, prox[rows], advantages[rows], weights[rows], data.mask[rows]
                )
                self.optimizer.zero_grad()
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.learner.parameters(), args.max_grad_norm)
                self.optimizer.step()
                for key, value in {"loss": loss.detach(), "grad_norm": grad_norm, **loss_stats}.items():
                    losses.setdefault(key, []).append(float(value))
        stats.update({f"losses/{k}": float(np.mean(v)) for k, v in losses.items()})
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
        """Mean reward of one sampled completion for each of ``num_prompts`` fresh prompts."""
        if num_prompts == 0:
            return float("nan")
        prompts = list(itertools.islice(iter_prompts(self.eval_env, self.args.seed + 1), num_prompts))
        scored = score_completions(self.policy, self.rewarder, prompts, self.args.timeout_s)
        return float(np.mean(scored)) if scored else float("nan")

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
        reached = False
        try:
            eval_before = self.evaluate(args.eval_prompts)
            start = time.monotonic()
            if args.mode == "async":  # generation runs ahead while the learner trains
                self.collector.start(args.total_prompts, ahead=args.prefetch_updates * args.prompts_per_update)
            prompts_done = 0
            while prompts_done < args.total_prompts:
                num = min(args.prompts_per_update, args.total_prompts - prompts_done)
                if args.mode == "sync":
                    self.collector.submit(num)
                waited = time.monotonic()
                groups = self.collector.pop(num, args.timeout_s)
                learned = time.monotonic()
                prompts_done += num
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
                    reached = True
                    break
            wall = time.monotonic() - start
            self.collector.stop()
            eval_after = self.evaluate(args.eval_prompts)
            if args.output_dir:
                self.learner.save_pretrained(args.output_dir)
                self.tokenizer.save_pretrained(args.output_dir)
        finally:
            logger.close()
            self.close()
        return LMTrainResult.from_run(
            history,
            self.collector.stats(),
            wall,
            (eval_before, eval_after),
            self.versions.staleness_stats().mean,
            (self.start_version, self.versions.current_version),
            reached,
        )

    def close(self) -> None:
        """Stops generation; closes the policy, the reward service and the envs (reverse order)."""
        self.resources.close()

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
