"""What the language-model agents (RLOO, REINFORCE++) share: prompts, generation, learner, loop.

Data flow of one run::

    env.reset() prompts ──► GroupGenerator ── k x policy.submit(prompt) ──► completions (+ token log-probs, version)
                                 │                                              │
                                 │          RewardService.submit(prompt, text) ◄┘  (scores while generation goes on)
                                 ▼
                          CompletionGroups (k per prompt) ──► LMTrainer.update ──► VersionManager.publish ──► policy

The agent files define only their objective (``compute_advantages`` and ``policy_loss``);
:class:`LMTrainer` does the rest. Sample handling, the same for both:

* **stale groups** (a completion more than ``max_staleness`` versions older than the learner)
  are dropped whole and counted;
* **flagged rewards** (RewardService timeout or scorer error: the reward is unknown) stay
  out of the loss and out of every baseline; a group keeps its other samples;
* **fallback samples** (the completion has no leading integer, so the policy's parser
  rejected it) are trained on like any other: the tokens were sampled from the policy and
  the scorer rates their text (``exact_answer`` gives 0). Dropping them would let the policy
  produce unparsable text at no cost.
"""

from __future__ import annotations

import abc
import itertools
import json
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch

from agents.common import LaggedWeights, check_env_id, seed_everything
from asyncvec import VersionManager, rewards
from asyncvec.buffers import CompletionGroups, GroupBatch
from asyncvec.inference import PolicyOutput, build_tiny_lm
from asyncvec.losses import truncated_importance_weights
from asyncvec.metrics import RunLogger

TARGET_WINDOW = 10
"""``target_reward`` is met when the mean training reward of this many updates reaches it."""


