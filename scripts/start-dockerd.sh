#!/usr/bin/env bash
# The Docker engine for agentrl's sandboxes.
# - An engine that is already running is used as it is: nothing is changed or restarted. runsc (gVisor)
#   is used only where that engine has it registered (sandboxes default to runc); a note says how to add it.
# - Otherwise start dockerd as root: no bridge, no iptables (sandboxes run with --network none), and
#   gVisor ('runsc') merged into /etc/docker/daemon.json (scripts/docker_daemon_json.py keeps every other
#   setting there) as a runtime that keeps its network off and applies Docker's seccomp profile.
# Environment: AGENTRL_DAEMON_JSON (default /etc/docker/daemon.json), AGENTRL_DOCKERD_LOG.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
daemon_json=${AGENTRL_DAEMON_JSON:-/etc/docker/daemon.json}
log=${AGENTRL_DOCKERD_LOG:-/var/log/agentrl-dockerd.log}
if docker info >/dev/null 2>&1; then
  if docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc"'; then
    echo "[install] dockerd is running (runsc registered): used as it is"
  else
    echo "[install] dockerd is running without runsc: sandboxes use runc; to add gVisor: python3 scripts/docker_daemon_json.py $daemon_json, then restart dockerd"
  fi
  exit 0
fi
if command -v runsc >/dev/null 2>&1; then
  python3 "$here/docker_daemon_json.py" "$daemon_json" --runsc "$(command -v runsc)"
fi
dockerd_args=(--bridge=none --iptables=false --ip6tables=false)
[ "$daemon_json" = /etc/docker/daemon.json ] || dockerd_args+=(--config-file "$daemon_json")
nohup dockerd "${dockerd_args[@]}" >"$log" 2>&1 &
for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then echo "[install] dockerd is up"; exit 0; fi
  sleep 1
done
echo "[install] dockerd did not start; see $log" >&2
tail -20 "$log" >&2
exit 1
