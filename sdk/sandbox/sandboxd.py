"""The in-container command server of Docker sandboxes (runs inside the sandbox).

`docker exec` costs a runc process set-up per command (~100 ms on a busy 2-core machine).
Instead, a Docker sandbox's main process runs this script. It is one single-threaded poll
loop that imports only built-in C modules (start-up is part of every sandbox's creation
time): requests arrive on stdin, each a 12-digit length then a `marshal`-encoded dict
written by the host; every command runs in its own session (fork + setsid + exec) with the
environment, working directory, stdin, timeout and output cap asked for. Output is capped
here, at the source.

Nothing a command starts can reach this server's channel to the host. The server runs as
root with only CAP_SETUID, CAP_SETGID and CAP_KILL (the container drops every other
capability and sets no-new-privileges); each command drops to the sandbox user
(`AGENTRL_SANDBOX_USER`, 'uid[:gid]' or 'name[:group]') before it executes, and a command
that runs as root loses every capability. The kernel then refuses the command's processes
this server's /proc entries (fds, memory, environment) and its signals: a different uid,
or fewer capabilities for root. Every answer also echoes the request's random token, so
the host drops anything it did not ask for.

A command's answer goes out as soon as its main process exits; output that background
children write later is read and dropped (so they never die of a broken pipe) until they
close it. At its timeout a command's process group is killed, and so is any process that
inherited the command's `AGENTRL_EXEC_ID` marker (children that left the group; a helper
running as the sandbox user, holding none of this server's fds, finds them, since root
without CAP_SYS_PTRACE may not read their environment). `kill_all` kills every process but the container's init, its
launcher and this server. Answers go to stdout as JSON lines built by hand (the host parses
them with `json`; nothing from the sandbox is ever unmarshalled on the host). If this server
dies, the host falls back to `docker exec`.

Request:  {"id", "token", "marker", "argv", "cwd", "env", "timeout", "max_output", "stdin" (bytes or None)}
          or {"id", "token", "op": "kill_all"}
Answer:   {"id", "token", "exit_code", "stdout", "stderr" (base64), "stdout_total", "stderr_total", "timed_out"}
          or {"id", "token", "killed"} or {"id", "token", "error" (base64 text)}
Hello:    {"ready": pid, "launcher": parent pid} or {"gone": 1, "error": base64 text} when it cannot serve
"""

import _signal
import binascii
import marshal
import os
import select
import time

MARKER = "AGENTRL_EXEC_ID"
USER_VARIABLE = "AGENTRL_SANDBOX_USER"
HEADER = 12
ORPHAN_FDS = 256  # output pipes of background children still drained after their command answered


def b64(data):
    return binascii.b2a_base64(data, newline=False).decode()


def send(text):
    view = memoryview(text.encode())
    while view:
        written = os.write(1, view)
        view = view[written:]


class User:
    """The sandbox user commands run as, resolved from the image's passwd and group files."""

    def __init__(self, spec):
        import grp
        import pwd

        name, _, group = (spec or "0").partition(":")
        try:
            entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
        except KeyError:
            if not name.isdigit():
                raise ValueError("unable to find user " + name) from None
            entry = None
        self.uid = int(name) if name.isdigit() else entry.pw_uid
        if group:
            self.gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        else:
            self.gid = entry.pw_gid if entry else 0
        self.home = entry.pw_dir if entry else "/"
        self.groups = [self.gid]
        if entry is not None:
            self.groups += [g.gr_gid for g in grp.getgrall() if entry.pw_name in g.gr_mem and g.gr_gid != self.gid]
        self._capset = None
        if self.uid == 0:  # root commands must lose the server's capabilities: capset(2) through libc
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
            empty = (ctypes.c_uint32 * 6)()
            self._capset = lambda: libc.capset(header, empty)

    def become(self):
        """In a forked child: drop to this user, and to no capabilities at all."""
        os.setgroups(self.groups)
        os.setresgid(self.gid, self.gid, self.gid)
        os.setresuid(self.uid, self.uid, self.uid)
        if self._capset is not None and self._capset() != 0:
            raise PermissionError("cannot drop capabilities")


def leave_channel():
    """In a forked child that runs as the sandbox user and never executes anything: let go of every fd this
    server holds (its channel to the host is stdin and stdout; the commands' pipes), so that no process of
    the sandbox user's holds them, not even for the moment it runs. 0, 1 and 2 become /dev/null."""
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        if fd != null:
            os.dup2(null, fd)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))


