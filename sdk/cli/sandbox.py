"""`agentrl sandbox ...`: run a command in a sandbox, build the base image, list and reap sandboxes."""

from __future__ import annotations

import asyncio
import sys

import typer

from agentrl.errors import ConfigError

app = typer.Typer(help="Sandboxes: run commands, build the base image, list and garbage-collect.", no_args_is_help=True)


@app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    image: str = typer.Option("agentrl-base:bookworm", "--image", help="Docker image (or E2B template)."),
    backend: str = typer.Option("docker", "--type", help="Backend: docker, bwrap or e2b."),
    runtime: str = typer.Option(
        "runc", "--runtime", help="Docker runtime: runc, or runsc (gVisor) for untrusted code."
    ),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds before the command is killed."),
    memory_mb: int = typer.Option(1024, "--memory-mb", help="Memory limit in MiB."),
    cpus: float = typer.Option(1.0, "--cpus", help="CPU limit in cores."),
    network: bool = typer.Option(False, "--network/--no-network", help="Allow network access (off by default)."),
    workdir: str = typer.Option("/workspace", "--workdir", help="Working directory inside the sandbox."),
    env: list[str] = typer.Option([], "--env", "-e", help="Environment variable KEY=VALUE (repeatable)."),
) -> None:
    """Run one command in a fresh sandbox and print its output: agentrl sandbox run --image IMG -- CMD."""
    from agentrl.config import config_from_dict
    from agentrl.sandbox import SandboxConfig, create_sandbox

    argv = list(ctx.args)
    if not argv:
        raise ConfigError("sandbox run: no command given; usage: agentrl sandbox run --image IMG -- CMD [ARGS...]")
    variables = {}
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"sandbox run --env {item!r}: expected KEY=VALUE")
        variables[key] = value
    config = config_from_dict(SandboxConfig, {
        "type": backend, "image": image, "runtime": runtime, "memory_mb": memory_mb, "cpus": cpus,
        "network": network, "workdir": workdir, "env": variables, "exec_timeout_s": timeout,
    }, source="agentrl sandbox run")

    async def go():
        async with create_sandbox(config) as sandbox:
            return await sandbox.exec(argv if len(argv) > 1 else argv[0])

    result = asyncio.run(go())
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if result.stdout_truncated or result.stderr_truncated:
        typer.secho("[output truncated]", fg="yellow", err=True)
    if result.timed_out:
        typer.secho(f"[killed after {timeout:g}s timeout]", fg="red", err=True)
    raise SystemExit(result.exit_code)  # the command's own exit status


@app.command("build-base")
def build_base(
    force: bool = typer.Option(False, "--force", help="Rebuild even when the cached image matches the recipe."),
) -> None:
    """Build the sandbox base image agentrl-base:bookworm (debootstrap + python3, git, pytest); cached."""
    from agentrl.sandbox.base_image import build_base_image

    info = build_base_image(force=force)
    state = "cached" if info.cached else "built"
    typer.echo(f"{info.tag} {state} (recipe {info.recipe_hash}, {info.image_id[:19]}, rootfs {info.rootfs})")


def _backends(backend: str | None) -> dict[str, bool]:
    if backend not in (None, "docker", "bwrap"):
        raise ConfigError(f"--type {backend!r}: expected docker or bwrap")
    return {"docker": backend in (None, "docker"), "bwrap": backend in (None, "bwrap")}


@app.command("ls")
def ls(backend: str | None = typer.Option(None, "--type", help="Only this backend: docker or bwrap.")) -> None:
    """List agentrl sandboxes on this machine, with their owner and whether they are orphans."""
    from rich.console import Console
    from rich.table import Table

    from agentrl.sandbox.gc import list_sandboxes

    kinds = _backends(backend)
    found = list_sandboxes(include_docker=kinds["docker"], include_bwrap=kinds["bwrap"])
    table = Table("backend", "id", "owner", "pid", "status", "image", "orphan")
    for info in found:
        table.add_row(
            info.backend, info.id, info.owner, info.pid, info.status, info.image, "yes" if info.orphan else ""
        )
    console = Console()
    Console(width=max(console.width, 150)).print(table)  # ids and owners are never cut off
    typer.echo(f"{len(found)} sandbox(es)")


@app.command("gc")
def gc(
    owner: str | None = typer.Option(None, "--owner", help="Remove this run's sandboxes (alive or not)."),
    everything: bool = typer.Option(False, "--all", help="Remove every agentrl sandbox on this machine."),
    backend: str | None = typer.Option(None, "--type", help="Only this backend: docker or bwrap."),
) -> None:
    """Remove sandboxes whose owning process died (default), a run's (--owner) or all (--all)."""
    from agentrl.sandbox.gc import collect_garbage

    kinds = _backends(backend)
    removed = collect_garbage(owner=owner, everything=everything, docker=kinds["docker"], bwrap=kinds["bwrap"])
    for info in removed:
        typer.echo(f"removed {info.backend} {info.id} (owner {info.owner}, pid {info.pid})")
    typer.echo(f"{len(removed)} sandbox(es) removed")
