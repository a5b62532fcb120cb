"""Prefill/decode with Router Replay on CUDA vLLM (issue 35 items 3 and 4; skipped without a GPU).

A prefill and a decode server of float32 tiny-moe share the GPU, joined by vLLM's NixlConnector (NIXL over UCX,
`inference.kv_connector = "nixl"`; the `kv` group of scripts/gpu-extra-wheels.txt) or agentrl's folder connector
(`"example"`, `inference/vllm_plugin/pd_folder_connector.py`); agentrl's plugin lifts vLLM's refusal of routed
experts with them (`routed_offload`), and the token client makes the two calls and
stitches the prompt's routing from the prefill answer (`sdk/clients/prefill_decode.py`). The decode server must
load the prompt (vLLM's external prefix-cache hit counter moves), the answer must equal one server's without a
connector, and the stitched routing must agree with that server's on at least 99.9% of (token, MoE layer) expert
sets, with no token unknown but the completion's last (no forward pass takes it in, on either server). The CPU
twin is `tests/integration/test_prefill_decode.py`; `scripts/gpu_run.sh features` runs this one.
"""

from __future__ import annotations

import asyncio
import random
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.gpu.server_logs import kv_connector_lines

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_feature, pytest.mark.integration, pytest.mark.timeout(600)]
torch = pytest.importorskip("torch")


HITS = "vllm:external_prefix_cache_hits"
"""Prompt tokens a KV connector loaded (vLLM's counter)."""


def _generate(url, tokens, *, prefill_url=None):
    from agentrl.clients.token_client import TokenClient
    from agentrl.sampling import SamplingConfig

    async def run():
        async with TokenClient(url, model="tiny-moe", prefill_url=prefill_url, coalesce=False) as client:
            completion, prompt = await client.generate(tokens, sampling=SamplingConfig(max_tokens=8, temperature=0.0,
                                                                                       ignore_eos=True))
            return completion, prompt, client.prefill_stitch

    return asyncio.run(run())


@pytest.mark.parametrize("connector", ["nixl", "example"])
def test_pd_routing_stitched_by_the_client_equals_one_servers(connector, tmp_path):
    import numpy as np

    from agentrl.inference.deployment import InferenceConfig
    from agentrl.inference.routed_experts import routing_agreement
    from agentrl.inference.server_metrics import fetch_metric_sums
    from agentrl.models import ensure_model
    from agentrl.rl.inference_actor import replica_server

    model_dir = Path(ensure_model("tiny-moe"))
    prompt = [random.Random(0).randrange(3, 120) for _ in range(320)]
    deployment = InferenceConfig(device="gpu", gpu_memory_utilization=0.15, max_model_len=512, max_num_seqs=4,
                                  routed_experts=True, fp8=False, fp8_kv_cache=False, kv_connector=connector,
                                  kv_offload_dir=str(tmp_path / "kv"))
    with ExitStack() as stack:
        servers = {}
        for role in ("prefill", "decode", None):
            config = deployment if role else deployment.model_copy(update={"kind": "single"})
            server = replica_server(config, model_dir, served_name="tiny-moe", dtype="float32", role=role,
                                    log_path=tmp_path / f"{role or 'single'}.log")
            servers[role] = stack.enter_context(server)
        before = fetch_metric_sums(servers["decode"].url, HITS)[HITS]
        split, split_prompt, stitch = _generate(servers["decode"].url, prompt, prefill_url=servers["prefill"].url)
        loaded = fetch_metric_sums(servers["decode"].url, HITS)[HITS] - before
        whole, whole_prompt, _ = _generate(servers[None].url, prompt)
    stitched = np.concatenate([split_prompt.array, split.routed_experts.array])
    reference = np.concatenate([whole_prompt.array, whole.routed_experts.array])
    moe_layers = [layer for layer in range(reference.shape[1]) if reference[:, layer].any()]
    # The completion's last token is sampled and never taken in by a forward pass, on either server: no routing.
    assert (reference[-1, moe_layers] < 0).all() and (stitched[-1, moe_layers] < 0).all()
    stitched, reference = stitched[:-1], reference[:-1]
    unknown = int((stitched[:, moe_layers] < 0).any(axis=(1, 2)).sum())
    agreement = routing_agreement(stitched[:, moe_layers], reference[:, moe_layers])
    print(f"P/D: {loaded:.0f} prompt tokens loaded by the decode server, {stitch.stitched_tokens} stitched from the "
          f"prefill answer; routing agrees with one server's on {agreement:.5f} of (token, layer) sets, {unknown} "
          f"tokens unknown; answers {'equal' if split.token_ids == whole.token_ids else 'differ'}")
    assert loaded >= 256, ("the decode server computed the prompt itself: the test shows nothing; what the servers "
                           "said of their KV connector:\n" + "\n".join(
                               f"--- {role}:\n{kv_connector_lines(tmp_path / f'{role}.log', limit_chars=3000)}"
                               for role in ("prefill", "decode")))
    differ = np.sort(stitched[:, moe_layers], axis=-1) != np.sort(reference[:, moe_layers], axis=-1)
    where = (f"prompt of {len(prompt)} tokens; tokens whose rows differ from one server's: "
             f"{np.nonzero(differ.any(axis=(1, 2)))[0].tolist()[:40]}; unknown: "
             f"{np.nonzero((stitched[:, moe_layers] < 0).any(axis=(1, 2)))[0].tolist()[:40]}")
    assert unknown == 0 and stitch.version_mismatches == 0, where
    assert agreement >= 0.999, where
