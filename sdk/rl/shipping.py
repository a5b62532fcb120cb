"""Folders between the driver and Ray nodes that share no filesystem.

The driver's run folder is the one source of truth. Actors work in a node-local folder of
their own (`node_dir()`: `$AGENTRL_NODE_DIR`, else a folder under the system temp dir) and
ship what the driver keeps (checkpoints, exported weights, logs) as `Folder` values: a
mapping of relative file paths to bytes, which Ray carries through its object store. The
other way, a folder the driver has (the starting weights, a checkpoint to resume from) is
written into the node-local folder before an actor uses it, unless the node already
sees it at the same path.

Shipping is skipped where a node does see the driver's folder (one machine, or a shared
disk mounted at the same path): `mark_visible` puts a token file into a folder of the
driver, `sees(folder, token)` tells an actor it can write there directly, and
`nodes_missing(path, nodes)` asks each node (a Ray task pinned to it) whether it sees a model
folder, so the starting weights go into the object store only for nodes that lack them.

`write_folder` writes into a temporary sibling and renames it into place, so a reader
never sees half a folder (`merge=True` adds files to an existing folder instead, each file
written to a temporary name and renamed); file names are checked (relative, no `..`), as
everything crossing a process boundary is.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path, PurePosixPath

from agentrl import env_vars
from agentrl.errors import AgentrlError

__all__ = ["MAX_SHIPPED_BYTES", "WEIGHT_SUFFIXES", "Folder", "folder_bytes", "mark_visible", "node_dir",
           "nodes_missing", "prune_versions", "read_folder", "remove_node_dirs", "sees", "write_folder"]

_MARKER = ".agentrl-visible-"

Folder = dict[str, bytes]
"""Relative POSIX path -> file content."""

#: Largest folder shipped through the object store (the starting weights of big models must be on every node).
MAX_SHIPPED_BYTES = 8 * 1024**3


def node_dir(*parts: str) -> Path:
    """This node's own working folder for agentrl (created), optionally a subfolder of it."""
    root = Path(env_vars.NODE_DIR.get() or Path(tempfile.gettempdir()) / "agentrl-node")
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def remove_node_dirs(run_id: str, *paths: Path) -> None:
    """Remove this node's folders of a run (`paths`, the run's start-weight copy, then the run folder if empty)."""
    for path in (*paths, node_dir("models") / f"{run_id}-start"):
        shutil.rmtree(path, ignore_errors=True)
    try:
        node_dir("runs", run_id).rmdir()
    except OSError:  # another actor of the run on this node still has its folder there
        pass


def mark_visible(folder: str | Path) -> str:
    """Put a token file into one of the driver's folders; actors that find it (`sees`) write there directly."""
    token = uuid.uuid4().hex
    (Path(folder) / f"{_MARKER}{token}").touch()
    return token


def sees(folder: str | Path, token: str | None) -> bool:
    """Whether this process sees the driver's `folder` marked with `token` (same machine or shared disk)."""
    return token is not None and (Path(folder) / f"{_MARKER}{token}").is_file()


def nodes_missing(model_dir: str | Path, nodes: list[str]) -> list[str]:
    """The Ray nodes among `nodes` that do not see the HF folder `model_dir` (no config.json at that path)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def has(path: str) -> bool:
        return (Path(path) / "config.json").is_file()

    unique = sorted(set(nodes))
    found = ray.get([has.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
        str(model_dir)) for node in unique])
    return [node for node, seen in zip(unique, found, strict=True) if not seen]


def prune_versions(folder: Path, *, newest: int, keep: int = 2) -> None:
    """Remove the `v<N>` subfolders of `folder` older than the `keep` newest (up to `newest`): a server may
    still be reading the one before the newest."""
    for old in folder.glob("v*") if folder.is_dir() else []:
        if old.name[1:].isdigit() and int(old.name[1:]) <= newest - keep:
            shutil.rmtree(old, ignore_errors=True)


def folder_bytes(path: str | Path) -> int:
    """Total size of the regular files under `path`."""
    return sum(item.stat().st_size for item in Path(path).rglob("*") if item.is_file() and not item.is_symlink())


#: What a model folder's weights end with: `read_folder(..., skip=WEIGHT_SUFFIXES)` ships the rest (tokenizer, configs).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


def read_folder(path: str | Path, *, max_bytes: int = MAX_SHIPPED_BYTES, skip: tuple[str, ...] = ()) -> Folder:
    """Every regular file under `path` (links are not followed) but those ending with `skip`, by relative path."""
    root = Path(path)
    if not root.is_dir():
        raise AgentrlError(f"{root}: no such folder to ship")
    files: Folder = {}
    total = 0
    for item in sorted(root.rglob("*")):
        if item.is_symlink() or not item.is_file() or item.name.endswith(skip):
            continue
        total += item.stat().st_size
        if total > max_bytes:
            raise AgentrlError(f"{root}: more than {max_bytes / 1024**3:.0f} GiB to ship between nodes; put it on "
                               "storage every node sees (the same path on each) instead")
        files[item.relative_to(root).as_posix()] = item.read_bytes()
    return files


def _checked(name: str) -> PurePosixPath:
    relative = PurePosixPath(name)
    if relative.is_absolute() or not relative.parts or ".." in relative.parts:
        raise AgentrlError(f"shipped folder: refused file name {name!r}")
    return relative


def write_folder(files: Folder, dest: str | Path, *, merge: bool = False) -> Path:
    """Write `files` as the folder `dest` (replacing it whole: temporary sibling, then rename), or with
    `merge` into the existing folder (each file written to a temporary name, then renamed)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if merge:
        for name, data in files.items():
            target = dest / _checked(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.incoming")
            temporary.write_bytes(data)
            temporary.rename(target)
        return dest
    staging = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.incoming")
    try:
        for name, data in files.items():
            target = staging / _checked(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        staging.mkdir(parents=True, exist_ok=True)
        old = None
        if dest.exists():
            old = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.old")
            dest.rename(old)
        staging.rename(dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return dest
