"""`warn_random_start` says when a created model would train from random weights (no warm start for the env)."""

from __future__ import annotations

import warnings

import pytest

from agentrl.errors import AgentrlWarning
from agentrl.rl.config import load_run_config, warn_random_start


def _warnings(**kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_random_start(load_run_config(None, **kwargs))
    return [str(w.message) for w in caught if issubclass(w.category, AgentrlWarning)]


def test_a_created_model_on_another_environment_warns_with_the_warm_start_command():
    [message] = _warnings(env="key-hunt", model="tiny-moe")
    assert message.startswith("model tiny-moe starts from random weights"), message
    assert ("`agentrl sft --set env=key-hunt --set model=tiny-moe --set output=runs/key-hunt-tiny-moe-sft`, then "
            "train with --set model.init_checkpoint=runs/key-hunt-tiny-moe-sft") in message


@pytest.mark.parametrize("kwargs", [
    {},  # reverse-text: the CPU recipe's own SFT warm start
    {"env": "key-hunt", "model": "tiny-moe", "overrides": ["model.init_checkpoint=runs/some-sft"]},
])
def test_a_warm_started_model_does_not_warn(kwargs):
    assert _warnings(**kwargs) == []
