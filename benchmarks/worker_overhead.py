"""What one message to a worker process costs, beside its physical floor, in one run.

A vector env at its defaults steps each env in a worker process of its own (gymnasium's placement), so
every step of a cheap env pays one message to its worker and one answer back. This measures that cost
with an env whose step costs ~0.3 us (``NoopEnv``), so that what remains is the message:

* **floors**, the same round trip with nothing but the wake-up: a one-byte ``os.pipe`` ping-pong between
  two processes, a ``multiprocessing.Pipe`` (duplex socket pair, gymnasium's transport), ``posix_ipc``
  semaphores and ``faster-fifo`` queues (where installed: ``pip install posix_ipc faster-fifo``), and, measured
  alone (it takes a core), a shared-memory flag that both sides spin on (no wake-up: the lower bound when a core
  is free for each side);
* **one env**: ``step()`` of a vector env of one ``NoopEnv`` (ours at defaults, gymnasium's
  ``AsyncVectorEnv``, ``SyncVectorEnv`` for the env's own cost);
* **eight envs in lockstep** on this machine's cores: the floor (eight raw pipes, one byte written to each,
  then each read), ours, gymnasium's.

Each figure is the median of interleaved rounds. Run: ``python benchmarks/worker_overhead.py`` (about a
minute). Writes ``benchmarks/results/worker_overhead.md`` and ``.png``.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import tyro
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncvec import AsyncLLMVectorEnv  # noqa: E402  (the repository root goes on sys.path first)
from asyncvec.benchmarks.report import machine_line, markdown_table, new_figure, save_report  # noqa: E402  (after the repository is put on sys.path)


@dataclass
class Args:
    rounds: int = 5
    """interleaved rounds per contender (the table holds the median)"""
    seconds: float = 0.4
    """seconds per contender and round"""
    out_dir: str | None = None
    """where to write worker_overhead.md/.png (default benchmarks/results)"""


class NoopEnv(gym.Env):
    """A step of ~0.3 us: what a vector env around it costs is its own overhead."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (6,), np.float32)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(6, np.float32), {}

    def step(self, action):
        return np.zeros(6, np.float32), 0.0, False, False, {}


def _pipe_echo(read_fd: int, write_fd: int) -> None:
    while (byte := os.read(read_fd, 1)) != b"q":
        os.write(write_fd, byte)


def _connection_echo(connection) -> None:
    while (payload := connection.recv_bytes()) != b"q":
        connection.send_bytes(payload)


def _semaphore_echo(request_name: str, answer_name: str, stop) -> None:
    import posix_ipc

    request, answer = posix_ipc.Semaphore(request_name), posix_ipc.Semaphore(answer_name)
    while True:
        request.acquire()
        if stop.value:
            return
        answer.release()


def _fifo_echo(requests, answers) -> None:
    while (item := requests.get()) != b"q":
        answers.put(item)


def _spin_echo(flags) -> None:
    seen = 0
    while True:
        while flags[0] == seen:
            pass
        seen = flags[0]
        if seen < 0:
            return
        flags[1] = seen


def timed(step: Callable[[], object], seconds: float) -> float:
    """Microseconds per call of ``step`` over ``seconds``."""
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(50):
            step()
        calls += 50
    return elapsed / calls * 1e6


def floors(ctx) -> dict[str, tuple[Callable[[], object], Callable[[], None]]]:
    """Round trips to a second process with nothing but the hand-over: (step, close) per mechanism."""
    found: dict[str, tuple[Callable[[], object], Callable[[], None]]] = {}
    request_read, request_write = os.pipe()
    answer_read, answer_write = os.pipe()
    child = ctx.Process(target=_pipe_echo, args=(request_read, answer_write), daemon=True)
    child.start()

    def pipe_step() -> None:
        os.write(request_write, b"x")
        os.read(answer_read, 1)

    found["floor: os.pipe, 1 byte each way"] = (pipe_step, lambda: (os.write(request_write, b"q"), child.join()))
    ours, theirs = ctx.Pipe()
    echo = ctx.Process(target=_connection_echo, args=(theirs,), daemon=True)
    echo.start()

    def connection_step() -> None:
        ours.send_bytes(b"x")
        ours.recv_bytes()

    found["floor: multiprocessing.Pipe (gymnasium's)"] = (
        connection_step,
        lambda: (ours.send_bytes(b"q"), echo.join()),
    )
    try:
        import posix_ipc
    except ImportError:
        pass
    else:
        names = (f"/asyncvec-req-{os.getpid()}", f"/asyncvec-ans-{os.getpid()}")
        request, answer = (posix_ipc.Semaphore(name, posix_ipc.O_CREX) for name in names)
        stop = ctx.RawValue("i", 0)
        semaphores = ctx.Process(target=_semaphore_echo, args=(*names, stop), daemon=True)
        semaphores.start()

        def semaphore_step() -> None:
            request.release()
            answer.acquire()

        def close_semaphores() -> None:
            stop.value = 1
            request.release()
            semaphores.join()
            for semaphore in (request, answer):
                semaphore.unlink()

        found["floor: posix_ipc semaphores"] = (semaphore_step, close_semaphores)
    try:
        from faster_fifo import Queue
    except ImportError:
        pass
    else:
        requests, answers = Queue(), Queue()
        fifo = ctx.Process(target=_fifo_echo, args=(requests, answers), daemon=True)
        fifo.start()

        def fifo_step() -> None:
            requests.put(b"x")
            answers.get()

        found["floor: faster-fifo queues"] = (fifo_step, lambda: (requests.put(b"q"), fifo.join()))
    return found


