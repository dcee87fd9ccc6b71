"""The language-model agents' skeleton and the steps their updates and loops call
(``agents/rloo.py``, ``agents/reinforce_pp.py`` and the other LM agents): each agent file holds
its ``Args``, its update (read top to bottom), its advantages and its loss; what every agent does
the same way lives here.

* :class:`LMAgent`: builds an agent's parts from its options (:func:`asyncvec.lm.build.build_parts`)
  and its optimizer; the loop (:meth:`LMAgent.train`: each agent's ``update``, then a publish),
  checkpoints; publishes the learner's weights, closes everything;
* :func:`trainable_batch`: a popped batch of groups as learner tensors, staleness recorded;
* :class:`LearnerStep`: the start of an update (``pi_prox``, the reference's log-probs, the
  truncated importance weights), its minibatches, gradient steps and statistics;
* :class:`TrainingRun`: the bookkeeping around the loop: batches popped from the collector,
  timings, logging, evaluation before and after, the ``--target-reward`` check, the result.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from asyncvec.buffers import GroupBatch
from asyncvec.extras import check_installed
from asyncvec.lifecycle import ClosesOnExit
from asyncvec.lm.backends import LM_BACKENDS
from asyncvec.lm.build import LMParts, build_parts
from asyncvec.lm.episode_records import EpisodeGroups
from asyncvec.lm.evaluation import confirm_target, mean_reward, target_reached
from asyncvec.lm.learner import EpisodeBatch, LMBatch, MinibatchSteps, quiet_model_libraries
from asyncvec.lm.options import NOT_REPLAYED, LMArgs
from asyncvec.lm.results import LMTrainResult
from asyncvec.losses import truncated_importance_weights
from asyncvec.metrics import RunLogger, StageClock
from asyncvec.runs import (
    CheckpointError,
    RunFolder,
    check_resumable,
    load_checkpoint,
    run_name,
    seed_everything,
    set_rng_state,
)
from asyncvec.schedule import RecordedUpdate, ScheduleError, ScheduleWriter, read_schedule

LossAndStats = tuple[torch.Tensor, dict[str, float]]
"""What an agent's ``policy_loss`` returns: the loss (with grad) and its statistics."""


