"""The Mooncake master as agentrl manages it (`inference/mooncake_master.py`), with the real `mooncake_master`.

The master starts bound to 127.0.0.1; the client configuration agentrl writes is read by vLLM's own
`MooncakeStoreConfig.load_from_config` (through `$MOONCAKE_CONFIG_PATH`, as the connector reads it), and a store
client set up from it over TCP puts and gets a megabyte through the master. The client runs in a subprocess:
Mooncake's transfer engine listens for peers on every interface, and those sockets end with it. Stopping ends the
master's process and frees its port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.inference.mooncake_master import (
    MooncakeMaster,
    MooncakeMasterError,
    store_for_server,
    write_client_config,
)

pytestmark = pytest.mark.integration
pytest.importorskip("mooncake.store", reason="the mooncake-transfer-engine wheel (scripts/install.sh) is not here")

CLIENT = r"""
import os, sys
from vllm.distributed.mooncake_store import MooncakeStoreConfig
from mooncake.store import MooncakeDistributedStore

config = MooncakeStoreConfig.load_from_config()
store = MooncakeDistributedStore()
code = store.setup("127.0.0.1", config.metadata_server, config.global_segment_size, config.local_buffer_size,
                   config.protocol, config.device_name, config.master_server_address)
assert code == 0, f"setup returned {code}"
value = os.urandom(1 << 20)
assert store.put("agentrl-block", value) == 0
assert store.get("agentrl-block") == value
assert store.is_exist("agentrl-block") == 1
store.close()
print("round trip ok", config.protocol, config.master_server_address)
"""


def _listening(pid: int) -> set[str]:
    import psutil

    return {connection.laddr.ip for connection in psutil.Process(pid).net_connections(kind="tcp")
            if connection.status == psutil.CONN_LISTEN}


def test_the_master_serves_a_store_client_configured_as_vllm_reads_it(tmp_path):
    pytest.importorskip("vllm.distributed.mooncake_store")
    server_env: dict[str, str] = {}  # as the loop's inference actor and bench/inference_features.py set one up
    folder = tmp_path / "not-made-yet"  # the master makes its folder (the bench's first run on an H100 did not)
    with store_for_server(server_env, folder, gib=1 / 16) as master:
        pid, port = master.process.pid, master.port
        assert _listening(pid) == {"127.0.0.1"}, _listening(pid)
        config = Path(server_env["MOONCAKE_CONFIG_PATH"])
        assert json.loads(config.read_text())["protocol"] == "tcp"
        assert json.loads(config.read_text())["global_segment_size"] == 64 * 2**20
        assert (folder / "mooncake_master.log").is_file()
        result = subprocess.run([sys.executable, "-c", CLIENT], env={**os.environ, **server_env},
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, (result.stdout + result.stderr)[-2000:]
        assert f"round trip ok tcp {master.address}" in result.stdout
    assert master.process is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_a_taken_port_and_bad_sizes_are_refused_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(MooncakeMasterError, match="already listens") as info:
            MooncakeMaster(port=taken.getsockname()[1]).start()
    assert "\n" not in str(info.value)
    with pytest.raises(MooncakeMasterError, match="must be > 0"):
        write_client_config(tmp_path / "c.json", master_address="127.0.0.1:1", global_segment_bytes=0)
    with pytest.raises(MooncakeMasterError, match="kv_offload_gb must be > 0") as info:
        store_for_server({}, tmp_path, gib=0)
    assert "\n" not in str(info.value)
