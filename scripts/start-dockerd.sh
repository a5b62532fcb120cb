#!/usr/bin/env bash
# Start dockerd as root when it is not running: no bridge, no iptables (sandboxes run with
# --network none), gVisor ('runsc') registered as a runtime that keeps its network off and
# applies Docker's seccomp profile.
set -euo pipefail
if docker info >/dev/null 2>&1; then exit 0; fi
mkdir -p /etc/docker
# Register runsc (or amend our entry) without touching the rest of an existing daemon.json:
# --network=none (it refuses to start in the root network namespace otherwise) and
# --oci-seccomp (gVisor applies Docker's seccomp profile only with it: no nested user namespaces).
python3 - <<'PY'
import json
import pathlib

path = pathlib.Path("/etc/docker/daemon.json")
text = path.read_text() if path.exists() else ""
config = json.loads(text) if text.strip() else {}
runsc = config.setdefault("runtimes", {}).setdefault("runsc", {"path": "/usr/bin/runsc"})
args = runsc.setdefault("runtimeArgs", [])
missing = [arg for arg in ("--network=none", "--oci-seccomp") if arg not in args]
if missing:
    args.extend(missing)
    path.write_text(json.dumps(config, indent=2) + "\n")
PY
nohup dockerd --bridge=none --iptables=false --ip6tables=false >/var/log/agentrl-dockerd.log 2>&1 &
for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then echo "[install] dockerd is up"; exit 0; fi
  sleep 1
done
echo "[install] dockerd did not start; see /var/log/agentrl-dockerd.log" >&2
tail -20 /var/log/agentrl-dockerd.log >&2
exit 1
