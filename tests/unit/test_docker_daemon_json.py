"""scripts/docker_daemon_json.py and start-dockerd.sh: runsc merged into a daemon.json keeps every other
setting; a running engine is used as it is (temporary files, stub docker/dockerd)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "docker_daemon_json.py"
_spec = importlib.util.spec_from_file_location("docker_daemon_json", SCRIPT)
daemon_json = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(daemon_json)

OTHER_SETTINGS = {
    "data-root": "/srv/docker",
    "log-driver": "json-file",
    "log-opts": {"max-size": "10m", "max-file": "3"},
    "registry-mirrors": ["http://127.0.0.1:5000"],
    "default-runtime": "runc",
    "runtimes": {"crun": {"path": "/usr/bin/crun"}},
    "features": {"buildkit": True},
}


def test_an_existing_daemon_json_keeps_its_other_settings(tmp_path):
    path = tmp_path / "daemon.json"
    path.write_text(json.dumps(OTHER_SETTINGS, indent=4))
    os.chmod(path, 0o600)
    assert daemon_json.merge_runsc(path, runsc="/usr/bin/runsc") is True
    merged = json.loads(path.read_text())
    assert merged["runtimes"].pop("runsc") == {"path": "/usr/bin/runsc",
                                               "runtimeArgs": ["--network=none", "--oci-seccomp"]}
    assert merged == OTHER_SETTINGS  # every other key, the other runtime included, exactly as it was
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["daemon.json"]  # no temporary file left behind


def test_a_second_merge_changes_nothing(tmp_path):
    path = tmp_path / "daemon.json"
    path.write_text(json.dumps(OTHER_SETTINGS))
    assert daemon_json.merge_runsc(path) is True
    text, mtime = path.read_text(), path.stat().st_mtime_ns
    assert daemon_json.merge_runsc(path) is False
    assert path.read_text() == text and path.stat().st_mtime_ns == mtime


def test_an_existing_runsc_entry_is_completed_not_replaced(tmp_path):
    path = tmp_path / "daemon.json"
    entry = {"path": "/opt/gvisor/runsc", "runtimeArgs": ["--platform=systrap", "--network=none"]}
    path.write_text(json.dumps({"runtimes": {"runsc": entry}}))
    assert daemon_json.merge_runsc(path) is True
    assert json.loads(path.read_text())["runtimes"]["runsc"] == {
        "path": "/opt/gvisor/runsc", "runtimeArgs": ["--platform=systrap", "--network=none", "--oci-seccomp"]}


def test_no_file_or_an_empty_one_gets_just_the_runtime(tmp_path):
    for path in (tmp_path / "new" / "daemon.json", tmp_path / "empty.json"):
        if path.name == "empty.json":
            path.write_text("\n")
        assert daemon_json.merge_runsc(path, runsc="/usr/local/bin/runsc") is True
        entry = {"path": "/usr/local/bin/runsc", "runtimeArgs": ["--network=none", "--oci-seccomp"]}
        assert json.loads(path.read_text()) == {"runtimes": {"runsc": entry}}


@pytest.mark.parametrize("text", ['{"log-driver": "json-file",', "[1, 2]", '{"runtimes": []}',
                                  '{"runtimes": {"runsc": {"runtimeArgs": "--network=none"}}}'])
def test_a_file_it_cannot_amend_is_left_alone(tmp_path, text):
    path = tmp_path / "daemon.json"
    path.write_text(text)
    with pytest.raises(daemon_json.DaemonJsonError, match="left as it is|fix it by hand"):
        daemon_json.merge_runsc(path)
    assert path.read_text() == text


def test_the_command_line(tmp_path):
    path = tmp_path / "daemon.json"
    path.write_text(json.dumps({"debug": True}))
    run = [sys.executable, str(SCRIPT), str(path), "--runsc", "/usr/bin/runsc"]
    first = subprocess.run(run, capture_output=True, text=True, timeout=30)
    second = subprocess.run(run, capture_output=True, text=True, timeout=30)
    assert first.returncode == 0 and "runsc registered" in first.stdout
    assert second.returncode == 0 and "already registered" in second.stdout
    assert json.loads(path.read_text())["debug"] is True
    path.write_text("not json")
    broken = subprocess.run(run, capture_output=True, text=True, timeout=30)
    assert broken.returncode == 1 and "not valid JSON" in broken.stderr and path.read_text() == "not json"


START = SCRIPT.with_name("start-dockerd.sh")


def _stubs(tmp_path: Path, runtimes: str) -> dict:
    """`docker`, `dockerd` and `runsc` stand-ins on PATH: docker info answers once the stub dockerd ran
    (or at once when `up` exists), listing `runtimes`; dockerd records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(
        "#!/bin/sh\n"
        f'[ -e "{tmp_path}/up" ] || exit 1\n'
        f'case "$*" in *Runtimes*) echo \'{runtimes}\' ;; esac\n'
    )
    (bin_dir / "dockerd").write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/dockerd.args"\n'
                                     f'touch "{tmp_path}/up"\n')
    (bin_dir / "runsc").write_text("#!/bin/sh\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "AGENTRL_DAEMON_JSON": str(tmp_path / "daemon.json"),
            "AGENTRL_DOCKERD_LOG": str(tmp_path / "dockerd.log")}


def test_a_running_engine_without_runsc_is_used_as_it_is(tmp_path):
    env = _stubs(tmp_path, '{"runc":{"path":"runc"}}')
    (tmp_path / "up").touch()
    (tmp_path / "daemon.json").write_text('{"debug": true}')
    done = subprocess.run(["bash", str(START)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "without runsc" in done.stdout and "docker_daemon_json.py" in done.stdout  # the one-line note
    assert len(done.stdout.strip().splitlines()) == 1
    assert (tmp_path / "daemon.json").read_text() == '{"debug": true}'  # not touched
    assert not (tmp_path / "dockerd.args").exists()  # nothing started


def test_its_own_engine_gets_runsc_merged_into_the_existing_settings(tmp_path):
    env = _stubs(tmp_path, '{"runc":{"path":"runc"},"runsc":{"path":"/usr/bin/runsc"}}')
    (tmp_path / "daemon.json").write_text(json.dumps(OTHER_SETTINGS))
    done = subprocess.run(["bash", str(START)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "dockerd is up" in done.stdout
    merged = json.loads((tmp_path / "daemon.json").read_text())
    assert merged["runtimes"].pop("runsc")["runtimeArgs"] == ["--network=none", "--oci-seccomp"]
    assert merged == OTHER_SETTINGS
    args = (tmp_path / "dockerd.args").read_text().split()
    assert args[:3] == ["--bridge=none", "--iptables=false", "--ip6tables=false"]
    assert args[3:] == ["--config-file", str(tmp_path / "daemon.json")]
