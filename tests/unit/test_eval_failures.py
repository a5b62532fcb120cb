"""`agentrl eval` against a server that is not there, or that refuses every request: one line, non-zero exit.

The refusing server is a real HTTP server on 127.0.0.1 (the standard library's) that answers every
request with 400, as an OpenAI-compatible endpoint does for a request it rejects.
"""

from __future__ import annotations

import http.server
import socket

import pytest

from tests.http_thread import serving


@pytest.fixture
def refusing_server():
    class Refuse(http.server.BaseHTTPRequestHandler):
        def _refuse(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            body = b'{"error": {"message": "refused by the test server"}}'
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _refuse

        def log_message(self, *args) -> None:
            pass

    class Quiet(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address) -> None:
            pass  # a client that hung up mid-answer (the CLI stopping at once) is not this test's output

    server = Quiet(("127.0.0.1", 0), Refuse)
    with serving(server):
        yield f"http://127.0.0.1:{server.server_address[1]}"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_no_server_at_the_base_url_is_one_line_and_writes_nothing(tmp_path, capsys):
    from agentrl.cli import main

    url = f"http://127.0.0.1:{_closed_port()}"
    output = tmp_path / "eval"
    assert main(["eval", "--base-url", url, "--model", "served", "-n", "2", "-o", str(output)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"base_url '{url}': no server answers" in err and "agentrl serve" in err
    assert not output.exists()


def test_every_rollout_refused_exits_non_zero_and_keeps_the_results(refusing_server, tmp_path, capsys):
    from agentrl.cli import main

    output = tmp_path / "eval"
    assert main(["eval", "--base-url", refusing_server, "--model", "served", "--client", "openai", "-n", "2",
                 "-r", "2", "-o", str(output)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: all 4 rollouts failed; first error:") and "400" in err[-1]
    assert len((output / "results.jsonl").read_text().splitlines()) == 4
    assert (output / "summary.json").is_file()
