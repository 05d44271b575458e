"""Block accounting of the paged KV pool and its prefix cache, checked from the outside.

``check_accounting(llm)`` can be called between any two engine steps (also after a step that
raised). It recomputes everything from the block tables of the scheduler's sequences and the
block manager's own structures, and raises ``AssertionError`` naming the first broken rule:

* every block is exactly one of
    free             -- ref 0, no hash, in the free queue;
    cached-and-free  -- ref 0, has a hash, in the free queue, registered in the prefix cache;
    in use           -- ref > 0, not in the free queue;
* a block's ref count equals the number of running sequences' block tables holding it
  (a waiting sequence holds no block, and no table holds a block twice);
* the free queue is a well-formed doubly linked list whose size, flags and members agree;
* every prefix-cache entry ``h -> block`` names the block's own hash, its stored token bytes
  are one block of tokens, and ``h`` is the chain hash of those bytes seeded with the parent's
  hash (the salt's root hash for a first block) -- so the entry names exactly one token
  prefix; its parent is itself a registered cached block (or a block in use);
* every full block a running sequence has computed is registered (prefix caching on) and
  holds that sequence's tokens under that sequence's chain hash, with the sequence's previous
  block as parent; with prefix caching off no block carries a hash;
* a running sequence has at least one token left to compute (its last one), so the scheduler
  can always give it a chunk;
* the engine's request map holds exactly the queued and running sequences.

``assert_idle(llm)`` additionally checks that nothing is in use and nothing is queued.

``FaultInjector`` makes one engine step raise (in the model forward, before or after it wrote
K/V, or in sampling); ``snapshot`` / ``assert_nothing_committed`` check that the failed step
changed nothing a step commits.
"""
from __future__ import annotations

__all__ = ["check_accounting", "assert_idle", "FaultInjector", "FAULT_KINDS", "InjectedFault",
           "snapshot", "assert_nothing_committed"]


def _registered_requests(llm) -> dict:
    """The engine's request table (request id -> record); a leaked entry is a leaked request."""
    return engine_core(llm).output_processor.requests


def engine_core(llm):
    """The ``EngineCore`` behind an ``LLM``, an ``LLMEngine``, or the core itself."""
    llm = getattr(llm, "llm_engine", llm)
    return getattr(llm, "engine_core", llm)


def _free_queue_members(fq, num_blocks: int) -> list:
    members, prev, seen = [], None, set()
    block = fq.head
    while block is not None:
        assert id(block) not in seen, f"free queue has a cycle at block {block.block_id}"
        seen.add(id(block))
        assert block.prev is prev, (f"free queue link broken: block {block.block_id}.prev is "
                                    f"{getattr(block.prev, 'block_id', None)}, expected "
                                    f"{getattr(prev, 'block_id', None)}")
        members.append(block)
        assert len(members) <= num_blocks, "free queue longer than the pool"
        prev, block = block, block.next
    assert fq.tail is prev, (f"free queue tail is {getattr(fq.tail, 'block_id', None)}, "
                             f"last linked block is {getattr(prev, 'block_id', None)}")
    assert len(fq) == len(members), f"free queue size {len(fq)} != {len(members)} linked blocks"
    return members


def check_accounting(llm) -> None:
    """Every rule of the module docstring; raises AssertionError naming the first broken one.
    ``llm``: an ``LLM``, an ``LLMEngine`` or an ``EngineCore``."""
    llm = engine_core(llm)
    bm, pc = llm.block_manager, llm.prefix_cache
    cached = pc.entries if pc is not None else {}
    n = len(bm.blocks)
    slots = llm.model_runner.kv_cache.k.shape[2]
    assert n * bm.block_size == slots, f"block manager has {n} blocks, the KV pool {slots} slots"
    for i, block in enumerate(bm.blocks):
        assert block.block_id == i, f"blocks[{i}] has block_id {block.block_id}"
    members = _check_free_queue(bm)
    running, waiting = _check_queues(llm)
    holders = _check_block_tables(llm, running, waiting)
    _check_block_states(bm.blocks, holders, cached)
    _check_cache_entries(llm, cached)
    _check_running_chains(llm, running, cached)
    _check_stats(llm, members, cached)


