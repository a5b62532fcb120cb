"""Harbor tasks written by the project, the Harbor tests' fixtures (FROM agentrl-base:bookworm, offline).

- `named`: schema 1.4; `reward.json` of named rewards (`correctness` marked primary) beside a stale
  `reward.txt` of 0; a `solve.sh` that copies its sibling `answer.txt` into the working directory
  (`[environment] workdir = "/work"`, not the Dockerfile's /app) as `[agent] user = 1000`; the verifier
  as root with `[verifier] env` (a host template with a default); `[solution] env`; a healthcheck.
- `steps`: two `[[steps]]`, each with its instruction, tests and solution; the second uploads `workdir/`
  and runs its `setup.sh`; `min_reward` on the first; the agent is the image's user named `agent`.
- `network(mode)`: one task per `network_mode`; the verifier records whether it had a network.
- `installs`: a test.sh that installs a tool under /usr/local/bin (needs a writable root at verify time)
  and needs apt able to run as root there (how `apt-get install` works without capabilities).
- `slow`: `[agent] timeout_sec = 3`, the agent's total budget.

`harbor_validate(folders)` checks folders with harbor 0.25's own `Task` model (Python 3.12 venv).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

BASE = "FROM agentrl-base:bookworm\n"
HARBOR_PYTHON = Path(os.environ.get("AGENTRL_HARBOR_PYTHON", "/tmp/harbor-venv/bin/python"))


def _write(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


NAMED_TOML = """schema_version = "1.4"

[task]
name = "agentrl/named-rewards"
description = "Copy the greeting into the working directory."
keywords = ["files"]

[metadata]
difficulty = "easy"
primary_reward = "correctness"

[agent]
timeout_sec = 120.0
user = 1000

[verifier]
timeout_sec = 60.0
user = "root"
env = { EXPECTED = "Hello, world!", FROM_HOST = "${AGENTRL_HARBOR_UNSET_VARIABLE:-fallback}" }

[environment]
cpus = 1
memory_mb = 512
storage_mb = 1024
workdir = "/work"
network_mode = "no-network"
env = { GREETING_FILE = "hello.txt" }

[environment.healthcheck]
command = "test -f /opt/ready"
interval_sec = 0.2
start_interval_sec = 0.2
retries = 2

[solution]
env = { ANSWER_FILE = "answer.txt" }
"""
NAMED_TEST = """#!/bin/bash
correct=0; [ "$(cat hello.txt 2>/dev/null)" = "$EXPECTED" ] && correct=1
agent=0; [ "$(cat who.txt 2>/dev/null)" = "1000" ] && agent=1
root=0; [ "$(id -u)" = 0 ] && root=1
host=0; [ "$FROM_HOST" = "fallback" ] && host=1
echo 0 > /logs/verifier/reward.txt
printf '{"correctness": %d, "agent_user": %d, "verifier_root": %d, "host_env": %d}' \\
  $correct $agent $root $host > /logs/verifier/reward.json
"""


def named(folder: Path) -> Path:
    return _write(folder, {
        "task.toml": NAMED_TOML,
        "instruction.md": "<!-- canary GUID 0000 -->\nWrite hello.txt in the working directory: "
                          "Hello, world!\n",
        "environment/Dockerfile": BASE + "WORKDIR /app\nRUN mkdir -p /work && touch /opt/ready\n",
        "tests/test.sh": NAMED_TEST,
        "solution/solve.sh": '#!/bin/bash\nset -e\ncp "$(dirname "$0")/$ANSWER_FILE" "$GREETING_FILE"\n'
                             'id -u > who.txt\n',
        "solution/answer.txt": "Hello, world!",
    })


STEPS_TOML = """schema_version = "1.4"
multi_step_reward_strategy = "mean"

[task]
name = "agentrl/two-steps"

[agent]
user = "agent"

[environment]
memory_mb = 512
storage_mb = 1024
network_mode = "no-network"

[[steps]]
name = "write"
min_reward = 1.0

[[steps]]
name = "extend"
"""
STEP_TEST = """#!/bin/bash
if [ "$(cat /app/notes.txt 2>/dev/null)" = "{expected}" ]; then echo 1; else echo 0; fi \\
  > /logs/verifier/reward.txt
