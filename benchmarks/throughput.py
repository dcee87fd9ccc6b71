"""Env-steps/s of gymnasium's vector envs and AsyncLLMVectorEnv at its defaults, side by side in one run.

Every contender steps the same envs with random actions for the same wall-clock budget, in
interleaved rounds (the machine is noisy); the table holds medians. ``AsyncLLMVectorEnv`` is built
with defaults only (``AsyncLLMVectorEnv(fns)``, ``batch_size`` for the partial-batch row): its
placement is whatever :mod:`asyncvec.vector.placement` chose, printed in the table. Env kinds:

* ``classic``: CartPole-v1 x8 (a few us a step: vectorization overhead only).
* ``acrobot``: Acrobot-v1 x8 (about 45 us a step: a cheap env whose step outweighs a pipe message).
* ``pendulum``: Pendulum-v1 x8 (cheap, continuous Box actions).
* ``cpu``: CartPole behind a SlowEnv spinning 1 ms of CPU a step, x8 (a local simulator).
* ``sleep``: CartPole behind a SlowEnv sleeping lognormal 10 ms (sigma 1), x16 (a remote
  simulator or a robot: heavy-tailed, the core is free); lockstep and partial batches of 8.
* ``image``: a 64x64 RGB image observation (``PixelPendulum``'s image alone), x8.
* ``dict``: ``Dict(image 64x64x3, instruction Text)`` observations (a VLA's input), x8.
* ``mixed``: 4 CartPole-v1 and 4 CartPoles behind a SlowEnv sleeping 20 ms a step, in one vector
  env (fast and slow envs together, the case partial batches are for); its bound is the sum of each
  half's.

Beside the defaults (one env per worker, decided before the first step and never changed), two rows show what
a user gets by asking: ``in_process=True`` (cheap kinds) and the setting ``envs.placement.advised`` names once
a throwaway vector env at defaults has timed its first steps (the advice; nothing moves by itself).

PufferLib's Python vectorization (``pufferlib.vector.Multiprocessing``, ``pip install pufferlib-core``) runs
beside them where it is installed: one busy worker per core less the one its main process spins on, in
lockstep (``batch_size = N``) and with partial batches (``batch_size = N/2``), its envs wrapped by
``pufferlib.emulation.GymnasiumPufferEnv`` (which autoresets them itself). Its ``autotune`` is not run (it tries
configurations for minutes); the rows say which configuration ran.

The physical bound of each kind is ``min(N / E[wall], cores / E[cpu])`` per env-step, from
one env stepped in this process before the contenders run: the envs always stepping, on every
core. EnvPool's own CartPole is a reference row where ``envpool`` is installed (``pip install
envpool``).

Run: ``python benchmarks/throughput.py`` (about 4 minutes; ``--quick`` for a short run).
Writes ``benchmarks/results/throughput.md`` and ``throughput.png``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import gymnasium as gym
import numpy as np
import tyro
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv
from gymnasium.vector.utils import batch_space

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncvec import AsyncLLMVectorEnv  # noqa: E402  (the repository root goes on sys.path first)
from asyncvec.benchmarks.report import machine_line, markdown_table, new_figure, save_report  # noqa: E402  (after the repository is put on sys.path)
from asyncvec.envs.pixels import make_pixel_env  # noqa: E402  (after the repository is put on sys.path)
from asyncvec.envs.slow import SlowEnv  # noqa: E402  (after the repository is put on sys.path)
from asyncvec.vector.transport import usable_cores  # noqa: E402  (after the repository is put on sys.path)

SYNC, ASYNC = "gymnasium SyncVectorEnv", "gymnasium AsyncVectorEnv"
OURS_STEP, OURS_PARTIAL = "AsyncLLMVectorEnv step()", "AsyncLLMVectorEnv send/recv"
OURS_IN_PROCESS, OURS_ADVISED = "AsyncLLMVectorEnv step() in_process=True", "AsyncLLMVectorEnv step() as advised"
ENVPOOL = "EnvPool (its own CartPole)"


@dataclass
class Args:
    seconds: float = 6.0
    """wall-clock budget per contender and env kind (split into interleaved rounds)"""
    rounds: int = 6
    """interleaved rounds per contender (the table holds the median)"""
    quick: bool = False
    """a short run (1.5 s per contender, 3 rounds)"""
    kinds: tuple[str, ...] = ("classic", "acrobot", "pendulum", "cpu", "sleep", "image", "dict", "mixed")
    """which env kinds to run"""
    out_dir: str | None = None
    """where to write throughput.md/.png (default benchmarks/results)"""


def make_cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def make_acrobot() -> gym.Env:
    return gym.make("Acrobot-v1")


def make_pendulum() -> gym.Env:
    return gym.make("Pendulum-v1")


def make_cpu_env() -> gym.Env:
    return SlowEnv(gym.make("CartPole-v1"), latency_ms=1.0, busy=True)


def make_slow_cartpole(latency_ms: float = 10.0, sigma: float = 1.0) -> gym.Env:
    return SlowEnv(gym.make("CartPole-v1"), latency_ms=latency_ms, distribution="lognormal", sigma=sigma)


def make_image_env() -> gym.Env:
    env = make_pixel_env("pendulum", size=64)
    return gym.wrappers.TransformObservation(env, lambda obs: obs["image"], env.observation_space["image"])


def make_dict_env() -> gym.Env:
    return make_pixel_env("pendulum", size=64)


def make_sleepy_cartpole() -> gym.Env:
    return SlowEnv(gym.make("CartPole-v1"), latency_ms=20.0)


@dataclass(frozen=True)
class Kind:
    title: str
    env_fn: Callable[[], gym.Env]
    num_envs: int
    batch_size: int
    second_half_fn: Callable[[], gym.Env] | None = None  # the second half of the envs, when they differ

    def fns(self) -> list[Callable[[], gym.Env]]:
        half = self.num_envs // 2
        if self.second_half_fn is None:
            return [self.env_fn] * self.num_envs
        return [self.env_fn] * half + [self.second_half_fn] * (self.num_envs - half)


KINDS = {
    "classic": Kind("CartPole-v1", make_cartpole, 8, 4),
    "acrobot": Kind("Acrobot-v1", make_acrobot, 8, 4),
    "pendulum": Kind("Pendulum-v1 (Box actions)", make_pendulum, 8, 4),
    "cpu": Kind("1 ms of CPU a step", make_cpu_env, 8, 4),
    "sleep": Kind("lognormal 10 ms sleeps", partial(make_slow_cartpole, 10.0, 1.0), 16, 8),
    "image": Kind("64x64 RGB image obs", make_image_env, 8, 4),
    "dict": Kind("Dict(image, Text) obs", make_dict_env, 8, 4),
    "mixed": Kind("4 fast + 4 sleeping 20 ms", make_cartpole, 8, 4, make_sleepy_cartpole),
}


def tree_cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process and all its live descendants (Linux ``/proc``).

    Wall-clock rates on a shared, loaded machine depend on how many processes a contender
    runs (the scheduler shares cores per process); CPU seconds per env-step do not.
    """
    pid = os.getpid() if pid is None else pid
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
        children: set[int] = set()
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children.update(int(c) for c in f.read().split())
    except OSError:  # the process ended
        return total
    return total + sum(tree_cpu_seconds(child) for child in children)


