"""The run telemetry: the progress bar."""

from __future__ import annotations

from asyncvec.metrics import RunLogger


def test_the_progress_bar_stays_drawn_when_steps_overshoot_the_total(capsys):
    # agents count steps in whole batches, so the last log is often past the planned total
    logger = RunLogger("unused", track=False, total_steps=100, progress=True)
    logger.log({"charts/episodic_return": 1.0}, step=60)
    logger.log({"charts/episodic_return": 2.0}, step=130)
    logger.close()
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "130/130" in last, last
    assert "100%" in last and "█" in last, last


def test_the_bar_keeps_its_total_when_the_final_step_overshoots_it(capsys):
    # SAC logs every few hundred steps and moves the bar to its last step only at close
    logger = RunLogger("unused", track=False, total_steps=100, progress=True)
    logger.log({"charts/episodic_return": 1.0}, step=60)
    logger.close(final_step=104)
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "104/104" in last and "100%" in last, last


def test_a_tensorboard_writer_that_does_not_stop_cannot_hold_the_runs_stop(tmp_path, monkeypatch, capsys):
    """GRPO's Ctrl-C once hung in SummaryWriter.close (TensorBoard's writer thread never got its stop signal):
    the close now waits a bounded time, in a thread of its own, and says what it left behind."""
    import threading
    import time

    from asyncvec import metrics

    monkeypatch.setattr(metrics, "WRITER_CLOSE_TIMEOUT_S", 0.5)
    logger = metrics.RunLogger(str(tmp_path), track=True, total_steps=10, progress=False)
    writer, never = logger.writer, threading.Event()
    real_close = writer.close
    writer.close = never.wait  # a close that never returns
    started = time.monotonic()
    logger.close()
    assert time.monotonic() - started < 5 and logger.writer is None
    assert "did not stop within 0.5 s" in capsys.readouterr().err
    never.set()
    real_close()
