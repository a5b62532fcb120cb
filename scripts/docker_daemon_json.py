#!/usr/bin/env python3
"""Register gVisor ('runsc') as a Docker runtime in daemon.json, keeping every other setting.

    python3 scripts/docker_daemon_json.py [/etc/docker/daemon.json] [--runsc /usr/bin/runsc]

scripts/start-dockerd.sh runs it before it starts its own dockerd; on an engine that is already
running, run it by hand and restart dockerd to add runsc. The runsc entry gets the two arguments
agentrl's sandboxes need: --network=none (gVisor refuses to start in the root network namespace
otherwise) and --oci-seccomp (gVisor applies Docker's seccomp profile only with it: no nested
user namespaces). An entry already there keeps its path and its other arguments. The file is
rewritten (atomically, same mode) only when something was missing; a file that is not a JSON
object is left alone and reported. Standard library only: it runs before agentrl is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

DAEMON_JSON = Path("/etc/docker/daemon.json")
RUNSC_ARGS = ("--network=none", "--oci-seccomp")


class DaemonJsonError(Exception):
    """daemon.json exists but cannot be amended (not JSON, not an object, an entry of the wrong type)."""


def merge_runsc(path: str | os.PathLike[str] = DAEMON_JSON, runsc: str = "/usr/bin/runsc") -> bool:
    """Add (or complete) the runsc runtime in the daemon.json at `path`; True when the file was written."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    try:
        config = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise DaemonJsonError(f"{path}: not valid JSON ({exc}); fix it by hand, it was left as it is") \
            from None
    if not isinstance(config, dict):
        raise DaemonJsonError(f"{path}: holds a JSON {type(config).__name__}, not an object; left as it is")
    before = json.dumps(config, sort_keys=True)
    runtimes = config.setdefault("runtimes", {})
    if not isinstance(runtimes, dict):
        raise DaemonJsonError(f"{path}: \"runtimes\" is not an object; left as it is")
    entry = runtimes.setdefault("runsc", {"path": runsc})
    if not isinstance(entry, dict):
        raise DaemonJsonError(f"{path}: \"runtimes\".\"runsc\" is not an object; left as it is")
    entry.setdefault("path", runsc)
    args = entry.setdefault("runtimeArgs", [])
    if not isinstance(args, list):
        raise DaemonJsonError(f"{path}: \"runtimes\".\"runsc\".\"runtimeArgs\" is not a list; left as it is")
    args.extend([arg for arg in RUNSC_ARGS if arg not in args])
    if path.exists() and json.dumps(config, sort_keys=True) == before:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
        handle.write(json.dumps(config, indent=2) + "\n")
    os.chmod(handle.name, mode)
    os.replace(handle.name, path)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=str(DAEMON_JSON), help="daemon.json to amend")
    parser.add_argument("--runsc", default="/usr/bin/runsc", help="runsc binary for a new entry")
    args = parser.parse_args(argv)
    try:
        changed = merge_runsc(args.path, args.runsc)
    except (DaemonJsonError, OSError) as exc:
        print(f"[install] {exc}", file=sys.stderr)
        return 1
    print(f"[install] {args.path}: runsc {'registered' if changed else 'already registered'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
