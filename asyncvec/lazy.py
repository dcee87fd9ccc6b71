"""Public names a package imports on first use (PEP 562's module ``__getattr__``), each with the optional
library its module needs.

A package keeps one table, ``public name -> where it lives`` (a module, or a `LazyName` that also names the
library and the extra installing it), and takes its ``__getattr__`` and ``__dir__`` from `lazy_package`: importing
the package loads nothing heavy, and a missing library fails on first use with the extra to install.

Example:
    >>> table = {"dumps": "json", "missing": LazyName("json", library="no_such_module_here", extra="serve")}
    >>> getattr_, dir_ = lazy_package({"__name__": "demo"}, table)
    >>> getattr_("dumps").__name__, dir_()
    ('dumps', ['dumps', 'missing'])
    >>> getattr_("missing")
    Traceback (most recent call last):
    ...
    asyncvec.extras.MissingExtraError: demo.missing needs no_such_module_here, which is not installed (No module named 'no_such_module_here'); install it with: pip install 'asyncvec[serve]'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncvec.extras import check_installed, check_torch_libraries


@dataclass(frozen=True)
class LazyName:
    """Where a public name lives, and the optional library its module imports."""

    module: str
    library: str | None = None
    """top-level module checked (found, not imported) before ``module`` is imported; missing, the error names
    ``extra``"""
    extra: str | None = None
    """the extra of ``pip install 'asyncvec[EXTRA]'`` that installs ``library``"""
    needs_loadable_torch_libraries: bool = False
    """refuse torchvision, torchaudio or torchcodec installed but unable to load beside torch (vLLM's helper
    processes import them: `asyncvec.extras.check_torch_libraries`)"""

    def load(self, name: str, feature: str) -> Any:
        """``name`` from ``module``, after the checks; ``feature`` names it in their errors."""
        if self.library is not None:
            check_installed(self.library, extra=self.extra or self.library, feature=feature)
        if self.needs_loadable_torch_libraries:
            check_torch_libraries(feature)
        return getattr(importlib.import_module(self.module), name)


def lazy_package(
    namespace: dict[str, Any],
    names: Mapping[str, str | LazyName],
    *,
    also_from: str | None = None,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package whose ``globals()`` is ``namespace``: a name of ``names``
    is loaded on first access and kept in ``namespace``; any other is looked up in ``also_from`` when given (a
    module that once held the package's names), else an AttributeError."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        where = names.get(name)
        if where is None and also_from is not None:
            where = also_from
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            value = (where if isinstance(where, LazyName) else LazyName(where)).load(name, f"{package}.{name}")
        except AttributeError:
            if name in names:
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__