def _check_free_queue(bm) -> list:
    """The free queue is well formed and agrees with every block's flag and links."""
    members = _free_queue_members(bm.free_queue, len(bm.blocks))
    in_queue = {b.block_id for b in members}
    assert len(in_queue) == len(members), "a block is linked into the free queue twice"
    for block in bm.blocks:
        assert block.in_free_queue == (block.block_id in in_queue), (
            f"block {block.block_id}: in_free_queue={block.in_free_queue} but "
            f"{'is' if block.block_id in in_queue else 'is not'} linked in the free queue")
        if not block.in_free_queue:
            assert block.prev is None and block.next is None, (
                f"block {block.block_id} is not queued but keeps free-queue links")
    return members


def _check_queues(llm) -> tuple[list, list]:
    """Each sequence is in one queue once; the engine's request map holds exactly them."""
    sched = llm.scheduler
    running, waiting = list(sched.running), list(sched.waiting)
    run_ids, wait_ids = {id(s) for s in running}, {id(s) for s in waiting}
    assert len(run_ids) == len(running), "a sequence is in the running list twice"
    assert len(wait_ids) == len(waiting), "a sequence is in the waiting queue twice"
    assert not run_ids & wait_ids, "a sequence is both running and waiting"
    assert len(running) <= sched.config.max_num_seqs, (
        f"{len(running)} running sequences > max_num_seqs {sched.config.max_num_seqs}")
    queued = {id(s) for s in running + waiting}
    registered = [seq_state.seq for state in _registered_requests(llm).values()
                  for seq_state in state.sequences if not seq_state.seq.is_finished]
    assert {id(s) for s in registered} == queued, (
        f"engine request table {sorted(s.request_id for s in registered)} != queued/running "
        f"{sorted(s.request_id for s in running + waiting)}")
    for state in _registered_requests(llm).values():
        assert not state.finished, f"request {state.request_id} is finished but still registered"
    return running, waiting


def _check_block_tables(llm, running: list, waiting: list) -> list[int]:
    """Block tables fit their sequences; returns how many tables hold each block."""
    bs, n = llm.block_manager.block_size, len(llm.block_manager.blocks)
    holders = [0] * n
    for seq in running:
        table = seq.block_table
        assert len(set(table)) == len(table), f"{seq}: block table holds a block twice: {table}"
        for block_id in table:
            assert 0 <= block_id < n, f"{seq}: block id {block_id} outside the pool"
            holders[block_id] += 1
        # between steps a running sequence always has its last token (at least) to compute;
        # with nothing left the scheduler would never give it a chunk again (wedged)
        assert seq.num_computed_tokens < seq.num_tokens, (
            f"{seq}: all {seq.num_tokens} tokens computed but no token was appended")
        assert seq.num_computed_tokens <= len(table) * bs, (
            f"{seq}: {seq.num_computed_tokens} tokens computed but only {len(table)} blocks")
        assert len(table) * bs >= seq.num_tokens - 1, (
            f"{seq}: block table of {len(table)} blocks cannot hold its {seq.num_tokens} tokens")
        assert len(table) <= -(-seq.num_tokens // bs), (
            f"{seq}: {len(table)} blocks for {seq.num_tokens} tokens (over-allocated)")
    for seq in waiting:
        assert seq.block_table == [], f"waiting {seq} still holds blocks {seq.block_table}"
        assert seq.num_computed_tokens == 0, f"waiting {seq} claims computed tokens"
    return holders


def _check_block_states(blocks: list, holders: list[int], cached) -> None:
    """Each block is free, cached-and-free or in use, with a ref count equal to its holders."""
    for block in blocks:
        bid = block.block_id
        assert block.ref_count == holders[bid], (
            f"block {bid}: ref_count {block.ref_count} but held by {holders[bid]} block table(s)")
        if block.ref_count == 0:
            assert block.in_free_queue, f"block {bid} has ref 0 but is not in the free queue"
            if block.block_hash is not None:
                assert cached.get(block.block_hash) is block, (
                    f"block {bid} is free with hash {block.block_hash:#x} but not registered "
                    f"in the prefix cache (a stale identity)")
        else:
            assert not block.in_free_queue, f"block {bid} is in use (ref {block.ref_count}) and free"
            if block.block_hash is not None:
                assert cached.get(block.block_hash) is block, (
                    f"in-use block {bid} has hash {block.block_hash:#x} but is not registered")
        if block.block_hash is None:
            assert block.token_bytes is None and block.parent is None and block.salt is None, (
                f"block {bid} has no hash but keeps a cached identity")


