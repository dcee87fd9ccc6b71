"""The options the language-model agents share (``LMArgs``: each agent's ``Args`` extends it and
adds its own), their checks, and ``--reward module:name`` plugins.

``LMArgs`` keeps the algorithm's and the run's options at the top and the rest in sections that
``--help`` lists apart: ``engine`` (:class:`EngineOptions`), ``staleness``
(:class:`~asyncvec.lm.staleness.Staleness`), ``multi_turn`` (:class:`MultiTurnOptions`),
``reward_service`` (:class:`RewardServiceOptions`), ``logging`` (:class:`LoggingOptions`). A
section's flags have no prefix, and its options keep their flat names in Python too.

Example:
    >>> from asyncvec.lm.options import LMArgs
    >>> LMArgs(group_size=4).group_size
    4
    >>> args = LMArgs(max_staleness=1, backend="hf")
    >>> args.staleness.max_staleness, args.max_staleness, args.engine.backend
    (1, 1, 'hf')
    >>> LMArgs(group_size=1)
    Traceback (most recent call last):
    ...
    ValueError: --group-size must be an int >= 2, got 1
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Annotated, Any, Literal

import torch
from tyro.conf import OmitArgPrefixes

from asyncvec.inference.backends.server_routes import SERVER_KINDS
from asyncvec.lm import rewards
from asyncvec.lm.backends import LM_BACKENDS
from asyncvec.lm.staleness import Staleness
from asyncvec.runs import import_user_module

if TYPE_CHECKING:
    BackendName = ServerKind = str
else:  # --backend's choices: the names in the table of backends; --server-kind's: the servers OpenAIPolicy
    BackendName = Literal[tuple(LM_BACKENDS)]  # knows (tyro reads the Literals)
    ServerKind = Literal[SERVER_KINDS]


NOT_REPLAYED = frozenset(  # options that do not change what the learner computes from a batch (--replay)
    {
        "mode",
        "staleness_control",
        "bitwise_sampling",
        "prefetch_updates",
        "policy_batch_size",
        "policy_wait_ms",
        "policy_inflight_batches",
        "deadline_ms",
        "inflight_updates",
        "backend",
        "base_url",
        "served_model",
        "server_kind",
        "update_token",
        "vllm_engine",
        "reward_workers",
        "reward_timeout_s",
        "reward_cache_size",
        "total_prompts",
        "target_reward",
        "eval_prompts",
        "timeout_s",
        "output_dir",
        "checkpoint_dir",
        "resume",
        "track",
        "log_dir",
        "progress",
        "record_schedule",
        "replay",
    }
)


@dataclass(frozen=True)
class MultiTurnOptions:
    """Multi-turn envs: how episodes are played and their returns."""

    num_envs: int = 8
    """multi-turn envs: envs stepping at once (their turns reach the policy batched)"""
    gamma: float = 1.0
    """multi-turn envs: discount of the episode return sum_t gamma^t r_t"""
    per_turn: bool = False
    """multi-turn envs: each turn's advantage is its discounted return-to-go normalized over the batch
    (for dense rewards) instead of the episode return with the agent's baseline; --kl-coef subtracts
    beta times the KL summed over a turn's tokens from that turn's reward"""
    system_prompt: str | None = None
    """multi-turn envs: the conversation's first message"""
    on_overflow: Literal["truncate", "drop_oldest"] = "truncate"
    """multi-turn envs: a prompt over the context ends the episode truncated, or drops the oldest whole
    turns from it (a new context segment, each turn trained in the context the engine saw)"""


@dataclass(frozen=True)
class RewardServiceOptions:
    """One-step envs: the reward service scoring completions."""

    reward_timeout_s: float = 10.0
    """a reward not ready this long after its request is flagged and kept out of training"""
    reward_workers: int = 2
    """scorer calls running at once (raise it for a remote reward model or tool that waits)"""
    reward_cache_size: int = 4096
    """scores kept by (prompt, completion) and reused; 0 scores every completion afresh"""


