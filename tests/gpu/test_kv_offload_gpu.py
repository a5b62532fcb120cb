"""Router Replay through vLLM's native KV offload on CUDA (issue 35 item 4; skipped without a GPU).

vLLM refuses `--enable-return-routed-experts` with a KV connector; agentrl's plugin lifts that for offload and
stitches the rows of blocks the connector loads (`inference/vllm_plugin/routed_offload.py`). Here a float32
tiny-moe server with a GPU KV cache of 48 blocks and 1 GiB of CPU offload answers a first turn, other prompts push
that turn's blocks out of the GPU cache, and the second turn (the first turn's tokens and more) gets its prefix
back through the connector (vLLM's external prefix-cache hit counter moves). Its routing must agree with the
routing a server without any connector computes for the whole sequence on at least 99.9% of (token, MoE layer)
expert sets, with no token unknown. The same through the Mooncake store (`kv_offload = "mooncake"`, a
`mooncake_master` agentrl starts, TCP, `MooncakeStoreConnector`; skipped without the Mooncake wheel).
`scripts/gpu_run.sh features` runs it (outside the one-GPU check's tests).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.gpu.server_logs import kv_connector_lines

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_feature, pytest.mark.integration, pytest.mark.timeout(600)]
torch = pytest.importorskip("torch")

BLOCK_BYTES = 16 * 4 * 2 * 2 * 32 * 4  # tokens per block x layers x (K, V) x KV heads x head dim x float32


def _server(model_dir, *, offload: str | None, mooncake_config: Path | None = None, log_path: Path | None = None):
    from agentrl.inference.deployment import InferenceConfig
    from agentrl.rl.inference_actor import replica_server

    deployment = InferenceConfig(device="gpu", gpu_memory_utilization=0.2, max_model_len=512, max_num_seqs=4,
                                  routed_experts=True, fp8=False, fp8_kv_cache=False,
                                  kv_offload=offload or "none", kv_offload_gb=1.0,
                                  kv_cache_memory_bytes=48 * BLOCK_BYTES if offload else None)
    server = replica_server(deployment, Path(model_dir), served_name="tiny-moe", dtype="float32", log_path=log_path)
    if mooncake_config is not None:
        server.env["MOONCAKE_CONFIG_PATH"] = str(mooncake_config)
    return server


def _generate(url, tokens, *, max_tokens):
    import httpx

    from agentrl.routed import decode_routed_experts_array

    body = {"token_ids": tokens, "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
    response = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice["token_ids"], decode_routed_experts_array(choice["routed_experts"])


CACHE_COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
                  "vllm:external_prefix_cache_hits")
"""The server's prefix-cache counters, in tokens: the local GPU cache's and the KV connector's ("external")."""


@pytest.mark.parametrize("offload", ["cpu", "mooncake"])
def test_routing_through_kv_offload_equals_the_routing_computed_whole(offload, tmp_path):
    from contextlib import ExitStack

    from agentrl.inference.routed_experts import routing_agreement
    from agentrl.inference.server_metrics import fetch_metric_sums
    from agentrl.models import ensure_model

    stack = ExitStack()
    mooncake_config = None
    if offload == "mooncake":
        pytest.importorskip("mooncake.store", reason="no Mooncake wheel (scripts/gpu-extra-wheels.txt, group kv)")
        from agentrl.inference.mooncake_master import MooncakeMaster, write_client_config

        master = stack.enter_context(MooncakeMaster(log_path=tmp_path / "mooncake_master.log"))
        mooncake_config = write_client_config(tmp_path / "mooncake.json", master_address=master.address,
                                              global_segment_bytes=2**30)
    model_dir = ensure_model("tiny-moe")
    rng = random.Random(0)
    first = [rng.randrange(3, 120) for _ in range(320)]
    others = [[rng.randrange(3, 120) for _ in range(320)] for _ in range(6)]
    log_path = tmp_path / "vllm-offload.log"
    with stack, _server(model_dir, offload=offload, mooncake_config=mooncake_config, log_path=log_path) as server:
        completion, _ = _generate(server.url, first, max_tokens=16)
        for prompt in others:  # 6 x 320 tokens through a 768-token GPU cache: the first turn's blocks leave it
            _generate(server.url, prompt, max_tokens=1)
        second = first + completion + [7, 11, 13, 17, 19]
        before = fetch_metric_sums(server.url, *CACHE_COUNTERS)
        answer, stitched = _generate(server.url, second, max_tokens=8)
        after = fetch_metric_sums(server.url, *CACHE_COUNTERS)
    moved = {name.removeprefix("vllm:"): after[name] - before[name] for name in CACHE_COUNTERS}
    loaded = moved["external_prefix_cache_hits"]
    with _server(model_dir, offload=None) as server:
        answer_whole, whole = _generate(server.url, second, max_tokens=8)
    assert stitched.shape == whole.shape == (len(second) + len(answer) - 1, *whole.shape[1:]), (stitched.shape,
                                                                                                whole.shape)
    moe_layers = [layer for layer in range(whole.shape[1]) if whole[:, layer].any()]
    unknown = int((stitched[:, moe_layers] < 0).any(axis=(1, 2)).sum())
    agreement = routing_agreement(stitched[: len(second) - 1, moe_layers], whole[: len(second) - 1, moe_layers])
    print(f"kv offload ({offload}): {loaded:.0f} prompt tokens loaded through the connector, stitched routing agrees with the "
          f"whole computation on {agreement:.5f} of (token, layer) sets, {unknown} tokens unknown; answers "
          f"{'equal' if answer == answer_whole else 'differ'}; second turn's cache counters {moved}")
    assert loaded >= 16, (f"the second turn's prefix did not come back through the connector: the test shows nothing; "
                          f"the second turn's counters {moved}; the server's log of its KV cache and connector:\n"
                          f"{kv_connector_lines(log_path)}")
    assert unknown == 0
    assert agreement >= 0.999
