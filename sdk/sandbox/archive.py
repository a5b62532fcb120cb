"""Paths and archives that cross the sandbox boundary, checked on the host.

Everything a sandbox hands back is hostile. `download` receives a tar made inside the
sandbox; this module unpacks it without ever calling `tarfile.extract*` (whose filters
have had path-traversal bugs, e.g. CVE-2025-4517): every member is checked here and
written by hand.

- Only regular files and folders are written. A hard link to a regular file written earlier from
  the same archive becomes a copy of that file (its content is the archive's, never the host's:
  `git clone` of a local repository hard-links its objects). Symbolic links, other hard links,
  devices, FIFOs and anything else are left out and listed in the result.
- A member's name must be relative and stay relative: no absolute paths, no `..`, no empty
  or over-long components, no NUL bytes.
- Folders are walked one component at a time through directory file descriptors opened
  with `O_NOFOLLOW`, so no link on the host (planted earlier or raced in) is followed; a
  file is created fresh (an existing file or link at its place is unlinked first, so a
  hard link can never be written through).
- Modes keep the owner's read/write/execute bits and the group/other read/execute bits;
  set-uid, set-gid and sticky bits are dropped. Ownership is never taken from the archive.
- The member count, the folder depth and the total size are capped; a compressed stream is
  refused, and so are extended headers `tarfile` would read in quadratic time
  (`_check_extended`). Times are kept within what the host can set. Going past a cap raises
  `WorkdirRejected` (the content's fault, not the host's: a grader scores such an episode 0
  instead of failing it).

`pack_folder` makes the tar `upload` sends, and `remove_tree` removes a host folder; both walk
without recursion (a 2,000-deep chain of folders is just a long loop) under the same caps,
and neither follows a link.

`resolve_path` is the one rule for paths given to `read_file`, `write_file`, `upload` and
`download`: relative paths are relative to the working directory and may not leave it by
`..`; absolute paths name any place inside the sandbox.
"""

from __future__ import annotations

import io
import math
import os
import posixpath
import re
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.errors import SandboxError

__all__ = ["ExtractResult", "WorkdirRejected", "extract_archive", "pack_folder", "remove_tree", "resolve_path"]

MAX_MEMBERS = 200_000
MAX_DEPTH = 256
MAX_NAME_BYTES = 4096
MAX_COMPONENT_BYTES = 255
_KEEP_MODE = 0o755
_CHUNK = 1 << 20
_LATEST_MTIME = 253402300799.0  # 9999-12-31T23:59:59Z: a later time (a touch -d @2**63-1) overflowed utime


class WorkdirRejected(SandboxError):
    """Files that cannot cross the boundary because of what they are (too many, too deep, too large, malformed)."""


_MAX_EXTENDED_BYTES = 64 * 1024
_MAX_EXTENDED_TOTAL = 32 << 20
_MAX_DIGIT_COST = 10_000_000
_DIGITS = re.compile(rb"\d+")


def _pax_records_ok(data: bytes) -> bool:
    """Whether `data` is whole `"<length> <key>=<value>\\n"` records, read in one linear pass."""
    position = 0
    while position < len(data):
        space = data.find(b" ", position, position + 21)
        if space <= position or not data[position:space].isdigit():
            return False
        length = int(data[position:space])
        end = position + length
        if length <= space - position + 2 or end > len(data) or data[end - 1] != 10 \
                or data.find(b"=", space + 1, end) < 0:
            return False
        position = end
    return True


def _check_extended(archive: tarfile.TarFile, member: tarfile.TarInfo, *, pax: bool) -> None:
    """Refuse an extended header (pax, or a GNU long name) before `tarfile` parses it, where `tarfile` reads it: its
    data is peeked at and put back. Python < 3.11.10's tarfile reads a pax header's runs of digits in quadratic time
    (CVE-2024-6232: 12 s for one of 80,000 digits; a red team's archive held the event loop for 20 s, and a header
    hidden behind another member's size passed a scan of the raw headers). Each must be under 64 KiB, all under
    32 MiB, a pax header whole records, and the runs of digits of all of them together cost (the sum of their
    squared lengths) under 10^7, about 0.1 s of tarfile's time. The `tar` of a download writes GNU long names,
    no pax header."""
    seen = getattr(archive, "_agentrl_extended", (0, 0))
    total = seen[0] + member.size
    if member.size > _MAX_EXTENDED_BYTES or total > _MAX_EXTENDED_TOTAL:
        raise WorkdirRejected(f"download: the archive's extended headers are too large ({member.size} bytes, "
                              f"{total} in all; at most {_MAX_EXTENDED_BYTES} each, {_MAX_EXTENDED_TOTAL} in all)")
    start = archive.fileobj.tell()
    data = archive.fileobj.read(member.size)
    archive.fileobj.seek(start)
    cost = seen[1]
    if pax:
        if not _pax_records_ok(data):
            raise WorkdirRejected("download: the sandbox sent a malformed archive (a pax header that is not whole "
                                  "records)")
        cost += sum((match.end() - match.start()) ** 2 for match in _DIGITS.finditer(data))
        if cost > _MAX_DIGIT_COST:
            raise WorkdirRejected("download: the archive's pax headers hold more runs of digits than any name, time "
                                  "or size needs (tarfile would take quadratic time over them)")
    archive._agentrl_extended = (total, cost)


