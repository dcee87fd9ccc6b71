"""Module-scoped fixtures shared by the vLLM test modules (import them into the module):
the tiny GPT-2 folder and its transformers reference models by version."""

import psutil
import pytest

from asyncvec.inference import build_tiny_lm
from asyncvec.testing.checks import VersionedReference


def text_action(text):
    """The action is the completion itself (no parser rejects anything)."""
    return text


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("vllm") / "tiny", arch="gpt2", seed=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    return VersionedReference(model_dir)


def vllm_children():
    """This process's child processes that are vLLM's (none may be left after a policy or server closes)."""
    leftovers = []
    for process in psutil.Process().children(recursive=True):
        try:
            if "vllm" in " ".join(process.cmdline() + [process.name()]).lower():
                leftovers.append(process)
        except psutil.Error:  # it ended meanwhile
            pass
    return leftovers
