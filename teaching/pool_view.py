"""The KV pool drawn as text (``python run.py --show-blocks``): each sequence's block table,
the blocks shared between sequences, a map of the pool by block state, the cached blocks with
their chain hashes, and what twin folding does to a block table."""
from __future__ import annotations

from collections import Counter

from engine import LLM


def draw_pool(llm: LLM, title: str, events: Counter | None = None) -> str:
    """The KV pool as a learner wants to see it: block tables, sharing, cached hashes, waiting.
    ``events``: the engine's prefix-cache events by kind so far (``count_events``), if counted."""
    bm, lines, owners = llm.block_manager, [], {}
    lines.append(f"\n=== KV pool {title}: {bm.num_blocks} blocks of {llm.block_size} tokens ===")
    lines.append("  (N/M tokens computed: N of the sequence's M tokens so far have K/V in the pool; "
                 "blocks: its block table)")
    for seq in llm.scheduler.running:
        for b in seq.block_table:
            owners.setdefault(b, []).append(seq.request_id)
        lines.append(f"  seq {seq.request_id:>3s}: {seq.num_computed_tokens:>4d}/{seq.num_tokens:<4d} tokens "
                     f"computed, blocks {_ranges(seq.block_table)}")
    waiting = [int(s.request_id) for s in llm.scheduler.waiting]
    lines.append(f"  waiting: {len(waiting)}" + (f", seqs {_ranges(waiting)}" if waiting else ""))
    shared = {b: o for b, o in owners.items() if len(o) > 1}
    by_owners: dict[tuple, list[int]] = {}
    for block_id, seqs in shared.items():
        by_owners.setdefault(tuple(seqs), []).append(block_id)
    lines.append(f"  shared blocks: {len(shared)}" + "".join(
        f"\n    blocks {_ranges(sorted(ids))} shared by seqs {', '.join(seqs)}" for seqs, ids in by_owners.items()))
    return "\n".join(lines + _pool_map(llm, shared) + _cached_hashes(llm) + _twin_note(events))


def count_events(llm: LLM) -> Counter:
    """A live count of the engine's prefix-cache events by kind (subscribed for its lifetime)."""
    counts: Counter = Counter()
    llm.prefix_cache.subscribe(lambda event: counts.update((event.kind,)))
    return counts


def _twin_note(events: Counter | None) -> list[str]:
    """Why a block table can change between steps with no new block: twin folding."""
    so_far = "" if events is None else f" ({events['twin']} so far in this engine)"
    return ["  Blocks [a-b c] are pool block ids. Twin folding" + so_far + ":\n  when two sequences fill "
            "identical blocks, the later one switches to the block cached first and\n  frees its own "
            "copy, so a table like [0-31 58] can become [0-32] between steps with no block added."]


def _pool_map(llm: LLM, shared: dict) -> list[str]:
    symbol = {"free": ".", "cached": "c", "in use": "U", "in use, cached": "U"}
    cells = ["S" if b.block_id in shared else symbol[b.state] for b in llm.block_manager.blocks]
    lines = ["  map (S shared, U in use by one, c cached-and-free, . free):"]
    last = max((i for i, c in enumerate(cells) if c != "."), default=0)
    lines += [f"    {i:>5d} {''.join(cells[i:i + 64])}" for i in range(0, last + 1, 64)]
    if last + 64 < len(cells):
        lines.append(f"    ... blocks {(last // 64 + 1) * 64}-{len(cells) - 1} are all free")
    lines.append(f"  cached-and-free: {cells.count('c')}, free: {cells.count('.')}, "
                 f"evicted so far: {llm.stats()['evictions']}")
    return lines


def _cached_hashes(llm: LLM, limit: int = 40) -> list[str]:
    """Each cached block with the first 6 hex digits of its chain hash (the prefix it names)."""
    cached = [b for b in llm.block_manager.blocks if b.block_hash is not None]
    cells = [f"{b.block_id:>4d}:{b.block_hash:016x}"[:11] for b in cached[:limit]]
    lines = [f"  cached blocks, block id:hash ({len(cached)} in the prefix cache):"]
    lines += ["    " + "  ".join(cells[i:i + 8]) for i in range(0, len(cells), 8)]
    if len(cached) > limit:
        lines.append(f"    ... and {len(cached) - limit} more")
    return lines


def _ranges(ids: list[int]) -> str:
    parts, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            parts.append(str(ids[start]) if start == i - 1 else f"{ids[start]}-{ids[i - 1]}")
            start = i
    return "[" + " ".join(parts) + "]"
