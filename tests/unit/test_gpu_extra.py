"""The extra GPU wheels (scripts/gpu-extra-wheels.txt): groups carried in parts are joined and installed, a missing
part is one line, and an unknown group is refused before any download."""

from __future__ import annotations

import os
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "scripts" / "gpu_extra_install.sh"


def _wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel pip installs offline."""
    path = folder / "agentrl_probe-1.0-py3-none-any.whl"
    files = {"agentrl_probe/__init__.py": "VALUE = 7\n",
             "agentrl_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: agentrl-probe\nVersion: 1.0\n",
             "agentrl_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n"}
    files["agentrl_probe-1.0.dist-info/RECORD"] = "".join(f"{name},,\n" for name in files) + \
        "agentrl_probe-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


def _install(repo: Path, site: Path, acc: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_EXTRA_SITE": str(site), "GPU_EXTRA_ACC": str(acc)}
    return subprocess.run(["bash", "-c", f"source {INSTALL} && gpu_extra_install"], cwd=repo, capture_output=True,
                          text=True, timeout=120, env=env)


def test_parts_carried_to_two_places_are_joined_and_installed_once(tmp_path):
    wheel = _wheel(tmp_path)
    subprocess.run(["tar", "cf", str(tmp_path / "wheels.tar"), "-C", str(tmp_path), wheel.name], check=True)
    data = (tmp_path / "wheels.tar").read_bytes()
    repo, acc = tmp_path / "repo", tmp_path / "acc"
    (repo / ".gpu-extra-probe").mkdir(parents=True)
    (acc / "acc-probe").mkdir(parents=True)
    (acc / "acc-probe" / "p00").write_bytes(data[:3000])  # carried by an earlier call
    (repo / ".gpu-extra-probe" / "p01").write_bytes(data[3000:])  # the last part, in the checkout
    missing = _install(repo, tmp_path / "site-missing", tmp_path / "nothing-carried")  # p00 is not there
    assert missing.returncode == 1 and missing.stderr == (
        "gpu_extra: the parts of 'probe' (none) are not a whole archive: carry every part first\n"), missing.stderr
    done = _install(repo, tmp_path / "site", acc)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "agentrl_probe" / "__init__.py").read_text() == "VALUE = 7\n"
    assert (tmp_path / "site" / ".gpu-extra-probe-ok").is_file()
    (acc / "acc-probe" / "p00").unlink()  # installed once per machine: the parts are not read again
    assert _install(repo, tmp_path / "site", acc).returncode == 0


@pytest.mark.parametrize("group", ["fp8", "scan"])
def test_the_fp8_and_scan_groups_go_beside_the_site_not_into_it(tmp_path, group):
    """vLLM imports torchao at start whenever it can, and compiles with the image's Triton: the fp8 and scan groups
    are installed where only FP8 training and the trainer's fla scan look."""
    wheel = _wheel(tmp_path)
    repo = tmp_path / "repo"
    (repo / f".gpu-extra-{group}").mkdir(parents=True)
    subprocess.run(["tar", "cf", str(repo / f".gpu-extra-{group}" / "p00"), "-C", str(tmp_path), wheel.name],
                   check=True)
    done = _install(repo, tmp_path / "site", tmp_path / "acc")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / f"site-{group}" / "agentrl_probe" / "__init__.py").is_file()
    assert not (tmp_path / "site" / "agentrl_probe").exists()
    assert (tmp_path / "site" / f".gpu-extra-{group}-ok").is_file()


def test_a_debian_package_is_unpacked_and_its_programs_put_on_the_path(tmp_path):
    package = tmp_path / "pkg"
    (package / "DEBIAN").mkdir(parents=True)
    (package / "DEBIAN" / "control").write_text("Package: agentrl-probe\nVersion: 1.0\nArchitecture: all\n"
                                                "Maintainer: tests\nDescription: probe\n")
    program = package / "usr" / "bin" / "agentrl-probe"
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\necho probe 1.0\n")
    program.chmod(0o755)
    repo = tmp_path / "repo"
    (repo / ".gpu-extra").mkdir(parents=True)
    subprocess.run(["dpkg-deb", "--build", str(package), str(repo / ".gpu-extra" / "agentrl-probe_1.0_all.deb")],
                   check=True, capture_output=True, timeout=60)
    site = tmp_path / "site"
    done = _install(repo, site, tmp_path / "acc")
    assert done.returncode == 0, done.stderr
    said = subprocess.run(["agentrl-probe"], capture_output=True, text=True, timeout=30, check=True,
                          env={**os.environ, "PATH": f"{site / 'bin'}:{os.environ['PATH']}"})
    assert said.stdout == "probe 1.0\n"
    assert (site / ".gpu-extra-debs-ok").is_file()
    (repo / ".gpu-extra" / "broken_1.0_all.deb").write_bytes(b"not an archive")
    broken = _install(repo, tmp_path / "site-broken", tmp_path / "acc")
    assert broken.returncode == 1 and "gpu_extra: cannot unpack .gpu-extra/broken_1.0_all.deb" in broken.stderr


def test_the_wheel_list_and_an_unknown_group():
    lines = [line.split("#")[0].split() for line in (ROOT / "scripts" / "gpu-extra-wheels.txt").read_text().splitlines()]
    entries = [line for line in lines if line]
    assert entries and all(len(line) == 2 and ("==" in line[1] or line[1].startswith("deb:")) for line in entries), entries
    assert ["base", "deb:bubblewrap"] in entries  # the H200s have no Docker: key-hunt's sandboxes run under bwrap
    assert {"base", "kv", "fp8", "scan"} <= {group for group, _ in entries}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_extra.sh"), "bogus"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and result.stderr.strip() == (
        "gpu_extra: no group 'bogus' in scripts/gpu-extra-wheels.txt; groups: base fp8 kv scan")


def test_machine_facts_say_what_the_sandboxes_can_use():
    said = subprocess.run(["bash", str(ROOT / "scripts" / "machine_facts.sh")], capture_output=True, text=True,
                          timeout=60, check=True).stdout
    facts = dict(line.split(": ", 1) for line in said.splitlines())
    assert {"os", "kernel", "user", "bwrap", "docker", "cgroup", "cpus", "memory"} <= set(facts), said
    assert facts["cpus"].isdigit() and int(facts["cpus"]) >= 1
    assert facts["user namespaces"] in ("yes", "no")
