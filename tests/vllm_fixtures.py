"""Module-scoped fixtures shared by the vLLM test modules (import them into the module):
the tiny GPT-2 folder and its transformers reference models by version."""

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
