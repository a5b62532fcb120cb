"""Per-sandbox cgroups: one memory limit (no swap beyond it) and one process limit for every
process of a sandbox, whichever command started it.

`create(name, memory_bytes=..., pids=...)` makes the cgroup under this process's own cgroup
(read from /proc/self/cgroup, so the limits nest inside whatever contains us), on cgroup v2
(a unified hierarchy with the memory and pids controllers, at /sys/fs/cgroup or, on hybrid
hosts, /sys/fs/cgroup/unified) or else on cgroup v1 (the memory and pids hierarchies). On
v2 a cgroup holding processes cannot pass controllers to children, so there the sandbox's
cgroup may sit beside ours, in our parent, when the parent already passes both on. It
raises `CgroupUnavailable` with the reason when neither is there or writable.

`create(..., cpus=N)` also caps CPU time at N cores (cpu.max on v2, cpu.cfs_quota_us in the
v1 cpu hierarchy) where the cpu controller is there; `Cgroup.cpu_limited` says whether it
was, and `cpu_unavailable` why not.

`Cgroup.join(pid)` only opens and writes files, so a `preexec_fn` may call it between fork
and exec; `kill_all()` ends every member at once: the cgroup is frozen first (cgroup.freeze
on v2, the v1 freezer hierarchy), so no member runs another instruction between the first
SIGKILL and the last (a parent cannot see its child die and exit 0 first); then cgroup.kill
on v2, else SIGKILL through pidfds, thawed, repeated until none remain (bounded). Without a
freezer it falls back to signalling until none remain. `remove()` deletes the cgroup.
`find(prefix)` lists existing cgroups by name, for removing those of dead processes.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

from agentrl.errors import SandboxError

__all__ = ["CGROUP_ROOT", "Cgroup", "CgroupUnavailable", "create", "find"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
V1_HIERARCHIES = ("memory", "pids")
V1_OPTIONAL = ("cpu", "freezer")  # joined where they are mounted: CPU limits and freezing before a kill
CONTROLLERS = {"memory", "pids"}
CPU_PERIOD_US = 100_000
FREEZE_TIMEOUT_S = 2.0


class CgroupUnavailable(SandboxError):
    """No writable cgroup with the memory and pids controllers exists for this process."""


class Cgroup:
    """One cgroup: a single folder on cgroup v2, or a memory and a pids folder on cgroup v1 (plus, where those
    hierarchies are mounted, a cpu and a freezer folder: `extra_dirs`)."""

    def __init__(self, *, version: int, dirs: tuple[Path, ...], extra_dirs: tuple[Path, ...] = ()) -> None:
        self.version = version
        self.dirs = dirs
        self.extra_dirs = extra_dirs
        self.name = dirs[0].name
        self.cpu_limited = False
        self.cpu_unavailable = ""
        """Why `cpus` could not be limited (empty when it was, or was not asked for)."""
        self._procs_files = tuple(str(folder / "cgroup.procs") for folder in dirs + extra_dirs)

    def __repr__(self) -> str:
        return f"Cgroup(version={self.version}, dirs={[str(folder) for folder in self.dirs + self.extra_dirs]})"

    def join(self, pid: int) -> None:
        """Move process `pid` into the cgroup (safe in a preexec_fn: no imports, no locks)."""
        data = str(pid).encode()
        for path in self._procs_files:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    def members(self) -> set[int]:
        """The pids in the cgroup now (an empty set once it is removed)."""
        found: set[int] = set()
        for path in self._procs_files:
            try:
                with open(path) as handle:
                    found.update(int(line) for line in handle.read().split())
            except FileNotFoundError:
                pass
        return found

    def _freezer(self) -> tuple[Path, str, str] | None:
        """(file, frozen value, thawed value) of this cgroup's freezer, None without one."""
        if self.version == 2:
            return (self.dirs[0] / "cgroup.freeze", "1", "0") if (self.dirs[0] / "cgroup.freeze").exists() else None
        for folder in self.extra_dirs:
            if (folder / "freezer.state").exists():
                return folder / "freezer.state", "FROZEN", "THAWED"
        return None

    def _frozen(self) -> bool:
        if self.version == 2:
            return "frozen 1" in (self.dirs[0] / "cgroup.events").read_text()
        freezer = self._freezer()
        return freezer is not None and freezer[0].read_text().strip() == "FROZEN"

    def kill_all(self, *, timeout_s: float = 10.0) -> None:
        """SIGKILL every member at once (frozen first), again until none is left; SandboxError if some survive
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        freezer = self._freezer()
        while pids := self.members():
            if time.monotonic() > deadline:
                raise SandboxError(f"cgroup {self.dirs[0]}: {len(pids)} processes still alive {timeout_s:g} s "
                                   f"after SIGKILL (pids {sorted(pids)[:10]})")
            try:
                if freezer is not None:
                    freezer[0].write_text(freezer[1])
                    frozen_by = time.monotonic() + FREEZE_TIMEOUT_S
                    while not self._frozen() and time.monotonic() < frozen_by:
                        time.sleep(0.001)
                kill_file = self.dirs[0] / "cgroup.kill"
                if self.version == 2 and kill_file.exists():
                    kill_file.write_text("1")
                else:
                    self._signal_members(self.members())
            except FileNotFoundError:  # removed meanwhile
                return
            finally:
                if freezer is not None:
                    try:
                        freezer[0].write_text(freezer[2])
                    except FileNotFoundError:
                        pass
            time.sleep(0.005)

    def _signal_members(self, pids: set[int]) -> None:
        # A pid read from cgroup.procs may exit and be reused by a host process before the kill:
        # open a pidfd for each, check the pid is still a member, and signal through the pidfd.
        handles: dict[int, int] = {}
        try:
            for pid in pids:
                try:
                    handles[pid] = os.pidfd_open(pid)
                except ProcessLookupError:
                    pass
            still_members = self.members()
            for pid, fd in handles.items():
                if pid in still_members:
                    try:
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        finally:
            for fd in handles.values():
                os.close(fd)

    def remove(self, *, timeout_s: float = 10.0) -> None:
        """Kill what is left and delete the cgroup's folders; SandboxError if one stays busy."""
        deadline = time.monotonic() + timeout_s
        for folder in self.dirs + self.extra_dirs:
            while True:
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as error:
                    if error.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise SandboxError(f"cannot remove cgroup {folder}: {error.strerror}") from None
                    self.kill_all(timeout_s=max(deadline - time.monotonic(), 0.1))
                    time.sleep(0.01)


