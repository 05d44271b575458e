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

The block manager owns every block's fields and the free queue's order. They live in one
column per field (``BlockColumns``; a ``Block`` is a handle onto its row). ``snapshot()`` copies
a column only when it is first written while the snapshot is held (most decode steps write
none: the pool changes when a block fills or frees), and ``restore()`` puts those copies back:
the engine core calls the pair around each operation (core/atomic.py), and nothing else here
needs to know.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

FIELDS = ("ref_count", "generation", "block_hash", "token_bytes", "parent", "salt",
          "prev_id", "next_id", "in_free_queue")
DEFAULTS = (0, 0, None, None, None, None, None, None, False)


class ColumnCopies:
    """A snapshot of the columns: ``columns[name]``, the column as it was, for each column
    written since it was taken."""

    __slots__ = ("columns", "__weakref__")

    def __init__(self) -> None:
        self.columns: dict[str, list] = {}


class BlockColumns:
    """Every block's fields, one list per field, indexed by block id."""

    def __init__(self, num_blocks: int) -> None:
        for name, default in zip(FIELDS, DEFAULTS):
            setattr(self, name, [default] * num_blocks)
        self._held: weakref.WeakSet[ColumnCopies] = weakref.WeakSet()  # snapshots still held

    def snapshot(self) -> ColumnCopies:
        copies = ColumnCopies()
        self._held.add(copies)
        return copies

    def write(self, name: str, block_id: int, value) -> None:
        """One field of one block; each held snapshot first copies a column it has not yet."""
        column = getattr(self, name)
        for copies in self._held:
            if name not in copies.columns:
                copies.columns[name] = column.copy()
        column[block_id] = value

    def put_back(self, copies: ColumnCopies) -> None:
        for name, values in copies.columns.items():
            getattr(self, name)[:] = values  # the same lists: Block handles keep reading them


def _column(name: str, doc: str) -> property:
    def get(block: Block):
        return getattr(block.columns, name)[block.block_id]

    def set_(block: Block, value) -> None:
        block.columns.write(name, block.block_id, value)

    return property(get, set_, doc=doc)


class Block:
    """One physical KV block plus the identity it carries while cached (a handle onto the
    block manager's columns: one ``Block`` per block id, for the pool's whole life)."""

    __slots__ = ("columns", "block_id", "_blocks")

    def __init__(self, columns: BlockColumns, block_id: int, blocks: list[Block]) -> None:
        self.columns, self.block_id, self._blocks = columns, block_id, blocks

    ref_count = _column("ref_count", "How many block tables hold the block.")
    generation = _column("generation", "Bumped on every allocation: (block_id, generation) names "
                         "one lifetime of its K/V, so a child is never matched to a reused parent.")
    block_hash = _column("block_hash", "The chain hash it is cached under (None: not cached).")
    token_bytes = _column("token_bytes", "What the hash stands for, checked on every hit, so a "
                          "collision can only cost a miss.")
    parent = _column("parent", "(block_id, generation) of the block before it.")
    salt = _column("salt", "The cache_salt of the request that saved it.")
    prev_id = _column("prev_id", "The free queue's link to the front (None at the end).")
    next_id = _column("next_id", "The free queue's link to the back (None at the end).")
    in_free_queue = _column("in_free_queue", "True while its ref count is 0.")

    @property
    def prev(self) -> Block | None:
        return None if self.prev_id is None else self._blocks[self.prev_id]

    @property
    def next(self) -> Block | None:
        return None if self.next_id is None else self._blocks[self.next_id]

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

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref_count={self.ref_count}, block_hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of ref-count-0 blocks: O(1) pop, push and removal from the middle.

    The front is evicted first. Blocks that carry no cached content are pushed to the
    front (they cost nothing to reuse); cached blocks go to the back (most recently used).
    The links are the blocks' ``prev_id`` / ``next_id``.
    """

    def __init__(self, blocks: list[Block]) -> None:
        self.blocks = blocks
        self.head_id: int | None = None
        self.tail_id: int | None = None
        self.size = 0

    @property
    def head(self) -> Block | None:
        return None if self.head_id is None else self.blocks[self.head_id]

    @property
    def tail(self) -> Block | None:
        return None if self.tail_id is None else self.blocks[self.tail_id]

    def push_back(self, block: Block) -> None:
        block.prev_id, block.next_id = self.tail_id, None
        if self.tail_id is None:
            self.head_id = block.block_id
        else:
            self.tail.next_id = block.block_id
        self.tail_id = block.block_id
        self._mark_added(block)

    def push_front(self, block: Block) -> None:
        block.prev_id, block.next_id = None, self.head_id
        if self.head_id is None:
            self.tail_id = block.block_id
        else:
            self.head.prev_id = block.block_id
        self.head_id = block.block_id
        self._mark_added(block)

    def remove(self, block: Block) -> None:
        prev, next_ = block.prev, block.next
        if prev is None:
            self.head_id = block.next_id
        else:
            prev.next_id = block.next_id
        if next_ is None:
            self.tail_id = block.prev_id
        else:
            next_.prev_id = block.prev_id
        block.prev_id = block.next_id = None
        block.in_free_queue = False
        self.size -= 1

    def pop_front(self) -> Block:
        if self.head_id is None:
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
        self.columns = BlockColumns(num_blocks)
        self.blocks: list[Block] = []
        self.blocks.extend(Block(self.columns, i, self.blocks) for i in range(num_blocks))
        self.free_queue = FreeBlockQueue(self.blocks)
        for block in self.blocks:
            self.free_queue.push_back(block)

    def snapshot(self) -> tuple:
        """Every block's fields and the free queue's ends, to ``restore`` after a failure."""
        fq = self.free_queue
        return self.columns.snapshot(), fq.head_id, fq.tail_id, fq.size

    def restore(self, saved: tuple) -> None:
        columns, head, tail, size = saved
        self.columns.put_back(columns)
        self.free_queue.head_id, self.free_queue.tail_id, self.free_queue.size = head, tail, size

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
        if block.block_hash is not None:
            evict(block)
        block.ref_count = 1
        block.generation += 1
        return block

    def share(self, block: Block) -> None:
        """Add a reference to a cached block (taking it out of the free queue if idle)."""
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
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.push_front(block)
                else:
                    self.free_queue.push_back(block)