@dataclass(frozen=True)
class EngineOptions:
    """The inference engine sampling completions (--backend) and its batching."""

    backend: BackendName = "hf"
    """hf: HFTextPolicy in this process; vllm: an in-process vLLM engine; openai: a server at --base-url
    (asyncvec.lm.backends.LM_BACKENDS)"""
    inflight_updates: bool = False
    """hf and vllm backends, and openai with --server-kind vllm (a server started with --enable-scale-out): a
    publish reaches the engine between decoding steps instead of after the batch; completions then span versions
    (token by token) and the loss uses each token's version (asyncvec docs inference)"""
    vllm_engine: str = "{}"
    """--backend vllm: vllm.LLM options as JSON, e.g. '{"dtype": "float32", "max_model_len": 128}'"""
    base_url: str | None = None
    """server root for --backend openai, e.g. http://127.0.0.1:8000"""
    server_kind: ServerKind = "asyncvec"
    """--backend openai: which server it is (how new weights reach it, see asyncvec docs lm_agents)"""
    served_model: str | None = None
    """model name the server expects (default: the one model the server lists at /v1/models)"""
    weights_dir: str | None = None
    """--backend openai: where published versions are written for the server to load (default: a scratch folder)"""
    update_token: str | None = None
    """bearer token of an asyncvec server's /update_weights (default: $ASYNCVEC_SERVE_TOKEN)"""
    bitwise_sampling: bool = False
    """--backend hf: each completion (sampled with its own seed) gets an engine call of its own, so its log-probs do
    not depend on which requests shared its batch: runs repeat bit for bit, async at --max-staleness 0 ends with sync's
    parameters bit for bit (slower: completions are not batched). Default: batched; the tokens are the same, the
    log-probs may differ in the last bits (asyncvec docs lm_agents)"""
    policy_batch_size: int = 128
    """largest batch the policy's DynamicBatcher sends to the model (multi-turn: at most --num-envs)"""
    policy_wait_ms: float = 20.0
    """longest the policy's batcher waits to fill a batch (over HTTP each batch is one request)"""
    policy_inflight_batches: int | None = None
    """batches the policy runs at once (vllm: they share the engine, continuous admission; openai: requests in
    flight at once; default: the backend's, 1 in process, 4 over HTTP); without --inflight-updates a weight
    update waits for all of them"""
    deadline_ms: float | None = None
    """a completion not ready this long after its request gets the fallback and is never trained on"""


@dataclass(frozen=True)
class LoggingOptions:
    """Logs, checkpoints, the saved model and recorded schedules."""

    output_dir: str | None = None
    """save the trained model (save_pretrained) here"""
    checkpoint_dir: str | None = None
    """save a checkpoint here after every update (learner weights, optimizer, version, prompts done, RNG state)"""
    resume: bool = False
    """continue from the checkpoint in --checkpoint-dir (same TensorBoard run folder, same step axis)"""
    track: bool = True
    """write TensorBoard logs to --log-dir/<run> (as CleanRL; --no-track writes none)"""
    log_dir: str = "runs"
    """TensorBoard log root (a resumed run keeps writing to its own folder there)"""
    progress: bool = True
    """show a progress bar"""
    record_schedule: bool = False
    """write each update's groups (samples with their behaviour log-probs and versions), the learner's version and the
    RNG states into <log-dir>/<run>/schedule, for --replay"""
    replay: str | None = None
    """re-run the learner on the schedule recorded in this folder (--record-schedule): the same batches in the same
    order, nothing generated; ends with the recorded run's parameters, bit for bit"""


_SECTIONS: dict[str, type] = {
    "engine": EngineOptions,
    "staleness": Staleness,
    "multi_turn": MultiTurnOptions,
    "reward_service": RewardServiceOptions,
    "logging": LoggingOptions,
}
"""``LMArgs``' sections: field name -> its dataclass."""

SECTION_OF: dict[str, str] = {option.name: section for section, cls in _SECTIONS.items() for option in fields(cls)}
"""A sectioned option's flat name (``max_staleness``) -> its section (``staleness``)."""


