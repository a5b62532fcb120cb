"""Chat rendering with a model's own tokenizer, and tool-call parsing of completion text.

`ChatRenderer` turns messages (and tool schemas) into prompt token ids with the
tokenizer's chat template. For multi-turn rollouts it never re-tokenizes what the model
already saw or produced: `extend(previous_ids, messages, last_assistant=k)` renders only
what the template writes after assistant message k (its closing markup, the new messages,
the generation prompt) and appends those tokens, without repeating end-of-turn special
tokens the model already generated.

`parse_tool_calls(text)` reads hermes-style `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` blocks (the format of the tiny-moe template, Qwen and many others) into
`ToolCall`s and returns the remaining text as the message content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError, require
from agentrl.types import FunctionCall, Message, ToolCall, untrusted_json

__all__ = ["ChatRenderer", "assistant_message", "parse_tool_calls", "unparsed_tool_calls"]

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_SENTINEL = "\u2063AGENTRL\u2063"
_REMEMBERED = 256  # conversations (texts, token ids) a renderer remembers: a group's rollouts render the same prompt


def _remembered(cache: OrderedDict, key: Any, compute: Any) -> Any:
    """`cache[key]`, computed by `compute()` the first time; the `_REMEMBERED` latest keys are kept."""
    value = cache.get(key)
    if value is None:
        value = cache[key] = compute()
        if len(cache) > _REMEMBERED:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return value


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split completion text into (content, tool calls); malformed blocks stay in the content."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            payload = untrusted_json(match.group(1))
            name = payload["name"]
            arguments = payload.get("arguments", payload.get("parameters", {}))
            if not isinstance(name, str) or not isinstance(arguments, (dict, str)):
                raise ValueError("bad tool call")
            arguments_json = arguments if isinstance(arguments, str) else json.dumps(arguments)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # left in the text: the environment sees what the model wrote
        kept.append(text[position: match.start()])
        position = match.end()
        calls.append(ToolCall(
            id=f"call_{uuid.uuid4().hex[:12]}", function=FunctionCall(name=name, arguments=arguments_json),
        ))
    kept.append(text[position:])
    return "".join(kept).strip(), calls


def unparsed_tool_calls(content: str) -> int:
    """`<tool_call>` blocks left in an assistant message's content: those `parse_tool_calls` could not read
    (bad JSON, no name, no closing tag because the completion was cut); parsed ones are not in the content."""
    return content.count("<tool_call>")


def assistant_message(text: str, *, parse_tools: bool = True) -> Message:
    """The assistant Message for a completion text, with parsed tool calls."""
    if not parse_tools:
        return Message(role="assistant", content=text)
    content, calls = parse_tool_calls(text)
    return Message(role="assistant", content=content, tool_calls=calls or None)


class ChatRenderer:
    """Renders chat messages into token ids with a model's tokenizer and chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise AgentrlError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
                "use a chat/instruct model or add chat_template.jinja to the model folder"
            )
        self._closing: str | None = None
        self._encoded: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._rendered: OrderedDict[str, str] = OrderedDict()

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatRenderer:
        """Load the tokenizer of a local model folder."""
        transformers = require("transformers", "cpu")
        return cls(transformers.AutoTokenizer.from_pretrained(str(path)))

    # ------------------------------------------------------------------ text
    @staticmethod
    def _dicts(messages: list[Message] | list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [m.to_openai() if isinstance(m, Message) else dict(m) for m in messages]

    def render_text(
        self, messages: list[Message] | list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template's text for `messages`; tool results and tool schemas as plain text (`plain_text`)."""
        dicts = [{**message, "content": self.plain_text(message.get("content"))} if message.get("role") == "tool"
                 else message for message in self._dicts(messages)]
        return self.tokenizer.apply_chat_template(
            dicts, tools=self.plain_text(tools) or None, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def plain_text(self, value: Any) -> Any:
        """`value` (a string, or lists and dicts of them) with the text of every special or added token broken after
        its first character (a zero-width space, or a space where the tokenizer has none), so that it is tokenized as
        text. What a sandbox or a tool server wrote (tool results, MCP tool descriptions) otherwise became the
        template's own tokens in the next prompt: a tool output holding `<|im_end|>\\n<|im_start|>user` forged a
        user turn, in the context and the training data (red team, 2026-12-07). Other messages (the task's prompt,
        the model's own replies) are left as written."""
        if not hasattr(self, "_added_pattern"):
            strings = {str(token) for token in getattr(self.tokenizer, "all_special_tokens", []) or []}
            strings |= {str(getattr(token, "content", token))
                        for token in (getattr(self.tokenizer, "added_tokens_decoder", {}) or {}).values()}
            strings = sorted((text for text in strings if len(text) > 1), key=len, reverse=True)
            self._added_pattern = re.compile("|".join(map(re.escape, strings))) if strings else None
            # a zero-width space where the tokenizer writes it back (byte-level ones do), else a plain space
            ids = self.tokenizer("a\u200bb", add_special_tokens=False)["input_ids"]
            self._breaker = "\u200b" if self.tokenizer.decode(ids) == "a\u200bb" else " "
        if self._added_pattern is None or value is None:
            return value
        if isinstance(value, str):
            return self._added_pattern.sub(lambda match: match.group()[0] + self._breaker + match.group()[1:], value)
        if isinstance(value, list):
            return [self.plain_text(item) for item in value]
        if isinstance(value, dict):
            return {key: self.plain_text(item) for key, item in value.items()}
        return value

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (special tokens are written in the text).

        The latest texts are remembered: a group's rollouts render the same prompt.
        """
        return list(_remembered(self._encoded, text, lambda: tuple(
            self.tokenizer(text, add_special_tokens=False)["input_ids"])))

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render(
        self, messages: list[Message] | list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Prompt token ids for a whole conversation, ending with the generation prompt.

        The latest conversations are remembered (keyed by their JSON and the tools): the rollouts of
        a group render the same first prompt, and the template costs more than the key. Extending a
        turn (`new_text`) renders fresh: its conversations are each new."""
        dicts = self._dicts(messages)
        key = json.dumps([dicts, tools or None], ensure_ascii=False)
        return self.encode(_remembered(self._rendered, key, lambda: self.render_text(dicts, tools=tools)))

    # ------------------------------------------------------------------ extension
    def special_ids(self) -> set[int]:
        """Ids of special tokens: the named ones and every added token flagged special."""
        if not hasattr(self, "_special"):
            ids = set(getattr(self.tokenizer, "all_special_ids", []) or [])
            for token_id, token in (getattr(self.tokenizer, "added_tokens_decoder", {}) or {}).items():
                if getattr(token, "special", False):
                    ids.add(int(token_id))
            self._special = ids
        return self._special

    def assistant_closing(self) -> str:
        """The text the template writes after an assistant message's content (e.g. '<|im_end|>\\n')."""
        if self._closing is None:
            conversation = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
            text = self.render_text(conversation, add_generation_prompt=False)
            index = text.rfind(_SENTINEL)
            if index < 0:
                raise AgentrlError("chat template drops assistant content; cannot extend turns")
            self._closing = text[index + len(_SENTINEL):]
        return self._closing

    def assistant_text(
        self, messages: list[Message] | list[dict[str, Any]], reply: Message | dict[str, Any], *,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The text the template writes for `reply` after `messages` and the generation prompt, without the
        closing markup: content and tool calls as a model following the template generates them."""
        dicts = self._dicts(messages)
        head = self.render_text(dicts, tools=tools, add_generation_prompt=True)
        full = self.render_text(dicts + self._dicts([reply]), tools=tools, add_generation_prompt=False)
        closing = self.assistant_closing()
        if not (full.startswith(head) and full.endswith(closing)):
            raise AgentrlError("chat template renders an assistant reply other than after its generation prompt; "
                               "cannot write the reply's text")
        return full[len(head): len(full) - len(closing)]

    def new_text(
        self, messages: list[Message] | list[dict[str, Any]], *, last_assistant: int,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """What the template writes after the content of the assistant message at `last_assistant`.

        That is the assistant's closing markup (e.g. `<|im_end|>\\n`), the messages added since,
        and the generation prompt.
        """
        dicts = self._dicts(messages)
        if dicts[last_assistant].get("role") != "assistant":
            raise ValueError(f"message {last_assistant} is not an assistant message")
        head = self.render_text(dicts[: last_assistant + 1], tools=tools, add_generation_prompt=False)
        full = self.render_text(dicts, tools=tools, add_generation_prompt=True)
        if not full.startswith(head):
            raise AgentrlError(
                "chat template re-renders earlier messages differently when new ones are added; "
                "multi-turn token extension needs a prefix-stable template"
            )
        return self.assistant_closing() + full[len(head):]

    def extend(
        self, previous_ids: list[int], messages: list[Message] | list[dict[str, Any]], *,
        last_assistant: int, tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """`previous_ids` (last prompt + its completion) followed by the new messages' tokens.

        The model's own end-of-turn tokens are kept: where the completion already ends with
        special tokens the template would write next (`<|im_end|>` in ChatML, `<|observation|>`
        in GLM's template), they are not added again. Only special tokens can overlap, so a
        completion cut by the length limit never merges with the template's text.
        """
        added = self.encode(self.new_text(messages, last_assistant=last_assistant, tools=tools))
        special = self.special_ids()
        overlap = 0
        for size in range(min(len(added), len(previous_ids)), 0, -1):
            head = added[:size]
            if all(token in special for token in head) and list(previous_ids[-size:]) == head:
                overlap = size
                break
        return list(previous_ids) + added[overlap:]
