"""Environment packages: validate a package folder, hash it, build its dataset, stage it for publishing.

A *source* package is the folder a user writes (`environment.toml`, the module, an optional
Dockerfile, data or a generator, README.md). A *published* package is what a hub stores and
what `pull` returns: the source files, the dataset built to parquet under `dataset/`, the
README turned into a dataset card with YAML metadata, the manifest with the image digest
filled in, and `agentrl-package.json`, the lock file listing the sha256 of every published
file plus the package's content hash.

The content hash covers the source files only (path and bytes, in sorted order), so the
same source always hashes the same: pushing it again is a no-op, and pushing different
content under an existing version is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.config import dump_config
from agentrl.errors import AgentrlError, ConfigError, NotFoundError
from agentrl.hub.entrypoint import import_package_attr
from agentrl.hub.manifest import MANIFEST_NAME, Manifest, load_manifest

__all__ = [
    "LOCK_NAME", "DATASET_DIR", "IGNORED_NAMES", "PackageLock", "HashMismatchError",
    "source_files", "content_hash", "file_sha256", "build_dataset", "validate_package",
    "stage_package", "verify_package", "read_lock", "published_files",
]

LOCK_NAME = "agentrl-package.json"
"""The lock file of a published package: every file's sha256 and the content hash."""
DATASET_DIR = "dataset"
"""Folder of the published package holding one parquet file per split."""
IGNORED_NAMES = {"__pycache__", ".git", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".venv", ".DS_Store",
                 LOCK_NAME, ".cache"}
"""File and folder names never packaged."""
RUNS_DIR = "runs"
"""Top-level folder never packaged: where `agentrl eval` and `train` write their runs when started in the package."""
_IGNORED_SUFFIXES = (".pyc", ".pyo", ".swp")
_VALIDATE_BATCH = 4096


class HashMismatchError(AgentrlError):
    """A published file's bytes do not match the sha256 its lock file records."""


@dataclass
class PackageLock:
    """The parsed `agentrl-package.json` of a published package."""

    name: str
    version: str
    content_hash: str
    files: dict[str, str]
    image: str | None = None
    image_digest: str | None = None
    splits: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2, sort_keys=True) + "\n"


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def source_files(package_dir: Path) -> list[str]:
    """Relative POSIX paths of the package's files, sorted, without caches, VCS folders or build output."""
    package_dir = Path(package_dir)
    found: list[str] = []
    for path in sorted(package_dir.rglob("*")):
        relative = path.relative_to(package_dir)
        if any(part in IGNORED_NAMES for part in relative.parts) or path.name.endswith(_IGNORED_SUFFIXES):
            continue
        if relative.parts[0] == DATASET_DIR and (package_dir / LOCK_NAME).exists():
            continue  # a published package's built dataset is output, not source
        if relative.parts[0] == RUNS_DIR:
            continue  # `agentrl eval` / `train` started in the package folder write their runs here
        if path.is_symlink():
            raise AgentrlError(f"{path}: symbolic links cannot be packaged; copy the file in instead")
        if path.is_file():
            found.append(relative.as_posix())
    return found


def content_hash(package_dir: Path) -> str:
    """`sha256:<hex>` over the sorted (path, sha256) pairs of the package's source files."""
    package_dir = Path(package_dir)
    digest = hashlib.sha256()
    for relative in source_files(package_dir):
        digest.update(f"{relative}\0{file_sha256(package_dir / relative)}\n".encode())
    return "sha256:" + digest.hexdigest()


def _call_generator(package_dir: Path, spec: str, name: str) -> dict[str, Any]:
    function = import_package_attr(package_dir, spec, package_name=name)
    result = function()
    if not hasattr(result, "items"):
        raise ConfigError(f"{package_dir / MANIFEST_NAME}: dataset.generator {spec!r} must return a dict of "
                          f"split name -> datasets.Dataset, got {type(result).__name__}")
    return dict(result.items())