class LMAgent(ClosesOnExit, RunFolder):
    """The skeleton of a language-model agent: its options (``args``), its parts (the learner and its
    frozen reference, the tokenizer, the policy, the version manager, the collector: see
    :class:`~asyncvec.lm.build.LMParts`), an Adam optimizer over the learner (``--learning-rate``),
    the loop, publishing and closing. An agent (a subclass) adds what differs: its ``update``, its
    ``compute_advantages`` and ``policy_loss``, and sets ``name`` (the run's name in its
    TensorBoard folder), ``label`` (its name in messages and the summary) and, when its
    advantages need it, ``min_group_samples``.

    ``policy``: a text policy to sample from instead of one built from ``--backend`` (it stays
    open after the run); the learner's starting weights are published to it first.
    """

    name = "lm"
    label = "LM"
    min_group_samples = 1
    """groups left with fewer trainable samples are not trained on (a leave-one-out or a group
    standard deviation needs 2)"""

    def __init__(self, args: LMArgs, policy: Any | None = None) -> None:
        self.args = args
        check_installed(
            "transformers", extra="hf", feature=f"agents/{self.name}.py (its learner is a transformers model)"
        )
        seed_everything(args.seed)
        if LM_BACKENDS[args.backend].sets_torch_threads:
            torch.set_num_threads(args.torch_threads)
        quiet_model_libraries()
        self.run_name = run_name(args.env, self.name, args.mode, args.seed)
        self.checkpoint_path = Path(args.checkpoint_dir) / f"{self.name}.pt" if args.checkpoint_dir else None
        self.prompts_done = self.updates = 0
        state = self._load_checkpoint() if args.resume else None  # before building: a wrong one fails fast
        # --replay: the recorded updates (checked before building, so a wrong folder fails fast)
        self._replay = read_schedule(args.replay, self.name, args.flat(), NOT_REPLAYED) if args.replay else None
        if state is not None:
            self.run_name = state.get("run_name", self.run_name)
        # A resumed run: no warm start (the checkpoint's weights replace it), its prompt stream goes on.
        build_args = dataclasses.replace(args, sft_steps=0) if state is not None else args
        start = int(state["prompts_done"]) if state is not None else 0
        self.parts = build_parts(build_args, self.run_name, policy, start_prompts=start)
        self.learner, self.tokenizer, self.reference = self.parts.learner, self.parts.tokenizer, self.parts.reference
        self.policy, self.versions, self.collector = self.parts.policy, self.parts.versions, self.parts.collector
        self.optimizer = torch.optim.Adam(self.learner.parameters(), lr=args.learning_rate)
        # the KL reference is then the warm-started model, which a resumed run does not rebuild: checkpoints keep it
        self._reference_is_warm_started = self.reference is not None and bool(args.sft_steps)
        if state is not None:
            try:
                self._restore(state)
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ where the run writes
    length_flag = "--total-prompts"  # the option that sets the run's length (the command line names it)

    @property
    def output_path(self) -> Path | None:
        """Where the trained model is saved (``--output-dir``; None: not saved)."""
        return Path(self.args.output_dir) if self.args.output_dir else None

    @property
    def position(self) -> str:
        """Where the run is, in words (the command line's Ctrl-C message)."""
        return f"prompt {self.prompts_done} of {self.args.total_prompts} ({self.updates} updates)"

    @property
    def work_left(self) -> int:
        """Prompts still to train on (0: a resumed run that had already finished)."""
        return max(0, self.args.total_prompts - self.prompts_done)

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        """Writes the checkpoint (``--checkpoint-dir``): learner weights, optimizer, version, updates and prompts
        done, the run's name (its TensorBoard folder) and the RNG states; atomically, after every update."""
        if self.checkpoint_path is None:
            return
        self.write_checkpoint(
            learner=self.learner.state_dict(),
            optimizer=self.optimizer.state_dict(),
            version=self.versions.current_version,
            updates=self.updates,
            prompts_done=self.prompts_done,
            run_name=self.run_name,
            args=asdict(self.args.flat()),  # flat names, as checkpoints always had
            reference=self.reference.state_dict() if self._reference_is_warm_started else None,
        )

    def _load_checkpoint(self) -> dict[str, Any]:
        if self.checkpoint_path is None:
            raise ValueError("--resume needs --checkpoint-dir DIR, the folder of the checkpoint to continue from")
        state = load_checkpoint(self.checkpoint_path)
        check_resumable(state, self.checkpoint_path, env=self.args.env, env_kwargs=self.args.env_kwargs)
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        """The checkpoint's learner, optimizer and counters; its version published to the policy."""
        try:
            self.learner.load_state_dict(state["learner"])
        except RuntimeError as exc:
            raise CheckpointError(
                f"--resume: {self.checkpoint_path} holds another model than --model {self.args.model}: pass the "
                f"--model of the run that wrote it, or another --checkpoint-dir ({str(exc).splitlines()[0]})"
            ) from None
        self.optimizer.load_state_dict(state["optimizer"])
        if self.reference is not None:
            self._restore_reference(state)
        self.updates, self.prompts_done = int(state["updates"]), int(state["prompts_done"])
        # one publish (one load on a server) whatever the version: the policy samples with the restored weights
        self.versions.publish(self.learner_weights(), version=max(state["version"], self.versions.current_version + 1))

    def _restore_reference(self, state: dict[str, Any]) -> None:
        """The KL reference of the run that wrote ``state``: its warm-started model when it had one
        (saved in the checkpoint), else the ``--model`` folder's, which :meth:`__init__` loaded."""
        if state.get("reference") is not None:
            self.reference.load_state_dict(state["reference"])
            self._reference_is_warm_started = True
        elif state["args"].get("sft_steps"):
            raise CheckpointError(
                f"--resume: {self.checkpoint_path} was written without its KL reference (its run warm-started "
                f"for {state['args']['sft_steps']} --sft-steps): pass --kl-coef 0, or start a new run"
            )

    # ------------------------------------------------------------------ what each agent defines
    @abc.abstractmethod
    def compute_advantages(
        self, data: LMBatch | EpisodeBatch, logp: torch.Tensor, ref_logp: torch.Tensor | None
    ) -> torch.Tensor:
        """The advantages ``[N, L]`` of ``data``'s tokens (0 off the mask); ``logp``: ``pi_prox``'s
        log-probs, ``ref_logp``: the reference's (None without ``--kl-coef``)."""

    @abc.abstractmethod
    def policy_loss(
        self,
        logp: torch.Tensor,
        prox_logp: torch.Tensor,
        advantages: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        ref_logp: torch.Tensor | None = None,
    ) -> LossAndStats:
        """The loss of a minibatch's rows: ``logp`` (with grad) and ``prox_logp`` (``pi_prox``) per
        token, the advantages, the truncated IS weights, the mask, the reference's log-probs
        (None without ``--kl-coef``); returns ``(loss, stats)``."""

    @classmethod
    def run_label(cls, args: LMArgs) -> str:
        """The agent's name in its command line's messages and summary (``label``; a variant may add to it)."""
        return cls.label

    # ------------------------------------------------------------------ one update
    @abc.abstractmethod
    def update(self, groups: GroupBatch | EpisodeGroups) -> dict[str, float]:
        """One learner update on complete groups, read top to bottom in each agent's file: its trainable
        batch (:meth:`trainable_batch`), ``pi_prox`` and the importance weights (:class:`LearnerStep`), its
        advantages, its loss over ``--update-epochs`` x ``--num-minibatches`` steps; returns the update's
        statistics (:meth:`LearnerStep.stats`). :meth:`train` publishes after it."""

    def trainable_batch(self, groups: GroupBatch | EpisodeGroups) -> LMBatch | EpisodeBatch:
        """What an update trains on (:func:`trainable_batch`): groups too stale, flagged rewards, deadline misses
        and groups left with fewer than ``min_group_samples`` samples are out."""
        return trainable_batch(groups, self.parts, self.args, self.min_group_samples)

    # ------------------------------------------------------------------ the loop
    def train(self) -> LMTrainResult:
        """Trains on ``total_prompts`` prompts (or until ``target_reward``) and closes everything."""
        # TrainingRun: evaluation before and after, logging, generation started (--mode async) and stopped.
        recorder = (
            ScheduleWriter(self.run_dir / "schedule", self.name, self.args.flat())
            if self.args.record_schedule
            else None
        )
        training = TrainingRun(self.parts, self.args, self.run_name, self.prompts_done, recorder, self._replay)
        with training as run:
            for groups in run.batches():  # --prompts-per-update complete groups at a time
                run.record(self.update(groups), publish=self.publish)  # publishes, checks --target-reward
                self.prompts_done, self.updates = run.prompts_done, self.updates + 1
                self.save()  # after every update: Ctrl-C or a crash loses at most the update in progress
        result = run.result()
        result.log_path, result.output_path = (
            None if self.log_path is None else str(self.log_path),
            None if self.output_path is None else str(self.output_path),
        )
        result.checkpoint_path = None if self.checkpoint_path is None else str(self.checkpoint_path)
        return result

    # ------------------------------------------------------------------ weights and closing
    def learner_weights(self) -> dict[str, torch.Tensor]:
        """A copy of the learner's weights (what :meth:`publish` sends)."""
        return {k: v.detach().clone() for k, v in self.learner.state_dict().items()}

    def publish(self) -> int:
        """Sends the learner's weights to the policy (``policy.load_weights``); returns the new version."""
        return self.versions.publish(self.learner_weights())

    def close(self) -> None:
        """Stops generation; closes the policy, the reward service and the envs (reverse order)."""
        self.parts.resources.close()


