"""The in-container command server of Docker sandboxes (runs inside the sandbox).

`docker exec` costs a runc process set-up per command (~100 ms on a busy 2-core machine).
Instead, a Docker sandbox's main process runs this script (as the sandbox user, with no
capabilities). It is one single-threaded poll loop that imports only built-in C modules
(start-up is part of every sandbox's creation time): requests arrive on stdin, each a
12-digit length then a `marshal`-encoded dict written by the host; every command runs in
its own session (fork + setsid + exec) with the environment, working directory, stdin,
timeout and output cap asked for. Output is capped here, at the source. At its timeout a
command's process group is killed, and so is any process that inherited the command's
`AGENTRL_EXEC_ID` marker (children that left the group). Answers go to stdout as JSON
lines built by hand (the host parses them with `json`; nothing from the sandbox is ever
unmarshalled on the host). If this server dies, the host falls back to `docker exec`.

Request:  {"id", "marker", "argv", "cwd", "env", "timeout", "max_output", "stdin" (bytes or None)}
Answer:   {"id", "exit_code", "stdout", "stderr" (base64), "stdout_total", "stderr_total", "timed_out"}
          or {"id", "error" (base64 text)}
"""

import _signal
import binascii
import marshal
import os
import select
import time

MARKER = "AGENTRL_EXEC_ID"
HEADER = 12


def b64(data):
    return binascii.b2a_base64(data, newline=False).decode()


def send(text):
    view = memoryview(text.encode())
    while view:
        written = os.write(1, view)
        view = view[written:]


def kill_marked(marker):
    """SIGKILL every process whose environment carries this command's marker."""
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


class Job:
    def __init__(self, request):
        self.id = request["id"]
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
    def __init__(self):
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
        job, kind = self.fds.pop(fd)
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

    def finish(self, job):
        for fd in [fd for fd, (owner, _) in self.fds.items() if owner is job]:
            self.close_fd(fd)
        del self.jobs[job.pid]
        code = job.status if job.status is not None else -9
        send('{"id": %d, "exit_code": %d, "stdout": "%s", "stderr": "%s", "stdout_total": %d, '
             '"stderr_total": %d, "timed_out": %s}\n' % (
                 job.id, 128 - code if code < 0 else code, b64(bytes(job.out)), b64(bytes(job.err)),
                 job.totals["out"], job.totals["err"], "true" if job.timed_out else "false"))

    def check_jobs(self):
        now = time.monotonic()
        for job in list(self.jobs.values()):
            output_open = any(self.fds[fd][1] != "in" for fd in job.open)
            if job.status is not None and not output_open:
                self.finish(job)
            elif now >= job.deadline:
                # Timed out, or finished while an escaped child holds the output open: kill them all.
                job.timed_out = True
                try:
                    os.killpg(job.pid, 9)
                except OSError:
                    pass
                kill_marked(job.marker)
                if job.status is None:
                    try:
                        job.status = os.waitstatus_to_exitcode(os.waitpid(job.pid, 0)[1])
                    except ChildProcessError:
                        job.status = -9
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
                self.spawn(request)
            except Exception as error:  # e.g. no processes left under the pids limit
                send('{"id": %d, "error": "%s"}\n' % (request.get("id", -1), b64(f"{type(error).__name__}: {error}".encode())))

    def run(self):
        try:  # `pkill python3` from a command should not take the server down
            fd = os.open("/proc/self/comm", os.O_WRONLY)
            os.write(fd, b"sandboxd")
            os.close(fd)
        except OSError:
            pass
        send('{"ready": %d}\n' % os.getpid())
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


if __name__ == "__main__":
    Server().run()
