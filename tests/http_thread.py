"""A standard-library HTTP server run in a thread for the length of a `with` block.

Tests that stand in for a remote party which cannot be made to misbehave on demand (a model server answering with
hostile bytes, one that refuses every request, an echoing peer) serve it on 127.0.0.1 with `serving`, which stops
the server and joins its thread even when the test fails.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from socketserver import BaseServer


@contextmanager
def serving(server: BaseServer) -> Iterator[BaseServer]:
    """Serve `server` (already bound) from a daemon thread; shut it down, close it and join the thread on exit."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