class _AcceptsFlatOptions(type):
    """Lets ``LMArgs(max_staleness=1)`` (and ``dataclasses.replace(args, max_staleness=1)``) stand for
    ``LMArgs(staleness=Staleness(max_staleness=1))``: options given by their flat names are moved into their
    sections (into a copy of a section also given)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        flat = {name: kwargs.pop(name) for name in list(kwargs) if name in SECTION_OF}
        for section in {SECTION_OF[name] for name in flat}:
            given = {name: value for name, value in flat.items() if SECTION_OF[name] == section}
            kwargs[section] = dataclasses.replace(kwargs.get(section) or _SECTIONS[section](), **given)
        return super().__call__(*args, **kwargs)


@dataclass
class LMArgs(metaclass=_AcceptsFlatOptions):
    """Options shared by the language-model agents (each agent's ``Args`` adds its own): the algorithm's and
    the run's at the top, the others in sections (``engine``, ``staleness``, ``multi_turn``,
    ``reward_service``, ``logging``) that ``--help`` lists apart. Their flags have no prefix
    (``--max-staleness``), and in Python each sectioned option also reads, sets and constructs by its
    flat name: ``LMArgs(max_staleness=1).max_staleness`` is ``args.staleness.max_staleness``."""

    env: str = "asyncvec/SingleDigitSums-v0"
    """text env id, or module:EnvId (module, in the current folder or installed, registers EnvId when imported):
    an env declaring metadata["multi_turn"] = False is one-step, its reset() observations the prompts scored by
    --reward; any other (e.g. asyncvec/GuessNumber-v0) is played turn by turn in an AsyncLLMVectorEnv, rewarded
    by the env"""
    env_kwargs: str = "{}"
    """keyword arguments of gym.make(--env) as JSON, e.g. '{"max_number": 8, "transcript": false}'"""
    model: str | None = None
    """save_pretrained folder of the model (default: a fresh tiny GPT-2 from build_tiny_lm)"""
    sft_steps: int = 0
    """supervised warm start on the env's prompts and solved answers before RL (arithmetic envs)"""
    reward: str = "exact_answer"
    """one-step envs: the reward plugin scoring (prompt, completion): a registered name (asyncvec.lm.rewards.register), or
    module:name to import module first and use its function name (or the plugin it registers as name)"""
    mode: Literal["sync", "async"] = "async"
    """async: generation and scoring keep running in a thread while the learner trains; sync: alternate"""
    total_prompts: int = 6400
    """prompts to train on (each with group_size completions)"""
    prompts_per_update: int = 16
    """prompts (groups) per learner update"""
    group_size: int = 8
    """k: completions sampled per prompt"""
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
    eval_prompts: int = 200
    """completions sampled to measure the mean reward before and after training (0: skip)"""
    target_reward: float | None = None
    """stop once the mean training reward of the last 10 updates reaches this and a batch sampled
    entirely by the final weights confirms it (see --target-tolerance)"""
    target_tolerance: float = 0.1
    """a confirming batch (prompts_per_update groups, not trained on) must reach --target-reward less
    this; one that falls short is trained on and training goes on"""
    timeout_s: float = 120.0
    """longest wait for a batch of groups before the run fails (it never hangs)"""
    seed: int = 1
    """seed of torch, numpy, the prompt stream and the policy's sampling (HF: its own generator; vLLM: the engine)"""
    device: str = "cpu"
    """torch device of the learner, the reference model and the hf backend's model"""
    torch_threads: int = 1
    """torch CPU threads (generation and learning already run on two threads)"""
    multi_turn: Annotated[MultiTurnOptions, OmitArgPrefixes] = field(default_factory=MultiTurnOptions)
    """multi-turn envs: how episodes are played and their returns"""
    reward_service: Annotated[RewardServiceOptions, OmitArgPrefixes] = field(default_factory=RewardServiceOptions)
    """one-step envs: the reward service scoring completions"""
    engine: Annotated[EngineOptions, OmitArgPrefixes] = field(default_factory=EngineOptions)
    """the inference engine sampling completions (--backend) and its batching"""
    staleness: Annotated[Staleness, OmitArgPrefixes] = field(default_factory=Staleness)
    """how old a sample may be when trained on, and how generation keeps within it"""
    logging: Annotated[LoggingOptions, OmitArgPrefixes] = field(default_factory=LoggingOptions)
    """logs, checkpoints, the saved model and recorded schedules"""

    def flat(self) -> Any:
        """Every option as a field of its own, sections flattened (what a run records: its checkpoint's and
        schedule's options and its TensorBoard hparams keep the flat names they always had).

        Example:
            >>> from dataclasses import asdict
            >>> asdict(LMArgs(max_staleness=1).flat())["max_staleness"]
            1
        """
        values = {}
        for option in fields(self):
            if option.name in _SECTIONS:
                section = getattr(self, option.name)
                values.update({inner.name: getattr(section, inner.name) for inner in fields(section)})
            else:
                values[option.name] = getattr(self, option.name)
        return _flat_class(type(self))(**values)

    def __post_init__(self) -> None:
        for name in (
            "total_prompts",
            "prompts_per_update",
            "update_epochs",
            "num_minibatches",
            "max_new_tokens",
            "policy_batch_size",
            "torch_threads",
            "prefetch_updates",
            "num_envs",
        ):
            _check_int(name, getattr(self, name), 1)
        for name in ("sft_steps", "max_staleness", "policy_lag", "eval_prompts"):
            _check_int(name, getattr(self, name), 0)
        if self.replay and (self.resume or self.record_schedule):
            raise ValueError(
                f"--replay re-runs a recorded schedule from the start: leave out --{'resume' if self.resume else 'record-schedule'}"
            )
        self.staleness.check(self.mode)  # --policy-lag within --max-staleness under admission
        _check_int("group_size", self.group_size, 2)
        for name in ("is_cap", "reward_timeout_s", "timeout_s", "learning_rate", "max_grad_norm"):
            _check_number(name, getattr(self, name), positive=True)
        for name in ("kl_coef", "temperature", "policy_wait_ms", "target_tolerance"):
            _check_number(name, getattr(self, name), positive=False)
        if self.deadline_ms is not None:
            _check_number("deadline_ms", self.deadline_ms, positive=True)
        if self.policy_inflight_batches is not None:
            _check_int("policy_inflight_batches", self.policy_inflight_batches, 1)
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("--resume needs --checkpoint-dir DIR, the folder of the checkpoint to continue from")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"--gamma must be in [0, 1], got {self.gamma!r}")
        try:
            env_kwargs = json.loads(self.env_kwargs)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--env-kwargs must be a JSON object, got {self.env_kwargs!r}: {exc}") from None
        if not isinstance(env_kwargs, dict):
            raise ValueError(
                f"--env-kwargs must be a JSON object of gym.make keyword arguments, got {self.env_kwargs!r}"
            )
        if self.temperature == 0:
            raise ValueError("--temperature must be > 0: policy-gradient learning needs sampled completions")
        if self.backend not in LM_BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(LM_BACKENDS)}, got {self.backend!r}")
        LM_BACKENDS[self.backend].check(self)  # --base-url, --inflight-updates, --bitwise-sampling
        load_reward_plugin(self.reward)
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


