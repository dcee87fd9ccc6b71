"""Tiny causal language models built from a config, with a character-level tokenizer.

No downloads: `build_tiny_lm` writes a folder that ``transformers``, ``asyncvec serve`` and
vLLM load like any ``save_pretrained`` checkpoint.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path
from typing import Any

#: digits, arithmetic, letters, space, newline and basic punctuation (e.g. "3+4=" -> "7")
DEFAULT_VOCAB = string.digits + "+-*/=<>()[]{}.,:;!?'\"#%&_" + " \n" + string.ascii_lowercase + string.ascii_uppercase
PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
ARCHS = ("gpt2", "llama")


def build_char_tokenizer(vocab: str = DEFAULT_VOCAB):
    """A character-level ``PreTrainedTokenizerFast``: one token per character, left padding.

    Ids 0, 1, 2 are ``<pad>``, ``<eos>``, ``<unk>``; characters follow in ``vocab`` order;
    characters outside ``vocab`` map to ``<unk>``.

    Example:
        >>> tok = build_char_tokenizer("0123456789+=")
        >>> tok("3+4=").input_ids, tok.decode([6, 13, 7, 14])
        ([6, 13, 7, 14], '3+4=')
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if not isinstance(vocab, str) or not vocab:
        raise ValueError(f"vocab must be a non-empty str of characters, got {vocab!r}")
    if len(set(vocab)) != len(vocab):
        repeated = sorted({char for char in vocab if vocab.count(char) > 1})
        raise ValueError(f"vocab has repeated characters: {repeated}")
    table = {token: index for index, token in enumerate(SPECIAL_TOKENS + tuple(vocab))}
    core = Tokenizer(models.WordLevel(vocab=table, unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every char is a token
    core.decoder = decoders.Fuse()  # join tokens without separators
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
    )


def check_lm_sizes(arch: str, n_head: int | None, **sizes: int) -> int:
    """Checks ``arch`` and that every one of ``sizes`` is an int >= 1; returns the head count
    (``n_embd // 32`` when ``n_head`` is None), which must divide ``sizes["n_embd"]``.

    Example:
        >>> check_lm_sizes("gpt2", None, n_layer=2, n_embd=64)
        2
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    for field, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field} must be an int >= 1, got {value!r}")
    n_embd = sizes["n_embd"]
    heads = max(1, n_embd // 32) if n_head is None else n_head
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or n_embd % heads:
        raise ValueError(f"n_head must be an int >= 1 dividing n_embd={n_embd}, got {heads!r}")
    return heads


def build_tiny_lm(
    path: str | os.PathLike,
    arch: str = "gpt2",
    vocab: str = DEFAULT_VOCAB,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int | None = None,
    max_positions: int = 128,
    seed: int = 0,
) -> Path:
    """Build a small randomly initialised GPT-2 or Llama model and save it with its tokenizer.

    Args:
        path: output folder (created; existing files are overwritten).
        arch: ``"gpt2"`` or ``"llama"``.
        vocab: the characters the tokenizer knows (see `build_char_tokenizer`).
        n_layer: transformer blocks.
        n_embd: hidden size.
        n_head: attention heads; default ``max(1, n_embd // 32)`` (head size 32). vLLM's
            attention kernels want head sizes such as 64 or 128.
        max_positions: context length.
        seed: torch seed of the initialisation (the global RNG is left untouched).

    Returns:
        The folder, loadable with ``AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained``.

    Example:
        >>> import tempfile
        >>> from transformers import AutoModelForCausalLM, AutoTokenizer
        >>> folder = build_tiny_lm(tempfile.mkdtemp(), arch="llama", n_layer=1, n_embd=32)
        >>> AutoTokenizer.from_pretrained(folder)("3+4=").input_ids
        [6, 13, 7, 17]
        >>> AutoModelForCausalLM.from_pretrained(folder).config.model_type
        'llama'
    """
    import torch
    import transformers

    heads = check_lm_sizes(arch, n_head, n_layer=n_layer, n_embd=n_embd, max_positions=max_positions)
    tokenizer = build_char_tokenizer(vocab)
    config = text_model_config(arch, tokenizer, len(tokenizer), n_layer, n_embd, heads, max_positions)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return save_tiny_model(model, tokenizer, path)


def text_model_config(
    arch: str,
    tokenizer: Any,
    vocab_size: int,
    n_layer: int,
    n_embd: int,
    n_head: int,
    max_positions: int,
    tie_word_embeddings: bool | None = None,
) -> Any:
    """The transformers config of a tiny GPT-2 or Llama with ``tokenizer``'s special tokens (sizes checked by
    `check_lm_sizes`). ``tie_word_embeddings``: None keeps GPT-2's tied input and output embeddings; Llama's are
    never tied."""
    import transformers

    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.eos_token_id,
    }
    if arch == "gpt2":
        if tie_word_embeddings is not None:
            ids["tie_word_embeddings"] = tie_word_embeddings
        return transformers.GPT2Config(
            vocab_size=vocab_size, n_positions=max_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head, **ids
        )
    return transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=n_embd,
        intermediate_size=2 * n_embd,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_head,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        **ids,
    )


def save_tiny_model(model: Any, tokenizer: Any, path: str | os.PathLike) -> Path:
    """``save_pretrained`` of a tiny model and its tokenizer into ``path``, without transformers' progress bar
    (a toy built in a test or an example is not a download worth a bar), the tokenizer config made portable."""
    from transformers.utils import logging as transformers_logging

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    bars_were_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder)
    finally:
        if bars_were_on:
            transformers_logging.enable_progress_bar()
    tokenizer.save_pretrained(folder)
    _make_tokenizer_config_portable(folder)
    return folder


def _make_tokenizer_config_portable(folder: Path) -> None:
    # transformers 5 records its own backend class name; older releases (and vLLM pinned to
    # them) only know PreTrainedTokenizerFast, which loads the same tokenizer.json.
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["padding_side"] = "left"
    config_file.write_text(json.dumps(config, indent=2), encoding="utf-8")
