"""``Conversation``: a multi-turn episode as the token ids a causal LM reads, built by appending.

The prompt of turn ``t`` is the rendered history: the system prompt, every observation as a
user turn, every completion as an assistant turn, then the opening of the next assistant turn.
It is **prefix-stable**: turn ``t``'s prompt ids are a prefix of turn ``t+1``'s, because each
turn only appends ids: the sampled completion's own token ids (never re-tokenized) and the
tokenization of the new text around them. An engine with a prefix cache reuses the history,
and the learner scores exactly the ids the engine saw.

Two renderings:

* **chat template** (the tokenizer has ``chat_template``): the new text of a turn is the
  difference between ``apply_chat_template`` of the conversation after and before it. A
  template that rewrites earlier turns (no longer a prefix) raises ``ValueError``.
* **plain format** (no template, e.g. the tiny char-level models): :class:`PlainChatFormat`::

      {system}\\n                      (only with a system prompt)
      User: {observation}\\n
      Assistant: {completion}\\n       (the completion's sampled ids, eos included when sampled)
      User: {observation}\\n
      Assistant:  ...

When the history outgrows the context, :meth:`Conversation.fit` starts a new conversation from
the system prompt and the most recent whole turns that fit (the oldest user/assistant pairs
dropped): a new prefix-stable segment, whose prompts are no longer prefixes of the old one's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Conversation", "PlainChatFormat"]

ENCODE_CACHE_SIZE = 4096
"""texts an ``encode_cache`` holds at most"""


@dataclass(frozen=True)
class PlainChatFormat:
    """The text around turns when the tokenizer has no chat template (see the module docstring).

    Attributes:
        user: text before each observation.
        assistant: text after each observation, opening the assistant's turn (the prompt ends here).
        turn_end: text after each completion (and after the system prompt).
    """

    user: str = "User: "
    assistant: str = "\nAssistant: "
    turn_end: str = "\n"


class Conversation:
    """One episode's conversation as token ids, built by appending (prefix-stable).

    Args:
        tokenizer: a ``transformers`` tokenizer; its ``chat_template`` is used when it has one
            and ``use_chat_template`` is not False.
        system_prompt: the first message (None: none).
        plain: the plain format used without a chat template.
        use_chat_template: None (default): when the tokenizer has one; False: the plain format.
        encode_cache: a dict shared by the conversations of one tokenizer (an
            :class:`~asyncvec.lm.EpisodeCollector` keeps one): the ids of each text it encoded, so a
            text that comes again (an env's recurring feedback, the turn separators) is not
            tokenized again. At most ``ENCODE_CACHE_SIZE`` texts; then it starts over.

    Example:
        >>> from asyncvec.inference.tiny_models import build_char_tokenizer
        >>> tok = build_char_tokenizer()
        >>> chat = Conversation(tok, system_prompt="Play.")
        >>> first = chat.add_observation("8?")
        >>> tok.decode(first)
        'Play.\\nUser: 8?\\nAssistant: '
        >>> chat.add_completion(tok("7").input_ids + [tok.eos_token_id])
        >>> second = chat.add_observation("higher")
        >>> second[: len(first)] == first, tok.decode(second, skip_special_tokens=True)[len('Play.'):]
        (True, '\\nUser: 8?\\nAssistant: 7\\nUser: higher\\nAssistant: ')
    """

    def __init__(
        self,
        tokenizer: Any,
        system_prompt: str | None = None,
        plain: PlainChatFormat = PlainChatFormat(),
        use_chat_template: bool | None = None,
        encode_cache: dict[tuple[str, bool], tuple[int, ...]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.encode_cache = encode_cache
        self.system_prompt = system_prompt
        self.plain = plain
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if use_chat_template and not has_template:
            raise ValueError("use_chat_template=True, but the tokenizer has no chat_template")
        self.uses_template = has_template if use_chat_template is None else bool(use_chat_template)
        self.messages: list[dict[str, str]] = (
            [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        )
        self.ids: list[int] = []
        """the token ids so far (after :meth:`add_observation`: the prompt of the next turn)"""
        self.num_turns = 0
        """completions added"""
        self._rendered = ""  # chat template: the text self.ids stand for
        self._pending_suffix = ""  # chat template: the text the template puts after the last completion
        self._turns: list[tuple[str, list[int], str]] = []  # (observation, completion ids, text) of each turn
        self._observation: str | None = None  # the observation waiting for its completion

    def __len__(self) -> int:
        return len(self.ids)

    def _encode(self, text: str, first: bool) -> list[int]:
        if not text:
            return []
        special = first and not self.uses_template  # a BOS the tokenizer adds, once, at the start
        cache = self.encode_cache
        if cache is None:
            return list(self.tokenizer(text, add_special_tokens=special).input_ids)
        ids = cache.get((text, special))
        if ids is None:
            if len(cache) >= ENCODE_CACHE_SIZE:
                cache.clear()
            ids = cache[(text, special)] = tuple(self.tokenizer(text, add_special_tokens=special).input_ids)
        return list(ids)

    def _render(self, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            self.messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def add_observation(self, observation: str) -> list[int]:
        """Appends ``observation`` as a user turn and opens the assistant's; returns the prompt ids."""
        if not isinstance(observation, str):
            raise TypeError(f"Conversation: an observation must be a str, got {type(observation).__name__}")
        first = not self.ids
        if self.uses_template:
            self.messages.append({"role": "user", "content": observation})
            after = self._render(generation_prompt=True)
            before = self._rendered + self._pending_suffix
            if not after.startswith(before):
                raise ValueError(
                    "Conversation: the tokenizer's chat template is not prefix-stable (rendering a new turn "
                    "changed the text of earlier ones); pass use_chat_template=False for the plain format"
                )
            new_text = self._pending_suffix + after[len(before) :]
            self._rendered = after
        else:
            plain = self.plain
            head = f"{self.system_prompt}{plain.turn_end}" if first and self.system_prompt is not None else ""
            new_text = f"{head}{plain.user}{observation}{plain.assistant}"
            self.messages.append({"role": "user", "content": observation})
        self._pending_suffix = ""
        self._observation = observation
        self.ids.extend(self._encode(new_text, first))
        return list(self.ids)

    def add_completion(self, token_ids: list[int] | tuple[int, ...], text: str | None = None) -> None:
        """Appends the sampled completion's ids as they are (``text``: its decoded text, for the template)."""
        token_ids = [int(t) for t in token_ids]
        if text is None:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        self.ids.extend(token_ids)
        self.messages.append({"role": "assistant", "content": text})
        self.num_turns += 1
        self._turns.append((self._observation or "", token_ids, text))
        self._observation = None
        if self.uses_template:
            full = self._render(generation_prompt=False)
            head = self._rendered + text
            suffix = full[len(head) :] if full.startswith(head) else ""
            eos = self.tokenizer.eos_token
            if token_ids and token_ids[-1] == self.tokenizer.eos_token_id and eos and suffix.startswith(eos):
                suffix = suffix[len(eos) :]  # the sampled eos already closed the turn
            self._rendered = full[: len(full) - len(suffix)] if suffix else full
            self._pending_suffix = suffix
        else:
            self._pending_suffix = ""
            self.ids.extend(self._encode(self.plain.turn_end, False))

    def fit(self, max_tokens: int) -> Conversation | None:
        """A new conversation of at most ``max_tokens`` ids after :meth:`add_observation`: the system
        prompt, the most recent whole turns of this one that fit (each observation and its sampled
        completion ids, as they were), and the pending observation. At least the oldest turn is
        dropped; None when not even the system prompt and the pending observation fit.

        Example:
            >>> from asyncvec.inference.tiny_models import build_char_tokenizer
            >>> tok = build_char_tokenizer()
            >>> chat = Conversation(tok, system_prompt="Play.")
            >>> for obs in ("8?", "higher", "lower"):
            ...     _ = chat.add_observation(obs)
            ...     chat.add_completion(tok("5").input_ids)
            >>> _ = chat.add_observation("higher")
            >>> len(chat), len(chat.fit(max_tokens=60))
            (103, 55)
            >>> shorter = chat.fit(max_tokens=60)
            >>> shorter.num_turns, tok.decode(shorter.ids, skip_special_tokens=True)
            (1, 'Play.\\nUser: lower\\nAssistant: 5\\nUser: higher\\nAssistant: ')
        """
        if self._observation is None:
            raise ValueError("Conversation.fit: call it after add_observation (the prompt it shortens)")
        for keep in range(self.num_turns - 1, -1, -1):
            chat = Conversation(self.tokenizer, self.system_prompt, self.plain, self.uses_template, self.encode_cache)
            for observation, token_ids, text in self._turns[self.num_turns - keep :]:
                chat.add_observation(observation)
                chat.add_completion(token_ids, text)
            chat.add_observation(self._observation)
            if len(chat.ids) <= max_tokens:
                return chat
        return None
