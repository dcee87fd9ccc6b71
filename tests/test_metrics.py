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