def batch_sizes(groups: GroupBatch | EpisodeGroups) -> tuple[int, int]:
    """``(groups, samples)`` of a popped batch: completions, or turns of multi-turn episodes."""
    if isinstance(groups, EpisodeGroups):
        return len(groups), groups.num_turns
    return len(groups.prompt_ids), int(groups.rewards.size)


def trainable_batch(
    groups: GroupBatch | EpisodeGroups, parts: LMParts, args: LMArgs, min_group_samples: int
) -> LMBatch | EpisodeBatch:
    """The trainable completions (or episode turns) of ``groups`` as learner tensors: samples more
    than ``--max-staleness`` versions old, flagged rewards and deadline misses left out, and
    groups with fewer than ``min_group_samples`` trainable samples. Records the batch's
    staleness and the drops in ``parts.versions``; ``info`` also says how many groups and
    samples arrived (``groups``, ``samples_received``).

    Per-token versions (in-flight weight updates): a sample's age is its oldest token's, so
    ``--max-staleness`` drops a sample (a completion's group, or a turn) whose oldest token is too
    old, whole. ``parts.versions`` records one staleness per sample (its oldest token's: the unit
    of the max-lag rule and of the drop count); the per-token staleness of the tokens trained on
    is in ``info`` (``token_staleness_mean``, ``token_staleness_max``, ``spanning_samples``)."""
    current = parts.versions.current_version
    parts.versions.record_staleness(groups.staleness(current).ravel().tolist())
    data: LMBatch | EpisodeBatch
    if isinstance(groups, EpisodeGroups):  # multi-turn: a row per episode, stale turns masked one by one
        data = EpisodeBatch.from_episodes(
            groups, current, args.staleness.learner_bound(), args.gamma, min_group_samples, args.device
        )
    else:
        bound = args.staleness.learner_bound()
        data = LMBatch.from_groups(groups, parts.tokenizer, current, bound, min_group_samples, args.device)
    parts.versions.record_dropped(int(data.info["stale_samples"]))
    data.info["groups"], data.info["samples_received"] = batch_sizes(groups)
    return data


