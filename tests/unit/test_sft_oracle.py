"""`agentrl sft`'s oracle: the environment package's oracle_policy, built with the config's `oracle_args`."""

from __future__ import annotations

import pytest

from agentrl.errors import AgentrlError
from agentrl.rl.sft import SFTConfig, _oracle, run_sft
from agentrl.types import Message


def test_oracle_args_reach_the_packages_oracle_policy():
    def first_reply(oracle):
        prompt = [Message(role="user", content="Begin with the file start.")]
        return oracle(prompt, None), oracle([*prompt, Message(role="assistant", content=""),
                                             Message(role="tool", content="next: a/f1", name="bash")], None)

    plain = first_reply(_oracle("key-hunt"))
    guessing = first_reply(_oracle("key-hunt", guess_rate=1.0))
    assert plain[0].tool_calls[0].function.name == guessing[0].tool_calls[0].function.name == "bash"
    assert plain[1].tool_calls[0].function.name == "bash"  # follows the clue
    assert guessing[1].tool_calls[0].function.name == "submit"  # gives up after the first file


def test_bad_oracle_args_are_one_line():
    with pytest.raises(AgentrlError, match=r"oracle_args \{'rate': 1\}: key-hunt's oracle_policy does not take them"):
        _oracle("key-hunt", rate=1)
    with pytest.raises(AgentrlError, match=r"oracle_args \{'guess_rate': 0.5\}: reverse-text's oracle_policy does not"):
        run_sft(SFTConfig(env="reverse-text", oracle_args={"guess_rate": 0.5}, steps=1, batch_size=1))