class CpuMeter:
    """Accumulates env-steps and the CPU seconds of this process tree spent on them."""

    def __init__(self) -> None:
        self.steps = 0
        self.cpu = 0.0

    def measure(self, run: Callable[[], int]) -> int:
        start = tree_cpu_seconds()
        steps = run()
        self.cpu += tree_cpu_seconds() - start
        self.steps += steps
        return steps

    @property
    def cpu_us_per_step(self) -> float:
        return self.cpu / max(self.steps, 1) * 1e6


class LockstepLoop:
    """Steps ``envs.step`` with random actions; ``run(seconds)`` returns steps/s."""

    def __init__(self, envs) -> None:
        self.envs = envs
        self.meter = CpuMeter()
        envs.reset(seed=0)
        envs.action_space.seed(0)

    def sample(self):
        return self.envs.action_space.sample()

    def run(self, seconds: float) -> float:
        start = time.perf_counter()

        def loop() -> int:
            steps = 0
            num_envs = self.envs.num_envs
            while time.perf_counter() - start < seconds:
                self.envs.step(self.sample())
                steps += num_envs
            return steps

        return self.meter.measure(loop) / (time.perf_counter() - start)

    def close(self) -> None:
        self.envs.close()


class EnvPoolLoop(LockstepLoop):
    """EnvPool's synchronous ``step`` (its action space is a single env's: actions drawn per env)."""

    def __init__(self, envs, num_envs: int) -> None:
        self.num_envs = num_envs
        self.rng = np.random.default_rng(0)
        super().__init__(envs)

    def sample(self):
        return self.rng.integers(0, 2, size=self.num_envs, dtype=np.int32)


