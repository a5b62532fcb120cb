"""Per-sandbox cgroups (`agentrl.sandbox.cgroups`) on this host's real cgroup file system: a cgroup
made under this process's own, processes joined to it, its memory and pids limits enforced by the
kernel, `kill_all` ending its members and `remove` leaving nothing; and a host without cgroups
(an empty folder given as the cgroup root) refused in one line naming the limit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from sandbox_backends import bwrap_ok, config

from agentrl.sandbox import SandboxError, cgroups

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="creating cgroups needs root"),
]
MIB = 1024 * 1024


@pytest.fixture
def make_cgroup():
    """Creates cgroups (named for this test); kills their members and removes them afterwards, even on failure."""
    made: list[cgroups.Cgroup] = []
    started: list[subprocess.Popen] = []

    def make(*, memory_bytes: int = 256 * MIB, pids: int = 64, name: str | None = None) -> cgroups.Cgroup:
        group = cgroups.create(name or f"agentrl-test-{uuid.uuid4().hex[:8]}", memory_bytes=memory_bytes, pids=pids)
        made.append(group)
        return group

    make.started = started
    yield make
    for proc in started:  # each leads a process group of its own: its children go too, joined or not
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for group in made:
        group.kill_all()
        group.remove()
    for proc in started:
        proc.wait(timeout=10)


def start_in(group: cgroups.Cgroup, make_cgroup, argv: list[str]) -> subprocess.Popen:
    """Start argv as a member of `group` (joined between fork and exec, as the bwrap backend does)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: group.join(os.getpid()), start_new_session=True)
    make_cgroup.started.append(proc)
    return proc


def limit_values(group: cgroups.Cgroup) -> tuple[int, int]:
    """The (memory bytes, pids) limits as the kernel reports them."""
    if group.version == 2:
        folder = group.dirs[0]
        return int((folder / "memory.max").read_text()), int((folder / "pids.max").read_text())
    memory, pids = group.dirs
    return int((memory / "memory.limit_in_bytes").read_text()), int((pids / "pids.max").read_text())


def own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under '' its v2 path."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def wait_for_members(group: cgroups.Cgroup, count: int) -> None:
    for _ in range(200):
        if len(group.members()) == count:
            return
        time.sleep(0.05)
    assert len(group.members()) == count