def _own_paths(proc_cgroup: Path) -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under '' its cgroup v2 path."""
    paths: dict[str, str] = {}
    for line in proc_cgroup.read_text().splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _v2_hierarchy(root: Path) -> Path | None:
    """The cgroup v2 mount under `root` that has the memory and pids controllers, if any."""
    for candidate in (root, root / "unified"):
        try:
            controllers = set((candidate / "cgroup.controllers").read_text().split())
        except OSError:
            continue
        if CONTROLLERS <= controllers:
            return candidate
    return None


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as error:
        raise CgroupUnavailable(f"cannot write {value!r} to {path}: {error.strerror}") from None


def _make_child(parent: Path, name: str) -> Path:
    child = parent / name
    try:
        child.mkdir()
    except OSError as error:
        raise CgroupUnavailable(f"cannot create cgroup {child}: {error.strerror}") from None
    return child


def _v2_parent(hierarchy: Path, own: str) -> Path:
    """A cgroup whose children get the memory and pids controllers: ours, else our parent.

    Ours gets them enabled when it can pass them on; but on cgroup v2 a cgroup that holds
    processes cannot (the "no internal processes" rule), so the sandbox's cgroup may become
    our sibling instead, still inside whatever contains us, when our parent already passes
    both controllers to its children (a parent's settings are never changed here).
    """
    own_dir = hierarchy / own.lstrip("/")
    enabled = " ".join(f"+{name}" for name in sorted(CONTROLLERS))
    reasons = []
    try:
        available = set((own_dir / "cgroup.controllers").read_text().split())
        if not CONTROLLERS <= available:
            reasons.append(f"{own_dir} has only {' '.join(sorted(available)) or 'no controllers'}")
        elif CONTROLLERS <= set((own_dir / "cgroup.subtree_control").read_text().split()):
            return own_dir
        else:
            (own_dir / "cgroup.subtree_control").write_text(enabled)
            return own_dir
    except OSError as error:
        reasons.append(f"enabling {enabled!r} in {own_dir}: {error.strerror}")
    parent = own_dir.parent
    if own_dir != hierarchy and parent.is_relative_to(hierarchy):
        try:
            passed = set((parent / "cgroup.subtree_control").read_text().split())
        except OSError as error:
            passed = set()
            reasons.append(f"{parent / 'cgroup.subtree_control'}: {error.strerror}")
        if CONTROLLERS <= passed:
            return parent
        reasons.append(f"{parent} passes only {' '.join(sorted(passed)) or 'no controllers'} to its children")
    raise CgroupUnavailable(f"no cgroup v2 here can have a child with the memory and pids controllers "
                            f"({'; '.join(reasons)})")


def _v2_cpu(parent: Path, folder: Path, cpus: float) -> str:
    """Limit `folder` to `cpus` cores (cpu.max); why not, or ''."""
    if not (folder / "cpu.max").exists():
        try:
            if "cpu" not in (parent / "cgroup.controllers").read_text().split():
                return f"{parent} has no cpu controller"
            (parent / "cgroup.subtree_control").write_text("+cpu")
        except OSError as error:
            return f"enabling +cpu in {parent}: {error.strerror}"
    try:
        (folder / "cpu.max").write_text(f"{max(1000, int(cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}")
    except OSError as error:
        return f"cannot write {folder / 'cpu.max'}: {error.strerror}"
    return ""


def create(name: str, *, memory_bytes: int, pids: int, cpus: float | None = None, root: Path = CGROUP_ROOT,
           proc_cgroup: Path = PROC_SELF_CGROUP) -> Cgroup:
    """A new cgroup `name` with these limits, under this process's cgroup (see the module docstring).

    `root` is where the cgroup file systems are mounted; `proc_cgroup` the file naming this
    process's cgroups. Raises `CgroupUnavailable` (one line, with the reason) when it cannot make one with the
    memory and pids limits; a `cpus` limit it cannot set leaves `cpu_limited` False and says why in
    `cpu_unavailable`.
    """
    try:
        own = _own_paths(proc_cgroup)
    except OSError as error:
        raise CgroupUnavailable(f"cannot read {proc_cgroup}: {error.strerror}") from None
    hierarchy = _v2_hierarchy(root)
    if hierarchy is not None and "" in own:
        parent = _v2_parent(hierarchy, own[""])
        folder = _make_child(parent, name)
        cgroup = Cgroup(version=2, dirs=(folder,))
        try:
            _write(folder / "memory.max", str(memory_bytes))
            if (folder / "memory.swap.max").exists():
                _write(folder / "memory.swap.max", "0")
            _write(folder / "pids.max", str(pids))
            if cpus is not None:
                cgroup.cpu_unavailable = _v2_cpu(parent, folder, cpus)
                cgroup.cpu_limited = not cgroup.cpu_unavailable
        except BaseException:
            cgroup.remove()
            raise
        return cgroup
    missing = [h for h in V1_HIERARCHIES if h not in own or not (root / h / "cgroup.procs").is_file()]
    if missing:
        raise CgroupUnavailable(
            f"no cgroup v2 with the memory and pids controllers nor cgroup v1 {' and '.join(missing)} "
            f"hierarchy under {root}")
    made: list[Path] = []
    extras: list[Path] = []
    try:
        for hierarchy_name in V1_HIERARCHIES:
            made.append(_make_child(root / hierarchy_name / own[hierarchy_name].lstrip("/"), name))
        for hierarchy_name in V1_OPTIONAL:
            if hierarchy_name in own and (root / hierarchy_name / "cgroup.procs").is_file():
                extras.append(_make_child(root / hierarchy_name / own[hierarchy_name].lstrip("/"), name))
        cgroup = Cgroup(version=1, dirs=tuple(made), extra_dirs=tuple(extras))
        memory, pid_folder = made
        _write(memory / "memory.limit_in_bytes", str(memory_bytes))
        if (memory / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swap beyond the limit
            _write(memory / "memory.memsw.limit_in_bytes", str(memory_bytes))
        _write(pid_folder / "pids.max", str(pids))
        cpu = next((folder for folder in extras if (folder / "cpu.cfs_quota_us").exists()), None)
        if cpus is not None and cpu is None:
            cgroup.cpu_unavailable = f"no cgroup v1 cpu hierarchy with CFS quotas under {root}"
        elif cpus is not None:
            _write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(cpu / "cpu.cfs_quota_us", str(max(1000, int(cpus * CPU_PERIOD_US))))
            cgroup.cpu_limited = True
    except BaseException:
        for folder in made + extras:
            try:
                folder.rmdir()
            except OSError:
                pass
        raise
    return cgroup


def find(prefix: str, *, root: Path = CGROUP_ROOT) -> list[Cgroup]:
    """Existing cgroups whose name starts with `prefix`, anywhere in the hierarchies under `root`."""
    by_name: dict[str, tuple[int, list[Path]]] = {}
    hierarchies = [(2, hierarchy) for hierarchy in (root, root / "unified")
                   if (hierarchy / "cgroup.controllers").is_file()]
    hierarchies += [(1, root / name) for name in V1_HIERARCHIES + V1_OPTIONAL
                    if (root / name / "cgroup.procs").is_file()]
    for version, hierarchy in hierarchies:
        for folder, subfolders, _ in os.walk(hierarchy):
            matched = [sub for sub in subfolders if sub.startswith(prefix)]
            for sub in matched:
                entry = by_name.setdefault(sub, (version, []))
                if entry[0] == version:
                    entry[1].append(Path(folder) / sub)
            subfolders[:] = [sub for sub in subfolders if sub not in matched]
    found = []
    for version, dirs in by_name.values():
        main = tuple(folder for folder in dirs if version == 2 or folder.parts[len(root.parts)] in V1_HIERARCHIES)
        extra = tuple(folder for folder in dirs if folder not in main)
        found.append(Cgroup(version=version, dirs=main or extra, extra_dirs=extra if main else ()))
    return found
