#!/usr/bin/env bash
# Start dockerd as root when it is not running: no bridge, no iptables (sandboxes run with
# --network none), gVisor ('runsc') registered as a runtime that keeps its network off.
set -euo pipefail
if docker info >/dev/null 2>&1; then exit 0; fi
mkdir -p /etc/docker
if [ ! -f /etc/docker/daemon.json ] || ! grep -q runsc /etc/docker/daemon.json; then
  cat > /etc/docker/daemon.json <<'JSON'
{
  "runtimes": {
    "runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none"]}
  }
}
JSON
fi
nohup dockerd --bridge=none --iptables=false --ip6tables=false >/var/log/agentrl-dockerd.log 2>&1 &
for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then echo "[install] dockerd is up"; exit 0; fi
  sleep 1
done
echo "[install] dockerd did not start; see /var/log/agentrl-dockerd.log" >&2
tail -20 /var/log/agentrl-dockerd.log >&2
exit 1
