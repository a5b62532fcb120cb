"""A compatibility shim for the gVisor (`runsc`) release Debian bookworm ships.

That gVisor (2022-12) rejects `statx()` calls with the `AT_NO_AUTOMOUNT` flag (EINVAL),
which coreutils 9 passes: `ls`, `stat`, `du -L`... all fail with "Invalid argument" inside
the sandbox. This module compiles (once, with the host's C compiler, cached by source hash)
a tiny LD_PRELOAD library whose `statx` retries without that flag on EINVAL; Docker
sandboxes under runsc bind-mount it read-only and preload it. Under runc it is not used.
Without a C compiler the shim is skipped (runsc then works except for those tools).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

__all__ = ["SHIM_TARGET", "statx_shim"]

SHIM_TARGET = "/usr/lib/agentrl-statx-compat.so"
SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf) {
    long result = syscall(SYS_statx, dirfd, path, flags, mask, buf);
    if (result == -1 && errno == EINVAL && (flags & AT_NO_AUTOMOUNT)) {
        result = syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
    }
    return (int) result;
}
"""

_lock = threading.Lock()
_built: dict[str, Path | None] = {}


def statx_shim() -> Path | None:
    """Path of the compiled shim on the host, or None when no C compiler is available."""
    from agentrl.sandbox.base_image import cache_root

    digest = hashlib.sha256(SHIM_SOURCE.encode()).hexdigest()[:12]
    with _lock:
        if digest in _built:
            return _built[digest]
        target = cache_root() / "gvisor" / f"statx-compat-{digest}.so"
        if not target.exists():
            compiler = shutil.which("cc") or shutil.which("gcc")
            if compiler is None:
                _built[digest] = None
                return None
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as work:
                source = Path(work) / "shim.c"
                source.write_text(SHIM_SOURCE)
                output = Path(work) / "shim.so"
                built = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(output), str(source)],
                                       capture_output=True, text=True)
                if built.returncode != 0:
                    _built[digest] = None
                    return None
                output.chmod(0o755)
                os.replace(output, target)
        _built[digest] = target
        return target
