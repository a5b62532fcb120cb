"""One trainer rank as a Ray actor: a process of the run's torch.distributed group.

A rank is one GPU (NCCL) or, on the CPU, one gloo process (`launch.trainer_ranks`). The
driver starts every rank, asks rank 0 for a rendezvous address (its node's IP and a free
port), then calls `setup` on all ranks at once: each joins the process group and builds the
`agentrl.trainer.trainer.Trainer`, which takes its FSDP / EP / CP mesh from the planner and,
given a batch, trains on every `dp`-th packed row, so a step's rows are split across
data-parallel ranks and the step equals a one-process step on the whole batch.

Every collective call (`train_step`, `export`, `save`, `load`, `push_direct`, `resend_direct`) is made on
all ranks together by `agentrl.rl.groups.TrainerGroup`. Nothing here assumes a shared
filesystem: checkpoints and exports are written into this node's folder and the files the
driver keeps come back as values (`agentrl.rl.shipping.Folder`); a checkpoint to resume from
arrives the same way.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.gpu_memory import GIB, device_processes
from agentrl.inference.transfer import WeightTransport
from agentrl.rl.diagnostics import out_of_memory_error
from agentrl.rl.inference_actor import local_folder
from agentrl.rl.shipping import Folder, node_dir, prune_versions, read_folder, remove_node_dirs, sees, write_folder
from agentrl.types import TrainingSample

__all__ = ["TrainerRank"]


class TrainerRank:
    """One rank: process-group membership, the trainer, and its collective operations."""

    def __init__(self, *, run_id: str, rank: int, world: int, threads: int | None = None) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.run_id = run_id
        self.rank = rank
        self.world = world
        self.trainer = None
        self.folder = node_dir("runs", run_id, "trainer")  # shared by the ranks of this node
        self.direct_publisher = None
        self.export_adapters = False
        self.pushed_version: int | None = None
        """The version the last direct push sent (the trainer's weights until the next step)."""
        self.stepped_since_push = False

    # ---- set-up -----------------------------------------------------------------------
    def rendezvous(self) -> tuple[str, int]:
        """(this node's IP, a free port): where rank 0 accepts the process group's members."""
        import ray

        from agentrl.inference.server import free_port

        address = ray.util.get_node_ip_address()
        return address, free_port(address)

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def setup(self, *, master: tuple[str, int], trainer_config: Any, model_dir: str,
              model_files: Folder | None, export_adapters: bool = False) -> dict[str, Any]:
        """Join the process group (several ranks) and build the trainer; its layout and node. `export_adapters`:
        the servers serve the LoRA adapter by name (`inference.lora_adapters`), so `export` writes it alone."""
        self.export_adapters = export_adapters
        import torch
        import torch.distributed as dist

        from agentrl.trainer.trainer import Trainer

        if self.world > 1 and not dist.is_initialized():
            os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": "0",
                               "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])})
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            from datetime import timedelta

            dist.init_process_group(backend, init_method=f"tcp://{master[0]}:{master[1]}", rank=self.rank,
                                    world_size=self.world, timeout=timedelta(minutes=30))
        model = local_folder(model_dir, model_files, name=f"{self.run_id}-start")
        self.trainer = Trainer(trainer_config, model_dir=model)
        return {"rank": self.rank, "node": self.node(), "layout": self.trainer.plan.describe()}

    # ---- steps ------------------------------------------------------------------------
    def train_step(self, samples: list[TrainingSample], step: int, logprobs_of: list[int] = ()) -> dict[str, Any]:
        """The step's metrics; with `logprobs_of`, this rank's part of those samples' `token_logprobs`."""
        started = time.monotonic()
        self.stepped_since_push = True  # from here on the weights are no longer the pushed version
        try:
            metrics = self.trainer.train_on_samples(samples, logprobs_of=logprobs_of)
        except Exception as error:
            if type(error).__name__ != "OutOfMemoryError":  # torch.OutOfMemoryError (torch imports lazily here)
                raise
            raise self._out_of_memory(step) from None
        # Packing + forward/backward + optimizer, without the transfer of the samples to this actor.
        metrics["compute_s"] = time.monotonic() - started
        return metrics

    def _out_of_memory(self, step: int) -> Exception:
        """The one-line error of a CUDA out-of-memory error in `step`, with this GPU's memory as it stands."""
        import torch

        device = self.trainer.device
        self.trainer.release_cached_memory()
        processes = device_processes(device.index if device.index is not None else torch.cuda.current_device())
        others = sum(used for pid, used in processes.items() if pid != os.getpid()) if processes else None
        return out_of_memory_error(step=step, rank=self.rank, peak_gib=torch.cuda.max_memory_allocated(device) / GIB,
                                   reserved_gib=torch.cuda.max_memory_reserved(device) / GIB,
                                   others_gib=None if others is None else others / GIB,
                                   total_gib=torch.cuda.get_device_properties(device).total_memory / GIB,
                                   row_tokens=self.trainer.config.row_tokens)

    def export(self, version: int, *, dest: str | None, ship: bool) -> str | Folder | None:
        """HF export of the current weights, or the LoRA adapter alone (`export_adapters`) (collective; rank 0
        writes).

        Rank 0 writes into `dest` (a folder the servers read) or, with `ship`, into this node's
        folder and returns the files; other ranks return None.
        """
        target = Path(dest) if dest is not None else self.folder / "staged" / f"v{version}"
        if self.export_adapters:
            self.trainer.export_adapter(target)  # a PEFT folder the servers load by name
        else:
            self.trainer.export_hf(target, digest=True)  # the servers are checked against it after they load
        if self.rank != 0:
            return None
        prune_versions(target.parent, newest=version)
        if not ship:
            return str(target)
        files = read_folder(target)
        shutil.rmtree(target, ignore_errors=True)
        return files

    def push_direct(self, version: int, *, urls: list[str], transport: WeightTransport,
                    reconnect: list[str] = (), verify: bool = True) -> dict[str, Any]:
        """Send the weights straight into the servers' weight-transfer engine (nccl or ipc; GPUs).

        Every rank gathers the full tensors (collective); rank 0 sends them through the publisher
        `transport` builds here on the first push, first setting up the engine of the servers in
        `reconnect` again (restarted since the last push). Returns the timings (rank 0: the
        publisher's `update_s` and `total_s` too, each server's weight check and memory; `push_s`
        includes the gather). `verify`: check every server's weights after the update.
        """
        if self.rank == 0 and self.direct_publisher is None:
            self.direct_publisher = transport.publisher(urls, verify=verify)
        timings = self._send_direct(version, lambda state: self.direct_publisher.publish(
            state, version, reconnect=list(reconnect)))
        self.pushed_version, self.stepped_since_push = version, False
        return timings

    def resend_direct(self, urls: list[str]) -> dict[str, Any] | None:
        """Send the pushed version again to the restarted servers `urls`; None when it cannot be done now.

        Calls on this actor run one at a time, so when this runs no step is running: if no step
        ran since the last push, the weights are still that version and are sent again (the
        gather is collective, the decision the same on every rank). After a step the weights
        are the next version, and the push that follows the step reaches these servers instead.
        """
        if self.pushed_version is None or self.stepped_since_push:
            return None
        return self._send_direct(self.pushed_version, lambda state: self.direct_publisher.resend(state, urls))

    def _send_direct(self, version: int, send: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
        """Gather the full tensors under HF names (collective, `hf_state_views`), rank 0 `send`s them; the
        timings (`push_s` includes the gather)."""
        from agentrl.trainer.checkpoint import hf_state_views

        started = time.monotonic()
        state = hf_state_views(self.trainer)
        timings: dict[str, Any] = {"version": version}
        if self.rank == 0:
            # A server on this GPU loads the weights layer by layer into buffers of its own: hand it the blocks
            # this process keeps cached from the step (they come back at the next step).
            self.trainer.release_cached_memory()
            result = send(state)
            timings.update(update_s=result.update_s, total_s=result.total_s,
                           checks={url: check.model_dump() for url, check in result.checks.items()},
                           memory=result.memory)
        return {**timings, "push_s": time.monotonic() - started}

    # ---- checkpoints --------------------------------------------------------------------
    def save(self, step: int, *, dest: str, token: str | None, ship: bool, trainer_state: bool = True) -> Folder | None:
        """HF export (a LoRA run: its PEFT adapter) + (with `trainer_state`) DCP state of every rank (collective).

        A rank that sees the driver's checkpoint folder `dest` (the driver marked it with
        `token`: same machine or a shared disk) writes straight into it. The others write into
        this node's folder, and with `ship` (one rank per node) the node's files come back for
        the driver to merge into `dest`: the HF export at the top, the DCP state under `trainer/`.
        """
        direct = sees(dest, token)  # before any collective: rank 0's export replaces the folder
        local = Path(dest) if direct else self.folder / "checkpoints" / f"step_{step}"
        if self.trainer.config.lora is not None:  # the adapters alone, as PEFT lays them out
            self.trainer.export_adapter(local)
        else:
            self.trainer.export_hf(local)  # replaces the folder: written before the DCP state inside
        if trainer_state:
            self.trainer.save_checkpoint(local / "trainer")
        if direct or not ship:
            return None
        files: Folder = {}
        for name, data in read_folder(local, max_bytes=1 << 62).items():
            # Off rank 0's node the DCP files stay in `trainer.tmp` (rank 0 renames its own copy only).
            files[name.replace("trainer.tmp/", "trainer/", 1)] = data
        shutil.rmtree(local, ignore_errors=True)
        return files

    def sees_checkpoint(self, path: str) -> bool:
        """Whether this node sees the driver's (complete) checkpoint folder `path`."""
        return (Path(path) / "COMPLETE").is_file()

    def load(self, step: int, *, path: str | None = None, files: Folder | None = None) -> int:
        """Restore a checkpoint (collective): from `path` this node sees, else from the shipped `files`."""
        self.stepped_since_push = True  # new weights: not the pushed version
        if path is not None:
            return self.trainer.load_checkpoint(Path(path) / "trainer")
        local = write_folder(files, self.folder / "resume" / f"rank{self.rank}-step_{step}")
        try:
            return self.trainer.load_checkpoint(local / "trainer")
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def stop(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        remove_node_dirs(self.run_id, self.folder)
