"""``hash_strategy`` is a pure toggle: it changes how hashes are obtained and nothing else.

The chapter compares two ways of getting the same hashes; so the "before" (recompute) and
the "after" (incremental) engines must make the same admissions, waits, steps, hits,
preemptions and evictions, and produce the same tokens -- only ``hash_computations`` may
differ. The workload exercises every place a hash is used: prefixes shared by requests
admitted together (the in-flight wait), follow-up turns that hit blocks completed during
decode, and a pool small enough to preempt and evict.
"""
from __future__ import annotations

from helpers import assert_no_leak, greedy, make_llm, random_prompt


def traced_run(model_dir: str, strategy: str):
    """Run both rounds; return (per-step trace, tokens, final stats, chain events)."""
    llm = make_llm(model_dir, block_size=8, num_kv_blocks=22, max_num_seqs=5,
                   max_num_batched_tokens=40, hash_strategy=strategy)
    events = []
    llm.prefix_cache.subscribe(events.append)
    trace = []
    schedule = llm.scheduler.schedule

    def recorded_schedule():
        chunks = schedule()
        stats = {k: v for k, v in llm.stats().items() if k != "hash_computations"}
        trace.append(([(c.seq.request_id, c.num_tokens) for c in chunks], stats))
        return chunks
    llm.scheduler.schedule = recorded_schedule
    first = round_one_prompts()
    outs1 = llm.generate(first, greedy(12), use_tqdm=False)
    follow_ups = [p + o.outputs[0].token_ids + random_prompt(5, seed=90 + i)
                  for i, (p, o) in enumerate(zip(first, outs1))]
    outs2 = llm.generate(follow_ups, greedy(12), use_tqdm=False)
    assert_no_leak(llm)
    tokens = [o.outputs[0].token_ids for o in outs1 + outs2]
    return trace, tokens, llm.stats(), events


def round_one_prompts() -> list[list[int]]:
    """Three shared prefixes, two requests each, submitted together."""
    prefixes = [random_prompt(24 + 8 * i, seed=70 + i) for i in range(3)]
    return [prefixes[i // 2] + random_prompt(3 + i, seed=80 + i) for i in range(6)]


def test_recompute_and_incremental_differ_only_in_hash_count(llama_dir):
    before = traced_run(llama_dir, "recompute")
    after = traced_run(llama_dir, "incremental")
    (trace_b, tokens_b, stats_b, events_b), (trace_a, tokens_a, stats_a, events_a) = before, after
    assert trace_b == trace_a  # same chunks in every step, same counters after every step
    assert tokens_b == tokens_a
    assert {k: v for k, v in stats_b.items() if k != "hash_computations"} == \
           {k: v for k, v in stats_a.items() if k != "hash_computations"}
    assert stats_b["hash_computations"] > stats_a["hash_computations"]
    # The workload really exercised what it claims, in both runs alike.
    assert stats_a["preemptions"] > 0 and stats_a["evictions"] > 0
    waits = [sum(e.kind == "wait" for e in events) for events in (events_b, events_a)]
    assert waits[0] == waits[1] > 0
    saved = [[(e.request_id, e.index, e.block_hash) for e in events if e.kind == "save"]
             for events in (events_b, events_a)]
    assert saved[0] == saved[1]
