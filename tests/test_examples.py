"""The runnable examples in the docstrings of the vector env, collector, metrics, agents, example envs and extras."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "asyncvec",
    "asyncvec.vector.async_llm_vector_env",
    "asyncvec.vector.checker",
    "asyncvec.vector.placement",
    "asyncvec.collector",
    "asyncvec.metrics",
    "asyncvec.envs.slow",
    "asyncvec.envs.pixels",
    "asyncvec.agents.common",
    "asyncvec.extras",
    "asyncvec.control.instructions",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has no runnable example"
