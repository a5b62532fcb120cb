"""Token fidelity across turns (issue 36): what the loop trains on against what the chat template renders for
the whole conversation, tool calls and tool results included.

The loop never re-tokenizes: each turn's prompt is the previous turn's prompt and completion
followed by the template's text for the new messages (`ChatRenderer.extend`), and the
completion tokens are the model's own. So:

- for replies written as the template writes them (the SFT demonstrations of `agentrl sft`, played
  by key-hunt's oracle through real Docker sandboxes), the trained ids are the template's render
  of the whole conversation, token for token, up to the template's newline after the last
  `<|im_end|>` (the model stops at its end token; nothing follows it);
- a model completion the template would write differently (JSON spacing of a tool call) is kept as
  sampled: its logprobs belong to those tokens. The documented difference: the trained ids then
  differ from the re-rendered conversation inside that completion only; every prompt part (system,
  tools, user, tool results) is still the template's.
"""

from __future__ import annotations

import asyncio

import pytest
from sandbox_backends import docker_ok

import agentrl
from agentrl.chat import ChatRenderer
from agentrl.models import ensure_model
from agentrl.rl.sft import TeacherClient, _oracle, demonstrations
from agentrl.sampling import SamplingConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300),
              pytest.mark.skipif(not docker_ok(), reason="no Docker engine")]


@pytest.fixture(scope="module")
def renderer():
    return ChatRenderer.from_pretrained(ensure_model("tiny-moe"))


def _rendered(renderer, rollout, env) -> list[int]:
    return renderer.encode(renderer.render_text(rollout.messages, tools=env.tool_schemas, add_generation_prompt=False))


def test_demonstrations_train_on_the_template_render_of_the_whole_conversation(renderer):
    env = agentrl.load_environment("key-hunt", pool_size=2)
    tasks = env.tasks("train", n=4, seed=3)
    samples = demonstrations(env, tasks, renderer=renderer, oracle=_oracle("key-hunt"), max_concurrent=2)
    assert len(samples) == 4
    for sample, task in zip(samples, tasks, strict=True):
        text = renderer.decode(sample.token_ids, skip_special_tokens=False)
        assert f'"answer": "{task.answer}"' in text and text.count("<|im_start|>tool") == 2
        trained = renderer.decode([t for t, m in zip(sample.token_ids, sample.loss_mask) if m],
                                  skip_special_tokens=False)
        assert trained.count("<tool_call>") == 3 and trained.count("<|im_end|>") == 3
    # the same episodes as rollouts, to hold the conversation: ids == the whole conversation's render
    oracle = _oracle("key-hunt")

    async def play():
        client = TeacherClient(oracle, renderer=renderer)
        try:
            return [await env.rollout(client, task, sampling=SamplingConfig(max_tokens=4096)) for task in tasks]
        finally:
            await env.aclose()
            await client.aclose()

    for rollout in asyncio.run(play()):
        assert rollout.error is None and len(rollout.turns) == 3
        whole = _rendered(renderer, rollout, env)
        ids = rollout.sample().token_ids
        newline = renderer.encode("\n")
        assert ids + newline == whole  # token for token, up to the template's newline after the last turn


def test_a_model_completion_is_trained_as_sampled(renderer):
    """A completion with other JSON spacing than the template's: kept as sampled, and the prompt parts
    around it are still the template's."""
    env = agentrl.load_environment("key-hunt")
    task = env.tasks("test", n=1, seed=0)[0]
    first = task.info["chain"][0]
    replies = iter([f'<tool_call>{{"name":"bash","arguments":{{"command":"cat {first}"}}}}</tool_call>',
                    "I stop here."])

    async def play():
        client = TeacherClient(lambda messages, tools: next(replies), renderer=renderer)
        try:
            return await env.rollout(client, task, sampling=SamplingConfig(max_tokens=4096))
        finally:
            await client.aclose()

    rollout = asyncio.run(play())
    assert rollout.error is None and len(rollout.turns) == 2
    assert rollout.messages[3].content == f"next: {task.info['chain'][1]}"  # the tool ran in the sandbox
    ids = rollout.sample().token_ids
    whole = _rendered(renderer, rollout, env)
    sampled = rollout.turns[0].completion.token_ids
    start = len(rollout.turns[0].prompt_token_ids)
    assert ids[start: start + len(sampled)] == sampled  # the model's own tokens
    assert ids[:start] == whole[:start]  # system, tools, user: the template's
    canonical = renderer.encode(renderer.assistant_text(rollout.messages[:2], rollout.messages[2],
                                                        tools=env.tool_schemas))
    assert canonical != sampled[:-1]  # the template would have spaced the JSON
    tail = len(ids) - start - len(sampled)  # the tool result and the second turn: the template's again
    assert ids[-tail:] + renderer.encode("\n") == whole[-tail - 1:]
