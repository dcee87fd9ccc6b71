"""Image observations stored compressed in ReplayBuffer and RolloutStore, in RAM and on disk."""

from __future__ import annotations

import string

import numpy as np
import pytest
from gymnasium import spaces

from asyncvec.buffers import ImageCompression, ReplayBuffer, RolloutStore, is_image_space

SIZE = 48
IMAGE = spaces.Box(0, 255, (SIZE, SIZE, 3), np.uint8)
OBS_SPACE = spaces.Dict({"image": IMAGE, "instruction": spaces.Text(24, charset=string.ascii_lowercase + " ")})
LOSSY_ERROR = {"quantize": 4, "jpeg": 40}  # bits=5: half a step of 8; JPEG q90 4:4:4 on rendered frames


def rendered(n: int, rng: np.random.Generator) -> np.ndarray:
    """Frames like a rendered control task: a flat background, a moving box, a little noise."""
    frames = np.full((n, SIZE, SIZE, 3), (30, 40, 60), np.uint8)
    for i, x in enumerate(rng.integers(0, SIZE - 12, n)):
        frames[i, 20:32, x : x + 12] = (220, 120, 40)
        frames[i, 32:34, :] = (90, 90, 90)
    frames[..., 2] += rng.integers(0, 3, (n, SIZE, SIZE), dtype=np.uint8)
    return frames