def _check_cache_entries(llm, cached) -> None:
    """Every entry names exactly the prefix its block holds, chained from a cached parent."""
    blocks, pc = llm.block_manager.blocks, llm.prefix_cache
    if not pc.enabled:
        assert not cached, "prefix caching is off but blocks are registered"
        assert all(b.block_hash is None for b in blocks), "prefix caching is off but a block has a hash"
    assert len(cached) <= len(blocks), "more prefix-cache entries than blocks"
    for h, block in cached.items():
        bid = block.block_id
        assert blocks[bid] is block, f"prefix cache entry {h:#x} points outside the pool"
        assert block.block_hash == h, (
            f"prefix cache entry {h:#x} points to block {bid} whose hash is {block.block_hash}")
        assert isinstance(block.token_bytes, bytes) and len(block.token_bytes) == llm.block_manager.block_size * 8, (
            f"cached block {bid} stores {len(block.token_bytes or b'')} token bytes, not one block")
        seed = _chain_seed(block, blocks, cached, pc)
        assert pc.hash_fn(block.token_bytes, seed) == h, (
            f"cached block {bid}: hash {h:#x} is not the chain hash of its tokens and parent "
            f"{block.parent} (the entry names a prefix the block does not hold)")
    for block in cached.values():  # chains terminate (no cycles through parents)
        steps, b = 0, block
        while b.parent is not None:
            b = blocks[b.parent[0]]
            steps += 1
            assert steps <= len(blocks), f"parent chain of cached block {block.block_id} has a cycle"


def _chain_seed(block, blocks: list, cached, pc) -> int:
    """The hash a cached block's entry must be seeded with: its live cached parent's, or the
    salt's root hash for a first block."""
    bid = block.block_id
    if block.parent is None:
        return pc.root_hash(block.salt)
    parent = blocks[block.parent[0]]
    assert parent.generation == block.parent[1], (
        f"cached block {bid}: its parent {parent.block_id} was reused since (stale chain)")
    assert parent is not block, f"cached block {bid} is its own parent"
    parent_cached = parent.block_hash is not None and cached.get(parent.block_hash) is parent
    assert parent_cached or parent.ref_count > 0, (
        f"cached block {bid}: parent {parent.block_id} is neither cached nor in use (dangling chain)")
    assert parent_cached, (f"cached block {bid}: parent {parent.block_id} is in use but not cached, "
                           f"so the entry's chain cannot be verified")
    assert parent.salt == block.salt, f"cached block {bid} and its parent have different salts"
    return parent.block_hash


