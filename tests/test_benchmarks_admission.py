"""benchmarks/admission.py --quick: drop-after and admission run end to end and the report has both rows.

No timing asserts: the smoke run checks what holds whatever the machine's speed: admission discards
nothing and trains on every sample that reached the learner; the lengths the benchmark records agree
with the learner's ``length/*`` totals (``run_one`` raises otherwise); the report's files and columns.
"""

from __future__ import annotations

import doctest
import json

import pytest

from asyncvec.benchmarks import admission

pytestmark = pytest.mark.timeout(300)


def test_docstring_examples_run() -> None:
    assert doctest.testmod(admission).failed == 0


def test_quick_run_compares_both_modes(tmp_path) -> None:
    out = admission.main(admission.Args(quick=True, out_dir=str(tmp_path)))
    assert [row[0] for row in out["rows"]] == list(admission.MODES)
    header = out["table"].splitlines()[0]
    assert [cell.strip() for cell in header.strip("|").split("|")] == admission.COLUMNS
    for name in ("admission.md", "admission.png", "admission.json"):
        assert (tmp_path / name).stat().st_size > 0
    saved = json.loads((tmp_path / "admission.json").read_text())["runs"]
    assert [(run["mode"], sum(run["length_counts"]["trained"])) for run in saved] == [
        (run["mode"], len(run["trained_lengths"])) for run in out["runs"]
    ]
    runs = {run["mode"]: run for run in out["runs"]}
    assert set(runs) == set(admission.MODES)
    for run in runs.values():
        assert run["updates"] == 4 and run["generated_lengths"], run["mode"]
        assert run["trained_mean"] <= max(run["generated_lengths"])
    gated = runs["admission"]
    assert gated["discarded_stale"] == 0.0
    assert sorted(gated["trained_lengths"]) == sorted(gated["generated_lengths"])  # nothing generated was dropped
    assert out["rows"][1][3] == "1.000"  # admission's trained/generated mean ratio
