"""Digests of weight tensors: per tensor its element count, float64 sum and sum of squares, and largest |value|.

What a weight check compares (`agentrl.inference.weight_check`): the trainer's tensors as a
server would hold them (`tensor_digests`, rounded through the dtype they travel in and the
dtype of the parameter they load into), the files of an exported checkpoint (`folder_digests`),
and vLLM's parameters (`agentrl.inference.vllm_worker_ext`, through `float64_sums`). The values
of 16-bit floats and their squares are exact in float64, so digests of the same values agree
to float64 summation error whatever the order. FP8 parameters are digested as the values they stand for
(`fp8_stats`: each FP8 value times its scale), for the FP8 check of `weight_check`.

An export the servers load carries the digest of the tensors it was written from
(`DIGEST_FILE`, `write_digest` / `read_digest`). torch is imported inside the functions.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["DIGEST_FILE", "FOLDER_DTYPES", "float64_sums", "fp8_stats", "tensor_digests", "folder_digests",
           "write_digest", "read_digest"]

DIGEST_FILE = "weights-digest.json"
"""Beside an exported checkpoint that a server loads: the digest of the trainer's tensors it was written from."""

FOLDER_DTYPES = ("float32", "bfloat16", "float16")
"""What a checkpoint folder's digest covers: a server may load it into parameters of any of these dtypes."""

_CHUNK = 1 << 24  # elements per float64 chunk: 128 MiB of temporary memory at most


def float64_sums(tensor: Any, *, via: tuple[Any, ...] = ()) -> Any:
    """A float64 tensor [sum, sum of squares, largest |value|] of `tensor`'s values, each rounded through the
    dtypes `via` first (e.g. (torch.bfloat16,) for what a bf16 server holds of a float32 tensor); in chunks of
    bounded memory."""
    import torch

    flat = tensor.detach().reshape(-1)
    out = torch.zeros(3, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK]
        for dtype in via:
            part = part.to(dtype)
        _accumulate(out, part.double())
    return out


def _accumulate(out: Any, values: Any) -> None:
    """Add float64 `values` to the running [sum, sum of squares, largest |value|] `out`."""
    import torch

    if values.numel():
        out[0] += values.sum()
        out[1] += values.square().sum()
        out[2] = torch.maximum(out[2], values.abs().max())


def fp8_stats(weight: Any, scale: Any) -> Any:
    """`float64_sums` of the values an FP8 parameter stands for: `weight` (float8) times `scale`, in float32 as
    vLLM's kernels apply it, in chunks of bounded memory.

    The scale layouts of vLLM's FP8 methods: one scale (per tensor); one per row or column; one per block of
    rows and columns (128 x 128 in DeepSeek-V3's layout: a scale dimension of ceil(n / 128)); and for routed
    experts (a 3-D weight [experts, rows, columns]) any of these per expert (scale [experts, ...]). Raises
    ValueError for a scale whose shape fits none of them.
    """
    import torch

    out = torch.zeros(3, dtype=torch.float64, device=weight.device)
    if weight.dim() == 3 and scale.numel() > 1:
        if scale.shape[0] != weight.shape[0]:
            raise ValueError(f"FP8 scale of shape {list(scale.shape)} for a weight of {list(weight.shape)}")
        for expert in range(weight.shape[0]):
            _accumulate_fp8(out, weight[expert], scale[expert])
    else:
        _accumulate_fp8(out, weight, scale)
    return out


def _accumulate_fp8(out: Any, weight: Any, scale: Any) -> None:
    """Add the values of `weight` (float8, 2-D or flattened to its last dimension) times `scale` to `out`."""
    matrix = weight.reshape(-1, weight.shape[-1]) if weight.dim() != 2 else weight
    rows, cols = matrix.shape
    grid = _scale_grid(scale, rows, cols, weight_shape=list(weight.shape))
    row_block = _block(grid.shape[0], rows, what="rows", scale=scale, weight=weight)
    col_block = _block(grid.shape[1], cols, what="columns", scale=scale, weight=weight)
    expanded_cols = grid.float().repeat_interleave(col_block, dim=1)[:, :cols]
    step = max(row_block, (_CHUNK // max(cols, 1)) // row_block * row_block)  # whole row blocks per chunk
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        row_scales = expanded_cols[start // row_block:(stop - 1) // row_block + 1].repeat_interleave(row_block, dim=0)
        _accumulate(out, (matrix[start:stop].float() * row_scales[:stop - start]).double())


def _scale_grid(scale: Any, rows: int, cols: int, *, weight_shape: list[int]) -> Any:
    """`scale` as a 2-D grid over a [rows, cols] weight: [1, 1], [rows, 1], [1, cols] or [row blocks, col blocks]."""
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    if scale.dim() == 1 or (scale.dim() == 2 and 1 in scale.shape):
        flat = scale.reshape(-1)
        if flat.numel() == rows or (flat.numel() != cols and rows % flat.numel() == 0):
            return flat.reshape(-1, 1)
        if flat.numel() == cols:
            return flat.reshape(1, -1)
    if scale.dim() == 2:
        return scale
    raise ValueError(f"FP8 scale of shape {list(scale.shape)} for a weight of {weight_shape}")


def _block(count: int, size: int, *, what: str, scale: Any, weight: Any) -> int:
    """How many of a weight's `size` rows (columns) one of `count` scales covers."""
    if count == 1:
        return size
    if count == size:
        return 1
    if count == -(-size // 128):
        return 128
    if size % count == 0:
        return size // count
    raise ValueError(f"FP8 scale of shape {list(scale.shape)} does not tile the {what} of a weight of "
                     f"{list(weight.shape)}")


def tensor_digests(state: Mapping[str, Any], *, wire: Callable[[Any], Any], served: tuple[str, ...]
                   ) -> dict[str, dict[str, list[float]]]:
    """{name: {served dtype name: [numel, sum, sum of squares, largest |value|]}} of each tensor as a server
    holding it in that dtype would, after the transport sent it in `wire(tensor)`'s dtype (torch)."""
    import torch

    names = list(state)
    results: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for dtype_name in served:
        target = getattr(torch, dtype_name)
        sums = [float64_sums(state[name], via=(wire(state[name]), target)) for name in names]
        stacked = torch.stack([item.to(sums[0].device) for item in sums]).cpu() if sums else torch.zeros(0, 3)
        for name, (total, squares, largest) in zip(names, stacked.tolist()):
            results[name][dtype_name] = [float(state[name].numel()), total, squares, largest]
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
