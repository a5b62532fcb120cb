"""What a Docker sandbox reads from its image before it starts, cached per process.

- `image_user`: the image's configured user (`USER` in its Dockerfile), which commands run
  as when `SandboxConfig.user` is not set;
- `numeric_user`: a user name as uid:gid, looked up in the image's /etc/passwd and
  /etc/group (through a throwaway labelled container), so the tmpfs workspace can be owned
  by the command user;
- `workdir_seed`: a tar of the image's content at the working directory, read from the
  created container before the tmpfs mounted there hides it, and unpacked into the tmpfs
  once the sandbox runs (the last `SEED_CACHE_ENTRIES` (image, workdir) pairs are kept).
"""
from __future__ import annotations

import io
import tarfile

from agentrl.errors import require
from agentrl.sandbox.labels import sandbox_labels

__all__ = ["SEED_CACHE_ENTRIES", "image_user", "numeric_user", "workdir_seed"]

_image_users: dict[str, str] = {}  # image -> its configured user (Config.User)
_numeric_users: dict[tuple[str, str], str] = {}  # (image, user name) -> uid:gid from the image's /etc/passwd
_seed_cache: dict[tuple[str, str], bytes | None] = {}  # (image, workdir) -> tar of the image's workdir
SEED_CACHE_ENTRIES = 32


def image_user(client, image: str) -> str | None:
    """The image's configured user (`USER` in its Dockerfile); None for root or a missing image."""
    docker = require("docker", "cpu")
    if image not in _image_users:
        try:
            _image_users[image] = (client.api.inspect_image(image).get("Config") or {}).get("User") or ""
        except docker.errors.ImageNotFound:
            return None  # create_container reports it
    return _image_users[image] or None


def numeric_user(client, image: str, user: str, *, owner: str) -> str:
    """`user` as uid:gid (a name looked up in the image's /etc/passwd, cached): tmpfs owners.

    The probe container carries `owner`'s sandbox labels, so a crash leaves it to gc.
    """
    name, _, group = user.partition(":")
    if name.isdigit() and (not group or group.isdigit()):
        return user
    key = (image, user)
    if key not in _numeric_users:
        files = {}
        try:
            labels = sandbox_labels(owner=owner, backend="docker")
            probe = client.api.create_container(image=image, command=["true"], labels=labels)
        except Exception:  # a missing image: create_container reports it again, with its one-line error
            return user
        try:
            for path in ("/etc/passwd", "/etc/group"):
                stream, _stat = client.api.get_archive(probe["Id"], path)
                with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                    member = tar.extractfile(tar.getmembers()[0])
                    files[path] = member.read().decode(errors="replace") if member else ""
        except Exception:  # no passwd file: leave the name to sandboxd
            files = {}
        finally:
            client.api.remove_container(probe["Id"], force=True)
        passwd = [line.split(":") for line in files.get("/etc/passwd", "").splitlines()]
        users = {fields[0]: (fields[2], fields[3]) for fields in passwd if len(fields) > 3}
        group_lines = [line.split(":") for line in files.get("/etc/group", "").splitlines()]
        groups = {fields[0]: fields[2] for fields in group_lines if len(fields) > 2}
        uid, gid = users.get(name, (name, None))
        gid = (groups.get(group, group) if group else gid) or uid
        _numeric_users[key] = f"{uid}:{gid}"
    return _numeric_users[key]


def workdir_seed(client, container_id: str, *, image: str, workdir: str) -> bytes | None:
    """A tar of the image's content at `workdir` (read before the tmpfs hides it); cached per image.

    None when the image has nothing there.
    """
    docker = require("docker", "cpu")
    key = (image, workdir)
    if key not in _seed_cache:
        try:
            stream, _stat = client.api.get_archive(container_id, workdir.rstrip("/") + "/.")
            data = b"".join(stream)
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                empty = all(member.name in (".", "./") for member in tar.getmembers())
            if len(_seed_cache) >= SEED_CACHE_ENTRIES:
                _seed_cache.pop(next(iter(_seed_cache)))
            _seed_cache[key] = None if empty else data
        except docker.errors.NotFound:
            _seed_cache[key] = None
    return _seed_cache[key]