def _package_file(package_dir: Path, relative: str, *, field_name: str) -> Path:
    """A file the manifest names (`field_name`), checked to be a relative path inside the package that no
    symbolic link leads to: an absolute path, `..` or a link would publish a host file (a private held-out set)."""
    pure = Path(relative)
    if pure.is_absolute() or ".." in pure.parts:
        raise ConfigError(f"{package_dir / MANIFEST_NAME}: {field_name} = {relative!r}: must be a path inside the "
                          "package (relative, without '..')")
    path = package_dir
    for part in pure.parts:
        path = path / part
        if path.is_symlink():
            raise ConfigError(f"{package_dir / MANIFEST_NAME}: {field_name} = {relative!r}: {path} is a symbolic "
                              "link; copy the file into the package instead")
    return path


def _load_split_file(package_dir: Path, split: str, relative: str):
    import datasets

    path = _package_file(package_dir, relative, field_name=f"dataset.splits.{split}")
    if not path.is_file():
        raise ConfigError(f"{package_dir / MANIFEST_NAME}: dataset.splits.{split}: file {relative!r} not found")
    if path.suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(path))
    if path.suffix in (".jsonl", ".json"):
        from agentrl.environment import rows_to_dataset

        try:
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
                if path.suffix == ".jsonl" else json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: malformed JSON ({error}); fix the file named by dataset.splits.{split}") \
                from None
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise ConfigError(f"{path}: dataset.splits.{split} must hold JSON objects, one row each")
        return rows_to_dataset(rows)  # the SDK's own conversion (info stored as JSON text)
    raise ConfigError(f"{package_dir / MANIFEST_NAME}: dataset.splits.{split}: {relative!r} must be "
                      ".jsonl, .json or .parquet")


def build_dataset(package_dir: Path, *, manifest: Manifest | None = None) -> dict[str, Any]:
    """The package's splits as `datasets.Dataset`s (from its data files or its generator)."""
    package_dir = Path(package_dir)
    manifest = manifest or load_manifest(package_dir)
    splits: dict[str, Any] = {}
    if manifest.dataset.generator:
        splits.update(_call_generator(package_dir, manifest.dataset.generator, manifest.name))
    for split, relative in manifest.dataset.splits.items():
        splits[split] = _load_split_file(package_dir, split, relative)
    for split, dataset in splits.items():
        if "prompt" not in dataset.column_names:
            raise ConfigError(f"{package_dir}: dataset split {split!r} has no 'prompt' column "
                              f"(rows need prompt, answer, info, task)")
    return splits


def validate_package(package_dir: Path, *, check_rows: bool = True) -> tuple[Manifest, dict[str, Any]]:
    """Check the manifest, the entrypoint module, the Dockerfile and that every row is a valid Task."""
    from agentrl.types import Task

    package_dir = Path(package_dir)
    if not (package_dir / MANIFEST_NAME).is_file():
        raise NotFoundError(f"{package_dir}: no {MANIFEST_NAME}; create one with `agentrl env init NAME`")
    manifest = load_manifest(package_dir)
    module = manifest.entrypoint.split(":")[0]
    module_path = package_dir / (module.replace(".", "/") + ".py")
    if not module_path.is_file() and not (package_dir / module.replace(".", "/") / "__init__.py").is_file():
        raise ConfigError(f"{package_dir / MANIFEST_NAME}: entrypoint {manifest.entrypoint!r}: "
                          f"module file {module_path.name} not found in the package")
    # imported now, not first by a user who pulled a published (immutable) version: a syntax error, a missing
    # import or a misnamed function is one line here ("...: import failed: SyntaxError: ...")
    factory = import_package_attr(package_dir, manifest.entrypoint, package_name=manifest.name)
    if not callable(factory):
        raise ConfigError(f"{package_dir / MANIFEST_NAME}: entrypoint {manifest.entrypoint!r} is a "
                          f"{type(factory).__name__}, not a function returning the Environment")
    if manifest.sandbox and manifest.sandbox.dockerfile and not _package_file(
            package_dir, manifest.sandbox.dockerfile, field_name="sandbox.dockerfile").is_file():
        raise ConfigError(f"{package_dir / MANIFEST_NAME}: sandbox.dockerfile {manifest.sandbox.dockerfile!r} "
                          "not found in the package")
    splits = build_dataset(package_dir, manifest=manifest) if check_rows else {}
    for split, dataset in splits.items():
        for start in range(0, len(dataset), _VALIDATE_BATCH):  # arrow batches: far faster than row iteration
            rows = dataset.data.slice(start, _VALIDATE_BATCH).to_pylist()
            for offset, row in enumerate(rows):
                try:
                    Task.from_row(row)
                except Exception as error:  # noqa: BLE001 - any bad row is reported as one line
                    message = str(error).splitlines()[0]
                    raise ConfigError(f"{package_dir}: dataset split {split!r} row {start + offset}: not a valid "
                                      f"task ({message})") from None
    return manifest, splits


