"""The sampler on its own: each logits processor against Hugging Face's (or the formula vLLM
documents), on random logits, with no model. The engine-level parity tests are in
test_vllm_api.py."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from core.sampler import Sampler, gather_logprobs, noise_seed, prompt_logprobs
from vllm_api.sampling_params import SamplingParams

V = 64
EOS = 2


class FakeSeq:
    """What the sampler reads from a Sequence."""

    def __init__(self, prompt, output=(), **params) -> None:
        self.sampling_params = SamplingParams(**params)
        self.tokens = np.array(list(prompt) + list(output), dtype=np.int64)
        self.num_prompt_tokens = len(prompt)
        self.num_tokens = len(self.tokens)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens


def sampler(seed=0) -> Sampler:
    return Sampler(torch.device("cpu"), seed, eos_token_ids=[EOS])


def random_logits(rows: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * scale


def processed(seqs, logits):
    return sampler()._apply_logits_processors(logits, seqs)


# ----------------------------------------------------------------------- processors vs HF

@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_hf(penalty):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = random_logits(3, 1)
    histories = [([5, 9, 9, 40], [7, 5]), ([1, 2, 3], []), ([60, 61], [62, 62, 63])]
    seqs = [FakeSeq(p, o, repetition_penalty=penalty) for p, o in histories]
    ours = processed(seqs, logits)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for row, (p, o) in enumerate(histories):
        ids = torch.tensor([p + o])
        expected = hf(ids, logits[row:row + 1].clone())[0]
        torch.testing.assert_close(ours[row], expected)


def test_presence_and_frequency_penalties_follow_the_openai_formula():
    """logit - frequency * count_in_output - presence * (count > 0); the prompt does not count."""
    logits = random_logits(1, 2)
    seq = FakeSeq([3, 3, 4], [4, 4, 5], presence_penalty=0.5, frequency_penalty=0.25)
    ours = processed([seq], logits)[0]
    expected = logits[0].clone()
    for token, count in Counter([4, 4, 5]).items():
        expected[token] -= 0.25 * count + 0.5
    torch.testing.assert_close(ours, expected)
    assert ours[3] == logits[0, 3]  # prompt-only token: untouched


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.9])
def test_min_p_keeps_what_hf_keeps(min_p):
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = random_logits(4, 3) / 0.7
    seqs = [FakeSeq([1], min_p=min_p, temperature=1.0)] * 4
    ours = sampler()._apply_min_p(logits, [s.sampling_params for s in seqs])
    hf = MinPLogitsWarper(min_p)(None, logits.clone())
    assert torch.equal(torch.isfinite(ours), torch.isfinite(hf))
    assert torch.isfinite(ours).sum() < logits.numel()  # something was filtered


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.6), (-1, 0.9), (10, 0.5), (1, 1.0)])
def test_top_k_top_p_support_matches_hf(top_k, top_p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = random_logits(4, 4)
    params = [SamplingParams(top_k=top_k, top_p=top_p)] * 4
    ours = sampler()._filtered_probs(logits, params)
    hf = logits.clone()
    if top_k > 0:
        hf = TopKLogitsWarper(top_k)(None, hf)
    if top_p < 1.0:
        hf = TopPLogitsWarper(top_p)(None, hf)
    assert torch.equal(ours > 0, torch.isfinite(hf))
    # the race draw is scale-free, so top-p's survivors are not renormalised
    torch.testing.assert_close(ours / ours.sum(dim=-1, keepdim=True), hf.softmax(dim=-1))


@pytest.mark.parametrize("off", [0, -1])
def test_top_k_zero_or_minus_one_is_off(off):
    logits = random_logits(2, 5)
    probs = sampler()._filtered_probs(logits, [SamplingParams(top_k=off)] * 2)
    torch.testing.assert_close(probs, logits.softmax(dim=-1))


# ----------------------------------------------------------------------- token constraints

def test_logit_bias_is_added():
    logits = random_logits(2, 6)
    seqs = [FakeSeq([1], logit_bias={3: 5.0, 10: -2.5}), FakeSeq([1])]
    out = processed(seqs, logits)
    assert out[0, 3] == logits[0, 3] + 5.0 and out[0, 10] == logits[0, 10] - 2.5
    assert torch.equal(out[1], logits[1])


def test_allowed_token_ids_restrict_the_choice():
    logits = random_logits(2, 7)
    allowed = [4, 17, 33]
    seqs = [FakeSeq([1], allowed_token_ids=allowed, temperature=0.0), FakeSeq([1], temperature=0.0)]
    out = processed(seqs, logits)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == allowed
    tokens = sampler()(logits, seqs).token_ids
    assert tokens[0] == allowed[int(logits[0, allowed].argmax())]
    assert tokens[1] == int(logits[1].argmax())


def test_bad_words_ban_the_last_token_after_the_rest():
    logits = torch.zeros(3, V)
    words = [[9], [20, 21], [30, 31, 32]]
    seqs = [FakeSeq([1], [5, 20]), FakeSeq([1], [30, 31]), FakeSeq([20], [7])]
    for seq in seqs:
        seq.sampling_params.bad_words_token_ids = words
    out = processed(seqs, logits)
    banned = [set(torch.isinf(row).nonzero().flatten().tolist()) for row in out]
    # word [9] always; [20, 21] after output ending in 20; [30, 31, 32] after 30, 31.
    # Row 2: 20 is in the prompt, not the output, so 21 stays allowed.
    assert banned == [{9, 21}, {9, 32}, {9}]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(3, V)
    logits[:, EOS] = 10.0
    seqs = [FakeSeq([1], [4, 4], min_tokens=3, stop_token_ids=[7], temperature=0.0),
            FakeSeq([1], [4, 4, 4], min_tokens=3, stop_token_ids=[7], temperature=0.0),
            FakeSeq([1], [4], min_tokens=3, ignore_eos=True, temperature=0.0)]
    out = processed(seqs, logits)
    assert math.isinf(out[0, EOS]) and math.isinf(out[0, 7])
    assert out[1, EOS] == 10.0 and out[1, 7] == 0.0  # reached: nothing banned
    assert math.isinf(out[2, EOS])  # EOS counts as a stop token for min_tokens even with ignore_eos
    assert sampler()(logits, seqs).token_ids[1] == EOS


def test_a_row_with_every_token_banned_falls_back_to_raw_logits():
    logits = random_logits(1, 8)
    seq = FakeSeq([1], allowed_token_ids=[EOS], min_tokens=2, temperature=1.0, seed=3)
    out = processed([seq], logits)
    assert torch.equal(out, logits)
    assert 0 <= sampler()(logits, [seq]).token_ids[0] < V


def test_nothing_to_do_leaves_the_logits_tensor_untouched():
    """Greedy is the argmax of the raw logits when no processor applies (no copy at all)."""
    logits = random_logits(3, 9)
    seqs = [FakeSeq([1], temperature=0.0), FakeSeq([1], top_k=5), FakeSeq([1], min_p=0.1)]
    assert processed(seqs, logits) is logits
    assert sampler()(logits[:1], seqs[:1]).token_ids == [int(logits[0].argmax())]


# ----------------------------------------------------------------------- sampling

def test_samples_follow_the_filtered_distribution():
    """Many rows of the same logits in one call: frequencies match softmax(logits / T) after
    top-k (chi-square, 4000 draws)."""
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0] + [-30.0] * (V - 5))
    rows = 4000
    seqs = [FakeSeq([1], temperature=0.8, top_k=4)] * rows
    tokens = sampler(seed=11)(base.repeat(rows, 1), seqs).token_ids
    expected = (base[:4] / 0.8).softmax(dim=-1) * rows
    counts = torch.tensor([tokens.count(t) for t in range(4)], dtype=torch.float32)
    assert sum(counts) == rows  # top_k=4: nothing else is ever drawn
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3, (counts, expected)  # p = 0.001 for 3 degrees of freedom


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = random_logits(3, 10)
    seeded = FakeSeq([1], [4, 5], temperature=1.0, seed=2 ** 63 + 7)  # uint64 seeds are fine
    alone = sampler(seed=1)(logits[1:2], [seeded]).token_ids
    batch = sampler(seed=2)(logits, [FakeSeq([1]), seeded, FakeSeq([2], temperature=0.5)]).token_ids
    assert batch[1] == alone[0]


def test_noise_seed_accepts_the_whole_64_bit_range():
    for seed in (-(2 ** 63), -1, 0, 2 ** 63, 2 ** 64 - 1):
        assert 0 <= noise_seed(seed, 5) < 2 ** 63
    assert noise_seed(-1, 0) == noise_seed(2 ** 64 - 1, 0)  # the same 64 bits


# ----------------------------------------------------------------------- logprobs

def test_logprobs_are_of_the_raw_distribution_with_ranks():
    logits = random_logits(2, 12)
    seqs = [FakeSeq([1], [3], temperature=0.7, seed=1, logprobs=3, repetition_penalty=1.5),
            FakeSeq([1], temperature=0.0, logprobs=0)]
    out = sampler()(logits, seqs)
    raw = logits.log_softmax(dim=-1)
    first = out.logprobs[0]
    chosen = out.token_ids[0]
    assert first.token_ids[0] == chosen
    assert first.logprobs[0] == pytest.approx(raw[0, chosen].item())
    assert first.ranks[0] == int((raw[0] > raw[0, chosen]).sum()) + 1
    top = raw[0].topk(3)
    assert first.token_ids[1:] == top.indices.tolist() and first.ranks[1:] == [1, 2, 3]
    assert first.logprobs[1:] == pytest.approx(top.values.tolist())
    second = out.logprobs[1]  # logprobs=0: only the chosen token
    assert second.token_ids == [int(logits[1].argmax())] and second.ranks == [1]


def test_logprobs_none_where_not_asked_and_full_vocab_for_minus_one():
    logits = random_logits(2, 13)
    out = sampler()(logits, [FakeSeq([1], temperature=0.0), FakeSeq([1], temperature=0.0, logprobs=-1)])
    assert out.logprobs[0] is None
    full = out.logprobs[1]
    assert len(full.token_ids) == V + 1 and sorted(full.token_ids[1:]) == list(range(V))
    assert sampler()(logits, [FakeSeq([1])]).logprobs is None


def test_prompt_logprobs_score_each_next_prompt_token():
    logits = random_logits(4, 14)
    targets = [5, 9, 9, 60]
    rows = prompt_logprobs(logits, targets, 2)
    raw = logits.log_softmax(dim=-1)
    for i, row in enumerate(rows):
        assert row.token_ids[0] == targets[i]
        assert row.logprobs[0] == pytest.approx(raw[i, targets[i]].item())
        assert row.token_ids[1:] == raw[i].topk(2).indices.tolist()
    everything = prompt_logprobs(logits, targets, -1)
    assert all(len(r.token_ids) == V + 1 for r in everything)


def test_gather_logprobs_counts_per_row():
    lp = random_logits(3, 15).log_softmax(dim=-1)
    rows = gather_logprobs(lp, torch.tensor([1, 2, 3]), [None, 0, 5])
    assert rows[0] is None and len(rows[1].token_ids) == 1 and len(rows[2].token_ids) == 6
