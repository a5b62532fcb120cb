"""The memory plan of a GPU shared by the trainer and vLLM (cookbook/gpu-1xh200), the refusal of a recipe that
does not fit, the trainer's out-of-memory line, and the step metrics of a weight update; all on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.rl.config import load_run_config
from agentrl.rl.plan import ResourceError, check_resources, plan_run, trainer_plan
from agentrl.rl.shared_gpu import MARGIN_GIB, shared_gpu_plan

RECIPE = Path(__file__).resolve().parents[2] / "cookbook" / "gpu-1xh200" / "train.toml"


def recipe(**sets):
    config = load_run_config(RECIPE)
    for key, value in sets.items():
        section, field = key.split("__")
        setattr(getattr(config, section), field, value)
    return config


def test_the_one_gpu_recipe_fits_at_both_moments_and_the_dry_run_says_so():
    config = recipe()
    plan = shared_gpu_plan(config, trainer_plan(config), gpu_gib=139.8)
    # vLLM's share plus what its process holds beyond it; the trainer's estimate scaled to its process
    assert plan.server_gib == pytest.approx(0.30 * 139.8 + 0.1)  # measured: 42.0 GiB on the H200
    assert 80 < plan.trainer_step_gib < 100 and 50 < plan.trainer_update_gib < 65
    # twice the largest layer (128 experts of 3 x 4096 x 1408, attention, shared expert) in bf16
    assert 8 < plan.server_update_gib < 9.5
    assert plan.step_gib > plan.update_gib and plan.fits()
    text = plan_run(config)
    assert "# shared GPU (141.0 GiB): at the trainer's step" in text and "# fits:" in text


def test_a_recipe_that_does_not_fit_is_refused_before_the_start_in_one_line():
    config = recipe(inference__gpu_memory_utilization=0.4)
    plan = shared_gpu_plan(config, trainer_plan(config), gpu_gib=139.8)
    assert not plan.fits() and plan.peak_gib + MARGIN_GIB > 139.8
    with pytest.raises(ResourceError) as info:
        check_resources(config, cluster_gpus=1)
    line = str(info.value)
    assert "trainer and vLLM sharing one" in line and "inference.gpu_memory_utilization=0.4" in line
    assert "lower inference.gpu_memory_utilization to at most 0.3" in line and "\n" not in line
    assert "# does NOT fit" in plan_run(config)


def test_a_pd_pair_counts_two_servers_and_asks_for_a_share_each():
    from agentrl.inference.deployment import InferenceConfig

    one = recipe()
    pair = recipe(inference__gpu_memory_utilization=0.15)
    pair.inference = InferenceConfig(**{**pair.inference.model_dump(), "kind": "pd", "kv_connector": "example"})
    single, double = (shared_gpu_plan(config, trainer_plan(config), gpu_gib=139.8) for config in (one, pair))
    assert double.servers == 2 and double.server_gib == pytest.approx(2 * (0.15 * 139.8 + 0.1))
    assert double.server_update_gib == pytest.approx(2 * single.server_update_gib) and double.fits()
    pair.inference = pair.inference.model_copy(update={"gpu_memory_utilization": 0.30})
    too_much = shared_gpu_plan(pair, trainer_plan(pair), gpu_gib=139.8)
    line = too_much.problem(pair)
    assert not too_much.fits() and "each of the P/D pair's two servers" in line and "\n" not in line


def test_runs_that_do_not_share_a_gpu_have_no_shared_plan():
    config = recipe(launch__colocate=False)
    assert shared_gpu_plan(config, trainer_plan(config)) is None


def test_the_out_of_memory_line_names_the_step_both_sides_and_the_knobs():
    from agentrl.rl.diagnostics import out_of_memory_error

    error = out_of_memory_error(step=17, rank=0, peak_gib=91.2, reserved_gib=97.8, others_gib=39.3, total_gib=139.8,
                                row_tokens=2048)
    line = str(error)
    assert error.exit_code == 1 and "\n" not in line
    for part in ("trainer-0 ran out of GPU memory at step 17", "trainer peak 91.2 GiB", "held 97.8 GiB",
                 "(a vLLM server sharing it) 39.3 GiB", "GPU 139.8 GiB", "inference.gpu_memory_utilization",
                 "trainer.row_tokens (now 2048)", "launch.colocate = false"):
        assert part in line


def test_an_actors_own_error_becomes_the_runs_line_with_what_is_kept(tmp_path):
    from agentrl.rl.diagnostics import out_of_memory_error
    from agentrl.rl.stopping import actor_error

    cause = out_of_memory_error(step=2, rank=0, peak_gib=85.3, reserved_gib=86.0, others_gib=None, total_gib=139.8,
                                row_tokens=2048)
    error = actor_error(cause, run_dir=tmp_path / "run", checkpoint_step=None)
    assert error.exit_code == 1
    assert str(error).startswith("trainer-0 ran out of GPU memory at step 2")
    assert f"{tmp_path / 'run'} is kept (no checkpoint yet" in str(error)


def test_a_weight_updates_record_becomes_step_metrics():
    from agentrl.rl.transport import update_metrics

    record = {"checks": {"http://a": {"checked": 9, "trainer_tensors": 20, "max_error": 0.02, "unserved": []},
                         "http://b": {"checked": 9, "trainer_tensors": 20, "max_error": 0.07, "unserved": []}},
              "memory": {"http://a": [{"device": "cuda", "process": 43 * 2**30, "reserved": 41 * 2**30}],
                         "http://b": [{"device": "cuda", "process": None, "reserved": 44 * 2**30}]}}
    assert update_metrics(record) == {"weights/verified": 1.0, "weights/check_error": 0.07,
                                      "mem/inference_gib": 44.0}
    assert update_metrics({}) == {"weights/verified": 0.0}
    assert update_metrics({"memory": {"http://a": [{"device": "cpu"}]}}) == {"weights/verified": 0.0}


def test_kernel_format_updates_trade_vllms_layer_load_for_a_larger_trainer_buffer():
    plain = recipe()
    kernel = recipe(inference__weight_format="kernel")
    before = shared_gpu_plan(plain, trainer_plan(plain), gpu_gib=139.8)
    after = shared_gpu_plan(kernel, trainer_plan(kernel), gpu_gib=139.8)
    experts = 2 * 128 * 3 * 4096 * 1408 / 2**30  # glm-air-5b: one MoE layer's experts in bf16
    assert before.server_update_gib > 8 and after.server_update_gib == 0.0  # vLLM copies in place
    assert after.trainer_update_gib == pytest.approx(before.trainer_update_gib - 1.0 + 2 * experts)
    assert after.trainer_step_gib > before.trainer_step_gib and after.fits()


def test_the_nemotron_recipe_fits_one_h200_beside_vllm():
    from agentrl.models import resolve_model

    config = load_run_config(RECIPE.with_name("nemotron-train.toml"))
    assert resolve_model(config.model.name).family == "nemotron_h"
    plan = shared_gpu_plan(config, trainer_plan(config), gpu_gib=139.8)
    assert 60 < plan.trainer_step_gib < 90 and plan.fits()


def test_the_80g_recipe_fits_an_h100_where_the_h200_recipe_does_not():
    """scripts/gpu_check.sh runs train-80g.toml on a card under 100 GiB: glm-air-5b's own recipe needs ~124 GiB."""
    h100_gib = 79.0
    assert not shared_gpu_plan(recipe(), trainer_plan(recipe()), gpu_gib=h100_gib).fits()
    config = load_run_config(RECIPE.with_name("train-80g.toml"))
    assert config.model.name == "glm-air-32e" and config.plan.gpu_memory_gib == h100_gib
    h200 = load_run_config(RECIPE)  # the same loop otherwise: only the model, its warm start and the budgets differ
    for section in ("orchestrator", "sampling", "inference", "launch", "env"):
        assert getattr(config, section) == getattr(h200, section), section
    plan = shared_gpu_plan(config, trainer_plan(config), gpu_gib=h100_gib)
    assert plan.fits() and 25 < plan.trainer_step_gib < 45


