"""Copying a task's files into a package without pulling host files in, and writing a package atomically.

`shutil.copytree` follows symbolic links: a link in a Harbor task folder to a host file
became a real file in the package, was built into the image and published; a link loop
gave a traceback and a half-written package. Here:

- `copy_tree(source, destination)` walks `source` without following any link (and without
  recursion). Regular files and folders are copied; a link whose target stays inside
  `source` is kept as the same link; a link that leads out of it (absolute, `..` past the
  root, or through another link out) is refused in one line naming it; a link loop is
  refused; devices, FIFOs and sockets are refused.
- `package_folder(target)` is a context manager yielding a fresh staging folder beside
  `target`: on success it becomes `target` by one rename, on any error it is removed, so a
  failed import leaves nothing half-written (and an existing non-empty `target` is never
  touched).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from agentrl.errors import AgentrlError, ConfigError
from agentrl.sandbox.archive import remove_tree

__all__ = ["copy_tree", "package_folder"]


def _link_target_inside(root: Path, link: Path) -> str:
    """The link's text when its target stays inside `root` and is no folder holding the link; ConfigError (one
    line) otherwise."""
    text = os.readlink(link)
    try:
        resolved = link.resolve(strict=False)
    except (RuntimeError, OSError):  # a loop: RuntimeError on Python 3.11, OSError (ELOOP) later
        raise ConfigError(f"{link}: symbolic link loop ({text!r}); replace the link with the file it means") from None
    if not resolved.is_relative_to(root):
        raise ConfigError(f"{link}: symbolic link to {text!r} leads out of the task folder {root}; copy the file "
                          "into the task instead")
    if link.parent.is_relative_to(resolved):
        raise ConfigError(f"{link}: symbolic link to {text!r} points at a folder holding it (a loop); remove it")
    return text


def copy_tree(source: str | Path, destination: str | Path, *, ignore: Callable[[str], bool] | None = None,
              only: Sequence[str] | None = None) -> None:
    """Copy `source` into `destination` (created) without following links; see the module docstring.

    `ignore(name)`: names (files or folders, at any level) left out; `only`: the names copied from `source`'s
    top level (all by default).
    """
    root = Path(source).resolve()
    stack = [(root, Path(destination))]
    while stack:
        folder, target = stack.pop()
        target.mkdir(parents=True, exist_ok=True)
        for entry in sorted(os.scandir(folder), key=lambda item: item.name):
            if (ignore is not None and ignore(entry.name)) or (only is not None and folder == root
                                                                and entry.name not in only):
                continue
            path, out = Path(entry.path), target / entry.name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                os.symlink(_link_target_inside(root, path), out)
            elif stat.S_ISDIR(mode):
                stack.append((path, out))
            elif stat.S_ISREG(mode):
                shutil.copyfile(path, out, follow_symlinks=False)
                os.chmod(out, stat.S_IMODE(mode) & 0o755 | 0o600)
            else:
                raise ConfigError(f"{path}: not a regular file, folder or link (a device, FIFO or socket); "
                                  "remove it from the task")


@contextlib.contextmanager
def package_folder(target: str | Path) -> Iterator[Path]:
    """A staging folder that becomes `target` in one rename when the block succeeds, and is removed otherwise."""
    target = Path(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise AgentrlError(f"{target}: folder exists and is not empty; pick another --out")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield staging
        staging.chmod(0o755)
        if target.exists():
            target.rmdir()  # empty, checked above
        os.rename(staging, target)
    except BaseException:
        remove_tree(staging)
        raise
