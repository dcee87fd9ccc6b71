"""Every ```python and ```bash block of README.md and docs/*.md runs as written.

The convention (also in docs/integrations.md, "Docs that run"):

* Files: README.md and every docs/*.md (a glob, so a new page is tested from its first commit).
  One test per file.
* Blocks: fenced blocks whose info string is exactly ``python`` or ``bash``; other fences
  (``text``, ``console``, none) are not run. The blocks of a file run top to bottom in one fresh
  Python process; each may depend only on the blocks above it. Python blocks share one
  namespace (``__name__ == "__main__"``); a traceback names the .md file and its line.
* Bash blocks run with ``bash -euo pipefail``: every command must succeed.
* Where: a scratch directory whose entries link to the repository root's, so commands written
  for the repository root work (``python agents/ppo.py``, ``make``) and files the blocks write
  land in the scratch directory. The venv's ``bin`` is first on PATH (and ``OMP_NUM_THREADS=1``,
  so torch does not spin threads on a loaded machine). Every process a file
  started (servers put in the background with ``&`` too) is killed when its blocks end.
* Directives: HTML comments on the lines just above a block (stackable), invisible on GitHub:

  - ``<!-- docs-test: skip: <reason> -->``: the block is not run (a GPU, a real remote
    cluster, ``make test`` itself). Use sparingly: the reason is printed in the test report.
  - ``<!-- docs-test: append: <args> -->``: bash only; ``<args>`` is appended to every command
    line that starts with ``python``. This keeps long training commands honest: the documented
    command runs as written, with e.g. ``--total-timesteps 2048`` making it seconds long (tyro
    lets the last value of a flag win). The page says how long the full command takes.
  - ``<!-- docs-test: replace: <old> => <new> -->``: the same for code, e.g. a step budget
    in a Python block; ``<old>`` must occur in the block.
  - ``<!-- docs-test: timeout: <seconds> -->``: the block's time limit (default 300 s).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = sorted(["README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
DEFAULT_TIMEOUT_S = 300.0  # per block; a loaded 2-core machine starts servers slowly

_FENCE = re.compile(r"^```(\S*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*docs-test:\s*(skip|append|replace|timeout):\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    path: str
    line: int  # 1-based line of the block's first code line
    language: str
    code: str
    skip: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    directives: list[tuple[str, str]] = field(default_factory=list)


def extract_blocks(path: str, text: str) -> list[Block]:
    """The ```python and ```bash blocks of a Markdown page, with the directives above each."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: list[tuple[str, str]] = []
    i = 0
    while i < len(lines):
        directive = _DIRECTIVE.match(lines[i].strip())
        fence = _FENCE.match(lines[i])
        if directive:
            pending.append((directive.group(1), directive.group(2)))
        elif fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise ValueError(f"{path}:{i + 1}: unclosed code fence")
            if fence.group(1) in ("python", "bash"):
                block = Block(path, i + 2, fence.group(1), "\n".join(lines[i + 1 : end]) + "\n", directives=pending)
                _apply(block)
                blocks.append(block)
            elif pending:
                raise ValueError(f"{path}:{i + 1}: docs-test directives above a block that is not python or bash")
            pending = []
            i = end
        elif lines[i].strip() and pending:
            raise ValueError(f"{path}:{i + 1}: a docs-test directive must sit just above a code block")
        i += 1
    if pending:
        raise ValueError(f"{path}: docs-test directive at the end of the file, above no block")
    return blocks


