"""Digests of weight tensors: per tensor its element count and float64 sum and sum of squares.

What a weight check compares (`agentrl.inference.weight_check`): the trainer's tensors as a
server would hold them (`tensor_digests`, rounded through the dtype they travel in and the
dtype of the parameter they load into), the files of an exported checkpoint (`folder_digests`),
and vLLM's parameters (`agentrl.inference.vllm_worker_ext`, through `float64_sums`). The values
of 16-bit floats and their squares are exact in float64, so digests of the same values agree
to float64 summation error whatever the order.

An export the servers load carries the digest of the tensors it was written from
(`DIGEST_FILE`, `write_digest` / `read_digest`). torch is imported inside the functions.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["DIGEST_FILE", "FOLDER_DTYPES", "float64_sums", "tensor_digests", "folder_digests", "write_digest",
           "read_digest"]

DIGEST_FILE = "weights-digest.json"
"""Beside an exported checkpoint that a server loads: the digest of the trainer's tensors it was written from."""

FOLDER_DTYPES = ("float32", "bfloat16", "float16")
"""What a checkpoint folder's digest covers: a server may load it into parameters of any of these dtypes."""

_CHUNK = 1 << 24  # elements per float64 chunk: 128 MiB of temporary memory at most


def float64_sums(tensor: Any, *, via: tuple[Any, ...] = ()) -> Any:
    """A float64 tensor [sum, sum of squares] of `tensor`'s values, each rounded through the dtypes `via` first
    (e.g. (torch.bfloat16,) for what a bf16 server holds of a float32 tensor); in chunks of bounded memory."""
    import torch

    flat = tensor.detach().reshape(-1)
    out = torch.zeros(2, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK]
        for dtype in via:
            part = part.to(dtype)
        part = part.double()
        out[0] += part.sum()
        out[1] += part.square().sum()
    return out


def tensor_digests(state: Mapping[str, Any], *, wire: Callable[[Any], Any], served: tuple[str, ...]
                   ) -> dict[str, dict[str, list[float]]]:
    """{name: {served dtype name: [numel, sum, sum of squares]}} of each tensor as a server holding it in that
    dtype would, after the transport sent it in `wire(tensor)`'s dtype (torch)."""
    import torch

    names = list(state)
    results: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for dtype_name in served:
        target = getattr(torch, dtype_name)
        sums = [float64_sums(state[name], via=(wire(state[name]), target)) for name in names]
        stacked = torch.stack([item.to(sums[0].device) for item in sums]).cpu() if sums else torch.zeros(0, 2)
        for name, (total, squares) in zip(names, stacked.tolist()):
            results[name][dtype_name] = [float(state[name].numel()), total, squares]
    return results


def folder_digests(folder: Path, *, served: tuple[str, ...]) -> dict[str, dict[str, list[float]]]:
    """`tensor_digests` of a safetensors checkpoint folder, as written (torch, CPU)."""
    from safetensors import safe_open

    state = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                state[name] = handle.get_tensor(name)
    return tensor_digests(state, wire=lambda tensor: tensor.dtype, served=served)


def write_digest(folder: Path, digests: Mapping[str, Any]) -> None:
    """Put the digest beside an export (`DIGEST_FILE`)."""
    (Path(folder) / DIGEST_FILE).write_text(json.dumps(digests))


def read_digest(folder: Path) -> dict[str, dict[str, list[float]]] | None:
    """The digest beside an export, None when it has none."""
    path = Path(folder) / DIGEST_FILE
    return json.loads(path.read_text()) if path.is_file() else None
