"""Token sampling for one engine step, batched: vLLM's logits processors, then greedy or
temperature / min-p / top-k / top-p sampling, and logprobs of the raw model distribution.

Order, as in vLLM: a structured-output row's grammar bitmask (core/grammar.py) ->
allowed_token_ids -> bad_words and min_tokens bans -> logit_bias -> the batch processors that
may change the argmax -> penalties (repetition over prompt + output, frequency and presence
over the output) -> greedy argmax, or temperature -> the argmax-invariant batch processors ->
min_p -> top-k / top-p -> sample. Batch processors (``batch_processors``: vLLM's custom
logits processors, adapted by the vLLM layer) are told each step's rows (``update_batch``),
then ``apply`` to the whole batch's logits; one that raises fails the step before its commit. Every step works on the
whole batch at once (rows that need nothing are not touched), never looping over the
vocabulary in Python. A greedy row nothing modifies is the argmax of the raw logits.

Sampling uses the exponential-race trick (argmax of p / E with E ~ Exp(1)), which draws
exactly from p. A request with a seed draws its noise from a generator seeded with
(seed, number of tokens it has generated), so its samples depend neither on the rest of
the batch nor on a step that failed and was retried, nor on preemption.

Logprobs (the chosen token first, then the top ``logprobs``, each with its rank) follow
vLLM's ``logprobs_mode``: "raw_logprobs" (the default) and "raw_logits" are of the model's
output; "processed_logprobs" and "processed_logits" of what sampling drew from -- after the
logits processors, penalties, temperature (1 for greedy rows), min_p, top-k and top-p, so a
token those filters removed has -inf (what RL trainers use for importance weights).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from core.grammar import apply_grammars
from core.sampling_params import SamplingParams

UINT64_MASK = (1 << 64) - 1


def noise_seed(seed: int, position: int) -> int:
    """A generator seed for one sampled position of a seeded request (any 64-bit seed)."""
    return xxhash.xxh3_64_intdigest(struct.pack("<Qq", seed & UINT64_MASK, position)) >> 1


@dataclass
class TokenLogprobs:
    """One position's logprobs: the chosen token first, then the top-k, with vocab ranks."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # None when no row asked for logprobs


