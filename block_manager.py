"""The paged KV pool of step14_5: fixed-size blocks, ref-counted, shared between sequences.

The pool is allocated once at start-up: per layer, ``num_blocks x block_size`` K and V slots.
A block is in exactly one of three states:

* free            -- ref_count 0, no hash, in the free queue;
* cached-and-free -- ref_count 0, keeps its hash and stays in the prefix cache until its
                     memory is needed (then it is evicted, least recently used first);
* in use          -- ref_count > 0, held by that many block tables.

The hash -> block map itself is the prefix cache's (prefix_cache.py, the chapter): when a
free block that still carries a hash is popped for reuse, ``allocate`` hands it to the
``evict`` function its caller passes (the scheduler passes ``PrefixCache.evict``, which drops
the map's entry).

Nothing is lost when something fails: the block manager owns the engine's ``Journal``
(core/journal.py). Every method here keeps the blocks and the free-queue links it is about to
change, so when an engine operation raises -- at any line, a ``KeyboardInterrupt`` included --
its transaction puts every block, ref count and link back as it was.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from core.journal import Journal

import torch


@dataclass(eq=False, slots=True)
class Block:
    """One physical KV block plus the identity it carries while cached."""

    block_id: int
    ref_count: int = 0
    # Bumped on every allocation: (block_id, generation) names one lifetime of the block's
    # K/V, so a child can never be matched to a reused parent.
    generation: int = 0
    block_hash: int | None = None
    # What the hash stands for, checked on every hit so a collision can only cost a miss.
    token_bytes: bytes | None = None
    parent: tuple[int, int] | None = None  # (block_id, generation) of the block before it
    salt: str | None = None
    # Links of the free queue (None when not queued or at an end).
    prev: Block | None = None
    next: Block | None = None
    in_free_queue: bool = False

    def set_identity(self, block_hash: int, token_bytes: bytes, parent: tuple[int, int] | None,
                     salt: str | None) -> None:
        self.block_hash, self.token_bytes, self.parent, self.salt = block_hash, token_bytes, parent, salt

    def forget_identity(self) -> None:
        self.block_hash = None
        self.token_bytes = None
        self.parent = None
        self.salt = None

    @property
    def lifetime(self) -> tuple[int, int]:
        return self.block_id, self.generation

    @property
    def state(self) -> str:
        """"free", "cached" (free, but still in the prefix cache), "in use" or "in use, cached"."""
        if self.ref_count == 0:
            return "cached" if self.block_hash is not None else "free"
        return "in use, cached" if self.block_hash is not None else "in use"


class FreeBlockQueue:
    """Doubly linked list of ref-count-0 blocks: O(1) pop, push and removal from the middle.

    The front is evicted first. Blocks that carry no cached content are pushed to the
    front (they cost nothing to reuse); cached blocks go to the back (most recently used).
    """

    _journal_skip = ("journal",)

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.head: Block | None = None
        self.tail: Block | None = None
        self.size = 0

    def push_back(self, block: Block) -> None:
        self.journal.keep(self, block, self.tail)
        block.prev, block.next = self.tail, None
        if self.tail is None:
            self.head = block
        else:
            self.tail.next = block
        self.tail = block
        self._mark_added(block)

    def push_front(self, block: Block) -> None:
        self.journal.keep(self, block, self.head)
        block.prev, block.next = None, self.head
        if self.head is None:
            self.tail = block
        else:
            self.head.prev = block
        self.head = block
        self._mark_added(block)

    def remove(self, block: Block) -> None:
        self.journal.keep(self, block, block.prev, block.next)
        if block.prev is None:
            self.head = block.next
        else:
            block.prev.next = block.next
        if block.next is None:
            self.tail = block.prev
        else:
            block.next.prev = block.prev
        block.prev = block.next = None
        block.in_free_queue = False
        self.size -= 1

    def pop_front(self) -> Block:
        if self.head is None:
            raise RuntimeError("no free KV block (the scheduler must check can_allocate first)")
        block = self.head
        self.remove(block)
        return block

    def _mark_added(self, block: Block) -> None:
        block.in_free_queue = True
        self.size += 1

    def __len__(self) -> int:
        return self.size


class KVCachePool:
    """The K/V tensors: ``[num_layers, num_kv_heads, num_blocks * block_size, head_dim]`` each.

    Slot ``block_id * block_size + offset`` of each KV head holds one token's K (or V).
    Head-major, so a block's keys of one head are contiguous and the blocks the model reads
    come out ready for batched matmuls without a transposing copy. Zero-initialised so that
    masked-out slots can never inject NaN into attention. ``zeros(shape, dtype=, device=)``
    makes the storage (the fast layer passes one that puts it on huge pages).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 zeros: Callable[..., torch.Tensor] = torch.zeros) -> None:
        self.block_size = block_size
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        self.k = zeros(shape, dtype=dtype, device=device)
        self.v = zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element


class BlockManager:
    """Allocates, shares and frees blocks; LRU order of free blocks decides what is evicted."""

    def __init__(self, num_blocks: int, block_size: int, journal: Journal | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got num_blocks={num_blocks}")
        self.block_size = block_size
        self.journal = journal or Journal()
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.journal)
        for block in self.blocks:
            self.free_queue.push_back(block)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_blocks_in_use(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def can_allocate(self, num_new_blocks: int, reused: list[Block] = ()) -> bool:
        """True if ``num_new_blocks`` fresh blocks fit after taking ``reused`` cached blocks.

        A cached block that sits in the free queue leaves it when reused, so it counts too.
        """
        taken_from_free = sum(1 for block in reused if block.ref_count == 0)
        return num_new_blocks + taken_from_free <= self.num_free_blocks

    def allocate(self, evict: Callable[[Block], None] = Block.forget_identity) -> Block:
        """Pop the least recently used free block. If it still carries a cached identity,
        ``evict(block)`` drops it first (the prefix cache's entry goes with it)."""
        block = self.free_queue.pop_front()
        self.journal.keep(block)
        if block.block_hash is not None:
            evict(block)
        block.ref_count = 1
        block.generation += 1
        return block

    def share(self, block: Block) -> None:
        """Add a reference to a cached block (taking it out of the free queue if idle)."""
        self.journal.keep(block)
        if block.in_free_queue:
            self.free_queue.remove(block)
        block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference per block, tail first, so a shared head survives eviction longest.

        A block that keeps a hash goes to the back of the free queue (most recently used); one
        without goes to the front, since reusing it costs nothing.
        """
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            self.journal.keep(block)
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.push_front(block)
                else:
                    self.free_queue.push_back(block)