def _check_running_chains(llm, running: list, cached) -> None:
    """What a running sequence has computed is cached under its own chain (caching on)."""
    if not llm.prefix_cache.enabled:
        return
    bs, blocks, pc = llm.block_manager.block_size, llm.block_manager.blocks, llm.prefix_cache
    for seq in running:
        prev = pc.root_hash(seq.cache_salt)
        for i in range(seq.num_computed_tokens // bs):
            block = blocks[seq.block_table[i]]
            expect_bytes = seq.tokens[i * bs:(i + 1) * bs].tobytes()
            prev = pc.hash_fn(expect_bytes, prev)
            assert block.block_hash == prev and cached.get(prev) is block, (
                f"{seq}: computed block {i} (block {block.block_id}) is not cached under the "
                f"sequence's chain hash")
            assert block.token_bytes == expect_bytes, (
                f"{seq}: cached block {block.block_id} at index {i} holds other tokens")
            want_parent = blocks[seq.block_table[i - 1]].lifetime if i else None
            assert block.parent == want_parent, (
                f"{seq}: block {block.block_id} at index {i} has parent {block.parent}, "
                f"the sequence's previous block is {want_parent}")
            assert block.salt == seq.cache_salt, f"{seq}: block {block.block_id} has another salt"


def _check_stats(llm, members: list, cached) -> None:
    """The engine's own figures agree with the count."""
    blocks, stats = llm.block_manager.blocks, llm.stats()
    in_use = sum(1 for b in blocks if b.ref_count > 0)
    assert stats["blocks_in_use"] == in_use, f"stats say {stats['blocks_in_use']} in use, counted {in_use}"
    assert stats["free_blocks"] == len(members) == len(blocks) - in_use
    assert stats["blocks_cached"] == len(cached)


def assert_idle(llm) -> None:
    """Everything finished: no block in use, nothing queued, every block in the free queue."""
    check_accounting(llm)
    llm = engine_core(llm)
    bm = llm.block_manager
    assert not llm.scheduler.running and not llm.scheduler.waiting, (
        f"queues not empty: running={list(llm.scheduler.running)} waiting={list(llm.scheduler.waiting)}")
    assert not llm.has_unfinished
    assert not _registered_requests(llm), f"requests still registered: {sorted(_registered_requests(llm))}"
    assert all(b.ref_count == 0 for b in bm.blocks), "a block is in use with nothing running"
    assert len(bm.free_queue) == bm.num_blocks, (
        f"free queue holds {len(bm.free_queue)} of {bm.num_blocks} blocks")


# ----------------------------------------------------------------------------- fault injection

FAULT_KINDS = ("forward_before", "forward_after", "sampler")


class InjectedFault(RuntimeError):
    pass


class FaultInjector:
    """Raises ``InjectedFault`` once, inside an engine step, when armed.

    Kinds: ``forward_before`` (model forward raises before computing), ``forward_after`` (it
    raises after the real forward wrote this step's K/V into the pool), ``sampler`` (sampling
    raises after the real sampler ran). ``arm(kind, skip=n)`` lets n calls pass first.
    """

    def __init__(self, llm) -> None:
        self.armed: str | None = None
        self.skip = 0
        self.fired = 0
        runner = engine_core(llm).model_runner
        backend, sampler = runner.backend, runner.sampler
        injector = self

        class FaultyBackend:
            """This runner's backend, with a forward that fires when armed (the backend
            itself, which other engines may share, is left as it is)."""

            def __getattr__(self, name):
                return getattr(backend, name)

            def forward(self, *args, **kwargs):
                fire = injector._should_fire(("forward_before", "forward_after"))
                if fire == "forward_before":
                    injector._fire()
                out = backend.forward(*args, **kwargs)  # writes this step's K/V into the pool
                if fire == "forward_after":
                    injector._fire()
                return out

        def faulty_sampler(*args, **kwargs):
            fire = self._should_fire(("sampler",))
            out = sampler(*args, **kwargs)
            if fire:
                self._fire()
            return out

        runner.backend = FaultyBackend()
        runner.sampler = faulty_sampler

    def arm(self, kind: str, skip: int = 0) -> None:
        assert kind in FAULT_KINDS, kind
        self.armed, self.skip = kind, skip

    def _should_fire(self, kinds) -> str | None:
        if self.armed not in kinds:
            return None
        if self.skip > 0:
            self.skip -= 1
            return None
        return self.armed

    def _fire(self):
        self.armed = None
        self.fired += 1
        raise InjectedFault("injected")


def snapshot(llm):
    seqs = {s.request_id: (s.num_tokens, s.output_token_ids, s.num_computed_tokens, s in llm.scheduler.running)
            for s in list(llm.scheduler.running) + list(llm.scheduler.waiting)}
    cached = set(llm.prefix_cache.entries) if llm.prefix_cache else set()
    return (seqs, llm.stats(), cached,
            llm.scheduler.stats.preemptions)


def assert_nothing_committed(llm, before):
    """The failed step may have scheduled (admitted, allocated, preempted) but not computed."""
    seqs_before, counters_before, cached_before, preempted_before = before
    seqs_after, counters_after, cached_after, preempted_after = snapshot(llm)
    assert set(seqs_after) == set(seqs_before), "a failed step lost or finished a request"
    for rid, (num_tokens, out, computed, was_running) in seqs_before.items():
        n2, out2, computed2, running2 = seqs_after[rid]
        assert (n2, out2) == (num_tokens, out), f"request {rid}: a failed step appended tokens"
        if was_running and running2 and preempted_after == preempted_before:
            assert computed2 == computed, (
                f"request {rid}: a failed step advanced num_computed_tokens {computed} -> {computed2}")
    for key in ("steps", "generation_tokens", "prompt_tokens_computed"):
        assert counters_after[key] == counters_before[key], f"a failed step counted {key}"
    assert cached_after <= cached_before, "a failed step registered prefix-cache blocks"
