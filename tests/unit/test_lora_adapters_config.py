"""`inference.lora_adapters`: what a run that serves its LoRA adapter by name refuses in one line at config load,
and what it sets (a folder transport)."""

from __future__ import annotations

import pytest

from agentrl.errors import ConfigError
from agentrl.rl.config import load_run_config

LORA = 'trainer.lora={rank=4, alpha=8, targets=["attention", "shared_experts"]}'


@pytest.mark.parametrize(("overrides", "match"), [
    (["inference.lora_adapters=true"], r"inference\.lora_adapters: the run trains no adapters; set trainer\.lora"),
    (["inference.lora_adapters=true", 'trainer.lora={rank=4, alpha=8}'],
     r"trainer\.lora\.targets: vLLM serves adapters on routed experts only on GPUs"),
    (["inference.lora_adapters=true", LORA, 'inference.weight_transfer="nccl"'],
     r"lora_adapters with weight_transfer='nccl': an adapter is loaded from a folder"),
])
def test_what_cannot_serve_an_adapter_is_refused_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_run_config(overrides=overrides)
    assert "\n" not in str(info.value)


def test_an_adapter_travels_as_a_folder():
    config = load_run_config(overrides=["inference.lora_adapters=true", LORA, 'inference.device="gpu"'])
    assert config.inference.transport().name == "filesystem"
    assert load_run_config(overrides=[LORA, 'inference.device="gpu"']).inference.transport().name == "nccl"


@pytest.mark.parametrize(("overrides", "match"), [
    (['inference.base_url="http://127.0.0.1:8000"'], r"inference\.base_url: a shared server serves each run's LoRA"),
    ([LORA, "inference.lora_adapters=true", 'inference.base_url="127.0.0.1:8000"'],
     r"inference\.base_url: '127\.0\.0\.1:8000' is not an http\(s\) URL"),
    ([LORA, "inference.lora_adapters=true", 'inference.base_url="http://127.0.0.1:8000"', "launch.colocate=true"],
     r"inference\.base_url: the run starts no server to colocate with"),
])
def test_what_cannot_share_a_server_is_refused_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_run_config(overrides=overrides)
    assert "\n" not in str(info.value)


def test_serve_lora_values_are_one_line(capsys):
    from agentrl.cli import main

    code = main(["serve", "--lora", "8", "--lora-targets", "attention,everything"])
    said = capsys.readouterr().err.strip()
    assert code == 2 and said.count("\n") == 0 and "--lora-targets attention,everything" in said, said
    code = main(["serve", "--lora", "8", "--lora-targets", "attention,experts"])  # MoE LoRA needs CUDA
    said = capsys.readouterr().err.strip()
    assert code == 2 and "vLLM serves adapters on routed experts only on GPUs" in said, said
