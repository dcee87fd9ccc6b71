"""Image observations in the replay buffer: bytes per sample and speed, compressed vs not.

A `ReplayBuffer` over ``Dict(image=Box(0, 255, (S, S, 3), uint8), instruction=Text)`` is filled
with frames of two kinds and read back:

* ``rendered``: frames like a rendered control task (CartPole drawn with numpy: a flat
  background, a track, a cart and a pole at the state's angle, 1-2 levels of sensor noise in one
  channel);
* ``camera``: a smooth colour gradient with a moving blob and +-8 levels of noise in every
  channel (a harder, camera-like case).

For each codec (none, zlib level 1 and 6 lossless, quantize 5 bits and JPEG q90 lossy) it
measures the image bytes per stored transition (obs and next_obs; in RAM: ``nbytes``, blobs plus
Python's object overhead; saved: the files ``save()`` writes; live on disk: the allocated
blocks of a ``storage_dir``), ``add`` throughput (transitions/s, ``num_envs`` per add),
``sample`` throughput (transitions/s in batches of ``batch_size``, decoding included) and the
largest pixel error. Rates are medians over ``repeats`` runs of the thread's CPU time.

Run:
    python benchmarks/buffer_images.py           # about 2 CPU minutes
    python benchmarks/buffer_images.py --quick   # a few seconds
"""

from __future__ import annotations

import statistics
import string
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import tyro
from gymnasium import spaces

from asyncvec.benchmarks.report import markdown_table, new_figure, save_report
from asyncvec.buffers import ImageCompression, ReplayBuffer


@dataclass
class Args:
    """Compressed image observations in the replay buffer."""

    quick: bool = False
    """fewer transitions and repeats (a smoke run)"""
    image_size: int = 64
    """side of the square RGB frames"""
    capacity: int = 4096
    """transitions stored (the buffer is filled once)"""
    num_envs: int = 8
    """transitions per add call"""
    batch_size: int = 256
    """transitions per sample call"""
    repeats: int = 3
    """timed runs per measurement; medians are reported"""
    seed: int = 0
    """seed of the frames and of sampling"""
    out_dir: str | None = None
    """where buffer_images.md / .png go (default benchmarks/results)"""


CODECS: dict[str, ImageCompression | None] = {
    "none": None,
    "zlib-1 (lossless)": ImageCompression("zlib", level=1),
    "zlib-6 (lossless)": ImageCompression("zlib", level=6),
    "quantize-5 (lossy)": ImageCompression("quantize", bits=5),
    "jpeg-90 (lossy)": ImageCompression("jpeg", quality=90),
}


