"""Docker backend (placeholder being written)."""
from __future__ import annotations

from agentrl.errors import AgentrlError, require


def docker_client():
    docker = require("docker", "cpu")
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except Exception as error:
        raise AgentrlError(f"sandbox: no Docker engine ({error}); start dockerd or use type = 'bwrap'") from None
    return client