def _dataset_card(manifest: Manifest, splits: dict[str, Any], readme: str, content_hash_value: str) -> str:
    import yaml

    metadata = {
        "license": manifest.license.lower(),
        "pretty_name": manifest.name,
        "tags": ["agentrl", "agentrl-environment", *manifest.tags],
        "configs": [{
            "config_name": "default",
            "data_files": [{"split": split, "path": f"{DATASET_DIR}/{split}.parquet"} for split in sorted(splits)],
        }],
        "agentrl": {"name": manifest.name, "version": manifest.version, "entrypoint": manifest.entrypoint,
                    "content_hash": content_hash_value},
    }
    if readme.startswith("---\n"):  # drop a front matter the author wrote; ours replaces it
        end = readme.find("\n---", 4)
        readme = readme[end + 4:].lstrip("\n") if end != -1 else readme
    body = readme or f"# {manifest.name}\n\n{manifest.description}\n"
    return "---\n" + yaml.safe_dump(metadata, sort_keys=False) + "---\n\n" + body


def stage_package(
    package_dir: Path, staging_dir: Path, *, image: str | None = None, image_digest: str | None = None,
    splits: dict[str, Any] | None = None, manifest: Manifest | None = None, on_file=None,
) -> PackageLock:
    """Write the published form of a package into `staging_dir` (which must be empty or absent)."""
    package_dir, staging_dir = Path(package_dir), Path(staging_dir)
    if manifest is None or splits is None:
        manifest, splits = validate_package(package_dir)
    hash_value = content_hash(package_dir)
    staging_dir.mkdir(parents=True, exist_ok=True)
    for relative in source_files(package_dir):
        target = staging_dir / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(package_dir / relative, target)
        if on_file is not None:
            on_file(relative)
    published = manifest.model_copy(deep=True)
    if published.sandbox is not None and image_digest:
        published.sandbox.image = image or published.sandbox.image
        published.sandbox.digest = image_digest
    (staging_dir / MANIFEST_NAME).write_text(dump_config(published))
    (staging_dir / DATASET_DIR).mkdir(exist_ok=True)
    import datasets

    datasets.disable_progress_bars()
    counts: dict[str, int] = {}
    for split, dataset in sorted(splits.items()):
        dataset.to_parquet(str(staging_dir / DATASET_DIR / f"{split}.parquet"))
        counts[split] = len(dataset)
    readme_path = package_dir / "README.md"
    readme = readme_path.read_text() if readme_path.is_file() else ""
    (staging_dir / "README.md").write_text(_dataset_card(manifest, splits, readme, hash_value))
    files = {
        path.relative_to(staging_dir).as_posix(): file_sha256(path)
        for path in sorted(staging_dir.rglob("*")) if path.is_file() and path.name != LOCK_NAME
    }
    lock = PackageLock(name=manifest.name, version=manifest.version, content_hash=hash_value, files=files,
                       image=published.sandbox.image if published.sandbox else None,
                       image_digest=image_digest, splits=counts)
    (staging_dir / LOCK_NAME).write_text(lock.to_json())
    return lock


_SHA256 = re.compile(r"[0-9a-f]{64}")
_LOCK_TYPES: dict[str, tuple[type, ...]] = {"name": (str,), "version": (str,), "content_hash": (str,),
                                             "files": (dict,), "image": (str, type(None)),
                                             "image_digest": (str, type(None)), "splits": (dict,)}


