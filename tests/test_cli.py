"""The ``asyncvec`` command as a user meets it: ``--version``, ``python -m asyncvec``, the demos' own options
and their one-line errors (exit 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import asyncvec
from asyncvec.cli import main


def run(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "asyncvec", *argv], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_version_and_python_dash_m(tmp_path):
    done = run("--version", cwd=tmp_path)  # from any folder: the installed package answers
    assert done.returncode == 0 and done.stdout.strip() == f"asyncvec {asyncvec.__version__}", done.stderr


def test_the_demos_are_listed_and_take_their_own_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    listing = capsys.readouterr().out
    assert "demo " in listing and "demo-llm" in listing
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--help"])
    assert exit_.value.code == 0 and "--regime" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["demo-llm", "--help"])
    assert exit_.value.code == 0 and "--agents" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["demo", "--regime", "z"], ["demo-llm", "--agents", "dqn"], ["demo", "--seeed", "1"]])
def test_a_wrong_demo_option_exits_2_without_a_traceback(argv):
    done = run(*argv)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
