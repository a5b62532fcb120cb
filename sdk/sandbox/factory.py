"""`create_sandbox`: a `SandboxConfig` (or its fields) -> a not-yet-started sandbox of the backend its `type` names.

The backends are `docker_backend.DockerSandbox`, `bwrap_backend.BwrapSandbox` and
`e2b_backend.E2BSandbox`; each module is imported when a sandbox of its type is made, so a
machine without the Docker SDK or E2B's uses the others.
"""

from __future__ import annotations

from typing import Any

from agentrl.sandbox.base import Sandbox, SandboxConfig

__all__ = ["create_sandbox"]


def create_sandbox(spec: SandboxConfig | dict[str, Any] | None = None, **overrides: Any) -> Sandbox:
    """A not-yet-started sandbox for `spec`; `async with` starts it and always destroys it."""
    if spec is None:
        spec = SandboxConfig()
    elif isinstance(spec, dict):
        spec = SandboxConfig.model_validate(spec)
    if overrides:
        spec = spec.model_copy(update=overrides)
        spec = SandboxConfig.model_validate(spec.model_dump())
    if spec.type == "docker":
        from agentrl.sandbox.docker_backend import DockerSandbox

        return DockerSandbox(spec)
    if spec.type == "bwrap":
        from agentrl.sandbox.bwrap_backend import BwrapSandbox

        return BwrapSandbox(spec)
    from agentrl.sandbox.e2b_backend import E2BSandbox

    return E2BSandbox(spec)
