"""A private OCI registry on 127.0.0.1: Debian's `docker-registry` (the distribution registry) as a process.

`LocalRegistry(storage_dir)` writes its own config file (filesystem storage, HTTP on
127.0.0.1, a free port when the wanted one is taken), starts `docker-registry serve`, waits
until `/v2/` answers, and stops the process by its handle. The Docker engine trusts
registries on 127.0.0.1 without TLS, so `docker push 127.0.0.1:PORT/name:tag` works at once.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from agentrl.errors import AgentrlError

__all__ = ["LocalRegistry", "free_port"]

_CONFIG = """version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
"""


def free_port(preferred: int | None = None) -> int:
    """`preferred` when nothing listens on it on 127.0.0.1, else a free port the kernel picks."""
    if preferred is not None:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", preferred))
                return preferred
            except OSError:
                pass
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalRegistry:
    """A `docker-registry` process serving `storage_dir` on 127.0.0.1."""

    def __init__(self, storage_dir: str | Path, *, port: int | None = 5000, binary: str = "docker-registry") -> None:
        self.storage_dir = Path(storage_dir)
        self.port = free_port(port)
        self.binary = binary
        self.process: subprocess.Popen | None = None
        self.log_path = self.storage_dir / "registry.log"

    @property
    def address(self) -> str:
        """`127.0.0.1:PORT`, the registry part of image names."""
        return f"127.0.0.1:{self.port}"

    def start(self, *, timeout_s: float = 30.0) -> LocalRegistry:
        import httpx

        executable = shutil.which(self.binary)
        if executable is None:
            raise AgentrlError(f"{self.binary} not found; install Debian's docker-registry package "
                               "(scripts/install.sh does)")
        (self.storage_dir / "data").mkdir(parents=True, exist_ok=True)
        config = self.storage_dir / "config.yml"
        config.write_text(_CONFIG.format(root=self.storage_dir / "data", port=self.port))
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen([executable, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                if httpx.get(f"http://{self.address}/v2/", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        tail = self.log_path.read_text(errors="replace")[-500:] if self.log_path.exists() else ""
        self.stop()
        raise AgentrlError(f"docker-registry on {self.address} did not start: {' | '.join(tail.splitlines()[-3:])}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> LocalRegistry:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
