"""`agentrl sandbox ...`: run a command in a sandbox, build the base image, list and reap sandboxes."""

from __future__ import annotations

import typer

app = typer.Typer(help="Sandboxes: run commands, build the base image, list and garbage-collect.", no_args_is_help=True)


@app.command("build-base")
def build_base(
    force: bool = typer.Option(False, "--force", help="Rebuild even when the cached image matches the recipe."),
) -> None:
    """Build the sandbox base image agentrl-base:bookworm (debootstrap + python3, git, pytest); cached."""
    from agentrl.sandbox.base_image import build_base_image

    info = build_base_image(force=force)
    state = "cached" if info.cached else "built"
    typer.echo(f"{info.tag} {state} (recipe {info.recipe_hash}, {info.image_id[:19]}, rootfs {info.rootfs})")