def _safe_relative(relative: object) -> bool:
    """Whether `relative` is a plain relative POSIX path (no absolute path, `..`, `.` or empty part)."""
    return (isinstance(relative, str) and bool(relative) and not relative.startswith("/") and "\\" not in relative
            and all(part not in ("", ".", "..") for part in relative.split("/")))


def read_lock(package_dir: Path) -> PackageLock:
    """Parse a published package's lock file, every field checked: its file names are paths inside the package,
    each with a sha256."""
    path = Path(package_dir) / LOCK_NAME
    if not path.is_file() or path.is_symlink():
        raise NotFoundError(f"{package_dir}: no {LOCK_NAME}; this is not a published package")

    def bad(why: str) -> HashMismatchError:
        return HashMismatchError(f"{path}: unreadable lock file ({why}); pull the package again")

    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise bad(str(error)) from None
    if not isinstance(data, dict):
        raise bad(f"a JSON object expected, got {type(data).__name__}")
    unknown, missing = sorted(set(data) - set(_LOCK_TYPES)), sorted({"name", "version", "content_hash", "files"}
                                                                    - set(data))
    if unknown or missing:
        raise bad(f"unknown key {unknown[0]!r}" if unknown else f"missing key {missing[0]!r}")
    for key, value in data.items():
        if not isinstance(value, _LOCK_TYPES[key]):
            raise bad(f"{key} is {type(value).__name__}")
    for relative, digest in data["files"].items():
        if not _safe_relative(relative) or relative == LOCK_NAME:
            raise bad(f"files names {relative!r}, not a path inside the package")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise bad(f"files[{relative!r}] is not a sha256")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in data.get("splits", {}).values()):
        raise bad("splits must map split names to row counts")
    return PackageLock(**data)


def published_files(package_dir: Path) -> list[str]:
    """Every file of a published package folder (relative POSIX paths, the lock file too), nothing skipped; a
    symbolic link or anything but a regular file or folder is refused in one line (a link would read a host
    file, a FIFO would block). Walked without following links."""
    package_dir = Path(package_dir)
    if package_dir.is_symlink():
        raise HashMismatchError(f"{package_dir}: the published package folder is a symbolic link; pull it again")
    found: list[str] = []
    for root, folders, files in os.walk(package_dir):
        for name in folders + files:
            path = Path(root) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                raise HashMismatchError(f"{path}: a symbolic link in a published package; pull it again")
            if stat.S_ISREG(mode):
                found.append(path.relative_to(package_dir).as_posix())
            elif not stat.S_ISDIR(mode):
                raise HashMismatchError(f"{path}: not a regular file or folder; pull the package again")
    return sorted(found)


def verify_package(package_dir: Path, *, expected_content_hash: str | None = None) -> PackageLock:
    """Check a published package against its lock file: exactly the files it lists (no other file, a cache folder's
    neither: a `__pycache__/*.pyc` runs in place of a reviewed source), each with its sha256; raise on the first
    difference."""
    package_dir = Path(package_dir)
    lock = read_lock(package_dir)
    if expected_content_hash is not None and lock.content_hash != expected_content_hash:
        raise HashMismatchError(f"{package_dir / LOCK_NAME}: content hash {lock.content_hash} differs from the "
                                f"hub's {expected_content_hash}; pull the package again")
    present = set(published_files(package_dir))
    extra = sorted(relative for relative in present if relative not in lock.files and relative != LOCK_NAME)
    if extra:
        raise HashMismatchError(f"{package_dir / extra[0]}: file not in the published package; pull it again")
    for relative, expected in sorted(lock.files.items()):
        path = package_dir / relative
        if relative not in present:
            raise HashMismatchError(f"{path}: missing from the pulled package; pull it again")
        actual = file_sha256(path)
        if actual != expected:
            raise HashMismatchError(f"{path}: sha256 {actual[:12]}... does not match the published "
                                    f"{expected[:12]}...; the file is corrupted, pull the package again")
    return lock