def check_clip_coef(value: Any) -> None:
    """``--clip-coef`` of the agents with a PPO-clip loss: a number in (0, 1).

    Example:
        >>> check_clip_coef(1.5)
        Traceback (most recent call last):
        ...
        ValueError: --clip-coef must be a number in (0, 1), got 1.5
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"--clip-coef must be a number in (0, 1), got {value!r}")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"--{_flag(name)} must be an int >= {minimum}, got {value!r}")


def _check_number(name: str, value: Any, positive: bool) -> None:
    in_range = isinstance(value, (int, float)) and (value > 0 if positive else value >= 0) and value < math.inf
    if isinstance(value, bool) or not in_range:
        raise ValueError(f"--{_flag(name)} must be a finite number {'>' if positive else '>='} 0, got {value!r}")


def load_reward_plugin(spec: str) -> str:
    """Makes ``--reward`` usable by name: ``module:name`` imports ``module``, then registers its
    attribute ``name`` (or the plugin the import registered as ``name``) under ``spec`` itself.
    A plain name is returned as is (an unknown one fails when it first scores). Returns ``spec``.

    Raises:
        ValueError: naming the module imported and what was missing in it.

    Example:
        >>> load_reward_plugin("asyncvec.lm.rewards:exact_answer")
        'asyncvec.lm.rewards:exact_answer'
        >>> rewards.score("asyncvec.lm.rewards:exact_answer", "1+1=", "2")
        1.0
    """
    module_name, _, name = spec.rpartition(":")
    if not module_name:
        return spec
    if not name:
        raise ValueError(f"--reward {spec!r}: expected module:name, the name of a reward function after the colon")
    module = import_user_module(module_name, f"--reward {spec!r}: importing {module_name!r}")
    if hasattr(module, name):
        plugin = getattr(module, name)
    elif name in rewards.available():
        plugin = rewards.get(name)
    else:
        raise ValueError(
            f"--reward {spec!r}: imported {module_name!r}, but it has no attribute {name!r} and registered no "
            f"reward plugin {name!r} (registered plugins: {', '.join(rewards.available())})"
        )
    if not callable(plugin):
        raise ValueError(
            f"--reward {spec!r}: {module_name}.{name} is a {type(plugin).__name__}, not a reward function "
            "f(prompt, completion, **info) -> float"
        )
    if spec not in rewards.available() or rewards.get(spec) is not plugin:
        try:
            rewards.register(spec, replace=True)(plugin)
        except TypeError as exc:  # its signature: a reward is f(prompt, completion, **info)
            raise ValueError(f"--reward {spec!r}: {exc}; change the function to take them") from None
    return spec


def _flat_option(section: str, name: str) -> property:
    def read(args: LMArgs) -> Any:
        return getattr(getattr(args, section), name)

    def write(args: LMArgs, value: Any) -> None:  # a section is frozen: the args get a changed copy
        setattr(args, section, dataclasses.replace(getattr(args, section), **{name: value}))

    return property(read, write, doc=f"``{section}.{name}`` (``--{_flag(name)}``)")


for _name, _section in SECTION_OF.items():
    setattr(LMArgs, _name, _flat_option(_section, _name))


@functools.cache
def _flat_class(cls: type) -> type:
    """A dataclass with a field per option of ``cls``, sections flattened (:meth:`LMArgs.flat`)."""
    names: list[str] = []
    for option in fields(cls):
        names += [inner.name for inner in fields(_SECTIONS[option.name])] if option.name in _SECTIONS else [option.name]
    return dataclasses.make_dataclass(f"Flat{cls.__name__}", [(name, Any) for name in names])
