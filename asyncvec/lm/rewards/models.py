"""Reward models: the :class:`BatchScorer` protocol and :class:`HFRewardModel` (imports torch and
transformers only when a model is built or scores).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@runtime_checkable
class BatchScorer(Protocol):
    """A scorer that rates many ``(prompt, response)`` pairs in one call (e.g. a reward model)."""

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str]) -> Sequence[float]:
        """One score per pair, in order."""
        ...


class HFRewardModel:
    """A transformers sequence-classification model used as a reward model.

    The pair is encoded as ``tokenizer(prompt, response)`` (right-padded); the score is the
    single regression logit (``num_labels == 1``) or the logit of label 1.

    Args:
        model: A ``*ForSequenceClassification`` model; put it on its device beforehand.
        tokenizer: Its tokenizer; needs a pad token, and ``model.config.pad_token_id`` set.
        max_length: Truncate pairs to this many tokens (default: the model's context size).
        label: Which logit to use (default: 0 for one label, else 1).

    Example:
        >>> from tokenizers import Tokenizer, models
        >>> from transformers import (
        ...     GPT2Config, GPT2ForSequenceClassification, PreTrainedTokenizerFast)
        >>> from asyncvec.lm.rewards import HFRewardModel
        >>> vocab = {"<pad>": 0, **{c: i + 1 for i, c in enumerate("0123456789+-*= ")}}
        >>> # a BPE model without merges is a character-level tokenizer
        >>> chars = Tokenizer(models.BPE(vocab, merges=[], unk_token="<pad>"))
        >>> tok = PreTrainedTokenizerFast(tokenizer_object=chars, pad_token="<pad>")
        >>> config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(vocab),
        ...                     num_labels=1, pad_token_id=0)
        >>> rm = HFRewardModel(GPT2ForSequenceClassification(config), tok)
        >>> len(rm.score_batch(["3+4=", "1+1="], ["7", "2"]))
        2
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_length: int | None = None,
        label: int | None = None,
    ) -> None:
        config = model.config
        num_labels = int(config.num_labels)
        self.label = (0 if num_labels == 1 else 1) if label is None else label
        if not 0 <= self.label < num_labels:
            raise ValueError(f"label must be in [0, {num_labels}) for this model, got {label!r}")
        if tokenizer.pad_token_id is None:
            raise ValueError("tokenizer.pad_token is None; set one (e.g. tokenizer.pad_token = tokenizer.eos_token)")
        if config.pad_token_id is None:
            raise ValueError(
                "model.config.pad_token_id is None; set model.config.pad_token_id = "
                "tokenizer.pad_token_id so padded batches score like single pairs"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length or getattr(config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        self._lock = threading.Lock()  # weights never change during a forward pass

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> HFRewardModel:
        """Load model and tokenizer saved with ``save_pretrained`` in ``path``.

        ``kwargs`` go to :class:`HFRewardModel` (``max_length``, ``label``).
        """
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model = AutoModelForSequenceClassification.from_pretrained(path)
        if device is not None:
            model = model.to(device)
        return cls(model, AutoTokenizer.from_pretrained(path), **kwargs)

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """Score each ``(prompt, response)`` pair; returns one float per pair."""
        import torch

        encoded = self.tokenizer(
            list(prompts),
            list(responses),
            padding=True,
            padding_side="right",  # keeps absolute positions equal to unpadded scoring
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        ).to(self.device)
        with self._lock, torch.inference_mode():
            logits = self.model(**encoded).logits
        return logits[:, self.label].float().tolist()

    def load_weights(self, weights: Mapping[str, torch.Tensor] | str | os.PathLike[str]) -> None:
        """Replace the weights with a state dict or a ``save_pretrained`` folder (strict)."""
        if isinstance(weights, (str, os.PathLike)):
            weights = type(self.model).from_pretrained(weights).state_dict()
        with self._lock:
            self.model.load_state_dict(weights)
