"""Poke at one Sequence: ``python -m teaching.poke``.

Builds one ``Sequence`` of 10 tokens, looks it up twice in a ``PrefixCache`` (blocks of 4, no
model needed: a lookup only hashes and probes the map), and prints its chain and the hash
counter after each lookup, under both strategies. The same session at the REPL::

    >>> from block_manager import BlockManager
    >>> from prefix_cache import PrefixCache
    >>> from scheduler import Sequence
    >>> cache = PrefixCache(BlockManager(8, 4), "incremental")   # or "recompute"
    >>> seq = Sequence(list(range(10)))       # 10 tokens: 2 full blocks + 2 tokens
    >>> match = cache.lookup(seq)             # cold: hashes blocks 0 and 1
    >>> [f"{h:016x}" for h in seq._block_hashes], cache.hash_computations
    >>> match = cache.lookup(seq)             # again: incremental reads seq._block_hashes (0 calls);
    >>> cache.hash_computations               # recompute rebuilds the chain (2 more calls)

``match.chain`` is the chain the lookup used; under recompute ``seq._block_hashes`` stays
empty, because the "before" keeps no chain on the Sequence.
"""
from __future__ import annotations

import argparse

from block_manager import BlockManager
from prefix_cache import PrefixCache
from scheduler import Sequence
from teaching.chapter_table import COLUMN_NAMES, STRATEGIES


def poke(strategy: str, tokens: list[int], block_size: int) -> list[tuple[list[int], list[int], int]]:
    """Look one Sequence up twice; per lookup: the chain it used, the chain the Sequence
    keeps, and the hash counter after it."""
    cache = PrefixCache(BlockManager(len(tokens) // block_size + 2, block_size), strategy)
    seq = Sequence(tokens)
    seen = []
    for _ in range(2):
        match = cache.lookup(seq)
        seen.append((list(match.chain), list(seq._block_hashes), cache.hash_computations))
    return seen


def hexes(hashes: list[int]) -> str:
    return "[" + ", ".join(f"{h:016x}" for h in hashes) + "]"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Look one Sequence up twice under both strategies.")
    p.add_argument("--tokens", type=int, default=10, help="prompt length (token ids 0, 1, 2, ...)")
    p.add_argument("--block-size", type=int, default=4, help="tokens per block")
    args = p.parse_args(argv)
    tokens = list(range(args.tokens))
    print(f"One Sequence of {args.tokens} tokens, blocks of {args.block_size}: "
          f"{args.tokens // args.block_size} full blocks. Looked up twice.")
    for strategy in STRATEGIES:
        print(f"\n{COLUMN_NAMES[strategy]}: PrefixCache(..., {strategy!r})")
        for n, (chain, kept, counter) in enumerate(poke(strategy, tokens, args.block_size), 1):
            print(f"  lookup {n}: {'chain the lookup used':24s} {hexes(chain)}\n"
                  f"            {'seq._block_hashes':24s} {hexes(kept)}\n"
                  f"            {'cache.hash_computations':24s} {counter}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
