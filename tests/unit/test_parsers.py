"""Parsers: XML fields (missing closing tags, alternatives), think blocks, format rewards."""

from __future__ import annotations

import pytest

from agentrl.errors import AgentrlError
from agentrl.parsers import Parser, ThinkParser, XMLParser
from agentrl.types import Message


def _assistant(*texts: str) -> list[Message]:
    messages: list[Message] = []
    for text in texts:
        messages += [Message(role="assistant", content=text), Message(role="user", content="next")]
    return messages[:-1]


def test_xml_parse_fields_and_missing_ones():
    parser = XMLParser(fields=["think", "answer"])
    parsed = parser.parse("<think>\nsum it\n</think>\n<answer> 7 </answer>")
    assert parsed == {"think": "sum it", "answer": "7"}
    assert parser.parse("just text") == {"think": None, "answer": None}


def test_xml_tolerates_missing_closing_tags():
    parser = XMLParser(fields=["think", "answer"])
    assert parser.parse("<think>hmm <answer>12") == {"think": "hmm", "answer": "12"}
    assert parser.parse("<answer>12\n") == {"think": None, "answer": "12"}


def test_xml_last_value_wins_and_alternatives():
    parser = XMLParser(fields=[("code", "python"), "answer"])
    assert parser.parse("<python>print(1)</python>")["code"] == "print(1)"
    assert parser.parse("<answer>1</answer> wait <answer>2</answer>")["answer"] == "2"


def test_xml_parse_answer_uses_last_assistant_message_with_the_field():
    parser = XMLParser(fields=["think", "answer"])
    messages = _assistant("<answer>first</answer>", "<think>no answer here</think>")
    assert parser.parse_answer(messages) == "first"
    assert parser.parse_answer(_assistant("<answer>a</answer>", "<answer>b</answer>")) == "b"
    assert parser.parse_answer([Message(role="user", content="<answer>x</answer>")]) is None
    assert parser.parse_answer("<answer>s</answer>") == "s"
    assert parser.parse_answer([{"role": "assistant", "content": "<answer>d</answer>"}]) == "d"


def test_xml_format_and_round_trip():
    parser = XMLParser(fields=["think", "answer"])
    text = parser.format(think="a", answer="b")
    assert text == "<think>\na\n</think>\n<answer>\nb\n</answer>"
    assert parser.parse(text) == {"think": "a", "answer": "b"}
    with pytest.raises(AgentrlError, match="unknown field"):
        parser.format(verdict="x")


def test_xml_format_reward():
    parser = XMLParser(fields=["think", "answer"])
    assert parser.format_reward("<think>x</think><answer>1</answer>") == 1.0
    assert parser.format_reward("<answer>1") == 0.0
    assert parser.format_reward("<think>x</think><answer>1") == 0.5
    assert parser.format_reward("plain") == 0.0
    assert parser.format_reward(_assistant("<answer>1</answer>", "plain")) == 0.5
    reward = parser.get_format_reward_func()
    assert reward.__name__ == "format_reward" and reward("<answer>1</answer>") == 1.0


def test_xml_rejects_bad_fields():
    with pytest.raises(AgentrlError, match="at least one field"):
        XMLParser(fields=[])
    with pytest.raises(AgentrlError, match="not a valid tag name"):
        XMLParser(fields=["a b"])


def test_think_parser_strips_reasoning():
    parser = ThinkParser()
    assert parser.parse("<think>long\nreasoning</think>\nthe answer") == "the answer"
    assert parser.parse("reasoning opened by the template</think> ok") == "ok"
    assert parser.parse("<think>never closed") == ""
    assert parser.parse("no think at all") == "no think at all"
    assert parser.parse_answer(_assistant("<think>a</think>one", "<think>b</think>two")) == "two"


def test_think_format_reward():
    parser = ThinkParser()
    assert parser.format_reward("<think>a</think>done") == 1.0
    assert parser.format_reward("<think>a</think>") == 0.0
    assert parser.format_reward("<think>unclosed answer") == 0.0
    assert parser.format_reward(_assistant("<think>a</think>x", "y")) == 0.5


def test_base_parser():
    parser = Parser()
    assert parser.parse_answer(_assistant("  hi  ")) == "hi"
    assert parser.parse_answer([]) is None
    assert parser.format_reward("") == 0.0 and parser.format_reward("x") == 1.0
