"""`agentrl view`: serve the local viewer of runs, evaluations and rollouts on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("view")
    def view_command(
        folders: list[Path] = typer.Argument(None, help="Run or eval folders, or folders holding them "
                                                        "(default: runs)."),
        port: int = typer.Option(8765, "--port", "-p", help="Port on 127.0.0.1 (0: a free one)."),
    ) -> None:
        """Open runs and evaluations in the browser: curves that update while a run trains, its rollouts
        (filter by step, task, reward; turns, tool calls, outputs, diffs, per-token logprobs) and two
        evaluations side by side. Serves http://127.0.0.1:PORT/ until Ctrl-C."""
        from agentrl.errors import ConfigError
        from agentrl.viewer.serve import serve

        if not 0 <= port <= 65535:
            raise ConfigError(f"--port {port}: use a port from 0 to 65535")

        def ready(url: str) -> None:
            typer.echo(f"agentrl view: {url}  (Ctrl-C stops it)")

        serve(list(folders or [Path("runs")]), port=port, on_ready=ready)
