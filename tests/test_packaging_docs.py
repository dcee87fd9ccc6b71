"""What a user who installed the wheel (no clone) can reach: the docs ship in the wheel and the sdist, every docs
pointer the code prints (``docs/agents.md``, ``asyncvec docs agents``) names a page the wheel holds and
``asyncvec docs`` opens it, and ``asyncvec demo`` says where it writes.

The wheel is built as ``python -m build`` builds it (setup.py's bdist_wheel), with the sdist's manifest, into a
scratch folder: about 2 s. `make test-user-install` builds both with ``python -m build`` and installs the wheel in a
fresh venv."""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys
import zipfile
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncvec import cli
from asyncvec.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(path.name for path in (ROOT / "docs").glob("*.md"))
# A pointer to a page, as code writes it: docs/agents.md (with or without #section) or `asyncvec docs agents`.
POINTER = re.compile(r"(?<![\w/.])docs/([a-z0-9_]+)\.md|\basyncvec docs ([a-z0-9_]+)\b")
SOURCES = ("asyncvec", "agents", "envs", "benchmarks")  # what the wheel installs (as asyncvec.*)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The wheel of this checkout (setup.py's bdist_wheel, what ``python -m build`` runs) and the file list of its
    sdist (egg_info's SOURCES.txt: the manifest sdist packs), built in a scratch folder. The sdist itself is not
    made: it stages its tree in the source folder, where two test workers would collide."""
    out = tmp_path_factory.mktemp("build")
    done = subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(out), "build", "--build-base"]
        + [str(out / "build"), "bdist_wheel", "--dist-dir", str(out / "dist"), "--bdist-dir", str(out / "bdist")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (out / "dist").glob("asyncvec-*.whl")
    (sources,) = out.glob("*.egg-info/SOURCES.txt")
    return {"wheel": wheel, "sdist_files": sources}


def pointers(text: str) -> set[str]:
    """The pages ``text`` points at (``docs/lm_agents.md#x`` and ``asyncvec docs lm_agents``: lm_agents.md)."""
    return {f"{a or b}.md" for a, b in POINTER.findall(text)}


def test_pointers_reads_both_forms():
    text = "see docs/agents.md#running-an-agent, (asyncvec docs lm_agents) and benchmarks/docs/x.md"
    assert pointers(text) == {"agents.md", "lm_agents.md"}


def test_the_docs_ship_in_the_wheel_and_the_sdist(built):
    wheel_pages = sorted(
        Path(name).name for name in zipfile.ZipFile(built["wheel"]).namelist() if name.startswith("asyncvec/docs/")
    )
    assert wheel_pages == PAGES, "the wheel holds every docs/*.md as asyncvec/docs/, nothing else there"
    sdist = built["sdist_files"].read_text().splitlines()
    assert sorted(Path(name).name for name in sdist if Path(name).parent == Path("docs")) == PAGES, "sdist: docs/*.md"


def test_the_installed_wheel_opens_its_docs(built, tmp_path):
    # the wheel unpacked first on the path, run from an empty folder: asyncvec (and its docs) come from the wheel
    site = tmp_path / "site"
    zipfile.ZipFile(built["wheel"]).extractall(site)
    cwd = tmp_path / "empty"
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-m", "asyncvec", "docs", "docs/inference.md#install", "--path"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()) == site / "asyncvec" / "docs" / "inference.md", done.stdout
    listing = subprocess.run(
        [sys.executable, "-m", "asyncvec", "docs"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert listing.returncode == 0 and str(site / "asyncvec" / "docs") in listing.stdout, listing.stderr[-2000:]
    assert all(f"  {Path(page).stem} " in listing.stdout for page in PAGES), listing.stdout


def string_constants(path: Path) -> list[str]:
    """Every string literal of a module (docstrings, help texts, messages, f-strings' literal parts)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_every_docs_pointer_in_the_code_names_a_page_the_wheel_holds(built):
    shipped = {Path(name).name for name in zipfile.ZipFile(built["wheel"]).namelist() if "/docs/" in name}
    seen: dict[str, set[str]] = {}
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            for text in string_constants(path):
                for page in pointers(text):
                    seen.setdefault(page, set()).add(str(path.relative_to(ROOT)))
    assert seen, "the scan found no pointer: the pattern is wrong"
    missing = {page: sorted(where) for page, where in seen.items() if page not in shipped}
    assert not missing, f"pointers to pages the wheel does not hold: {missing}"


def printed_texts(capsys) -> dict[str, str]:
    """What the commands print where they point at the docs: every agent's --help, the asyncvec command's, and
    the errors that name a page."""
    import tyro

    from asyncvec.agents import grpo, ppo, ppo_chunks, reinforce_pp, rloo, sac, sac_chunks
    from asyncvec.extras import install_command
    from asyncvec.lm.backends import LM_BACKENDS

    texts = {}
    for module in (ppo, sac, ppo_chunks, sac_chunks, rloo, reinforce_pp, grpo):
        with pytest.raises(SystemExit):
            tyro.cli(module.Args, args=["--help"])
        texts[f"asyncvec-{module.__name__.rpartition('.')[2]} --help"] = capsys.readouterr().out
    for argv in (["--help"], ["demo", "--help"], ["demo-llm", "--help"], ["docs", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        texts["asyncvec " + " ".join(argv)] = capsys.readouterr().out
    texts["the missing vLLM extra"] = install_command("vllm")
    args = SimpleNamespace(
        base_url="http://127.0.0.1:1", server_kind="asyncvec", inflight_updates=True, bitwise_sampling=False
    )
    with pytest.raises(ValueError) as refused:
        LM_BACKENDS["openai"].check(args)
    texts["--inflight-updates refused"] = str(refused.value)
    return texts


def test_every_printed_docs_pointer_opens_with_asyncvec_docs(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # tyro wraps help to the terminal: a pointer stays on one line
    texts = printed_texts(capsys)
    found = {where: pointers(text) for where, text in texts.items()}
    assert found["the missing vLLM extra"] == {"inference.md"} and found["--inflight-updates refused"]
    assert found["asyncvec-rloo --help"], "the LM agents' --help points at the docs"
    for where, pages in found.items():
        for page in pages:
            assert cli.doc_path(page).is_file(), (where, page)
            out = io.StringIO()
            with redirect_stdout(out):
                assert main(["docs", Path(page).stem]) == 0
            assert out.getvalue() == cli.doc_path(page).read_text(encoding="utf-8") + "\n", (where, page)


def test_asyncvec_docs_lists_the_pages_and_refuses_an_unknown_one(capsys):
    assert main(["docs"]) == 0
    listing = capsys.readouterr().out
    assert all(f"  {Path(page).stem} " in listing for page in PAGES), listing
    assert main(["docs", "lm-agents", "--path"]) == 0
    assert capsys.readouterr().out.strip() == str(ROOT / "docs" / "lm_agents.md")
    assert main(["docs", "nosuchpage"]) == 2
    error = capsys.readouterr().err
    assert "no page 'nosuchpage'" in error and "lm_agents" in error, error


def test_the_demo_says_where_it_writes(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    from asyncvec.benchmarks import ppo_speed
    from asyncvec.benchmarks.report import RESULTS_DIR

    ran = []
    monkeypatch.setattr(ppo_speed, "main", ran.append)  # the 5-minute run itself is not what is tested
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--out-dir", "out", "--no-progress"]) == 0
    assert ran[0].out_dir == "out"
    assert f"asyncvec demo: the tables and plots go to {tmp_path / 'out'}\n" in capsys.readouterr().out
    assert main(["demo", "--no-progress"]) == 0
    default = Path(RESULTS_DIR).resolve()  # ./asyncvec-results installed, benchmarks/results in a clone
    assert f"go to {default}\n" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "./asyncvec-results" in help_text, "--out-dir names the installed default"