def _apply(block: Block) -> None:
    where = f"{block.path}:{block.line - 1}"
    for kind, value in block.directives:
        if kind == "skip":
            if not value:
                raise ValueError(f"{where}: docs-test: skip needs a reason")
            block.skip = value
        elif kind == "timeout":
            block.timeout_s = float(value)
        elif kind == "append":
            if block.language != "bash":
                raise ValueError(f"{where}: docs-test: append is for bash blocks")
            lines = block.code.splitlines()
            targets = [k for k, line in enumerate(lines) if line.lstrip().startswith("python ")]
            if not targets:
                raise ValueError(f"{where}: docs-test: append found no command line starting with `python`")
            for k in targets:  # the command's last line: follow backslash continuations
                end = k
                while lines[end].rstrip().endswith("\\"):
                    end += 1
                command, hash_, comment = lines[end].partition(" #")
                lines[end] = f"{command.rstrip()} {value}" + (f"  #{comment}" if hash_ else "")
            block.code = "\n".join(lines) + "\n"
        elif kind == "replace":
            old, sep, new = value.partition(" => ")
            if not sep or old not in block.code:
                raise ValueError(f"{where}: docs-test: replace: {old!r} does not occur in the block")
            block.code = block.code.replace(old, new)


_DRIVER = """\
import json, subprocess, sys

def main():
    sys.path[0] = ""  # python blocks run as if typed into `python` at the repository root: it comes first
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    for block in json.load(open(sys.argv[1])):
        where = f"{block['path']}:{block['line']}"
        print(f"\\n===== {where} ({block['language']})", flush=True)
        if block["language"] == "python":
            exec(compile("\\n" * (block["line"] - 1) + block["code"], block["path"], "exec"), namespace)
        else:
            try:
                subprocess.run(["bash", "-euo", "pipefail", "-c", block["code"]], check=True, timeout=block["timeout_s"])
            except subprocess.CalledProcessError as error:
                sys.exit(f"bash block at {where} failed with exit code {error.returncode}")
            except subprocess.TimeoutExpired:
                sys.exit(f"bash block at {where} ran past its {block['timeout_s']} s")
        sys.stdout.flush()

if __name__ == "__main__":
    main()
"""


def _scratch_dir(tmp_path: Path) -> Path:
    """A directory that looks like the repository root: its entries link to the real ones."""
    scratch = tmp_path / "repo"
    scratch.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".pytest_cache"):
            (scratch / entry.name).symlink_to(entry)
    return scratch