class Sampler:
    """Samples one token per row. ``eos_token_ids``: the engine's EOS ids, banned (with each
    request's own ``stop_token_ids``) while a request is below its ``min_tokens``."""

    def __init__(self, device: torch.device, seed: int | None, eos_token_ids=(),
                 logprobs_mode: str = "raw_logprobs", batch_processors=()) -> None:
        self.device = device
        self.batch_processors = list(batch_processors)
        self.logprobs_mode = logprobs_mode
        self.eos_token_ids = tuple(eos_token_ids)
        self.request_generator = torch.Generator(device=device)
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, seqs) -> SamplerOutput:
        """logits: float32 [B, V], one row per sequence (anything with ``sampling_params``,
        ``tokens``, ``num_prompt_tokens``, ``num_tokens``, ``num_output_tokens``)."""
        params = [s.sampling_params for s in seqs]
        if any(getattr(s, "grammar", None) is not None for s in seqs):  # structured outputs:
            logits = apply_grammars(logits, seqs)  # before everything else, as in vLLM
        for processor in self.batch_processors:
            processor.update_batch(seqs)
        processed = self._apply_logits_processors(logits, seqs)
        greedy = processed.argmax(dim=-1)
        scaled = None
        if all(p.greedy for p in params):
            tokens = greedy
        else:
            scaled = self._scaled(processed, params, with_processors=True)
            tokens = torch.where(self._tensor([p.greedy for p in params], torch.bool),
                                 greedy, self._sample(scaled, seqs))
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(logits, processed, scaled, seqs, token_list))

    def _custom(self, argmax_invariant: bool) -> list:
        return [p for p in self.batch_processors if p.is_argmax_invariant() == argmax_invariant]

    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    # ------------------------------------------------------------------ logits processors

    def _apply_logits_processors(self, logits: torch.Tensor, seqs) -> torch.Tensor:
        """A modified copy of ``logits`` (or ``logits`` itself when no row needs anything)."""
        params = [s.sampling_params for s in seqs]
        bans, custom = self._bans(seqs), self._custom(argmax_invariant=False)
        if not (bans or custom or any(p.allowed_token_ids or p.logit_bias or p.uses_penalties
                                      for p in params)):
            return logits
        out = self._keep_allowed(logits.clone(), params)
        if bans:
            rows, cols = zip(*bans)
            out[self._tensor(rows, torch.long), self._tensor(cols, torch.long)] = float("-inf")
        out = self._add_logit_bias(out, params)
        for processor in custom:  # vLLM's custom processors that may change the argmax
            out = processor.apply(out)
        out = self._apply_penalties(out, seqs)
        # A row with every token banned (e.g. allowed ids all masked by min_tokens) would
        # sample garbage from NaNs: it falls back to the raw logits.
        dead = ~torch.isfinite(out).any(dim=-1, keepdim=True)
        return torch.where(dead, logits, out)

    def _keep_allowed(self, logits: torch.Tensor, params) -> torch.Tensor:
        rows = [r for r, p in enumerate(params) if p.allowed_token_ids]
        if not rows:
            return logits
        keep = torch.ones_like(logits, dtype=torch.bool)
        keep[self._tensor(rows, torch.long)] = False
        row_idx = [r for r in rows for _ in params[r].allowed_token_ids]
        col_idx = [t for r in rows for t in params[r].allowed_token_ids]
        keep[self._tensor(row_idx, torch.long), self._tensor(col_idx, torch.long)] = True
        return logits.masked_fill(~keep, float("-inf"))

    def _bans(self, seqs) -> list[tuple[int, int]]:
        """(row, token) pairs to mask: the last token of each bad word whose other tokens end
        the output so far, and stop tokens while a request is below ``min_tokens``."""
        bans = []
        for row, seq in enumerate(seqs):
            p: SamplingParams = seq.sampling_params
            if p.bad_words_token_ids:
                output = seq.tokens[seq.num_prompt_tokens:seq.num_tokens]
                bans += [(row, word[-1]) for word in p.bad_words_token_ids
                         if _ends_with(output, word[:-1])]
            if seq.num_output_tokens < p.min_tokens:
                bans += [(row, t) for t in dict.fromkeys((*self.eos_token_ids, *p.stop_token_ids))]
        return bans

    def _add_logit_bias(self, logits: torch.Tensor, params) -> torch.Tensor:
        entries = [(r, t, b) for r, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        if not entries:
            return logits
        rows, cols, values = zip(*entries)
        index = (self._tensor(rows, torch.long), self._tensor(cols, torch.long))
        return logits.index_put_(index, self._tensor(values, logits.dtype), accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, seqs) -> torch.Tensor:
        rows = [r for r, s in enumerate(seqs) if s.sampling_params.uses_penalties]
        if not rows:
            return logits
        chosen = [seqs[r] for r in rows]
        seen, output_counts = self._token_counts(chosen, logits.shape[-1])
        params = [s.sampling_params for s in chosen]
        rep = self._tensor([p.repetition_penalty for p in params], logits.dtype)[:, None]
        freq = self._tensor([p.frequency_penalty for p in params], logits.dtype)[:, None]
        presence = self._tensor([p.presence_penalty for p in params], logits.dtype)[:, None]
        index = self._tensor(rows, torch.long)
        sub = logits[index]
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        sub = sub - freq * output_counts - presence * (output_counts > 0)
        logits[index] = sub
        return logits

    def _token_counts(self, seqs, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: which tokens occur in prompt + output (bool [R, V]), and how often each
        occurs in the output (float [R, V]); rows padded with id ``vocab``, dropped after."""
        width = max(s.num_tokens for s in seqs)
        ids = np.full((len(seqs), width), vocab, dtype=np.int64)
        is_output = np.zeros((len(seqs), width), dtype=bool)
        for row, seq in enumerate(seqs):
            ids[row, :seq.num_tokens] = seq.tokens[:seq.num_tokens]
            is_output[row, seq.num_prompt_tokens:seq.num_tokens] = True
        ids_t = torch.from_numpy(ids).to(self.device)
        output_ids = ids_t.masked_fill(~torch.from_numpy(is_output).to(self.device), vocab)
        ones = torch.ones(ids_t.shape, dtype=torch.float32, device=self.device)
        seen = torch.zeros(len(seqs), vocab + 1, device=self.device).scatter_(1, ids_t, ones)
        counts = torch.zeros(len(seqs), vocab + 1, device=self.device).scatter_add_(
            1, output_ids, ones)
        return seen[:, :vocab] > 0, counts[:, :vocab]

    # ------------------------------------------------------------------ random sampling

    def _scaled(self, logits: torch.Tensor, params, with_processors: bool) -> torch.Tensor:
        """Temperature (1 for greedy rows), then the custom processors that keep the argmax
        (vLLM applies those on the random path only), then min_p."""
        temperature = self._tensor([p.temperature if not p.greedy else 1.0 for p in params],
                                   torch.float32)
        scaled = logits / temperature[:, None]
        for processor in self._custom(argmax_invariant=True) if with_processors else ():
            scaled = processor.apply(scaled)
        return self._apply_min_p(scaled, params)

    def _sample(self, scaled: torch.Tensor, seqs) -> torch.Tensor:
        """Draw from ``scaled`` (``_scaled``'s): top-k / top-p, then the exponential race."""
        params = [s.sampling_params for s in seqs]
        probs = self._filtered_probs(scaled, params)
        return (probs / self._exponential_noise(seqs, probs.shape[-1])).argmax(dim=-1)

    def _apply_min_p(self, logits: torch.Tensor, params) -> torch.Tensor:
        """Drop tokens less likely than ``min_p`` times the most likely one."""
        if all(p.min_p == 0.0 for p in params):
            return logits
        probs = logits.softmax(dim=-1)
        min_p = self._tensor([p.min_p for p in params], torch.float32)[:, None]
        too_unlikely = probs < min_p * probs.amax(dim=-1, keepdim=True)
        return logits.masked_fill(too_unlikely, float("-inf"))

    def _filtered_probs(self, logits: torch.Tensor, params) -> torch.Tensor:
        """Softmax after top-k and top-p, both applied on one descending sort."""
        vocab = logits.shape[-1]
        if all(p.top_k_or_none is None and p.top_p == 1.0 for p in params):
            return logits.softmax(dim=-1)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        top_k = self._tensor([min(p.top_k_or_none or vocab, vocab) for p in params], torch.int64)
        rank = torch.arange(vocab, device=self.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        top_p = self._tensor([p.top_p for p in params], torch.float32)
        # Keep a token while the mass before it is below top_p (the top token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
        return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)

    def _exponential_noise(self, seqs, vocab: int) -> torch.Tensor:
        noise = torch.empty(len(seqs), vocab, device=self.device)
        noise.exponential_(generator=self.generator)
        for row, seq in enumerate(seqs):
            seed = seq.sampling_params.seed
            if seed is not None and not seq.sampling_params.greedy:
                self.request_generator.manual_seed(noise_seed(seed, seq.num_output_tokens))
                noise[row].exponential_(generator=self.request_generator)
        return noise

    # ------------------------------------------------------------------ logprobs

    def _logprobs(self, logits: torch.Tensor, processed: torch.Tensor, scaled, seqs,
                  tokens: list[int]):
        """Per row: TokenLogprobs per ``logprobs_mode``, or None where not requested."""
        wanted = [s.sampling_params.logprobs for s in seqs]
        if all(n is None for n in wanted):
            return None
        counts = [None if n is None else (logits.shape[-1] if n == -1 else n) for n in wanted]
        return gather_logprobs(self._logprob_source(logits, processed, scaled, seqs),
                               self._tensor(tokens, torch.long), counts)

    def _logprob_source(self, logits: torch.Tensor, processed: torch.Tensor, scaled,
                        seqs) -> torch.Tensor:
        """The [B, V] values logprobs report, per ``logprobs_mode``."""
        if self.logprobs_mode == "raw_logits":
            return logits
        if self.logprobs_mode == "raw_logprobs":
            return logits.log_softmax(dim=-1)
        final = self._sampling_logits(processed, scaled, [s.sampling_params for s in seqs])
        return final if self.logprobs_mode == "processed_logits" else final.log_softmax(dim=-1)

    def _sampling_logits(self, logits: torch.Tensor, scaled, params) -> torch.Tensor:
        """The logits sampling draws from: ``scaled`` (temperature, 1 for greedy rows, and
        min_p; computed here when the step drew nothing at random), then top-k and top-p as
        -inf masks (greedy rows have them off)."""
        if scaled is None:
            scaled = self._scaled(logits, params, with_processors=False)
        if all(p.top_k_or_none is None and p.top_p == 1.0 for p in params):
            return scaled
        return scaled.masked_fill(self._filtered_probs(scaled, params) == 0, float("-inf"))


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor,
                    counts: list[int | None]) -> list[TokenLogprobs | None]:
    """For each row of ``logprobs`` [R, V]: the chosen token's logprob and rank, then the
    top ``counts[row]`` (ranks 1..k). One topk and one comparison for the whole batch."""
    k = max((c for c in counts if c is not None), default=0)
    chosen_lp = logprobs.gather(1, chosen[:, None])
    chosen_rank = ((logprobs > chosen_lp).sum(dim=-1) + 1).tolist()
    chosen_ids, chosen_lp = chosen.tolist(), chosen_lp[:, 0].tolist()
    top_ids = top_values = None
    if k:
        top = logprobs.topk(k, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    rows: list[TokenLogprobs | None] = []
    for row, n in enumerate(counts):
        if n is None:
            rows.append(None)
            continue
        ids = [chosen_ids[row]] + (top_ids[row][:n] if n else [])
        values = [chosen_lp[row]] + (top_values[row][:n] if n else [])
        rows.append(TokenLogprobs(ids, values, [chosen_rank[row]] + list(range(1, n + 1))))
    return rows


def prompt_logprobs(logits: torch.Tensor, next_token_ids, num: int) -> list[TokenLogprobs]:
    """Logprobs of prompt tokens 1..P-1: ``logits`` [P-1, V] are the model's outputs at
    positions 0..P-2, ``next_token_ids`` the prompt tokens they predict; ``num`` = -1: all."""
    chosen = torch.as_tensor(np.asarray(next_token_ids, dtype=np.int64), device=logits.device)
    count = logits.shape[-1] if num == -1 else num
    return gather_logprobs(logits.float().log_softmax(dim=-1), chosen, [count] * len(chosen))


def _ends_with(tokens: np.ndarray, prefix: list[int]) -> bool:
    if not prefix:
        return True
    return len(tokens) >= len(prefix) and tokens[-len(prefix):].tolist() == prefix
