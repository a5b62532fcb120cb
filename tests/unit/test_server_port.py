"""A vLLM server asked for a port that something already listens on is refused at once, in one line.

Before, it started anyway, could not bind, and the other listener's `/health` answered for it: `agentrl serve
--port P` printed "ready in 0.1s" for a server that was not its own (seen with a second `agentrl serve`).
"""

from __future__ import annotations

import socket

import pytest

from agentrl.inference.server import ServerStartupError, VLLMServer, port_taken


def test_a_taken_port_is_refused_before_anything_starts(tmp_path):
    pytest.importorskip("vllm")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert port_taken("127.0.0.1", port)
        server = VLLMServer("tiny-moe", port=port, log_path=tmp_path / "vllm.log")
        with pytest.raises(ServerStartupError, match=f"port {port} on 127.0.0.1 is in use") as info:
            server.start()
        assert "\n" not in str(info.value)
        assert server.process is None and not (tmp_path / "vllm.log").exists()
    assert not port_taken("127.0.0.1", port)
