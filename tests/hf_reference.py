"""Old home of the shared test helpers: the names some test files still import from here.
New code imports from ``helpers`` (checkpoints, prompts, engine drivers, the greedy reference)."""
from helpers import (ARCHS, MAX_POS, TIE_TOL, VOCAB_SIZE, GreedyReference, assert_no_leak,
                     build_checkpoint, build_tokenizer, make_llm, random_prompt)

__all__ = ["ARCHS", "MAX_POS", "TIE_TOL", "VOCAB_SIZE", "GreedyReference", "assert_no_leak",
           "build_checkpoint", "build_tokenizer", "make_llm", "random_prompt"]