"""


def steps(folder: Path) -> Path:
    return _write(folder, {
        "task.toml": STEPS_TOML,
        "environment/Dockerfile": BASE + "WORKDIR /app\nRUN chown agent:agent /app\n",
        "steps/write/instruction.md": "Write 'one' to /app/notes.txt.\n",
        "steps/write/tests/test.sh": STEP_TEST.format(expected="one"),
        "steps/write/solution/solve.sh": "#!/bin/bash\necho one > /app/notes.txt\n",
        "steps/extend/instruction.md": "Append the content of seed.txt, then 'two', to /app/notes.txt.\n",
        "steps/extend/workdir/setup.sh": "#!/bin/bash\necho seeded > /app/seed.txt\n",
        "steps/extend/tests/test.sh": STEP_TEST.format(expected="one\nseeded\ntwo"),
        "steps/extend/solution/solve.sh": "#!/bin/bash\ncat /app/seed.txt >> /app/notes.txt\n"
                                          "echo two >> /app/notes.txt\n",
    })


def network(folder: Path, mode: str) -> Path:
    hosts = '\nallowed_hosts = ["pypi.org", "*.pythonhosted.org"]' if mode == "allowlist" else ""
    verifier = '[verifier]\nnetwork_mode = "no-network"\n' if mode == "public" else ""
    return _write(folder, {
        "task.toml": f'schema_version = "1.3"\n{verifier}[environment]\nmemory_mb = 512\n'
                     f'network_mode = "{mode}"{hosts}\n',
        "instruction.md": "Write done to /app/state.txt.\n",
        "environment/Dockerfile": BASE + "WORKDIR /app\n",
        "tests/test.sh": "#!/bin/bash\n"
                         "ok=0; [ \"$(cat /app/state.txt 2>/dev/null)\" = done ] && ok=1\n"
                         "net=$(tail -n +3 /proc/net/dev | grep -vc '^ *lo:')\n"
                         "had=$([ \"$net\" -gt 0 ] && echo 1 || echo 0)\n"
                         "printf '{\"reward\": %d, \"had_network\": %d}' $ok $had"
                         " > /logs/verifier/reward.json\n",
        "solution/solve.sh": "#!/bin/bash\necho done > /app/state.txt\n",
    })


def installs(folder: Path) -> Path:
    return _write(folder, {
        "task.toml": 'version = "1.0"\n[environment]\nmemory = "512M"\nstorage = "1G"\n'
                     'allow_internet = false\n',
        "instruction.md": "Write ok to /app/out.txt.\n",
        "environment/Dockerfile": BASE + "WORKDIR /app\n",
        "tests/test.sh": "#!/bin/bash\nprintf '#!/bin/sh\\ncat /app/out.txt\\n' > /usr/local/bin/check-out"
                         " && chmod +x /usr/local/bin/check-out\n"
                         "eval \"$(apt-config shell SANDBOX_USER APT::Sandbox::User)\"\n"
                         "if [ \"$(check-out)\" = ok ] && [ \"$SANDBOX_USER\" = root ]; then echo 1; "
                         "else echo 0; fi > /logs/verifier/reward.txt\n",
        "solution/solve.sh": "#!/bin/bash\necho ok > /app/out.txt\n",
    })


def slow(folder: Path) -> Path:
    return _write(folder, {
        "task.toml": '[agent]\ntimeout_sec = 3.0\n[environment]\nnetwork_mode = "no-network"\n',
        "instruction.md": "Take your time.\n",
        "environment/Dockerfile": BASE + "WORKDIR /app\n",
        "tests/test.sh": "#!/bin/bash\necho 0.25 > /logs/verifier/reward.txt\n",
    })


VALIDATE = """
import sys, warnings
warnings.simplefilter("ignore")
from harbor.models.task.task import Task
for folder in sys.argv[1:]:
    task = Task(folder)
    print(folder, task.config.schema_version, len(task.config.steps or []))
"""


def harbor_available() -> bool:
    return HARBOR_PYTHON.is_file()


def harbor_validate(folders: list[Path]) -> str:
    """Load each folder with harbor 0.25's own Task model; returns its output (raises on a rejection)."""
    result = subprocess.run([str(HARBOR_PYTHON), "-c", VALIDATE, *map(str, folders)], capture_output=True,
                            text=True, timeout=120)
    if result.returncode != 0:
        raise AssertionError(f"harbor rejected a fixture: {result.stderr.strip().splitlines()[-1]}")
    return result.stdout


COMPOSE = """services:
  main:
    environment:
      STORE_URL: http://store:8000
    depends_on: [store]
  store:
    build:
      context: ./store
    healthcheck:
      test: ["CMD", "python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/x')"]
      interval: 500ms
      retries: 60
"""
STORE = """import http.server

DATA = {"/x": b""}


class Store(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = DATA.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"")

    def do_PUT(self):
        DATA[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(204)
        self.end_headers()


http.server.ThreadingHTTPServer(("0.0.0.0", 8000), Store).serve_forever()
"""
FETCH = ("python3 -c \"import os, urllib.request; "
         "print(urllib.request.urlopen(os.environ['STORE_URL'] + '/answer').read().decode())\"")


def compose(folder: Path, network: str = "no-network") -> Path:
    """A service beside the agent: the agent PUTs the answer into `store`; the verifier reads it there."""
    return _write(folder, {
        "task.toml": f'[environment]\nmemory_mb = 512\nnetwork_mode = "{network}"\n',
        "instruction.md": "Store the answer 42 under /answer in the key-value service at $STORE_URL "
                          "(HTTP PUT).\n",
        "environment/Dockerfile": BASE + "WORKDIR /app\n",
        "environment/docker-compose.yaml": COMPOSE,
        "environment/store/Dockerfile": BASE + 'COPY server.py /server.py\nCMD ["python3", "/server.py"]\n',
        "environment/store/server.py": STORE,
        "tests/test.sh": f"#!/bin/bash\nif [ \"$({FETCH} 2>/dev/null)\" = 42 ]; then echo 1; else echo 0; fi"
                         " > /logs/verifier/reward.txt\n",
        "solution/solve.sh": "#!/bin/bash\npython3 -c \"import os, urllib.request; urllib.request.urlopen("
                             "urllib.request.Request(os.environ['STORE_URL'] + '/answer', data=b'42', "
                             "method='PUT'))\"\n",
    })