@dataclass
class LMArgs:
    """Options shared by the language-model agents (``agents/rloo.py``, ``agents/reinforce_pp.py``)."""

    env: str = "asyncvec/SingleDigitSums-v0"
    """one-step text env id: its reset() observations are the prompts"""
    model: str | None = None
    """save_pretrained folder of the model (default: a fresh tiny GPT-2 from build_tiny_lm)"""
    sft_steps: int = 0
    """supervised warm start on the env's prompts and solved answers before RL (arithmetic envs)"""
    reward: str = "exact_answer"
    """reward plugin name (asyncvec.rewards.register) scoring (prompt, completion)"""
    reward_timeout_s: float = 10.0
    """a reward not ready this long after its request is flagged and kept out of training"""
    backend: Literal["hf", "openai", "vllm"] = "hf"
    """hf: HFTextPolicy in this process; openai: a server at --base-url; vllm: an in-process vLLM engine (GPU)"""
    vllm_engine: str = "{}"
    """--backend vllm: vllm.LLM options as JSON, e.g. '{"dtype": "float32", "gpu_memory_utilization": 0.3}'"""
    base_url: str | None = None
    """server root for --backend openai, e.g. http://127.0.0.1:8000"""
    served_model: str | None = None
    """model name the server expects (default: the --model folder's name)"""
    weights_dir: str | None = None
    """--backend openai: the server's --weights-dir; version N is saved to <weights-dir>/<run>-vN and loaded from there"""
    update_token: str | None = None
    """bearer token of the server's /update_weights (default: $ASYNCVEC_SERVE_TOKEN)"""
    mode: Literal["sync", "async"] = "async"
    """async: generation and scoring keep running in a thread while the learner trains; sync: alternate"""
    total_prompts: int = 6400
    """prompts to train on (each with group_size completions)"""
    prompts_per_update: int = 16
    """prompts (groups) per learner update"""
    group_size: int = 8
    """k: completions sampled per prompt"""
    prefetch_updates: int = 1
    """async mode: updates' worth of prompts generated ahead of the learner"""
    max_staleness: int = 2
    """groups with a completion more than this many versions older than the learner are dropped"""
    policy_lag: int = 0
    """the policy receives each new version this many updates late (a slow weight broadcast)"""
    is_cap: float = 2.0
    """truncation C of the importance weights min(pi/mu, C)"""
    is_level: Literal["token", "sequence"] = "token"
    """importance weights per token, or one per completion (product of the token ratios)"""
    kl_coef: float = 0.0
    """beta: weight of the KL penalty against the frozen initial model (0: no reference model)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """per-token KL estimator (asyncvec.losses.approx_kl)"""
    max_new_tokens: int = 4
    """completion length limit in tokens (eos included)"""
    temperature: float = 1.0
    """sampling temperature (the learner's log-probs use the same one)"""
    learning_rate: float = 1e-3
    """Adam learning rate"""
    update_epochs: int = 1
    """passes over each batch"""
    num_minibatches: int = 1
    """minibatches per pass"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    policy_batch_size: int = 128
    """largest batch the policy's DynamicBatcher sends to the model"""
    eval_prompts: int = 200
    """completions sampled to measure the mean reward before and after training (0: skip)"""
    target_reward: float | None = None
    """stop once the mean training reward of the last 10 updates reaches this"""
    timeout_s: float = 120.0
    """longest wait for a batch of groups before the run fails (it never hangs)"""
    seed: int = 1
    """seed of torch, numpy and the prompt stream"""
    device: str = "cpu"
    """torch device of the learner, the reference model and the hf backend's model"""
    torch_threads: int = 1
    """torch CPU threads (generation and learning already run on two threads)"""
    output_dir: str | None = None
    """save the trained model (save_pretrained) here"""
    track: bool = False
    """write TensorBoard logs to runs/"""
    log_dir: str = "runs"
    """TensorBoard log root"""
    progress: bool = True
    """show a progress bar"""

    def __post_init__(self) -> None:
        for name in (
            "total_prompts",
            "prompts_per_update",
            "update_epochs",
            "num_minibatches",
            "max_new_tokens",
            "policy_batch_size",
            "torch_threads",
        ):
            _check_int(name, getattr(self, name), 1)
        _check_int("prefetch_updates", self.prefetch_updates, 1)
        for name in ("sft_steps", "max_staleness", "policy_lag", "eval_prompts"):
            _check_int(name, getattr(self, name), 0)
        _check_int("group_size", self.group_size, 2)
        for name in ("is_cap", "reward_timeout_s", "timeout_s", "learning_rate", "max_grad_norm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"--{_flag(name)} must be a finite number > 0, got {value!r}")
        for name in ("kl_coef", "temperature"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"--{_flag(name)} must be a finite number >= 0, got {value!r}")
        if self.temperature == 0:
            raise ValueError("--temperature must be > 0: policy-gradient learning needs sampled completions")
        if self.backend == "openai":
            if not self.base_url:
                raise ValueError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000)")
            if not self.weights_dir:
                raise ValueError("--backend openai needs --weights-dir: the folder the server loads new weights from")
        elif self.base_url is not None:
            raise ValueError(f"--base-url is only used with --backend openai, got --backend {self.backend}")
        try:
            engine = json.loads(self.vllm_engine)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--vllm-engine must be a JSON object, got {self.vllm_engine!r}: {exc}") from None
        if not isinstance(engine, dict):
            raise ValueError(f"--vllm-engine must be a JSON object of vllm.LLM options, got {self.vllm_engine!r}")
        try:
            torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"--device: {exc}") from None


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"--{_flag(name)} must be an int >= {minimum}, got {value!r}")


# ------------------------------------------------------------------------------------ prompts
def make_prompt_env(env_id: str) -> gym.Env:
    """Makes ``env_id`` after checking it is a one-step text task (a prompt in, a completion out).

    Raises:
        ValueError: unknown id (close matches named), observation or action space not
            ``gymnasium.spaces.Text``, or an episode that does not end after one step.

    Example:
        >>> make_prompt_env("asyncvec/SingleDigitSums-v0").reset(seed=0)[0]
        '8+6='
    """
    check_env_id(env_id)
    env = gym.make(env_id)
    try:
        for role, space in (("observation", env.observation_space), ("action", env.action_space)):
            if not isinstance(space, gym.spaces.Text):
                raise ValueError(
                    f"{env_id}: the LM agents need a gymnasium.spaces.Text {role} space (prompts in, "
                    f"completions out), got {space}"
                )
        env.reset(seed=0)
        _, _, terminated, truncated, _ = env.step("0")
        if not (terminated or truncated):
            raise ValueError(
                f"{env_id}: the LM agents train on one-step tasks (prompt -> completion -> reward), "
                "but its episode did not end after one step"
            )
    except BaseException:
        env.close()
        raise
    return env


def iter_prompts(env: gym.Env, seed: int) -> Iterator[str]:
    """Endless prompts: the env's reset observations, the first one seeded.

    Example:
        >>> prompts = iter_prompts(make_prompt_env("asyncvec/SingleDigitSums-v0"), seed=0)
        >>> next(prompts), next(prompts)
        ('8+6=', '5+2=')
    """
    obs, _ = env.reset(seed=seed)
    while True:
        yield obs
        obs, _ = env.reset()