class PartialBatchLoop:
    """The send/recv loop: act on whichever ``batch_size`` envs are ready (random actions of any space)."""

    def __init__(self, envs: AsyncLLMVectorEnv) -> None:
        self.envs = envs
        self.meter = CpuMeter()
        self._spaces: dict[int, gym.Space] = {}
        envs.async_reset(seed=0)

    def sample(self, count: int):
        space = self._spaces.get(count)
        if space is None:
            space = self._spaces[count] = batch_space(self.envs.single_action_space, count)
            space.seed(count)
        return space.sample()

    def step_once(self) -> dict:
        """One ``recv`` and the ``send`` that answers it; returns the batch's info."""
        _, _, _, _, info = self.envs.recv(timeout=120)
        ids = info["env_id"]
        self.envs.send(self.sample(len(ids)), ids)
        return info

    def run(self, seconds: float) -> float:
        start = time.perf_counter()

        def loop() -> int:
            steps = 0
            while time.perf_counter() - start < seconds:
                steps += len(self.step_once()["env_id"])
            return steps

        return self.meter.measure(loop) / (time.perf_counter() - start)

    def close(self) -> None:
        while self.envs.in_flight:
            self.envs.recv(timeout=120)
        self.envs.close()


class PufferLoop:
    """PufferLib's ``send``/``recv`` loop over its vector env (random actions for the rows it returns)."""

    def __init__(self, vecenv) -> None:
        self.envs = vecenv
        self.meter = CpuMeter()
        self._spaces: dict[int, gym.Space] = {}
        vecenv.async_reset(seed=0)

    def run(self, seconds: float) -> float:
        start = time.perf_counter()

        def loop() -> int:
            steps = 0
            while time.perf_counter() - start < seconds:
                rows = len(self.envs.recv()[6])
                space = self._spaces.get(rows)
                if space is None:
                    space = self._spaces[rows] = batch_space(self.envs.single_action_space, rows)
                    space.seed(rows)
                self.envs.send(space.sample())
                steps += rows
            return steps

        return self.meter.measure(loop) / (time.perf_counter() - start)

    def close(self) -> None:
        self.envs.close()


