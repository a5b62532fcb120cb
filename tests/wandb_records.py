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
import time
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
        if position + length > len(data):  # a record still being written
            break
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


def _records(run_file: str | Path) -> list:
    from wandb.proto import wandb_internal_pb2

    records = []
    for payload in _payloads(Path(run_file).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def history_rows(run_file: str | Path, *, timeout_s: float = 30.0) -> list[dict]:
    """The `history` records of a finished run file: {key: value} per logged step (keys joined with '/').

    `wandb.finish()` can return while wandb-core is still writing the file; this waits (up to
    `timeout_s`) for the run's `exit` record, which wandb-core writes last.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        records = _records(run_file)
        if any(record.WhichOneof("record_type") == "exit" for record in records):
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{run_file}: no exit record after {timeout_s:g} s (the run did not finish)")
        time.sleep(0.1)
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
             for item in record.history.item}
            for record in records if record.WhichOneof("record_type") == "history"]