def completion_with_answer(text: str) -> str | None:
    """The policy's action parser: the completion if it starts with an integer, else None (a fallback).

    Example:
        >>> completion_with_answer(" 7"), completion_with_answer("x")
        (' 7', None)
    """
    return text if rewards.parse_leading_int(text) is not None else None


# ----------------------------------------------------------------------------- learner pieces
def load_causal_lm(folder: str | os.PathLike, device: str = "cpu") -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a save_pretrained folder, the model in eval mode (dropout off).

    Policy-gradient log-probs must match the sampler's, which has no dropout.

    Example:
        >>> import tempfile
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
    env_id: str = "asyncvec/SingleDigitSums-v0",
    steps: int = 150,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    seed: int = 0,
    torch_threads: int = 1,
) -> Path:
    """Supervised warm start: teaches ``prompt -> answer<eos>`` on the env's arithmetic prompts.

    The answers come from :func:`asyncvec.rewards.solve_arithmetic`. The model in
    ``model_dir`` is left untouched; the trained one is saved to ``out_dir``. Training uses
    ``torch_threads`` CPU threads (a tiny model is no faster on two, and a second thread
    spins against other work on a small machine); the previous setting is restored.

    Raises:
        ValueError: the env's prompts are not arithmetic problems ending in ``"a+b="``.

    Example:
        >>> import tempfile
        >>> base = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32)
        >>> sft_warm_start(base, tempfile.mkdtemp(), steps=2).joinpath("config.json").exists()
        True
    """
    env = make_prompt_env(env_id)
    prompts = iter_prompts(env, seed)
    model, tokenizer = load_causal_lm(model_dir)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for _ in range(steps):
                sequences, starts = [], []
                for prompt in itertools.islice(prompts, batch_size):
                    answer = rewards.solve_arithmetic(prompt)
                    if answer is None:
                        raise ValueError(
                            f"sft_warm_start: {env_id} prompt {prompt!r} is not an arithmetic problem 'a+b='"
                        )
                    prompt_ids = tokenizer(prompt).input_ids
                    sequences.append(prompt_ids + tokenizer(str(answer)).input_ids + [tokenizer.eos_token_id])
                    starts.append(len(prompt_ids))
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
        env.close()
        torch.set_num_threads(threads)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# --------------------------------------------------------------------------------- generation
@dataclass(frozen=True)
class Sample:
    """One scored completion, as stored in :class:`CompletionGroups`."""

    prompt: str
    output: PolicyOutput
    reward: float
    flagged: bool


