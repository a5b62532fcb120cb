"""User-facing errors.

Every mistake a user can make (a bad config key, an unknown environment, a missing Docker
engine) is raised as an `AgentrlError` carrying one line that names the field or file and
says what to do. The CLI prints that line and exits with status 2 instead of a traceback.
"""

from __future__ import annotations


class AgentrlError(Exception):
    """An error caused by user input or the machine's set-up, shown as one line."""

    exit_code: int = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:  # one line, always
        return " ".join(self.message.split("\n"))


class ConfigError(AgentrlError):
    """A config file or override is malformed, has an unknown key, or a wrong type."""


class NotFoundError(AgentrlError):
    """A named thing (environment, model, image, checkpoint) does not exist."""


class SandboxError(AgentrlError):
    """A sandbox could not be created or used (engine or image missing, limits refused, a path or archive refused)."""


class ProcessesSurvived(SandboxError):
    """Processes of the sandbox still ran after its kill gave up (forks outpacing the SIGKILLs): nothing may be
    graded beside them. The episode's own doing, so graders score it 0 rather than drop it."""

    def __init__(self, message: str, *, count: int) -> None:
        super().__init__(message)
        self.count = count
        """How many still ran."""


class WeightUpdateError(AgentrlError):
    """A weight update could not be applied to a server."""


class InferenceError(AgentrlError):
    """The inference server refused or failed a request.

    `retryable`: the server was unreachable or failed on its side (connection error, HTTP 5xx),
    so the same request may succeed once it is back; a refusal (HTTP 4xx) is not retried.
    """

    def __init__(self, message: str, *, status: int | None = None, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status the server answered with (None when there was no answer)."""
        self.retryable = (status is None or status >= 500) if retryable is None else retryable


class ContextLengthError(AgentrlError):
    """A prompt longer than the model's context: `prompt of 5,210 tokens exceeds tiny-moe's context of 2,048 tokens`.

    Not an `InferenceError`: no server restart makes the request succeed, so the layers that
    retry inference failures (`agentrl.inference.supervisor.SupervisedClient`) let it through.
    """

    def __init__(self, message: str, *, prompt_tokens: int, context_tokens: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.context_tokens = context_tokens


class MissingExtraError(AgentrlError):
    """A heavy optional dependency is not installed."""

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(
            f"{module} is not installed; install the extra with: pip install 'agentrl[{extra}]'"
        )


def require(module: str, extra: str):
    """Import a heavy optional module, or raise a one-line error naming the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingExtraError(module, extra) from exc


class AgentrlWarning(RuntimeWarning):
    """Something a user should know and the run goes on without (a sandbox limit or network the host cannot give,
    a log at its size cap): the `agentrl` command shows it as one line, `warning: ...`."""
