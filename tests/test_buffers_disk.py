"""ReplayBuffer on disk: reopening, layout checks, and surviving SIGKILL mid-write."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import string
import time
from pathlib import Path

import numpy as np
import pytest
from gymnasium import spaces

from asyncvec.buffers import ReplayBuffer, StorageDirInUseError

OBS_SPACE = spaces.Dict(
    {"x": spaces.Box(-np.inf, np.inf, (3,), np.float64), "text": spaces.Text(8, charset=string.digits)}
)
ACTION_SPACE = spaces.Discrete(3)
CAPACITY = 64


def add_serials(buffer: ReplayBuffer, first: int, n: int) -> None:
    """Transitions whose every field is derived from a unique serial number."""
    serials = np.arange(first, first + n)
    obs = {"x": np.repeat(serials[:, None], 3, axis=1).astype(np.float64), "text": [str(s) for s in serials]}
    buffer.add(
        obs,
        serials % 3,
        serials.astype(np.float32),
        obs,
        serials % 7 == 0,
        np.zeros(n, bool),
        policy_version=serials // 10,
        episode_id=serials,
        fallback=serials % 5 == 0,
    )


def assert_holds_exactly(buffer: ReplayBuffer, first: int, end: int) -> None:
    """The buffer holds serials first..end-1, each with all its fields intact."""
    assert len(buffer) == end - first
    if end == first:
        return
    batch = buffer.sample(len(buffer), current_version=10**6, exclude_fallback=False)
    order = np.argsort(batch.episode_id)
    serials = batch.episode_id[order]
    np.testing.assert_array_equal(serials, np.arange(first, end))
    np.testing.assert_array_equal(batch.obs["x"][order], np.repeat(serials[:, None], 3, axis=1))
    assert batch.obs["text"][order].tolist() == [str(s) for s in serials]
    np.testing.assert_array_equal(batch.reward[order], serials)
    np.testing.assert_array_equal(batch.action[order], serials % 3)
    np.testing.assert_array_equal(batch.policy_version[order], serials // 10)
    np.testing.assert_array_equal(batch.terminated[order], serials % 7 == 0)
    np.testing.assert_array_equal(batch.fallback[order], serials % 5 == 0)
    assert buffer.version_range() == (first // 10, (end - 1) // 10)


def test_storage_dir_reopens_with_every_committed_sample(tmp_path: Path) -> None:
    with ReplayBuffer(CAPACITY, OBS_SPACE, ACTION_SPACE, storage_dir=tmp_path) as buffer:
        add_serials(buffer, 0, 50)
        add_serials(buffer, 50, 30)  # wraps around
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".npy")) == [
        "commit.bin",
        "lock",
        "meta.json",
        "spaces.pkl",
    ]
    with ReplayBuffer(CAPACITY, OBS_SPACE, ACTION_SPACE, storage_dir=tmp_path) as buffer:
        assert buffer.num_added == 80
        assert_holds_exactly(buffer, 80 - CAPACITY, 80)
        add_serials(buffer, 80, 5)
    reopened = ReplayBuffer.open(tmp_path)
    assert_holds_exactly(reopened, 85 - CAPACITY, 85)
    reopened.close()


def _commit_ten_then_add_ten(directory: str, done, prioritized: bool) -> None:
    """Child process: commit 10 samples, add 10 more without committing, wait to be killed."""
    buffer = ReplayBuffer(
        CAPACITY, OBS_SPACE, ACTION_SPACE, storage_dir=directory, commit_every=0, prioritized=prioritized
    )
    add_serials(buffer, 0, 10)
    buffer.commit()
    add_serials(buffer, 10, 10)
    done.set()
    time.sleep(120)


@pytest.mark.usefixtures("no_leftover_children")
@pytest.mark.parametrize("prioritized", [False, True])
def test_manual_commits_expose_only_committed_samples(tmp_path: Path, prioritized: bool) -> None:
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Event()
    child = ctx.Process(target=_commit_ten_then_add_ten, args=(str(tmp_path), done, prioritized))
    child.start()
    try:
        assert done.wait(timeout=90), "child never finished writing"
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=30)
    finally:
        if child.is_alive():
            child.kill()
            child.join(timeout=10)
    with ReplayBuffer.open(tmp_path) as buffer:
        assert buffer.num_added == 10 and buffer.prioritized == prioritized
        if not prioritized:
            assert_holds_exactly(buffer, 0, 10)
        else:  # uncommitted slots must not be drawn by their leftover priorities
            batches = [buffer.sample(10, 10**6, exclude_fallback=False) for _ in range(50)]
            drawn = np.concatenate([batch.episode_id for batch in batches])
            assert len(buffer) == 10 and np.array_equal(np.unique(drawn), np.arange(10))
            assert all(np.array_equal(batch.reward, batch.episode_id) for batch in batches)


def test_a_directory_is_locked_to_one_open_buffer(tmp_path: Path) -> None:
    buffer = ReplayBuffer(CAPACITY, OBS_SPACE, ACTION_SPACE, storage_dir=tmp_path)
    with pytest.raises(StorageDirInUseError, match="already open"):
        ReplayBuffer(CAPACITY, OBS_SPACE, ACTION_SPACE, storage_dir=tmp_path)
    assert issubclass(StorageDirInUseError, RuntimeError)  # what it raised before it was typed
    buffer.close()
    ReplayBuffer(CAPACITY, OBS_SPACE, ACTION_SPACE, storage_dir=tmp_path).close()


@pytest.mark.parametrize(
    ("capacity", "observation_space", "prioritized", "match"),
    [
        (CAPACITY + 1, OBS_SPACE, False, "capacity=64"),
        (CAPACITY, spaces.Box(0, 1, (3,)), False, "columns="),
        (CAPACITY, OBS_SPACE, True, "prioritized=False"),
    ],
)
def test_reopening_with_another_layout_is_refused(
    tmp_path: Path, capacity: int, observation_space: spaces.Space, prioritized: bool, match: str
) -> None:
    ReplayBuffer(CAPACITY, OBS_SPACE, ACTION_SPACE, storage_dir=tmp_path).close()
    with pytest.raises(ValueError, match=match):
        ReplayBuffer(capacity, observation_space, ACTION_SPACE, storage_dir=tmp_path, prioritized=prioritized)
    ReplayBuffer(CAPACITY, OBS_SPACE, ACTION_SPACE, storage_dir=tmp_path).close()  # lock released


def test_open_and_load_refuse_a_directory_without_a_buffer(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a saved ReplayBuffer"):
        ReplayBuffer.open(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a saved ReplayBuffer"):
        ReplayBuffer.load(tmp_path)


def _write_forever(directory: str, committed, batch_sizes: list[int]) -> None:
    """Child process: append serial-numbered batches until killed."""
    buffer = ReplayBuffer(CAPACITY, OBS_SPACE, ACTION_SPACE, storage_dir=directory, commit_every=1)
    serial = buffer.num_added
    committed.value = serial
    step = 0
    while True:
        n = batch_sizes[step % len(batch_sizes)]
        add_serials(buffer, serial, n)
        serial += n
        step += 1
        committed.value = serial  # add() returned: this batch is committed


@pytest.mark.usefixtures("no_leftover_children")
@pytest.mark.parametrize("rounds", [3])
def test_sigkilled_writer_loses_no_committed_sample(tmp_path: Path, rounds: int) -> None:
    ctx = multiprocessing.get_context("spawn")
    # no lock: the writer is SIGKILLed at any moment, also while it would hold a Value's lock (every later read of
    # the value then waited forever: a loaded make test timed out here); one aligned 8-byte store is atomic
    committed = ctx.Value("q", -1, lock=False)
    last_seen = 0
    rng = np.random.default_rng(0)
    for round_ in range(rounds):
        target = last_seen + 200 + int(rng.integers(0, 200))
        child = ctx.Process(target=_write_forever, args=(str(tmp_path), committed, [1, 7, 3, 64, 100, 2]))
        child.start()
        try:
            deadline = time.monotonic() + 90
            while committed.value < target:
                assert child.is_alive(), f"writer died with exit code {child.exitcode}"
                assert time.monotonic() < deadline, "writer made no progress"
                time.sleep(0.001)
            os.kill(child.pid, signal.SIGKILL)
            child.join(timeout=30)
            assert child.exitcode == -signal.SIGKILL
        finally:
            if child.is_alive():
                child.kill()
                child.join(timeout=10)
        last_seen = committed.value  # every add that returned before the kill
        buffer = ReplayBuffer.open(tmp_path)
        try:
            # The kill may land after a commit but before the counter update: at most one
            # batch (100 rows) more than reported, never less.
            assert last_seen <= buffer.num_added <= last_seen + 100, (round_, last_seen, buffer.num_added)
            # A kill inside an add that evicts old samples may take those (at most one batch of
            # the oldest) with it; every sample that is there is intact and the range is
            # contiguous up to the newest committed one.
            full = min(CAPACITY, buffer.num_added)
            assert full - 100 <= len(buffer) <= full
            assert_holds_exactly(buffer, buffer.num_added - len(buffer), buffer.num_added)
            last_seen = buffer.num_added
        finally:
            buffer.close()


def test_fsync_mode_and_saving_a_disk_buffer(tmp_path: Path) -> None:
    with ReplayBuffer(
        CAPACITY, OBS_SPACE, ACTION_SPACE, storage_dir=tmp_path / "a", fsync=True, commit_every=2
    ) as buffer:
        add_serials(buffer, 0, 3)
        add_serials(buffer, 3, 3)  # second add: committed with msync + fsync
        add_serials(buffer, 6, 3)  # not committed yet
        buffer.save(tmp_path / "a")  # saving to its own directory commits
        buffer.save(tmp_path / "b")  # a copy elsewhere
    with ReplayBuffer.open(tmp_path / "a") as reopened:
        assert_holds_exactly(reopened, 0, 9)
    assert_holds_exactly(ReplayBuffer.load(tmp_path / "b"), 0, 9)


def test_a_torn_commit_record_falls_back_to_the_previous_commit(tmp_path: Path) -> None:
    from asyncvec.buffers._disk import CommitLog

    log = CommitLog(tmp_path / "commit.bin")
    assert log.read() is None
    log.write(0, 10, 1.0, fsync=False)
    log.write(2, 12, 3.0, fsync=True)
    assert log.read() == (2, 2, 12, 3.0)
    log.close()
    # Tear the newest record (slot seq % 2 == 0) as a kill mid-write would.
    raw = bytearray((tmp_path / "commit.bin").read_bytes())
    raw[10] ^= 0xFF
    (tmp_path / "commit.bin").write_bytes(bytes(raw))
    reopened = CommitLog(tmp_path / "commit.bin")
    assert reopened.read() == (1, 0, 10, 1.0)
    reopened.write(5, 15, 1.0, fsync=False)  # continues after the intact record
    assert reopened.read() == (2, 5, 15, 1.0)
    reopened.close()


def test_a_commit_covers_only_rows_whose_priorities_are_written(tmp_path: Path) -> None:
    """A commit record makes rows survive a crash: their priorities must be on disk by then (else they come back
    with priority 0 and are never drawn)."""
    with ReplayBuffer(
        CAPACITY, OBS_SPACE, ACTION_SPACE, storage_dir=tmp_path, prioritized=True, commit_every=1
    ) as buffer:
        rows, priorities_at_commit = buffer._rows, []
        commit = rows.commit

        def commit_and_record() -> None:
            priorities_at_commit.append(rows.columns["priority"][: rows.added].copy())
            commit()

        rows.commit = commit_and_record
        add_serials(buffer, 0, 12)
    assert len(priorities_at_commit) >= 2 and all((p > 0).all() for p in priorities_at_commit)


def test_a_saved_buffer_keeps_the_format_1_columns(tmp_path: Path) -> None:
    """The columns come from the fields of `Transitions`; they must stay those that buffers saved by earlier
    versions hold (names, shapes, dtypes), or those directories no longer open."""
    buffer = ReplayBuffer(4, spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(2), prioritized=True)
    buffer.save(tmp_path)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["format"] == "asyncvec.ReplayBuffer/1"
    shapes = {name: (column["shape"], column["dtype"]) for name, column in meta["columns"].items()}
    assert shapes == {
        "obs": ([4, 3], "<f4"),
        "next_obs": ([4, 3], "<f4"),
        "action": ([4], "<i8"),
        "reward": ([4], "<f4"),
        "terminated": ([4], "|b1"),
        "truncated": ([4], "|b1"),
        "policy_version": ([4], "<i8"),
        "behavior_logp": ([4], "<f4"),
        "env_id": ([4], "<i8"),
        "episode_id": ([4], "<i8"),
        "fallback": ([4], "|b1"),
        "priority": ([4], "<f8"),
    }