class GroupGenerator:
    """Prompts -> k completions each (policy) -> rewards (RewardService) -> :class:`CompletionGroups`.

    Completions are submitted to the policy as futures; each finished completion goes to the
    reward service at once, so scoring overlaps generation, and each scored one is added to
    its prompt's group. ``submit(n)`` does this for ``n`` prompts (sync mode); ``start``
    runs a thread that keeps ``ahead`` prompts in flight or waiting beyond what the learner
    has taken (async mode). Errors of the policy, the reward service or the callbacks are
    re-raised by :meth:`check` and :meth:`pop`.

    Example:
        >>> import tempfile
        >>> from asyncvec.inference import HFTextPolicy
        >>> folder = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32)
        >>> env = make_prompt_env("asyncvec/SingleDigitSums-v0")
        >>> with HFTextPolicy(folder, None, completion_with_answer, action_space=env.action_space,
        ...                   max_new_tokens=3) as policy, rewards.RewardService("exact_answer") as service:
        ...     generator = GroupGenerator(policy, service, iter_prompts(env, 0), group_size=2)
        ...     generator.submit(3)
        ...     batch = generator.pop(3, timeout=60)
        >>> batch.rewards.shape
        (3, 2)
    """

    def __init__(
        self, policy: Any, reward_service: rewards.RewardService, prompts: Iterator[str], group_size: int
    ) -> None:
        self.policy = policy
        self.reward_service = reward_service
        self.prompts = prompts
        self.groups = CompletionGroups(group_size)
        self.group_size = group_size
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self._slots: threading.Semaphore | None = None
        self._thread: threading.Thread | None = None
        self.submitted_prompts = 0
        self.samples = 0
        self.flagged = 0
        self.fallbacks = 0

    def submit(self, num_prompts: int) -> None:
        """Queues ``group_size`` completions for each of the next ``num_prompts`` prompts."""
        for prompt in itertools.islice(self.prompts, num_prompts):
            prompt_id = next(self._ids)
            for _ in range(self.group_size):
                self.policy.submit(prompt).add_done_callback(partial(self._on_completion, prompt_id, prompt))
            with self._lock:
                self.submitted_prompts += 1

    def start(self, total_prompts: int, ahead: int) -> GroupGenerator:
        """Async mode: a thread submits prompts while fewer than ``ahead`` are in flight or unpopped."""
        self._slots = threading.Semaphore(ahead)
        self._thread = threading.Thread(
            target=self._run, args=(total_prompts,), name="asyncvec-lm-generator", daemon=True
        )
        self._thread.start()
        return self

    def _run(self, total_prompts: int) -> None:
        try:
            while not self._stopping.is_set() and self.submitted_prompts < total_prompts:
                if self._slots.acquire(timeout=0.1):
                    self.submit(1)
        except Exception as exc:  # re-raised in the learner by check()
            self._fail(exc)

    def pop(self, num_groups: int, timeout: float) -> GroupBatch:
        """Waits (at most ``timeout`` seconds) for ``num_groups`` complete groups; frees their slots."""
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            try:
                batch = self.groups.pop(num_groups, timeout=min(0.25, max(deadline - time.monotonic(), 0.0)))
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"no {num_groups} complete groups within {timeout} s ({self.groups.num_pending} prompts "
                        f"pending, policy stats {self.policy.stats()}, reward stats {self.reward_service.stats()})"
                    ) from None
        if self._slots is not None:
            for _ in range(num_groups):
                self._slots.release()
        return batch

    def check(self) -> None:
        """Raises the first error of the generation or scoring path, if any."""
        if self._error is not None:
            raise RuntimeError(f"generation failed: {type(self._error).__name__}: {self._error}") from self._error

    def stop(self, timeout: float = 10.0) -> None:
        """Stops submitting; completions still in flight are ignored from now on."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the generator thread did not stop within {timeout} s")

    def _fail(self, exc: BaseException) -> None:
        if not self._stopping.is_set():
            with self._lock:
                self._error = self._error or exc

    # Callbacks run on the policy's and the reward service's threads: quick, never raising.
    def _on_completion(self, prompt_id: int, prompt: str, future: Future) -> None:
        try:
            output: PolicyOutput = future.result()
            if not output.token_ids:
                raise ValueError(
                    f"{type(self.policy).__name__} returned no token ids for {prompt!r}; the learner needs them "
                    "(OpenAIPolicy: return_token_ids=True against vLLM or asyncvec serve)"
                )
            scored = self.reward_service.submit(prompt, output.text or "")
            scored.add_done_callback(partial(self._on_reward, prompt_id, prompt, output))
        except Exception as exc:
            self._fail(exc)

    def _on_reward(self, prompt_id: int, prompt: str, output: PolicyOutput, future: Future) -> None:
        try:
            result = future.result()
            sample = Sample(prompt, output, result.reward, result.flagged)
            with self._lock:
                self.samples += 1
                self.flagged += result.flagged
                self.fallbacks += output.fallback
            self.groups.add(prompt_id, sample, result.reward, output.token_logps, output.policy_version)
        except Exception as exc:
            self._fail(exc)


# ------------------------------------------------------------------------------------ policies
class ServerCheckpoints:
    """Publishes weights to an asyncvec server: saves them under its ``--weights-dir``, then
    asks it to load them (``OpenAIPolicy.load_weights``).

    Registered with the agent's VersionManager for ``--backend openai``; version N goes to
    ``<weights_dir>/<run_name>-vN/model.safetensors`` (``test_training_through_an_asyncvec_server``
    runs it against a real server).
    """

    def __init__(self, policy: Any, weights_dir: str | os.PathLike, run_name: str) -> None:
        self.policy = policy
        self.weights_dir = Path(weights_dir)
        self.run_name = run_name

    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        from safetensors.torch import save_file

        name = f"{self.run_name}-v{version}"
        (self.weights_dir / name).mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(self.weights_dir / name / "model.safetensors"))
        self.policy.load_weights(name, version)


def make_text_policy(args: LMArgs, model_dir: Path, action_space: gym.Space) -> Any:
    """The policy sampling completions: HFTextPolicy, OpenAIPolicy or VLLMPolicy (``--backend``).

    Example:
        >>> import tempfile
        >>> folder = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32)
        >>> env = make_prompt_env("asyncvec/SingleDigitSums-v0")
        >>> with make_text_policy(LMArgs(max_new_tokens=2), folder, env.action_space) as policy:
        ...     len(policy.submit("3+4=").result(timeout=30).token_ids) <= 2
        True
    """
    options = {
        "action_space": action_space,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "max_batch_size": args.policy_batch_size,
        "max_wait_ms": 5.0,
    }
    if args.backend == "hf":
        from asyncvec.inference import HFTextPolicy

        return HFTextPolicy(*load_causal_lm(model_dir, args.device), completion_with_answer, **options)
    if args.backend == "vllm":
        from asyncvec.inference import VLLMPolicy

        engine = {"seed": args.seed, **json.loads(args.vllm_engine)}
        return VLLMPolicy(model_dir, completion_with_answer, engine_kwargs=engine, **options)
    from asyncvec.inference import OpenAIPolicy

    token = args.update_token if args.update_token is not None else os.environ.get("ASYNCVEC_SERVE_TOKEN")
    policy = OpenAIPolicy(
        args.base_url,
        args.served_model or model_dir.name,
        completion_with_answer,
        update_token=token,
        max_attempts=3,
        **options,
    )
    try:
        policy.server_version()
    except Exception as exc:
        policy.close()
        raise ValueError(
            f"--base-url {args.base_url}: cannot read its weights version (GET /version: {type(exc).__name__}: {exc}). "
            "The learner publishes new weights after every update, which over HTTP only `asyncvec serve "
            "--weights-dir` accepts; a `vllm serve` server cannot take new weights through its OpenAI API, so for "
            "vLLM use --backend vllm (an in-process engine)"
        ) from exc
    return policy


# ----------------------------------------------------------------------------------- learning
@dataclass
class LMBatch:
    """The usable completions of a :class:`GroupBatch` as learner tensors (``N`` rows, ``L`` tokens)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    rewards: torch.Tensor  # [N]
    group_ids: torch.Tensor  # [N] index of the prompt's group
    behavior_logp: torch.Tensor  # [N, L] log-probs the engine reported
    mask: torch.Tensor  # [N, L] True on completion tokens