MCP_COMPOSE = """services:
  main:
    depends_on: [notes-mcp]
  notes-mcp:
    build:
      context: ./notes
    healthcheck:
      test: ["CMD", "python3", "-c", "import socket; socket.create_connection(('127.0.0.1', 8000))"]
      interval: 500ms
      retries: 60
"""
MCP_CALL = ("import json, sys, urllib.request; "
            "body = json.dumps({'jsonrpc': '2.0', 'id': 1, 'method': 'tools/call', 'params': "
            "{'name': sys.argv[1], 'arguments': json.loads(sys.argv[2])}}).encode(); "
            "request = urllib.request.Request('http://notes-mcp:8000/mcp', data=body, "
            "headers={'Content-Type': 'application/json', 'Accept': 'application/json, text/event-stream'}); "
            "print(json.load(urllib.request.urlopen(request))['result']['content'][0]['text'])")


def mcp_compose(folder: Path) -> Path:
    """An MCP server as a compose service (streamable HTTP), declared in `[[environment.mcp_servers]]`: the
    agent must add the note 42 with its `add_note` tool; the verifier asks the server for its notes."""
    notes = (Path(__file__).resolve().parents[1] / "fixtures" / "mcp" / "notes_server.py").read_text()
    return _write(folder, {
        "task.toml": '[environment]\nmemory_mb = 512\nnetwork_mode = "no-network"\n\n'
                     '[[environment.mcp_servers]]\nname = "notes"\ntransport = "streamable-http"\n'
                     'url = "http://notes-mcp:8000/mcp"\n',
        "instruction.md": "Add the note 42 with the notes tool.\n",
        "environment/Dockerfile": BASE + "WORKDIR /app\n",
        "environment/docker-compose.yaml": MCP_COMPOSE,
        "environment/notes/Dockerfile": BASE + 'COPY notes_server.py /notes_server.py\n'
                                               'CMD ["python3", "/notes_server.py", "--http", "8000"]\n',
        "environment/notes/notes_server.py": notes,
        "tests/test.sh": f"#!/bin/bash\nif python3 -c \"{MCP_CALL}\" list_notes '{{}}' | grep -qx 42; then echo 1; "
                         "else echo 0; fi > /logs/verifier/reward.txt\n",
        "solution/solve.sh": f"#!/bin/bash\npython3 -c \"{MCP_CALL}\" add_note '{{\"text\": \"42\"}}'\n",
    })


def entrypoint(folder: Path) -> Path:
    """An image whose ENTRYPOINT writes under /etc before it runs the container's command."""
    return _write(folder, {
        "task.toml": '[environment]\nmemory_mb = 512\nnetwork_mode = "no-network"\n',
        "instruction.md": "Copy /etc/harbor-ready to /app/out.txt.\n",
        "environment/Dockerfile": BASE + "WORKDIR /app\nCOPY start.sh /start.sh\n"
                                         'ENTRYPOINT ["/bin/sh", "/start.sh"]\n',
        "environment/start.sh": "echo ready > /etc/harbor-ready || exit 1\nexec \"$@\"\n",
        "tests/test.sh": "#!/bin/bash\nif [ \"$(cat /app/out.txt 2>/dev/null)\" = ready ]; then echo 1; "
                         "else echo 0; fi > /logs/verifier/reward.txt\n",
        "solution/solve.sh": "#!/bin/bash\ncp /etc/harbor-ready /app/out.txt\n",
    })


def home(folder: Path) -> Path:
    """The solution writes outside the working directory (Harbor's verifier sees the whole container)."""
    return _write(folder, {
        "task.toml": '[environment]\nmemory_mb = 512\nnetwork_mode = "no-network"\n',
        "instruction.md": "Write 42 to /root/.config/harbor/answer.\n",
        "environment/Dockerfile": BASE + "WORKDIR /app\n",
        "tests/test.sh": "#!/bin/bash\nif [ \"$(cat /root/.config/harbor/answer 2>/dev/null)\" = 42 ]; "
                         "then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n",
        "solution/solve.sh": "#!/bin/bash\nmkdir -p /root/.config/harbor\n"
                             "echo 42 > /root/.config/harbor/answer\n",
    })


def built_package(task_folder: Path, out: Path, *, name: str, docker_client):
    """Import a Harbor task folder as package `name` and build its image `name:0.1.0` (on the base image); a
    generator for module fixtures: yields the package folder, removes the image afterwards."""
    from agentrl.hub.images import build_image
    from agentrl.hub.interop.harbor import import_harbor_task
    from agentrl.sandbox.base_image import build_base_image

    build_base_image()
    package = import_harbor_task(task_folder, out=out, name=name)
    build_image(package, dockerfile="environment/Dockerfile", tag=f"{name}:0.1.0")
    yield package
    docker_client.images.remove(f"{name}:0.1.0", force=True)
