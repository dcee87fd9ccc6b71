"""Style rules the linter cannot check: every ``# noqa`` says why the rule does not apply there."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOQA = re.compile(r"#\s*noqa(?::\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)?(?P<why>.*)$")


def test_every_noqa_says_why():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    missing = []
    for name in files.stdout.split():
        for number, line in enumerate((ROOT / name).read_text(encoding="utf-8").splitlines(), 1):
            match = NOQA.search(line)
            if match and not re.search(r"[a-z]{3}", match["why"]):
                missing.append(f"{name}:{number}: {line.strip()}")
    assert not missing, "a # noqa without a reason after its codes:\n" + "\n".join(missing)


def test_one_version_string():
    import importlib.metadata

    import asyncvec

    assert importlib.metadata.version("asyncvec") == asyncvec.__version__
    assert "version=VERSION" in (ROOT / "setup.py").read_text()  # setup.py reads asyncvec/__init__.py's
