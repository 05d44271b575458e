"""The paged KV pool of step14_5: fixed-size blocks, ref-counted, shared between sequences.

The pool is allocated once at start-up: per layer, ``num_blocks x block_size`` K and V slots.
A block is in exactly one of three states:

* free            -- ref_count 0, no hash, in the free queue;
* cached-and-free -- ref_count 0, keeps its hash and stays in the prefix cache until its
                     memory is needed (then it is evicted, least recently used first);
* in use          -- ref_count > 0, held by that many block tables.

The hash -> block map itself is the prefix cache's (prefix_cache.py, the chapter). A step
does not take blocks as it plans: ``Reservation`` picks the blocks a plan will take (fresh ones
from the free queue's front, cached ones it shares) without taking them, and the step's commit
takes them (``take``, ``share``). A plan that is dropped (its forward raised) leaves the pool
as it was.
"""
from __future__ import annotations

from typing import Callable

import torch


class Block:
    """One physical KV block plus the identity it carries while cached."""

    __slots__ = ("block_id", "ref_count", "generation", "block_hash", "token_bytes", "parent", "salt",
                 "prev", "next", "in_free_queue")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0   # how many block tables hold it
        # Bumped on every allocation: (block_id, generation) names one lifetime of its K/V, so
        # a child is never matched to a reused parent.
        self.generation = 0
        self.block_hash: int | None = None    # the chain hash it is cached under (None: not cached)
        self.token_bytes: bytes | None = None  # what the hash stands for, checked on every hit
        self.parent: tuple[int, int] | None = None  # (block_id, generation) of the block before it
        self.salt: str | None = None          # the cache_salt of the request that saved it
        self.prev: Block | None = None        # the free queue's links (None at its ends)
        self.next: Block | None = None
        self.in_free_queue = False

    def set_identity(self, block_hash: int, token_bytes: bytes, parent: tuple[int, int] | None,
                     salt: str | None) -> None:
        self.block_hash, self.token_bytes, self.parent, self.salt = block_hash, token_bytes, parent, salt

    def forget_identity(self) -> None:
        self.block_hash = self.token_bytes = self.parent = self.salt = None

    @property
    def lifetime(self) -> tuple[int, int]:
        return self.block_id, self.generation

    @property
    def state(self) -> str:
        """"free", "cached" (free, but still in the prefix cache), "in use" or "in use, cached"."""
        if self.ref_count == 0:
            return "cached" if self.block_hash is not None else "free"
        return "in use, cached" if self.block_hash is not None else "in use"

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref_count={self.ref_count}, block_hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of ref-count-0 blocks: O(1) pop, push and removal from the middle.

    The front is evicted first. Blocks that carry no cached content are pushed to the
    front (they cost nothing to reuse); cached blocks go to the back (most recently used).
    The links are the blocks' ``prev`` / ``next``.
    """

    def __init__(self) -> None:
        self.head: Block | None = None
        self.tail: Block | None = None
        self.size = 0

    def push_back(self, block: Block) -> None:
        block.prev, block.next = self.tail, None
        if self.tail is None:
            self.head = block
        else:
            self.tail.next = block
        self.tail = block
        self._mark_added(block)

    def push_front(self, block: Block) -> None:
        block.prev, block.next = None, self.head
        if self.head is None:
            self.tail = block
        else:
            self.head.prev = block
        self.head = block
        self._mark_added(block)

    def remove(self, block: Block) -> None:
        prev, next_ = block.prev, block.next
        if prev is None:
            self.head = next_
        else:
            prev.next = next_
        if next_ is None:
            self.tail = prev
        else:
            next_.prev = prev
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

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got num_blocks={num_blocks}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue()
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

    def allocate(self) -> Block:
        """Take the least recently used free block. One that is still cached must leave the
        prefix cache first (``PrefixCache.evict``): the pool never reaches up into the cache."""
        block = self.free_queue.head
        if block is None:
            raise RuntimeError("no free KV block (the scheduler must check can_allocate first)")
        if block.block_hash is not None:
            raise RuntimeError(f"KV block {block.block_id} is still cached: evict it from the prefix cache first")
        return self.take(block)

    def take(self, block: Block) -> Block:
        """Take a free block that carries no identity (a reservation chose it): a new lifetime."""
        self.free_queue.remove(block)
        block.ref_count = 1
        block.generation += 1
        return block

    def retain(self, block: Block) -> None:
        """One more block table holds a cached block (taking it out of the free queue if idle)."""
        if block.in_free_queue:
            self.free_queue.remove(block)
        block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """One block table fewer holds each block (step14_6's ``release``), tail first, so a
        shared head survives eviction longest.

        A block that keeps a hash goes to the back of the free queue (most recently used); one
        without goes to the front, since reusing it costs nothing.
        """
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.push_front(block)
                else:
                    self.free_queue.push_back(block)


class Reservation:
    """The blocks one step's plan will take, chosen without taking them: fresh blocks in the
    free queue's order from its front, past those already chosen, and the idle cached blocks
    it will share. The step's commit takes them; a plan that is dropped changes nothing here."""

    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager
        self.held: set[int] = set()  # ids of free blocks the plan takes (fresh or shared)
        self._cursor = manager.free_queue.head  # every free block before it is held

    @property
    def num_free(self) -> int:
        return self.manager.num_free_blocks - len(self.held)

    def can_take(self, num_fresh: int, shared: list[Block]) -> bool:
        from_free = sum(1 for b in shared if b.ref_count == 0 and b.block_id not in self.held)
        return num_fresh + from_free <= self.num_free

    def share(self, block: Block) -> None:
        if block.ref_count == 0:
            self.held.add(block.block_id)

    def next_fresh(self) -> Block:
        """The least recently used free block not yet held (it may still carry a hash)."""
        block = self._cursor
        while block is not None and block.block_id in self.held:
            block = block.next
        if block is None:
            raise RuntimeError("no free KV block (the scheduler must check can_take first)")
        self._cursor = block.next
        self.held.add(block.block_id)
        return block

    def rewind(self) -> None:
        """Blocks were freed into the queue (a preemption): look from its front again."""
        self._cursor = self.manager.free_queue.head
