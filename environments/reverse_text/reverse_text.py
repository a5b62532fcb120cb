"""reverse-text: reverse a short lowercase text, character by character (single turn).

Rows are generated deterministically from a seed: 1-4 short common words, at most 24
characters (`min_words`, `max_words`, `max_chars` make longer texts), so that a tiny character-level
model can learn the task with RL. The reply is
the reversed text, optionally inside `<answer>...</answer>` (think blocks are ignored);
the reward is difflib's LCS ratio between the reply and the reversed text, so partial
reversals earn partial credit.
"""

from __future__ import annotations

import difflib
import random

from agentrl.environment import SingleTurnEnv, rows_to_dataset
from agentrl.parsers import ThinkParser, XMLParser
from agentrl.policies import ScriptedPolicy
from agentrl.rubric import Rubric

SYSTEM_PROMPT = "Reverse the text character by character. Reply with the reversed text only."
MAX_CHARS = 24
WORDS = ["a", "able", "about", "act", "add", "age", "ago", "air", "all", "and", "any", "arm", "art", "ask", "away", "back", "bad", "bag", "ball", "bank", "bed", "best", "big", "bird", "blue", "boat", "body", "book", "box", "boy", "bus", "buy", "cake", "call", "car", "card", "care", "cat", "city", "cold", "come", "cook", "cool", "cup", "cut", "dark", "day", "deep", "desk", "dog", "door", "down", "draw", "dry", "duck", "each", "ear", "east", "easy", "eat", "egg", "end", "eye", "face", "fall", "far", "farm", "fast", "fish", "five", "fly", "food", "foot", "fox", "free", "fun", "game", "gift", "girl", "give", "glad", "go", "gold", "good", "green", "hand", "hat", "head", "hill", "home", "hot", "idea", "ink", "jam", "job", "joy", "jump", "key", "kid", "king", "lake", "lamp", "land", "last", "late", "leaf", "left", "leg", "life", "light", "line", "lion", "long", "look", "love", "low", "map", "milk", "moon", "near", "nest", "net", "new", "nice", "night", "nine", "nose", "note", "oak", "old", "one", "open", "pan", "park", "pen", "pig", "pink", "plan", "play", "pot", "rain", "red", "rice", "ring", "road", "rock", "room", "rose", "run", "sand", "sea", "seed", "ship", "shoe", "sing", "sky", "slow", "snow", "song", "star", "stop", "sun", "tall", "tea", "ten", "tree", "two", "up", "van", "warm", "water", "way", "wet", "wind", "wing", "wolf", "word", "yes", "zoo"]

_answer_parser = XMLParser(fields=["answer"])
_think_parser = ThinkParser()


MAX_WORDS = 4


def make_text(rng: random.Random, *, min_words: int = 1, max_words: int = MAX_WORDS, max_chars: int = MAX_CHARS) -> str:
    """`min_words` to `max_words` random words joined by spaces, at most `max_chars` characters."""
    while True:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
        if len(text) <= max_chars:
            return text


def make_rows(count: int, *, seed: int, exclude: set[str] = frozenset(), split: str = "train",
              min_words: int = 1, max_words: int = MAX_WORDS, max_chars: int = MAX_CHARS) -> list[dict]:
    """`count` distinct rows (texts in `exclude` are skipped), deterministic in `seed`."""
    rng = random.Random(seed)
    rows: list[dict] = []
    seen = set(exclude)
    attempts = 0
    while len(rows) < count:
        attempts += 1
        if attempts > count * 200:
            raise ValueError(f"cannot make {count} distinct texts from the word list")
        text = make_text(rng, min_words=min_words, max_words=max_words, max_chars=max_chars)
        if text in seen:
            continue
        seen.add(text)
        rows.append({
            "prompt": [{"role": "user", "content": text}],
            "answer": text[::-1],
            "info": {"text": text, "split": split},
            "task": "reverse-text",
            "example_id": f"{split}-{len(rows)}",
        })
    return rows


def build_dataset(*, num_train: int = 2000, num_test: int = 200, seed: int = 0,
                  min_words: int = 1, max_words: int = MAX_WORDS, max_chars: int = MAX_CHARS) -> dict:
    """Train and test splits as `datasets.Dataset`s; no test text appears in train."""
    longest = max(len(w) for w in WORDS)
    if not 1 <= min_words <= max_words or max_chars < min_words * (longest + 1) - 1:
        raise ValueError(f"reverse-text: min_words={min_words}, max_words={max_words}, max_chars={max_chars}: "
                         f"need 1 <= min_words <= max_words and max_chars >= {longest + 1} * min_words - 1 "
                         "(room for min_words of the longest word)")
    lengths = {"min_words": min_words, "max_words": max_words, "max_chars": max_chars}
    test_rows = make_rows(num_test, seed=seed + 1, split="test", **lengths)
    train_rows = make_rows(num_train, seed=seed, exclude={r["info"]["text"] for r in test_rows}, split="train",
                           **lengths)
    return {"train": rows_to_dataset(train_rows), "test": rows_to_dataset(test_rows)}


def parse_reply(completion) -> str:
    """The reply's answer: inside <answer> tags if present, else the whole text (think removed)."""
    tagged = _answer_parser.parse_answer(completion)
    if tagged is not None:
        return tagged
    reply = _think_parser.parse_answer(completion)
    return reply or ""


def lcs_reward(completion, answer: str) -> float:
    """difflib's LCS ratio between the parsed reply and the reversed text."""
    return difflib.SequenceMatcher(None, parse_reply(completion), answer, autojunk=False).ratio()


def exact_match(completion, answer: str) -> float:
    """1.0 when the reply is exactly the reversed text (a metric, weight 0)."""
    return float(parse_reply(completion) == answer)


def oracle_policy() -> ScriptedPolicy:
    """A policy that always answers correctly (reverses the last user message)."""
    return ScriptedPolicy(lambda messages, tools: messages[-1].content[::-1], name="reverse-text-oracle")


def load_environment(
    *, num_train: int = 2000, num_test: int = 200, seed: int = 0, system_prompt: str = SYSTEM_PROMPT,
    min_words: int = 1, max_words: int = MAX_WORDS, max_chars: int = MAX_CHARS,
) -> SingleTurnEnv:
    """The reverse-text environment (`min_words`/`max_words`/`max_chars`: longer texts, a harder task)."""
    splits = build_dataset(num_train=num_train, num_test=num_test, seed=seed, min_words=min_words,
                           max_words=max_words, max_chars=max_chars)
    rubric = Rubric(funcs=[lcs_reward, exact_match], weights=[1.0, 0.0], parser=_answer_parser)
    return SingleTurnEnv(
        name="reverse-text", dataset=splits["train"], eval_dataset=splits["test"],
        rubric=rubric, parser=_answer_parser, system_prompt=system_prompt,
    )