def run_blocks(blocks: list[Block], tmp_path: Path) -> subprocess.CompletedProcess:
    """Runs the blocks in one process (see the module docstring); kills everything it started after."""
    scratch = _scratch_dir(tmp_path)
    plan = tmp_path / "blocks.json"
    plan.write_text(json.dumps([block.__dict__ for block in blocks if block.skip is None]))
    driver = tmp_path / "run_blocks.py"
    driver.write_text(_DRIVER)
    venv_bin = Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(venv_bin.parent),
        "OMP_NUM_THREADS": "1",  # torch on one thread: on a loaded 2-core machine more threads only spin
    }
    env.pop("PYTHONPATH", None)
    env.pop("RAY_ADDRESS", None)  # a page runs as in a fresh shell, not inside another test's Ray cluster
    timeout = sum(block.timeout_s for block in blocks if block.skip is None) + 60
    log = tmp_path / "output.txt"
    with open(log, "w") as out:  # a file, not a pipe: a server put in the background keeps a pipe open
        process = subprocess.Popen(
            [sys.executable, str(driver), str(plan)],
            cwd=scratch,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            process.wait(timeout=timeout)
            note = ""
        except subprocess.TimeoutExpired:
            note = f"\n(the blocks ran past {timeout:.0f} s)"
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # background servers and workers the blocks left
            except ProcessLookupError:
                pass
            process.wait()
    output = log.read_text(errors="replace") + note
    return subprocess.CompletedProcess(process.args, process.returncode, output, "")


def _doc_params() -> list:
    """One test per page, with its time limit (the sum of its blocks')."""
    params = []
    for path in DOC_FILES:
        try:
            blocks = extract_blocks(path, (ROOT / path).read_text(encoding="utf-8"))
            seconds = sum(block.timeout_s for block in blocks if block.skip is None)
        except ValueError:  # reported by the test itself
            seconds = DEFAULT_TIMEOUT_S
        params.append(pytest.param(path, marks=[pytest.mark.timeout(seconds + 120)], id=path))
    return params


@pytest.mark.parametrize("path", _doc_params())
def test_doc_blocks_run(path, tmp_path):
    blocks = extract_blocks(path, (ROOT / path).read_text(encoding="utf-8"))
    for block in blocks:
        if block.skip:
            print(f"{path}:{block.line}: skipped: {block.skip}")
    if not any(block.skip is None for block in blocks):
        pytest.skip(f"{path} has no block to run")
    result = run_blocks(blocks, tmp_path)
    assert result.returncode == 0, f"{path}: a block failed\n{result.stdout[-6000:]}"


def test_extract_blocks_and_directives():
    page = "\n".join(
        [
            "# Title",
            "```python",
            "x = 1",
            "```",
            "text",
            "<!-- docs-test: append: --total-timesteps 64 -->",
            "```bash",
            "python agents/ppo.py --env CartPole-v1 \\",
            "    --mode async   # about 2 minutes",
            "echo done",
            "```",
            "<!-- docs-test: skip: needs a GPU -->",
            "```bash",
            "nvidia-smi",
            "```",
            "```text",
            "not run",
            "```",
            "<!-- docs-test: replace: 50_000 => 64 -->",
            "<!-- docs-test: timeout: 30 -->",
            "```python",
            "n = 50_000",
            "```",
        ]
    )
    blocks = extract_blocks("page.md", page)
    assert [(b.language, b.line, b.skip) for b in blocks] == [
        ("python", 3, None),
        ("bash", 8, None),
        ("bash", 14, "needs a GPU"),
        ("python", 22, None),
    ]
    assert blocks[1].code.splitlines()[1] == "    --mode async --total-timesteps 64  # about 2 minutes"
    assert blocks[3].code == "n = 64\n" and blocks[3].timeout_s == 30
    with pytest.raises(ValueError, match="does not occur"):
        extract_blocks("page.md", "<!-- docs-test: replace: nothere => x -->\n```python\nx = 1\n```")
    with pytest.raises(ValueError, match="must sit just above a code block"):
        extract_blocks("page.md", "<!-- docs-test: skip: why -->\nsome text\n```python\nx = 1\n```")


def test_a_failing_block_names_its_file_and_line_and_leaves_no_process(tmp_path):
    page = "```bash\nsleep 600 &\necho started\n```\n\n```python\nimport os\nraise RuntimeError(os.getcwd())\n```\n"
    result = run_blocks(extract_blocks("page.md", page), tmp_path)
    assert result.returncode != 0
    assert 'File "page.md", line 8' in result.stdout and "RuntimeError" in result.stdout
    assert str(tmp_path / "repo") in result.stdout, "blocks run in the scratch copy of the repository root"
    leftover = subprocess.run(["pgrep", "-f", "sleep 600"], capture_output=True, text=True).stdout.split()
    assert not leftover or all(_not_ours(int(pid), tmp_path) for pid in leftover)


def _not_ours(pid: int, tmp_path: Path) -> bool:
    try:
        return Path(f"/proc/{pid}/cwd").resolve() != (tmp_path / "repo").resolve()
    except OSError:
        return True


def test_the_progress_bar_labels_staleness_as_staleness():
    # "mean=1.7" next to the return read as a return; the bar says what it is.
    from asyncvec.metrics import RunLogger

    logger = RunLogger("unused", track=False, total_steps=100, progress=True)
    try:
        logger.log({"charts/episodic_return": 21.0, "staleness/mean": 1.5, "charts/env_steps_per_s": 900.0}, step=10)
        postfix = logger.bar.postfix
    finally:
        logger.close()
    assert "staleness=1.5" in postfix and "episodic_return=21" in postfix and "mean=" not in postfix