@dataclass
class LMTrainResult:
    """What ``train`` returns: the reward curve, speed and sample accounting of the run.

    Fractions are over all completions received: ``stale_fraction`` dropped for staleness,
    ``flagged_fraction`` with a flagged reward, ``fallback_fraction`` unparsable;
    ``truncated_fraction`` is the share of importance weights (tokens or sequences, per
    ``is_level``) clipped at ``is_cap``.
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
    staleness_mean: float
    final_version: int
    reached_target: bool
    history: list[dict] = field(default_factory=list)


class LMTrainer(abc.ABC):
    """The loop both LM agents share; a subclass defines ``compute_advantages`` and ``policy_loss``.

    It owns a learner model, a frozen reference (when ``kl_coef > 0``), the policy (a separate
    copy of the weights, possibly on a server), the reward service and the version manager.
    Use it as a context manager or call :meth:`close`; :meth:`train` closes everything.
    """

    name = "lm"
    min_group_samples = 1
    """groups with fewer usable samples are skipped (RLOO's leave-one-out needs 2)"""

    def __init__(self, args: LMArgs) -> None:
        self.args = args
        seed_everything(args.seed)
        torch.set_num_threads(args.torch_threads)
        self.run_name = f"{args.env.replace('/', '_')}__{self.name}__{args.mode}__{args.seed}__{int(time.time())}"
        self._closers: list[Callable[[], None]] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        args = self.args
        self.env = make_prompt_env(args.env)
        self._closers.append(self.env.close)
        self.eval_env = gym.make(args.env)
        self._closers.append(self.eval_env.close)
        first_prompt = self.env.reset(seed=args.seed)[0]
        try:
            rewards.score(args.reward, first_prompt, "0")
        except Exception as exc:
            raise ValueError(
                f"--reward {args.reward!r} cannot score {args.env} prompts like {first_prompt!r}: {exc}"
            ) from exc
        self._workdir = Path(tempfile.mkdtemp(prefix="asyncvec-lm-"))
        self._closers.append(partial(shutil.rmtree, self._workdir, ignore_errors=True))
        model_dir = Path(args.model) if args.model else build_tiny_lm(self._workdir / "tiny-lm", seed=args.seed)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"--model {model_dir}: no such folder (a save_pretrained model with its tokenizer)")
        if args.sft_steps:
            model_dir = sft_warm_start(model_dir, self._workdir / "sft", args.env, args.sft_steps, seed=args.seed)
        self.model_dir = model_dir
        self.learner, self.tokenizer = load_causal_lm(model_dir, args.device)
        self.reference = load_causal_lm(model_dir, args.device)[0].requires_grad_(False) if args.kl_coef > 0 else None
        self.optimizer = torch.optim.Adam(self.learner.parameters(), lr=args.learning_rate)
        self.reward_service = rewards.RewardService(args.reward, timeout_s=args.reward_timeout_s, num_workers=2)
        self._closers.append(self.reward_service.close)
        self.policy = make_text_policy(args, model_dir, self.env.action_space)
        self._closers.append(self.policy.close)
        initial = self.policy.server_version() if args.backend == "openai" else 0
        self.versions = VersionManager(initial_version=initial, max_lag=args.max_staleness)
        self._closers.append(self.versions.close)
        backend = (
            ServerCheckpoints(self.policy, args.weights_dir, self.run_name) if args.backend == "openai" else self.policy
        )
        self.versions.register(LaggedWeights(backend, args.policy_lag))
        self.generator = GroupGenerator(
            self.policy, self.reward_service, iter_prompts(self.env, args.seed), args.group_size
        )
        self._closers.append(self.generator.stop)
        self._prompt_ids: dict[str, list[int]] = {}
        self.updates = 0
        self.counts = {"received": 0, "stale": 0, "is_entries": 0, "is_clipped": 0}

    # ------------------------------------------------------------------ the objective
    @abc.abstractmethod
    def compute_advantages(self, data: LMBatch, logp: torch.Tensor, ref_logp: torch.Tensor | None) -> torch.Tensor:
        """``[N, L]`` per-token advantages (0 off the mask); ``logp`` is the learner's at update start."""

    @abc.abstractmethod
    def policy_loss(
        self,
        logp: torch.Tensor,
        prox_logp: torch.Tensor,
        advantages: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss on a minibatch; ``weights`` are the truncated importance weights per token."""

    # ------------------------------------------------------------------ data
    def prepare(self, batch: GroupBatch) -> tuple[LMBatch | None, dict[str, float]]:
        """Drops stale groups and flagged samples (counting both); returns the rest as tensors."""
        staleness = batch.staleness(self.versions.current_version)
        self.versions.record_staleness(staleness.ravel().tolist())
        stale_groups = staleness.max(axis=1) > self.args.max_staleness
        stale = int(stale_groups.sum()) * batch.rewards.shape[1]
        if stale:
            self.versions.record_dropped(stale)
        self.counts["received"] += batch.rewards.size
        self.counts["stale"] += stale
        rows: list[tuple[int, Sample]] = []
        for g, samples in enumerate(batch.completions):
            usable = [s for s in samples if not s.flagged]
            if not stale_groups[g] and len(usable) >= self.min_group_samples:
                rows.extend((g, s) for s in usable)
        scored = [s.reward for samples in batch.completions for s in samples if not s.flagged]
        info = {
            "reward": float(np.mean(scored)) if scored else float("nan"),
            "stale_groups": float(stale_groups.sum()),
            "samples_used": float(len(rows)),
            "staleness_mean": float(staleness.mean()),
        }
        if not rows:
            return None, info
        length = max(len(s.output.token_ids) for _, s in rows)
        behavior = torch.zeros(len(rows), length)
        mask = torch.zeros(len(rows), length, dtype=torch.bool)
        for i, (_, s) in enumerate(rows):
            behavior[i, : len(s.output.token_logps)] = torch.tensor(s.output.token_logps)
            mask[i, : len(s.output.token_ids)] = True
        device = self.args.device
        data = LMBatch(
            prompt_ids=[self._encode_prompt(s.prompt) for _, s in rows],
            completion_ids=[list(s.output.token_ids) for _, s in rows],
            rewards=torch.tensor([s.reward for _, s in rows], dtype=torch.float32, device=device),
            group_ids=torch.tensor([g for g, _ in rows], device=device),
            behavior_logp=behavior.to(device),
            mask=mask.to(device),
        )
        return data, info

    def _encode_prompt(self, prompt: str) -> list[int]:
        if prompt not in self._prompt_ids:
            self._prompt_ids[prompt] = self.tokenizer(prompt).input_ids
        return self._prompt_ids[prompt]

    def logps(self, model: torch.nn.Module, data: LMBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Log-probs ``[n, L]`` of the batch's completions (or of ``rows``) under ``model``."""
        index = range(len(data.prompt_ids)) if rows is None else rows.tolist()
        return completion_logps(
            model,
            [data.prompt_ids[i] for i in index],
            [data.completion_ids[i] for i in index],
            data.mask.shape[1],
            self.args.temperature,
        )

    # ------------------------------------------------------------------ learning
    def update(self, batch: GroupBatch) -> dict[str, float]:
        """One learner update on complete groups; returns its statistics (no publish)."""
        args = self.args
        data, info = self.prepare(batch)
        self.updates += 1
        if data is None:
            return info
        mask = data.mask
        single_pass = args.update_epochs == 1 and args.num_minibatches == 1
        if single_pass:
            logp = self.logps(self.learner, data)
            prox = logp.detach()
        else:
            with torch.no_grad():
                prox = self.logps(self.learner, data)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = self.logps(self.reference, data)
        advantages = self.compute_advantages(data, prox, ref)
        # Truncated IS of the learner at update start (pi_prox) against the engine's behavior log-probs.
        weights, is_stats = truncated_importance_weights(
            prox, data.behavior_logp, args.is_cap, level=args.is_level, mask=mask
        )
        if args.is_level == "sequence":
            self.counts["is_entries"] += len(weights)
            weights = weights.unsqueeze(-1) * mask
        else:
            self.counts["is_entries"] += int(mask.sum())
        self.counts["is_clipped"] += round(
            float(is_stats["clipped_fraction"])
            * (len(data.rewards) if args.is_level == "sequence" else int(mask.sum()))
        )
        stats: dict[str, list[float]] = {}
        size = len(data.rewards)
        per_minibatch = max(1, math.ceil(size / args.num_minibatches))
        for _ in range(args.update_epochs):
            order = torch.arange(size, device=mask.device) if single_pass else torch.randperm(size, device=mask.device)
            for start in range(0, size, per_minibatch):
                rows = order[start : start + per_minibatch]
                current = logp if single_pass else self.logps(self.learner, data, rows)
                loss, loss_stats = self.policy_loss(current, prox[rows], advantages[rows], weights[rows], mask[rows])
                self.optimizer.zero_grad()
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.learner.parameters(), args.max_grad_norm)
                self.optimizer.step()
                for key, value in {"loss": loss.detach(), "grad_norm": grad_norm, **loss_stats}.items():
                    stats.setdefault(key, []).append(float(value))
        out = {
            **info,
            **{f"losses/{k}": float(np.mean(v)) for k, v in stats.items()},
            "is/clipped_fraction": float(is_stats["clipped_fraction"]),
            "is/ess": float(is_stats["ess"]),
            "is/mean_weight": float(is_stats["mean_weight"]),
            "advantage_abs_mean": float(advantages.abs()[mask].mean()),
        }
        if ref is not None:
            out["kl_ref"] = float(((prox - ref) * mask).sum(-1).mean())
        return out

    def publish(self) -> int:
        """Sends the learner's weights to the policy through the version manager; returns the new version."""
        return self.versions.publish({k: v.detach().clone() for k, v in self.learner.state_dict().items()})

    def generate_groups(self, num_prompts: int) -> GroupBatch:
        """Sync generation: ``num_prompts`` prompts, ``group_size`` scored completions each."""
        self.generator.submit(num_prompts)
        return self.generator.pop(num_prompts, self.args.timeout_s)

    def evaluate(self, num_samples: int) -> float:
        """Mean reward of ``num_samples`` completions (sampled as in training) on fresh prompts."""
        if num_samples == 0:
            return float("nan")
        prompts = list(itertools.islice(iter_prompts(self.eval_env, self.args.seed + 1), num_samples))
        outputs = self.policy.act(prompts, timeout=self.args.timeout_s)
        futures = [self.reward_service.submit(p, o.text or "") for p, o in zip(prompts, outputs)]
        results = [f.result(timeout=self.args.reward_timeout_s + 5.0) for f in futures]
        scored = [r.reward for r in results if not r.flagged]
        return float(np.mean(scored)) if scored else float("nan")

    # ------------------------------------------------------------------ the loop
    def train(self) -> LMTrainResult:
        """Trains for ``total_prompts`` (or until ``target_reward``) and closes everything."""
        args = self.args
        logger = RunLogger(
            Path(args.log_dir) / self.run_name,
            track=args.track,
            total_steps=args.total_prompts,
            progress=args.progress,
            hparams=asdict(args),
        )
        history: list[dict] = []
        curve: list[float] = []
        prompts_done = 0
        reached = False
        try:
            eval_before = self.evaluate(args.eval_prompts)
            start = time.monotonic()
            if args.mode == "async":
                self.generator.start(args.total_prompts, args.prefetch_updates * args.prompts_per_update)
            while prompts_done < args.total_prompts:
                num = min(args.prompts_per_update, args.total_prompts - prompts_done)
                batch = self.generator.pop(num, args.timeout_s) if args.mode == "async" else self.generate_groups(num)
                prompts_done += num
                stats = self.update(batch)
                if stats["samples_used"]:  # no step, no new version (nothing to send)
                    self.publish()
                version = self.versions.current_version
                curve.append(stats["reward"])
                elapsed = time.monotonic() - start
                row = {
                    **stats,
                    "charts/reward": stats["reward"],
                    "charts/version": version,
                    "time/wall_s": elapsed,
                    "charts/samples_per_s": self.generator.samples / elapsed,
                    "prompts": prompts_done,
                    "charts/policy_latency_p50_ms": self.policy.stats()["latency_p50_ms"],
                }
                history.append(row)
                logger.log(row, prompts_done)
                recent = [r for r in curve[-TARGET_WINDOW:] if not math.isnan(r)]
                if (
                    args.target_reward is not None
                    and len(recent) == TARGET_WINDOW
                    and np.mean(recent) >= args.target_reward
                ):
                    reached = True
                    break
            wall = time.monotonic() - start
            self.generator.stop()
            eval_after = self.evaluate(args.eval_prompts)
            if args.output_dir:
                self.learner.save_pretrained(args.output_dir)
                self.tokenizer.save_pretrained(args.output_dir)
        finally:
            logger.close()
            self.close()
        generator, counts = self.generator, self.counts
        received = max(counts["received"], 1)
        return LMTrainResult(
            updates=self.updates,
            prompts=prompts_done,
            samples=generator.samples,
            wall_time_s=wall,
            samples_per_s=generator.samples / wall,
            reward_curve=curve,
            eval_reward_before=eval_before,
            eval_reward_after=eval_after,
            stale_fraction=counts["stale"] / received,
            truncated_fraction=counts["is_clipped"] / max(counts["is_entries"], 1),
            flagged_fraction=generator.flagged / max(generator.samples, 1),
            fallback_fraction=generator.fallbacks / max(generator.samples, 1),
            staleness_mean=self.versions.staleness_stats().mean,
            final_version=self.versions.current_version,
            reached_target=reached,
            history=history,
        )

    def close(self) -> None:
        """Stops generation and closes the policy, reward service and envs (in reverse order of creation)."""
        closers, self._closers = self._closers, []
        errors = []
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:  # keep closing the rest
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> LMTrainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def summary(name: str, result: LMTrainResult) -> str:
    """A one-paragraph report of a run, printed by the agents' CLIs and the demo."""
    curve = ", ".join(f"{r:.2f}" for r in result.reward_curve)
    return (
        f"{name}: {result.updates} updates, {result.samples} completions in {result.wall_time_s:.1f} s "
        f"({result.samples_per_s:.0f} completions/s)\n"
        f"  reward curve (per update): [{curve}]\n"
        f"  eval reward before RL {result.eval_reward_before:.3f} -> after RL {result.eval_reward_after:.3f}\n"
        f"  stale {result.stale_fraction:.1%}, IS-truncated {result.truncated_fraction:.1%}, "
        f"flagged {result.flagged_fraction:.1%}, unparsable {result.fallback_fraction:.1%}, "
        f"mean staleness {result.staleness_mean:.2f}, final version {result.final_version}"
    )


__all__ = [
    "GroupGenerator",
    "LMArgs",
    "LMBatch",
    "LMTrainResult",
    "LMTrainer",
    "Sample",
    "ServerCheckpoints",
    "completion_logps",
    "completion_with_answer",
    "iter_prompts",
    "load_causal_lm",
    "make_prompt_env",
    "make_text_policy",
    "sft_warm_start",
    "summary",
]
