"""The seccomp profile of Docker sandboxes: Docker's defaults' refusals, plus ptrace and cross-process memory.

Docker's default profile lets a process `ptrace` another of the same user, and read or write
its memory with `process_vm_readv` / `process_vm_writev`. Inside a sandbox that means a
process left by one command can attach to the next command's shell (even a grader's trusted
command) and make it print anything and exit 0. The sandbox user never needs either, so runc
sandboxes run under this profile instead (gVisor refuses such attaches by itself; runsc sandboxes take it too, less
the clone3 rule, in place of Docker's default, under which no thread started there).

It allows every system call by default and refuses (EPERM) those listed: the three above, and
the calls Docker's default profile refuses to a container without capabilities (kernel
modules, mounts, new namespaces through clone/unshare/setns, keyrings, bpf, perf, io_uring,
userfaultfd, clock and reboot calls, ...). `clone3` answers ENOSYS, so the C library falls
back to `clone`, whose namespace flags are checked. The rules hold for the 64-bit, 32-bit
and x32 ABIs of x86 (or arm64's two), so no other syscall table gets around them.
"""

from __future__ import annotations

import functools
import json
import platform

__all__ = ["DENIED_SYSCALLS", "profile_json"]

EPERM, ENOSYS = 1, 38
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "create_module", "delete_module", "fanotify_init",
    "finit_module", "fsconfig", "fsmount", "fsopen", "fspick", "get_kernel_syms", "init_module", "io_uring_enter",
    "io_uring_register", "io_uring_setup", "ioperm", "iopl", "kexec_file_load", "kexec_load", "keyctl",
    "lookup_dcookie", "mount", "mount_setattr", "move_mount", "name_to_handle_at", "nfsservctl", "open_by_handle_at",
    "open_tree", "perf_event_open", "pivot_root", "query_module", "quotactl", "quotactl_fd", "reboot",
    "request_key", "setns", "settimeofday", "stime", "swapoff", "swapon", "syslog", "sysfs", "_sysctl", "umount",
    "umount2", "unshare", "uselib", "userfaultfd", "ustat", "vm86", "vm86old",
)
# clone flags that make namespaces: CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
_ARCHITECTURES = {
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
}


@functools.cache
def profile_json(*, gvisor: bool = False) -> str:
    """The profile, as the JSON Docker takes in `security_opt=["seccomp=<json>"]`. For gVisor (`gvisor`) without the
    clone3 rule: Debian's runsc (2022-12) answers every refusal with EPERM whatever its errnoRet, so the C library
    took clone3's refusal as final and no thread could start (Docker's default profile has the same rule); gVisor
    answers clone3 with ENOSYS itself."""
    rules = [{"names": list(DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM}]
    if not gvisor:
        rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS})
    rules += [{"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
               "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}]}
              for flag in _NAMESPACE_FLAGS]
    profile = {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": rules,
               "architectures": _ARCHITECTURES.get(platform.machine(), [])}
    return json.dumps(profile, separators=(",", ":"))
