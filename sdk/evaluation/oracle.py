"""An environment's oracle, the policy `agentrl eval --oracle` plays instead of a model.

An environment package may define `oracle_policy(...)` beside its `load_environment` in the entrypoint module: a
`ChatClient` that solves the tasks by their reference solutions (a Harbor task's `solution/solve.sh`, a SWE task's
gold patch, the answer a generator knows). Playing it checks a package end to end without a model: the tasks can
be solved in their sandboxes and the grader pays for a solution (reward 1), the check Harbor makes with
`harbor run --agent oracle`. `load_oracle(environment, env_args)` finds it and calls it with the environment's
arguments its signature takes (a SWE package's `data_dir`, say).
"""

from __future__ import annotations

import inspect
from typing import Any

from agentrl.errors import NotFoundError

__all__ = ["ORACLE_NAME", "load_oracle"]

ORACLE_NAME = "oracle_policy"
"""The entrypoint module's function that returns the oracle policy."""


def load_oracle(environment: Any, env_args: dict[str, Any]) -> Any:
    """The oracle policy of a loaded environment package; `NotFoundError` in one line when it defines none."""
    from agentrl.hub.entrypoint import import_package_attr

    manifest, folder = getattr(environment, "manifest", None), getattr(environment, "path", None)
    name = getattr(environment, "name", "environment")
    if manifest is None or folder is None:
        raise NotFoundError(f"environment {name!r} is not a package, so it has no {ORACLE_NAME}(); --oracle plays "
                            "a package's own")
    module = manifest.entrypoint.split(":", 1)[0]
    try:
        factory = import_package_attr(folder, f"{module}:{ORACLE_NAME}", package_name=manifest.name)
    except NotFoundError:
        factory = None
    if not callable(factory):
        raise NotFoundError(f"environment {name!r} has no oracle: define {ORACLE_NAME}() in {folder / module}.py, "
                            "returning a ChatClient that solves its tasks (agentrl.policies.ScriptedPolicy)")
    parameters = inspect.signature(factory).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return factory(**{key: value for key, value in env_args.items() if takes_all or key in parameters})
