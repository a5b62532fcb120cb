"""The in-container command server of Docker sandboxes (stdlib only; runs inside the sandbox).

`docker exec` costs a runc process set-up per command (~100 ms on a busy 2-core machine).
Instead, a Docker sandbox's main process runs this script (as the sandbox user, with no
capabilities): it reads one JSON request per line on stdin (the host attaches to the
container) and answers one JSON line per request on stdout, running each command in its
own session with the environment, working directory, stdin, timeout and output cap asked
for. Output is capped here, at the source. A command is killed at its timeout with its
whole process group, and any process that inherited its `AGENTRL_EXEC_ID` marker (children
that left the group) is killed too. Nothing here is trusted by the host beyond the
answers' shape: the sandbox limits still hold, and if this server dies the host falls back
to `docker exec`.

Request:  {"id", "marker", "argv", "cwd", "env", "timeout", "max_output", "stdin" (base64 or null)}
Answer:   {"id", "exit_code", "stdout", "stderr" (base64), "stdout_total", "stderr_total", "timed_out"}
"""

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time

MARKER = "AGENTRL_EXEC_ID"
_write_lock = threading.Lock()


def send(message):
    data = (json.dumps(message) + "\n").encode()
    with _write_lock:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()


def kill_marked(marker):
    """SIGKILL every process whose environment carries this command's marker."""
    needle = f"{MARKER}={marker}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    os.kill(int(name), signal.SIGKILL)
        except OSError:
            continue


def pump(stream, keep, totals, key, cap):
    while True:
        chunk = stream.read1(65536)
        if not chunk:
            return
        totals[key] += len(chunk)
        room = cap - len(keep)
        if room > 0:
            keep += chunk[:room]


def feed(stream, data):
    try:
        stream.write(data)
    except OSError:
        pass
    finally:
        try:
            stream.close()
        except OSError:
            pass


def before_exec():
    try:  # the OOM killer should pick a command, never this server
        with open("/proc/self/oom_score_adj", "w") as handle:
            handle.write("1000")
    except OSError:
        pass


def run(request):
    rid = request["id"]
    marker = request.get("marker") or os.urandom(8).hex()
    env = dict(os.environ)
    env.update(request.get("env") or {})
    env[MARKER] = marker
    stdin = request.get("stdin")
    deadline = time.monotonic() + float(request["timeout"])
    cap = int(request["max_output"])
    try:
        proc = subprocess.Popen(
            request["argv"], cwd=request.get("cwd") or None, env=env,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=before_exec,
        )
    except OSError as error:
        send({"id": rid, "exit_code": 126 if isinstance(error, PermissionError) else 127, "stdout": "",
              "stderr": base64.b64encode(f"{request['argv'][0]}: {error.strerror}\n".encode()).decode(),
              "stdout_total": 0, "stderr_total": 0, "timed_out": False})
        return
    out, err = bytearray(), bytearray()
    totals = {"out": 0, "err": 0}
    workers = [
        threading.Thread(target=pump, args=(proc.stdout, out, totals, "out", cap), daemon=True),
        threading.Thread(target=pump, args=(proc.stderr, err, totals, "err", cap), daemon=True),
    ]
    if stdin is not None:
        workers.append(threading.Thread(target=feed, args=(proc.stdin, base64.b64decode(stdin)), daemon=True))
    for worker in workers:
        worker.start()
    timed_out = False
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
    for worker in workers[:2]:  # children that escaped may still hold the output open
        worker.join(timeout=max(deadline - time.monotonic(), 0.2))
    if timed_out or any(worker.is_alive() for worker in workers[:2]):
        kill_marked(marker)
        for worker in workers[:2]:
            worker.join(timeout=2)
        timed_out = timed_out or time.monotonic() >= deadline
    code = proc.returncode
    send({"id": rid, "exit_code": 128 - code if code < 0 else code,
          "stdout": base64.b64encode(bytes(out)).decode(), "stderr": base64.b64encode(bytes(err)).decode(),
          "stdout_total": totals["out"], "stderr_total": totals["err"], "timed_out": timed_out})


def serve(request):
    try:
        run(request)
    except Exception as error:  # an answer always goes back, so the host never waits forever
        send({"id": request.get("id"), "error": f"{type(error).__name__}: {error}"})


def name_process():
    try:  # `pkill python3` from a command should not take the server down
        import ctypes

        ctypes.CDLL(None).prctl(15, b"sandboxd", 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass


def main():
    name_process()
    send({"ready": os.getpid()})
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            threading.Thread(target=serve, args=(request,), daemon=True).start()
        except RuntimeError as error:  # no threads left (the pids limit is exhausted)
            send({"id": request.get("id"), "error": f"cannot start the command: {error}"})


if __name__ == "__main__":
    main()