def spin_floor(ctx, seconds: float, rounds: int) -> list[float]:
    """Round trips to a process spinning on a shared-memory flag, measured alone: the spinner takes a whole
    core, which would slow (or, keeping a core awake, speed) every other contender beside it."""
    flags = ctx.RawArray("q", 2)
    spinner = ctx.Process(target=_spin_echo, args=(flags,), daemon=True)
    spinner.start()
    counter = [0]

    def spin_step() -> None:
        counter[0] += 1
        flags[0] = counter[0]
        while flags[1] != counter[0]:
            pass

    try:
        timed(spin_step, 0.1)
        return [timed(spin_step, seconds) for _ in range(rounds)]
    finally:
        flags[0] = -1
        spinner.join()


def lockstep_floor(ctx, workers: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """One byte to each of ``workers`` echo processes, then each answer read: a lockstep step's floor."""
    ends, children = [], []
    for _ in range(workers):
        request_read, request_write = os.pipe()
        answer_read, answer_write = os.pipe()
        child = ctx.Process(target=_pipe_echo, args=(request_read, answer_write), daemon=True)
        child.start()
        ends.append((request_write, answer_read))
        children.append(child)

    def step() -> None:
        for request_write, _ in ends:
            os.write(request_write, b"x")
        for _, answer_read in ends:
            os.read(answer_read, 1)

    def close() -> None:
        for request_write, _ in ends:
            os.write(request_write, b"q")
        for child in children:
            child.join()

    return step, close


def vector_step(envs) -> tuple[Callable[[], object], Callable[[], None]]:
    envs.reset(seed=0)
    actions = np.zeros(envs.num_envs, dtype=np.int64)
    return (lambda: envs.step(actions)), envs.close


def main(args: Args) -> list[list[object]]:
    ctx = multiprocessing.get_context()
    contenders: dict[str, tuple[str, tuple[Callable[[], object], Callable[[], None]]]] = {}
    floors_found = floors(ctx)
    for label, pair in floors_found.items():
        contenders[label] = ("round trip to one process", pair)
    one = [NoopEnv]
    contenders["ours step(), 1 env (a worker)"] = ("round trip to one process", vector_step(AsyncLLMVectorEnv(one)))
    contenders["gymnasium AsyncVectorEnv step(), 1 env"] = (
        "round trip to one process",
        vector_step(AsyncVectorEnv(one)),
    )
    contenders["gymnasium SyncVectorEnv step(), 1 env (no worker)"] = (
        "round trip to one process",
        vector_step(SyncVectorEnv(one)),
    )
    eight = [NoopEnv] * 8
    contenders["floor: 8 os.pipes, a byte to each, then each answer"] = ("lockstep step of 8", lockstep_floor(ctx, 8))
    contenders["ours step(), 8 envs (a worker each)"] = ("lockstep step of 8", vector_step(AsyncLLMVectorEnv(eight)))
    contenders["gymnasium AsyncVectorEnv step(), 8 envs"] = ("lockstep step of 8", vector_step(AsyncVectorEnv(eight)))
    contenders["gymnasium SyncVectorEnv step(), 8 envs (no worker)"] = (
        "lockstep step of 8",
        vector_step(SyncVectorEnv(eight)),
    )
    samples: dict[str, list[float]] = {label: [] for label in contenders}
    try:
        for _, (step, _) in contenders.values():
            timed(step, 0.1)  # warm up (and the first steps our advice times)
        for _ in range(args.rounds):
            for label, (_, (step, _)) in contenders.items():
                samples[label].append(timed(step, args.seconds))
    finally:
        for _, (_, close) in contenders.values():
            close()
    spinning = "floor: both sides spinning on shared memory (measured alone)"
    contenders = {
        **dict(list(contenders.items())[: len(floors_found)]),
        spinning: ("round trip to one process", (lambda: None, lambda: None)),
        **dict(list(contenders.items())[len(floors_found) :]),
    }
    samples[spinning] = spin_floor(ctx, args.seconds, args.rounds)
    rows = []
    for label, (what, _) in contenders.items():
        values = samples[label]
        floor_label = (
            "floor: os.pipe, 1 byte each way"
            if what.startswith("round")
            else "floor: 8 os.pipes, a byte to each, then each answer"
        )
        median = statistics.median(values)
        rows.append(
            [
                what,
                label,
                median,
                f"{min(values):,.1f}-{max(values):,.1f}",
                f"{median / statistics.median(samples[floor_label]):.2f}x",
            ]
        )
    headers = ["what", "contender", "us (median)", "range over rounds", "vs its os.pipe floor"]
    table = markdown_table(headers, rows)
    print(machine_line())
    print(table)
    figure, ax = new_figure(width=8.0, height=5.0)
    ax.barh([row[1] for row in rows][::-1], [row[2] for row in rows][::-1], color="tab:blue")
    ax.set_xlabel("microseconds (median)")
    ax.set_title("one message to a worker, and a lockstep step of 8, beside their floors", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    figure.tight_layout()
    command = " ".join(["python benchmarks/worker_overhead.py", *sys.argv[1:]])
    save_report("worker_overhead", table, figure, out_dir=args.out_dir, command=command)
    return rows


if __name__ == "__main__":
    main(tyro.cli(Args))
