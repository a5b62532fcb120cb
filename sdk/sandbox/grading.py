"""Grading out of the agent's reach: the episode's final files, graded in a fresh sandbox.

A grader that runs where the agent ran can be fooled by whatever the agent left running:
a loop that rewrites the reward file while the tests run, a process that stops the test
command and prints "passed" on its output. `grade_in_fresh_sandbox(sandbox, grade)`:

1. kills the agent's processes, then copies the episode's final files (`paths`, the
   working directory by default) out of the agent's sandbox: regular files and folders
   only, checked member by member on the host (`archive.extract_archive`);
2. closes the agent's sandbox (whatever still ran there dies with it), unless `keep_open`
   (a multi-step trial grading a step while the agent carries on);
3. starts a new sandbox from the same config (same image, same limits), empties each
   path there and copies the files in;
4. awaits `grade(fresh)`, then closes the fresh sandbox whatever happens.

Only the grader runs in the fresh sandbox, so only the grader writes reward files.
Changes outside `paths` (an installed package, a file under /etc) do not travel.

Files that cannot be carried because of what they are (too many, too deep, too large, or a
sandbox that cannot hand them over) raise `WorkdirRejected`: the episode's own doing, which
environments score 0 (a crash would take the rollout out of training: no gradient for the
policy that caused it). The host staging folder is removed without recursion in every case.
"""

from __future__ import annotations

import asyncio
import shlex
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from agentrl.errors import ProcessesSurvived
from agentrl.sandbox import create_sandbox
from agentrl.sandbox.archive import WorkdirRejected, remove_tree
from agentrl.sandbox.base import Sandbox, SandboxConfig, SandboxError

__all__ = ["TAMPER_METRIC", "WORKDIR_REJECTED_METRIC", "WorkdirRejected", "grade_in_fresh_sandbox"]

TAMPER_METRIC = "grader/tamper_suspected"
"""The metric every built-in grader sets to 1.0 when its evidence disagreed (the reward is then 0)."""
WORKDIR_REJECTED_METRIC = "grader/workdir_rejected"
"""1.0 when the episode's files could not be carried to the grader (too many, too deep, too large): reward 0."""

T = TypeVar("T")


async def _replace_folder(sandbox: Sandbox, local: Path, remote: str) -> None:
    """Make `remote` in `sandbox` hold exactly what `local` holds."""
    emptied = await sandbox.exec(["/bin/sh", "-c", f"mkdir -p -- {shlex.quote(remote)} && "
                                  f"find {shlex.quote(remote)} -mindepth 1 -delete"], timeout=120)
    if emptied.exit_code != 0:
        raise SandboxError(f"grading: could not empty {remote} in the fresh sandbox: {emptied.stderr.strip()[:200]}")
    try:
        await sandbox.upload(local, remote)
    except WorkdirRejected:
        raise
    except SandboxError as error:  # e.g. the files fill the fresh sandbox's disk
        raise WorkdirRejected(f"grading: {error}") from None


async def grade_in_fresh_sandbox(
    sandbox: Sandbox, grade: Callable[[Sandbox], Awaitable[T]], *, paths: Sequence[str] | None = None,
    config: SandboxConfig | None = None, keep_open: bool = False, drop: Callable[[Path, str], object] | None = None,
) -> T:
    """Carry `paths` (default: the workdir) out of `sandbox`, close it, and run `grade` in a fresh sandbox.

    `config` overrides the fresh sandbox's config (default: the agent sandbox's own); with `keep_open`
    the agent's sandbox stays usable (its processes are still killed before the copy). `drop(local, remote)`
    may remove files from each carried folder on the host before it goes in (start-up hooks the grader's
    programs would run).
    """
    remotes = [sandbox._abs(path, "grade_in_fresh_sandbox") for path in (paths or [sandbox.config.workdir])]
    staging = Path(tempfile.mkdtemp(prefix="agentrl-grade-"))
    try:
        locals_ = [staging / str(index) for index in range(len(remotes))]
        try:
            try:
                await sandbox.kill_processes()
            except ProcessesSurvived as error:  # processes the kill could not stop: their files are not graded
                raise WorkdirRejected(f"grading: {error}") from None
            for local, remote in zip(locals_, remotes, strict=True):
                try:
                    await sandbox.download(remote, local)
                except WorkdirRejected:
                    raise
                except SandboxError as error:  # the agent's sandbox could not hand its files over
                    raise WorkdirRejected(f"grading: {error}") from None
        finally:
            if not keep_open:
                await sandbox.close()
        if drop is not None:
            for local, remote in zip(locals_, remotes, strict=True):
                await asyncio.to_thread(drop, local, remote)
        async with create_sandbox(config or sandbox.config) as fresh:
            for local, remote in zip(locals_, remotes, strict=True):
                await _replace_folder(fresh, local, remote)
            return await grade(fresh)
    finally:
        await asyncio.to_thread(remove_tree, staging)
