"""Exercise 1: the chapter's ``_do_prefill_step`` snippet, run exactly as it reads.

The chapter's snippet, on a block boundary at the end of a prefill chunk::

    if end % self.block_size == 0 and end <= prompt_len:
        h = self._chain_hash(seq.prompt_ids.tolist(), seq._prev_hash, end - self.block_size, end)
        seq._block_hashes.append(h)
        seq._prev_hash = h
        self._save_prefix_cache(seq, h, end)

Read literally, it hashes and appends again although ``_lookup_prefix_cache`` has already
filled ``_block_hashes`` for the whole prompt (``_precompute_block_hashes``), and it chains
from ``_prev_hash``, the *last* block's hash. ``SnippetPrefixCache`` below is the engine's
``PrefixCache`` with only that method replaced. Predict, for a 4096-token prompt
(block_size 16, N = 256), prefilled in 16-token and in 512-token chunks:

* how many hash calls the cold request makes, and ``len(seq._block_hashes)`` afterwards;
* how many entries the prefix cache holds;
* how many of the 4096 tokens a new request with the same prompt gets from cache.

Then run ``python -m exercises.ex1_snippet_pitfall`` and read the README's answer.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass

import torch

from engine import LLM
from exercises.common import random_prompt, send, tiny_long_checkpoint
from prefix_cache import PrefixCache
from scheduler import Sequence

PROMPT_LEN, BLOCK = 4096, 16


class SnippetPrefixCache(PrefixCache):
    """The engine's prefix cache with ``_do_prefill_step`` as the chapter's snippet reads."""

    def _do_prefill_step(self, seq: Sequence, start: int, end: int) -> list:
        bs = self.block_size
        if end % bs == 0 and end <= seq.num_prompt_tokens:  # only the chunk's end is checked
            h = self._chain_hash(seq.token_view(), seq._prev_hash, end - bs, end)
            seq._block_hashes.append(h)  # seq._prev_hash is _block_hashes[-1]: it follows
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


def run_variant(model: str, cache_cls: type, chunk: int, label: str, prompt: list[int]) -> Outcome:
    llm = LLM(model, block_size=BLOCK, max_num_batched_tokens=chunk, num_kv_blocks=2 * len(prompt) // BLOCK + 8,
              device="cpu", dtype="float32")
    llm.prefix_cache = llm.scheduler.prefix_cache = cache_cls(llm.block_manager)
    before = llm.stats()["hash_computations"]
    (seq,) = send(llm, [prompt])
    calls = llm.stats()["hash_computations"] - before
    entries = llm.prefix_cache.num_cached_blocks
    cached = llm.stats()["prompt_tokens_cached"]
    send(llm, [prompt])
    return Outcome(label, calls, len(seq._block_hashes), entries,
                   llm.stats()["prompt_tokens_cached"] - cached, len(prompt))


def measure(model: str | None = None, prompt_len: int = PROMPT_LEN) -> list[Outcome]:
    """The four variants; without ``model``, on a tiny random checkpoint made for the run."""
    if model is None:
        with tempfile.TemporaryDirectory() as tmp:
            return measure(tiny_long_checkpoint(tmp, prompt_len + 64), prompt_len)
    prompt = random_prompt(prompt_len, seed=7, vocab=512)
    return [run_variant(model, SnippetPrefixCache, 16, "snippet as written, 16-token chunks", prompt),
            run_variant(model, SnippetPrefixCache, 512, "snippet as written, 512-token chunks", prompt),
            run_variant(model, PrefixCache, 16, "this engine, 16-token chunks", prompt),
            run_variant(model, PrefixCache, 512, "this engine, 512-token chunks", prompt)]


if __name__ == "__main__":
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on a shared CPU
    for outcome in measure():
        print(outcome.line())
