"""``python run.py --chain``: one request's chain of block hashes, block by block.

Every figure comes from the engine's own trace (``PrefixCache.recording()``), recorded while real
requests run:

1. the request cold, then the same prompt again as a new request: each full block's token
   range and text, parent hash -> block hash, lookup result, where it was saved, and where
   its hash came from;
2. the same prompt with one token changed at position k: the blocks before k's block keep
   their hashes and hit, every block from it on changes (the chain property);
3. the same two requests under ``hash_strategy="recompute"`` (the chapter's "before"):
   hash calls per block;
4. the in-flight wait: two copies sent together; what the second one's wait costs in hashes.

Each part says why each lookup stopped where it did: the reason on the trace's "miss" event,
which is also the request's ``RequestOutput.cache_miss_reason``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from teaching.chapter_table import RULE
from engine import LLM, SamplingParams
from prefix_cache import ChainEvent, HashSource

# Sources that are real hash calls (REUSED only reads the hash the sequence already has).
CALLS = {HashSource.PRECOMPUTED, HashSource.DECODE, HashSource.SAVE, HashSource.RECOMPUTED,
         HashSource.RECOMPUTED_AT_SAVE}
AT_LOOKUP = {HashSource.PRECOMPUTED, HashSource.RECOMPUTED}


@dataclass
class BlockTrace:
    """What happened to one block of one request."""

    block_hash: int | None = None
    parent_hash: int | None = None
    sources: list[HashSource] = field(default_factory=list)
    lookups: list[str] = field(default_factory=list)  # "hit", "miss", "wait", one per lookup probe
    saved: str = ""                                   # "saved" or "twin" (an identical block was cached)
    block_id: int | None = None                       # where it was saved, or what served the hit
    miss_reason: str | None = None                    # why a lookup missed it (prefix_cache.py, 7.)

    @property
    def calls_at_lookup(self) -> int:
        return sum(s in AT_LOOKUP for s in self.sources)

    @property
    def calls_at_save(self) -> int:
        return sum(s in CALLS - AT_LOOKUP for s in self.sources)


def trace_blocks(events: list[ChainEvent], request_id: str) -> dict[int, BlockTrace]:
    """Block index -> what the trace says happened to that block of ``request_id``."""
    blocks: dict[int, BlockTrace] = {}
    for e in events:
        if e.request_id != request_id:
            continue
        b = blocks.setdefault(e.index, BlockTrace())
        if e.kind in ("hash", "reuse"):  # a call, or a hash read off the Sequence
            b.sources.append(e.source)
            if e.parent_hash is not None and b.block_hash is None:
                b.block_hash, b.parent_hash = e.block_hash, e.parent_hash
        elif e.kind in ("hit", "miss", "wait"):
            b.lookups.append(e.kind)
            b.block_id = e.block_id if e.kind == "hit" else b.block_id
            b.miss_reason = e.reason if e.kind == "miss" else b.miss_reason
        elif e.kind in ("save", "twin"):
            b.saved, b.block_id = e.kind, e.block_id
    return dict(sorted(blocks.items()))


def stops(events: list[ChainEvent], request_id: str) -> list[str]:
    """Why each lookup of ``request_id`` stopped, in order (the "miss" events' reasons)."""
    return [str(e.reason) for e in events if e.kind == "miss" and e.request_id == request_id]


def print_stops(label: str, reasons: list[str]) -> None:
    """One line per distinct reason, in order, with how many lookups stopped for it."""
    for reason in dict.fromkeys(reasons):
        times = reasons.count(reason)
        print(f"  {label}{reason}" + (f" ({times} lookups)" if times > 1 else ""))


def hash_calls(events: list[ChainEvent], request_id: str) -> int:
    return sum(e.kind == "hash" and e.request_id == request_id for e in events)  # "reuse": no call


# ----------------------------------------------------------------------------- running

def traced(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list, list[list[int]]]:
    """Send ``prompts`` together; the chain events and each request's full token list."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with llm.prefix_cache.recording() as events:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return events, [o.prompt_token_ids + o.token_ids for o in outs]


def chain_prompt(llm: LLM, args) -> list[int]:
    """--prompt's text, else the demo model's first prompt, else a seeded random prompt."""
    if args.prompt is not None:
        if llm.tokenizer is None:
            raise ValueError("--prompt needs a checkpoint with a tokenizer; this one has none")
        return llm.tokenizer(args.prompt)["input_ids"]
    spec = Path(args.model) / "prompts.json"
    if spec.is_file():
        return json.loads(spec.read_text())["prompts"][0]["prompt_ids"]
    g = torch.Generator().manual_seed(args.seed)
    length = min(200, llm.max_model_len // 2)
    return torch.randint(0, llm.model_config.vocab_size, (length,), generator=g).tolist()


def prompt_source(args) -> str:
    """Where ``chain_prompt`` took the token ids from, as the header says it."""
    if args.prompt is not None:
        return "--prompt's text, through the model's tokenizer"
    spec = Path(args.model) / "prompts.json"
    if spec.is_file():
        return f"{Path(args.model).name}/prompts.json, prompt 0"
    return f"random ids, seed {args.seed} (the model has no prompts.json)"


def change_position(args, prompt: list[int]) -> int:
    k = len(prompt) // 2 if args.change_at is None else args.change_at
    if not 0 <= k < len(prompt):
        raise ValueError(f"--change-at {k} is outside the prompt (positions 0-{len(prompt) - 1})")
    return k


# ----------------------------------------------------------------------------- printing

def excerpt(llm: LLM, ids: list[int], width: int = 16) -> str:
    """A short printable piece of the block's text (its ids when there is no tokenizer)."""
    text = llm.tokenizer.decode(ids) if llm.tokenizer is not None else " ".join(map(str, ids))
    text = repr(text)[1:-1]
    return text[:width - 1] + "…" if len(text) > width else text


def hexh(h: int | None) -> str:
    return "-" * 16 if h is None else f"{h:016x}"


def generated_part(first: int, last: int, prompt_len: int) -> str:
    """The positions in [first, last] that were generated, not prompted ('-' for none)."""
    if last < prompt_len:
        return "-"
    start = max(first, prompt_len)
    return str(start) if start == last else f"{start}-{last}"


def print_cold_and_again(llm: LLM, tokens: list[int], cold: dict, again: dict, prompt_len: int) -> None:
    bs = llm.block_size
    print("\n1) The request cold (cache empty), then the same prompt again as a new request")
    print(f"  {'blk':>3s} {'tokens':>9s} {'generated':>9s}  {'text':16s}  {'parent hash':16s} -> "
          f"{'block hash':16s}  {'cold':4s} {'saved in':>8s}  {'hash came from':37s} {'again':5s} {'from':>4s}")
    for i, b in cold.items():
        a = again.get(i, BlockTrace())
        saved = f"{b.block_id} ({b.saved})" if b.saved == "twin" else str(b.block_id) if b.saved else "-"
        first, last = i * bs, (i + 1) * bs - 1
        print(f"  {i:>3d} {first:>4d}-{last:<4d} {generated_part(first, last, prompt_len):>9s}  "
              f"{excerpt(llm, tokens[first:last + 1]):16s}  "
              f"{hexh(b.parent_hash)} -> {hexh(b.block_hash)}  {lookup_word(b):4s} {saved:>8s}  "
              f"{', '.join(s.value for s in b.sources):37s} {lookup_word(a):5s} "
              f"{a.block_id if a.lookups and a.lookups[-1] == 'hit' else '-':>4}")
    print(f"  generated: positions in the block that the model generated (the prompt is positions "
          f"0-{prompt_len - 1}).\n  cold/again: the lookup's verdict for that block (- : not probed; "
          "the lookup stops at the first miss,\n  and the block holding the last token is never served "
          "from cache). 'from': the cached block that served the hit.")
    for label, trace in (("cold", cold), ("again", again)):
        why = next((b.miss_reason for b in trace.values() if b.miss_reason), None)
        if why:
            print(f"  Why the {label} lookup missed: {why}.")


def print_cold_count(cold: int, again: int, prompt_blocks: int) -> None:
    """The cold count, and why it is not the chapter table's cold row (which decodes one token)."""
    decode = cold - prompt_blocks
    print(f"  Hash calls: cold {cold} = {prompt_blocks} prompt blocks precomputed at lookup + {decode} "
          f"block{'s' * (decode != 1)} completed during decode, hashed once at save.\n  The chapter's "
          f"table counts {prompt_blocks} for its cold row: it asks for one new token, so no block "
          f"fills in decode.\n  Again: {again} (a new Sequence builds its own chain once, then reads it).")


def lookup_word(b: BlockTrace) -> str:
    return ",".join(dict.fromkeys(b.lookups)) or "-"


def print_changed(llm: LLM, prompt: list[int], k: int, before: dict, after: dict) -> bool:
    """Part 2; returns whether the chain property held block by block."""
    bs, kb = llm.block_size, k // llm.block_size
    changed = (prompt[k] + 1) % llm.model_config.vocab_size
    print(f"\n2) One token changed: position {k} (block {kb}), id {prompt[k]} "
          f"'{excerpt(llm, [prompt[k]])}' -> {changed} '{excerpt(llm, [changed])}'; sent as a new request")
    print(f"  {'blk':>3s} {'tokens':>9s}  {'hash before':16s}    {'hash after':16s}  lookup")
    holds = True
    for i, b in after.items():
        if b.block_hash is None:
            continue  # completed during decode: no counterpart before
        same = before[i].block_hash == b.block_hash
        holds &= same == (i < kb)
        print(f"  {i:>3d} {i * bs:>4d}-{(i + 1) * bs - 1:<4d}  {hexh(before[i].block_hash)} "
              f"{'==' if same else '!='} {hexh(b.block_hash)}  {lookup_word(b)}")
    hits = sum(b.lookups[-1:] == ["hit"] for b in after.values())
    print(f"  Blocks 0-{kb - 1} keep their hashes and hit ({hits * bs} tokens served from cache); "
          f"block {kb} changes because\n  its tokens did, every later block because its parent's hash "
          f"did: the chain property -> {'holds' if holds else 'VIOLATED'}." if kb > 0 else
          f"  Block 0 holds the change, so every block's hash changes and nothing hits -> "
          f"{'holds' if holds else 'VIOLATED'}.")
    return holds


def print_recompute(cold_r: dict, again_r: dict, cold_i: dict, again_i: dict) -> None:
    """Part 3: hash calls per block, consecutive blocks with the same counts on one line."""
    print("\n3) The same two requests under hash_strategy=\"recompute\" (the chapter's \"before\", its Paged "
          "Prefix Cache): hash calls per block")
    print(f"  {'blocks':>9s}  {'recompute: cold lookup+save':>27s}  {'again lookup+save':>17s}   "
          f"{'incremental: cold':>17s}  {'again':>5s}")
    rows = [(i, (b.calls_at_lookup, b.calls_at_save, again_r.get(i, BlockTrace()).calls_at_lookup,
                 again_r.get(i, BlockTrace()).calls_at_save, hash_count(cold_i.get(i)), hash_count(again_i.get(i))))
            for i, b in cold_r.items()]
    for first, last, c in group_runs(rows):
        span = f"{first}" if first == last else f"{first}-{last}"
        print(f"  {span:>9s}  {c[0]:>16d} + {c[1]:<8d}  {c[2]:>9d} + {c[3]:<5d}   {c[4]:>17d}  {c[5]:>5d}")
    total = [sum(c[j] for _, c in rows) for j in range(6)]
    print(f"  {'total':>9s}  {total[0]:>16d} + {total[1]:<8d}  {total[2]:>9d} + {total[3]:<5d}   "
          f"{total[4]:>17d}  {total[5]:>5d}")
    print(f"  The rule: {RULE[0]};\n  {RULE[1]} (a block completed during decode: once, at save).")


def hash_count(b: BlockTrace | None) -> int:
    return 0 if b is None else sum(s in CALLS for s in b.sources)


def group_runs(rows: list[tuple[int, tuple]]) -> list[tuple[int, int, tuple]]:
    """Consecutive block indices with equal counts, as (first, last, counts)."""
    runs: list[list] = []
    for i, counts in rows:
        if runs and runs[-1][2] == counts and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i, counts])
    return [tuple(r) for r in runs]


