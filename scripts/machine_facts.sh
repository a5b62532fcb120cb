#!/usr/bin/env bash
# What a lent machine offers the sandboxes and the runs, one "key: value" line each (the GPU check's `extra`
# phase keeps it as machine_facts.txt): the OS, the kernel, who we are, whether user and mount namespaces can be
# made (bubblewrap needs them), whether bwrap, docker or runsc are there, the cgroup version, CPUs and memory.
# Nothing here changes the machine.
set -u
echo "os: $( . /etc/os-release 2>/dev/null && echo "${PRETTY_NAME:-unknown}" || echo unknown)"
echo "kernel: $(uname -r)"
echo "user: $(id -u):$(id -g) $(id -un 2>/dev/null || true)"
echo "glibc: $(ldd --version 2>/dev/null | head -n 1 | awk '{print $NF}')"
for tool in bwrap docker runsc unshare setpriv; do
  echo "$tool: $(command -v "$tool" || echo missing)"
done
if command -v unshare >/dev/null; then
  unshare --user --map-root-user true 2>/dev/null && echo "user namespaces: yes" || echo "user namespaces: no"
  unshare --mount --pid --fork true 2>/dev/null && echo "mount+pid namespaces: yes" || echo "mount+pid namespaces: no"
fi
echo "max user namespaces: $(cat /proc/sys/user/max_user_namespaces 2>/dev/null || echo unknown)"
echo "cgroup: $( [ -f /sys/fs/cgroup/cgroup.controllers ] && echo v2 || echo v1-or-none)"
echo "cpus: $(nproc)"
echo "memory: $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