def kill_marked(user, marker):
    """SIGKILL every process whose environment carries this command's marker.

    Root without CAP_SYS_PTRACE may not read another uid's environment, so a helper that runs
    as the sandbox user scans /proc; it is itself killed if it does not finish within 2 s.
    """
    pid = os.fork()
    if pid == 0:
        try:
            leave_channel()
            user.become()
            needle = (MARKER + "=" + marker).encode()
            me = os.getpid()
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) == me:
                    continue
                try:
                    fd = os.open("/proc/" + name + "/environ", os.O_RDONLY)
                    try:
                        chunks = []
                        while chunk := os.read(fd, 65536):
                            chunks.append(chunk)
                    finally:
                        os.close(fd)
                    if needle in b"".join(chunks).split(b"\0"):
                        os.kill(int(name), 9)
                except OSError:
                    continue
        finally:
            os._exit(0)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return
        time.sleep(0.005)
    os.kill(pid, 9)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _threads(pid):
    """How many threads /proc/PID/status counts (0 when unreadable). A process whose leader thread ended with
    `SYS_exit` shows state Z while its other threads run on: it is alive, and SIGKILL to its pid ends them all."""
    try:
        with open("/proc/" + pid + "/status", "rb") as handle:
            for line in handle:
                if line.startswith(b"Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def kill_all(within_s=10.0):
    """SIGKILL every process but init, the launcher and this server, until none is left: (how many were killed,
    how many still ran when `within_s` ran out).

    Each process (a pid with its start time, so a reused pid counts as new; a zombie leader whose other threads
    run counts as alive) gets one SIGKILL; the loop then only waits for it to die, and signals what appeared
    meanwhile (forks in flight), for at most `within_s`. Survivors are reported, never taken for a clean kill: a
    grader must not run beside them.
    """
    keep = {1, os.getpid(), os.getppid()}
    signalled = set()
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in keep:
                continue
            try:
                with open("/proc/" + name + "/stat", "rb") as handle:
                    fields = handle.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if len(fields) > 19 and (fields[0] != b"Z" or _threads(name) > 1):
                alive.append((int(name), fields[19]))  # fields[19]: the start time (stat's 22nd field)
        if not alive or time.monotonic() >= deadline:
            break
        for process in alive:
            if process in signalled:
                continue
            signalled.add(process)
            try:
                os.kill(process[0], 9)
            except OSError:
                pass
        time.sleep(0.005)
    return len(signalled), len(alive)


class Job:
    def __init__(self, request):
        self.id = request["id"]
        self.token = request["token"]
        self.marker = request.get("marker") or os.urandom(8).hex()
        self.deadline = time.monotonic() + float(request["timeout"])
        self.cap = int(request["max_output"])
        self.out, self.err = bytearray(), bytearray()
        self.totals = {"out": 0, "err": 0}
        self.status = None
        self.timed_out = False
        self.open = set()
        self.stdin = request.get("stdin")
        self.stdin_sent = 0
        self.pid = 0


class Server:
    def __init__(self, user):
        self.user = user
        self.orphans = []  # output fds of answered commands, read until their writers close them
        self.poller = select.poll()
        self.fds = {}  # fd -> (job, "out" | "err" | "in")
        self.jobs = {}  # pid -> job
        self.inbox = bytearray()
        wake_r, self.wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.wake_r = wake_r
        _signal.set_wakeup_fd(self.wake_w)
        _signal.signal(_signal.SIGCHLD, lambda signum, frame: None)
        self.poller.register(0, select.POLLIN)
        self.poller.register(wake_r, select.POLLIN)

    def spawn(self, request):
        job = Job(request)
        env = dict(os.environ)
        env["HOME"] = self.user.home
        env.update(request.get("env") or {})
        env[MARKER] = job.marker
        argv = list(request["argv"])
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        if job.stdin is not None:
            in_r, in_w = os.pipe()
        else:
            in_r, in_w = os.open("/dev/null", os.O_RDONLY), None
        pid = os.fork()
        if pid == 0:  # the command: own session, most likely OOM victim, pipes as 0/1/2
            code = 127
            try:
                os.setsid()
                for signum in (_signal.SIGPIPE, _signal.SIGXFSZ):  # Python ignores these; commands must not
                    _signal.signal(signum, _signal.SIG_DFL)
                try:
                    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
                    os.write(fd, b"1000")
                    os.close(fd)
                except OSError:
                    pass
                os.dup2(in_r, 0)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                self.user.become()
                if request.get("cwd"):
                    os.chdir(request["cwd"])
                os.execvpe(argv[0], argv, env)
            except OSError as error:
                code = 126 if isinstance(error, PermissionError) else 127
                try:
                    os.write(2, (argv[0] + ": " + (error.strerror or str(error)) + "\n").encode())
                except OSError:
                    pass
            os._exit(code)
        job.pid = pid
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        for fd, kind in ((out_r, "out"), (err_r, "err")):
            os.set_blocking(fd, False)
            self.fds[fd] = (job, kind)
            job.open.add(fd)
            self.poller.register(fd, select.POLLIN)
        if in_w is not None:
            os.set_blocking(in_w, False)
            self.fds[in_w] = (job, "in")
            self.poller.register(in_w, select.POLLOUT)
        self.jobs[pid] = job

    def close_fd(self, fd):
        job, _kind = self.fds.pop(fd)
        if job is None:
            self.orphans.remove(fd)
        else:
            job.open.discard(fd)
        try:
            self.poller.unregister(fd)
        except (KeyError, ValueError):
            pass
        os.close(fd)

    def on_output(self, fd):
        job, kind = self.fds[fd]
        if kind == "in":
            try:
                written = os.write(fd, memoryview(job.stdin)[job.stdin_sent : job.stdin_sent + 65536])
                job.stdin_sent += written
            except BlockingIOError:
                return
            except OSError:  # the command closed its stdin
                job.stdin_sent = len(job.stdin)
            if job.stdin_sent >= len(job.stdin):
                self.close_fd(fd)
            return
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close_fd(fd)
            return
        if job is None:  # a background child's output after its command answered: dropped
            return
        job.totals[kind] += len(data)
        keep = job.out if kind == "out" else job.err
        room = job.cap - len(keep)
        if room > 0:
            keep += data[:room]

    def reap(self):
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            job = self.jobs.get(pid)
            if job is not None:
                job.status = os.waitstatus_to_exitcode(status)

    def drain(self, job):
        """Read what the exited command left in its output pipes (all it wrote is there by now)."""
        for fd in [fd for fd in job.open if self.fds[fd][1] != "in"]:
            while fd in self.fds:
                before = job.totals[self.fds[fd][1]]
                self.on_output(fd)
                if fd in self.fds and job.totals[self.fds[fd][1]] == before:
                    break  # nothing more buffered: a background child keeps the pipe open

    def finish(self, job):
        for fd in [fd for fd, (owner, _) in self.fds.items() if owner is job]:
            if self.fds[fd][1] == "in":
                self.close_fd(fd)
                continue
            self.fds[fd] = (None, "out")  # keep draining until the last writer closes it
            self.orphans.append(fd)
        job.open.clear()
        while len(self.orphans) > ORPHAN_FDS:
            self.close_fd(self.orphans[0])
        del self.jobs[job.pid]
        code = job.status if job.status is not None else -9
        send('{"id": %d, "token": "%s", "exit_code": %d, "stdout": "%s", "stderr": "%s", "stdout_total": %d, '
             '"stderr_total": %d, "timed_out": %s}\n' % (
                 job.id, job.token, 128 - code if code < 0 else code, b64(bytes(job.out)), b64(bytes(job.err)),
                 job.totals["out"], job.totals["err"], "true" if job.timed_out else "false"))

    def check_jobs(self):
        now = time.monotonic()
        for job in list(self.jobs.values()):
            if job.status is not None:  # the command exited: answer now, whatever its children do
                self.drain(job)
                self.finish(job)
            elif now >= job.deadline:  # timed out: kill its group and every process carrying its marker
                job.timed_out = True
                try:
                    os.killpg(job.pid, 9)
                except OSError:
                    pass
                kill_marked(self.user, job.marker)
                try:
                    job.status = os.waitstatus_to_exitcode(os.waitpid(job.pid, 0)[1])
                except ChildProcessError:
                    job.status = -9
                self.drain(job)
                self.finish(job)

    def take_requests(self):
        data = os.read(0, 1 << 20)
        if not data:
            raise SystemExit(0)  # the host detached: nothing more will come
        self.inbox += data
        while len(self.inbox) >= HEADER:
            size = int(self.inbox[:HEADER])
            if len(self.inbox) < HEADER + size:
                return
            request = marshal.loads(bytes(self.inbox[HEADER : HEADER + size]))
            del self.inbox[: HEADER + size]
            try:
                if request.get("op") == "kill_all":
                    killed, survivors = kill_all(float(request.get("within_s", 10.0)))
                    self.reap()
                    send('{"id": %d, "token": "%s", "killed": %d, "survivors": %d}\n' % (
                        request["id"], request["token"], killed, survivors))
                else:
                    self.spawn(request)
            except Exception as error:  # e.g. no processes left under the pids limit
                send('{"id": %d, "token": "%s", "error": "%s"}\n' % (
                    request.get("id", -1), request.get("token", ""), b64(f"{type(error).__name__}: {error}".encode())))

    def run(self):
        try:  # `pkill python3` from a command should not take the server down
            fd = os.open("/proc/self/comm", os.O_WRONLY)
            os.write(fd, b"sandboxd")
            os.close(fd)
        except OSError:
            pass
        send('{"ready": %d, "launcher": %d}\n' % (os.getpid(), os.getppid()))
        while True:
            deadlines = [job.deadline for job in self.jobs.values()]
            wait = None
            if deadlines:
                wait = max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)
            for fd, _events in self.poller.poll(wait):
                if fd == 0:
                    self.take_requests()
                elif fd == self.wake_r:
                    self.reap()
                elif fd in self.fds:
                    self.on_output(fd)
            self.reap()
            self.check_jobs()


def main():
    try:
        user = User(os.environ.pop(USER_VARIABLE, "0"))
    except Exception as error:  # an unknown user, or no ctypes to drop root's capabilities: docker exec serves
        send('{"gone": 1, "error": "%s"}\n' % b64(f"{type(error).__name__}: {error}".encode()))
        raise SystemExit(1) from None
    os.environ.pop("HOME", None)
    Server(user).run()


if __name__ == "__main__":
    main()
