"""Exercise 1: the chapter's ``_do_prefill_step`` snippet, read literally.

The chapter saves a block like this, at the end of each prefill chunk:

    if end % self.block_size == 0 and end <= prompt_len:
        h = self._chain_hash(seq.prompt_ids.tolist(), seq._prev_hash, end - self.block_size, end)
        seq._block_hashes.append(h)
        seq._prev_hash = h
        self._save_prefix_cache(seq, h, end)

``SnippetPrefixCache`` (in exercises/ex1_snippet_pitfall.py) is this engine's ``PrefixCache``
with only ``_do_prefill_step`` replaced by the snippet, line by line. Three lines had to be
translated to this engine:

* ``seq.prompt_ids.tolist()`` is ``seq.token_view()``: the same ids, without a copy;
* ``seq._prev_hash = h`` has no line of its own: here ``_prev_hash`` is a property that
  returns ``_block_hashes[-1]``, so the ``append`` just before it already makes it ``h``;
* ``self._save_prefix_cache(seq, h, end)`` is ``_snippet_save(seq, h, end)``: it registers the
  block that ends at ``end`` under ``h`` (the engine's own method takes a block, not an end).

Remember what runs before it: at admission, ``_lookup_prefix_cache`` calls
``_precompute_block_hashes``, which fills ``_block_hashes`` for the whole prompt.

Setup: one prompt of 4096 tokens, block_size 16 (N = 256 full blocks), an empty cache. It
is prefilled in 16-token chunks; then everything again, on a fresh cache, in 512-token chunks.
With the snippet, predict:

1. the hash calls the cold request makes with 16-token chunks (its lookup + its saves);
2. the entries in the prefix cache afterwards (16-token chunks);
3. how many of the 4096 tokens a new request with the same prompt then gets from cache
   (16-token chunks);
4. the hash calls the cold request makes with 512-token chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

from block_manager import BlockManager
from exercises.common import random_prompt
from prefix_cache import PrefixCache
from scheduler import Scheduler, SchedulerConfig, Sequence
from teaching.model_free import prefill_without_model

TITLE = "The chapter's snippet, read literally"
ASKS = ("hash calls, 16-token chunks", "cache entries, 16-token chunks",
        "tokens from cache for a new request, 16-token chunks", "hash calls, 512-token chunks")
HINT = ("Count the snippet's hash calls on top of the lookup's. Then ask which hash the first "
        "block is saved under: what is seq._prev_hash right after the lookup?")
PROMPT_LEN, BLOCK = 4096, 16


class SnippetPrefixCache(PrefixCache):
    """The engine's prefix cache with ``_do_prefill_step`` as the chapter's snippet reads."""

    def _do_prefill_step(self, seq: Sequence, start: int, end: int) -> list:
        bs = self.block_size
        if end % bs == 0 and end <= seq.num_prompt_tokens:  # only the chunk's end is checked
            h = self._chain_hash(seq.token_view(), seq._prev_hash, end - bs, end)
            seq._block_hashes.append(h)  # and so seq._prev_hash == h: it is _block_hashes[-1]
            self._snippet_save(seq, h, end)
        return []  # the snippet knows no twins

    def _snippet_save(self, seq: Sequence, h: int, end: int) -> None:
        """The snippet's ``_save_prefix_cache(seq, h, end)``: the block ending at ``end`` under ``h``."""
        index, blocks = end // self.block_size - 1, self.block_manager.blocks
        block = blocks[seq.block_table[index]]
        parent = blocks[seq.block_table[index - 1]].lifetime if index > 0 else None
        if block.block_hash is None and h not in self._prefix_cache:
            block.set_identity(h, seq.block_bytes(index, self.block_size), parent, seq.cache_salt)
            self._prefix_cache[h] = block


@dataclass
class Outcome:
    label: str
    hash_calls: int         # by the cold request: its lookup + its saves
    chain_length: int       # len(seq._block_hashes) after it
    cache_entries: int
    cached_for_new_seq: int  # tokens a new request with the same prompt gets from cache
    prompt_len: int

    def line(self) -> str:
        return (f"{self.label:36s}: {self.hash_calls} hash calls, len(_block_hashes) {self.chain_length}, "
                f"{self.cache_entries} cache entries, new Sequence: {self.cached_for_new_seq} of "
                f"{self.prompt_len} tokens from cache")


def run_variant(cache_cls: type, chunk: int, label: str, prompt: list[int]) -> Outcome:
    """One cold request on an empty cache, then a lookup of a new Sequence with the same prompt."""
    blocks = BlockManager(2 * len(prompt) // BLOCK + 8, BLOCK)
    cache = cache_cls(blocks)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=chunk), blocks, cache)
    seq = Sequence(prompt, max_tokens=1)
    prefill_without_model(scheduler, seq)
    calls = cache.hash_computations
    again = cache.lookup(Sequence(prompt, max_tokens=1))
    return Outcome(label, calls, len(seq._block_hashes), cache.num_cached_blocks,
                   again.num_cached_tokens, len(prompt))


def measure(prompt_len: int = PROMPT_LEN) -> list[Outcome]:
    prompt = random_prompt(prompt_len, seed=7, vocab=32000)
    return [run_variant(SnippetPrefixCache, 16, "snippet as written, 16-token chunks", prompt),
            run_variant(SnippetPrefixCache, 512, "snippet as written, 512-token chunks", prompt),
            run_variant(PrefixCache, 16, "this engine, 16-token chunks", prompt),
            run_variant(PrefixCache, 512, "this engine, 512-token chunks", prompt)]


def answer(outcomes: list[Outcome]) -> list[str]:
    chunks16, chunks512 = outcomes[0], outcomes[1]
    return [str(chunks16.hash_calls), str(chunks16.cache_entries), str(chunks16.cached_for_new_seq),
            str(chunks512.hash_calls)]


def report(outcomes: list[Outcome]) -> list[str]:
    return [o.line() for o in outcomes]


if __name__ == "__main__":
    print("\n".join(report(measure())))
