"""`agentrl env import swebench ROWS`: SWE-bench rows become an agentrl environment package.

ROWS is a `.jsonl` / `.json` file of SWE-bench rows (SWE-bench, Lite, Verified, SWE-Gym,
the `swebench` 5 datasets with `image`, `eval_script`, `log_parser`, `eval_type`), or a
folder written by `datasets`' `save_to_disk` (a Dataset, or a DatasetDict: every split, or
the one `--split` names). Every row is read as the built-in `swe` environment grades it
(`swe:checked_instances`): its fields, its image (the row's own, else
`<namespace>/sweb.eval.x86_64.<id>:latest`), and that it can be graded (its eval script and
a `swebench` log parser, pytest node ids, or a test command known for its runner); the
first row that cannot is refused in one line, so a package never holds a row that would
score 0 for want of a grader.

The package written:

    environment.toml   entrypoint swebench_rows:load_environment, [dataset.splits] per split,
                       [sandbox] the first row's image, /testbed, no network, the swe environment's
                       limits; requirements: swebench when a row is graded through an eval script
    swebench_rows.py   load_environment(**kwargs): the built-in `swe` environment over data/*.jsonl;
                       oracle_policy(): the gold patches through the tools
    data/<split>.jsonl verifiers rows (prompt: the problem statement, answer: the gold patch,
                       info: the whole row with its image name)
    README.md

A single file becomes the split `test` (SWE-bench's); `train` and `test` are aliases of the
first split when the source lacks them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError, NotFoundError

__all__ = ["ENTRY_MODULE", "import_swebench_rows", "read_swebench_rows"]

ENTRY_MODULE = "swebench_rows"
# Rows graded through an eval script need swebench's parsers: the package says so (`agentrl env install` installs it).
SWEBENCH_REQUIREMENT = "swebench==5.0.2"

_ENTRY = '''"""Entrypoint of a package imported from SWE-bench rows by `agentrl env import swebench`."""

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SPLITS = {splits!r}


def _swe_attr(name):
    from agentrl.hub.loader import builtin_environments_dir
    from agentrl.hub.entrypoint import import_package_attr

    return import_package_attr(builtin_environments_dir() / "swe", f"swe:{{name}}", package_name="swe")


def _data_files():
    return {{split: str(PACKAGE_DIR / path) for split, path in SPLITS.items()}}


def load_environment(**kwargs):
    return _swe_attr("load_environment")(data_files=_data_files(), **kwargs)


def oracle_policy(mode="gold"):
    return _swe_attr("oracle_policy")(data_files=_data_files(), mode=mode)
'''


def _swe_attr(name: str) -> Any:
    from agentrl.hub.entrypoint import import_package_attr
    from agentrl.hub.loader import builtin_environments_dir

    return import_package_attr(builtin_environments_dir() / "swe", f"swe:{name}", package_name="swe")


def read_swebench_rows(source: str | Path, *, split: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """Split name -> raw rows of a jsonl/json file or a saved `datasets` folder."""
    source = Path(source)
    if source.is_file():
        if split is not None:
            raise AgentrlError(f"{source}: --split only applies to a saved DatasetDict folder")
        text = source.read_text()
        try:
            rows = json.loads(text) if text.lstrip().startswith("[") else [
                json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            raise AgentrlError(
                f"{source}: not JSON lines of SWE-bench rows ({error.msg}, line {error.lineno})"
            ) from None
        return {"test": rows}
    if not source.is_dir():
        raise NotFoundError(f"{source}: no such file or folder; give a .jsonl of SWE-bench rows or a folder "
                            "written by datasets' save_to_disk")
    import datasets

    try:
        loaded = datasets.load_from_disk(str(source))
    except FileNotFoundError:
        raise NotFoundError(f"{source}: not a folder written by datasets' save_to_disk (no dataset_info.json or "
                            "dataset_dict.json)") from None
    if isinstance(loaded, datasets.Dataset):
        return {split or "test": loaded.to_list()}
    if split is not None:
        if split not in loaded:
            raise NotFoundError(f"{source}: no split {split!r}; it has {', '.join(sorted(loaded))}")
        return {split: loaded[split].to_list()}
    return {name: loaded[name].to_list() for name in loaded}


def _env_name(source: Path) -> str:
    stem = source.name[: -len(source.suffix)] if source.is_file() and source.suffix else source.name
    name = re.sub(r"[^a-z0-9\-_]+", "-", stem.lower()).strip("-_")
    if not name:
        raise AgentrlError(f"{source}: gives no usable environment name; pass --name")
    return (name if name.startswith("swebench") else f"swebench-{name}")[:64]


def import_swebench_rows(source: str | Path, *, out: str | Path | None = None, name: str | None = None,
                         namespace: str | None = None, split: str | None = None) -> Path:
    """Write the agentrl package of SWE-bench rows; returns its folder (a bad row is refused in one line)."""
    from agentrl.config import dump_config
    from agentrl.hub.manifest import DatasetSpec, Manifest, RewardSpec, SandboxLimits, SandboxSpec

    source = Path(source)
    raw = read_swebench_rows(source, split=split)
    checked, task_row, uses_eval_script = (_swe_attr(name) for name in ("checked_instances", "task_row",
                                                                          "uses_eval_script"))
    instances = {part: checked(rows, where=f"{source}[{part}]", namespace=namespace) for part, rows in raw.items()}
    if not any(instances.values()):
        raise AgentrlError(f"{source}: holds no rows")
    env_name = name or _env_name(source)
    target = Path(out) if out is not None else Path(env_name)
    if target.exists() and any(target.iterdir()):
        raise AgentrlError(f"{target}: folder exists and is not empty; pick another --out")
    files = {part: f"data/{part}.jsonl" for part in instances}
    first = next(part for part in instances if instances[part])
    for alias in ("train", "test"):
        files.setdefault(alias, files[first])
    images = sorted({instance.image_name for rows in instances.values() for instance in rows})
    needs_swebench = any(uses_eval_script(instance) for rows in instances.values() for instance in rows)
    manifest = Manifest(
        name=env_name, version="0.1.0", description=f"SWE-bench rows from {source.name} ({len(images)} images)",
        tags=["swe-bench", "sandbox", "multi-turn", "tools", "coding"], entrypoint=f"{ENTRY_MODULE}:load_environment",
        requirements=[SWEBENCH_REQUIREMENT] if needs_swebench else [],
        reward=RewardSpec(description="1.0 when SWE-bench resolves the agent's diff (every FAIL_TO_PASS and "
                                      "PASS_TO_PASS test passes), graded in a fresh sandbox as SWE-bench grades it"),
        dataset=DatasetSpec(splits=files),
        sandbox=SandboxSpec(image=instances[first][0].image_name, network=False, workdir="/testbed",
                            limits=SandboxLimits(cpus=1.0, memory_mb=2048, pids=256, disk_mb=2048, timeout_s=60.0)),
    )
    (target / "data").mkdir(parents=True, exist_ok=True)
    for part, rows in instances.items():
        (target / files[part]).write_text("".join(json.dumps(task_row(i)) + "\n" for i in rows))
    (target / "environment.toml").write_text(
        f"# Imported from SWE-bench rows ({source.name}) by `agentrl env import swebench`.\n" + dump_config(manifest))
    (target / f"{ENTRY_MODULE}.py").write_text(_ENTRY.format(splits=files))
    counts = ", ".join(f"{part}: {len(rows)}" for part, rows in instances.items())
    (target / "README.md").write_text(
        f"# {env_name}\n\nSWE-bench rows imported from `{source.name}` ({counts}) by `agentrl env import swebench`.\n\n"
        "Each rollout runs in the row's image with the repository at `/testbed` (bash, read_file, write_file, "
        "str_replace, submit); the final diff is graded in a fresh sandbox as SWE-bench grades it: the row's "
        "eval script and the `swebench` package's log parser (rows with `eval_script`, or non-pytest tests), "
        "or pytest under the repository's own config. Images (they must be present or pullable):\n\n"
        + "".join(f"- `{image}`\n" for image in images))
    return target