class _CheckedTarInfo(tarfile.TarInfo):
    """tarfile's member, whose extended headers `_check_extended` sees first, as tarfile reaches them."""

    def _proc_pax(self, tarfile):
        _check_extended(tarfile, self, pax=True)
        return super()._proc_pax(tarfile)

    def _proc_gnulong(self, tarfile):
        _check_extended(tarfile, self, pax=False)
        return super()._proc_gnulong(tarfile)


def resolve_path(workdir: str, path: str, *, action: str) -> str:
    """The absolute in-sandbox path for `path` (relative ones must stay inside `workdir`)."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise SandboxError(f"{action}: {path!r} is not a usable path (empty or with a NUL byte)")
    if path.startswith("/"):
        return posixpath.normpath(path).replace("//", "/")
    base = posixpath.normpath(workdir or "/")
    joined = posixpath.normpath(posixpath.join(base, path))
    inside = joined == base or joined.startswith(base.rstrip("/") + "/")
    if not inside:
        raise SandboxError(
            f"{action}: {path!r} leaves the working directory {base} by '..'; give an absolute path instead"
        )
    return joined


@dataclass
class ExtractResult:
    """What `extract_archive` wrote and what it left out."""

    files: int = 0
    folders: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)
    """'name (why)' for each member that was not written (links, devices, unsafe names)."""


def _member_parts(name: str) -> list[str] | None:
    """The path components of a member name, or None when it is unsafe."""
    if "\0" in name or len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES or name.startswith("/"):
        return None
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if len(parts) > MAX_DEPTH:
        raise WorkdirRejected(f"download: {name[:80]}... is more than {MAX_DEPTH} folders deep")
    for part in parts:
        if part == ".." or len(part.encode("utf-8", "surrogateescape")) > MAX_COMPONENT_BYTES:
            return None
    return parts


def _open_dir(parent_fd: int, name: str, *, create: bool) -> int:
    """Open (creating when asked) a real folder `name` under `parent_fd`; never follows a link."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, dir_fd=parent_fd)
    except FileNotFoundError:
        if not create:
            raise
    os.mkdir(name, 0o755, dir_fd=parent_fd)
    return os.open(name, flags, dir_fd=parent_fd)


def _remove_entry(parent_fd: int, name: str) -> None:
    """Unlink a file or link at `name` (folders are kept: a file cannot replace them)."""
    try:
        info = os.lstat(name, dir_fd=parent_fd)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(name)
    os.unlink(name, dir_fd=parent_fd)


