"""Preemption by swapping (vLLM V0's design): a pool of KV blocks in host memory, and the block
copies one step must make before its forward pass.

A swapped-out sequence's every block is copied to host blocks of its own (shared and
prefix-cached device blocks included), then its device blocks are freed as on any preemption:
cached ones stay findable by later requests. Swapping in allocates fresh device blocks and copies
the host blocks back; the sequence's full blocks are then hashed and registered again, as if it had
just computed them. No host block is ever shared, so the host pool needs no ref counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.engine.block_counts import BlockCounts


@dataclass(slots=True)
class SwapPlan:
    """(source block, destination block) pairs. Out: device → host; in: host → device. A step's
    copies out are made before its copies in, and both before its forward pass."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in)


class HostBlockPool(BlockCounts):
    """Which host blocks are in use. Host blocks hold swapped-out sequences only."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"the host pool needs >= 0 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes the lowest

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_blocks)

    def allocate(self, num_blocks: int) -> list[int]:
        assert self.can_allocate(num_blocks), "host pool overcommitted"
        return [self.free_blocks.pop() for _ in range(num_blocks)]

    def free(self, blocks: list[int]) -> None:
        self.free_blocks.extend(reversed(blocks))
        assert len(self.free_blocks) <= self.num_blocks, "host block freed twice"