def test_created_under_our_own_cgroup_with_its_limits(make_cgroup):
    group = make_cgroup(memory_bytes=64 * MIB, pids=16)
    assert limit_values(group) == (64 * MIB, 16)
    own = own_cgroups()
    if group.version == 1:
        assert group.dirs == tuple(cgroups.CGROUP_ROOT / hierarchy / own[hierarchy].lstrip("/") / group.name
                                   for hierarchy in ("memory", "pids"))
        if (group.dirs[0] / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swap beyond the limit
            assert int((group.dirs[0] / "memory.memsw.limit_in_bytes").read_text()) == 64 * MIB
    else:
        hierarchy = next(h for h in (cgroups.CGROUP_ROOT, cgroups.CGROUP_ROOT / "unified")
                         if (h / "cgroup.controllers").exists() and group.dirs[0].is_relative_to(h))
        mine = hierarchy / own[""].lstrip("/")
        assert group.dirs[0].parent in (mine, mine.parent)  # ours, or (no internal processes on v2) our parent's
        if (group.dirs[0] / "memory.swap.max").exists():
            assert (group.dirs[0] / "memory.swap.max").read_text().strip() == "0"
    assert all(folder.is_dir() for folder in group.dirs)


HOLD = "import sys, time; block = b'x' * (int(sys.argv[1]) << 20); print('held', flush=True); time.sleep(int(sys.argv[2]))"


def test_memory_limit_kills_a_process_that_passes_it(make_cgroup):
    group = make_cgroup(memory_bytes=64 * MIB)
    small = start_in(group, make_cgroup, [sys.executable, "-c", HOLD, "16", "0"])
    assert small.wait(timeout=60) == 0 and small.stdout.read() == "held\n"
    big = start_in(group, make_cgroup, [sys.executable, "-c", HOLD, "200", "0"])
    assert big.wait(timeout=60) == -signal.SIGKILL, big.stderr.read()


def test_memory_limit_is_shared_by_all_members(make_cgroup):
    group = make_cgroup(memory_bytes=64 * MIB)
    holders = [start_in(group, make_cgroup, [sys.executable, "-c", HOLD, "40", "5"]) for _ in range(2)]
    codes = sorted(proc.wait(timeout=60) for proc in holders)
    assert codes[0] == -signal.SIGKILL, codes  # 2 x 40 MiB do not fit in 64 MiB together


FORK_UNTIL_REFUSED = textwrap.dedent("""
    import os, time
    children = []
    for _ in range(100):
        try:
            pid = os.fork()
        except BlockingIOError:
            break
        if pid == 0:
            os.close(1)
            os.close(2)
            time.sleep(60)
            os._exit(0)
        children.append(pid)
    print(len(children), flush=True)
""")


def test_pids_limit_counts_every_member(make_cgroup):
    group = make_cgroup(pids=10)
    sleepers = start_in(group, make_cgroup, ["sh", "-c", "sleep 60 & sleep 60 & wait"])  # 3 pids
    wait_for_members(group, 3)
    forker = start_in(group, make_cgroup, [sys.executable, "-c", FORK_UNTIL_REFUSED])
    out, err = forker.communicate(timeout=60)
    assert out.strip() == "6", (out, err)  # 10 - 3 sleepers - the forker itself
    assert sleepers.poll() is None


def test_kill_all_ends_every_member_and_remove_leaves_nothing(make_cgroup):
    name = f"agentrl-test-{uuid.uuid4().hex[:8]}"
    group = make_cgroup(name=name)
    shells = [start_in(group, make_cgroup, ["sh", "-c", "sleep 1000 & sleep 1000 & wait"]) for _ in range(3)]
    wait_for_members(group, 9)  # 3 shells and their 6 sleeps
    [found] = cgroups.find(name)
    assert found.dirs == group.dirs
    group.kill_all(timeout_s=10)
    assert group.members() == set()
    assert [shell.wait(timeout=10) for shell in shells] == [-signal.SIGKILL] * 3
    group.remove()
    assert not any(folder.exists() for folder in group.dirs)
    assert cgroups.find(name) == []


WATCHER = "import os, sys; print('ready', flush=True); os.read(0, 1); os._exit(0)"


@pytest.mark.parametrize("round_", range(5))
def test_kill_all_leaves_no_member_time_to_see_a_sibling_die(make_cgroup, round_):
    """A member that exits 0 the moment a sibling dies (its stdin is a pipe only the sibling holds), started after
    60 other members so that a one-by-one kill reaches it late: the cgroup is frozen before any SIGKILL, so it
    never runs again and dies of SIGKILL like every other member. (On main, with one-by-one kills, it exited 0
    in about one round of three; five rounds.)"""
    group = make_cgroup(pids=128)
    read_end, write_end = os.pipe()
    holder = subprocess.Popen(["sleep", "1000"], stdout=write_end, preexec_fn=lambda: group.join(os.getpid()),
                              start_new_session=True)
    make_cgroup.started.append(holder)
    os.close(write_end)
    sleepers = [start_in(group, make_cgroup, ["sleep", "1000"]) for _ in range(60)]
    watcher = subprocess.Popen([sys.executable, "-c", WATCHER], stdin=read_end, stdout=subprocess.PIPE, text=True,
                               preexec_fn=lambda: group.join(os.getpid()), start_new_session=True)
    make_cgroup.started.append(watcher)
    os.close(read_end)
    assert watcher.stdout.readline() == "ready\n"  # blocked in its read
    wait_for_members(group, 62)
    group.kill_all(timeout_s=10)
    assert watcher.wait(timeout=10) == -signal.SIGKILL
    assert {proc.wait(timeout=10) for proc in [holder, *sleepers]} == {-signal.SIGKILL}


def test_cpus_caps_the_cgroup_cpu_time(make_cgroup):
    group = cgroups.create(f"agentrl-test-{uuid.uuid4().hex[:8]}", memory_bytes=256 * MIB, pids=64, cpus=0.25)
    try:
        assert group.cpu_limited, group.cpu_unavailable
        if group.version == 2:
            assert (group.dirs[0] / "cpu.max").read_text().split() == ["25000", "100000"]
        else:
            [cpu] = [folder for folder in group.extra_dirs if (folder / "cpu.cfs_quota_us").exists()]
            assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "25000"
    finally:
        group.kill_all()
        group.remove()
    assert not any(folder.exists() for folder in group.dirs + group.extra_dirs)


def test_a_host_without_cgroups_is_named_in_one_line(tmp_path):
    with pytest.raises(cgroups.CgroupUnavailable) as caught:
        cgroups.create("agentrl-test-none", memory_bytes=64 * MIB, pids=16, root=tmp_path)
    assert str(tmp_path) in str(caught.value) and "\n" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not bwrap_ok(), reason="bubblewrap or base rootfs missing")
async def test_bwrap_refuses_without_a_cgroup_when_told_to(tmp_path):
    from agentrl.sandbox.bwrap_backend import BwrapSandbox
    from agentrl.sandbox.bwrap_workspace import list_workspaces

    cfg = config({"type": "bwrap"}, unenforceable_limits="refuse")
    sandbox = BwrapSandbox(cfg, cgroup_root=tmp_path)
    try:
        with pytest.raises(SandboxError) as caught:
            await sandbox.start()
    finally:
        await sandbox.close()
    message = str(caught.value)
    assert message.startswith("sandbox limit memory_mb and pids_limit cannot be enforced on this host"), message
    assert "\n" not in message
    assert not [w for w in list_workspaces() if w.labels.get("agentrl.owner") == cfg.owner]  # nothing left behind
