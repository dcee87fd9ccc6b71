"""benchmarks/inflight_llm.py --quick: the three modes run end to end and the table has its columns.

No timing asserts: the smoke run only checks that every mode trains, that the in-flight mode's
completions may span versions while the others' never do, and the report's shape.
"""

from __future__ import annotations

import doctest
import json

import pytest

from asyncvec.benchmarks import inflight_llm

pytestmark = pytest.mark.timeout(300)


def test_docstring_examples_run() -> None:
    assert doctest.testmod(inflight_llm).failed == 0


def test_quick_run_writes_the_table_and_the_plot(tmp_path) -> None:
    out = inflight_llm.main(inflight_llm.Args(quick=True, out_dir=str(tmp_path)))
    assert [row[0] for row in out["rows"]] == list(inflight_llm.MODES)
    header = out["table"].splitlines()[0]
    assert [cell.strip() for cell in header.strip("|").split("|")] == inflight_llm.COLUMNS
    for name in ("inflight_llm.md", "inflight_llm.png", "inflight_llm.json"):
        assert (tmp_path / name).stat().st_size > 0
    runs = json.loads((tmp_path / "inflight_llm.json").read_text())["runs"]
    assert {run["mode"] for run in runs} == set(inflight_llm.MODES)
    for run in runs:
        assert run["updates"] >= 1 and run["tokens"] > 0, run
        if run["mode"] != "in-flight updates":  # only in-flight updates make a sample span versions
            assert run["spanning_fraction"] == 0.0 and run["inflight_swaps"] == 0, run
    assert out["bound"]["speedup_bound"] >= 1.0


def test_unknown_mode_is_refused_by_name(tmp_path) -> None:
    with pytest.raises(ValueError, match="--modes"):
        inflight_llm.main(inflight_llm.Args(quick=True, modes=["fast"], out_dir=str(tmp_path)))
