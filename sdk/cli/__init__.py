"""The `agentrl` command line: one Typer app, one file per command group.

Each module in `agentrl.cli` registers either a command group (a Typer app named `app`,
added under its group name) or top-level commands (a `register(app)` function). Modules
are listed here once; a group whose module is absent from this install is skipped. Every
`AgentrlError` raised by a command is printed as one line, with exit status 2. Text a sandbox
or a model wrote (rollout errors, their stderr) goes to the terminal through `printable`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import typer

from agentrl.errors import AgentrlError

_python_show_warning = None  # warnings.showwarning as it was before `main` set its own

app = typer.Typer(
    name="agentrl",
    help="Environment hub and asynchronous RL training for agent tasks on MoE models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def printable(text: str) -> str:
    """`text` safe for a terminal: control and format characters (ESC sequences, bidi overrides) written as
    visible escapes (`\\x1b`, `\\u202e`), newlines and tabs kept. Print it with rich's `markup=False`."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else ascii(c)[1:-1] for c in text)


def _print_version(value: bool) -> None:
    if value:
        import agentrl

        # where it runs from too: two checkouts (or a checkout and a venv) on one machine print the same number
        typer.echo(f"agentrl {agentrl.__version__} ({Path(agentrl.__file__).resolve().parent})")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the agentrl version and exit."),
) -> None:
    """Environment hub and asynchronous RL training for agent tasks on MoE models."""


@app.command()
def version() -> None:
    """Print the agentrl version."""
    from agentrl import __version__

    typer.echo(__version__)


# Modules that define top-level commands through `register(app)`.
COMMAND_MODULES = ["models", "serve", "eval", "train", "trainer_plan", "view"]
# Modules that define a command group `app`, mounted under the given name.
GROUP_MODULES = {"env": "env", "sandbox": "sandbox", "config": "config"}


def _module(name: str):
    full = f"agentrl.cli.{name}"
    if importlib.util.find_spec(full) is None:
        return None
    return importlib.import_module(full)


for _name in COMMAND_MODULES:
    _mod = _module(_name)
    if _mod is not None:
        _mod.register(app)

for _group, _name in GROUP_MODULES.items():
    _mod = _module(_name)
    if _mod is not None:
        app.add_typer(_mod.app, name=_group)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` of the command: agentrl's own warnings as one line, others as Python shows them."""
    from agentrl.errors import AgentrlWarning

    if issubclass(category, AgentrlWarning):
        typer.secho(f"warning: {printable(str(message))}", fg="yellow", err=True)
    else:
        _python_show_warning(message, category, filename, lineno, file, line)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `agentrl` script: run the app, print user errors and agentrl's warnings as one line."""
    import warnings

    global _python_show_warning
    if warnings.showwarning is not _show_warning:
        _python_show_warning, warnings.showwarning = warnings.showwarning, _show_warning
    try:
        # Not standalone, click hands back a command's `typer.Exit(code)` as the return value.
        code = app(args=argv, prog_name="agentrl", standalone_mode=False)
    except AgentrlError as error:
        typer.secho(f"error: {printable(str(error))}", fg="red", err=True)
        return error.exit_code
    except KeyboardInterrupt:
        typer.secho("interrupted", fg="yellow", err=True)
        return 130
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except Exception as error:
        # Click's usage errors (typer vendors click) arrive here in non-standalone mode.
        if hasattr(error, "show") and hasattr(error, "exit_code"):
            error.show()
            return error.exit_code
        if type(error).__name__ == "Abort":
            typer.secho("aborted", fg="yellow", err=True)
            return 1
        raise
    return code if isinstance(code, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