def extract_archive(
    archive: bytes, dest: str | Path, *, max_bytes: int, max_members: int = MAX_MEMBERS
) -> ExtractResult:
    """Unpack an (uncompressed) tar made inside a sandbox into `dest`; see the module docstring."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    result = ExtractResult()
    written: dict[tuple[str, ...], tarfile.TarInfo] = {}  # the regular files written, for hard links to them
    root_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:", tarinfo=_CheckedTarInfo) as tar:
            count = 0
            while True:
                try:
                    member = tar.next()
                except tarfile.TarError as error:
                    raise WorkdirRejected(f"download: the sandbox sent a malformed archive ({error})") from None
                if member is None:
                    break
                count += 1
                if count > max_members:
                    raise WorkdirRejected(f"download: the archive has more than {max_members} members")
                _extract_member(tar, member, root_fd, result, max_bytes=max_bytes, written=written)
    except tarfile.ReadError as error:
        raise WorkdirRejected(
            f"download: the sandbox sent something that is not an uncompressed tar ({error})"
        ) from None
    finally:
        os.close(root_fd)
    return result


def _extract_member(tar: tarfile.TarFile, member: tarfile.TarInfo, root_fd: int, result: ExtractResult, *,
                    max_bytes: int, written: dict[tuple[str, ...], tarfile.TarInfo]) -> None:
    parts = _member_parts(member.name)
    if parts is None:
        result.skipped.append(f"{member.name[:200]} (unsafe name)")
        return
    if not parts:  # the archive's root folder itself
        return
    content = member  # the member whose data the file gets: a hard link's target, earlier in this archive
    if member.islnk():
        target = _member_parts(member.linkname)
        content = written.get(tuple(target)) if target else None
        if content is None:
            result.skipped.append(f"{member.name} (hard link to {member.linkname[:200]!r}, not a file written from"
                                  " this archive)")
            return
    elif not (member.isreg() or member.isdir()):
        kind = "symbolic link" if member.issym() else "special file"
        result.skipped.append(f"{member.name} ({kind})")
        return
    folders = parts if member.isdir() else parts[:-1]
    fds: list[int] = []
    try:
        parent = root_fd
        for part in folders:
            try:
                parent = _open_dir(parent, part, create=True)
            except OSError as error:  # a file or link where a folder should be
                result.skipped.append(f"{member.name} ({type(error).__name__} at {part!r})")
                return
            fds.append(parent)
        if member.isdir():
            os.fchmod(parent, (member.mode & _KEEP_MODE) | 0o700)
            result.folders += 1
            return
        if result.bytes + content.size > max_bytes:
            raise WorkdirRejected(f"download: the archive holds more than max_file_bytes={max_bytes} bytes")
        try:
            _remove_entry(parent, parts[-1])
        except IsADirectoryError:
            result.skipped.append(f"{member.name} (a folder is in its place)")
            return
        fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=parent)
        try:
            source = tar.extractfile(content)
            copied = 0
            while chunk := source.read(_CHUNK):
                copied += len(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
            if copied != content.size:
                raise WorkdirRejected(f"download: {member.name} is cut short in the archive")
            os.fchmod(fd, (content.mode & _KEEP_MODE) | 0o600)
            mtime = float(content.mtime)  # from the archive: kept within what every host can set
            mtime = min(max(0.0, mtime), _LATEST_MTIME) if math.isfinite(mtime) else 0.0
            os.utime(fd, (mtime, mtime))
        finally:
            os.close(fd)
        result.files += 1
        result.bytes += content.size
        written[tuple(parts)] = content
    finally:
        for fd in fds:
            os.close(fd)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def pack_folder(local_dir: str | Path, *, max_members: int = MAX_MEMBERS, max_depth: int = MAX_DEPTH) -> bytes:
    """An uncompressed tar of `local_dir`'s contents (regular files and folders; links are not followed or
    packed), walked through folder fds without recursion (paths longer than PATH_MAX work); more than
    `max_members` entries or `max_depth` folders raise WorkdirRejected."""
    buffer = io.BytesIO()
    count = 0
    root_fd = os.open(local_dir, _DIR_FLAGS)
    open_fds = [root_fd]
    try:
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
            stack = [(root_fd, name, name, 1) for name in sorted(os.listdir(root_fd), reverse=True)]
            while stack:
                parent, name, arcname, depth = stack.pop()
                info = os.lstat(name, dir_fd=parent)
                if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
                    continue
                count += 1
                if count > max_members:
                    raise WorkdirRejected(f"upload: {local_dir} holds more than {max_members} files and folders")
                if depth > max_depth:
                    raise WorkdirRejected(f"upload: {arcname[:80]}... is more than {max_depth} folders deep")
                member = tarfile.TarInfo(arcname)
                member.mode, member.mtime = info.st_mode & 0o7777, int(info.st_mtime)
                if stat.S_ISDIR(info.st_mode):
                    member.type = tarfile.DIRTYPE
                    tar.addfile(member)
                    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
                    open_fds.append(fd)
                    stack += [(fd, child, f"{arcname}/{child}", depth + 1)
                              for child in sorted(os.listdir(fd), reverse=True)]
                else:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
                    with os.fdopen(fd, "rb") as handle:
                        member.size = os.fstat(handle.fileno()).st_size
                        tar.addfile(member, handle)
    finally:
        for fd in open_fds:
            os.close(fd)
    return buffer.getvalue()


def remove_tree(path: str | Path) -> None:
    """Remove a host folder and everything in it: without recursion, one folder fd open at a time (any depth,
    paths longer than PATH_MAX); links are removed, never followed."""
    root = Path(path)
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            os.unlink(root)
            return
    except FileNotFoundError:
        return
    fd = os.open(root, _DIR_FLAGS)
    names: list[str] = []  # the folders from the root down to fd's
    try:
        while True:
            child = None
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        child = entry.name
                        break
                    os.unlink(entry.name, dir_fd=fd)
            if child is not None:
                inner = os.open(child, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd, names = inner, [*names, child]
                continue
            if not names:
                break
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            os.rmdir(names.pop(), dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(root)
