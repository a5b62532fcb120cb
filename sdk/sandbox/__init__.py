"""agentrl.sandbox: one async Sandbox interface over Docker, bubblewrap and E2B backends.

    from agentrl.sandbox import SandboxConfig, create_sandbox

    async with create_sandbox(SandboxConfig(image="agentrl-base:bookworm")) as sb:
        result = await sb.exec("python3 -c 'print(1 + 1)'", timeout=10)

The backend is picked by `SandboxConfig.type` (`factory.create_sandbox`); each backend imports its
SDK lazily.
"""

from __future__ import annotations

from agentrl.sandbox.base import ExecResult, RawExecResult, Sandbox, SandboxConfig, SandboxError
from agentrl.sandbox.factory import create_sandbox
from agentrl.sandbox.pool import SandboxPool

__all__ = ["ExecResult", "RawExecResult", "Sandbox", "SandboxConfig", "SandboxError", "SandboxPool", "create_sandbox"]
