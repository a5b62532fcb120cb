"""The Hugging Face Hub backend: one dataset repo per environment, versions as git tags.

A published version is one commit on the repo's `main` branch that holds exactly the
published package (parquet splits under `dataset/`, the package files, README.md as the
dataset card with YAML metadata, `agentrl-package.json`), tagged with the version. The tag
is created only after the commit succeeded, so a push killed midway leaves no version.
Files of an older version that the new one lacks are deleted in the same commit, so every
tag holds one whole package. Pull downloads the tag's snapshot and verifies every hash.

The endpoint comes from `HF_ENDPOINT` (default https://huggingface.co) and the token from
`HF_TOKEN` or `hf auth login`, as `huggingface_hub` reads them.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from agentrl import env_vars
from agentrl.errors import AgentrlError, NotFoundError
from agentrl.hub.package import LOCK_NAME, PackageLock, read_lock, verify_package
from agentrl.hub.refs import PackageRef, VersionConflictError, resolve_version, sort_versions

__all__ = ["HFHub", "PACKAGE_TAG", "TAG_DELAY_ENV"]

PACKAGE_TAG = "agentrl-environment"
"""Dataset tag (from the card metadata) that marks a repo as an agentrl package."""
REPO_TYPE = "dataset"


@contextlib.contextmanager
def _hub_errors(what: str):
    """Turn huggingface_hub and connection errors into one-line AgentrlErrors."""
    import httpx
    from huggingface_hub import errors

    try:
        yield
    except errors.RepositoryNotFoundError:
        raise NotFoundError(f"{what}: repository not found on the Hugging Face Hub (private repos need HF_TOKEN "
                            "or `hf auth login`)") from None
    except errors.RevisionNotFoundError:
        raise NotFoundError(f"{what}: no such version on the Hugging Face Hub; see `agentrl env versions`") from None
    except errors.EntryNotFoundError:
        raise NotFoundError(f"{what}: file not found in the repository; is it an agentrl package?") from None
    except errors.HfHubHTTPError as error:
        first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        hint = " (set HF_TOKEN or run `hf auth login`)" if error.response is not None and \
            error.response.status_code in (401, 403) else ""
        raise AgentrlError(f"{what}: Hugging Face Hub error: {first}{hint}") from None
    except (httpx.ConnectError, httpx.TimeoutException) as error:
        raise AgentrlError(f"{what}: cannot reach the Hugging Face Hub ({type(error).__name__}); check HF_ENDPOINT "
                           "and the network") from None


TAG_DELAY_ENV = env_vars.HUB_TAG_DELAY_S.name
"""Seconds to sleep between the commit and the version tag (fault-injection hook for kill tests)."""


def _fault_delay() -> None:
    import os
    import time

    delay = float(os.environ.get(TAG_DELAY_ENV) or 0)
    if delay > 0:
        time.sleep(delay)


class HFHub:
    """Packages as Hugging Face dataset repos."""

    kind = "hf"

    def __init__(self, *, endpoint: str | None = None, token: str | None = None, private: bool = False) -> None:
        import os

        from huggingface_hub import HfApi

        # read HF_ENDPOINT now, not when huggingface_hub was first imported
        self.api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None, token=token)
        self.token = token
        self.private = private

    def __repr__(self) -> str:
        return f"HFHub({self.api.endpoint!r})"

    # -- reading ---------------------------------------------------------------------------
    def versions(self, ref: PackageRef) -> list[str]:
        """Version tags of the repo, oldest first ([] when the repo does not exist)."""
        try:
            with _hub_errors(ref.repo_id):
                refs = self.api.list_repo_refs(ref.repo_id, repo_type=REPO_TYPE)
        except NotFoundError:
            return []
        return sort_versions(tag.name for tag in refs.tags)

    def resolve(self, ref: PackageRef) -> PackageRef:
        return resolve_version(
            ref, self.versions(ref), hub="on the Hugging Face Hub",
            hub_detail=f"on the Hugging Face Hub ({self.api.endpoint})",
            hint="push it with `agentrl env push --hub hf` or check HF_TOKEN for private repos",
        )

    def _download(self, ref: PackageRef, relative: str) -> Path:
        folder = Path(tempfile.mkdtemp(prefix="agentrl-hf-"))
        with _hub_errors(f"{ref}: {relative}"):
            path = self.api.hf_hub_download(ref.repo_id, relative, repo_type=REPO_TYPE, revision=ref.version,
                                            local_dir=folder)
        return Path(path)

    def lock_of(self, ref: PackageRef) -> PackageLock | None:
        if ref.version is None or ref.version not in self.versions(ref):
            return None
        path = self._download(ref, LOCK_NAME)
        try:
            return read_lock(path.parent)
        finally:
            shutil.rmtree(path.parent, ignore_errors=True)

    def read_text(self, ref: PackageRef, relative: str) -> str:
        ref = self.resolve(ref)
        path = self._download(ref, relative)
        try:
            return path.read_text()
        finally:
            shutil.rmtree(path.parent, ignore_errors=True)

    def list_packages(self) -> list[PackageRef]:
        """Every agentrl package repo visible with this token, at its latest version."""
        with _hub_errors("list"):
            repos = list(self.api.list_datasets(filter=PACKAGE_TAG))
        found: list[PackageRef] = []
        for info in repos:
            owner, name = info.id.split("/", 1)
            versions = self.versions(PackageRef(owner, name))
            if versions:
                found.append(PackageRef(owner, name, versions[-1]))
        return found

    # -- writing ---------------------------------------------------------------------------
    def new_staging_dir(self) -> Path:
        return Path(tempfile.mkdtemp(prefix="agentrl-hf-stage-"))

    def publish(self, staged: Path, ref: PackageRef, lock: PackageLock) -> bool:
        """Commit the staged package to `main` (mirroring it exactly), then tag the commit with the version."""
        from huggingface_hub import errors

        existing = self.lock_of(ref)
        if existing is not None:
            if existing.content_hash == lock.content_hash:
                return False
            raise VersionConflictError.for_ref(ref, existing.content_hash, lock.content_hash)
        with _hub_errors(f"push {ref}"):
            self.api.create_repo(ref.repo_id, repo_type=REPO_TYPE, private=self.private, exist_ok=True)
            commit = self.api.upload_folder(
                repo_id=ref.repo_id, repo_type=REPO_TYPE, folder_path=str(staged),
                commit_message=f"agentrl: publish {ref.name} {ref.version}",
                commit_description=f"content hash {lock.content_hash}", delete_patterns=["*"],
            )
            _fault_delay()
            try:
                self.api.create_tag(ref.repo_id, tag=ref.version, revision=commit.oid, repo_type=REPO_TYPE,
                                    tag_message=f"{ref.name} {ref.version} ({lock.content_hash})")
            except errors.HfHubHTTPError as error:
                if error.response is None or error.response.status_code != 409:
                    raise
                # a concurrent push tagged this version first: same content is a no-op, other content a conflict
                existing = self.lock_of(ref)
                if existing is not None and existing.content_hash == lock.content_hash:
                    return False
                raise VersionConflictError.for_ref(
                    ref, existing.content_hash if existing else "unknown", lock.content_hash) from None
        return True

    def fetch(self, ref: PackageRef, destination: Path) -> PackageLock:
        """Download the version's snapshot into `destination` and verify every file's hash."""
        ref = self.resolve(ref)
        with _hub_errors(f"pull {ref}"):
            self.api.snapshot_download(ref.repo_id, repo_type=REPO_TYPE, revision=ref.version,
                                       local_dir=str(destination), ignore_patterns=[".gitattributes"])
        shutil.rmtree(Path(destination) / ".cache", ignore_errors=True)  # huggingface_hub's local_dir metadata
        return verify_package(destination)