def pufferlib_contenders(spec: Kind, cores: int) -> dict[str, Callable]:
    """PufferLib's Multiprocessing at one worker per core, lockstep and partial, where pufferlib is installed."""
    try:
        import pufferlib.emulation
        import pufferlib.vector
    except ImportError:
        return {}
    creators = [partial(pufferlib.emulation.GymnasiumPufferEnv, env_creator=fn) for fn in spec.fns()]
    # One busy worker per core, less the core its spin-waiting main process needs: with as many workers as
    # cores (its docs' advice for a machine the envs have to themselves) it ran about 1,300 steps/s here on every
    # cheap kind, three spinning processes taking turns on 2 cores.
    workers = max(w for w in range(1, max(1, cores - 1) + 1) if spec.num_envs % w == 0)

    def make(batch_size: int):
        return lambda: PufferLoop(
            pufferlib.vector.make(
                creators,
                env_args=[[] for _ in creators],
                env_kwargs=[{} for _ in creators],
                backend=pufferlib.vector.Multiprocessing,
                num_envs=spec.num_envs,
                num_workers=workers,
                batch_size=batch_size,
            )
        )

    loops = {f"PufferLib Multiprocessing ({workers} workers)": make(spec.num_envs)}
    if spec.batch_size % (spec.num_envs // workers) == 0:  # its partial batches are whole workers
        loops[f"PufferLib Multiprocessing ({workers} workers, batch {spec.batch_size})"] = make(spec.batch_size)
    return loops


def physical_bound(env_fn: Callable[[], gym.Env], num_envs: int, cores: int, budget_s: float = 1.0) -> float:
    """``min(N / E[wall], cores / E[cpu])`` env-steps/s from one env stepped here with random actions."""
    env = env_fn()
    env.action_space.seed(0)
    env.reset(seed=0)
    walls, cpus = [], []
    while sum(walls) < budget_s and len(walls) < 5000:
        action = env.action_space.sample()
        wall, cpu = time.perf_counter(), time.process_time()
        _, _, terminated, truncated, _ = env.step(action)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        if terminated or truncated:
            env.reset()
    env.close()
    mean_wall, mean_cpu = statistics.fmean(walls), max(statistics.fmean(cpus), 1e-9)
    return min(num_envs / mean_wall, cores / mean_cpu)


def envpool_cartpole(num_envs: int):
    try:
        import envpool
    except ImportError:
        return None
    return envpool.make("CartPole-v1", env_type="gymnasium", num_envs=num_envs, seed=0)


def advised_setting(fns: list[Callable[[], gym.Env]]) -> dict:
    """What ``envs.placement.advised`` says after a vector env at defaults has timed its first steps."""
    with AsyncLLMVectorEnv(fns) as envs:
        envs.reset(seed=0)
        envs.action_space.seed(0)
        while envs.placement.advice is None:
            envs.step(envs.action_space.sample())
        return dict(envs.placement.advised)


def contenders(kind: str, spec: Kind, cores: int = 2) -> dict[str, Callable]:
    fns = spec.fns()
    loops: dict[str, Callable] = {
        SYNC: lambda: LockstepLoop(SyncVectorEnv(fns)),
        ASYNC: lambda: LockstepLoop(AsyncVectorEnv(fns)),
        OURS_STEP: lambda: LockstepLoop(AsyncLLMVectorEnv(fns)),
        f"{OURS_PARTIAL} (batch {spec.batch_size})": lambda: PartialBatchLoop(
            AsyncLLMVectorEnv(fns, batch_size=spec.batch_size)
        ),
    }
    if kind in ("classic", "acrobot", "pendulum"):
        loops[OURS_IN_PROCESS] = lambda: LockstepLoop(AsyncLLMVectorEnv(fns, in_process=True))
    advised = advised_setting(fns)
    if advised and advised != {"in_process": True}:
        loops[f"{OURS_ADVISED} ({', '.join(f'{k}={v}' for k, v in advised.items())})"] = lambda: LockstepLoop(
            AsyncLLMVectorEnv(fns, **advised)
        )
    if kind == "classic" and envpool_cartpole(1) is not None:
        loops[ENVPOOL] = lambda: EnvPoolLoop(envpool_cartpole(spec.num_envs), spec.num_envs)
    if kind in ("classic", "acrobot", "pendulum", "cpu", "sleep", "mixed"):  # its emulation has no Text observations
        loops.update(pufferlib_contenders(spec, cores))
    return loops


def run_kind(kind: str, args: Args, cores: int) -> tuple[float, list[tuple[str, float, float, str]]]:
    """Measures every contender in interleaved rounds.

    Returns the bound and ``(label, median steps/s, CPU us/step, placement)`` per contender."""
    spec = KINDS[kind]
    seconds = 1.5 if args.quick else args.seconds
    rounds = 3 if args.quick else args.rounds
    budget = 0.3 if args.quick else 1.0
    if spec.second_half_fn is None:
        bound = physical_bound(spec.env_fn, spec.num_envs, cores, budget)
    else:
        half = spec.num_envs // 2
        bound = physical_bound(spec.env_fn, half, cores, budget)
        bound += physical_bound(spec.second_half_fn, spec.num_envs - half, cores, budget)
    loops = {label: make() for label, make in contenders(kind, spec, cores).items()}
    samples: dict[str, list[float]] = {label: [] for label in loops}
    try:
        for loop in loops.values():
            loop.run(0.2)  # warm up
            loop.meter = CpuMeter()
        for _ in range(rounds):
            for label, loop in loops.items():
                samples[label].append(loop.run(seconds / rounds))
    finally:
        for loop in loops.values():
            loop.close()
    rows = []
    for label, values in samples.items():
        placement = getattr(loops[label].envs, "placement", None)
        where = (
            "-"
            if placement is None
            else ("in process" if placement.in_process else f"{placement.num_workers} x {placement.envs_per_worker}")
        )
        rows.append((label, float(np.median(values)), loops[label].meter.cpu_us_per_step, where))
    print(f"\n### {spec.title}: {spec.num_envs} envs, physical bound {bound:,.0f} steps/s")
    print(f"median of {rounds} interleaved rounds of {seconds / rounds:.2f} s each; {machine_line()}")
    return bound, rows


def main(args: Args) -> dict[str, tuple[float, list[tuple[str, float, float, str]]]]:
    cores = usable_cores()
    results = {}
    headers = [
        "env kind",
        "contender",
        "placement",
        "env-steps/s",
        "vs best gymnasium",
        "vs gymnasium Async",
        "vs bound",
        "CPU us / env-step",
    ]
    table_rows = []
    for kind in args.kinds:
        bound, rows = run_kind(kind, args, cores)
        results[kind] = (bound, rows)
        rates = {label: rate for label, rate, _, _ in rows}
        best = max(rates[SYNC], rates[ASYNC])
        kind_rows = [
            [
                f"{KINDS[kind].title} x{KINDS[kind].num_envs}",
                label,
                where,
                rate,
                f"{rate / best:.2f}x",
                f"{rate / rates[ASYNC]:.2f}x",
                f"{rate / bound:.2f}",
                cpu,
            ]
            for label, rate, cpu, where in rows
        ]
        print(markdown_table(headers, kind_rows))
        table_rows += kind_rows
    table = markdown_table(headers, table_rows)
    figure, axes = new_figure(ncols=len(results), width=4.2, height=4.0)
    for ax, (kind, (bound, rows)) in zip(np.ravel(axes), results.items()):
        best = max(rate for label, rate, _, _ in rows if label in (SYNC, ASYNC))
        labels = [label.replace("AsyncLLMVectorEnv ", "ours ").replace("gymnasium ", "gym ") for label, _, _, _ in rows]
        ax.barh(labels[::-1], [rate / best for _, rate, _, _ in rows][::-1], color="tab:blue")
        ax.axvline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.axvline(bound / best, color="tab:red", linestyle=":", linewidth=1, label="physical bound")
        ax.set_xlabel("env-steps/s / best gymnasium")
        ax.set_title(f"{KINDS[kind].title} x{KINDS[kind].num_envs}", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlim(0, max(2.5, min(bound / best * 1.1, 8.0)))
    figure.tight_layout()
    command = " ".join(["python benchmarks/throughput.py", *sys.argv[1:]])
    save_report("throughput", table, figure, out_dir=args.out_dir, command=command)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
