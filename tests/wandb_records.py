"""Read a W&B run file (`run-<id>.wandb`, what an offline run writes) back into its history rows.

No reader ships in the Python `wandb` package (wandb-core, in Go, writes and syncs the file).
The format is LevelDB's log format: a 7-byte file header (`:W&B`, magic 0xBEE1, version),
then 32 KiB blocks of records, each with a 7-byte header (CRC32, little-endian length,
type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4), a block's tail under 7 bytes left as padding;
a record's payload is a `wandb_internal_pb2.Record` protobuf (wandb's own definition).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def _payloads(data: bytes) -> list[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file (no :W&B header)")
    payloads, pending, position = [], b"", HEADER
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < HEADER:
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position: position + HEADER])
        position += HEADER
        if kind == 0 and length == 0:  # zero padding to the block's end
            position += left - HEADER
            continue
        chunk = data[position: position + length]
        position += length
        if kind == 1:
            payloads.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            payloads.append(pending + chunk)
    return payloads


def history_rows(run_file: str | Path) -> list[dict]:
    """The `history` records of a run file: {key: value} per logged step (keys joined with '/')."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for payload in _payloads(Path(run_file).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
