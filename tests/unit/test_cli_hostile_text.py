"""Rollout errors printed by `agentrl eval` and `agentrl train` are text: no rich markup, no terminal escapes.

A rollout's error carries what the sandbox or the model server said (`SandboxError(f"read_file ...:
{stderr}")`, `InferenceError(... {response.text})`). On main, `agentrl eval` printed the first error
through rich markup, so `[/]` in it crashed the command with a MarkupError after the evaluation (and
`[link=...]` made a hyperlink), and both commands wrote its ESC sequences (screen clear, OSC 52
clipboard writes, title changes) to the terminal as they were.

The model server here is a real HTTP server on 127.0.0.1 (the standard library's) that answers every
other chat request with a completion and the rest with 400 and hostile bytes.
"""

from __future__ import annotations

import http.server
import itertools
import json
import threading

import pytest

from tests.http_thread import serving

HOSTILE = b"refused [/] [/] [bold]bold[/bold] [link=http://evil.example]x[/link] \x1b]52;c;aGk=\x07\x1b[2J\x1b]0;title\x07"


@pytest.fixture
def hostile_server():
    calls = itertools.count()
    lock = threading.Lock()

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with lock:
                refuse = self.server.refuse_all or next(calls) % 2 == 1
            if refuse:
                status, body = 400, HOSTILE
            else:
                status, body = 200, json.dumps({"choices": [{"message": {"role": "assistant", "content": "olleh"},
                                                             "finish_reason": "stop"}]}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # /v1/models: the names the server chose
            body = json.dumps({"data": [{"id": name} for name in self.server.models]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    server.refuse_all, server.models = False, []
    with serving(server):
        yield server


@pytest.mark.parametrize("refuse_all", [False, True], ids=["some-fail", "all-fail"])
def test_eval_prints_a_hostile_first_error_as_text(hostile_server, refuse_all, tmp_path, capsys):
    from agentrl.cli import main

    hostile_server.refuse_all = refuse_all
    url = f"http://127.0.0.1:{hostile_server.server_address[1]}"
    code = main(["eval", "--base-url", url, "--model", "served", "--client", "openai", "-n", "2", "-r", "2",
                 "-o", str(tmp_path / "eval")])
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert code == (1 if refuse_all else 0), output
    line = next(line for line in output.splitlines() if "first error:" in line)
    assert "refused [/] [/] [bold]bold[/bold] [link=http://evil.example]x[/link]" in line  # the markup as text
    assert "\x1b" not in output and "\x07" not in output  # no escape reaches the terminal ...
    assert "\\x1b]52;c;aGk=" in line  # ... it is shown, visibly


def test_a_one_line_error_quoting_the_server_is_text(hostile_server, tmp_path, capsys):
    from agentrl.cli import main

    hostile_server.models = ["a\x1b]0;title\x07", "b\x1b[2J"]
    url = f"http://127.0.0.1:{hostile_server.server_address[1]}"
    assert main(["eval", "--base-url", url, "--model", "served", "--client", "openai", "-n", "1",
                 "-o", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err
    assert "does not serve model 'served'; it serves: a\\x1b]0;title\\x07, b\\x1b[2J" in err
    assert "\x1b" not in err.replace("\x1b[31m", "").replace("\x1b[0m", "")  # typer's own red only


def test_train_prints_a_hostile_first_error_as_text():
    from agentrl.cli.train import _error_line

    assert _error_line({"step": 3}) is None
    line = _error_line({"rollout_errors": 2.0, "first_error": HOSTILE.decode() + "\u202e reversed \x9b31m"})
    assert line.startswith("  2 rollouts failed; first error: refused [/] [/] [bold]bold[/bold]")
    assert not any(ord(c) < 32 or 0x7f <= ord(c) < 0xa0 or c == "\u202e" for c in line), repr(line)
    assert "\\x1b[2J" in line and "\\u202e reversed \\x9b31m" in line


def test_agentrls_warnings_are_one_line_and_others_are_as_python_shows_them(capsys):
    """An ecosystem walk-through saw every Harbor eval print `.../concurrent/futures/thread.py:58: RuntimeWarning:
    sandbox network: ...` and then the source line `result = self.fn(*self.args, **self.kwargs)`."""
    import warnings

    import agentrl.cli as cli
    from agentrl.errors import AgentrlWarning

    shown_by_python = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, *rest: shown_by_python.append((category, str(message)))
        cli.main(["--help"])  # the command's display is in place from here on, as in the `agentrl` process
        capsys.readouterr()
        warnings.warn("sandbox network: asked for, but none \x1b]52;c;x\x07here", AgentrlWarning, stacklevel=1)
        warnings.warn("a library's own", DeprecationWarning, stacklevel=1)
    assert capsys.readouterr().err == "warning: sandbox network: asked for, but none \\x1b]52;c;x\\x07here\n"
    assert shown_by_python == [(DeprecationWarning, "a library's own")]