def print_wait(results: dict[str, list]) -> None:
    print("\n4) The in-flight wait: the prompt sent twice at once (cache empty, a step budget that fits both).\n"
          "  The in-flight rule: a request whose next block another running request is computing right "
          "now waits\n  one step instead of computing it twice; then that block is a cache hit.")
    for strategy, events in results.items():
        waits = sum(e.kind == "wait" and e.request_id == "1" for e in events)
        print(f"  {strategy:11s}: request 0 made {hash_calls(events, '0'):>3d} hash calls; request 1 waited "
              f"{waits} step(s) for blocks in flight, was looked up {waits + 1} times and made "
              f"{hash_calls(events, '1'):>3d}")
        for n, reason in enumerate(stops(events, "1"), 1):
            print(f"  {'':11s}  request 1's lookup {n} stopped at {reason}")
    print("  The wait's retry costs recompute a whole chain again; incremental reads the chain the "
          "first lookup stored\n  on the Sequence (0 hash calls).")


# ----------------------------------------------------------------------------- main

def main(args) -> int:
    llm = chain_llm(args, "incremental", args.max_num_batched_tokens)
    prompt = chain_prompt(llm, args)
    k, decode = change_position(args, prompt), llm.block_size + 1
    print_header(llm, prompt, decode, prompt_source(args))
    cold_events, (tokens,) = traced(llm, [prompt], decode)
    again_events, _ = traced(llm, [prompt], decode)
    cold, again = trace_blocks(cold_events, "0"), trace_blocks(again_events, "1")
    print_cold_and_again(llm, tokens, cold, again, len(prompt))
    print("  Why each lookup stopped where it did (the \"miss\" event's reason; the request's "
          "output carries it\n  as cache_miss_reason):")
    print_stops("cold:  ", stops(cold_events, "0"))
    print_stops("again: ", stops(again_events, "1"))
    print_cold_count(hash_calls(cold_events, "0"), hash_calls(again_events, "1"), len(prompt) // llm.block_size)
    changed = list(prompt)
    changed[k] = (prompt[k] + 1) % llm.model_config.vocab_size
    changed_events, _ = traced(llm, [changed], 1)
    holds = print_changed(llm, prompt, k, cold, trace_blocks(changed_events, "2"))
    print_stops("Its lookup stopped at ", stops(changed_events, "2"))
    before = chain_llm(args, "recompute", args.max_num_batched_tokens)
    r_cold = trace_blocks(traced(before, [prompt], decode)[0], "0")
    r_again = trace_blocks(traced(before, [prompt], decode)[0], "1")
    print_recompute(r_cold, r_again, cold, again)
    print_wait({s: traced(chain_llm(args, s, 2 * len(prompt)), [prompt, prompt], 1)[0]
                for s in ("recompute", "incremental")})
    return 0 if holds else 1


def chain_llm(args, strategy: str, step_budget: int) -> LLM:
    return LLM(args.model, block_size=args.block_size, device=args.device, dtype=args.dtype,
               seed=args.seed, num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
               max_num_batched_tokens=max(step_budget, args.max_num_batched_tokens),
               max_num_seqs=2, hash_strategy=strategy,  # 2: the pool is sized for two sequences
               enforce_eager=True)  # a teaching run never waits for a compiler


def print_header(llm: LLM, prompt: list[int], decode: int, source: str) -> None:
    bs, n = llm.block_size, len(prompt) // llm.block_size
    partial = f" + {len(prompt) % bs} tokens in a partial block (not hashed until it fills)" \
        if len(prompt) % bs else ""
    print(f"The chain of one request: {llm.model_config.architecture}, prompt of {len(prompt)} tokens, "
          f"block_size {bs} -> {n} full blocks{partial};\n  {decode} new tokens, so decode completes "
          f"a block too. Torch threads: {torch.get_num_threads()}. Token ids: {source}.")
    print("  block hash = xxh3_64(the block's token ids as int64 bytes, seed = the parent's hash); "
          "block 0's parent is\n  the root, 0 (or, for a request with a cache_salt -- an optional "
          "string that keeps requests with\n  different salts from sharing blocks -- the salt's hash). "
          "One hash names the whole prefix up to its block.")
