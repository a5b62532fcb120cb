"""A small root filesystem for key-hunt's bubblewrap sandboxes, made from this machine's own programs.

The bubblewrap backend runs each sandbox over a read-only root filesystem, by default the
Debian tree `agentrl sandbox build-base` makes with debootstrap (a Debian mirror, 317 MB). A
machine with neither Docker nor a mirror (the lent H200s) can make this one instead: bash and
the programs key-hunt's episodes use (coreutils, grep, find, tar), copied from the host with
the shared libraries `ldd` names, the folders the sandbox mounts over, and an /etc/passwd
naming the sandbox user. Nothing is downloaded; it takes a second and about 10 MB.

    python3 environments/key_hunt/key_hunt_rootfs.py /var/cache/agentrl/rootfs/key-hunt
    agentrl train --config cookbook/cpu-agent/train.toml \\
        --set 'env.args={pool_size=8, sandbox={type="bwrap", rootfs="/var/cache/agentrl/rootfs/key-hunt"}}'

The sandbox sees only these files (and its own workdir, /tmp and home), never the host's.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["PROGRAMS", "make_rootfs"]

PROGRAMS = ["bash", "sh", "cat", "ls", "grep", "find", "head", "tail", "wc", "sort", "uniq", "cut", "tr", "echo",
            "printf", "mkdir", "rm", "cp", "mv", "touch", "chmod", "ln", "env", "sleep", "seq", "test", "true",
            "false", "pwd", "id", "stat", "tar", "kill", "ps", "nohup", "setsid", "timeout", "dirname", "basename"]
MOUNT_POINTS = ["workspace", "tmp", "home/agent", "dev", "proc", "etc"]
_LIBRARY = re.compile(r"(/\S+)")


def _libraries(binary: Path) -> set[Path]:
    """The shared libraries (and the loader) `ldd` lists for `binary`; none for a static one."""
    result = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False)
    return {Path(match) for line in result.stdout.splitlines() for match in _LIBRARY.findall(line)
            if "=>" in line or line.strip().startswith("/")}


def _copy(source: Path, root: Path) -> None:
    """`source` (symlinks resolved) at its own path under `root`, and at its resolved path too."""
    for path in {source, source.resolve()}:
        target = root / path.relative_to("/")
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source.resolve(), target)


def make_rootfs(folder: str | Path, *, programs: list[str] = PROGRAMS) -> Path:
    """Write the root filesystem into `folder` (made or refreshed); returns it. Programs the host lacks are
    skipped, except bash, which the sandboxes run every command with."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    found = {name: shutil.which(name) for name in programs}
    if not found.get("bash"):
        raise SystemExit("key-hunt rootfs: this machine has no bash to copy")
    for name, where in found.items():
        if where is None:
            continue
        binary = Path(where)
        _copy(binary, root)
        for library in _libraries(binary.resolve()):
            if library.exists():
                _copy(library, root)
        for link in ("bin", "usr/bin"):  # the sandbox's PATH finds it in either
            target = root / link / name
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(binary.resolve(), target)
    if not (root / "bin" / "sh").exists():
        os.symlink(Path(found["bash"]).resolve(), root / "bin" / "sh")
    for name in MOUNT_POINTS:
        (root / name).mkdir(parents=True, exist_ok=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000::/home/agent:/bin/bash\n")
    (root / "etc" / "group").write_text("root:x:0:\nagent:x:1000:\n")
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Make a small bubblewrap root filesystem from this host's programs.")
    parser.add_argument("folder", help="where to write it, e.g. /var/cache/agentrl/rootfs/key-hunt")
    args = parser.parse_args(argv)
    print(make_rootfs(args.folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