class LearnerStep:
    """One update's log-probs and steps: ``prox_logp`` (``pi_prox``, the learner at the start of
    the update, detached), ``ref_logp`` (the frozen reference's, None without ``--kl-coef``), and
    ``weights``, the truncated importance weights ``min(pi_prox / mu, C)`` against the behavior
    log-probs ``mu`` the engine reported (``--is-cap``, ``--is-level``; ``[N, L]`` either way).
    :meth:`minibatches`, :meth:`logps` and :meth:`gradient_step` are the minibatch steps an agent's
    ``update`` takes on its loss; :meth:`stats` the update's statistics.

    Per token: ``mu_t = mu_{v_t}(y_t | y_<t)``, token ``t``'s log-prob under the version ``v_t``
    that sampled it (``data.token_versions``), so ``w_t = min(pi_prox(y_t) / mu_{v_t}(y_t), C)``
    and ``pi_prox`` is the same for every token. A sequence whose tokens span versions was
    sampled from ``prod_t mu_{v_t}(y_t | y_<t)``; ``--is-level sequence`` uses that product."""

    def __init__(self, data: LMBatch | EpisodeBatch, parts: LMParts, args: LMArgs) -> None:
        self.data, self.learner, self.args = data, parts.learner, args
        self.steps = MinibatchSteps(
            parts.learner, len(data), args.update_epochs, args.num_minibatches, args.max_grad_norm, in_order=True
        )
        # One pass over one minibatch reuses the graph of pi_prox's forward pass.
        with torch.set_grad_enabled(self.steps.single_pass):
            self._logp = data.logps(parts.learner, args.temperature)
        self.prox_logp = self._logp.detach()
        self.ref_logp = None
        if parts.reference is not None:
            with torch.no_grad():
                self.ref_logp = data.logps(parts.reference, args.temperature)
        self.weights, self.is_stats = truncated_importance_weights(
            self.prox_logp, data.behavior_logp, args.is_cap, level=args.is_level, mask=data.mask
        )
        if args.is_level == "sequence":
            self.weights = self.weights.unsqueeze(-1) * data.mask

    def minibatches(self) -> Iterator[torch.Tensor]:
        """The rows of each step: ``--update-epochs`` passes over the batch, each in
        ``--num-minibatches`` shuffled minibatches (one pass over one minibatch: in order)."""
        return iter(self.steps.minibatches(self.data.mask.device))

    def logps(self, rows: torch.Tensor) -> torch.Tensor:
        """``pi_theta``'s log-probs ``[rows, L]`` of those rows, with gradients (one pass over one
        minibatch reuses ``pi_prox``'s forward pass)."""
        if self.steps.single_pass:
            return self._logp
        return self.data.logps(self.learner, self.args.temperature, rows)

    def gradient_step(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor, stats: dict[str, float]) -> None:
        """``zero_grad``, ``backward``, the gradient clipped to ``--max-grad-norm``, ``optimizer.step()``."""
        self.steps.gradient_step(optimizer, loss, stats)

    def stats(self, advantages: torch.Tensor) -> dict[str, float]:
        """The update's statistics: its batch's counts (``data.info``), the losses' means over the steps,
        the importance weights, the advantages and the KL to the reference."""
        data = self.data
        entries = len(data) if self.args.is_level == "sequence" else int(data.mask.sum())
        stats = {**data.info, **{f"losses/{k}": v for k, v in self.steps.means().items()}}
        stats.update({f"is/{k}": float(v) for k, v in self.is_stats.items()})
        stats.update({"is/entries": entries, "is/clipped": round(float(self.is_stats["clipped_fraction"]) * entries)})
        stats["advantage_abs_mean"] = float(advantages.abs()[data.mask].mean())
        if self.ref_logp is not None:
            stats["kl_ref"] = float(((self.prox_logp - self.ref_logp) * data.mask).sum(-1).mean())
        return stats


