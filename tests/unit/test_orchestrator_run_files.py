"""Run config, run folder (metrics, plots, report), checkpoint bookkeeping and the train CLI's errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agentrl.errors import AgentrlError, ConfigError, NotFoundError
from agentrl.rl.config import RunConfig, load_run_config
from agentrl.rl.orchestrator import OrchestratorState
from agentrl.rl.report import RunDir, read_metrics
from agentrl.rl.resume import (
    begin_checkpoint,
    commit_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_orchestrator_state,
    prune_checkpoints,
    remove_partials,
)


def _row(step: int, reward: float) -> dict:
    return {"step": step, "reward": reward, "reward_std": 0.1, "mismatch_kl": 1e-3 * (step + 1),
            "staleness": {"0": 2, "1": step % 2}, "dropped_stale": step % 3 == 2, "tokens_per_s": 100.0 + step,
            "step_time_s": 1.5, "bound": "inference" if step % 2 else "trainer"}


def test_defaults_are_the_embedded_cpu_run():
    config = load_run_config()
    assert config.env.name == "reverse-text" and config.model.name == "tiny-moe"
    assert config.inference.device == "cpu" and config.launch.trainer_gpus == 0
    assert config.trainer.model == "tiny-moe"


def test_tiny_nemotron_on_reverse_text_is_its_cpu_recipe_from_its_warm_start():
    from agentrl.rl.config import TINY_NEMOTRON_RECIPE, TINY_NEMOTRON_SFT

    config = load_run_config(model="tiny-nemotron")  # `agentrl train --model tiny-nemotron`
    assert TINY_NEMOTRON_RECIPE.is_file() and (TINY_NEMOTRON_SFT / "config.json").is_file()
    assert config.model.name == config.trainer.model == "tiny-nemotron"
    assert config.starting_weights().resolve() == TINY_NEMOTRON_SFT.resolve()
    assert config.inference.device == "cpu" and config.inference.routed_experts and config.trainer.router_replay
    assert config.orchestrator.max_steps == 24
    # another environment on tiny-nemotron: no recipe, no reverse-text warm start
    assert load_run_config(model="tiny-nemotron", env="arithmetic").model.init_checkpoint is None


def test_tiny_deepseek_on_reverse_text_is_its_cpu_recipe():
    from agentrl.rl.config import TINY_DEEPSEEK_RECIPE

    config = load_run_config(model="tiny-deepseek")  # `agentrl train --model tiny-deepseek`
    assert TINY_DEEPSEEK_RECIPE.is_file() and config.model.name == config.trainer.model == "tiny-deepseek"
    assert config.orchestrator.max_steps == 3 and config.trainer.router_replay
    assert config.model.init_checkpoint is None  # random weights: the recipe shows MLA end to end


def test_inference_serves_in_the_trainers_dtype():
    # vLLM's "auto" would serve the float32 checkpoint in bfloat16 on the CPU: a mismatch KL of
    # ~1e-4 per token against the float32 trainer. The run passes the trainer's dtype instead.
    assert load_run_config().inference_dtype() == "float32"
    assert load_run_config(overrides=["trainer.parallel.param_dtype=bfloat16"]).inference_dtype() == "bfloat16"
    assert load_run_config(overrides=["inference.dtype=float16"]).inference_dtype() == "float16"
    gpu = load_run_config(overrides=["launch.trainer_gpus=2"])
    assert gpu.trainer.parallel.param_dtype is None and gpu.inference_dtype() == "bfloat16"
    assert load_run_config(overrides=["trainer.parallel.param_dtype=float16"]).inference_dtype() == "float16"


def test_the_run_passes_inference_extra_args_to_vllm():
    """`inference.extra_args` reach the server's command line, after the run's own CPU options."""
    from agentrl.rl.inference_actor import replica_server

    config = load_run_config(overrides=['inference.extra_args=["--hf-overrides", "{\\"head_dtype\\": \\"float32\\"}"]'])
    server = replica_server(config.inference, config.starting_weights(), served_name="tiny-moe",
                            dtype=config.inference_dtype())
    command = server.command()
    assert command[-2:] == ["--hf-overrides", '{"head_dtype": "float32"}']
    assert "--no-enable-prefix-caching" in command  # the routed-experts option is still there


def test_toml_overrides_and_shortcuts(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[orchestrator]\nmax_steps = 7\nmax_off_policy_steps = 0\n[sampling]\ntemperature = 0.7\n')
    config = load_run_config(path, overrides=["orchestrator.groups_per_step=3"], env="arithmetic")
    assert (config.orchestrator.max_steps, config.orchestrator.max_off_policy_steps) == (7, 0)
    assert config.orchestrator.groups_per_step == 3 and config.sampling.temperature == 0.7
    assert config.env.name == "arithmetic"


def test_unknown_key_is_one_line_with_file_and_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[orchestrator]\nmax_step = 7\n")
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    message = str(info.value)
    assert f"{path}:2" in message and "orchestrator.max_step" in message and "\n" not in message


def test_bad_override_value_names_the_key():
    with pytest.raises(ConfigError) as info:
        load_run_config(overrides=["orchestrator.max_off_policy_steps=-1"])
    assert "max_off_policy_steps" in str(info.value)


def test_missing_init_checkpoint_is_a_clear_error(tmp_path):
    config = load_run_config(overrides=[f'model.init_checkpoint="{tmp_path / "nope"}"'])
    with pytest.raises(ConfigError) as info:
        config.starting_weights()
    assert "model.init_checkpoint" in str(info.value)


def test_gpu_preset_gets_a_gpu_plan_with_a_fitting_trainer():
    config = load_run_config(env="swe", model="glm-4.5-air")
    assert config.inference.device == "gpu"
    assert config.launch.trainer_gpus >= 16 and config.launch.trainer_gpus % 8 == 0
    from agentrl.rl.plan import plan_run, trainer_plan

    plan = trainer_plan(config)
    assert plan.estimated_bytes <= config.trainer.parallel.gpu_memory_gib * 1024**3
    text = plan_run(config)
    for needle in ("nodes:", "layout: world=", "memory per GPU", "vllm.entrypoints.openai.api_server",
                   "--enable-return-routed-experts", "vllm-router"):
        assert needle in text, needle


def test_missing_gpus_are_listed():
    from agentrl.rl.plan import ResourceError, check_resources

    config = load_run_config(env="swe", model="glm-4.5-air")
    with pytest.raises(ResourceError) as info:
        check_resources(config, cluster_gpus=0)
    message = str(info.value)
    assert "GPUs" in message and "0 visible" in message and "\n" not in message


def test_run_dir_metrics_survive_a_torn_line_and_truncate(tmp_path):
    run = RunDir(tmp_path / "run").create("x = 1\n")
    for step in range(4):
        run.append_metrics(_row(step, 0.1 * step))
    with open(run.metrics_path, "a") as handle:
        handle.write('{"step": 4, "rew')  # what a kill -9 mid-write leaves
    assert [r["step"] for r in run.metrics()] == [0, 1, 2, 3]
    kept = run.truncate_metrics(before_step=2)
    assert [r["step"] for r in kept] == [0, 1]
    assert [r["step"] for r in read_metrics(run.metrics_path)] == [0, 1]
    with pytest.raises(AgentrlError):
        RunDir(tmp_path / "run").create("x = 2\n")


def test_report_and_plots(tmp_path):
    run = RunDir(tmp_path / "run").create("x = 1\n")
    for step in range(6):
        run.append_metrics({**_row(step, 0.1 * step), "wait_s": 1.0, "train_s": 0.5, "rollout_s": 2.0,
                            "rollout_generation_s": 1.5, "rollout_sandbox_s": 0.25 * step,
                            "tool_calls_per_rollout": 3.0, "rollouts_without_tool_calls": step % 2,
                            "tool_call_parse_failures": 1, "train/mismatch_large_fraction": 1e-3 * step,
                            "train/mismatch_max_log_ratio": 0.1 * step})
    report = run.finish(title="test run")
    text = report.read_text()
    assert "| tokens more than 2x apart, mean share / largest log ratio | 2.50e-03 / 0.500 |" in text
    assert "| reward at the first step | 0.0000 |" in text
    assert "trainer-bound / inference-bound steps | 3 / 3" in text
    assert "| training (s), mean | 0.50 |" in text and "| one rollout: sandbox (s), mean | 0.62 |" in text
    assert "| rollouts without a tool call / tool-call parse failures, all steps | 3 / 6 |" in text
    assert "weight staging" not in text  # a part with no figures gets no line
    for name in ("reward", "mismatch_kl", "staleness", "throughput", "time_split"):
        png = run.plots / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
        assert f"plots/{name}.png" in text


def test_report_frames_the_reward_against_noise_and_tables_the_held_out_evaluations(tmp_path):
    run = RunDir(tmp_path / "run").create("x = 1\n")
    for step in range(40):
        row = _row(step, 0.5 + 0.005 * step + 0.01 * ((step * 7) % 3))
        if step in (19, 39):
            row.update({"eval/step": step, "eval/tasks": 32, "eval/mean_reward": 0.4 + step / 200,
                        "eval/mean_reward_low": 0.35 + step / 200, "eval/mean_reward_high": 0.45 + step / 200,
                        "eval/avg@4": 0.4 + step / 200, "eval/pass@1": 0.3, "eval/pass@4": 0.6})
        run.append_metrics(row)
    text = run.finish(title="test run").read_text()
    assert "Training reward, mean of the first 20 steps against the last 20 (95% bootstrap interval" in text
    assert "no change of the reward" not in text  # a rise of 0.1 over steps of noise 0.01
    assert "| 20 | 32 | 0.495 (0.445-0.545) | 0.495 | 0.300 | 0.600 |" in text  # eval/step 19: 20 steps
    assert (run.plots / "heldout.png").read_bytes()[:4] == b"\x89PNG" and "plots/heldout.png" in text


def test_checkpoint_commit_latest_prune_and_partials(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        partial = begin_checkpoint(root, step)
        (partial / "model.safetensors").write_text("w")
        commit_checkpoint(partial, OrchestratorState(step=step, groups_started=4 * step))
    half = begin_checkpoint(root, 4)  # a crash while writing step 4
    assert latest_checkpoint(root).step == 3
    info = latest_checkpoint(root)
    assert load_orchestrator_state(info).groups_started == 12
    prune_checkpoints(root, keep=2)
    assert [c.step for c in list_checkpoints(root)] == [2, 3]
    remove_partials(root)
    assert not half.exists()
    (info.path / "orchestrator.json").write_text(json.dumps({"step": 9}))
    with pytest.raises(NotFoundError):
        load_orchestrator_state(info)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_bad_set_is_one_line_error():
    result = _cli("train", "--set", "orchestrator.nope=1", "--dry-run")
    assert result.returncode == 2
    assert "orchestrator.nope" in result.stderr and "Traceback" not in result.stderr


def test_cli_resume_of_a_non_run_folder(tmp_path):
    result = _cli("train", "--resume", str(tmp_path))
    assert result.returncode == 2 and "not a run folder" in result.stderr


def test_cli_dry_run_prints_config_and_plan():
    result = _cli("train", "--dry-run", "--set", "orchestrator.max_steps=3")
    assert result.returncode == 0, result.stderr
    assert "max_steps = 3" in result.stdout and "## inference" in result.stdout


def test_config_roundtrips_through_toml(tmp_path):
    from agentrl.config import dump_config

    config = load_run_config(overrides=["orchestrator.max_steps=4"])
    path = tmp_path / "config.toml"
    path.write_text(dump_config(config))
    again = load_run_config(path)
    assert again.orchestrator.max_steps == 4
    assert isinstance(again, RunConfig)


def test_run_baseline_of_a_checkpoint(tmp_path):
    from agentrl.config import dump_config
    from agentrl.evaluation.compare import run_baseline
    from agentrl.evaluation.engine import compare_checkpoint

    run = tmp_path / "run"
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    config = load_run_config(overrides=[f'model.init_checkpoint="{tmp_path}"'])
    (run / "config.toml").write_text(dump_config(config))
    assert run_baseline(run / "checkpoints" / "step_3") == str(tmp_path)
    assert run_baseline(tmp_path) is None  # not a run checkpoint
    with pytest.raises(NotFoundError) as info:
        compare_checkpoint("reverse-text", checkpoint=run / "checkpoints" / "step_3")
    assert "config.json" in str(info.value)
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "config.json").write_text("{}")
    with pytest.raises(NotFoundError) as info:
        compare_checkpoint("reverse-text", checkpoint=lonely)
    assert "baseline" in str(info.value)


def test_inference_cuda_graphs_drop_enforce_eager_on_gpu_only(tmp_path):
    """`inference.cuda_graphs` lets a GPU server capture CUDA graphs; the CPU server stays eager either way."""
    import json

    from agentrl.models import PRESETS
    from agentrl.rl.inference_actor import replica_server

    model = tmp_path / "glm-air-5b-shapes"  # config only: the command needs no weights
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**PRESETS["glm-air-5b"].hf_config,
                                                   "architectures": ["Glm4MoeForCausalLM"]}))
    commands = {}
    for device in ("gpu", "cpu"):
        for graphs in (False, True):
            config = load_run_config(overrides=[f"inference.device={device}",
                                                f"inference.cuda_graphs={str(graphs).lower()}"])
            commands[device, graphs] = replica_server(config.inference, model, served_name="glm-air-5b",
                                                      dtype="bfloat16").command()
    assert "--enforce-eager" in commands["gpu", False] and "--enforce-eager" not in commands["gpu", True]
    assert "--enforce-eager" in commands["cpu", False] and "--enforce-eager" in commands["cpu", True]


def test_inference_kv_cache_memory_bytes_reaches_the_server_on_either_device(tmp_path):
    """`inference.kv_cache_memory_bytes` sizes the KV cache of a GPU server too (it was dropped there: the KV-offload
    GPU test's 48-block cache came up with 8 million tokens on an H100); unset, a GPU server sizes it from its
    memory share and a CPU server takes 256 MiB."""
    import json

    from agentrl.models import PRESETS
    from agentrl.rl.inference_actor import replica_server

    model = tmp_path / "glm-air-5b-shapes"  # config only: the command needs no weights
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**PRESETS["glm-air-5b"].hf_config,
                                                   "architectures": ["Glm4MoeForCausalLM"]}))

    def kv_flags(device: str, *overrides: str) -> list[str]:
        config = load_run_config(overrides=[f"inference.device={device}", *overrides])
        command = replica_server(config.inference, model, served_name="glm-air-5b", dtype="bfloat16").command()
        return [command[i + 1] for i, flag in enumerate(command) if flag == "--kv-cache-memory-bytes"]

    assert kv_flags("gpu", "inference.kv_cache_memory_bytes=98304") == ["98304"]
    assert kv_flags("gpu") == []
    assert kv_flags("cpu", "inference.kv_cache_memory_bytes=98304") == ["98304"]
    assert kv_flags("cpu") == [str(256 * 2**20)]
