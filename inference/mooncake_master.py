"""`MooncakeMaster`: the Mooncake store's master process, started and stopped by agentrl like any managed process,
and the client configuration vLLM's `MooncakeStoreConnector` reads.

`inference.kv_offload = "mooncake"` keeps KV blocks in a Mooncake store: each vLLM server's connector is a store
client that puts and gets blocks, and one `mooncake_master` (a binary shipped in the `mooncake-transfer-engine*`
wheels, `mooncake/mooncake_master`) keeps the store's metadata. Here, on one node:

- `MooncakeMaster.start` runs `mooncake_master` in its own session with its RPC and metrics ports on 127.0.0.1 and
  no HTTP metadata server (clients find each other by P2P handshake), waits until its RPC port answers, and says
  in one line why when it does not (no wheel, a missing library, an early exit with its log's end);
- `write_client_config` writes the JSON vLLM reads from `$MOONCAKE_CONFIG_PATH` (vLLM 0.24's and 0.32's
  `MooncakeStoreConfig.from_file`): the master's address, `P2PHANDSHAKE`, protocol `tcp`, the segment each
  client gives the store and its local buffer;
- `stop` ends the master by its process group, SIGTERM then SIGKILL;
- `store_for_server` gives one vLLM server a store of its own: a master (not started) that writes the server's
  client configuration when it starts, and the server's `$MOONCAKE_CONFIG_PATH` pointing at it.

The clients (inside vLLM) listen for their peers on every interface; that is Mooncake's own transfer engine, not
this process. The master's libraries need libibverbs and libnl (Debian `libibverbs1`, `libnl-route-3-200`;
`scripts/install.sh` installs them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from agentrl.errors import AgentrlError

__all__ = ["MooncakeMaster", "MooncakeMasterError", "master_binary", "store_for_server", "write_client_config"]


class MooncakeMasterError(AgentrlError):
    """The Mooncake master could not be found, started or reached."""


def master_binary() -> Path:
    """The `mooncake_master` binary of the installed `mooncake` package (one of the mooncake-transfer-engine wheels)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MooncakeMasterError("inference.kv_offload='mooncake' needs a Mooncake wheel: pip install "
                                  "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine-cuda13 (GPUs)")
    binary = Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"
    if not binary.is_file():
        raise MooncakeMasterError(f"the installed mooncake package has no mooncake_master at {binary}; reinstall "
                                  "mooncake-transfer-engine-non-cuda or mooncake-transfer-engine-cuda13")
    return binary


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def write_client_config(path: Path, *, master_address: str, global_segment_bytes: int,
                        local_buffer_bytes: int = 64 * 2**20) -> Path:
    """The store client's configuration for vLLM's connector (the file `$MOONCAKE_CONFIG_PATH` names)."""
    if global_segment_bytes <= 0 or local_buffer_bytes <= 0:
        raise MooncakeMasterError("Mooncake client config: global_segment_bytes and local_buffer_bytes must be > 0")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": master_address,
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": int(global_segment_bytes),
        "local_buffer_size": int(local_buffer_bytes),
    }, indent=2))
    return path


class MooncakeMaster:
    """One `mooncake_master` on this machine, bound to `host` (see the module docstring)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, log_path: Path | None = None,
                 startup_timeout_s: float = 30.0, client_config: Path | None = None,
                 global_segment_bytes: int = 0) -> None:
        """`client_config`: where `start` writes the clients' configuration (`write_client_config`, each client
        giving the store `global_segment_bytes`) once the master answers."""
        self.host = host
        self.port = port
        self.log_path = log_path
        self.client_config = client_config
        self.global_segment_bytes = global_segment_bytes
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """`host:port` of the master's RPC server (the clients' `master_server_address`)."""
        if self.port is None:
            raise MooncakeMasterError("the Mooncake master has no port until it is started")
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        metrics_port = _free_port(self.host)
        return [str(master_binary()), f"--rpc_port={self.port}", f"--rpc_address={self.host}",
                "--enable_http_metadata_server=false", f"--metrics_port={metrics_port}",
                f"--metrics_host={self.host}"]

    def start(self) -> MooncakeMaster:
        """Start the master, wait until its RPC port answers, then write the clients' configuration if asked."""
        if self.process is not None and self.process.poll() is None:
            return self
        self.port = self.port or _free_port(self.host)
        if _answers(self.host, self.port):
            raise MooncakeMasterError(f"Mooncake master: something already listens on {self.address}; "
                                      "leave the port unset to take a free one")
        command = self.command()
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 - the process keeps it
        try:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while not _answers(self.host, self.port):
            if self.process.poll() is not None:
                raise MooncakeMasterError(f"mooncake_master exited with status {self.process.returncode} during "
                                          f"start-up: {self._log_end()}")
            if time.monotonic() > deadline:
                self.stop()
                raise MooncakeMasterError(f"mooncake_master did not answer on {self.address} within "
                                          f"{self.startup_timeout_s:.0f} s: {self._log_end()}")
            time.sleep(0.1)
        if self.client_config is not None:
            write_client_config(self.client_config, master_address=self.address,
                                global_segment_bytes=self.global_segment_bytes)
        return self

    def _log_end(self) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return "(no log)"
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:]) or "(empty log)"

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """End the master (its process group): SIGTERM, then SIGKILL after `timeout_s`."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def store_for_server(server_env: dict[str, str], folder: Path, *, gib: float) -> MooncakeMaster:
    """A Mooncake store for one vLLM server (`inference.kv_offload = "mooncake"`): the master (not started; start it
    before the server) with its log and the clients' configuration in `folder`, each client giving the store `gib`
    GiB; sets `$MOONCAKE_CONFIG_PATH` in `server_env` (the server's environment) to that configuration."""
    if gib <= 0:
        raise MooncakeMasterError(f"inference.kv_offload_gb must be > 0 for a Mooncake store, got {gib}")
    master = MooncakeMaster(log_path=folder / "mooncake_master.log", client_config=folder / "mooncake.json",
                            global_segment_bytes=int(gib * 2**30))
    server_env["MOONCAKE_CONFIG_PATH"] = str(master.client_config)
    return master
