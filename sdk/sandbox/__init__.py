"""agentrl.sandbox: one async Sandbox interface over Docker, bubblewrap and E2B backends.

    from agentrl.sandbox import SandboxConfig, create_sandbox

    async with create_sandbox(SandboxConfig(image="agentrl-base:bookworm")) as sb:
        result = await sb.exec("python3 -c 'print(1 + 1)'", timeout=10)

The backend is picked by `SandboxConfig.type`; each backend imports its SDK lazily.
"""

from __future__ import annotations

from typing import Any

from agentrl.sandbox.base import ExecResult, RawExecResult, Sandbox, SandboxConfig, SandboxError

__all__ = ["ExecResult", "RawExecResult", "Sandbox", "SandboxConfig", "SandboxError", "SandboxPool", "create_sandbox"]


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


def __getattr__(name: str):
    if name == "SandboxPool":
        from agentrl.sandbox.pool import SandboxPool

        return SandboxPool
    raise AttributeError(f"module 'agentrl.sandbox' has no attribute {name!r}")