_ENGINE_COUNTS = (
    "engine_restarts",
    "resubmitted_requests",
    "failed_requests",
    "inflight_swaps",
    "resumed_requests",  # a dead engine's completions continued from their prefix (docs/inference.md)
    "resumed_tokens",
    "regenerated_tokens",
)


class TrainingRun:
    """The bookkeeping around an LM agent's loop, as a context manager.

    Entering it opens the run's logger (TensorBoard under ``--log-dir`` with ``--track``, a
    progress bar), evaluates the policy (``--eval-prompts``) and, with ``--mode async``, starts
    generation ahead of the learner. :meth:`batches` yields ``--prompts-per-update`` complete
    groups until ``--total-prompts`` (or the target is confirmed); :meth:`record` publishes,
    logs and checks ``--target-reward``. Leaving it without an error stops generation,
    evaluates again and saves the model (``--output-dir``); it always closes the logger and the
    agent's parts. :meth:`result` is the run's :class:`~asyncvec.lm.results.LMTrainResult`.
    """

    def __init__(
        self,
        parts: LMParts,
        args: LMArgs,
        run_name: str,
        start_prompts: int = 0,
        recorder: ScheduleWriter | None = None,
        replay: Iterator[RecordedUpdate] | None = None,
    ) -> None:
        self.parts, self.args, self.run_name = parts, args, run_name
        self.recorder, self.replay = recorder, replay
        self.history: list[dict] = []
        self.confirmations: list[float] = []
        self.reached = False
        self.prompts_done = start_prompts  # after --resume: the checkpoint's (the step axis goes on from there)
        self.stages = StageClock()
        self._pending: Any = None  # a batch that failed to confirm the target, trained on next
        self._stop = False
        self.evals = (math.nan, math.nan)
        self.admission = args.staleness.admission(args.mode, args.prompts_per_update)

    def __enter__(self) -> TrainingRun:
        args = self.args
        self.logger = RunLogger(
            Path(args.log_dir) / self.run_name,
            track=args.track,
            total_steps=args.total_prompts,
            progress=args.progress,
            hparams=asdict(args.flat()),
            unit="prompt",
            initial_step=self.prompts_done,
        )
        try:
            self.evals = (self._evaluate(), math.nan)
            self.start = time.monotonic()
            if args.mode == "async" and self.replay is None:  # generation runs ahead while the learner trains
                self.parts.collector.start(
                    args.total_prompts - self.prompts_done,
                    ahead=args.staleness.prompts_ahead(args.prompts_per_update),
                    admission=self.admission,
                )
        except BaseException:
            self.logger.close()
            self.parts.resources.close()
            raise
        return self

    def _evaluate(self) -> float:
        return mean_reward(self.parts, self.args.eval_prompts, self.args.seed + 1, self.args.timeout_s)

    def batches(self) -> Iterator[GroupBatch | EpisodeGroups]:
        """Complete groups, ``--prompts-per-update`` at a time (sync mode: generated on request),
        until ``--total-prompts`` are done or :meth:`record` confirmed the target; with ``--replay``,
        the recorded ones (:meth:`_replayed`); with ``--record-schedule``, each written down first."""
        if self.replay is not None:
            yield from self._replayed(self.replay)
            return
        args, collector = self.args, self.parts.collector
        while not self._stop and (self.prompts_done < args.total_prompts or self._pending is not None):
            with self.stages("wait"):
                if self._pending is None:
                    num = min(args.prompts_per_update, args.total_prompts - self.prompts_done)
                    if args.mode == "sync":
                        collector.submit(num)
                    groups = collector.pop(num, args.timeout_s)
                    self.prompts_done += num
                else:
                    groups, self._pending = self._pending, None
            if self.recorder is not None:
                version = self.parts.versions.current_version - self.parts.start_version
                self.recorder.write(groups, version, self.prompts_done)
            self._learn_start = time.perf_counter()
            yield groups

    def _replayed(self, updates: Iterator[RecordedUpdate]) -> Iterator[GroupBatch | EpisodeGroups]:
        """The recorded updates' groups, each met with the version and RNG states it met when recorded."""
        versions = self.parts.versions
        for index, update in enumerate(updates):
            if versions.current_version - self.parts.start_version != update.version:
                raise ScheduleError(
                    f"--replay: update {index} met version {update.version} when recorded, "
                    f"{versions.current_version - self.parts.start_version} now: the replay diverged (another "
                    "torch, or a model folder that changed since)"
                )
            set_rng_state(update.rng)
            self.prompts_done = update.position
            self._learn_start = time.perf_counter()
            yield update.batch

    def record(self, stats: dict[str, float], publish: Callable[[], int]) -> None:
        """After an update: ``publish()`` the learner's weights when it trained on something (no
        step, no new version), log its row, and check ``--target-reward`` on a batch sampled by
        the new weights (:func:`~asyncvec.lm.evaluation.confirm_target`)."""
        args, parts = self.args, self.parts
        self.stages.add("learn", time.perf_counter() - self._learn_start)
        with self.stages("publish"):
            if stats["samples_used"]:
                publish()
        if self.admission is not None:
            self.admission.update_done()
        elapsed = time.monotonic() - self.start
        policy_stats = parts.policy.stats()
        row = {
            **stats,
            **{key: value for key, value in self.stages.scalars().items() if not key.endswith("_cpu_s")},
            "charts/reward": stats["reward"],
            "charts/version": parts.versions.current_version,
            "charts/completions_per_s": parts.collector.samples / elapsed,
            "time/wall_s": elapsed,
            "charts/policy_latency_p50_ms": policy_stats["latency_p50_ms"],
            # a supervised server (asyncvec.inference.EngineSupervisor) and in-flight updates count their events
            **{f"engine/{key}": value for key, value in policy_stats.items() if key in _ENGINE_COUNTS},
        }
        self.history.append(row)
        self.logger.log(row, self.prompts_done)
        if self.replay is None and target_reached([r["reward"] for r in self.history], args.target_reward):
            check = confirm_target(parts, args, args.total_prompts - self.prompts_done)
            self.prompts_done += check.popped
            self.confirmations.append(check.reward)
            self.logger.log({"charts/target_confirm_reward": check.reward}, self.prompts_done)
            if check.confirmed or check.batch is None:
                self.reached, self._stop = check.confirmed, True
            else:
                self._pending = check.batch

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        try:
            if exc_type is None:
                self.wall_time_s = time.monotonic() - self.start
                self.parts.collector.stop()
                self.evals = (self.evals[0], self._evaluate())
                if self.args.output_dir:
                    self.parts.learner.save_pretrained(self.args.output_dir)
                    self.parts.tokenizer.save_pretrained(self.args.output_dir)
        finally:
            self.logger.close()
            self.parts.resources.close()

    def result(self) -> LMTrainResult:
        """The run's totals (after it ended)."""
        parts = self.parts
        result = LMTrainResult.from_run(
            self.history,
            parts.collector.stats(),
            self.wall_time_s,
            self.evals,
            parts.versions.staleness_stats().mean,
            (parts.start_version, parts.versions.current_version),
            self.reached,
        )
        result.eval_details, result.target_confirmations = list(parts.eval_log), self.confirmations
        return result