def test_a_gpu_context_past_the_models_positions_is_refused_in_one_line_before_start(tmp_path):
    """CUDA vLLM's engine died on a device-side assert when prompts ran past the created glm-air-32e's 4,096 rotary
    positions (an H100, 2026-12-06): a GPU run asking for more is refused before anything starts. The recipe's own
    4,096 passes this check (and then lacks CUDA vLLM here); a checkpoint with rope scaling is the user's call."""
    from agentrl.errors import ConfigError

    recipe = Path("cookbook/gpu-1xh200/train-80g.toml")
    with pytest.raises(ConfigError) as refused:
        check_resources(load_run_config(recipe, overrides=["inference.max_model_len=8192"]), cluster_gpus=1)
    assert str(refused.value).startswith("inference.max_model_len=8192 is past the 4096 positions of glm-air-32e")
    assert "\n" not in str(refused.value)
    with pytest.raises(ResourceError, match="CUDA vLLM"):
        check_resources(load_run_config(recipe), cluster_gpus=1)
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", '
                                          '"factor": 4.0}, "architectures": ["Glm4MoeForCausalLM"]}')
    scaled = load_run_config(recipe, overrides=["inference.max_model_len=8192", f"model.init_checkpoint={tmp_path}"])
    with pytest.raises(ResourceError, match="CUDA vLLM"):
        check_resources(scaled, cluster_gpus=1)


def test_block_fp8_of_a_model_with_a_ragged_width_is_refused_in_one_line_before_start():
    """The created glm-air-32e's dense MLP is 10,944 wide (GLM-4.5-Air's): block FP8 served it NaN logprobs on an
    H100 (2026-12-07). The recipe with block scales is refused before anything starts; per-tensor FP8 passes on."""
    from agentrl.errors import ConfigError

    recipe = Path("cookbook/gpu-1xh200/train-80g.toml")
    block = ["inference.fp8=true", "inference.fp8_scales=block"]
    with pytest.raises(ConfigError) as refused:
        check_resources(load_run_config(recipe, overrides=block), cluster_gpus=1)
    said = str(refused.value)
    assert said.startswith("inference.fp8_scales='block': glm-air-32e's intermediate_size = 10944 is not a multiple "
                           "of 128") and "fp8_scales='tensor'" in said and "\n" not in said
    with pytest.raises(ResourceError, match="CUDA vLLM"):
        check_resources(load_run_config(recipe, overrides=["inference.fp8=true", "inference.fp8_scales=tensor"]),
                        cluster_gpus=1)
