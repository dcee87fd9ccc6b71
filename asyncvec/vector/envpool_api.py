"""EnvPool's asynchronous API of :class:`~asyncvec.vector.AsyncLLMVectorEnv`: ``async_reset``,
``send``/``send_reset`` to some envs, ``recv`` of the first ``batch_size`` to answer, and ``wake``.

:class:`EnvPoolAPI` is a base class of the vector env, not a class of its own: it works on the
vector env's dispatcher and slots, beside Gymnasium's lockstep API (``reset``/``step``) in
:mod:`~asyncvec.vector.async_llm_vector_env`, whose state guards both APIs use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncvec.vector.actions import seeds_for
from asyncvec.vector.advice import timed_for_advice
from asyncvec.vector.errors import NoAsyncCallError
from asyncvec.vector.observations import take_info
from asyncvec.vector.slots import SlotState

if TYPE_CHECKING:
    from asyncvec.vector.actions import ActionSplitter
    from asyncvec.vector.advice import PlacementAdvisor
    from asyncvec.vector.dispatch import Dispatcher
    from asyncvec.vector.observations import ObservationBuffers
    from asyncvec.vector.slots import Slot
    from asyncvec.vector.transport import Transport

__all__ = ["EnvPoolAPI"]

IDLE, RESET_READY = SlotState.IDLE, SlotState.RESET_READY


class EnvPoolAPI:
    """The EnvPool API of :class:`~asyncvec.vector.AsyncLLMVectorEnv` (see the module docstring)."""

    if TYPE_CHECKING:  # what the vector env provides
        num_envs: int
        batch_size: int
        validate_actions: bool
        _dispatch: Dispatcher
        _slots: list[Slot]
        _actions: ActionSplitter
        _advisor: PlacementAdvisor | None
        _observations: ObservationBuffers
        _transport: Transport

        @property
        def in_flight(self) -> list[int]: ...
        def _assert_is_running(self) -> None: ...
        def _assert_idle(self, call: str) -> None: ...
        def _assert_not_waiting(self, call: str) -> None: ...
        def _add_info(self, vector_infos: dict[str, Any], env_info: dict[str, Any], env_num: int) -> dict[str, Any]: ...

    def async_reset(
        self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> None:
        """Resets every env without waiting; the reset observations come out of :meth:`recv`.

        Reset results carry reward 0 and ``terminated = truncated = False``.
        """
        self._assert_idle("async_reset")
        seeds = seeds_for(seed, self.num_envs)
        for i in range(self.num_envs):
            self._dispatch.send(i, "reset", {"seed": seeds[i], "options": options})
        self._dispatch.flush()

    @timed_for_advice(lambda envs, result: 0)
    def send(self, actions: Any, env_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Sends one action to each env in ``env_ids`` (default: all) and returns at once.

        Thread-safe with a :meth:`recv` waiting in another thread (as :meth:`wake`): an action
        computed in another thread (a policy's callback) goes to its env at once, and the waiting
        ``recv`` watches that env from then on.

        Raises:
            ValueError: an env id is out of range, repeated, or still busy; or an action does
                not belong to ``single_action_space`` (nothing is sent then).
        """
        with self._dispatch.lock:
            self._assert_not_waiting("send")
            ids = list(range(self.num_envs)) if env_ids is None else [int(i) for i in np.asarray(env_ids).reshape(-1)]
            self._check_free(ids)
            items = self._actions.split(actions, ids, self.validate_actions)
            if self._advisor is not None:
                self._advisor.before_send(ids)
            self._send_now(ids, "step", items)

    def _send_now(self, ids: list[int], command: str, payloads: Sequence[Any]) -> None:
        """``send``/``send_reset``: one command per env, sent at once."""
        for i, payload in zip(ids, payloads):
            self._dispatch.send(i, command, payload)
        self._dispatch.flush()
        if self._dispatch.recv_waiting:  # called while recv waits in another thread: it watches these envs too
            self._transport.wake()

    def _check_free(self, ids: list[int]) -> None:
        """``send``/``send_reset``: each id once, in range, and not still busy."""
        if len(set(ids)) != len(ids):
            raise ValueError(f"env_ids has repeated ids: {ids}")
        for i in ids:
            if not 0 <= i < self.num_envs:
                raise ValueError(f"env id {i} is out of range [0, {self.num_envs})")
            if self._slots[i].state is not IDLE:
                raise ValueError(
                    f"env {i} is still busy with its previous send (or its answer was not received with recv() yet)"
                )

    def send_reset(
        self, env_ids: Sequence[int], seeds: Sequence[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> None:
        """Resets the envs in ``env_ids`` (each with its seed) and returns at once; the reset
        observations come out of :meth:`recv` like :meth:`async_reset`'s. The other envs keep
        stepping: an env whose episode ended (or was abandoned) starts its next one when its
        driver chooses, with the seed it chooses (e.g. k episodes of one seed for a group).
        Thread-safe with a :meth:`recv` waiting in another thread, as :meth:`send`.

        Raises:
            ValueError: an env id is out of range, repeated, or still busy; or ``seeds`` has
                another length than ``env_ids``.
        """
        with self._dispatch.lock:
            self._assert_not_waiting("send_reset")
            ids = [int(i) for i in np.asarray(env_ids).reshape(-1)]
            seeds = [None] * len(ids) if seeds is None else list(seeds)
            if len(seeds) != len(ids):
                raise ValueError(f"send_reset: {len(seeds)} seeds for {len(ids)} env ids")
            self._check_free(ids)
            if self._advisor is not None:
                self._advisor.before_send(ids)
            self._send_now(ids, "reset", [{"seed": seed, "options": options} for seed in seeds])

    @timed_for_advice(lambda envs, result: len(result[4]["env_id"]))
    def recv(
        self, timeout: float | None = None, *, at_least: int | None = None
    ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Returns the first ``batch_size`` envs to finish, in arrival order.

        If fewer than ``batch_size`` envs are in flight, returns all of them once they finish.
        With ``at_least=m``, returns as soon as ``m`` envs have finished, with every env finished
        by then (up to ``batch_size``): a loop whose policy batches requests itself need not
        hold a finished env back until ``batch_size - 1`` others finish too.
        ``info["env_id"]`` holds the env ids of the rows; other info keys follow gymnasium's
        ``key``/``_key`` convention, sized to the batch.

        Raises:
            NoAsyncCallError: nothing was sent.
            multiprocessing.TimeoutError: the batch was not complete within ``timeout``
                seconds, or :meth:`wake` ended the wait; answers already received stay
                buffered for the next ``recv``.
        """
        with self._dispatch.lock:
            self._assert_is_running()
            in_flight = self.in_flight
            if not in_flight:
                raise NoAsyncCallError(
                    "Calling `recv` with no env in flight: call `async_reset` or `send` first.", "recv"
                )
            target = min(self.batch_size, len(in_flight))
            needed = target if at_least is None else max(1, min(int(at_least), target))
            if self._advisor is not None and needed < target:
                self._advisor.block(f"recv(at_least={at_least}) of {target}", partial=True)
            dispatch = self._dispatch
            dispatch.wait_until(
                lambda: len(dispatch.arrivals) >= needed,
                timeout,
                f"recv: fewer than {needed} envs answered",
                wakeable=True,
            )
            if len(dispatch.arrivals) < target:  # at_least: take the answers that are ready, without waiting
                dispatch.poll_ready()
            target = min(target, len(dispatch.arrivals))
            ids = [dispatch.arrivals[k] for k in range(target)]
            rows = np.asarray(ids, dtype=np.int64)
            states = [self._slots[i].state for i in ids]
            results = self._dispatch.deliver(ids)
            rewards = np.zeros(target, dtype=np.float64)
            terminations = np.zeros(target, dtype=np.bool_)
            truncations = np.zeros(target, dtype=np.bool_)
            infos: dict[str, Any] = {}
            for k, (index, state, result) in enumerate(zip(ids, states, results)):
                if state is RESET_READY:
                    info = result[1]
                else:
                    _, rewards[k], terminations[k], truncations[k], info = result
                infos = self._add_info(infos, self._dispatch.with_extra(index, info), index)
            infos = take_info(infos, rows)
            infos["env_id"] = rows
            return self._observations.rows(rows), rewards, terminations, truncations, infos

    @property
    def wakeable(self) -> bool:
        """Whether :meth:`wake` ends a waiting :meth:`recv` at once (worker processes: yes; a
        transport that cannot ends it at its next return from waiting, at most its timeout)."""
        return self._transport is not None and self._transport.wakeable

    def wake(self) -> None:
        """Ends a :meth:`recv` waiting in another thread, as its timeout would (it raises ``multiprocessing.TimeoutError``);
        a wake while no ``recv`` waits ends the next wait. Thread-safe: with :meth:`send` and :meth:`send_reset`, what
        another thread may call during ``recv``. For a loop that waits on envs and on something else, e.g. a policy's
        answers: ``recv(timeout)`` with a long timeout, and ``wake()`` from the other side when its thing is ready.

        Example:
            >>> import multiprocessing, threading, time, gymnasium as gym
            >>> from asyncvec import AsyncLLMVectorEnv
            >>> from asyncvec.envs.slow import SlowEnv
            >>> envs = AsyncLLMVectorEnv([lambda: SlowEnv(gym.make("CartPole-v1"), latency_ms=500)], batch_size=1)
            >>> envs.send_reset([0], [0]); _ = envs.recv()
            >>> envs.send([0], [0])  # a step of 500 ms
            >>> threading.Timer(0.05, envs.wake).start()
            >>> start = time.monotonic()
            >>> try:
            ...     envs.recv(timeout=30)
            ... except multiprocessing.TimeoutError:
            ...     print("woken before the step ended:", time.monotonic() - start < 0.4)
            woken before the step ended: True
            >>> envs.close()
        """
        if self._dispatch is not None:
            self._dispatch.woken.set()
        if self._transport is not None:
            self._transport.wake()
