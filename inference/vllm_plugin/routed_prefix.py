"""Routed experts of prefix-cached tokens, stitched from the request that computed them (agentrl's vLLM plugin).

A token whose KV comes from vLLM's prefix cache is never forwarded again, so no router runs
for it and the recorder has no row for it. Its routing is the routing of the request that
computed that cache block: the same tokens from the start of the sequence through the block
(what the block hash covers) and the same weights (vLLM resets the prefix cache when weights
change). `CachedBlockRows` keeps, per full block hash, the rows recorded when the block was
computed, in least-recently-used order, bounded by the KV cache's block count (a block vLLM
still holds was registered at most that many blocks ago); a request that starts with a cache
hit of H tokens gets rows 0..H from them. A block it cannot find (evicted here first) gives
rows of -1, unknown, which Router Replay routes live; `missed` counts them.

`reset` (vLLM's prefix-cache reset: a weight update) forgets every block, and the rows running
requests still record after it are not registered: after a reset vLLM recomputes them with the
new weights, while a request keeps the rows its tokens were first sampled with.

Rows are numpy arrays (tokens, layers, top_k), or (tokens, layers, top_k, 2) float32 ids and gate
weights; unknown rows are -1 (ids) and NaN (weights). Standard library and numpy only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

__all__ = ["CachedBlockRows", "unknown_rows"]


def unknown_rows(count: int, like: np.ndarray) -> np.ndarray:
    """`count` rows shaped like `like`'s, marked unknown: -1 ids (int16 for integer rows), NaN gate weights."""
    if like.dtype.kind == "f":
        rows = np.full((count, *like.shape[1:]), -1.0, dtype=like.dtype)
        if rows.ndim == 4:
            rows[..., 1] = np.nan
        return rows
    return np.full((count, *like.shape[1:]), -1, dtype=np.int16)


class CachedBlockRows:
    """Rows of the full blocks computed so far, by block hash (see the module docstring)."""

    def __init__(self, *, block_size: int, max_blocks: int) -> None:
        self.block_size = block_size
        self.max_blocks = max(1, max_blocks)
        self._blocks: OrderedDict[Any, np.ndarray] = OrderedDict()
        self.stitched = 0
        """Blocks whose rows were handed to a request that hit them in the prefix cache."""
        self.missed = 0
        """Cache-hit blocks whose rows were no longer held (given as unknown)."""

    def __len__(self) -> int:
        return len(self._blocks)

    def register(self, block_hashes: list[Any], rows: np.ndarray, *, first_block: int) -> int:
        """Keep the rows of blocks `first_block`.. that `rows` (the request's rows from token 0) cover in full and
        whose every row is known; returns the index after the last block covered."""
        covered = min(len(block_hashes), len(rows) // self.block_size)
        for index in range(first_block, covered):
            block = rows[index * self.block_size: (index + 1) * self.block_size]
            known = block[..., 0] if block.ndim == 4 else block
            if (known < 0).any():
                continue
            self.put(block_hashes[index], block)
        return max(first_block, covered)

    def put(self, key: Any, block: np.ndarray) -> None:
        """Keep one full block's rows (copied) under its hash, the least recently used dropped past the bound."""
        self._blocks[key] = block.copy()
        self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def lookup(self, block_hashes: list[Any], tokens: int, *, like: np.ndarray) -> np.ndarray:
        """Rows for the first `tokens` tokens of a request that did not compute them (prefix-cache hits, blocks a
        KV connector loaded). `tokens` may end inside a block: vLLM recomputes the last token of a prompt whose
        every block it has, so it schedules such a prompt with all but one token computed; the part of that block
        comes from the block's rows when its hash (a full block's) is kept, and is unknown otherwise."""
        out = unknown_rows(tokens, like)
        needed = -(-tokens // self.block_size)
        blocks = min(needed, len(block_hashes))
        for index in range(blocks):
            block = self._blocks.get(block_hashes[index])
            if block is None or block.shape[1:] != like.shape[1:]:
                self.missed += 1
                continue
            self._blocks.move_to_end(block_hashes[index])
            first = index * self.block_size
            out[first: min(first + self.block_size, tokens)] = block[: tokens - first]
            self.stitched += 1
        self.missed += needed - blocks  # past the last hash: blocks with no hash yet
        return out

    def clear(self) -> None:
        self._blocks.clear()
