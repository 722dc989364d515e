"""Used / free counts of a pool of KV blocks, shared by the device pool (engine/block_manager.py)
and the host pool (engine/swap.py). Its own module so that the host pool's swap plans, which the
model runner executes, do not pull in the block manager and the live sequences it manages."""

from __future__ import annotations


class BlockCounts:
    """Used / free counts of a pool with `num_blocks` blocks and a `free_blocks` collection (the
    device pool of engine/block_manager.py, the host pool of engine/swap.py)."""

    num_blocks: int
    free_blocks: object

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0