def rendered_frames(n: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """CartPole-like frames: white background, a track, a cart and a pole at a random angle."""
    frames = np.full((n, size, size, 3), 255, np.uint8)
    rows, cols = np.mgrid[0:size, 0:size]
    track = int(size * 0.7)
    frames[:, track : track + 1] = 0
    for i in range(n):
        cart = int(rng.integers(size // 8, size - size // 8))
        frames[i, track - size // 16 : track + size // 32, cart - size // 10 : cart + size // 10] = 0
        angle = rng.uniform(-0.3, 0.3)
        top = (track - size // 16 - size * 0.45 * np.cos(angle), cart + size * 0.45 * np.sin(angle))
        base = (track - size // 16, cart)
        # the pole: pixels within 1.5 px of the segment base-top
        d = np.array(top) - np.array(base)
        t = np.clip(((rows - base[0]) * d[0] + (cols - base[1]) * d[1]) / (d @ d), 0, 1)
        dist = np.hypot(rows - (base[0] + t * d[0]), cols - (base[1] + t * d[1]))
        frames[i][dist < 1.5] = (202, 152, 101)
    frames[..., 2] -= rng.integers(0, 2, (n, size, size), dtype=np.uint8)  # a little sensor noise
    return frames


def camera_frames(n: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """A smooth gradient, a moving blob and +-8 levels of noise in every channel."""
    rows, cols = np.mgrid[0:size, 0:size] / size
    base = np.stack([80 + 100 * rows, 60 + 120 * cols, 140 - 60 * rows * cols], -1)
    frames = np.empty((n, size, size, 3), np.uint8)
    for i in range(n):
        cy, cx = rng.uniform(0.2, 0.8, 2)
        blob = 90 * np.exp(-((rows - cy) ** 2 + (cols - cx) ** 2) / 0.01)[..., None]
        noise = rng.normal(0, 4, (size, size, 3))
        frames[i] = np.clip(base + blob + noise, 0, 255).astype(np.uint8)
    return frames


def observation_space(size: int) -> spaces.Dict:
    return spaces.Dict(
        {
            "image": spaces.Box(0, 255, (size, size, 3), np.uint8),
            "instruction": spaces.Text(32, charset=string.ascii_lowercase + " "),
        }
    )


def image_bytes(buffer: ReplayBuffer) -> int:
    """Bytes of the image columns only (obs and next_obs; the image is the Dict's first leaf)."""
    sizes = buffer.column_nbytes()
    return sizes["obs.0"] + sizes["next_obs.0"]


def directory_bytes(path: Path, allocated: bool) -> int:
    files = [f for f in path.iterdir() if f.is_file() and (f.name.startswith("obs") or f.name.startswith("next_obs"))]
    return sum(f.stat().st_blocks * 512 if allocated else f.stat().st_size for f in files)


def cpu_seconds(fn) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def measure(args: Args, kind: str, frames: np.ndarray, name: str, codec: ImageCompression | None) -> dict:
    space = observation_space(args.image_size)
    n, adds = args.num_envs, args.capacity // args.num_envs
    actions, rewards = np.zeros(n, np.int64), np.ones(n, np.float32)
    flags = np.zeros(n, bool)
    instructions = ["balance the pole"] * n

    def obs_of(step: int) -> dict:
        start = (step * n) % (len(frames) - n)
        return {"image": frames[start : start + n], "instruction": instructions}

    add_rates, sample_rates = [], []
    buffer = None
    for repeat in range(args.repeats):
        buffer = ReplayBuffer(args.capacity, space, spaces.Discrete(2), image_compression=codec, seed=args.seed)
        observations = [obs_of(step) for step in range(adds + 1)]

        def fill(buffer=buffer, observations=observations) -> None:
            for step in range(adds):
                buffer.add(observations[step], actions, rewards, observations[step + 1], flags, flags,
                           policy_version=step)  # fmt: skip

        add_rates.append(adds * n / cpu_seconds(fill))
        draws = max(4, args.capacity // args.batch_size // 2)
        sample_rates.append(
            draws * args.batch_size
            / cpu_seconds(lambda buffer=buffer: [buffer.sample(args.batch_size, adds) for _ in range(draws)])
        )  # fmt: skip
    assert buffer is not None
    ram = image_bytes(buffer) / len(buffer)
    batch = buffer.gather(np.arange(args.capacity), adds)
    serials = np.arange(args.capacity)  # slot s holds serial s (filled exactly once)
    original = np.concatenate([obs_of(step)["image"] for step in range(adds)])[serials]
    error = int(np.abs(batch.obs["image"].astype(int) - original.astype(int)).max())
    with tempfile.TemporaryDirectory() as scratch:
        saved = Path(scratch) / "saved"
        buffer.save(saved)
        saved_bytes = directory_bytes(saved, allocated=False) / len(buffer)
        live = Path(scratch) / "live"
        on_disk = ReplayBuffer(args.capacity, space, spaces.Discrete(2), image_compression=codec, storage_dir=live,
                               commit_every=0)  # fmt: skip
        for step in range(adds):
            on_disk.add(obs_of(step), actions, rewards, obs_of(step + 1), flags, flags, policy_version=step)
        on_disk.close()
        live_bytes = directory_bytes(live, allocated=True) / args.capacity
    return {
        "kind": kind,
        "codec": name,
        "ram": ram,
        "saved": saved_bytes,
        "live": live_bytes,
        "add": statistics.median(add_rates),
        "sample": statistics.median(sample_rates),
        "error": error,
    }


def main(args: Args) -> list[dict]:
    if args.quick:
        args.capacity, args.repeats = min(args.capacity, 512), min(args.repeats, 2)
    rng = np.random.default_rng(args.seed)
    pool = args.capacity + 2 * args.num_envs
    kinds = {
        "rendered": rendered_frames(pool, args.image_size, rng),
        "camera": camera_frames(pool, args.image_size, rng),
    }
    results = []
    for kind, frames in kinds.items():
        for name, codec in CODECS.items():
            results.append(measure(args, kind, frames, name, codec))
            row = results[-1]
            print(f"{kind:9s} {name:20s} {row['ram']:9.0f} B/sample RAM  add {row['add']:9.0f}/s  "
                  f"sample {row['sample']:9.0f}/s  error {row['error']}", flush=True)  # fmt: skip
    rows = []
    for row in results:
        base = next(r for r in results if r["kind"] == row["kind"] and r["codec"] == "none")
        rows.append(
            [
                row["kind"],
                row["codec"],
                round(row["ram"]),
                f"{base['ram'] / row['ram']:.1f}x",
                round(row["saved"]),
                round(row["live"]),
                round(row["add"]),
                round(row["sample"]),
                f"{row['sample'] / base['sample']:.2f}",
                row["error"],
            ]
        )
    headers = [
        "frames",
        "codec",
        "image B/transition (RAM)",
        "smaller",
        "B/transition saved",
        "B/transition live on disk",
        "add /s",
        "sample /s",
        "sample vs none",
        "max pixel error",
    ]
    table = markdown_table(headers, rows)
    figure, axes = new_figure(ncols=2, width=5.5, height=4.0)
    for axis, kind in zip(axes[0], kinds):
        subset = [r for r in results if r["kind"] == kind]
        for row in subset:
            axis.scatter(row["ram"], row["sample"], s=40)
            axis.annotate(row["codec"], (row["ram"], row["sample"]), fontsize=7, xytext=(4, 4),
                          textcoords="offset points")  # fmt: skip
        axis.set_xscale("log")
        axis.set_xlabel("image bytes per transition in RAM (obs + next_obs)")
        axis.set_ylabel(f"sample throughput, transitions/s (batch {args.batch_size})")
        axis.set_title(f"{kind} {args.image_size}x{args.image_size}x3 frames")
        axis.grid(alpha=0.3)
    command = "python benchmarks/buffer_images.py" + (" --quick" if args.quick else "")
    notes = (
        f"capacity {args.capacity}, {args.num_envs} transitions per add, batches of {args.batch_size}; rates are "
        f"medians of {args.repeats} runs (thread CPU time). 'saved': files written by save() (blobs packed back "
        "to back); 'live on disk': allocated blocks of a storage_dir (blobs appended to segment files, an eighth "
        "of the capacity each; retired segments deleted)."
    )
    paths = save_report("buffer_images", table, figure, out_dir=args.out_dir, command=command, notes=notes)
    print(table)
    print("wrote", *paths)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
