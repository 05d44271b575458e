"""Compatibility names for test files not yet moved to ``helpers`` (import from helpers instead).

``hf_greedy`` / ``hf_refs`` / ``assert_same_tokens`` are the old spellings of
``GreedyReference.get`` / ``GreedyReference.compare_all``: the same reference, the same tie
tolerance.
"""
from __future__ import annotations

from helpers import (ARCHS, MAX_POS, SEEDS, TIE_TOL, VOCAB_SIZE, GreedyReference, Ref,  # noqa: F401
                     assert_no_leak, build_checkpoint, build_tokenizer, make_llm, random_prompt)


def hf_refs(model_dir, prompts, max_new_tokens: int) -> list[Ref]:
    reference = GreedyReference(model_dir)
    return [reference.get(p, max_new_tokens) for p in prompts]


def hf_greedy(model_dir, prompts, max_new_tokens: int):
    """Per prompt HF's greedy ids and per step whether its top-2 logits were a near-tie."""
    refs = hf_refs(model_dir, prompts, max_new_tokens)
    return [r.tokens for r in refs], [r.ties for r in refs]


def assert_same_tokens(ours, ref, ties, min_fraction: float = 0.5) -> int:
    """Token-for-token equality up to (excluding) the first near-tie of each reference, and
    at least ``min_fraction`` of all positions compared."""
    assert len(ours) == len(ref), f"got {len(ours)} outputs for {len(ref)} prompts"
    compared = total = 0
    for i, (o, r, t) in enumerate(zip(ours, ref, ties)):
        o = list(o)
        assert len(o) == len(r), f"prompt {i}: generated {len(o)} tokens, reference has {len(r)}"
        n = Ref(r, t, []).first_tie(len(r))
        assert o[:n] == r[:n], (f"prompt {i}: mismatch at position "
                                f"{next(j for j in range(n) if o[j] != r[j])}: ours {o[:n]} vs HF {r[:n]}")
        compared += n
        total += len(r)
    assert total > 0 and compared >= min_fraction * total, (
        f"only {compared}/{total} positions compared (near-ties) - test would be vacuous")
    return compared
