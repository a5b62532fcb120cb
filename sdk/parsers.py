"""Parsers: pull structured fields out of model text.

- `Parser`: the base; `parse(text)` returns the text, `parse_answer(completion)` returns
  the last assistant message's text.
- `ThinkParser`: drops `<think>...</think>` reasoning (also a dangling `...</think>` when
  the chat template opened the block in the prompt) and returns what follows.
- `XMLParser(fields=["think", "answer"])`: reads `<field>...</field>` sections, tolerant
  of a missing closing tag (the section runs to the next known tag or the end);
  `parse_answer` returns the answer field of the last assistant message that has one;
  `format_reward` scores how well the assistant messages follow the tag format.

A completion is either a string or the list of messages a rollout added after the prompt.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from agentrl.errors import AgentrlError
from agentrl.types import Message

__all__ = ["Parser", "ThinkParser", "XMLParser"]

_THINK_BLOCK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)


def _assistant_texts(completion: str | Sequence[Message | dict[str, Any]]) -> list[str]:
    """The text of every assistant message, oldest first (a string counts as one)."""
    if isinstance(completion, str):
        return [completion]
    texts = []
    for message in completion:
        role = message.get("role") if isinstance(message, dict) else message.role
        content = message.get("content") if isinstance(message, dict) else message.content
        if role == "assistant":
            texts.append(content or "")
    return texts


class Parser:
    """Base parser: text in, text out."""

    def parse(self, text: str) -> Any:
        """Parse one message's text (the base returns it stripped)."""
        return text.strip()

    def parse_answer(self, completion: str | Sequence[Message | dict[str, Any]]) -> str | None:
        """The answer in a completion: the last assistant message's parsed text, or None."""
        texts = _assistant_texts(completion)
        if not texts:
            return None
        parsed = self.parse(texts[-1])
        return parsed if isinstance(parsed, str) else None

    def format_reward(self, completion: str | Sequence[Message | dict[str, Any]]) -> float:
        """1.0 when the completion has assistant text (subclasses check their format)."""
        return 1.0 if any(text.strip() for text in _assistant_texts(completion)) else 0.0

    def get_format_reward_func(self):
        """A reward function `format_reward(completion)` bound to this parser, for a Rubric."""

        def format_reward(completion) -> float:
            return self.format_reward(completion)

        return format_reward


class ThinkParser(Parser):
    """Strips `<think>...</think>` reasoning and returns the rest."""

    def parse(self, text: str) -> str:
        if "</think>" in text and "<think>" not in text.split("</think>", 1)[0]:
            text = text.split("</think>", 1)[1]  # the template opened <think> in the prompt
        return _THINK_BLOCK.sub("", text).strip()

    def format_reward(self, completion: str | Sequence[Message | dict[str, Any]]) -> float:
        """Share of assistant messages whose think block is closed and followed by an answer."""
        texts = _assistant_texts(completion)
        if not texts:
            return 0.0
        good = 0
        for text in texts:
            opened = text.count("<think>")
            closed = text.count("</think>")
            if closed >= 1 and opened <= closed and text.rsplit("</think>", 1)[1].strip():
                good += 1
        return good / len(texts)


class XMLParser(Parser):
    """Reads `<field>value</field>` sections; each field may list alternative tag names."""

    def __init__(self, fields: Sequence[str | Sequence[str]], *, answer_field: str | None = None) -> None:
        if not fields:
            raise AgentrlError("XMLParser: give at least one field, e.g. XMLParser(fields=['answer'])")
        self.fields: list[tuple[str, ...]] = []
        for field in fields:
            names = (field,) if isinstance(field, str) else tuple(field)
            for name in names:
                if not re.fullmatch(r"[A-Za-z_][\w\-]*", name):
                    raise AgentrlError(f"XMLParser: field {name!r} is not a valid tag name")
            self.fields.append(names)
        self.answer_field = answer_field or (
            "answer" if any("answer" in f for f in self.fields) else self.fields[-1][0]
        )
        all_names = [name for names in self.fields for name in names]
        self._any_open = re.compile("|".join(f"<{re.escape(n)}>" for n in all_names))

    def _canonical(self, name: str) -> str:
        for names in self.fields:
            if name in names:
                return names[0]
        return name

    def parse(self, text: str) -> dict[str, str | None]:
        """Map each field's first tag name to its last value in the text (None when absent)."""
        result: dict[str, str | None] = {names[0]: None for names in self.fields}
        for names in self.fields:
            for name in names:
                value = self._last_value(text, name)
                if value is not None:
                    result[names[0]] = value
                    break
        return result

    def _last_value(self, text: str, name: str) -> str | None:
        opening = f"<{name}>"
        start = text.rfind(opening)
        if start < 0:
            return None
        body = text[start + len(opening):]
        closing = body.find(f"</{name}>")
        if closing >= 0:
            return body[:closing].strip()
        following = self._any_open.search(body)  # tolerate a missing closing tag
        return (body[: following.start()] if following else body).strip()

    def parse_answer(self, completion: str | Sequence[Message | dict[str, Any]]) -> str | None:
        """The answer field of the last assistant message that has one, else None."""
        key = self._canonical(self.answer_field)
        for text in reversed(_assistant_texts(completion)):
            value = self.parse(text).get(key)
            if value is not None:
                return value
        return None

    def format(self, **values: str) -> str:
        """Render field values as tagged text, in field order (the inverse of `parse`)."""
        known = {names[0] for names in self.fields}
        unknown = sorted(set(values) - known)
        if unknown:
            raise AgentrlError(f"XMLParser.format: unknown field(s) {', '.join(unknown)}; fields are {sorted(known)}")
        return "\n".join(
            f"<{names[0]}>\n{values[names[0]]}\n</{names[0]}>" for names in self.fields if names[0] in values
        )

    def _message_format_score(self, text: str) -> float:
        present = 0
        well_formed = 0
        for names in self.fields:
            for name in names:
                if f"<{name}>" in text:
                    present += 1
                    if re.search(rf"<{re.escape(name)}>.*?</{re.escape(name)}>", text, re.DOTALL):
                        well_formed += 1
                    break
        if present == 0:
            return 0.0
        return well_formed / present

    def format_reward(self, completion: str | Sequence[Message | dict[str, Any]]) -> float:
        """Mean over assistant messages of the share of used fields with both tags (0 when none used)."""
        texts = _assistant_texts(completion)
        if not texts:
            return 0.0
        return sum(self._message_format_score(text) for text in texts) / len(texts)
