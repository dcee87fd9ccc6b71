"""``ProcessCollector``: a lockstep :class:`~asyncvec.collection.collector.Collector` in a child process of its own.

Acting (stepping the envs, the policy's forward pass, writing the rollout) then never takes the learner's
interpreter lock: the learner's update runs at its own speed beside collection (Sample Factory's and IMPALA's
shape). What crosses between the two processes is small and happens once per segment: the learner's publish
sends the weights (numpy arrays) down one pipe, the child sends each finished :class:`Segment` up it.

Which version acts on which step is fixed by construction (:func:`publish_pace` with :class:`PinnedWeights`):
with ``lag=0`` segment ``k`` is acted by the version published after update ``k - 1`` (the sync loop, bitwise);
with ``lag=1`` by the one before, while update ``k - 1`` trains. So a slow learner or slow envs change the wall
time only, never what is learned.

With ``partial_batches=True`` the child runs a free-running :class:`Collector` instead (EnvPool-style partial
batches: each env's observation goes to the policy as soon as that env is ready, so a straggler holds back no
other env); each publish loads into the child's policy as it arrives and ``lag`` is the max-lag gate
(``--max-staleness`` above 1): what the thread collector of the learner's process does, without its interpreter.
The child takes a finished segment out of its store only when the learner asks for one (:meth:`get`), so it runs
no further ahead of the learner than a collector writing into the learner's own store would.

The child starts as the env workers do (``multiprocessing``'s default start method: ``fork`` on Linux up to Python
3.13, so a script without a ``__main__`` guard works as with gymnasium's ``AsyncVectorEnv``; start it before the
learner starts threads of its own), runs torch on one thread (PyTorch's DataLoader workers' rule) and ignores Ctrl-C:
the learner stops it (:meth:`ProcessCollector.stop`); a learner that dies closes its pipe, and the child then
stops its envs and exits.

Example:
    >>> import functools, gymnasium as gym, torch
    >>> from asyncvec import TorchPolicy, VersionManager
    >>> from asyncvec.agents.common import make_vector_env
    >>> envs_spec = functools.partial(make_vector_env, "CartPole-v1", 2)
    >>> module = torch.nn.Linear(4, 2)
    >>> policy_spec = functools.partial(TorchPolicy, module, gym.spaces.Discrete(2))
    >>> versions = VersionManager(max_lag=1)
    >>> spaces = (gym.spaces.Box(-5, 5, (4,)), gym.spaces.Discrete(2))
    >>> with ProcessCollector(envs_spec, policy_spec, module.state_dict(), 4, 2, *spaces, versions, lag=1) as c:
    ...     segment = next_segment(c, c)
    ...     _ = versions.publish(module.state_dict())
    ...     second = next_segment(c, c)
    >>> segment.reward.shape, int(segment.policy_version.max()), int(second.policy_version.max())
    ((4, 2), 0, 0)
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np

from asyncvec.buffers import RolloutStore
from asyncvec.buffers.rollout import Segment
from asyncvec.collection.base import CollectorError
from asyncvec.collection.collector import Collector, next_segment, publish_pace
from asyncvec.metrics import EpisodeStats
from asyncvec.runs import set_rng_state
from asyncvec.vector.errors import WorkerError
from asyncvec.versioning import PinnedWeights, VersionManager, with_lag

__all__ = ["ProcessCollector"]


class ProcessCollector:
    """Runs ``Collector(envs, policy, store, lockstep=True)`` in a child process; the learner takes segments with
    :meth:`get` (``next_segment(collector, collector)``) and its publishes reach the child (it registers itself
    with ``versions``).

    Args:
        make_envs: builds the vector env in the child (cloudpickled: a ``functools.partial`` of a module-level
            function, or a closure).
        make_policy: builds the policy in the child, its module holding ``weights`` already.
        weights: the state dict the policy starts with (version ``versions.current_version``).
        num_steps, num_envs, observation_space, action_space: the rollout segments' shape, as `RolloutStore`.
        versions: the learner's version manager.
        lag: 0 or 1, which version acts on a segment (module docstring); with ``partial_batches``, the max-lag gate
            (an action is sent only while at most ``lag`` versions behind the learner's last publish).
        seed: the first reset's seed.
        env_specs: gymnasium registrations the child makes where it lacks them (envs registered in a script).
        random_state: the global random generators' states (`asyncvec.runs.rng_state`) the child starts from, so
            its policy samples the stream an acting thread of the learner would (lag 0 is then the sync loop).
        partial_batches: the envs step freely (partial batches) and publishes load as they arrive, instead of the
            lockstep, version-pinned collector (module docstring).
        policy_lag: with ``partial_batches``, the policy acts this many publishes behind the learner
            (:func:`asyncvec.versioning.with_lag`; 0: the newest).
    """

    stop_timeout_s = 30.0

    def __init__(
        self,
        make_envs: Callable[[], Any],
        make_policy: Callable[[], Any],
        weights: Mapping[str, Any],
        num_steps: int,
        num_envs: int,
        observation_space: gym.Space,
        action_space: gym.Space,
        versions: VersionManager,
        lag: int = 1,
        seed: int | None = None,
        env_specs: tuple[gym.envs.registration.EnvSpec, ...] = (),
        random_state: dict[str, Any] | None = None,
        partial_batches: bool = False,
        policy_lag: int = 0,
    ) -> None:
        if not partial_batches and lag not in (0, 1):
            raise ValueError(f"lag must be 0 or 1 (the version that acts on a segment is fixed by it), got {lag}")
        if partial_batches and not 0 <= policy_lag <= lag:
            raise ValueError(f"policy_lag must be between 0 and lag ({lag}), got {policy_lag}")
        self.versions = versions
        self.episodes = EpisodeStats(num_envs)  # from the segments: the returns as of each segment's end
        self.restarts: list[int] = [0] * num_envs
        self.placement: Any = None  # the child's envs.placement, once stopped
        self._metrics: dict[str, float] = {}
        self._latencies = np.zeros(0)
        self._error: tuple[str, str] | None = None  # the child's error: (its line, its traceback)
        self._error_cause: BaseException | None = None  # the child's exception where it pickles (a WorkerError)
        self._stopped = False
        self._partial_batches = partial_batches
        self._asked = False  # partial batches: a segment was asked for and has not come yet
        self._send_lock = threading.Lock()
        self._payload = cloudpickle.dumps(
            dict(
                make_envs=make_envs,
                make_policy=make_policy,
                weights=_to_numpy(weights),
                partial_batches=partial_batches,
                policy_lag=policy_lag,
                store=(num_steps, num_envs, observation_space, action_space),
                version=versions.current_version,
                max_lag=lag,
                seed=seed,
                env_specs=env_specs,
                random_state=random_state,
                start_method=multiprocessing.get_start_method(),
            )
        )
        context = multiprocessing.get_context()
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_child_main,
            args=(self._payload, child_conn, self._conn, os.getpid()),
            name="asyncvec-collector",
            daemon=False,
        )
        self._child_conn = child_conn

    # ------------------------------------------------------------------ control
    def start(self) -> ProcessCollector:
        """Starts the child (Ctrl-C then reaches the learner only) and registers for the learner's publishes."""
        ignore_interrupts = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignore_interrupts else None
        try:
            self._process.start()  # the child inherits SIGINT ignored (before its interpreter starts)
        finally:
            if ignore_interrupts:
                signal.signal(signal.SIGINT, previous)
        self._child_conn.close()
        self.versions.register(self)
        return self

    def load_weights(self, weights: Mapping[str, Any], version: int) -> None:
        """The learner's publish: the weights go to the child, which acts with them when the pace says (with
        ``partial_batches``: at once)."""
        self._send(("weights", version, _to_numpy(weights)))

    def set_max_lag(self, max_lag: int) -> None:
        """Moves the child's max-lag gate (``partial_batches``; PPO's ``--adaptive-staleness``)."""
        self._send(("max_lag", max_lag))

    def stop_soon(self) -> None:
        """The child's collector ends at its next wait for a publish (lag 0: no step past the learner's last)."""
        self._send(("stop_soon",))

    def get(self, timeout: float | None = None) -> Segment:
        """The next segment (``TimeoutError`` after ``timeout`` s), as a `RolloutStore`'s ``get``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._partial_batches and not self._asked:
            self._send(("next_segment",))  # the child takes the segment out of its store now, not before
            self._asked = True
        while True:
            self.check()
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._conn.poll(remaining):
                self.check()
                raise TimeoutError(f"no segment from the collector process within {timeout} s")
            message = self._recv()
            if message[0] == "segment":
                _, segment, self._metrics, self._latencies = message
                self._asked = False
                dones = segment.terminated | segment.truncated
                env_ids = np.arange(dones.shape[1])
                for t in range(dones.shape[0]):
                    self.episodes.update(env_ids, segment.reward[t], dones[t])
                return segment

    def check(self) -> None:
        """Raises `CollectorError` if the child failed or died."""
        if self._error is not None:
            error = CollectorError(f"the collector process stopped: {self._error[0]}")
            error.add_note(f"the collector process's traceback:\n{self._error[1]}")
            raise error from self._error_cause
        if self._process.exitcode is not None and not self._stopped and not self._conn.poll(0):
            raise CollectorError(f"the collector process died (exit code {self._process.exitcode})")

    def stop(self, timeout: float | None = None) -> None:
        """Stops the child's collector and envs and joins it (killed after ``timeout`` s, default 30)."""
        if self._stopped:
            return
        self._stopped = True
        self.versions.unregister(self)
        timeout = self.stop_timeout_s if timeout is None else timeout
        if self._process.is_alive():
            self._send(("stop",))
            deadline = time.monotonic() + timeout
            try:
                while self._conn.poll(max(0.0, deadline - time.monotonic())):
                    message = self._conn.recv()
                    if message[0] == "stopped":
                        self.restarts, self.placement = message[1], message[2]
                        break
            except (EOFError, OSError):
                pass
            self._process.join(max(0.1, deadline - time.monotonic()))
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()

    @property
    def running(self) -> bool:
        return self._process.is_alive() and not self._stopped

    # ------------------------------------------------------------------ what the learner logs
    def recent_returns(self) -> list[float]:
        """Returns of the episodes finished in the segments taken so far (recent window, oldest first)."""
        return self.episodes.returns()

    def metrics(self) -> dict[str, float]:
        """The child collector's `Collector.metrics` as of the last segment taken."""
        return dict(self._metrics)

    def latencies(self) -> np.ndarray:
        """Recent policy latencies in seconds, as of the last segment taken."""
        return self._latencies

    def __enter__(self) -> ProcessCollector:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the pipe
    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (BrokenPipeError, EOFError, OSError):
                self.check()  # a dead child says so; a stopping one needs nothing more

    def _recv(self) -> tuple:
        try:
            message = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise CollectorError(f"the collector process died (exit code {self._process.exitcode})") from exc
        if message[0] == "error":
            self._error = (message[1], message[2])
            self._error_cause = message[3]
            self.check()
        return message


def _picklable_cause(exc: BaseException | None) -> BaseException | None:
    """The `WorkerError` in the chain of the child's exception (pickling keeps no chain): the learner chains it to
    its `CollectorError`, so an agent still reports "your env failed" with the env's own traceback."""
    while exc is not None:
        if isinstance(exc, WorkerError):
            try:
                return pickle.loads(pickle.dumps(exc))
            except Exception:  # noqa: BLE001  (a subclass that does not pickle: the text still goes up)
                return None
        exc = exc.__cause__ or exc.__context__
    return None


def _to_numpy(weights: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu().numpy() if hasattr(v, "detach") else v for k, v in weights.items()}


def _child_main(payload: bytes, conn: Any, learners_end: Any, learner_pid: int) -> None:
    """The child: builds the envs, the policy and a `Collector` (lockstep, or with partial batches); sends each
    segment up; takes the
    learner's weights and stop from the pipe (its main thread), and ends its envs when the learner is gone (its end
    of the pipe closed, or this process handed to another parent)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    learners_end.close()  # a forked child holds a copy: the learner's death would never close the pipe
    import torch

    torch.set_num_threads(1)
    send_lock, stopping = threading.Lock(), threading.Event()
    asked = threading.Semaphore(0)  # partial batches: the segments the learner asked for (see ProcessCollector.get)
    built: list[Any] = []  # what to close at the end, last built first

    def send(message: tuple) -> None:
        with send_lock:
            try:
                conn.send(message)
            except (BrokenPipeError, EOFError, OSError):
                pass  # the learner is gone: the main thread sees it too

    def send_error(exc: BaseException) -> None:
        send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(), _picklable_cause(exc)))

    try:
        spec = cloudpickle.loads(payload)
        # the env workers start as the learner's own would (the default of a spawned child is spawn)
        multiprocessing.set_start_method(spec["start_method"], force=True)
        for env_spec in spec["env_specs"]:
            gym.registry.setdefault(env_spec.id, env_spec)
        envs = spec["make_envs"]()
        built.append(envs)
        policy = spec["make_policy"]()
        built.append(policy)
        if spec["random_state"] is not None:
            set_rng_state(spec["random_state"])
        store = RolloutStore(*spec["store"])
        versions = VersionManager(max_lag=spec["max_lag"])
        weights = {k: torch.from_numpy(v) for k, v in spec["weights"].items()}
        if spec["version"]:  # a resumed learner's version: the policy acts with it (the gate compares the two)
            versions.publish({}, version=spec["version"])  # (nothing registered yet)
            policy.load_weights(weights, spec["version"])
        if spec["partial_batches"]:  # publishes load as they arrive; the gate holds actions within max_lag
            versions.register(with_lag(policy, spec["policy_lag"]))
            collector = Collector(envs, policy, store, version_manager=versions, seed=spec["seed"])
        else:
            pinned = PinnedWeights(policy, weights, spec["version"])
            versions.register(pinned)
            num_steps, num_envs = spec["store"][:2]
            pace = publish_pace(versions, num_steps * num_envs, spec["max_lag"], pinned)
            collector = Collector(
                envs, policy, store, version_manager=versions, seed=spec["seed"], pace=pace, lockstep=True
            )
        collector.start()
        built.append(collector)

        def forward() -> None:
            try:
                while True:
                    while spec["partial_batches"] and not asked.acquire(timeout=1.0):
                        collector.check()
                    segment = next_segment(store, collector)
                    send(("segment", segment, collector.metrics(), collector.latencies()))
            except Exception as exc:  # noqa: BLE001  (the store closes when the child stops: no error then)
                if not stopping.is_set():
                    send_error(exc)

        threading.Thread(target=forward, name="asyncvec-forwarder", daemon=True).start()
        while True:
            try:
                if not conn.poll(1.0):
                    if os.getppid() != learner_pid:
                        break  # the learner is gone (and something else still holds its end of the pipe)
                    continue
                message = conn.recv()
            except (EOFError, OSError):
                break  # the learner is gone
            if message[0] == "weights":
                _, version, arrays = message
                versions.publish({k: torch.from_numpy(v) for k, v in arrays.items()}, version=version)
            elif message[0] == "next_segment":
                asked.release()
            elif message[0] == "max_lag":
                versions.max_lag = message[1]
            elif message[0] == "stop_soon":
                collector.stop_soon()
            elif message[0] == "stop":
                break
        stopping.set()
        versions.close()  # ends the pace's wait for a publish
        collector.stop()
        store.close()
        send(("stopped", list(envs.restarts), envs.placement))
    except BaseException as exc:  # noqa: BLE001  (reported to the learner, which raises it)
        stopping.set()
        send_error(exc)
    finally:
        for closeable in reversed(built):
            try:
                closeable.stop() if isinstance(closeable, Collector) else closeable.close()
            except Exception:  # noqa: BLE001, S110  (ending: the others still close)
                pass
        conn.close()
