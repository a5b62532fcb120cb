"""A process left by one command may not trace or read the memory of the next command's processes.

The attack of issue 43: a background process of the agent attached with ptrace to a later
command's shell (a grader's trusted command) and made it exit 0 with forged output. Here a
process the first command leaves running is attacked from a second command with `ptrace`
(PTRACE_ATTACH) and `process_vm_readv`; both must fail. runc sandboxes run under agentrl's
seccomp profile (sdk/sandbox/seccomp.py), which refuses them; gVisor refuses by itself; a
bwrap command's processes end with it (its pid namespace), so there is nothing to attach to.
"""

from __future__ import annotations

import textwrap

import pytest
from sandbox_backends import BACKENDS, config

from agentrl.sandbox import create_sandbox

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ATTACK = textwrap.dedent("""
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    pid = int(sys.argv[1])
    if not os.path.exists(f"/proc/{pid}"):
        print("ptrace: no such process", "vm_readv: no such process")
        raise SystemExit
    attached = libc.ptrace(16, pid, None, None)  # PTRACE_ATTACH
    print("ptrace:", "attached" if attached == 0 else os.strerror(ctypes.get_errno()), end=" ")
    class iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
    buffer = ctypes.create_string_buffer(64)
    maps = open(f"/proc/{pid}/maps").readline() if os.access(f"/proc/{pid}/maps", os.R_OK) else "0-0"
    local, remote = iovec(ctypes.addressof(buffer), 64), iovec(int(maps.split("-")[0], 16), 64)
    read = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    print("vm_readv:", "read" if read > 0 else os.strerror(ctypes.get_errno()))
""")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_left_process_cannot_be_traced_or_read_by_a_later_command(backend):
    async with create_sandbox(config(backend)) as sandbox:
        left = await sandbox.exec("nohup sleep 300 >/dev/null 2>&1 & echo $!", timeout=30)
        victim = left.stdout.strip()
        assert victim.isdigit(), left
        result = await sandbox.exec(["python3", "-c", ATTACK, victim], timeout=30)
        assert result.exit_code == 0, result.stderr
        assert "attached" not in result.stdout and "read" not in result.stdout.split("vm_readv:")[1], result.stdout


@pytest.mark.parametrize("backend", BACKENDS[:1])
async def test_a_command_cannot_trace_or_read_its_own_child_under_runc(backend):
    """Within one command too, under runc's profile (gVisor and bwrap let a process trace its own child; the
    attack above needs a process another command left, which they refuse or end)."""
    own_child = "import subprocess, sys; child = subprocess.Popen(['sleep', '30']); sys.argv = ['x', str(child.pid)]\n"
    async with create_sandbox(config(backend)) as sandbox:
        result = await sandbox.exec(["python3", "-c", own_child + ATTACK], timeout=30)
        assert result.exit_code == 0, result.stderr
        assert "attached" not in result.stdout and "read" not in result.stdout.split("vm_readv:")[1], result.stdout
