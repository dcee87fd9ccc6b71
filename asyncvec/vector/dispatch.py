"""How the vector env talks to its workers: per-worker message queues, polling, answers filed per env.

Commands for single envs are queued (:meth:`Dispatcher.send`) and :meth:`Dispatcher.flush` sends
each worker its share as one message. A worker answers its messages in order, so each worker's
sent messages form a FIFO (:class:`Message`); an answer is filed per env into its :class:`Slot`
and the env id joins ``arrivals``, from which the vector env delivers. A message holding a step or
reset that runs past ``step_timeout`` (per env of the message) has hung: its worker is killed and
handed to the fault handling (:class:`~asyncvec.vector.faults.Faults`), as is a worker that died or an env
that raised: it says what to restart, and the dispatcher restarts it.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from gymnasium.vector.vector_env import AutoresetMode

from asyncvec.vector.errors import WorkerError, error_from_payload
from asyncvec.vector.faults import FaultPolicy, Faults, Restart
from asyncvec.vector.observations import ObservationBuffers
from asyncvec.vector.slots import ANSWERED, OWES_RESTART_STEP, Episode, Slot, SlotState
from asyncvec.vector.split_obs import write_row
from asyncvec.vector.transport import InProcessTransport, ProcessTransport, Transport
from asyncvec.vector.worker import BuildFailure, EnvFailure

__all__ = ["CallFailure", "Dispatcher", "Message", "Slot"]  # Slot: from slots.py

_TIMED_COMMANDS = ("step", "step_shared", "reset", "restart")  # a message holding one is subject to step_timeout

# The states and episode states the hot paths compare with, bound once (a global, not an enum attribute, per use)
IDLE, WAITING_STEP, WAITING_RESET = SlotState.IDLE, SlotState.WAITING_STEP, SlotState.WAITING_RESET
STEP_READY, RESET_READY, CALL_READY = SlotState.STEP_READY, SlotState.RESET_READY, SlotState.CALL_READY
LIVE, ENDED, LOST, ENDED_REBUILT = Episode.LIVE, Episode.ENDED, Episode.LOST, Episode.ENDED_REBUILT


@dataclass(frozen=True)
class CallFailure:
    """An env method raised inside a call; the worker itself is fine."""

    payload: tuple[Any, ...]


@dataclass
class Message:
    """A message sent to one worker and not yet answered."""

    env_ids: list[int]
    timed: bool  # holds a step or reset: subject to step_timeout
    started_at: float | None  # when the worker began it (None while an earlier message is still running)


class Dispatcher:
    """Sends the vector env's commands to its workers and files their answers (see the module docstring).

    Thread use: the vector env calls it under :attr:`lock`; :meth:`poll` with ``unlocked=True``
    releases the lock while it waits, so that a ``send`` from another thread reaches the workers
    (and, seeing :attr:`recv_waiting`, wakes the wait to watch its envs too).

    Args:
        transport: the workers.
        groups: the env indices each worker hosts.
        observations: where observations that come with answers are kept.
        autoreset_mode: the vector env's autoreset mode.
        step_timeout: seconds a step or reset may take before its worker counts as hung, or ``None``.
        start_timeout: seconds a worker may take to build its envs.
        fault_policy: decides whether a fault's envs are rebuilt (:class:`~asyncvec.vector.faults.MaxRestarts`).
        action_rows: shared views of one action per env (actions then travel without pickling), or ``None``.
        close_for: closes the vector env, saying why (an error while waiting, or a fault past restarting).
    """

    def __init__(
        self,
        transport: Transport,
        groups: list[list[int]],
        observations: ObservationBuffers,
        *,
        autoreset_mode: AutoresetMode,
        step_timeout: float | None,
        start_timeout: float,
        fault_policy: FaultPolicy,
        action_rows: Any,
        close_for: Callable[[str], None],
    ) -> None:
        self.transport = transport
        self.groups = groups
        self.observations = observations
        self.step_timeout = step_timeout
        self.start_timeout = start_timeout
        self.action_rows = action_rows
        self.close_for = close_for
        self.slots = [Slot(worker=0, position=0) for _ in range(sum(map(len, groups)))]
        self._place_slots(groups)
        self.queues: list[deque[Message]] = [deque() for _ in groups]
        self.arrivals: deque[int] = deque()  # env ids with an undelivered answer, in arrival order
        self.faults = Faults(self.slots, observations, fault_policy, autoreset_mode)
        self.lock = threading.Lock()
        self.recv_waiting = False
        self.woken = threading.Event()  # wake(): the next wakeable wait that would wait returns at once
        self._same_step = autoreset_mode == AutoresetMode.SAME_STEP
        self._outbox: dict[int, tuple[list[int], list[tuple[int, str, Any]]]] = {}
        self.stepped: Any = None  # a lockstep step's actions and results, taken by the in-process fast path
        self.compact_stepping = False  # a lockstep step of every env sent by step_workers, not yet finished

    def _place_slots(self, groups: list[list[int]]) -> None:
        for worker, group in enumerate(groups):
            for position, index in enumerate(group):
                self.slots[index].worker, self.slots[index].position = worker, position

    # ------------------------------------------------------------------ sending

    def await_ready(self, worker: int) -> None:
        """Waits until ``worker`` has built its envs; raises the ``WorkerError`` of one that failed to build."""
        ok, payload = self.transport.await_ready(worker, self.start_timeout)
        if ok:
            return
        if isinstance(payload, BuildFailure):
            raise error_from_payload(self.groups[worker][payload.position], "make", payload.payload)
        raise error_from_payload(self.groups[worker][0], "make", payload)

    def send(self, index: int, command: str, payload: Any) -> None:
        """Queues one command for one env; :meth:`flush` sends each worker its share as one message."""
        slot = self.slots[index]
        slot.payload = payload
        if command == "step":
            slot.state = WAITING_STEP
            episode = slot.episode
            if episode is not LOST and episode is not ENDED_REBUILT:  # the hot path: straight to the worker's message
                entry = self._outbox.get(slot.worker)
                if entry is None:
                    entry = self._outbox[slot.worker] = ([], [])
                entry[0].append(index)
                entry[1].append(self._step_item(index, slot.position, payload))
            else:  # its worker was rebuilt while it waited: it owes a restart's step
                self.queue(index, "restart", self.faults.owed_step(index))
        elif command == "reset":
            slot.state = WAITING_RESET
            if slot.episode in OWES_RESTART_STEP:  # a reset starts afresh anyway
                self.faults.drop_owed_step(index)
            self.queue(index, command, self.faults.reset_payload(index, payload))
        else:
            slot.state, slot.call = SlotState.WAITING_CALL, command
            self.queue(index, command, payload)

    def _step_item(self, index: int, position: int, action: Any) -> tuple[int, str, Any]:
        """A step's item: the action written to the env's shared row (worker processes, fixed-shape
        action spaces: nothing to pickle), else the action itself in the message."""
        if self.action_rows is not None:
            try:
                write_row(self.action_rows, index, action, field="action")
            except ValueError:
                pass  # not checked (validate_actions=False) and not a row: the env itself gets it and says why
            else:
                return position, "step_shared", None
        return position, "step", action

    def queue(self, index: int, command: str, payload: Any) -> None:
        """Queues an item for env ``index``'s worker as it is (no bookkeeping of the env's command)."""
        slot = self.slots[index]
        ids, items = self._outbox.setdefault(slot.worker, ([], []))
        ids.append(index)
        items.append((slot.position, command, payload))

    def flush(self) -> None:
        """Sends each worker its queued items as one message.

        A message that cannot be sent (a payload that does not pickle) raises; its envs and
        those of the messages after it go back to idle, as if never asked. Earlier messages
        stay sent: lockstep calls take their answers back with :meth:`flush_or_discard`.
        """
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        now = time.monotonic()
        messages = list(outbox.items())
        for k, (worker, (ids, items)) in enumerate(messages):
            try:
                self.transport.send(worker, items)
            except BaseException:
                for _, (unsent, _) in messages[k:]:
                    for index in unsent:
                        self.slots[index].state, self.slots[index].payload = IDLE, None
                raise
            queue = self.queues[worker]
            timed = items[0][1] in _TIMED_COMMANDS or any(command in _TIMED_COMMANDS for _, command, _ in items)
            queue.append(Message(ids, timed, None if queue else now))

    def flush_or_discard(self, ids: Sequence[int]) -> None:
        """:meth:`flush` for a lockstep call over ``ids``: if a message cannot be sent, the
        answers to those that were sent are awaited and dropped, so the call fails whole and
        the env is idle again."""
        try:
            self.flush()
        except BaseException:
            sent = [i for i in ids if self.slots[i].state is not IDLE]
            if sent:
                self.collect(sent, None)
                self.deliver(sent)
            raise

    # ------------------------------------------------------------------ receiving

    def _receive(self, workers: list[int]) -> None:
        """Reads the next reply of each worker (blocking) and files their results."""
        for worker, reply in zip(workers, self.transport.read_many(workers)):
            self._file(worker, *reply)

    def _file(self, worker: int, ok: bool, payload: Any) -> None:
        """Files a worker's reply to its oldest message: results per env, or the worker's death."""
        queue = self.queues[worker]
        message = queue.popleft()
        if queue:
            queue[0].started_at = time.monotonic()
        if not ok:
            queue.appendleft(message)
            self.worker_failed(worker, payload)
            return
        accept = self._accept
        for index, result in zip(message.env_ids, payload):
            if type(result) is EnvFailure:
                self.env_failed(index, result.payload)
            else:
                accept(index, result)
        self.flush()  # restarts queued by failures (nothing to do without one)

    def _accept(self, index: int, result: Any) -> None:
        slot = self.slots[index]
        observations = self.observations
        state = slot.state
        if state is WAITING_STEP and observations.in_shared_memory:
            # the common case (a step, its observation in shared memory), without the checks below
            slot.episode = ENDED if (result[2] or result[3]) and not self._same_step else LIVE
            slot.state = STEP_READY
        elif state is WAITING_STEP or state is WAITING_RESET:
            try:
                observations.store(index, result[0])
            except ValueError as exc:  # a bad observation is the env's failure, as with shared memory
                self.env_failed(index, (type(exc).__name__, str(exc), "", None))
                return
            if state is WAITING_RESET:
                slot.episode, slot.state = LIVE, RESET_READY
            else:
                slot.episode = ENDED if (result[2] or result[3]) and not self._same_step else LIVE
                slot.state = STEP_READY
        else:
            slot.state = CALL_READY
        slot.result = result
        self.arrivals.append(index)

    def env_failed(self, index: int, payload: Any) -> None:
        """Env ``index`` raised: a step or reset is restarted (or the vector env closes and raises, as the
        fault policy says); a method call's failure is its answer (the worker is fine, nothing restarts)."""
        slot = self.slots[index]
        if slot.state is WAITING_STEP or slot.state is WAITING_RESET:
            self._restart(self.faults.env_failed(index, payload))
        else:
            slot.result, slot.state = CallFailure(payload), CALL_READY
            self.arrivals.append(index)

    def poll(self, deadline: float | None, unlocked: bool = False) -> None:
        """Receive the replies that arrive before ``deadline`` (or the next hang deadline);
        ``unlocked``: the caller holds :attr:`lock`, released while waiting."""
        busy = [w for w, queue in enumerate(self.queues) if queue]
        if not busy:
            return
        # The earliest of the caller's deadline and the hang deadlines of timed messages; None
        # waits for the next reply (a call, setattr... has no hang deadline: it may take its time).
        deadlines = [] if self.step_timeout is None else [d for d in map(self._hang_deadline, busy) if d is not None]
        if deadline is not None:
            deadlines.append(deadline)
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        if unlocked:
            self.recv_waiting = True
            self.lock.release()
            try:
                ready = self.transport.wait(busy, timeout)
            finally:
                self.lock.acquire()
                self.recv_waiting = False
        else:
            ready = self.transport.wait(busy, timeout)
        self._receive(ready)
        if self.step_timeout is not None:
            now = time.monotonic()
            for worker, queue in enumerate(self.queues):
                hang_at = self._hang_deadline(worker) if queue else None
                if hang_at is not None and now > hang_at:
                    culprit = self.transport.culprit(worker)
                    self.transport.kill(worker)
                    self.worker_failed(
                        worker,
                        ("StepTimeout", f"no answer within step_timeout={self.step_timeout} s", "", None),
                        culprit,
                    )

    def worker_failed(self, worker: int, payload: Any, culprit: int | None = None) -> None:
        """A worker died or hung: restarts it with all its envs rebuilt, or closes and raises."""
        lost = [i for message in self.queues[worker] for i in message.env_ids]
        self.queues[worker].clear()
        if culprit is None:
            culprit = self.transport.culprit(worker)
        self._restart(self.faults.worker_failed(worker, self.groups[worker], lost, culprit, payload), payload)

    def _restart(self, restart: Restart | WorkerError, payload: Any = None) -> None:
        """Does what the fault handling decided: restart a worker and queue the envs' restart items, or give up."""
        if isinstance(restart, WorkerError):
            self._give_up(restart)
        if restart.worker is not None:
            try:
                self.transport.restart(restart.worker)
                self.await_ready(restart.worker)
            except WorkerError as error:
                error.args = (f"{error.args[0]}\n(while restarting its worker after: {payload[0]}: {payload[1]})",)
                self._give_up(error)
            except BaseException as exc:
                self.close_for(f"{type(exc).__name__}: {exc}")
                raise
        for index, item in restart.items:
            self.queue(index, "restart", item)
        if restart.worker is not None:
            self.flush()

    def _give_up(self, error: WorkerError) -> NoReturn:
        self.close_for(str(error).split("\n", 1)[0])
        raise error

    def poll_ready(self) -> None:
        """Files the replies that have already arrived, without waiting (an error closes the env)."""
        try:
            self.poll(time.monotonic())
        except BaseException as exc:
            self.close_after(exc)
            raise

    def _hang_deadline(self, worker: int) -> float | None:
        """When the worker's running message counts as hung; ``None``: never (no ``step_timeout``,
        or the message holds no step or reset, or it has not started)."""
        head = self.queues[worker][0]
        if self.step_timeout is None or not head.timed or head.started_at is None:
            return None
        return head.started_at + self.step_timeout * len(head.env_ids)

    def wait_until(self, done: Callable[[], bool], timeout: float | None, what: str, wakeable: bool = False) -> None:
        """Polls until ``done()``; raises ``multiprocessing.TimeoutError`` after ``timeout`` seconds
        (or, ``wakeable``, once :attr:`woken` is set, releasing :attr:`lock` while waiting)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not done():
                if deadline is not None and time.monotonic() >= deadline:
                    raise multiprocessing.TimeoutError(f"{what} within {timeout} s")
                if wakeable and self.woken.is_set():
                    self.woken.clear()
                    raise multiprocessing.TimeoutError(f"{what}: woken by wake()")
                self.poll(deadline, unlocked=wakeable)
        except multiprocessing.TimeoutError:
            raise
        except BaseException as exc:
            self.close_after(exc)
            raise

    def close_after(self, exc: BaseException) -> None:
        """While waiting for workers, any error but a timeout closes the env: after one, which
        worker answered what is unknown, and a call left half-waiting would make every later
        call fail with ``AlreadyPendingCallError``. The next call says why the env closed.
        (A ``try`` in each waiting method rather than a context manager: this is the hot path.)"""
        self.close_for(f"{type(exc).__name__}: {exc}")

    def collect(self, indices: list[int], timeout: float | None, what: str = "not every env answered") -> None:
        """Wait until every env in ``indices`` has answered (see :meth:`close_after`)."""
        slots = self.slots
        if timeout is None and self.step_timeout is None:
            # Nothing to time out: read each worker in turn, as gymnasium does (no selector per call).
            # A dead worker reads as a failure, so this never blocks on a dead env.
            try:
                while True:
                    waiting = [i for i in indices if slots[i].state not in ANSWERED]
                    if not waiting:
                        return
                    busy = [w for w in dict.fromkeys(slots[i].worker for i in waiting) if self.queues[w]]
                    if not busy:  # bare RuntimeError: the slots' bookkeeping is wrong, a bug here
                        raise RuntimeError(f"envs {waiting} wait for an answer but nothing was sent to them")
                    self._receive(busy)
            except BaseException as exc:
                self.close_after(exc)
                raise
        self.wait_until(lambda: all(slots[i].state in ANSWERED for i in indices), timeout, what)

    def deliver(self, indices: Sequence[int]) -> list[Any]:
        """Pop the answers of ``indices``; the envs become free for the next command."""
        results = []
        if len(indices) == len(self.arrivals):
            self.arrivals.clear()
        else:
            taken = set(indices)
            self.arrivals = deque(i for i in self.arrivals if i not in taken)
        for index in indices:
            slot = self.slots[index]
            results.append(slot.result)
            slot.result = slot.payload = None
            slot.state = IDLE
        return results

    def with_extra(self, index: int, info: dict[str, Any]) -> dict[str, Any]:
        """``info`` of env ``index`` with what a restart added to it (``env_restarted``...), once."""
        extra = self.slots[index].info_extra
        if extra:
            self.slots[index].info_extra = {}
            return {**info, **extra}
        return info

    # ------------------------------------------------------------------ in-process lockstep steps

    def step_all(self, actions: list[Any]) -> None:
        """The in-process fast path of a lockstep step (:meth:`EnvGroup.step_all`: no message nor
        result per env, as ``SyncVectorEnv``): every env, all in this process, steps now."""
        transport = self.transport
        assert isinstance(transport, InProcessTransport)  # the vector env takes this path only for in-process envs
        self.stepped = (actions, transport.step_all(0, actions))

    def finish_step_all(self) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
        """The results of :meth:`step_all` (rewards, terminations, truncations, infos): the envs that
        raised go through the usual failure path (rebuilt and truncated, or the error); the others'
        results are taken as they are."""
        actions, (rewards, terminations, truncations, infos, failures) = self.stepped
        self.stepped = None
        if failures:
            failed = [position for position, _ in failures]
            for index, payload in failures:
                slot = self.slots[index]
                slot.state, slot.payload = WAITING_STEP, actions[index]
                self.env_failed(index, payload)
            self.flush()
            self.collect(failed, None)
            for index, result in zip(failed, self.deliver(failed)):
                _, rewards[index], terminations[index], truncations[index], infos[index] = result
                infos[index] = self.with_extra(index, infos[index])
        if self._same_step:  # an ended episode was reset within the step
            for slot in self.slots:
                slot.episode = LIVE
        else:
            for slot, terminated, truncated in zip(self.slots, terminations, truncations):
                slot.episode = ENDED if terminated or truncated else LIVE
        return rewards, terminations, truncations, infos

    # ------------------------------------------------------------------ compact lockstep steps in workers

    @property
    def can_step_workers(self) -> bool:
        """Whether a lockstep step may take :meth:`step_workers` now: worker processes with actions and whole
        observations in shared memory, no ``step_timeout`` (the answers are read in order, as gymnasium's
        ``AsyncVectorEnv`` reads them), nothing in flight, and no env owing a restart's truncation or info."""
        transport = self.transport
        if not isinstance(transport, ProcessTransport) or not transport.compact_steps:
            return False
        if self.step_timeout is not None or self.observations.per_env is not None or self.arrivals:
            return False
        return not any(slot.episode in OWES_RESTART_STEP or slot.info_extra for slot in self.slots)

    def step_workers(self, rows: Any, actions: Any) -> None:
        """Writes ``actions`` (one array, every env's) into the shared action ``rows`` and sends every worker a step
        of all its envs: one byte a worker, no per-env message (:data:`~asyncvec.vector.worker.STEP_MESSAGE`)."""
        rows[...] = actions
        transport = self.transport
        assert isinstance(transport, ProcessTransport)  # can_step_workers said so
        for slot in self.slots:
            slot.state = WAITING_STEP
        now = time.monotonic()
        for worker, (ids, queue) in enumerate(zip(self.groups, self.queues)):
            queue.append(Message(ids, True, None if queue else now))
        self.compact_stepping = True
        transport.send_steps(range(len(self.groups)))

    def compact_step_waits(self, timeout: float | None) -> bool:
        """Whether a lockstep step sent by :meth:`step_workers` is finished by :meth:`finish_step_workers`: a wait
        that may time out takes the usual path instead (its answers may be waited for again)."""
        if timeout is None:
            return self.compact_stepping
        self.compact_stepping = False
        return False

    def finish_step_workers(self) -> tuple[Any, Any, Any, list[Any]]:
        """The results of :meth:`step_workers` (rewards, terminations, truncations as arrays, infos): compact
        answers from :class:`~asyncvec.vector.worker.StepResults`; any other answer (an info, a failure, a
        dead worker) through the usual path, restarts included."""
        transport = self.transport
        assert isinstance(transport, ProcessTransport) and transport.step_results is not None
        self.compact_stepping = False
        others: list[int] = []
        try:
            for worker, queue in enumerate(self.queues):
                reply = transport.read_step(worker)
                if reply is None:
                    queue.popleft()
                else:
                    others += self.groups[worker]
                    self._file(worker, *reply)
            if others:
                self.collect(others, None)
        except BaseException as exc:
            self.close_after(exc)
            raise
        rewards, terminations, truncations = (view.copy() for view in transport.step_results.views())
        infos: list[Any] = [None] * len(self.slots)
        for index, result in zip(others, self.deliver(others)):
            _, rewards[index], terminations[index], truncations[index], info = result
            infos[index] = self.with_extra(index, info)
        same_step = self._same_step
        for slot, ended in zip(self.slots, (terminations | truncations).tolist()):
            slot.state = IDLE
            slot.episode = ENDED if ended and not same_step else LIVE
        return rewards, terminations, truncations, infos