def fill(buffer: ReplayBuffer, steps: int, n: int = 4, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    added = []
    for step in range(steps):
        obs = {"image": rendered(n, rng), "instruction": ["push the box left"] * n}
        nxt = {"image": rendered(n, rng), "instruction": ["push the box left"] * n}
        buffer.add(obs, np.zeros(n, np.int64), np.ones(n, np.float32), nxt, np.zeros(n, bool), np.zeros(n, bool),
                   policy_version=step, episode_id=np.arange(n) + step * n)  # fmt: skip
        added.append((obs["image"], nxt["image"]))
    return added


def by_episode(added: list) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    return {k * len(obs) + i: (obs[i], nxt[i]) for k, (obs, nxt) in enumerate(added) for i in range(len(obs))}


def test_image_leaves_are_detected():
    assert is_image_space(IMAGE) and is_image_space(spaces.Box(0, 255, (84, 84), np.uint8))
    assert not is_image_space(spaces.Box(0, 255, (4, 4, 3), np.uint8))  # too small to be worth a blob
    assert not is_image_space(spaces.Box(0, 1, (SIZE, SIZE, 3), np.float32))
    assert not is_image_space(spaces.Box(0, 255, (SIZE, SIZE, 7), np.uint8))


@pytest.mark.parametrize("on_disk", [False, True])
@pytest.mark.parametrize("method", [None, "zlib", "quantize", "jpeg"])
def test_replay_round_trip(tmp_path, method, on_disk):
    """Lossless zlib gives the images back bit for bit; lossy codecs stay within their error;
    every other field is what it is without compression."""
    storage = tmp_path / "live" if on_disk else None
    buffer = ReplayBuffer(64, OBS_SPACE, spaces.Discrete(2), image_compression=method, storage_dir=storage, seed=0)
    added = by_episode(fill(buffer, 20))  # 80 adds into 64 slots: the ring wraps
    batch = buffer.sample(32, current_version=19)
    assert batch.obs["image"].dtype == np.uint8 and batch.obs["image"].shape == (32, SIZE, SIZE, 3)
    assert list(batch.obs["instruction"]) == ["push the box left"] * 32
    expected_obs = np.stack([added[e][0] for e in batch.episode_id])
    expected_next = np.stack([added[e][1] for e in batch.episode_id])
    for got, expected in ((batch.obs["image"], expected_obs), (batch.next_obs["image"], expected_next)):
        error = np.abs(got.astype(int) - expected.astype(int)).max()
        assert error <= LOSSY_ERROR.get(method, 0), (method, error)
    assert np.array_equal(batch.policy_version, batch.episode_id // 4)
    if method is not None:
        assert buffer.nbytes < 0.5 * ReplayBuffer(64, OBS_SPACE, spaces.Discrete(2)).nbytes or on_disk
    # persistence: save() packs the blobs; load() and open() read them back unchanged
    buffer.save(tmp_path / "saved")
    slots = batch.indices
    before = buffer.gather(slots, 19).obs["image"]
    buffer.close()
    for reopened in (ReplayBuffer.load(tmp_path / "saved"), ReplayBuffer.open(tmp_path / "saved")):
        assert reopened.image_compression == (None if method is None else ImageCompression(method))
        assert len(reopened) == 64
        np.testing.assert_array_equal(reopened.gather(slots, 19).obs["image"], before)
        reopened.close()
    if on_disk:
        live = ReplayBuffer.open(storage)
        np.testing.assert_array_equal(live.gather(slots, 19).obs["image"], before)
        live.close()


def test_compression_makes_samples_smaller_in_ram_and_in_a_saved_directory(tmp_path):
    plain = ReplayBuffer(256, OBS_SPACE, spaces.Discrete(2))
    packed = ReplayBuffer(256, OBS_SPACE, spaces.Discrete(2), image_compression=True)
    for buffer in (plain, packed):
        fill(buffer, 64)
    assert packed.nbytes < plain.nbytes / 4, (packed.nbytes, plain.nbytes)
    plain.save(tmp_path / "plain")
    packed.save(tmp_path / "packed")
    size = {name: sum(f.stat().st_size for f in (tmp_path / name).iterdir()) for name in ("plain", "packed")}
    assert size["packed"] < size["plain"] / 4, size


def test_noise_is_stored_raw_and_never_grows_beyond_a_byte():
    codec = ImageCompression("zlib", level=9)
    noise = np.random.default_rng(0).integers(0, 256, (3, SIZE, SIZE, 3), dtype=np.uint8)
    blobs = codec.compress(noise)
    assert all(len(blob) == noise[0].nbytes + 1 and blob[0] == 0 for blob in blobs)
    np.testing.assert_array_equal(codec.decompress(blobs, noise.shape[1:]), noise)


def test_rollout_store_round_trip():
    store = RolloutStore(3, 2, OBS_SPACE, spaces.Discrete(2), image_compression="zlib")
    plain = RolloutStore(3, 2, OBS_SPACE, spaces.Discrete(2))
    rng = np.random.default_rng(1)
    images = [rendered(2, rng) for _ in range(4)]
    for t in range(3):
        for s in (store, plain):
            obs = {"image": images[t], "instruction": ["go", "stop"]}
            nxt = {"image": images[t + 1], "instruction": ["go", "stop"]}
            s.add(obs, np.zeros(2, np.int64), np.ones(2), nxt if t == 2 else None, np.zeros(2, bool),
                  np.zeros(2, bool), 0, behavior_logp=np.zeros(2), env_id=[0, 1])  # fmt: skip
    assert store.nbytes < plain.nbytes / 3
    segment, reference = store.get(timeout=0), plain.get(timeout=0)
    np.testing.assert_array_equal(segment.obs["image"], np.stack(images[:3]))
    np.testing.assert_array_equal(segment.obs["image"], reference.obs["image"])
    np.testing.assert_array_equal(segment.last_obs["image"], images[3])
    np.testing.assert_array_equal(segment.next_obs["image"], reference.next_obs["image"])
    assert list(segment.obs["instruction"][:, 1]) == ["stop"] * 3


def test_plain_spaces_are_untouched_and_bad_input_is_named(tmp_path):
    buffer = ReplayBuffer(8, spaces.Box(-1, 1, (3,)), spaces.Discrete(2), image_compression=True)
    assert not buffer._rows.obs.compressed  # no image leaf: the plain fast path stays
    image_buffer = ReplayBuffer(8, IMAGE, spaces.Discrete(2), image_compression=True)
    with pytest.raises(ValueError, match=r"obs: expected dtype uint8"):
        image_buffer.add(np.zeros((2, SIZE, SIZE, 3), np.float32), np.zeros(2, np.int64), np.ones(2),
                         np.zeros((2, SIZE, SIZE, 3), np.uint8), np.zeros(2, bool), np.zeros(2, bool), 0)  # fmt: skip
    with pytest.raises(ValueError, match=r"next_obs: expected a batch of shape \(2, 48, 48, 3\)"):
        image_buffer.add(np.zeros((2, SIZE, SIZE, 3), np.uint8), np.zeros(2, np.int64), np.ones(2),
                         np.zeros((2, 8, 8, 3), np.uint8), np.zeros(2, bool), np.zeros(2, bool), 0)  # fmt: skip
    with pytest.raises(ValueError, match="method must be one of"):
        ReplayBuffer(8, IMAGE, spaces.Discrete(2), image_compression="png")
    with pytest.raises(ValueError, match="bits must be an int in 1..7"):
        ImageCompression("quantize", bits=8)
    # a directory keeps its codec: reopening it with another layout is refused, naming the key
    ReplayBuffer(8, IMAGE, spaces.Discrete(2), image_compression=True, storage_dir=tmp_path).close()
    with pytest.raises(ValueError, match="image_compression"):
        ReplayBuffer(8, IMAGE, spaces.Discrete(2), image_compression="quantize", storage_dir=tmp_path)


def test_on_disk_blobs_survive_sigkill_and_old_segments_are_deleted(tmp_path):
    """A writer killed with SIGKILL loses nothing it committed; the ring's retired blobs leave the disk."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        from test_buffers_images import OBS_SPACE, fill
        from gymnasium import spaces
        from asyncvec.buffers import ReplayBuffer
        buffer = ReplayBuffer(64, OBS_SPACE, spaces.Discrete(2), image_compression=True,
                              storage_dir={str(tmp_path / "live")!r}, commit_every=1)
        fill(buffer, 50)  # 200 transitions through 64 slots: the ring wraps three times
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True, text=True)
    assert result.returncode == -9, result.stderr
    added = by_episode(fill(ReplayBuffer(256, OBS_SPACE, spaces.Discrete(2)), 50))  # the same frames (seed 0)
    buffer = ReplayBuffer.open(tmp_path / "live")
    assert len(buffer) == 64 and buffer.num_added == 200
    batch = buffer.gather(np.arange(64), 49)
    np.testing.assert_array_equal(batch.obs["image"], np.stack([added[e][0] for e in batch.episode_id]))
    np.testing.assert_array_equal(batch.next_obs["image"], np.stack([added[e][1] for e in batch.episode_id]))
    assert sorted(batch.episode_id.tolist()) == list(range(136, 200))
    segments = sorted((tmp_path / "live").glob("obs.0.seg*"))
    assert 8 <= len(segments) <= 9  # 64 live samples in segments of 8, plus the one being filled
    blob_bytes = sum(path.stat().st_size for path in segments)
    assert blob_bytes < 64 * IMAGE.shape[0] * IMAGE.shape[1] * 3 / 3  # compressed, and nothing retired kept
    buffer.close()
