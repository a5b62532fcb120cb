"""What a GPU test's vLLM server said of its KV cache and KV connector, for the test's failure message.

A lent GPU machine is given back a few seconds after its call, and the servers' logs with it; a test that finds
"no prompt tokens came through the connector" says why from these lines (the cache's size in tokens, the
connector's start-up, its handshake, its warnings and errors).
"""

from __future__ import annotations

import re
from pathlib import Path

WANTED = re.compile(r"KV cache|kv_cache|offload|connector|block_size|mooncake|nixl|ucx|handshake|transfer|"
                    r"WARNING|ERROR|Traceback", re.I)


def kv_connector_lines(log_path: Path, *, limit_chars: int = 6000) -> str:
    """The log's lines about the KV cache and connector, and its warnings and errors (each cut to 300 characters;
    the last `limit_chars` in all)."""
    if not log_path.exists():
        return f"(no log at {log_path})"
    lines = log_path.read_text(errors="replace").splitlines()
    return "\n".join(line[-300:] for line in lines if WANTED.search(line))[-limit_chars:]
